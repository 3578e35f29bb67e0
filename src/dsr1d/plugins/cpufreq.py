"""Frequency ceiling (``[cpufreq]``): the highest clock each CPU may run at.

The tokens-per-joule controller's main actuator: decode is memory-bound above a knee, so a
ceiling there keeps tokens/s and sheds the power the top bins cost. Knob:
``cpuN/cpufreq/scaling_max_freq`` (kHz, every cpufreq driver: intel_pstate, amd-pstate,
acpi-cpufreq), clamped to the CPU's ``cpuinfo_min_freq``..``cpuinfo_max_freq``; ``max`` puts
the hardware's top back. Applied to every online CPU. Under amd-pstate (and intel_pstate with
HWP) the driver turns the ceiling into the CPPC/HWP ``max_perf`` it programs; ``acpi_cppc/`` in
sysfs is read-only, so ``scaling_max_freq`` is the interface there too.

Example::

    [cpufreq]
    max_mhz = 2800
"""

from __future__ import annotations

from typing import Any

from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.knobs import FileKnob
from dsr1d.contract.schema import choice, either, integer, option
from dsr1d.contract.sysroot import CPU_DIR, SysRoot
from dsr1d.contract.tunable import Action, Setting, Skip, Support, summarize_per_cpu


def _path(cpu: int, leaf: str) -> str:
    return f"{CPU_DIR}/cpu{cpu}/cpufreq/{leaf}"


class Cpufreq:
    name = "cpufreq"
    summary = "frequency ceiling of every CPU (cpufreq scaling_max_freq)"
    per_cpu = True
    options = {"max_mhz": option(either(choice("max"), integer(100, 20000), "100..20000 or max"),
                                 "the highest frequency a CPU may run at, in MHz (clamped to "
                                 "what the CPU offers); max = the hardware's top", "MHz|max")}

    def probe(self, root: SysRoot) -> Support:
        cpus = root.online_cpus()
        have = [c for c in cpus if root.exists(_path(c, "scaling_max_freq"))]
        if not have:
            return Support(False, f"no {root.display(_path(0, 'scaling_max_freq'))} (no cpufreq "
                           "driver: a VM without frequency control, or cpufreq disabled)")
        top = root.read_fixed(_path(have[0], "cpuinfo_max_freq")) \
            if root.exists(_path(have[0], "cpuinfo_max_freq")) else "?"
        return Support(True, f"scaling_max_freq on {len(have)}/{len(cpus)} CPUs, top {top} kHz")

    def read(self, root: SysRoot) -> dict[str, str]:
        values = {}
        for cpu in root.online_cpus():
            if root.exists(_path(cpu, "scaling_max_freq")):
                values[cpu] = str(int(root.read(_path(cpu, "scaling_max_freq"))) // 1000)
        return {"max_mhz": summarize_per_cpu(values)}

    def apply(self, root: SysRoot, options: dict[str, Any],
              cpus: list[int] | None = None) -> list[Action]:
        if "max_mhz" not in options:
            return []
        actions: list[Action] = []
        missing = []
        for cpu in root.online_cpus() if cpus is None else cpus:
            if not root.exists(_path(cpu, "scaling_max_freq")):
                missing.append(cpu)
                continue
            khz = self._khz(root, cpu, options["max_mhz"])
            if khz is None:
                actions.append(Skip(self.name, "max_mhz", f"cpu{cpu}: no cpuinfo_max_freq to "
                                    "know the top by"))
                continue
            actions.append(Setting(self.name, FileKnob(_path(cpu, "scaling_max_freq")), str(khz)))
        if missing:
            actions.append(Skip(self.name, "max_mhz", f"no scaling_max_freq on CPUs {missing}"))
        return actions

    def _khz(self, root: SysRoot, cpu: int, value: Any) -> int | None:
        def fixed(leaf: str) -> int | None:
            path = _path(cpu, leaf)
            return int(root.read_fixed(path)) if root.exists(path) else None
        top, bottom = fixed("cpuinfo_max_freq"), fixed("cpuinfo_min_freq")
        if top is None:
            return None
        if value == "max":
            return top
        return max(bottom or 0, min(top, int(value) * 1000))


@hookimpl
def register_tunables(register: Any) -> None:
    register(Cpufreq())
