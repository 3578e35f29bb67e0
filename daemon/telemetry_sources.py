"""Telemetry sources (plugins) and the sampler that merges their readings into one sample.

A source is any object with:

- ``name`` — unique, short (``turbostat``, ``rapl``, ``hwmon``…); the key of its entry in a
  sample's ``unavailable`` map;
- ``probe(root)`` → :class:`~dsr1d.tunable.Support` — usable here or not, and exactly why not;
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
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import pluggy

from .sysroot import SysRoot
from .tunable import Support

log = logging.getLogger("dsr1d")

UNAVAILABLE = "unavailable"
"""The reserved sample key: ``{source_or_source:part: reason}``."""


class Unavailable(Exception):
    """Raised by ``read()`` when the source has nothing true to report this interval."""


class Pending(Unavailable):
    """Nothing to report yet, as expected (a subprocess's first interval): logged at debug."""


class SourceError(Exception):
    """A source broke the contract (no name, a name taken twice, a missing method)."""


class TelemetrySource(Protocol):
    """The contract of a telemetry source (see the module docstring)."""

    name: str

    def probe(self, root: SysRoot) -> Support: ...

    def read(self, root: SysRoot, now: float) -> dict[str, Any]: ...


def collect_sources(pm: pluggy.PluginManager) -> dict[str, TelemetrySource]:
    """Every registered telemetry source by name, in merge order (priority, then name)."""
    from .plugin_manager import collect

    sources = collect(pm, "register_telemetry_sources", "telemetry source", ("probe", "read"))
    return dict(sorted(sources.items(), key=lambda kv: (priority(kv[1]), kv[0])))


def priority(source: Any) -> int:
    value = getattr(source, "priority", 100)
    return value if isinstance(value, int) else 100


@dataclass
class SourceState:
    """What the sampler knows about one source."""

    source: Any
    support: Support | None = None
    started: bool = False


@dataclass
class Sampler:
    """Probes and starts every source once, then merges their readings into samples.

    ``sample()`` returns ``{key_with_unit: value, ..., "time_unix_s": t,
    "unavailable": {name: reason}}``. Sources are merged in priority order; the first source
    to give a key keeps it (``provenance`` says which one did, for the last sample).
    """

    root: SysRoot
    sources: dict[str, Any]
    clock: Any = time.time
    states: dict[str, SourceState] = field(default_factory=dict)
    provenance: dict[str, str] = field(default_factory=dict)
    latest: dict[str, Any] = field(default_factory=dict)
    _logged: set[tuple[str, str]] = field(default_factory=set)

    @classmethod
    def from_manager(cls, pm: pluggy.PluginManager, root: SysRoot | str = "/") -> Sampler:
        sysroot = root if isinstance(root, SysRoot) else SysRoot(root)
        return cls(sysroot, collect_sources(pm))

    def start(self) -> dict[str, Support]:
        """Probe every source, start those that work; returns each source's support."""
        out: dict[str, Support] = {}
        for name, source in self.sources.items():
            state = SourceState(source)
            self.states[name] = state
            try:
                support = source.probe(self.root)
                if not isinstance(support, Support):
                    raise SourceError(f"probe() returned {support!r}, not a Support")
            except Exception as exc:  # a plugin's bug must not stop the daemon
                support = Support(False, f"probe failed: {type(exc).__name__}: {exc}")
            if support.supported and callable(getattr(source, "start", None)):
                try:
                    source.start(self.root)
                except Exception as exc:
                    support = Support(False, f"start failed: {type(exc).__name__}: {exc}")
            state.support = support
            state.started = support.supported
            if not support.supported:
                self._note(name, support.detail, level=logging.INFO)
            out[name] = support
        return out

    def stop(self) -> None:
        """Stop every started source (subprocesses, file handles)."""
        for name, state in self.states.items():
            stop = getattr(state.source, "stop", None)
            if state.started and callable(stop):
                try:
                    stop()
                except Exception as exc:
                    log.warning("telemetry source %s: stop failed: %s", name, exc)
            state.started = False

    def sample(self) -> dict[str, Any]:
        """One fresh sample: every started source read once, merged."""
        if not self.states:
            self.start()
        now = self.clock()
        sample: dict[str, Any] = {"time_unix_s": now}
        unavailable: dict[str, str] = {}
        provenance: dict[str, str] = {}
        for name, state in self.states.items():
            if not state.started:
                unavailable[name] = state.support.detail if state.support else "not started"
                continue
            provides = getattr(state.source, "provides", None)
            if provides and all(key in sample for key in provides):
                continue  # a fallback whose every key a preferred source already measured
            try:
                values = state.source.read(self.root, now)
            except Unavailable as exc:
                unavailable[name] = str(exc) or "unavailable"
                if isinstance(exc, Pending):
                    log.debug("telemetry %s: %s", name, unavailable[name])
                else:
                    self._note(name, unavailable[name])
                continue
            except OSError as exc:
                unavailable[name] = describe_oserror(exc)
                self._note(name, unavailable[name])
                continue
            except Exception as exc:
                unavailable[name] = f"read failed: {type(exc).__name__}: {exc}"
                if (name, unavailable[name]) not in self._logged:
                    log.exception("telemetry source %s: read failed", name)
                    self._logged.add((name, unavailable[name]))
                continue
            if not isinstance(values, dict):
                unavailable[name] = f"read() returned {type(values).__name__}, not a dict"
                self._note(name, unavailable[name])
                continue
            for part, reason in (values.get(UNAVAILABLE) or {}).items():
                key = f"{name}:{part}"
                unavailable[key] = str(reason)
                self._note(key, str(reason))
            for key, value in values.items():
                if key == UNAVAILABLE or key in sample or value is None:
                    continue
                sample[key] = value
                provenance[key] = name
        sample[UNAVAILABLE] = unavailable
        self.provenance = provenance
        self.latest = sample
        return sample

    def _note(self, key: str, reason: str, level: int = logging.WARNING) -> None:
        """Log each distinct (what, why) once for the life of the sampler."""
        if (key, reason) in self._logged:
            return
        self._logged.add((key, reason))
        log.log(level, "telemetry %s unavailable: %s", key, reason)


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
