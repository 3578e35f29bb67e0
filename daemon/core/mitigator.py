"""The daemon's side of throttle mitigation: telemetry samples in, overlays and threads out.

`dsr1d.core.mitigation.Controller` decides (pure); this module turns each sample dict into a
`Sample`, and each `Action` into a Manager overlay (journaled like any profile write, so stop
and crash recovery undo it) or an engine thread change, and reports the state and the active
rungs. A rung whose write the machine refuses is logged once and dropped, never retried blindly.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from dsr1d.constants import (BUSY_MHZ, CPU_MHZ, ENGINE_TOKENS_PER_S, PKG_POWER_W, PKG_TEMP_C,
                             THROTTLE_COUNT)
from dsr1d.core.manager import Manager
from dsr1d.core.mitigation import Action, Controller, MitigationConfig, Sample
from dsr1d.core.tuning import ApplyFailed, TuningError

log = logging.getLogger("dsr1d")

StateListener = Callable[[str, dict[str, Any]], None]
ChangeListener = Callable[[list[str]], None]


def to_sample(values: dict[str, Any], start: float) -> Sample:
    """The controller's view of one telemetry sample (missing values stay None)."""
    mhz = values.get(BUSY_MHZ)
    if mhz is None and values.get(CPU_MHZ):
        mhz = sum(values[CPU_MHZ]) / len(values[CPU_MHZ])
    return Sample(time_s=float(values.get("time_unix_s", start)) - start,
                  pkg_temp_c=values.get(PKG_TEMP_C), busy_mhz=mhz,
                  pkg_power_w=values.get(PKG_POWER_W),
                  throttle_count=values.get(THROTTLE_COUNT),
                  tokens_per_s=values.get(ENGINE_TOKENS_PER_S))


def overlay_for(action: Action) -> dict[str, dict] | None:
    """The profile sections a rung lays over the active profile (None: not a knob rung)."""
    if action.rung == "rapl_pl1":
        # Within the [rapl] schema's range: a wild power reading must not become a wild knob.
        return {"rapl": {"pl1_w": min(2000, max(1, int(round(action.params["pl1_w"]))))}}
    if action.rung == "no_turbo":
        return {"turbo": {"enabled": False}}
    if action.rung == "epb_balance":
        return {"epb": {"epb": int(action.params.get("epb", 6))}}
    return None


class Mitigator:
    """Runs the controller on every sample and applies what it decides."""

    def __init__(self, manager: Manager, set_threads: Callable[[int | None], Any] | None = None,
                 threads: Callable[[], int] | None = None) -> None:
        self.manager = manager
        self.set_threads = set_threads
        self.threads = threads
        self.controller: Controller | None = None
        self.state = "none"
        self.evidence: dict[str, Any] = {}
        self.start: float | None = None
        self.refused: set[str] = set()
        self.threads_before: int | None = None
        self.state_listeners: list[StateListener] = []
        self.change_listeners: list[ChangeListener] = []

    @property
    def active(self) -> list[str]:
        """Active rungs, with their parameters, for the ``Mitigations`` property."""
        if self.controller is None:
            return []
        return [_describe(rung, self.controller.params.get(rung, {}))
                for rung in self.controller.active if rung not in self.refused]

    def configure(self, section: dict[str, Any]) -> None:
        """(Re)build the controller from a profile's ``[mitigation]`` section."""
        config = MitigationConfig.from_section(section)
        if self.controller is not None and self.controller.config == config:
            return
        self.controller = Controller(config) if config.enabled else None
        if self.controller is None:
            self._lift_all("mitigation disabled by the profile")

    def on_sample(self, values: dict[str, Any]) -> None:
        if self.controller is None:
            return
        if self.start is None:
            self.start = float(values.get("time_unix_s", 0.0))
        before = list(self.active)
        for action in self.controller.step(to_sample(values, self.start)):
            self._act(action)
        if self.controller.state != self.state:
            self.state = self.controller.state
            self.evidence = dict(self.controller.evidence)
            log.info("throttle state %s: %s", self.state, self.evidence)
            for listener in self.state_listeners:
                listener(self.state, self.evidence)
            self._changed(["ThrottleState"])
        if self.active != before:
            self._changed(["Mitigations"])

    def _act(self, action: Action) -> None:
        if action.rung in self.refused:
            return
        log.info("mitigation %s %s: %s", action.kind, action.rung, action.reason)
        if action.rung == "engine_threads":
            self._threads(action)
            return
        overlay = overlay_for(action) if action.kind == "apply" else None
        try:
            self.manager.set_overlay(action.rung, overlay, f"mitigation {action.kind} "
                                     f"{action.rung}: {action.reason}")
        except (ApplyFailed, TuningError) as exc:
            self.refused.add(action.rung)
            log.error("mitigation rung %s refused by the machine, not retried: %s",
                      action.rung, exc)

    def _threads(self, action: Action) -> None:
        if self.set_threads is None or self.threads is None:
            return
        # The rung is a cap on the engine's threads, combined with the profile's count in
        # EngineHost.effective_threads: a profile change cannot undo it behind its back.
        if action.kind == "apply":
            current = self.threads()
            if self.threads_before is None:
                self.threads_before = current
            self.set_threads(max(1, current + int(action.params.get("threads_delta", -1))))
        elif self.threads_before is not None:
            self.set_threads(None)
            self.threads_before = None

    def _lift_all(self, reason: str) -> None:
        for rung in list(self.manager.overlays):
            try:
                self.manager.set_overlay(rung, None, reason)
            except (ApplyFailed, TuningError) as exc:
                log.error("could not lift mitigation %s: %s", rung, exc)

    def _changed(self, names: list[str]) -> None:
        for listener in self.change_listeners:
            listener(names)


def _describe(rung: str, params: dict[str, Any]) -> str:
    if rung == "rapl_pl1" and "pl1_w" in params:
        return f"rapl_pl1 {params['pl1_w']:.0f} W"
    if rung == "epb_balance" and "epb" in params:
        return f"epb_balance {params['epb']}"
    return rung
