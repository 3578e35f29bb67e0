"""Energy Performance Bias and Preference (``[epb]``).

EPB (0 = performance … 15 = power saving) tells the CPU's power management how eagerly to
raise frequency and how deep to let idle go; EPP does the same for hardware P-states (HWP).
Decode is memory-bound but stalls on every token boundary where sampling runs on one core: a
performance-leaning bias keeps the uncore and core clocks up through those gaps.

Knobs: ``cpuN/power/energy_perf_bias`` (falls back to MSR 0x1B0 bits 3:0,
IA32_ENERGY_PERF_BIAS, when the CPU has the ``epb`` flag and the msr device exists) and
``cpuN/cpufreq/energy_performance_preference``. Applied to every online CPU.

Example::

    [epb]
    epb = balance-performance
    epp = balance_performance
"""

from __future__ import annotations

from typing import Any

from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.knobs import FileKnob, Knob, MsrKnob
from dsr1d.contract.schema import choice, either, integer, option
from dsr1d.contract.sysroot import CPU_DIR, SysRoot
from dsr1d.contract.tunable import Action, Setting, Skip, Support, summarize_per_cpu

IA32_ENERGY_PERF_BIAS = 0x1B0
# The kernel's names for EPB values (arch/x86/kernel/cpu/intel_epb.c).
EPB_NAMES = {"performance": 0, "balance-performance": 4, "normal": 6, "balance-power": 8, "power": 15}
EPP_NAMES = ("default", "performance", "balance_performance", "balance_power", "power")


def _epb_value(raw: str) -> int:
    return either(choice(*EPB_NAMES), integer(0, 15), f"0..15 or one of {', '.join(EPB_NAMES)}")(raw)


def _epb_path(cpu: int) -> str:
    return f"{CPU_DIR}/cpu{cpu}/power/energy_perf_bias"


def _epp_path(cpu: int) -> str:
    return f"{CPU_DIR}/cpu{cpu}/cpufreq/energy_performance_preference"


def _epp_available(cpu: int) -> str:
    return f"{CPU_DIR}/cpu{cpu}/cpufreq/energy_performance_available_preferences"


class Epb:
    name = "epb"
    summary = "energy/performance bias (EPB) and preference (EPP) of every CPU"
    per_cpu = True
    options = {
        "epb": option(
            _epb_value,
            "energy-performance bias: 0 (performance) .. 15 (power), or a kernel name: "
            + ", ".join(f"{n}={v}" for n, v in EPB_NAMES.items()),
            "0..15|name",
        ),
        "epp": option(
            either(choice(*EPP_NAMES), integer(0, 255), f"0..255 or one of {', '.join(EPP_NAMES)}"),
            "energy-performance preference for hardware P-states (intel_pstate/amd-pstate)",
            "0..255|name",
        ),
    }

    def _epb_knob(self, root: SysRoot, cpu: int) -> Knob | None:
        if root.exists(_epb_path(cpu)):
            return FileKnob(_epb_path(cpu))
        if "epb" in root.cpu_flags() and root.msr_available(cpu):
            return MsrKnob(cpu, IA32_ENERGY_PERF_BIAS, 0xF)
        return None

    def probe(self, root: SysRoot) -> Support:
        cpus = root.online_cpus()
        epb = [c for c in cpus if self._epb_knob(root, c) is not None]
        epp = [c for c in cpus if root.exists(_epp_path(c))]
        if not epb and not epp:
            return Support(False, _why_not(root))
        parts = []
        if epb:
            via = "sysfs" if root.exists(_epb_path(epb[0])) else "MSR 0x1B0"
            parts.append(f"EPB via {via} on {len(epb)}/{len(cpus)} CPUs")
        if epp:
            parts.append(f"EPP on {len(epp)}/{len(cpus)} CPUs")
        return Support(True, "; ".join(parts))

    def read(self, root: SysRoot) -> dict[str, str]:
        epb: dict[int, str] = {}
        epp: dict[int, str] = {}
        for cpu in root.online_cpus():
            knob = self._epb_knob(root, cpu)
            if knob is not None:
                epb[cpu] = knob.read(root)
            if root.exists(_epp_path(cpu)):
                epp[cpu] = root.read(_epp_path(cpu))
        return {"epb": summarize_per_cpu(epb), "epp": summarize_per_cpu(epp)}

    def apply(
        self, root: SysRoot, options: dict[str, Any], cpus: list[int] | None = None
    ) -> list[Action]:
        actions: list[Action] = []
        targets = root.online_cpus() if cpus is None else cpus
        if "epb" in options:
            actions += self._apply_epb(root, options["epb"], targets)
        if "epp" in options:
            actions += self._apply_epp(root, str(options["epp"]), targets)
        return actions

    def _apply_epb(self, root: SysRoot, value: Any, cpus: list[int]) -> list[Action]:
        number = str(EPB_NAMES.get(value, value))
        actions: list[Action] = []
        missing = []
        for cpu in cpus:
            knob = self._epb_knob(root, cpu)
            if knob is None:
                missing.append(cpu)
            else:
                actions.append(Setting(self.name, knob, number))
        if missing:
            actions.append(Skip(self.name, "epb", f"no EPB on CPUs {missing}: {_why_not(root)}"))
        return actions

    def _apply_epp(self, root: SysRoot, value: str, cpus: list[int]) -> list[Action]:
        actions: list[Action] = []
        missing = []
        for cpu in cpus:
            if not root.exists(_epp_path(cpu)):
                missing.append(cpu)
                continue
            if not value.isdigit() and root.exists(_epp_available(cpu)):
                offered = root.read_fixed(_epp_available(cpu)).split()
                if value not in offered:
                    actions.append(Skip(self.name, "epp", f"cpu{cpu} offers only {offered}"))
                    continue
            actions.append(Setting(self.name, FileKnob(_epp_path(cpu)), value))
        if missing:
            actions.append(Skip(self.name, "epp", f"no cpufreq energy_performance_preference "
                                f"on CPUs {missing} (no HWP driver, or cpufreq absent)"))
        return actions


def _why_not(root: SysRoot) -> str:
    reasons = [f"no {root.display(_epb_path(0))}"]
    if "epb" not in root.cpu_flags():
        reasons.append("the CPU does not report the 'epb' flag")
    elif not root.msr_available(0):
        reasons.append(f"no {root.display(root.msr_path(0))} (msr module not loaded)")
    reasons.append("no cpufreq energy_performance_preference")
    return "; ".join(reasons)


@hookimpl
def register_tunables(register: Any) -> None:
    register(Epb())
