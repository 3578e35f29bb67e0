"""Telemetry sources (plugins) and the sampler that merges their readings into one sample.

A source is any object with:

- ``name`` — unique, short (``turbostat``, ``rapl``, ``hwmon``…); the key of its entry in a
  sample's ``unavailable`` map;
- ``probe(root)`` → :class:`~dsr1d.contract.tunable.Support` — usable here or not, and exactly why not;
- ``start(root)`` / ``stop()`` (optional) — discover and cache paths, own a subprocess…;
- ``read(root, now)`` → ``{key_with_unit: value}`` — what it measured since its last read.

Optional: ``priority`` (int, default 100; lower wins when two sources give the same key, so
turbostat's APERF/MPERF ``cpu_mhz`` beats cpufreq's), ``provides`` (a set of keys: the source
is not read at all when a preferred source already gave every one of them — a fallback costs
nothing while the better source works) and ``summary`` (one line for people).

A source never invents a value. When it cannot measure something it leaves the key out and
says why: raising :class:`Unavailable` (the whole source, this interval), or returning the
reserved key ``"unavailable"`` mapped to ``{part: reason}`` for parts of it (one RAPL domain,
one vanished sensor). The sampler turns both into ``sample["unavailable"]`` entries
(``"rapl"`` or ``"rapl:package-0"``) and logs every distinct fault once. Any other exception
from a source is contained the same way: the sampler never dies for a plugin.

Sources keep the paths they discover at ``start()`` and re-discover only when a read fails
(hotplug), so a 1 Hz sample costs a few dozen small reads.
"""

from __future__ import annotations

import errno as errno_mod
import functools
import os
from typing import Any, Callable, Protocol

from dsr1d.contract.sysroot import SysRoot
from dsr1d.contract.tunable import Support

UNAVAILABLE = "unavailable"
"""The reserved sample key: ``{source_or_source:part: reason}``."""


class Unavailable(Exception):
    """Raised by ``read()`` when the source has nothing true to report this interval."""


class Pending(Unavailable):
    """Nothing to report yet, as expected (a subprocess's first interval): logged at debug."""


class TelemetrySource(Protocol):
    """The contract of a telemetry source (see the module docstring)."""

    name: str

    def probe(self, root: SysRoot) -> Support: ...

    def read(self, root: SysRoot, now: float) -> dict[str, Any]: ...


def describe_oserror(exc: OSError, path: str | None = None) -> str:
    """``/sys/...: ENOENT (No such file or directory)``."""
    name = errno_mod.errorcode.get(exc.errno or 0, str(exc.errno))
    where = path or exc.filename or ""
    text = f"{name} ({exc.strerror or exc})"
    return f"{where}: {text}" if where else text


def sanitize(text: str) -> str:
    """A key fragment: lower case, runs of anything but letters and digits become ``_``."""
    out = []
    prev_sep = True
    for ch in text.strip().lower():
        if ch.isascii() and ch.isalnum():
            out.append(ch)
            prev_sep = False
        elif not prev_sep:
            out.append("_")
            prev_sep = True
    return "".join(out).strip("_") or "unnamed"


# -- cheap reads of paths found once -------------------------------------------------------------
#
# A source resolves its paths through the SysRoot once (``root.display(rel)``: the absolute path
# below the root) and re-reads them every sample with three system calls and no pathlib, which
# is most of what keeps a sample of a 100-CPU machine near a millisecond.


def read_attr(path: str) -> str:
    """The stripped text of a kernel attribute at the absolute ``path``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.read(fd, 4097)
    finally:
        os.close(fd)
    if len(data) > 4096:
        raise OSError(errno_mod.EFBIG, "more than 4096 bytes: not a kernel attribute", path)
    return data.decode().strip()


def read_int(path: str) -> int:
    """An integer attribute (``ValueError`` when it holds anything else)."""
    return int(read_attr(path))


def msr_reader(root: SysRoot, cpu: int) -> Callable[[int], int]:
    """A function reading 64-bit registers of ``cpu`` (through :meth:`SysRoot.read_msr`)."""
    return functools.partial(root.read_msr, cpu)
