"""The sampler: merges the telemetry sources' readings into one sample, containing each
source's faults (the source contract is in :mod:`dsr1d.contract.telemetry`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import pluggy

from dsr1d.contract.sysroot import SysRoot
from dsr1d.contract.telemetry import (UNAVAILABLE, Pending, TelemetrySource, Unavailable,
                                      describe_oserror)
from dsr1d.contract.tunable import Support

log = logging.getLogger("dsr1d")

class SourceError(Exception):
    """A source broke the contract (no name, a name taken twice, a missing method)."""


def collect_sources(pm: pluggy.PluginManager) -> dict[str, TelemetrySource]:
    """Every registered telemetry source by name, in merge order (priority, then name)."""
    from dsr1d.core.plugin_manager import collect

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


