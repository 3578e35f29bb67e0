"""Knobs: single kernel settings that a tunable may write, addressable by a stable key.

The key is what the journal stores, so a later process (``dsr1d restore``) can rebuild the knob
and put its original value back without knowing which plugin wrote it. Every value is a string.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Protocol

from dsr1d.contract.sysroot import PM_QOS_DEVICE, SysRoot

NO_REQUEST = "none"


class Knob(Protocol):
    """One setting: read its current value, write a new one."""

    @property
    def key(self) -> str: ...

    def where(self, root: SysRoot) -> str:
        """The path (and register) as shown to people."""
        ...

    def read(self, root: SysRoot) -> str: ...

    def write(self, root: SysRoot, value: str) -> None: ...

    def exists(self, root: SysRoot) -> bool:
        """False when the knob is gone (its CPU was unplugged, its driver unloaded)."""
        ...


def holds(knob: Knob, root: SysRoot, wanted: str) -> bool:
    """Whether ``knob`` currently gives what ``wanted`` asks for."""
    check = getattr(knob, "satisfies", None)
    return check(root, wanted) if check else knob.read(root) == wanted


@dataclass(frozen=True)
class FileKnob:
    """A plain sysfs/procfs file whose content is the value."""

    path: str
    # Worked out once: a switch asks for it several times per knob.
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"file:{self.path}")

    def where(self, root: SysRoot) -> str:
        return root.display(self.path)

    def read(self, root: SysRoot) -> str:
        return root.read(self.path)

    def write(self, root: SysRoot, value: str) -> None:
        root.write(self.path, value)

    def exists(self, root: SysRoot) -> bool:
        return root.exists(self.path)


_SELECTED = re.compile(r"\[([^\]]+)\]")


@dataclass(frozen=True)
class SelectKnob(FileKnob):
    """A file that lists the choices and brackets the active one (``always [madvise] never``)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"select:{self.path}")

    def read(self, root: SysRoot) -> str:
        text = root.read(self.path)
        match = _SELECTED.search(text)
        return match.group(1) if match else text


@dataclass(frozen=True)
class MsrKnob:
    """The bits ``mask`` of register ``reg`` on one CPU; the value is those bits, shifted down."""

    cpu: int
    reg: int
    mask: int
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", f"msr:{self.cpu}:{self.reg:#x}:{self.mask:#x}")

    @property
    def shift(self) -> int:
        return (self.mask & -self.mask).bit_length() - 1

    def where(self, root: SysRoot) -> str:
        return f"{root.display(root.msr_path(self.cpu))} register {self.reg:#x} bits {self.mask:#x}"

    def read(self, root: SysRoot) -> str:
        return str((root.read_msr(self.cpu, self.reg) & self.mask) >> self.shift)

    def exists(self, root: SysRoot) -> bool:
        return root.exists(root.msr_path(self.cpu))

    def write(self, root: SysRoot, value: str) -> None:
        bits = (int(value) << self.shift) & self.mask
        old = root.read_msr(self.cpu, self.reg)
        root.write_msr(self.cpu, self.reg, (old & ~self.mask) | bits)


@dataclass(frozen=True)
class PmQosKnob:
    """The CPU latency request this process holds on /dev/cpu_dma_latency (µs, or ``none``).

    The kernel drops the request when the holding process exits, so a crash cannot leave it
    behind; its "original" is always ``none``.
    """

    lives_with_process = True

    @property
    def key(self) -> str:
        return "pmqos:"

    def where(self, root: SysRoot) -> str:
        return root.display(PM_QOS_DEVICE)

    def read(self, root: SysRoot) -> str:
        held = root.pm_qos_held()
        return NO_REQUEST if held is None else str(held)

    def exists(self, root: SysRoot) -> bool:
        return True  # the request is this process's, whatever the device does

    def satisfies(self, root: SysRoot, wanted: str) -> bool:
        """True when some process's request keeps the effective limit at or below ``wanted``."""
        if wanted == NO_REQUEST:
            return True
        return self.read(root) == wanted or root.pm_qos_effective() <= int(wanted)

    def write(self, root: SysRoot, value: str) -> None:
        if value == NO_REQUEST:
            root.pm_qos_release()
        else:
            root.pm_qos_hold(int(value))


def _check_relative(key: str, path: str) -> None:
    """A journaled path stays inside the root: relative, no ``..``, under sys/, proc/ or dev/."""
    parts = path.split("/")
    if not path or path.startswith("/") or ".." in parts or parts[0] not in ("sys", "proc", "dev"):
        raise ValueError(f"knob key {key!r} points outside the hardware root")


def knob_from_key(key: str) -> Knob:
    """Rebuild a knob from its journal key; ValueError for a key no knob type makes."""
    kind, _, rest = key.partition(":")
    if kind in ("file", "select"):
        _check_relative(key, rest)
        return FileKnob(rest) if kind == "file" else SelectKnob(rest)
    if kind == "msr":
        cpu, reg, mask = rest.split(":")
        return MsrKnob(int(cpu), int(reg, 16), int(mask, 16))
    if kind == "pmqos":
        return PmQosKnob()
    raise ValueError(f"unknown knob key {key!r}")
