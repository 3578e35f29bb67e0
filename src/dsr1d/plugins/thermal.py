"""Temperatures, throttle counters and frequencies from sysfs and MSRs (telemetry sources).

Seven sources, each available or not on its own:

- ``thermal_zones`` — ``/sys/class/thermal/thermal_zoneN/{type,temp}`` (m°C):
  ``thermal_zone_<type>_c`` (a type seen twice gets its zone number: ``..._x86_pkg_temp_1_c``);
  ``pkg_temp_c`` from ``x86_pkg_temp`` (the hottest package).
- ``hwmon`` — ``/sys/class/hwmon/hwmonN/{name,tempK_input,tempK_label}``:
  ``hwmon_<name>_<label>_c`` (``hwmon_coretemp_core_0_c``, ``hwmon_k10temp_tctl_c``; a name seen
  twice gets its hwmon number); ``pkg_temp_c`` from coretemp ``Package id N`` (hottest) or
  k10temp ``Tdie``/``Tctl``; ``core_temp_c`` (list) from coretemp ``Core N``.
- ``throttle`` — ``/sys/devices/system/cpu/cpuN/thermal_throttle/{core,package}_throttle_count``:
  ``throttle_count`` = every core's count (once per core) + every package's (once per package),
  also ``throttle_core_count`` and ``throttle_package_count``; cumulative since boot.
  ``throttle_ms``: the largest ``*_throttle_total_time_ms`` (the most throttled core or package);
  ``online_cpus``: how many CPUs are online (a change says the counters were rebased). The paths
  are found again whenever that count changes.
- ``msr_throttle`` — IA32_THERM_STATUS (0x19C, per core) and IA32_PACKAGE_THERM_STATUS (0x1B1):
  ``throttle_active`` (bit 0, "thermal status": the part is throttling now), ``prochot_active``
  (bit 2) and ``throttle_logged`` (bit 1, sticky since boot) — Intel only, where
  ``/dev/cpu/N/msr`` is readable. Where they read too: ``limit_reasons``
  (MSR_CORE_PERF_LIMIT_REASONS 0x64F, low 16 bits: what limits the clock now), ``tj_max_c`` and
  ``tcc_offset_c`` (MSR_TEMPERATURE_TARGET 0x1A2 bits 23:16 and 29:24: where TCC steps in).
- ``cpufreq_limits`` — ``cpufreq/{cpuinfo_max_freq,cpuinfo_min_freq,scaling_max_freq}``:
  ``cpu_max_mhz``, ``cpu_min_mhz`` (CPU 0's range) and ``ceiling_mhz`` (the lowest
  ``scaling_max_freq`` of the online CPUs): what a frequency ceiling can do.
- ``aperf`` — IA32_APERF / IA32_MPERF (0xE8 / 0xE7, Intel and AMD) and the TSC (0x10) of every
  online CPU, as turbostat computes its columns: ``busy_mhz`` = TSC rate × ΣΔAPERF / ΣΔMPERF
  (MPERF counts only while a CPU is awake, so an idle CPU weighs nothing and cannot dilute the
  decoding CPUs' clock), ``busy_percent`` = ΣΔMPERF / ΣΔTSC, ``cpu_mhz`` (list, each CPU's own,
  0 for a CPU that slept through the interval). Needs two readings; not read while turbostat
  measures ``busy_mhz``.
- ``cpufreq`` — ``cpufreq/scaling_cur_freq`` (kHz): ``cpu_mhz`` (list, by CPU number) and
  ``cpu_mhz_avg``; a fallback: not read at all while turbostat or ``aperf`` measures ``cpu_mhz``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from dsr1d.constants import (BUSY_MHZ, CEILING_MHZ, CPU_MAX_MHZ, CPU_MHZ, CPU_MIN_MHZ,
                             LIMIT_REASONS, ONLINE_CPUS, PKG_TEMP_C, TCC_OFFSET_C, THROTTLE_COUNT,
                             THROTTLE_MS, TJ_MAX_C)
from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.sysroot import CPU_DIR, SysRoot
from dsr1d.contract.telemetry import UNAVAILABLE, Pending, Unavailable, describe_oserror, \
    msr_reader, read_int, sanitize
from dsr1d.contract.tunable import Support

THERMAL = "sys/class/thermal"
HWMON = "sys/class/hwmon"
IA32_THERM_STATUS = 0x19C
MSR_TEMPERATURE_TARGET = 0x1A2
MSR_CORE_PERF_LIMIT_REASONS = 0x64F
IA32_PACKAGE_THERM_STATUS = 0x1B1
IA32_TIME_STAMP_COUNTER = 0x10
IA32_MPERF = 0xE7
IA32_APERF = 0xE8


def _num(path: str) -> int:
    m = re.search(r"(\d+)$", path)
    return int(m.group(1)) if m else -1


def _millideg(path: str) -> float:
    return round(read_int(path) / 1000.0, 1)


class _Cached:
    """Paths found at start(), found again only after a read fails (hotplug)."""

    def __init__(self) -> None:
        self.found: Any = None

    def discover(self, root: SysRoot) -> Any:
        raise NotImplementedError

    def start(self, root: SysRoot) -> None:
        self.found = self.discover(root)

    def stop(self) -> None:
        self.found = None

    def _paths(self, root: SysRoot) -> Any:
        if self.found is None:
            self.found = self.discover(root)
        return self.found


# -- thermal zones -------------------------------------------------------------------------------


@dataclass
class Zone:
    path: str       # sys/class/thermal/thermal_zone1
    type: str       # x86_pkg_temp
    key: str
    temp: str       # the absolute path of its temp attribute


class ThermalZones(_Cached):
    name = "thermal_zones"
    summary = "ACPI / x86_pkg_temp thermal zones"
    priority = 50

    def discover(self, root: SysRoot) -> list[Zone]:
        raw = []
        for path in root.glob(f"{THERMAL}/thermal_zone*"):
            try:
                raw.append((path, root.read(f"{path}/type")))
            except OSError:
                continue
        counts: dict[str, int] = {}
        for _, typ in raw:
            counts[typ] = counts.get(typ, 0) + 1
        zones = []
        for path, typ in raw:
            frag = sanitize(typ) if counts[typ] == 1 else f"{sanitize(typ)}_{_num(path)}"
            zones.append(Zone(path, typ, f"thermal_zone_{frag}_c", root.display(f"{path}/temp")))
        return zones

    def probe(self, root: SysRoot) -> Support:
        zones = self.discover(root)
        if not zones:
            return Support(False, f"no thermal zones in {root.display(THERMAL)}")
        return Support(True, ", ".join(z.type for z in zones))

    def read(self, root: SysRoot, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        missing: dict[str, str] = {}
        pkg: list[float] = []
        for z in self._paths(root):
            try:
                value = _millideg(z.temp)
            except OSError as exc:
                missing[z.path.rsplit("/", 1)[-1]] = f"vanished: {describe_oserror(exc, z.temp)}"
                self.found = None
                continue
            except ValueError:
                missing[z.path.rsplit("/", 1)[-1]] = f"{z.type}: temp is not a number"
                continue
            out[z.key] = value
            if z.type == "x86_pkg_temp":
                pkg.append(value)
        if pkg:
            out[PKG_TEMP_C] = max(pkg)
        if missing:
            out[UNAVAILABLE] = missing
        if not out:
            raise Unavailable(f"no thermal zones in {root.display(THERMAL)}")
        return out


# -- hwmon ---------------------------------------------------------------------------------------


@dataclass
class Sensor:
    path: str       # /sys/class/hwmon/hwmon2/temp3_input (absolute)
    chip: str       # coretemp
    label: str      # Core 1
    key: str


class Hwmon(_Cached):
    name = "hwmon"
    summary = "hwmon temperature sensors (coretemp, k10temp, …)"
    priority = 40

    def discover(self, root: SysRoot) -> list[Sensor]:
        chips = []
        for path in root.glob(f"{HWMON}/hwmon*"):
            try:
                chips.append((path, root.read(f"{path}/name")))
            except OSError:
                continue
        counts: dict[str, int] = {}
        for _, chip in chips:
            counts[chip] = counts.get(chip, 0) + 1
        sensors = []
        for path, chip in chips:
            chip_key = sanitize(chip) if counts[chip] == 1 else f"{sanitize(chip)}_{_num(path)}"
            for inp in root.glob(f"{path}/temp*_input"):
                base = inp[: -len("_input")]
                try:
                    label = root.read(f"{base}_label")
                except OSError:
                    label = base.rsplit("/", 1)[-1]
                sensors.append(Sensor(root.display(inp), chip, label,
                                      f"hwmon_{chip_key}_{sanitize(label)}_c"))
        return sensors

    def probe(self, root: SysRoot) -> Support:
        sensors = self.discover(root)
        if not sensors:
            return Support(False, f"no hwmon temperature sensors in {root.display(HWMON)}")
        return Support(True, ", ".join(sorted({s.chip for s in sensors})))

    def read(self, root: SysRoot, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        missing: dict[str, str] = {}
        packages: list[float] = []
        cores: list[tuple[int, float]] = []
        amd: dict[str, float] = {}
        for s in self._paths(root):
            try:
                value = _millideg(s.path)
            except OSError as exc:
                missing[f"{s.chip}/{s.label}"] = f"vanished: {describe_oserror(exc, s.path)}"
                self.found = None  # re-discover on the next read
                continue
            except ValueError:
                missing[f"{s.chip}/{s.label}"] = f"{s.path}: not a number"
                continue
            out[s.key] = value
            if s.chip == "coretemp":
                if s.label.startswith("Package id"):
                    packages.append(value)
                elif s.label.startswith("Core "):
                    cores.append((_num(s.label), value))
            elif s.chip == "k10temp" and s.label in ("Tdie", "Tctl"):
                amd[s.label] = value
        if packages:
            out[PKG_TEMP_C] = max(packages)
        elif amd:
            out[PKG_TEMP_C] = amd.get("Tdie", amd.get("Tctl"))
        if cores:
            out["core_temp_c"] = [v for _, v in cores]
        if missing:
            out[UNAVAILABLE] = missing
        if not out:
            raise Unavailable(f"no hwmon temperature sensors in {root.display(HWMON)}")
        return out


# -- thermal_throttle counters -------------------------------------------------------------------


@dataclass
class Counters:
    core: list[str] = field(default_factory=list)       # one absolute path per physical core
    package: list[str] = field(default_factory=list)    # one absolute path per package
    times: list[str] = field(default_factory=list)      # *_throttle_total_time_ms paths
    online: int = 0                                     # online CPUs when these were found


def _topology(root: SysRoot, cpu_path: str, cpu: int) -> tuple[int, int]:
    try:
        pkg = int(root.read(f"{cpu_path}/topology/physical_package_id"))
    except (OSError, ValueError):
        pkg = 0
    try:
        core = int(root.read(f"{cpu_path}/topology/core_id"))
    except (OSError, ValueError):
        core = cpu
    return pkg, core


class ThrottleCounters(_Cached):
    name = "throttle"
    summary = "thermal_throttle core / package event counters"
    priority = 50

    def discover(self, root: SysRoot) -> Counters:
        found = Counters(online=len(root.online_cpus()))
        seen_core: set[tuple[int, int]] = set()
        seen_pkg: set[int] = set()
        for cpu_path in root.glob(f"{CPU_DIR}/cpu[0-9]*"):
            tt = f"{cpu_path}/thermal_throttle"
            if not root.exists(tt):
                continue
            pkg, core = _topology(root, cpu_path, _num(cpu_path))
            if (pkg, core) not in seen_core and root.exists(f"{tt}/core_throttle_count"):
                seen_core.add((pkg, core))
                found.core.append(root.display(f"{tt}/core_throttle_count"))
                if root.exists(f"{tt}/core_throttle_total_time_ms"):
                    found.times.append(root.display(f"{tt}/core_throttle_total_time_ms"))
            if pkg not in seen_pkg and root.exists(f"{tt}/package_throttle_count"):
                seen_pkg.add(pkg)
                found.package.append(root.display(f"{tt}/package_throttle_count"))
                if root.exists(f"{tt}/package_throttle_total_time_ms"):
                    found.times.append(root.display(f"{tt}/package_throttle_total_time_ms"))
        return found

    def probe(self, root: SysRoot) -> Support:
        c = self.discover(root)
        if not c.core and not c.package:
            return Support(False, f"no thermal_throttle counters under {root.display(CPU_DIR)} "
                                  "(not Intel, or kernel without CONFIG_X86_THERMAL_VECTOR)")
        return Support(True, f"{len(c.core)} cores, {len(c.package)} packages")

    def read(self, root: SysRoot, now: float) -> dict[str, Any]:
        c: Counters = self._paths(root)
        online = len(root.online_cpus())
        if online != c.online:             # hotplug: a CPU's counters came or went
            self.found = c = self.discover(root)
        totals = {"core": 0, "package": 0}
        failed: dict[str, str] = {}
        for kind, paths in (("core", c.core), ("package", c.package)):
            for path in paths:
                try:
                    totals[kind] += read_int(path)
                except (OSError, ValueError) as exc:
                    why = describe_oserror(exc, path) \
                        if isinstance(exc, OSError) else f"{path}: not a number"
                    failed[kind] = f"vanished: {why}"
        if failed:
            # A sum missing a CPU would look like the counters went down: report no sum.
            self.found = None
            raise Unavailable("; ".join(failed.values()))
        out: dict[str, Any] = {}
        if c.core:
            out["throttle_core_count"] = totals["core"]
        if c.package:
            out["throttle_package_count"] = totals["package"]
        out[THROTTLE_COUNT] = totals["core"] + totals["package"]
        out[ONLINE_CPUS] = online
        times = []
        for path in c.times:
            try:
                times.append(read_int(path))
            except (OSError, ValueError):
                times = []      # a maximum missing a CPU is no maximum
                break
        if times:
            out[THROTTLE_MS] = max(times)
        return out


# -- MSR thermal status ----------------------------------------------------------------------------


class MsrThermStatus(_Cached):
    name = "msr_throttle"
    summary = "IA32_THERM_STATUS 0x19C / IA32_PACKAGE_THERM_STATUS 0x1B1 (throttling now)"
    priority = 60

    def discover(self, root: SysRoot) -> dict[str, list[tuple[int, Any]]]:
        cores: list[tuple[int, Any]] = []
        pkgs: list[tuple[int, Any]] = []
        seen_core: set[tuple[int, int]] = set()
        seen_pkg: set[int] = set()
        for cpu in root.online_cpus():
            pkg, core = _topology(root, f"{CPU_DIR}/cpu{cpu}", cpu)
            if (pkg, core) not in seen_core:
                seen_core.add((pkg, core))
                cores.append((cpu, msr_reader(root, cpu)))
            if pkg not in seen_pkg:
                seen_pkg.add(pkg)
                pkgs.append((cpu, msr_reader(root, cpu)))
        return {"core": cores, "package": pkgs}

    def probe(self, root: SysRoot) -> Support:
        if root.cpu_vendor() != "GenuineIntel":
            return Support(False, f"IA32_THERM_STATUS is Intel's ({root.cpu_vendor() or 'unknown'}"
                                  " CPU)")
        cpus = root.online_cpus() or [0]
        if not root.msr_available(cpus[0]):
            return Support(False, f"{root.display(root.msr_path(cpus[0]))} is missing "
                                  "(modprobe msr)")
        try:
            root.read_msr(cpus[0], IA32_THERM_STATUS)
        except OSError as exc:
            return Support(False, "cannot read MSR 0x19c: " + describe_oserror(exc))
        return Support(True, f"{root.display(root.msr_path(cpus[0]))}")

    def read(self, root: SysRoot, now: float) -> dict[str, Any]:
        cpus = self._paths(root)
        active = prochot = logged = False
        readings = 0
        missing: dict[str, str] = {}
        for kind, reg in (("core", IA32_THERM_STATUS), ("package", IA32_PACKAGE_THERM_STATUS)):
            for cpu, read_msr in cpus[kind]:
                try:
                    value = read_msr(reg)
                except OSError as exc:
                    missing[f"cpu{cpu}:{reg:#x}"] = describe_oserror(exc)
                    self.found = None
                    continue
                readings += 1
                active |= bool(value & 0x1)
                logged |= bool(value & 0x2)
                prochot |= bool(value & 0x4)
        if not readings:
            raise Unavailable("no thermal status MSR readable: "
                              + "; ".join(f"{k} {v}" for k, v in missing.items()))
        if missing:
            # A CPU we could not read might be the one throttling: no all-clear from a part.
            return {UNAVAILABLE: missing, **({"throttle_active": True} if active else {}),
                    **({"prochot_active": True} if prochot else {})}
        out = {"throttle_active": active, "prochot_active": prochot, "throttle_logged": logged}
        out.update(self._limits(cpus["package"]))
        return out

    @staticmethod
    def _limits(packages: list[tuple[int, Any]]) -> dict[str, Any]:
        """Limit reasons and the TCC activation point, where those MSRs read (optional)."""
        out: dict[str, Any] = {}
        reasons = 0
        for _cpu, read_msr in packages:
            try:
                reasons |= read_msr(MSR_CORE_PERF_LIMIT_REASONS) & 0xFFFF
                out[LIMIT_REASONS] = reasons
            except OSError:
                pass
        if packages:
            try:
                target = packages[0][1](MSR_TEMPERATURE_TARGET)
            except OSError:
                return out
            if (target >> 16) & 0xFF:
                out[TJ_MAX_C] = (target >> 16) & 0xFF
                out[TCC_OFFSET_C] = (target >> 24) & 0x3F
        return out


# -- APERF / MPERF -------------------------------------------------------------------------------


class AperfMperf(_Cached):
    name = "aperf"
    summary = "busy MHz and Busy% from IA32_APERF/IA32_MPERF and the TSC (as turbostat has them)"
    priority = 50
    provides = frozenset({BUSY_MHZ})  # not read while turbostat measures busy_mhz

    def __init__(self) -> None:
        super().__init__()
        self.last: tuple[float, dict[int, tuple[int, int, int]]] | None = None

    def discover(self, root: SysRoot) -> list[tuple[int, Any]]:
        self.last = None            # another set of CPUs: the deltas start again
        return [(cpu, msr_reader(root, cpu)) for cpu in root.online_cpus()]

    def probe(self, root: SysRoot) -> Support:
        cpus = root.online_cpus() or [0]
        if not root.msr_available(cpus[0]):
            return Support(False, f"{root.display(root.msr_path(cpus[0]))} is missing "
                                  "(modprobe msr; not in VMs)")
        for reg in (IA32_TIME_STAMP_COUNTER, IA32_MPERF, IA32_APERF):
            try:
                root.read_msr(cpus[0], reg)
            except OSError as exc:
                return Support(False, f"cannot read MSR {reg:#x}: " + describe_oserror(exc))
        return Support(True, f"{len(cpus)} CPUs")

    def read(self, root: SysRoot, now: float) -> dict[str, Any]:
        counters: dict[int, tuple[int, int, int]] = {}
        for cpu, read_msr in self._paths(root):
            try:
                counters[cpu] = (read_msr(IA32_TIME_STAMP_COUNTER), read_msr(IA32_MPERF),
                                 read_msr(IA32_APERF))
            except OSError as exc:
                self.found = None
                raise Unavailable(f"cpu{cpu}: " + describe_oserror(exc)) from None
        last, self.last = self.last, (now, counters)
        if last is None or set(last[1]) != set(counters):
            raise Pending("a first reading of APERF/MPERF (busy MHz needs two)")
        seconds = now - last[0]
        deltas = {cpu: tuple(b - a for a, b in zip(last[1][cpu], c))
                  for cpu, c in sorted(counters.items())}
        if seconds <= 0 or any(t <= 0 or m < 0 or a < 0 for t, m, a in deltas.values()):
            raise Pending("APERF/MPERF went back (a wrap or a reset): measuring again")
        tsc = sum(t for t, _, _ in deltas.values())
        mperf = sum(m for _, m, _ in deltas.values())
        aperf = sum(a for _, _, a in deltas.values())
        if mperf == 0:
            raise Unavailable("every CPU slept through the interval (MPERF did not move)")
        # Bzy_MHz as turbostat has it: the TSC's rate times the awake cycles' APERF/MPERF
        return {
            BUSY_MHZ: round(tsc / len(deltas) / seconds * aperf / mperf / 1e6, 1),
            "busy_percent": round(100.0 * mperf / tsc, 2),
            CPU_MHZ: [round(t / seconds * a / m / 1e6, 1) if m else 0.0
                      for t, m, a in deltas.values()],
        }


# -- cpufreq -------------------------------------------------------------------------------------


def _cpufreq_support(root: SysRoot, found: list, attribute: str) -> Support:
    if not found:
        return Support(False, f"no cpufreq/{attribute} under {root.display(CPU_DIR)} "
                              "(no cpufreq driver, e.g. in a VM)")
    return Support(True, f"{len(found)} CPUs")


class CpufreqMhz(_Cached):
    name = "cpufreq"
    summary = "cpufreq scaling_cur_freq per CPU (what the kernel last asked for / saw)"
    priority = 70
    provides = frozenset({CPU_MHZ})  # not read while turbostat measures cpu_mhz

    def discover(self, root: SysRoot) -> list[tuple[int, str]]:
        out = []
        for cpu in root.online_cpus():
            path = f"{CPU_DIR}/cpu{cpu}/cpufreq/scaling_cur_freq"
            if root.exists(path):
                out.append((cpu, root.display(path)))
        return out

    def probe(self, root: SysRoot) -> Support:
        return _cpufreq_support(root, self.discover(root), "scaling_cur_freq")

    def read(self, root: SysRoot, now: float) -> dict[str, Any]:
        mhz: list[float] = []
        missing: dict[str, str] = {}
        for cpu, path in self._paths(root):
            try:
                mhz.append(round(read_int(path) / 1000.0, 1))
            except (OSError, ValueError) as exc:
                missing[f"cpu{cpu}"] = (describe_oserror(exc, path)
                                        if isinstance(exc, OSError) else "not a number")
                self.found = None
        if missing:
            # A list with a hole would shift every later CPU: no list this interval.
            raise Unavailable("; ".join(f"{k}: {v}" for k, v in missing.items()))
        if not mhz:
            raise Unavailable("no CPU has cpufreq/scaling_cur_freq")
        return {CPU_MHZ: mhz, "cpu_mhz_avg": round(sum(mhz) / len(mhz), 1)}


class CpufreqLimits(_Cached):
    name = "cpufreq_limits"
    summary = "cpufreq range and ceiling (cpuinfo_{max,min}_freq, scaling_max_freq)"
    priority = 75

    def discover(self, root: SysRoot) -> list[str]:
        return [root.display(f"{CPU_DIR}/cpu{cpu}/cpufreq/scaling_max_freq")
                for cpu in root.online_cpus()
                if root.exists(f"{CPU_DIR}/cpu{cpu}/cpufreq/scaling_max_freq")]

    def probe(self, root: SysRoot) -> Support:
        return _cpufreq_support(root, self.discover(root), "scaling_max_freq")

    def read(self, root: SysRoot, now: float) -> dict[str, Any]:
        paths = self._paths(root)
        if not paths:
            raise Unavailable("no CPU has cpufreq/scaling_max_freq")
        first = f"{CPU_DIR}/cpu{(root.online_cpus() or [0])[0]}/cpufreq"
        try:
            ceiling = min(read_int(p) for p in paths)
            top, bottom = root.read_fixed(f"{first}/cpuinfo_max_freq"), \
                root.read_fixed(f"{first}/cpuinfo_min_freq")
            out = {CEILING_MHZ: ceiling / 1000.0, CPU_MAX_MHZ: int(top) / 1000.0,
                   CPU_MIN_MHZ: int(bottom) / 1000.0}
        except (OSError, ValueError) as exc:
            self.found = None
            raise Unavailable(f"cpufreq limits: {exc}") from None
        return out


@hookimpl
def register_telemetry_sources(register: Any) -> None:
    register(ThermalZones())
    register(Hwmon())
    register(ThrottleCounters())
    register(MsrThermStatus())
    register(AperfMperf())
    register(CpufreqMhz())
    register(CpufreqLimits())
