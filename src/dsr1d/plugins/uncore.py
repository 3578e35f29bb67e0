"""Uncore frequency (``[uncore]``): the clock of the mesh, the last-level cache and the memory
controllers of each Intel package.

Decode streams every weight through the uncore once per token, so its clock bounds memory
bandwidth as much as the DRAM does; the firmware's own uncore scaling lowers it when cores look
idle (a layer barrier) and pays a ramp-up on the next layer. A floor (``min_mhz``) keeps it up;
a ceiling (``max_mhz``) sheds uncore power where decode is limited by the DRAM anyway.

Knobs: ``intel_uncore_frequency/package_XX_die_YY/{max,min}_freq_khz`` of every package and die,
clamped to that directory's ``initial_{min,max}_freq_khz`` (the firmware's range) and rounded
down to the hardware's 100 MHz step (the kernel drops the rest of a written value). Kernels with
TPMI also show ``uncoreNN/`` directories (one per power domain and fabric cluster, named by
their ``package_id``/``domain_id`` files); a write at package/die level reaches every one of
them, so those are used only where the kernel shows no package/die directory (multi-die TPMI
parts). ``max`` and ``min`` name the firmware's top and bottom.

Example::

    [uncore]
    max_mhz = 2000
    min_mhz = 1600
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsr1d.constants import UNCORE_LIMIT_MHZ, UNCORE_MAX_MHZ, UNCORE_MIN_MHZ
from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.knobs import FileKnob
from dsr1d.contract.schema import choice, either, integer, option
from dsr1d.contract.sysroot import CPU_DIR, SysRoot
from dsr1d.contract.telemetry import Unavailable
from dsr1d.contract.tunable import Action, Setting, Skip, Support

UNCORE_DIR = f"{CPU_DIR}/intel_uncore_frequency"
STEP_KHZ = 100_000  # one uncore ratio: the kernel writes input // 100000
# The kernel takes ratios 1..127 (7 bits), so 100..12700 MHz is all it could ever accept.
MHZ_RANGE = (100, 12_700)


def _mhz(raw: str) -> int | str:
    what = f"{MHZ_RANGE[0]}..{MHZ_RANGE[1]} (MHz), min or max"
    value: int | str = either(choice("min", "max"), integer(*MHZ_RANGE), what)(raw)
    return value


@dataclass(frozen=True)
class Domain:
    """One directory of ``intel_uncore_frequency``: its path and the firmware's range."""

    path: str
    low_khz: int
    high_khz: int

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    def knob(self, leaf: str) -> FileKnob:
        return FileKnob(f"{self.path}/{leaf}")

    def khz(self, value: int | str) -> int:
        """``value`` (MHz, ``min`` or ``max``) in kHz, on the 100 MHz grid, within the range."""
        if value == "max":
            return self.high_khz
        if value == "min":
            return self.low_khz
        wanted = int(value) * 1000 // STEP_KHZ * STEP_KHZ
        return max(self.low_khz, min(self.high_khz, wanted))


def _controls(root: SysRoot) -> list[str]:
    """The directories to write: package/die level, else the TPMI clusters."""
    for pattern in ("package_*_die_*", "uncore[0-9]*"):
        found = [d for d in root.glob(f"{UNCORE_DIR}/{pattern}")
                 if root.exists(f"{d}/max_freq_khz")]
        if found:
            return found
    return []


def _domains(root: SysRoot) -> tuple[list[Domain], list[str]]:
    """Every controllable domain, and the names of those without a firmware range."""
    domains, broken = [], []
    for path in _controls(root):
        try:
            low = int(root.read_fixed(f"{path}/initial_min_freq_khz"))
            high = int(root.read_fixed(f"{path}/initial_max_freq_khz"))
        except (OSError, ValueError):
            broken.append(path.rsplit("/", 1)[-1])
            continue
        domains.append(Domain(path, low, high))
    return domains, broken


def _why_not(root: SysRoot) -> str:
    vendor = root.cpu_vendor()
    if not root.exists(UNCORE_DIR):
        cause = (f"{vendor} CPU: Intel servers only" if vendor and vendor != "GenuineIntel"
                 else "driver intel_uncore_frequency not loaded, or a VM without it")
        return f"no {root.display(UNCORE_DIR)} ({cause})"
    return (f"no package_*_die_* or uncore* directory with max_freq_khz in "
            f"{root.display(UNCORE_DIR)}")


def _summarize(values: dict[str, str]) -> str:
    """``2400`` when every domain agrees, else ``package_00_die_00=2400 …``; ``-`` for none."""
    if not values:
        return "-"
    if len(set(values.values())) == 1:
        return next(iter(values.values()))
    return " ".join(f"{name}={value}" for name, value in values.items())


