"""RAPL package power limit (``[rapl]``), the mitigation ladder's first rung.

Capping PL1 (the long-term limit) at the power the package can sustain keeps it just under its
thermal limit instead of letting it hit PROCHOT and saw between turbo and the floor. The knob is
``/sys/class/powercap/intel-rapl:N/constraint_0_power_limit_uw`` (constraint 0 is
``long_term``) of every package zone; writing it needs root. One value caps every package; a
list caps each package in zone order (``intel-rapl:0``, ``intel-rapl:1``…): two sockets draw
differently, and a cap from their summed power would starve one and spare the other.

Example::

    [rapl]
    pl1_w = 180
    # or per package: pl1_w = 180 150
"""

from __future__ import annotations

from typing import Any

from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.knobs import FileKnob
from dsr1d.contract.schema import integer, option
from dsr1d.contract.sysroot import SysRoot
from dsr1d.contract.tunable import Action, Setting, Skip, Support

POWERCAP = "sys/class/powercap"


def _watts(raw: str) -> int | list[int]:
    """One limit in watts, or one per package (space or comma separated)."""
    words = [w for w in raw.replace(",", " ").split() if w]
    values = [integer(1, 2000)(w) for w in words]
    if not values:
        raise ValueError("expected watts")
    return values[0] if len(values) == 1 else values


def _packages(root: SysRoot) -> list[str]:
    """Package zones (``intel-rapl:0``, not sub-zones like ``intel-rapl:0:0``) with a PL1."""
    zones = []
    for zone in root.glob(f"{POWERCAP}/intel-rapl:*"):
        if zone.count(":") == 1 and root.exists(f"{zone}/constraint_0_power_limit_uw"):
            zones.append(zone)
    return zones


class PowerLimit:
    name = "rapl"
    summary = "RAPL package power limit PL1 (long term): hold power the package can sustain"
    per_cpu = False
    options = {
        "pl1_w": option(_watts, "long-term package power limit in watts; a list: one per "
                        "package, in zone order", "W|W W…"),
    }

    def probe(self, root: SysRoot) -> Support:
        zones = _packages(root)
        if not zones:
            return Support(False, f"no {root.display(POWERCAP)}/intel-rapl:N/"
                           "constraint_0_power_limit_uw (no RAPL powercap driver)")
        return Support(True, f"PL1 on {len(zones)} package(s)")

    def read(self, root: SysRoot) -> dict[str, str]:
        values = [int(root.read(f"{z}/constraint_0_power_limit_uw")) / 1e6 for z in _packages(root)]
        return {"pl1_w": " ".join(f"{v:g}" for v in values) or "-"}

    def apply(self, root: SysRoot, options: dict[str, Any],
              cpus: list[int] | None = None) -> list[Action]:
        if cpus is not None or "pl1_w" not in options:
            return []
        zones = _packages(root)
        if not zones:
            return [Skip(self.name, "pl1_w", self.probe(root).detail)]
        wanted = options["pl1_w"]
        watts = wanted if isinstance(wanted, list) else [wanted] * len(zones)
        if len(watts) != len(zones):
            return [Skip(self.name, "pl1_w", f"{len(watts)} limits for {len(zones)} package(s)")]
        return [Setting(self.name, FileKnob(f"{z}/constraint_0_power_limit_uw"),
                        str(int(w) * 1_000_000)) for z, w in zip(zones, watts)]


@hookimpl
def register_tunables(register: Any) -> None:
    register(PowerLimit())
