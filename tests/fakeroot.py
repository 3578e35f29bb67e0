"""Builders for a fake hardware root: a temporary tree shaped like /sys, /proc and /dev.

MSRs follow the project's convention: ``dev/cpu/N/msr`` is a directory holding one 8-byte
little-endian file per register, named by its lowercase hex number.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

CPU = "sys/devices/system/cpu"
THP = "sys/kernel/mm/transparent_hugepage"
THP_ENABLED = ("always", "madvise", "never")
THP_DEFRAG = ("always", "defer", "defer+madvise", "madvise", "never")


def _bracket(choices: tuple[str, ...], active: str) -> str:
    return " ".join(f"[{c}]" if c == active else c for c in choices) + "\n"


def _value(text: str) -> str:
    if "[" in text and "]" in text:
        return text[text.index("[") + 1:text.index("]")]
    return text


class FakeRoot:
    """A fake machine under ``path``; every builder returns self so calls can chain."""

    def __init__(self, path: Path, vendor: str = "GenuineIntel", flags: str = "fpu msr epb") -> None:
        self.path = Path(path)
        self.cpus: list[int] = []
        self.write("proc/cpuinfo", f"processor\t: 0\nvendor_id\t: {vendor}\nflags\t\t: {flags}\n\n")
        self.write(f"{CPU}/online", "")

    def __str__(self) -> str:
        return str(self.path)

    # -- generic -----------------------------------------------------------------------------

    def write(self, rel: str, text: str) -> FakeRoot:
        target = self.path / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
        return self

    def read(self, rel: str) -> str:
        return (self.path / rel).read_text().strip()

    def selected(self, rel: str) -> str:
        """The active choice of a select-style file (sysfs brackets it; a written fake file
        holds just the word)."""
        return _value(self.read(rel))

    def snapshot(self) -> dict[str, object]:
        """Every knob's value as the kernel would report it.

        Leaves out the journal and dev/cpu_dma_latency: a PM QoS request is not a stored value
        (the kernel drops it when its holder closes the device), which a plain file cannot show.
        """
        out: dict[str, object] = {}
        for p in sorted(self.path.rglob("*")):
            rel = str(p.relative_to(self.path))
            if p.is_file() and not rel.startswith("run/") and rel != "dev/cpu_dma_latency":
                data = p.read_bytes()
                out[rel] = data if "/msr/" in rel else _value(data.decode().strip())
        return out

    # -- CPUs --------------------------------------------------------------------------------

    def add_cpu(self, n: int, epb: int | None = None, epp: str | None = None,
                online: bool = True) -> FakeRoot:
        """A CPU, with EPB in sysfs and EPP in cpufreq when given."""
        self.write(f"{CPU}/cpu{n}/topology/core_id", f"{n}\n")
        if epb is not None:
            self.write(f"{CPU}/cpu{n}/power/energy_perf_bias", f"{epb}\n")
        if epp is not None:
            self.write(f"{CPU}/cpu{n}/cpufreq/energy_performance_preference", f"{epp}\n")
            self.write(f"{CPU}/cpu{n}/cpufreq/energy_performance_available_preferences",
                       "default performance balance_performance balance_power power\n")
        if online and n not in self.cpus:
            self.cpus.append(n)
            self.cpus.sort()
        self.write(f"{CPU}/online", ",".join(map(str, self.cpus)) + "\n")
        return self

    def add_cpufreq(self, n: int, max_khz: int = 3_800_000, min_khz: int = 800_000) -> FakeRoot:
        """cpufreq limits of CPU ``n``: the hardware's range and a ceiling at its top."""
        for leaf, value in (("cpuinfo_max_freq", max_khz), ("cpuinfo_min_freq", min_khz),
                            ("scaling_max_freq", max_khz)):
            self.write(f"{CPU}/cpu{n}/cpufreq/{leaf}", f"{value}\n")
        return self

    def add_msr(self, cpu: int, reg: int, value: int) -> FakeRoot:
        target = self.path / f"dev/cpu/{cpu}/msr/{reg:#x}"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(struct.pack("<Q", value))
        return self

    def msr(self, cpu: int, reg: int) -> int:
        return struct.unpack("<Q", (self.path / f"dev/cpu/{cpu}/msr/{reg:#x}").read_bytes())[0]

    # -- idle --------------------------------------------------------------------------------

    def add_cpuidle(self, states: list[tuple[str, int]], governor: str = "menu",
                    available: str = "ladder menu teo haltpoll", driver: str = "intel_idle") -> FakeRoot:
        """Idle states ``(name, exit latency µs)`` on every CPU added so far, and the governor."""
        self.write(f"{CPU}/cpuidle/current_governor", f"{governor}\n")
        self.write(f"{CPU}/cpuidle/available_governors", f"{available}\n")
        self.write(f"{CPU}/cpuidle/current_driver", f"{driver}\n")
        for cpu in self.cpus:
            for k, (name, latency) in enumerate(states):
                base = f"{CPU}/cpu{cpu}/cpuidle/state{k}"
                self.write(f"{base}/name", f"{name}\n")
                self.write(f"{base}/latency", f"{latency}\n")
                self.write(f"{base}/disable", "0\n")
                self.write(f"{base}/usage", "0\n")
        return self

    def state_disabled(self, cpu: int, name: str) -> str:
        for state in sorted((self.path / f"{CPU}/cpu{cpu}/cpuidle").glob("state*")):
            if (state / "name").read_text().strip() == name:
                return (state / "disable").read_text().strip()
        raise KeyError(name)

    def add_pm_qos(self, effective: int = 2_000_000_000) -> FakeRoot:
        target = self.path / "dev/cpu_dma_latency"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(struct.pack("<i", effective))
        return self

    def pm_qos(self) -> int:
        return struct.unpack("<i", (self.path / "dev/cpu_dma_latency").read_bytes()[-4:])[0]

    def add_procfs(self, load: float = 0.5) -> FakeRoot:
        """/proc/stat, /proc/loadavg and /proc/meminfo as the kernel formats them."""
        stat = "cpu  100 0 100 1000 0 0 0 0 0 0\n" + "".join(
            f"cpu{n} 50 0 50 500 0 0 0 0 0 0\n" for n in self.cpus)
        self.write("proc/stat", stat)
        self.write("proc/loadavg", f"{load:.2f} {load:.2f} {load:.2f} 1/100 1234\n")
        self.write("proc/meminfo", "MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
        return self

    def add_rapl(self, pl1_w: int = 205, package: int = 0) -> FakeRoot:
        """A RAPL package zone with its long-term limit (PL1)."""
        base = f"sys/class/powercap/intel-rapl:{package}"
        self.write(f"{base}/name", f"package-{package}\n")
        self.write(f"{base}/constraint_0_name", "long_term\n")
        self.write(f"{base}/constraint_0_power_limit_uw", f"{pl1_w * 1_000_000}\n")
        self.write(f"{base}/energy_uj", "0\n")
        self.write(f"{base}/max_energy_range_uj", "262143328850\n")
        return self

    def add_uncore(self, package: int, die: int = 0, low_khz: int = 800_000,
                   high_khz: int = 2_400_000, max_khz: int | None = None,
                   min_khz: int | None = None) -> FakeRoot:
        """An ``intel_uncore_frequency/package_XX_die_YY`` directory: the firmware's range and
        the limits now (the range itself unless given)."""
        return self._uncore_dir(f"package_{package:02d}_die_{die:02d}", low_khz, high_khz,
                                max_khz, min_khz)

    def add_uncore_cluster(self, instance: int, package: int, domain: int, cluster: int = 0,
                           low_khz: int = 800_000, high_khz: int = 2_400_000,
                           max_khz: int | None = None) -> FakeRoot:
        """A TPMI ``intel_uncore_frequency/uncoreNN`` directory (one fabric cluster)."""
        name = f"uncore{instance:02d}"
        for leaf, value in (("package_id", package), ("domain_id", domain),
                            ("fabric_cluster_id", cluster)):
            self.write(f"{CPU}/intel_uncore_frequency/{name}/{leaf}", f"{value}\n")
        return self._uncore_dir(name, low_khz, high_khz, max_khz, None)

    def _uncore_dir(self, name: str, low_khz: int, high_khz: int, max_khz: int | None,
                    min_khz: int | None) -> FakeRoot:
        base = f"{CPU}/intel_uncore_frequency/{name}"
        for leaf, value in (("initial_min_freq_khz", low_khz), ("initial_max_freq_khz", high_khz),
                            ("min_freq_khz", low_khz if min_khz is None else min_khz),
                            ("max_freq_khz", high_khz if max_khz is None else max_khz),
                            ("current_freq_khz", low_khz)):
            self.write(f"{base}/{leaf}", f"{value}\n")
        return self

    # -- memory ------------------------------------------------------------------------------

    def add_thp(self, enabled: str = "madvise", defrag: str = "madvise",
                khugepaged_defrag: str = "1") -> FakeRoot:
        self.write(f"{THP}/enabled", _bracket(THP_ENABLED, enabled))
        self.write(f"{THP}/defrag", _bracket(THP_DEFRAG, defrag))
        self.write(f"{THP}/khugepaged/defrag", f"{khugepaged_defrag}\n")
        return self


def _knob_value(rel: str, path: Path) -> object:
    """A knob's value as the kernel would present it: MSR files as numbers, select files as
    their bracketed choice (the fake cannot re-bracket a written word), text stripped."""
    data = path.read_bytes()
    if "/msr/" in rel and len(data) == 8:
        return int.from_bytes(data, "little")
    return _value(data.decode(errors="backslashreplace").strip())


def snapshot_tree(root: Path) -> dict[str, object]:
    """Every knob, symlink (by target, never followed) and directory below ``sys/`` and
    ``dev/cpu/``; ``dev/cpu_dma_latency`` is left out (see `FakeRoot.snapshot`)."""
    snap: dict[str, object] = {}
    for base in ("sys", "dev/cpu"):
        for dirpath, dirnames, filenames in os.walk(root / base):
            for name in dirnames + filenames:
                path = Path(dirpath) / name
                rel = str(path.relative_to(root))
                if path.is_symlink():
                    snap[rel] = ("symlink", os.readlink(path))
                elif path.is_dir():
                    snap[rel] = ("dir",)
                else:
                    snap[rel] = _knob_value(rel, path)
    return snap


def diff_snapshots(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """``path: before -> after`` for every entry that differs."""
    return [f"{rel}: {before.get(rel)!r} -> {after.get(rel)!r}"
            for rel in sorted(set(before) | set(after)) if before.get(rel) != after.get(rel)]


def intel_box(path: Path, cpus: int = 4) -> FakeRoot:
    """An Intel server with every tunable present: EPB/EPP, cpufreq, idle states, MSRs, PM QoS,
    THP, the uncore frequency."""
    fake = FakeRoot(path)
    for n in range(cpus):
        fake.add_cpu(n, epb=6, epp="balance_performance").add_cpufreq(n)
        fake.add_msr(n, 0x1A4, 0)
        fake.add_msr(n, 0x1B0, 6)
        fake.add_msr(n, 0xE2, 0x8)
    fake.add_cpuidle([("POLL", 0), ("C1", 2), ("C1E", 10), ("C6", 170)])
    fake.add_rapl().write(f"{CPU}/intel_pstate/no_turbo", "0\n")
    fake.add_uncore(0)
    fake.add_procfs()
    return fake.add_pm_qos().add_thp()
