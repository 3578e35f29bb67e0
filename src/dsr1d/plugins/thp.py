"""Transparent hugepages (``[thp]``).

Decode reads every weight once per token; with 4 KiB pages a 3 GB model spans ~750,000 pages
and the TLB misses on nearly every cache line it streams. Huge pages (2 MiB) cut that by 512×.
``enabled=madvise`` gives huge pages to regions that ask for them (the engine madvises its
weights) without bloating every other process; ``always`` gives them to everyone.

Example::

    [thp]
    enabled = madvise
    defrag = defer+madvise
    khugepaged_defrag = 1
"""

from __future__ import annotations

from typing import Any

from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.knobs import FileKnob, SelectKnob
from dsr1d.contract.schema import boolean, choice, option
from dsr1d.contract.sysroot import SysRoot
from dsr1d.contract.tunable import Action, Setting, Support

THP_DIR = "sys/kernel/mm/transparent_hugepage"
KNOBS = {
    "enabled": SelectKnob(f"{THP_DIR}/enabled"),
    "defrag": SelectKnob(f"{THP_DIR}/defrag"),
    "khugepaged_defrag": FileKnob(f"{THP_DIR}/khugepaged/defrag"),
}


class Thp:
    name = "thp"
    summary = "transparent hugepages: fewer TLB misses while weights stream"
    per_cpu = False
    options = {
        "enabled": option(
            choice("always", "madvise", "never"),
            "who gets huge pages: every anonymous mapping, only madvise()d ones, or none",
            "always|madvise|never",
        ),
        "defrag": option(
            choice("always", "defer", "defer+madvise", "madvise", "never"),
            "how hard a page fault works (compaction) to get a huge page",
            "always|defer|defer+madvise|madvise|never",
        ),
        "khugepaged_defrag": option(
            boolean, "let khugepaged compact memory to collapse pages into huge pages", "bool"
        ),
    }

    def probe(self, root: SysRoot) -> Support:
        if not root.exists(KNOBS["enabled"].path):
            return Support(False, f"{root.display(THP_DIR)} is missing "
                           "(kernel built without CONFIG_TRANSPARENT_HUGEPAGE)")
        return Support(True, f"{root.display(THP_DIR)}")

    def read(self, root: SysRoot) -> dict[str, str]:
        return {name: knob.read(root) for name, knob in KNOBS.items() if root.exists(knob.path)}

    def apply(
        self, root: SysRoot, options: dict[str, Any], cpus: list[int] | None = None
    ) -> list[Action]:
        actions: list[Action] = []
        for name, value in options.items():
            text = ("1" if value else "0") if isinstance(value, bool) else value
            actions.append(Setting(self.name, KNOBS[name], text))
        return actions


@hookimpl
def register_tunables(register: Any) -> None:
    register(Thp())
