"""The hardware root: every read and write of /sys, /proc and /dev goes through here.

A `SysRoot` is bound to one directory (``/`` on a real machine, a temporary tree in tests).
Paths handed to it are relative to that directory. Model-specific registers are read through
``dev/cpu/N/msr``: on a real machine a character device addressed by register number, in a fake
root a directory holding one 8-byte little-endian file per register (``dev/cpu/0/msr/0x1a4``).
"""

from __future__ import annotations

import errno as errno_mod
import glob as glob_mod
import os
import re
import struct
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, cast

CPU_DIR = "sys/devices/system/cpu"
CPU_ONLINE = f"{CPU_DIR}/online"
CPUINFO = "proc/cpuinfo"
PM_QOS_DEVICE = "dev/cpu_dma_latency"


class KnobError(Exception):
    """A read or write of one knob failed; names the knob, the path and the errno."""

    def __init__(self, knob: str, path: str, err: OSError, action: str = "write") -> None:
        self.knob = knob
        self.path = path
        self.errno = err.errno or 0
        self.errno_name = errno_mod.errorcode.get(self.errno, str(self.errno))
        self.strerror = err.strerror or str(err)
        self.action = action
        super().__init__(
            f"{knob}: cannot {action} {path}: {self.errno_name} ({self.strerror})"
        )


