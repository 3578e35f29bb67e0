"""What a tunable plugin provides, and what its ``apply`` returns.

A tunable reads and plans; it never records or restores anything itself. Its ``apply`` returns
the settings it wants (knob, value) and the options it had to skip on this machine; the tuning
core reads the originals, journals them, writes, and restores them later.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, Union

from dsr1d.contract.knobs import Knob
from dsr1d.contract.schema import Schema
from dsr1d.contract.sysroot import SysRoot


@dataclass(frozen=True)
class Support:
    """Whether a tunable works on this machine, and why (not)."""

    supported: bool
    detail: str


@dataclass(frozen=True)
class Setting:
    """One knob set to one value by one tunable."""

    tunable: str
    knob: Knob
    value: str


@dataclass(frozen=True)
class Skip:
    """An option of the profile that cannot be applied here, and why."""

    tunable: str
    option: str
    reason: str


Action = Union[Setting, Skip]


class Tunable(Protocol):
    """The contract of a tunable plugin (see DESIGN.md, "The plugin contract")."""

    name: str
    """Equals the profile section it reads (``[thp]`` ↔ ``thp``)."""
    summary: str
    """One line for ``dsr1d probe`` and the documentation."""
    options: Schema
    """Every key the section may hold: typed and described."""
    per_cpu: bool
    """Whether some of its knobs exist per CPU (re-applied when a CPU comes online)."""

    def probe(self, root: SysRoot) -> Support:
        """Supported on this machine or not, and exactly why not."""
        ...

    def read(self, root: SysRoot) -> dict[str, str]:
        """The current value of every knob it may write, by option name."""
        ...

    def apply(
        self, root: SysRoot, options: dict[str, Any], cpus: list[int] | None = None
    ) -> list[Action]:
        """The settings that realise ``options`` (on ``cpus`` only, when given)."""
        ...


@dataclass
class TunableInfo:
    """A probed tunable, for tables and the D-Bus ``Tunables`` property."""

    name: str
    summary: str
    support: Support
    current: dict[str, str] = field(default_factory=dict)


def summarize_per_cpu(values: dict[int, str]) -> str:
    """``6`` when every CPU agrees, else ``cpu0=6 cpu1=4``; ``-`` when there are none."""
    if not values:
        return "-"
    distinct = set(values.values())
    if len(distinct) == 1:
        return distinct.pop()
    return " ".join(f"cpu{cpu}={value}" for cpu, value in sorted(values.items()))
