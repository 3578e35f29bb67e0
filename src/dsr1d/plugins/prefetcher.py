"""Hardware prefetchers (``[prefetcher]``), Intel MSR 0x1A4.

Decode streams weights sequentially: the L2 streamer and adjacent-line prefetchers are what keep
memory bandwidth near its peak, so the throughput profiles keep them on. Some latency-bound
mixed workloads gain from turning the adjacent-line prefetcher off; the knob exists to measure
that, per machine.

MSR 0x1A4 (MSR_MISC_FEATURE_CONTROL, Intel SDM vol. 4): a set bit *disables* a prefetcher —
bit 0 L2 hardware (streamer), bit 1 L2 adjacent cache line, bit 2 DCU (L1 streamer), bit 3 DCU
IP. Applied to every online CPU through ``/dev/cpu/N/msr``.

AMD parts control prefetchers through other, family-specific MSRs that have not been verified
against AMD's manuals for this project, so they are reported unsupported rather than guessed.

Example::

    [prefetcher]
    l2_streamer = on
    l2_adjacent = on
    dcu_streamer = on
    dcu_ip = on
"""

from __future__ import annotations

from typing import Any

from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.knobs import MsrKnob
from dsr1d.contract.schema import boolean, option
from dsr1d.contract.sysroot import SysRoot
from dsr1d.contract.tunable import Action, Setting, Skip, Support, summarize_per_cpu

MSR_MISC_FEATURE_CONTROL = 0x1A4
# option -> disable bit in MSR 0x1A4
BITS = {"l2_streamer": 0, "l2_adjacent": 1, "dcu_streamer": 2, "dcu_ip": 3}


class Prefetcher:
    name = "prefetcher"
    summary = "hardware prefetchers (Intel MSR 0x1A4): keep weight streaming at full bandwidth"
    per_cpu = True
    options = {
        "l2_streamer": option(boolean, "L2 hardware prefetcher (streamer), bit 0", "on|off"),
        "l2_adjacent": option(boolean, "L2 adjacent cache line prefetcher, bit 1", "on|off"),
        "dcu_streamer": option(boolean, "L1 data cache (DCU) streamer, bit 2", "on|off"),
        "dcu_ip": option(boolean, "L1 data cache IP-stride prefetcher, bit 3", "on|off"),
    }

    def probe(self, root: SysRoot) -> Support:
        vendor = root.cpu_vendor() or "unknown"
        if vendor != "GenuineIntel":
            return Support(False, f"{vendor} CPU: only Intel's MSR 0x1A4 is supported; other "
                           "vendors' prefetch controls are not verified")
        if not root.msr_available(0):
            return Support(False, f"no {root.display(root.msr_path(0))} "
                           "(load the msr module: modprobe msr)")
        try:
            root.read_msr(0, MSR_MISC_FEATURE_CONTROL)
        except OSError as exc:
            return Support(False, f"MSR 0x1A4 unreadable: {exc.strerror} "
                           "(not implemented on this model, or a hypervisor hides it)")
        return Support(True, "Intel MSR 0x1A4 on every online CPU")

    def read(self, root: SysRoot) -> dict[str, str]:
        if not self.probe(root).supported:
            return {}
        current: dict[str, str] = {}
        for option_name, bit in BITS.items():
            per_cpu = {cpu: "off" if MsrKnob(cpu, MSR_MISC_FEATURE_CONTROL, 1 << bit).read(root) == "1"
                       else "on" for cpu in root.online_cpus() if root.msr_available(cpu)}
            current[option_name] = summarize_per_cpu(per_cpu)
        return current

    def apply(
        self, root: SysRoot, options: dict[str, Any], cpus: list[int] | None = None
    ) -> list[Action]:
        support = self.probe(root)
        if not support.supported:
            return [Skip(self.name, name, support.detail) for name in options]
        actions: list[Action] = []
        for cpu in root.online_cpus() if cpus is None else cpus:
            for option_name, enabled in options.items():
                knob = MsrKnob(cpu, MSR_MISC_FEATURE_CONTROL, 1 << BITS[option_name])
                actions.append(Setting(self.name, knob, "0" if enabled else "1"))
        return actions


@hookimpl
def register_tunables(register: Any) -> None:
    register(Prefetcher())