def parse_cpu_list(text: str) -> list[int]:
    """Parse a kernel CPU list such as ``0-3,8,10-11`` into sorted CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return sorted(cpus)


class SysRoot:
    """Reads and writes kernel interfaces below one root directory."""

    def __init__(self, root: str | os.PathLike[str] = "/") -> None:
        self.root = Path(root).resolve()
        # Paths are joined as strings: a switch touches hundreds of files, and pathlib's
        # parsing was most of its cost.
        self._prefix = str(self.root).rstrip("/") + "/"
        self._pm_qos_fd: int | None = None
        self._pm_qos_value: int | None = None
        self._cpuinfo: dict[str, str] | None = None  # fixed for the life of the machine
        self._msr_dirs: set[str] = set()  # MSR nodes known to be a fake root's directories
        self._memo: dict[object, object] | None = None
        self._fixed: dict[str, object] = {}  # attributes that change only with the hardware

    @contextmanager
    def steady(self) -> Iterator[None]:
        """Within it, ``exists`` and MSR reads answer once per path and register: a plan looks
        at one machine, and reads four prefetcher bits of a register with one read, not four.
        An MSR write inside it forgets that register."""
        outer = self._memo
        self._memo = {} if outer is None else outer
        try:
            yield
        finally:
            self._memo = outer

    def __repr__(self) -> str:
        return f"SysRoot({str(self.root)!r})"

    # -- files -------------------------------------------------------------------------------

    def path(self, rel: str) -> Path:
        """The absolute path of ``rel`` below this root."""
        return self.root / rel.lstrip("/")

    def _abs(self, rel: str) -> str:
        return self._prefix + rel.lstrip("/")

    def display(self, rel: str) -> str:
        """How a path is shown to people: absolute, as the kernel names it, under this root."""
        return self._abs(rel)

    def exists(self, rel: str) -> bool:
        memo = self._memo
        if memo is None:
            return os.path.exists(self._abs(rel))
        found = memo.get(rel)
        if found is None:
            found = memo[rel] = os.path.exists(self._abs(rel))
        return bool(found)

    def read(self, rel: str) -> str:
        """The stripped text of a file (at most one page, like every sysfs attribute)."""
        return _read_capped(self._abs(rel)).decode().strip()

    def read_fixed(self, rel: str) -> str:
        """``read`` for an attribute that changes only when the hardware does (an idle state's
        name and latency, the EPP choices offered), remembered until ``forget_fixed``."""
        found = self._fixed.get(rel)
        if found is None:
            found = self._fixed[rel] = self.read(rel)
        return str(found)

    def glob_fixed(self, pattern: str) -> list[str]:
        """``glob`` for entries that come and go only with the hardware (idle state folders)."""
        key = "glob:" + pattern
        found = self._fixed.get(key)
        if found is None:
            found = self._fixed[key] = self.glob(pattern)
        return list(cast(list[str], found))

    def forget_fixed(self) -> None:
        """CPUs came or went, or a driver changed: read the fixed attributes again."""
        self._fixed.clear()

    def write(self, rel: str, value: str) -> None:
        """Write ``value`` to an existing file (never creates one: a missing knob is an error)."""
        fd = os.open(self._abs(rel), os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, value.encode())
        finally:
            os.close(fd)

    def glob(self, pattern: str) -> list[str]:
        """Paths (relative to the root) matching ``pattern``, in natural sort order."""
        found = glob_mod.glob(self._abs(pattern))
        return sorted((p[len(self._prefix):] for p in found), key=_natural_key)

    # -- CPUs --------------------------------------------------------------------------------

    def online_cpus(self) -> list[int]:
        """Online CPU numbers, from the kernel's ``online`` list."""
        try:
            return parse_cpu_list(self.read(CPU_ONLINE))
        except FileNotFoundError:
            return []

    def cpuinfo(self) -> dict[str, str]:
        """The first processor's fields of /proc/cpuinfo (vendor_id, flags, model name…)."""
        if self._cpuinfo is None:
            self._cpuinfo = self._read_cpuinfo()
        return self._cpuinfo

    def _read_cpuinfo(self) -> dict[str, str]:
        info: dict[str, str] = {}
        try:
            text = self.path(CPUINFO).read_text()
        except FileNotFoundError:
            return info
        for line in text.splitlines():
            if not line.strip():
                if info:
                    break
                continue
            key, _, value = line.partition(":")
            info[key.strip()] = value.strip()
        return info

    def cpu_vendor(self) -> str:
        """``GenuineIntel``, ``AuthenticAMD``… or an empty string when unknown."""
        return self.cpuinfo().get("vendor_id", "")

    def cpu_flags(self) -> set[str]:
        return set(self.cpuinfo().get("flags", "").split())

    # -- MSRs --------------------------------------------------------------------------------

    def msr_path(self, cpu: int) -> str:
        return f"dev/cpu/{cpu}/msr"

    def msr_available(self, cpu: int = 0) -> bool:
        return self.exists(self.msr_path(cpu))

    def read_msr(self, cpu: int, reg: int) -> int:
        """The 64-bit value of register ``reg`` on ``cpu``."""
        memo = self._memo
        if memo is not None and (cpu, reg) in memo:
            return memo[(cpu, reg)]  # type: ignore[return-value]
        value = self._read_msr(cpu, reg)
        if memo is not None:
            memo[(cpu, reg)] = value
        return value

    def _is_msr_dir(self, path: str) -> bool:
        if path in self._msr_dirs:
            return True
        if os.path.isdir(path):  # a fake root: one file per register; it stays a directory
            self._msr_dirs.add(path)
            return True
        return False

    def _read_msr(self, cpu: int, reg: int) -> int:
        path = self._abs(self.msr_path(cpu))
        if self._is_msr_dir(path):
            data = _read_capped(f"{path}/{reg:#x}", limit=8)
        else:
            fd = os.open(path, os.O_RDONLY)
            try:
                data = os.pread(fd, 8, reg)
            finally:
                os.close(fd)
        if len(data) != 8:
            raise OSError(errno_mod.EIO, f"short read of MSR {reg:#x}")
        return int(struct.unpack("<Q", data)[0])

    def write_msr(self, cpu: int, reg: int, value: int) -> None:
        """Write the 64-bit ``value`` to register ``reg`` on ``cpu``."""
        path = self._abs(self.msr_path(cpu))
        data = struct.pack("<Q", value)
        if self._memo is not None:
            self._memo.pop((cpu, reg), None)
        if self._is_msr_dir(path):
            fd = os.open(f"{path}/{reg:#x}", os.O_WRONLY | os.O_TRUNC)
            try:
                os.write(fd, data)
            finally:
                os.close(fd)
            return
        fd = os.open(path, os.O_WRONLY)
        try:
            os.pwrite(fd, data, reg)
        finally:
            os.close(fd)

    # -- PM QoS ------------------------------------------------------------------------------

    def pm_qos_available(self) -> bool:
        return self.exists(PM_QOS_DEVICE)

    def pm_qos_effective(self) -> int:
        """The system-wide CPU latency limit in µs that the kernel currently enforces."""
        with open(self.path(PM_QOS_DEVICE), "rb") as f:
            return int(struct.unpack("<i", f.read(4))[0])

    def pm_qos_held(self) -> int | None:
        """The latency request this process holds, or None."""
        return self._pm_qos_value

    def pm_qos_hold(self, latency_us: int) -> None:
        """Hold a CPU latency request; the kernel drops it when this process dies."""
        if self._pm_qos_fd is None:
            self._pm_qos_fd = os.open(self.path(PM_QOS_DEVICE), os.O_WRONLY)
        try:
            os.write(self._pm_qos_fd, struct.pack("<i", latency_us))
        except OSError:
            if self._pm_qos_value is None:  # no earlier request to keep alive
                self.pm_qos_release()
            raise
        self._pm_qos_value = latency_us

    def pm_qos_release(self) -> None:
        """Drop the request this process holds, if any."""
        if self._pm_qos_fd is not None:
            os.close(self._pm_qos_fd)
        self._pm_qos_fd = None
        self._pm_qos_value = None


PAGE = 4096


def _read_capped(path: str | Path, limit: int = PAGE) -> bytes:
    """Read a kernel attribute; a file that does not end within ``limit`` bytes is refused."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise OSError(errno_mod.EFBIG, f"more than {limit} bytes: not a kernel attribute")
    return data


def _natural_key(path: str) -> list[object]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]
