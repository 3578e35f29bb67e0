"""The previous throttle controller, a rung ladder: kept as a policy to compare against.

The daemon ran it until `dsr1d.core.efficiency` replaced it; ``dsr1d simulate --policy ladder``
and ``bench/mitigation.py`` run it on the plants. Pure: samples in, `Action`s out, time from the
samples (an ``apply`` of a rung already active updates its parameters; a ``release`` removes it).

Detection (evidence of throttling; a missing field never counts, either way):

* counter: ``throttle_count`` higher than in the previous sample (both present);
* collapse: ``busy_mhz`` more than ``freq_drop_percent`` below its high over the last
  ``freq_window_s`` (only samples since the controller's last action count, so a drop the
  controller caused itself is not evidence) while ``pkg_temp_c >= target_temp_c - near_limit_c``.

Reported state: ``none`` (no evidence, nothing applied), ``throttling`` (evidence, nothing applied
yet, or mitigation disabled), ``mitigating`` (rungs applied, not yet cooling), ``recovering`` (rungs
applied, evidence clear and the package under ``target_temp_c - release_margin_c``: counting down
to the next release).

Ladder (``MitigationConfig.ladder``, in order; each rung applied at most once):

* ``rapl_pl1``: cap RAPL PL1 at the power the package can sustain under the target, estimated from
  the sample as ``P * (target - ambient) / (T - ambient)`` (steady state of a thermal resistance),
  never above ``pl1_max_fraction`` of the current power nor below ``pl1_min_w``. While it is
  applied the cap is trimmed every ``trim_every_s`` toward holding ``target - trim_below_c``
  (down when hotter, up when cooler and the cap is what limits the package): the heat sink keeps
  warming after the first estimate, which a one-shot estimate cannot know. Params ``{"pl1_w"}``.
* ``no_turbo``: turbo off. Params ``{"no_turbo": 1}``.
* ``epb_balance``: energy-performance bias toward balance. Params ``{"epb": epb_balance}``.
* ``engine_threads``: one engine thread fewer. Params ``{"threads_delta": -threads_step}``.

The first rung is applied on the ``react_after_samples``-th consecutive sample with evidence
(default 1: the first). The next rung follows when evidence has been seen on
``escalate_after_samples`` samples since the previous apply. The most recent rung is released when
the evidence has been clear for ``release_after_s`` with the package under ``target_temp_c -
release_margin_c`` the whole time; the count restarts after each release, so rungs come off one
by one. A rung whose evidence is missing (no package power for ``rapl_pl1``) is skipped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, fields
from typing import Any, Mapping

from dsr1d.core.efficiency import Action

RUNGS = ("rapl_pl1", "no_turbo", "epb_balance", "engine_threads")
STATES = ("none", "throttling", "mitigating", "recovering")


@dataclass(frozen=True)
class Sample:
    """One telemetry sample; None = unavailable (never acted on)."""

    time_s: float
    pkg_temp_c: float | None = None
    busy_mhz: float | None = None          # average busy frequency of the cores in use
    pkg_power_w: float | None = None
    throttle_count: int | None = None      # cumulative thermal throttle events (core + package)
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class MitigationConfig:
    """The profile's ``[mitigation]`` section. Every key is optional; defaults are sane."""

    enabled: bool = True
    target_temp_c: float = 90.0            # package temperature to hold under
    ladder: tuple[str, ...] = RUNGS        # rungs, applied in this order, released in reverse
    release_after_s: float = 30.0          # evidence clear (and cool) this long before a release
    release_margin_c: float = 5.0          # "cool" = under target_temp_c - release_margin_c
    near_limit_c: float = 5.0              # collapse counts at or above target - near_limit_c
    freq_drop_percent: float = 15.0        # collapse: this far under the recent high
    freq_window_s: float = 30.0            # "recent" for that high
    react_after_samples: int = 1           # samples with evidence before the first rung
    escalate_after_samples: int = 2        # evidence samples after an apply before the next rung
    ambient_c: float = 35.0                # cooling-side temperature for the PL1 estimate
    pl1_min_w: float = 30.0                # the PL1 cap never goes under this
    pl1_max_fraction: float = 0.95         # first cap at most this fraction of the current power
    pl1_trim: bool = True                  # keep trimming the cap while rapl_pl1 is applied
    trim_every_s: float = 5.0
    trim_below_c: float = 1.5              # trim toward target - this
    trim_deadband_c: float = 1.0           # no trim within this of that setpoint
    trim_gain_w_per_c: float = 4.0         # watts per °C of error, per trim
    trim_max_step_w: float = 40.0
    epb_balance: int = 6                   # EPB the epb_balance rung sets (6 = normal/balance)
    threads_step: int = 1                  # threads the engine_threads rung takes away

    def __post_init__(self) -> None:
        bad = [r for r in self.ladder if r not in RUNGS]
        if bad:
            raise ValueError(f"unknown ladder rung(s) {', '.join(bad)}; known: {', '.join(RUNGS)}")
        if len(set(self.ladder)) != len(self.ladder):
            raise ValueError("a ladder rung is listed twice")
        if not 0 <= self.epb_balance <= 15:
            raise ValueError("epb_balance must be 0..15")
        if self.react_after_samples < 1 or self.escalate_after_samples < 1:
            raise ValueError("react_after_samples and escalate_after_samples must be >= 1")
        if not 0 < self.freq_drop_percent < 100:
            raise ValueError("freq_drop_percent must be in (0, 100)")
        if self.release_after_s < 0 or self.release_margin_c < 0 or self.threads_step < 1:
            raise ValueError("release_after_s, release_margin_c must be >= 0, threads_step >= 1")
        if not 0 < self.pl1_max_fraction <= 1:
            raise ValueError("pl1_max_fraction must be in (0, 1]")

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> MitigationConfig:
        """Build from a parsed ``[mitigation]`` section (typed values or INI strings); the ladder
        is a comma- or space-separated list. Unknown keys raise ValueError."""
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in section.items():
            if key not in known:
                raise ValueError(f"unknown [mitigation] key {key!r}")
            default = getattr(cls, key) if key != "ladder" else RUNGS
            if key == "ladder":
                if isinstance(value, str):
                    value = tuple(w for w in value.replace(",", " ").split() if w)
                kwargs[key] = tuple(value)
            elif isinstance(default, bool):
                if isinstance(value, str):
                    low = value.strip().lower()
                    if low not in ("1", "0", "yes", "no", "true", "false", "on", "off"):
                        raise ValueError(f"{key}: not a boolean: {value!r}")
                    value = low in ("1", "yes", "true", "on")
                kwargs[key] = bool(value)
            elif isinstance(default, int):
                kwargs[key] = int(value)
            else:
                kwargs[key] = float(value)
        return cls(**kwargs)


