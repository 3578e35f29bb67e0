"""Turbo (``[turbo]``): frequencies above base, on or off.

Off is the mitigation ladder's second rung: decode is memory-bound, so the top turbo bins buy
little speed for much heat. Knobs: ``intel_pstate/no_turbo`` (1 = off) where intel_pstate runs,
else ``cpufreq/boost`` (acpi-cpufreq, amd-pstate; 1 = on).

Example::

    [turbo]
    enabled = no
"""

from __future__ import annotations

from typing import Any

from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.knobs import FileKnob
from dsr1d.contract.schema import boolean, option
from dsr1d.contract.sysroot import CPU_DIR, SysRoot
from dsr1d.contract.tunable import Action, Setting, Skip, Support

NO_TURBO = f"{CPU_DIR}/intel_pstate/no_turbo"
BOOST = f"{CPU_DIR}/cpufreq/boost"


class Turbo:
    name = "turbo"
    summary = "turbo frequencies on or off (intel_pstate/no_turbo or cpufreq/boost)"
    per_cpu = False
    options = {"enabled": option(boolean, "allow frequencies above base", "bool")}

    def probe(self, root: SysRoot) -> Support:
        if root.exists(NO_TURBO):
            return Support(True, f"{root.display(NO_TURBO)}")
        if root.exists(BOOST):
            return Support(True, f"{root.display(BOOST)}")
        return Support(False, f"neither {root.display(NO_TURBO)} nor {root.display(BOOST)} "
                       "(no intel_pstate, and the cpufreq driver has no boost switch)")

    def read(self, root: SysRoot) -> dict[str, str]:
        if root.exists(NO_TURBO):
            return {"enabled": "no" if root.read(NO_TURBO) == "1" else "yes"}
        if root.exists(BOOST):
            return {"enabled": "yes" if root.read(BOOST) == "1" else "no"}
        return {}

    def apply(self, root: SysRoot, options: dict[str, Any],
              cpus: list[int] | None = None) -> list[Action]:
        if cpus is not None or "enabled" not in options:
            return []
        on = bool(options["enabled"])
        if root.exists(NO_TURBO):
            return [Setting(self.name, FileKnob(NO_TURBO), "0" if on else "1")]
        if root.exists(BOOST):
            return [Setting(self.name, FileKnob(BOOST), "1" if on else "0")]
        return [Skip(self.name, "enabled", self.probe(root).detail)]


@hookimpl
def register_tunables(register: Any) -> None:
    register(Turbo())