class Uncore:
    name = "uncore"
    summary = "uncore (mesh, LLC, memory controller) frequency range of every package and die"
    per_cpu = False
    options = {
        "max_mhz": option(_mhz, "the highest uncore frequency in MHz (clamped to the firmware's "
                          "range, rounded down to 100 MHz); max = the firmware's top", "MHz|max"),
        "min_mhz": option(_mhz, "the lowest uncore frequency in MHz (clamped to the firmware's "
                          "range, rounded down to 100 MHz); min = the firmware's bottom, "
                          "max = hold it at the top", "MHz|min|max"),
    }

    def probe(self, root: SysRoot) -> Support:
        domains, broken = _domains(root)
        if not domains:
            if broken:
                return Support(False, f"no initial_min/max_freq_khz in {', '.join(broken)}")
            return Support(False, _why_not(root))
        low = min(d.low_khz for d in domains) // 1000
        high = max(d.high_khz for d in domains) // 1000
        names = ", ".join(d.name for d in domains)
        return Support(True, f"{len(domains)} domain(s) ({names}), firmware range "
                       f"{low}..{high} MHz")

    def read(self, root: SysRoot) -> dict[str, str]:
        values: dict[str, dict[str, str]] = {"max_mhz": {}, "min_mhz": {}}
        for path in _controls(root):
            name = path.rsplit("/", 1)[-1]
            for key, leaf in (("max_mhz", "max_freq_khz"), ("min_mhz", "min_freq_khz")):
                if root.exists(f"{path}/{leaf}"):
                    values[key][name] = str(int(root.read(f"{path}/{leaf}")) // 1000)
        return {key: _summarize(per_domain) for key, per_domain in values.items()}

    def apply(self, root: SysRoot, options: dict[str, Any],
              cpus: list[int] | None = None) -> list[Action]:
        wanted: dict[str, Any] = {k: options[k] for k in ("max_mhz", "min_mhz") if k in options}
        if cpus is not None or not wanted:
            return []
        domains, broken = _domains(root)
        option_name = next(iter(wanted))
        if not domains:
            return [Skip(self.name, option_name, self.probe(root).detail)]
        actions: list[Action] = []
        for domain in domains:
            actions += self._plan_domain(root, domain, wanted)
        if broken:
            actions.append(Skip(self.name, option_name, "no initial_min/max_freq_khz (the "
                                f"firmware's range) in {', '.join(broken)}"))
        return actions

    def _plan_domain(self, root: SysRoot, domain: Domain,
                     wanted: dict[str, Any]) -> list[Action]:
        current_min = int(domain.knob("min_freq_khz").read(root))
        high = domain.khz(wanted["max_mhz"]) if "max_mhz" in wanted else None
        low = domain.khz(wanted["min_mhz"]) if "min_mhz" in wanted else None
        final_high = high if high is not None else int(domain.knob("max_freq_khz").read(root))
        final_low = low if low is not None else current_min
        if final_low > final_high:
            return [Skip(self.name, "min_mhz" if low is not None else "max_mhz",
                         f"{domain.name}: minimum {final_low // 1000} MHz would be above "
                         f"maximum {final_high // 1000} MHz")]
        settings: list[Action] = []
        if high is not None:
            settings.append(Setting(self.name, domain.knob("max_freq_khz"), str(high)))
        if low is not None:
            settings.append(Setting(self.name, domain.knob("min_freq_khz"), str(low)))
        # Never min above max between two writes: a lower ceiling under the present floor
        # lowers the floor first (restore, in reverse order, then stays in order too).
        if high is not None and high < current_min:
            settings.reverse()
        return settings


class UncoreLimits:
    """Telemetry: the uncore's firmware range and the limit in force (what the mitigation
    controller lowers), the lowest over the packages."""

    name = "uncore_limits"
    summary = "uncore frequency range and limit (intel_uncore_frequency)"
    priority = 75

    def probe(self, root: SysRoot) -> Support:
        return Uncore().probe(root)

    def read(self, root: SysRoot, now: float) -> dict[str, Any]:
        domains, _ = _domains(root)
        if not domains:
            raise Unavailable(_why_not(root))
        try:
            limit = min(int(root.read_fixed(f"{d.path}/max_freq_khz")) for d in domains)
        except (OSError, ValueError) as exc:
            raise Unavailable(f"uncore max_freq_khz: {exc}") from None
        return {UNCORE_MAX_MHZ: min(d.high_khz for d in domains) / 1000.0,
                UNCORE_MIN_MHZ: max(d.low_khz for d in domains) / 1000.0,
                UNCORE_LIMIT_MHZ: limit / 1000.0}


@hookimpl
def register_tunables(register: Any) -> None:
    register(Uncore())


@hookimpl
def register_telemetry_sources(register: Any) -> None:
    register(UncoreLimits())