def _fmt(value: float | None, unit: str, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f} {unit}"


class Controller:
    """Samples in, actions out. See the module docstring for the rules."""

    def __init__(self, config: MitigationConfig | None = None) -> None:
        self.config = config or MitigationConfig()
        self.state: str = "none"
        self.evidence: dict[str, Any] = {}
        self.active: list[str] = []
        self.params: dict[str, dict[str, Any]] = {}   # rung -> params last applied
        self.history: list[tuple[float, Action]] = []  # every action, with its sample time
        self._prev: Sample | None = None
        self._freq: deque[tuple[float, float]] = deque()   # (time_s, busy_mhz) since last action
        self._power: deque[tuple[float, float]] = deque()  # (time_s, pkg_power_w), freq window
        self._temps: deque[tuple[float, float]] = deque()  # (time_s, pkg_temp_c), trim window
        self._streak = 0             # consecutive evidence samples
        self._since_apply = 0        # evidence samples since the last apply
        self._clear_s = 0.0          # evidence clear and cool for this long
        self._last_trim_s: float | None = None
        self._pl1_ceiling_w: float | None = None

    # -- detection ---------------------------------------------------------------------------

    def _detect(self, s: Sample) -> dict[str, Any]:
        cfg = self.config
        prev = self._prev
        ev: dict[str, Any] = {
            "time_s": s.time_s,
            "pkg_temp_c": s.pkg_temp_c,
            "busy_mhz": s.busy_mhz,
            "pkg_power_w": s.pkg_power_w,
            "throttle_count": s.throttle_count,
            "tokens_per_s": s.tokens_per_s,
            "target_temp_c": cfg.target_temp_c,
        }
        delta = None
        if s.throttle_count is not None and prev is not None and prev.throttle_count is not None:
            delta = s.throttle_count - prev.throttle_count   # < 0: counter reset, not evidence
        ev["throttle_events_delta"] = delta
        ev["counter_rising"] = delta is not None and delta > 0
        high = max((m for _, m in self._freq), default=None)
        ev["recent_high_mhz"] = high
        drop = None
        if s.busy_mhz is not None and high:
            drop = 100.0 * (1.0 - s.busy_mhz / high)
        ev["freq_drop_percent"] = drop
        near = s.pkg_temp_c is not None and s.pkg_temp_c >= cfg.target_temp_c - cfg.near_limit_c
        ev["freq_collapse"] = bool(drop is not None and drop > cfg.freq_drop_percent and near)
        ev["throttling"] = ev["counter_rising"] or ev["freq_collapse"]
        # "clear" needs a channel that could have shown throttling and did not
        ev["evidence_known"] = delta is not None or drop is not None
        ev["missing"] = [k for k in ("pkg_temp_c", "busy_mhz", "pkg_power_w", "throttle_count")
                         if getattr(s, k) is None]
        return ev

    def _why(self, ev: dict[str, Any]) -> str:
        parts = []
        if ev["counter_rising"]:
            parts.append(f"throttle counter +{ev['throttle_events_delta']}")
        if ev["freq_collapse"]:
            parts.append(f"busy {ev['busy_mhz']:.0f} MHz, {ev['freq_drop_percent']:.0f} % under "
                         f"the recent {ev['recent_high_mhz']:.0f} MHz")
        parts.append(f"package {_fmt(ev['pkg_temp_c'], '°C')}, {_fmt(ev['pkg_power_w'], 'W')}")
        return "; ".join(parts)

    # -- the ladder --------------------------------------------------------------------------

    def _rung_params(self, rung: str, s: Sample) -> tuple[dict[str, Any], str] | None:
        """Parameters for applying ``rung`` now and a note on them, or None to skip it."""
        cfg = self.config
        if rung == "rapl_pl1":
            if s.pkg_power_w is None or s.pkg_power_w <= 0:
                return None
            power = s.pkg_power_w
            cap = power * cfg.pl1_max_fraction
            note = f"{cfg.pl1_max_fraction:.0%} of {power:.0f} W"
            if s.pkg_temp_c is not None and s.pkg_temp_c > cfg.ambient_c:
                est = power * (cfg.target_temp_c - cfg.ambient_c) / (s.pkg_temp_c - cfg.ambient_c)
                if est < cap:
                    cap = est
                    note = (f"sustainable estimate {power:.0f} W x ({cfg.target_temp_c:.0f}-"
                            f"{cfg.ambient_c:.0f})/({s.pkg_temp_c:.1f}-{cfg.ambient_c:.0f}) °C")
            cap = max(cfg.pl1_min_w, cap)
            self._pl1_ceiling_w = max([power] + [p for _, p in self._power])
            return {"pl1_w": round(cap, 1)}, f"PL1 {cap:.0f} W ({note})"
        if rung == "no_turbo":
            return {"no_turbo": 1}, "turbo off"
        if rung == "epb_balance":
            return {"epb": cfg.epb_balance}, f"EPB {cfg.epb_balance}"
        if rung == "engine_threads":
            return {"threads_delta": -cfg.threads_step}, f"{cfg.threads_step} engine thread(s) fewer"
        return None

    def _apply_next(self, s: Sample, ev: dict[str, Any], why: str) -> list[Action]:
        for rung in self.config.ladder:
            if rung in self.active:
                continue
            got = self._rung_params(rung, s)
            if got is None:
                continue   # its evidence is missing: try the next rung
            params, note = got
            self.active.append(rung)
            self.params[rung] = params
            step = len(self.active)
            return [Action("apply", rung, f"rung {step} {note}: {why}", dict(params))]
        return []

    def _acted(self, s: Sample, trim: bool = False) -> None:
        """Forget frequency history: what follows an action is measured against itself. An
        apply or release also restarts the escalation and release counts (a trim does not)."""
        self._freq.clear()
        self._last_trim_s = s.time_s
        if not trim:
            self._since_apply = 0
            self._clear_s = 0.0

    def _trim(self, s: Sample) -> list[Action]:
        cfg = self.config
        if ("rapl_pl1" not in self.active or not cfg.pl1_trim or s.pkg_temp_c is None
                or self._last_trim_s is None or s.time_s - self._last_trim_s < cfg.trim_every_s):
            return []
        window = [t for ts, t in self._temps if ts > s.time_s - cfg.trim_every_s]
        mean = sum(window) / len(window)
        setpoint = cfg.target_temp_c - cfg.trim_below_c
        err = mean - setpoint
        cap = float(self.params["rapl_pl1"]["pl1_w"])
        if err > cfg.trim_deadband_c:
            new = max(cfg.pl1_min_w, cap - min(cfg.trim_max_step_w, max(1.0, cfg.trim_gain_w_per_c * err)))
        elif (err < -cfg.trim_deadband_c and s.pkg_power_w is not None
              and s.pkg_power_w >= 0.97 * cap and self._pl1_ceiling_w is not None):
            new = min(self._pl1_ceiling_w, cap + min(cfg.trim_max_step_w, cfg.trim_gain_w_per_c * -err))
        else:
            self._last_trim_s = s.time_s
            return []
        new = round(new, 1)
        self._last_trim_s = s.time_s
        if abs(new - cap) < 0.5:
            return []
        self.params["rapl_pl1"] = {"pl1_w": new}
        reason = (f"trim PL1 {cap:.0f} -> {new:.0f} W: package {mean:.1f} °C over the last "
                  f"{cfg.trim_every_s:.0f} s, setpoint {setpoint:.1f} °C, "
                  f"{_fmt(s.pkg_power_w, 'W')}")
        return [Action("apply", "rapl_pl1", reason, {"pl1_w": new})]

    # -- the step ----------------------------------------------------------------------------

    def step(self, sample: Sample) -> list[Action]:
        """Take one sample; return the actions to apply now (possibly none)."""
        cfg = self.config
        s = sample
        ev = self._detect(s)
        prev_time = self._prev.time_s if self._prev is not None else None
        dt = s.time_s - prev_time if prev_time is not None else 0.0
        actions: list[Action] = []

        if ev["throttling"]:
            self._streak += 1
            self._since_apply += 1
            self._clear_s = 0.0
        else:
            self._streak = 0

        if ev["throttling"] and cfg.enabled:
            why = self._why(ev)
            if not self.active:
                if self._streak >= cfg.react_after_samples:
                    actions = self._apply_next(s, ev, why)
            elif self._since_apply >= cfg.escalate_after_samples:
                actions = self._apply_next(s, ev, f"still throttling after {self.active[-1]}: {why}")
                if not actions:
                    self._since_apply = 0  # ladder exhausted: stay, re-check later
        elif not ev["throttling"] and self.active:
            cool = s.pkg_temp_c is not None and \
                s.pkg_temp_c < cfg.target_temp_c - cfg.release_margin_c
            if s.pkg_temp_c is not None and not cool:
                self._clear_s = 0.0
            elif cool and ev["evidence_known"]:
                self._clear_s += dt
                if self._clear_s >= cfg.release_after_s:
                    rung = self.active.pop()
                    params = self.params.pop(rung, {})
                    if rung == "rapl_pl1":
                        self._pl1_ceiling_w = None
                    reason = (f"clear for {self._clear_s:.0f} s (no throttle evidence, package "
                              f"{s.pkg_temp_c:.1f} °C < {cfg.target_temp_c - cfg.release_margin_c:.1f} °C)")
                    actions = [Action("release", rung, reason, dict(params))]
            # unknown temperature or no evidence channel: the count neither advances nor resets
            if not actions:
                actions = self._trim(s)

        if actions:
            self._acted(s, trim=all(a.reason.startswith("trim ") for a in actions))
        # history for the next sample; after an action the reference starts with the next
        # sample (this one was taken before the action took effect)
        if s.busy_mhz is not None and not actions:
            self._freq.append((s.time_s, s.busy_mhz))
        if s.pkg_power_w is not None:
            self._power.append((s.time_s, s.pkg_power_w))
        if s.pkg_temp_c is not None:
            self._temps.append((s.time_s, s.pkg_temp_c))
        horizon = s.time_s - cfg.freq_window_s
        for dq in (self._freq, self._power):
            while dq and dq[0][0] <= horizon:
                dq.popleft()
        while self._temps and self._temps[0][0] <= s.time_s - max(cfg.trim_every_s, 1.0) * 2:
            self._temps.popleft()
        self._prev = s

        if self.active:
            cool = s.pkg_temp_c is not None and \
                s.pkg_temp_c < cfg.target_temp_c - cfg.release_margin_c
            self.state = "recovering" if (not ev["throttling"] and cool) else "mitigating"
        else:
            self.state = "throttling" if ev["throttling"] else "none"
        ev["state"] = self.state
        ev["active"] = list(self.active)
        ev["clear_for_s"] = self._clear_s
        self.evidence = ev
        for a in actions:
            self.history.append((s.time_s, a))
        return actions
