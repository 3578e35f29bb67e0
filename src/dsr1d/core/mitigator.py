"""The daemon's side of throttle mitigation: telemetry samples in, overlays out.

`dsr1d.core.efficiency.EfficiencyController` decides (pure); this module turns each sample dict
into an `Observation`, and each `Action` into a Manager overlay (journaled like any profile
write, so stop and crash recovery undo it), and reports the state and the active actuators. An
actuator whose write the machine refuses is logged once and given up, never retried blindly;
the controller then uses the other one.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from dsr1d.constants import (BUSY_MHZ, CEILING_MHZ, CPU_MAX_MHZ, CPU_MHZ, CPU_MIN_MHZ,
                             ENGINE_GB_PER_TOKEN, ENGINE_TOKENS_PER_S, LIMIT_REASONS, ONLINE_CPUS,
                             PKG_POWER_PACKAGES_W, PKG_POWER_W, PKG_TEMP_C, PL1_PACKAGES_W, PL1_W,
                             TCC_OFFSET_C, THROTTLE_COUNT, THROTTLE_MS, TJ_MAX_C,
                             UNCORE_LIMIT_MHZ, UNCORE_MAX_MHZ, UNCORE_MIN_MHZ)
from dsr1d.core.efficiency import (Action, EfficiencyConfig, EfficiencyController, Observation,
                                  RungParams)
from dsr1d.core.manager import Manager
from dsr1d.core.tuning import ApplyFailed, TuningError

log = logging.getLogger("dsr1d")

StateListener = Callable[[str, dict[str, Any]], None]
ChangeListener = Callable[[list[str]], None]


def to_observation(values: dict[str, Any], start: float, threads: int | None = None,
                   pl1_firmware_w: float | None = None,
                   pl1_firmware_packages_w: list[float] | None = None) -> Observation:
    """The controller's view of one telemetry sample (missing values stay None)."""
    mhz = busy_mhz(values)
    limit = None
    if values.get(TJ_MAX_C) is not None:
        limit = float(values[TJ_MAX_C]) - float(values.get(TCC_OFFSET_C) or 0)
    return Observation(
        time_s=float(values.get("time_unix_s", start)) - start,
        tokens_per_s=values.get(ENGINE_TOKENS_PER_S), busy_mhz=mhz,
        pkg_power_w=values.get(PKG_POWER_W), pkg_temp_c=values.get(PKG_TEMP_C),
        throttle_count=values.get(THROTTLE_COUNT), throttle_ms=values.get(THROTTLE_MS),
        limit_reasons=values.get(LIMIT_REASONS), online_cpus=values.get(ONLINE_CPUS),
        threads=threads, limit_temp_c=limit, ceiling_mhz=values.get(CEILING_MHZ),
        max_mhz=values.get(CPU_MAX_MHZ), min_mhz=values.get(CPU_MIN_MHZ),
        pl1_w=values.get(PL1_W), pl1_firmware_w=pl1_firmware_w,
        pkg_power_packages_w=_tuple(values.get(PKG_POWER_PACKAGES_W)),
        pl1_packages_w=_tuple(values.get(PL1_PACKAGES_W)),
        pl1_firmware_packages_w=_tuple(pl1_firmware_packages_w),
        gb_per_token=values.get(ENGINE_GB_PER_TOKEN),
        uncore_max_mhz=values.get(UNCORE_MAX_MHZ), uncore_min_mhz=values.get(UNCORE_MIN_MHZ),
        uncore_limit_mhz=values.get(UNCORE_LIMIT_MHZ))


def busy_mhz(values: dict[str, Any]) -> float | None:
    """The decoding CPUs' clock: turbostat's or APERF/MPERF's busy MHz (idle CPUs weigh nothing
    there); else cpufreq's per-CPU MHz weighted by each CPU's utilisation, so that idle CPUs do
    not dilute it (a plain mean where the two lists do not match)."""
    if values.get(BUSY_MHZ) is not None:
        return float(values[BUSY_MHZ])
    mhz: list[float] | None = values.get(CPU_MHZ)
    util: list[float] | None = values.get("cpu_util_percent")
    if not mhz:
        return None
    if util and len(util) == len(mhz) and sum(util) > 0:
        return sum(m * u for m, u in zip(mhz, util)) / sum(util)
    return sum(mhz) / len(mhz)


