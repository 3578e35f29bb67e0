"""A third-party plugin for tests: ``[swappy] swappiness = N`` sets ``/proc/sys/vm/swappiness``.

Loaded with ``DSR1D_PLUGINS=extra_tunable`` (the tests directory is on ``PYTHONPATH``); it
uses only the public plugin contract, as a package from another project would.
"""

from __future__ import annotations

from typing import Any

from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.knobs import FileKnob
from dsr1d.contract.schema import integer, option
from dsr1d.contract.sysroot import SysRoot
from dsr1d.contract.tunable import Action, Setting, Support

SWAPPINESS = "proc/sys/vm/swappiness"


class Swappy:
    name = "swappy"
    summary = "how eagerly the kernel swaps (vm.swappiness)"
    per_cpu = False
    options = {
        "swappiness": option(integer(0, 200), "vm.swappiness: 0 (avoid swap) .. 200", "0..200"),
    }

    def probe(self, root: SysRoot) -> Support:
        if not root.exists(SWAPPINESS):
            return Support(False, f"no {root.display(SWAPPINESS)}")
        return Support(True, root.display(SWAPPINESS))

    def read(self, root: SysRoot) -> dict[str, str]:
        return {"swappiness": root.read(SWAPPINESS)}

    def apply(self, root: SysRoot, options: dict[str, Any],
              cpus: list[int] | None = None) -> list[Action]:
        if "swappiness" not in options:
            return []
        return [Setting(self.name, FileKnob(SWAPPINESS), str(options["swappiness"]))]


@hookimpl
def register_tunables(register: Any) -> None:
    register(Swappy())