def _tuple(values: Any) -> tuple[float, ...] | None:
    return tuple(float(v) for v in values) if isinstance(values, (list, tuple)) else None


def overlay_for(action: Action) -> dict[str, dict[str, Any]] | None:
    """The profile sections an apply lays over the active profile (None: not a knob)."""
    if action.rung == "freq_ceiling":
        return {"cpufreq": {"max_mhz": int(round(action.params["mhz"]))}}
    if action.rung == "rapl_pl1":
        # Within the [rapl] schema's range: a wild power reading must not become a wild knob.
        watts = action.params["pl1_w"]
        each = [min(2000, max(1, int(round(w)))) for w in
                (watts if isinstance(watts, list) else [watts])]
        return {"rapl": {"pl1_w": each if isinstance(watts, list) else each[0]}}
    if action.rung == "uncore_ceiling":
        return {"uncore": {"max_mhz": int(round(action.params["mhz"]))}}
    return None


class Mitigator:
    """Runs the controller on every sample and applies what it decides."""

    def __init__(self, manager: Manager, threads: Callable[[], int] | None = None) -> None:
        self.manager = manager
        self.threads = threads
        self.controller: EfficiencyController | None = None
        self.state = "none"
        self.evidence: dict[str, Any] = {}
        self.start: float | None = None
        self.pl1_firmware_w: float | None = None
        self.pl1_firmware_packages_w: list[float] | None = None
        self.state_listeners: list[StateListener] = []
        self.change_listeners: list[ChangeListener] = []

    @property
    def active(self) -> list[str]:
        """Active actuators, with their values, for the ``Mitigations`` property."""
        if self.controller is None:
            return []
        return [_describe(rung, self.controller.params.get(rung, {}))
                for rung in self.controller.active]

    def configure(self, section: dict[str, Any]) -> None:
        """(Re)build the controller from a profile's ``[mitigation]`` section."""
        config = EfficiencyConfig.from_section(section)
        if self.controller is not None and self.controller.config == config:
            return
        self._lift_all("mitigation reconfigured by the profile")
        self.controller = EfficiencyController(config) if config.enabled else None

    def on_sample(self, values: dict[str, Any]) -> None:
        if self.controller is None:
            return
        if self.start is None:
            self.start = float(values.get("time_unix_s", 0.0))
        if "rapl_pl1" not in self.controller.active and values.get(PL1_W) is not None:
            # the limit before this controller lowered it: never raised above
            self.pl1_firmware_w = float(values[PL1_W])
            packages = values.get(PL1_PACKAGES_W)
            self.pl1_firmware_packages_w = [float(v) for v in packages] if packages else None
        before = list(self.active)
        observation = to_observation(values, self.start,
                                     self.threads() if self.threads else None,
                                     self.pl1_firmware_w, self.pl1_firmware_packages_w)
        for action in self.controller.step(observation):
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
        assert self.controller is not None
        log.info("mitigation %s %s: %s", action.kind, action.rung, action.reason)
        overlay = overlay_for(action) if action.kind == "apply" else None
        try:
            self.manager.set_overlay(action.rung, overlay, f"mitigation {action.kind} "
                                     f"{action.rung}: {action.reason}")
        except (ApplyFailed, TuningError) as exc:
            self.controller.refuse(action.rung)
            log.error("mitigation %s refused by the machine, not retried: %s", action.rung, exc)

    def _lift_all(self, reason: str) -> None:
        for rung in list(self.manager.overlays):
            try:
                self.manager.set_overlay(rung, None, reason)
            except (ApplyFailed, TuningError) as exc:
                log.error("could not lift mitigation %s: %s", rung, exc)

    def _changed(self, names: list[str]) -> None:
        for listener in self.change_listeners:
            listener(names)


def _describe(rung: str, params: RungParams) -> str:
    if rung == "freq_ceiling" and "mhz" in params:
        return f"freq_ceiling {params['mhz']:.0f} MHz"
    if rung == "rapl_pl1" and "pl1_w" in params:
        watts = params["pl1_w"] if isinstance(params["pl1_w"], list) else [params["pl1_w"]]
        return "rapl_pl1 " + "+".join(f"{w:.0f}" for w in watts) + " W"
    if rung == "uncore_ceiling" and "mhz" in params:
        return f"uncore_ceiling {params['mhz']:.0f} MHz"
    return rung
