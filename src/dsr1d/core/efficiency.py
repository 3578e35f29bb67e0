"""Closed-loop control on tokens per joule: samples in, actions out (pure, no I/O, no clock).

The objective: the lowest energy per token while sustained decode keeps within ``delta_percent``
of the best tokens/s the machine showed in this decode, and the package under its thermal limit
before the hardware has to step in. Two actuators: a **frequency ceiling** (cpufreq
``scaling_max_freq``), and where there is none a **PL1 cap**, only ever lowered from the
firmware's value. Time comes from the samples.

When it acts
------------
Only in *steady decode*: the engine's tokens/s, the busy frequency and the package power all
present, tokens/s at least ``min_tokens_per_s``, the thread count unchanged, for ``steady_s``.
A missing value is never evidence: without power (a VM) it never acts. When decode has stopped
for ``release_idle_s`` every cap is lifted.

What it learns
--------------
Samples more than ``settle_s`` after the last change are averaged into windows of ``dwell_s``;
each window is one point (f, R, P): busy MHz, tokens/s, package watts. Decode time per token is
memory time plus compute time, so over the recent points it fits ``1/R = a + b/f`` by least
squares (natural variation counts: a PL2 budget running out or the hardware's own throttling
gives two frequencies for free). With no spread in f it probes ``probe_bins`` bins down. The
throughput floor ``R >= (1 - delta) * R_best`` gives the lowest frequency worth running::

    f_energy = b / (1 / ((1 - delta) * R_best) - a)          (the top when the floor is unreachable)

Power rises with f faster than tokens/s, so that lowest f is also the cheapest per token; a
window that lands under the floor is a point like any other and moves the fit back up, and the
ceiling never again goes at or under a ceiling that broke the floor (until the next decode).

Noise: a real engine's tokens/s moves a few per cent from sample to sample. Each window carries
the standard error of its mean (``se``); the best tokens/s is the best ``R - 2 se`` (the best of
many noisy windows is not the best decode), a window breaks the floor only when ``R + 2 se`` is
under it, and ``f_energy`` uses the slope two standard errors steeper (``se_b``: from the
scatter about the line or the windows' own noise, the larger), turned about the points' centre.
So a ceiling goes only as low as the evidence carries; with exact readings only the scatter of
the decode curve about ``1/R = a + b/f`` widens it (a point or two of J/token on a sharp knee).

Thermal guard
-------------
The limit is ``limit_temp_c`` or the machine's TjMax minus the TCC offset (or 95 °C); the set
point is ``limit_margin_c`` under it. Since the last change the temperature is fitted as a first
order lag, ``T[k+1] = alpha T[k] + c``: ``T_ss = c / (1 - alpha)``, ``tau = -dt / ln(alpha)``,
and the time to the set point ``t_hit = tau ln((T_ss - T) / (T_ss - T_set))``. When ``t_hit`` is
under ``horizon_s`` (or the package is already there) the power that would settle at the set point
is ``P_set = P_base + (P - P_base) (T_set - T_base) / (T_ss - T_base)`` (``T_base``/``P_base``:
the idle package before decode), and the frequency for it comes from ``P ~ p0 + k f^2.5``; with
more than a quarter of the horizon left the cut is one bin and the next decision sees a fresh fit
(a fit over a short stretch takes the die and the heat sink's slow rise for one lag and
overshoots ``T_ss``). Hardware throttle evidence (throttle time rising, thermal limit-reason
bits) lowers the ceiling one bin under the busy frequency at once (the guard was late), never
more than ``max_move_bins`` under the ceiling in force: under an external PROCHOT# the busy
frequency is the floor clock's. The guard is relaxed a bin at a
time while the temperature predicted one bin up stays under the set point, at most one bin per
``horizon_s / 2``: the heat over the idle package is taken as proportional to the power over it,
and the power one bin up comes from the measured windows' slope dP/df (``(f'/f)^2.5`` of the
dynamic power when they do not span a bin). The set point sits ``limit_margin_c`` (1.5 °C)
under the limit: over a 1 °C sensor reading and the TCC's own hysteresis (0.5–2 °C), and every
degree further under costs frequency on a plant the heat limits (about 25 MHz a degree on the
ensemble's heat sinks). The ceiling applied is
``min(f_energy, f_thermal)``, in whole bins of ``step_mhz``.

Counters that jump when a CPU comes online (its boot-time throttle counts) are rebased, not read
as throttling.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, Mapping


STATES = ("none", "learning", "efficient", "mitigating", "throttling", "recovering")
RUNGS = ("freq_ceiling", "rapl_pl1")
URGENT_FRACTION = 0.25          # t_hit under this share of the horizon: cut at once
POWER_EXPONENT = 2.5            # dynamic power ~ V(f)^2 f with V rising with f
DEFAULT_LIMIT_C = 95.0


@dataclass(frozen=True)
class Action:
    """One decision: ``apply`` (or re-apply with new params) or ``release`` a rung, and why."""

    kind: str            # "apply" | "release"
    rung: str            # "freq_ceiling" | "rapl_pl1" (the ladder: its own rung names)
    reason: str          # one line, with the evidence numbers
    params: dict = field(default_factory=dict)


def _setting(default: Any, help: str, lo: float | None = None, hi: float | None = None,
             unit: str = "") -> Any:
    return field(default=default, metadata={"help": help, "lo": lo, "hi": hi, "unit": unit})


@dataclass(frozen=True)
class EfficiencyConfig:
    """The profile's ``[mitigation]`` section: every field is a key (see `settings`)."""

    enabled: bool = _setting(True, "run the controller")
    delta_percent: float = _setting(2.0, "sustained tokens/s may fall this far below the best "
                                    "this decode showed", 0.0, 50.0, "%")
    limit_temp_c: float = _setting(0.0, "thermal limit; 0 = the hardware's TjMax minus the TCC "
                                   "offset (95 °C where unknown)", 0.0, 125.0, "°C")
    limit_margin_c: float = _setting(1.5, "hold the package this far under the limit", 0.0,
                                     30.0, "°C")
    horizon_s: float = _setting(60.0, "act when the limit is predicted sooner than this", 0.0,
                                3600.0, "s")
    steady_s: float = _setting(30.0, "decode steady this long before any action", 1.0, 3600.0,
                               "s")
    settle_s: float = _setting(3.0, "samples this soon after a change are not measured", 0.0,
                               120.0, "s")
    dwell_s: float = _setting(10.0, "one measuring window", 1.0, 600.0, "s")
    step_mhz: float = _setting(100.0, "one frequency bin", 10.0, 1000.0, "MHz")
    probe_bins: int = _setting(2, "a probe goes this many bins under the busy frequency", 1, 20,
                               "bins")
    max_move_bins: int = _setting(6, "one move changes the ceiling by at most this", 1, 100,
                                  "bins")
    fit_points: int = _setting(6, "recent windows the fit uses", 2, 100, "windows")
    min_tokens_per_s: float = _setting(0.1, "under this the engine is not decoding", 0.0, 1e6,
                                       "tok/s")
    release_idle_s: float = _setting(30.0, "decode stopped this long: every cap is lifted", 0.0,
                                     3600.0, "s")
    pl1: bool = _setting(True, "cap PL1 (never above the firmware's) where there is no "
                         "frequency ceiling")
    pl1_min_w: float = _setting(10.0, "a PL1 cap never goes under this", 1.0, 5000.0, "W")

    def __post_init__(self) -> None:
        for f in fields(self):
            lo, hi, value = f.metadata["lo"], f.metadata["hi"], getattr(self, f.name)
            if lo is not None and not (lo <= value <= hi):
                raise ValueError(f"{f.name} = {value} is outside {lo:g}..{hi:g}")

    @classmethod
    def from_section(cls, section: Mapping[str, Any]) -> EfficiencyConfig:
        """From a parsed ``[mitigation]`` section (values already typed by the profile schema,
        or INI strings); an unknown key raises ValueError."""
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in section.items():
            if key not in known:
                raise ValueError(f"unknown [mitigation] key {key!r}")
            kwargs[key] = _coerce(known[key].type, value, key)
        return cls(**kwargs)


def settings() -> list[tuple[str, str, Any, str, float | None, float | None, str]]:
    """(name, type, default, help, lo, hi, unit) for every `EfficiencyConfig` key: the profile
    schema, the shipped documentation and the man page are generated from this."""
    return [(f.name, str(f.type), f.default, f.metadata["help"], f.metadata["lo"],
             f.metadata["hi"], f.metadata["unit"]) for f in fields(EfficiencyConfig)]


def _coerce(kind: Any, value: Any, key: str) -> Any:
    kind = str(kind)
    if kind == "bool":
        if isinstance(value, str):
            low = value.strip().lower()
            if low not in ("1", "0", "yes", "no", "true", "false", "on", "off"):
                raise ValueError(f"{key}: not a boolean: {value!r}")
            return low in ("1", "yes", "true", "on")
        return bool(value)
    try:
        return int(value) if kind == "int" else float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key}: not a number: {value!r}") from None


@dataclass(frozen=True)
class Observation:
    """One telemetry sample as the controller sees it; None = unavailable (never acted on)."""

    time_s: float
    tokens_per_s: float | None = None
    busy_mhz: float | None = None          # mean busy frequency of the CPUs that decode
    pkg_power_w: float | None = None
    pkg_temp_c: float | None = None
    throttle_count: int | None = None      # cumulative thermal throttle events
    throttle_ms: float | None = None       # cumulative thermal throttle time (max over CPUs)
    limit_reasons: int | None = None       # MSR 0x64F low bits
    online_cpus: int | None = None
    threads: int | None = None             # engine decode threads
    limit_temp_c: float | None = None      # TjMax - TCC offset
    ceiling_mhz: float | None = None       # scaling_max_freq as read back
    max_mhz: float | None = None           # cpuinfo_max_freq: None = no frequency ceiling
    min_mhz: float | None = None
    pl1_w: float | None = None             # PL1 as read back
    pl1_firmware_w: float | None = None    # the firmware's PL1 (None: PL1 not writable)
    pkg_power_packages_w: tuple | None = None     # per package (two sockets or more)
    pl1_packages_w: tuple | None = None           # read back, per package
    pl1_firmware_packages_w: tuple | None = None  # the firmware's, per package


Point = tuple[float, float, float, float]      # busy MHz, tokens/s, watts, tokens/s std. error


@dataclass
class _Window:
    start_s: float
    n: int = 0
    f: float = 0.0
    r: float = 0.0
    r2: float = 0.0
    p: float = 0.0

    def add(self, o: Observation) -> None:
        self.n += 1
        self.f += o.busy_mhz or 0.0
        self.r += o.tokens_per_s or 0.0
        self.r2 += (o.tokens_per_s or 0.0) ** 2
        self.p += o.pkg_power_w or 0.0

    def point(self) -> Point:
        """The window's means and the standard error of its tokens/s (0 from a single sample)."""
        mean = self.r / self.n
        var = max(0.0, self.r2 / self.n - mean * mean) * self.n / (self.n - 1) \
            if self.n > 1 else 0.0
        return self.f / self.n, mean, self.p / self.n, math.sqrt(var / self.n)


def _watts(values: list[float]) -> str:
    return "+".join(f"{v:.0f}" for v in values) + " W"


def fit_inverse(points: list[Point]) -> tuple[float, float, float, float] | None:
    """Least squares of ``1/R = a + b/f`` (f in MHz): ``(a, b, se_b, mean of 1/f)``, ``se_b``
    the standard error of ``b`` from the scatter about the line or the windows' own noise,
    whichever is larger; None without a spread of at least 1 %."""
    use = [(f, r, se) for f, r, _, se in points if f > 0 and r > 0]
    xs = [1.0 / f for f, _, _ in use]
    ys = [1.0 / r for _, r, _ in use]
    line = least_squares(xs, ys) if len(xs) >= 2 and max(xs) >= min(xs) * 1.01 else None
    if line is None:
        return None
    mx, my, b = line
    sxx = sum((x - mx) ** 2 for x in xs)
    noise = sum((se / r ** 2) ** 2 for _, r, se in use) / len(use)      # var(1/R) of a window
    if len(use) > 2:
        a0 = my - b * mx
        noise = max(noise, sum((y - a0 - b * x) ** 2 for x, y in zip(xs, ys)) / (len(use) - 2))
    b = max(0.0, b)             # more frequency never slows decode: noise, not physics
    return my - b * mx, b, math.sqrt(noise / sxx), mx


def least_squares(xs: list[float], ys: list[float],
                  min_sxx: float = 0.0) -> tuple[float, float, float] | None:
    """(mean x, mean y, slope) of the least-squares line through the points; None where the x
    values spread no more than ``min_sxx`` (their summed squared deviation)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx <= min_sxx:
        return None
    return mx, my, sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx


class EfficiencyController:
    """Samples in, actions out. See the module docstring for the rules."""

    def __init__(self, config: EfficiencyConfig | None = None) -> None:
        self.config = config or EfficiencyConfig()
        self.state = "none"
        self.evidence: dict[str, Any] = {}
        self.active: list[str] = []
        self.params: dict[str, dict[str, Any]] = {}
        self.history: list[tuple[float, Action]] = []
        self._prev: Observation | None = None
        self._steady_since: float | None = None
        self._idle_since: float | None = None
        self._threads: int | None = None
        self._changed_s = -math.inf
        self._window: _Window | None = None
        self._points: deque[Point] = deque(maxlen=self.config.fit_points)
        self._r_best = 0.0
        self._bad_mhz = 0.0                     # a ceiling at or under this broke the floor
        self._temps: list[tuple[float, float]] = []
        self._base: tuple[float, float] | None = None   # (T, P) idle before decode
        self._thermal_mhz: float | None = None
        self._energy_mhz: float | None = None
        self._probing = False
        self._fitted = False
        self._refused: set[str] = set()          # actuators the machine would not take

    # -- the step ----------------------------------------------------------------------------

    def refuse(self, rung: str) -> None:
        """The machine refused ``rung``'s write: forget it was applied, never use it again."""
        self._refused.add(rung)
        if rung in self.active:
            self.active.remove(rung)
        self.params.pop(rung, None)
        if rung == "freq_ceiling":
            self._energy_mhz = self._thermal_mhz = None
            self._probing = False

    def step(self, o: Observation) -> list[Action]:
        """Take one sample; return the actions to apply now (possibly none)."""
        cfg = self.config
        actions: list[Action] = []
        decoding = self._decoding(o)
        throttled = self._hardware_throttled(o)
        if not decoding:
            self._steady_since = None
            self._window = None
            self._note_idle(o)
            if self.active and self._idle_since is not None and \
                    o.time_s - self._idle_since >= cfg.release_idle_s:
                actions = self._release_all(f"decode stopped {o.time_s - self._idle_since:.0f} s "
                                            "ago")
        else:
            self._idle_since = None
            if self._steady_since is None or o.threads != self._threads:
                self._steady_since, self._threads = o.time_s, o.threads
                self._window, self._temps = None, []
                self._points.clear()
                self._r_best, self._bad_mhz = 0.0, 0.0
                self._fitted = False
            if cfg.enabled:
                actions = self._decide(o, throttled)
        self._prev = o
        self._set_state(o, decoding, throttled)
        for a in actions:
            self.history.append((o.time_s, a))
        return actions

    def _decoding(self, o: Observation) -> bool:
        cfg = self.config
        return (o.tokens_per_s is not None and o.tokens_per_s >= max(cfg.min_tokens_per_s, 1e-9)
                and o.busy_mhz is not None and o.pkg_power_w is not None)

    def _note_idle(self, o: Observation) -> None:
        if self._idle_since is None:
            self._idle_since = o.time_s
        if o.pkg_temp_c is not None and o.pkg_power_w is not None and \
                (o.tokens_per_s or 0.0) < self.config.min_tokens_per_s:
            self._base = (o.pkg_temp_c, o.pkg_power_w)

    def _hardware_throttled(self, o: Observation) -> bool:
        """The hardware limited the clock for heat since the last sample (rebased on hotplug)."""
        prev = self._prev
        if prev is None or (o.online_cpus != prev.online_cpus):
            return False
        rising = (o.throttle_ms is not None and prev.throttle_ms is not None
                  and o.throttle_ms > prev.throttle_ms)
        bits = o.limit_reasons is not None and bool(o.limit_reasons & 0b11)
        return rising or bits

    # -- deciding ----------------------------------------------------------------------------

    def _decide(self, o: Observation, throttled: bool) -> list[Action]:
        cfg = self.config
        settled = o.time_s - self._changed_s >= cfg.settle_s
        completed = False
        if settled:
            completed = self._measure(o)
            if o.pkg_temp_c is not None:
                self._temps.append((o.time_s, o.pkg_temp_c))
                del self._temps[:-600]
        if o.time_s - self._steady_since < cfg.steady_s:
            return []
        if not o.max_mhz or "freq_ceiling" in self._refused:   # no ceiling to set: PL1 only
            return self._pl1_guard(o, throttled)
        if throttled and o.busy_mhz is not None and o.time_s - self._changed_s >= 1.0:
            # under a floor clamp (PROCHOT#) the busy clock is the floor's: never more than
            # one move's worth under the ceiling in force
            applied = self._applied_mhz(o)
            self._thermal_mhz = self._bin_down(max(min(o.busy_mhz, applied) - cfg.step_mhz,
                                                   applied - cfg.max_move_bins * cfg.step_mhz), o)
            return self._move(o, "the hardware throttled (throttle time or thermal limit bits): "
                                 "one bin under the busy frequency, at most "
                                 f"{cfg.max_move_bins} bins under the ceiling")
        if not settled:
            return []
        thermal_note = self._thermal(o)
        energy_note = self._energy(o) if completed else None
        if thermal_note is None and energy_note is None:
            return []
        return self._move(o, "; ".join(n for n in (thermal_note, energy_note) if n))

    def _measure(self, o: Observation) -> bool:
        """Add ``o`` to the open window; True when that completed a window (a new point)."""
        cfg = self.config
        if self._window is None:
            self._window = _Window(o.time_s)
        self._window.add(o)
        period = o.time_s - self._prev.time_s if self._prev is not None else 1.0
        if o.time_s - self._window.start_s + period + 1e-9 >= cfg.dwell_s:
            point = self._window.point()
            self._points.append(point)
            _, r, _, se = point
            # two standard errors: the best of many noisy windows is not the best decode
            self._r_best = max(self._r_best, r - 2 * se)
            floor = (1 - cfg.delta_percent / 100) * self._r_best
            if r + 2 * se < floor and "freq_ceiling" in self.active:
                self._bad_mhz = max(self._bad_mhz, self.params["freq_ceiling"]["mhz"])
            self._window = None
            return True
        return False

    def _applied_mhz(self, o: Observation) -> float:
        if "freq_ceiling" in self.active:
            return float(self.params["freq_ceiling"]["mhz"])
        return float(o.max_mhz or 0.0)

    def _bin_down(self, mhz: float, o: Observation) -> float:
        step = self.config.step_mhz
        lo = o.min_mhz or step
        return max(lo, math.floor(mhz / step + 1e-9) * step)

    def _energy(self, o: Observation) -> str | None:
        """Update the energy ceiling from the fit (or probe); a note when it changed."""
        cfg = self.config
        if not self._points:
            return None
        fit = fit_inverse(list(self._points))
        top = float(o.max_mhz)
        delta = cfg.delta_percent / 100
        if fit is None:
            if self._energy_mhz is not None or self._probing or self._fitted:
                return None                   # one probe a decode; a verdict stands
            f, r, _, _ = self._points[-1]
            self._probing = True
            self._energy_mhz = self._bin_down(f - cfg.probe_bins * cfg.step_mhz, o)
            return (f"probe: {self._energy_mhz:.0f} MHz, {cfg.probe_bins} bins under the busy "
                    f"{f:.0f} MHz at {r:.2f} tok/s, to learn how decode answers frequency")
        self._probing = False
        self._fitted = True
        a, b, se_b, mx = fit
        # the slope two standard errors steeper, turned about the points' centre: a ceiling
        # only as low as the evidence carries when tokens/s is noisy (exact data: the fit)
        b_hi = b + 2 * se_b
        a_hi = a - 2 * se_b * mx
        denom = 1.0 / ((1 - delta) * self._r_best) - a_hi
        if denom <= 0:
            want = top                        # the floor needs more than the top can give
        else:
            want = b_hi / denom               # 0 when decode ignores frequency entirely
        want = min(top, max(want, self._bad_mhz + cfg.step_mhz))
        want = math.ceil(want / cfg.step_mhz - 1e-9) * cfg.step_mhz
        want = max(o.min_mhz or cfg.step_mhz, min(top, want))
        reach = max(f for f, *_ in self._points)
        current = self._energy_mhz if self._energy_mhz is not None else top
        if want >= reach - cfg.step_mhz / 2 or \
                (self._energy_mhz is None and want > reach - cfg.probe_bins * cfg.step_mhz):
            # a ceiling at or over where the clock runs would not bind; a new one must be
            # worth an action (probe_bins under the clock)
            want = top
        limit = cfg.max_move_bins * cfg.step_mhz
        want = max(current - limit, min(current + limit, want))
        if abs(want - current) < cfg.step_mhz / 2:
            return None
        self._energy_mhz = want
        elasticity = b / (a * o.busy_mhz + b) if (a * o.busy_mhz + b) > 0 else 0.0
        return (f"energy: {want:.0f} MHz keeps tokens/s within {cfg.delta_percent:g} % of the "
                f"best {self._r_best:.2f} (fit 1/R = {a:.4g} + {b:.4g}/f, elasticity "
                f"{elasticity:.2f} at {o.busy_mhz:.0f} MHz)")

    def _limit_c(self, o: Observation) -> float:
        cfg = self.config
        if cfg.limit_temp_c > 0:
            return cfg.limit_temp_c
        return o.limit_temp_c if o.limit_temp_c is not None else DEFAULT_LIMIT_C

    def predict(self, o: Observation) -> tuple[float, float] | None:
        """(T_ss, t_hit) from the first-order fit since the last change, or None."""
        recent = [(s, t) for s, t in self._temps if s > self._changed_s]
        if len(recent) < 8 or o.pkg_temp_c is None:
            return None
        period = (recent[-1][0] - recent[0][0]) / (len(recent) - 1)   # seconds per sample
        if period <= 0:
            return None
        temps = [t for _, t in recent]
        line = least_squares(temps[:-1], temps[1:], 1e-6)
        if line is None:
            return o.pkg_temp_c, math.inf
        mx, my, alpha = line
        if not 0.0 < alpha < 0.9999:
            slope = (temps[-1] - temps[0]) / (recent[-1][0] - recent[0][0])   # °C per second
            return None if slope <= 0 else (math.inf, max(0.0, (self._set_c(o) - o.pkg_temp_c)
                                                           / slope))
        c = my - alpha * mx
        t_ss = c / (1 - alpha)
        tau = -period / math.log(alpha)
        t_set = self._set_c(o)
        if o.pkg_temp_c >= t_set:
            return t_ss, 0.0
        if t_ss <= t_set:
            return t_ss, math.inf
        return t_ss, tau * math.log((t_ss - o.pkg_temp_c) / (t_ss - t_set))

    def _set_c(self, o: Observation) -> float:
        return self._limit_c(o) - self.config.limit_margin_c

    def _thermal(self, o: Observation) -> str | None:
        cfg = self.config
        got = self.predict(o)
        if got is None or o.pkg_power_w is None or o.busy_mhz is None:
            return None
        t_ss, t_hit = got
        t_set = self._set_c(o)
        if t_hit < cfg.horizon_s:
            # a fit over a short stretch sees the die and the sink's slow rise as one lag and
            # overshoots T_ss: with time left, one bin and a fresh fit; a big cut only when close
            bins = cfg.max_move_bins if t_hit < cfg.horizon_s * URGENT_FRACTION else 1
            scale = self._dynamic_scale(o, t_ss)
            want = self._bin_down(o.busy_mhz * scale ** (1 / POWER_EXPONENT), o)
            want = max(want, self._applied_mhz(o) - bins * cfg.step_mhz)
            if self._thermal_mhz is not None and want >= self._thermal_mhz:
                return None
            if want >= self._applied_mhz(o):
                want = self._bin_down(self._applied_mhz(o) - cfg.step_mhz, o)
            self._thermal_mhz = want
            return (f"thermal: {want:.0f} MHz, the package would reach {t_set:.1f} °C in "
                    f"{t_hit:.0f} s (settling at {t_ss:.1f} °C, {o.pkg_power_w:.0f} W)")
        # relax slowly: the heat sink answers over minutes, a fit since the last change
        # sees mostly the die, so a quick relax would undo what the sink needs
        if self._thermal_mhz is not None and math.isfinite(t_ss) and \
                o.time_s - self._changed_s >= cfg.horizon_s / 2:
            up = self._thermal_mhz + cfg.step_mhz
            t_up = self._temp_at(o, t_ss, up)
            if t_up >= t_set:
                return None
            self._thermal_mhz = None if up >= float(o.max_mhz) else up
            return (f"thermal relaxed: settling at {t_ss:.1f} °C, {t_up:.1f} °C predicted one bin "
                    f"up, under {t_set:.1f} °C")
        return None

    def _idle_package(self, o: Observation) -> tuple[float, float]:
        """(T, P) of the idle package before decode, or a guess where none was seen: 5 °C under
        the coolest reading, a quarter of today's power."""
        assert o.pkg_power_w is not None
        return self._base or (min(t for _, t in self._temps) - 5.0, 0.25 * o.pkg_power_w)

    def _temp_at(self, o: Observation, t_ss: float, mhz: float) -> float:
        """Where the package would settle at ``mhz``: the heat over the idle package is taken as
        proportional to the power over it, and the power at ``mhz`` comes from the measured
        windows' slope dP/df where they span a bin or more (else ``P ~ f^2.5`` over the idle)."""
        assert o.pkg_power_w is not None and o.busy_mhz
        base_t, base_p = self._idle_package(o)
        now = o.pkg_power_w - base_p
        if now <= 0:
            return t_ss
        pts = [(f, w) for f, _, w, _ in self._points if w > 0]
        fs = [f for f, _ in pts]
        line = least_squares(fs, [w for _, w in pts]) \
            if fs and max(fs) - min(fs) >= self.config.step_mhz * 0.9 else None
        if line is not None:
            extra = max(0.0, line[2]) * (mhz - o.busy_mhz)
        else:
            extra = now * ((mhz / o.busy_mhz) ** POWER_EXPONENT - 1)
        return base_t + (t_ss - base_t) * (now + extra) / now

    def _dynamic_scale(self, o: Observation, t_ss: float) -> float:
        """How much of today's dynamic power (over the idle package's) settles at the set point."""
        assert o.pkg_power_w is not None and o.pkg_temp_c is not None
        base_t, base_p = self._idle_package(o)
        if not math.isfinite(t_ss):
            t_ss = o.pkg_temp_c + 5.0
        headroom = max(0.0, (self._set_c(o) - base_t) / max(1e-6, t_ss - base_t))
        return max(0.0, min(1.0, headroom))

    def _move(self, o: Observation, why: str) -> list[Action]:
        cfg = self.config
        top = float(o.max_mhz)
        want = min(x for x in (self._energy_mhz, self._thermal_mhz, top) if x is not None)
        current = self._applied_mhz(o)
        if abs(want - current) < cfg.step_mhz / 2:
            return []
        self._changed_s = o.time_s
        self._window = None
        if want >= top:
            self.active.remove("freq_ceiling")
            self.params.pop("freq_ceiling", None)
            return [Action("release", "freq_ceiling", f"back to {top:.0f} MHz: {why}")]
        if "freq_ceiling" not in self.active:
            self.active.append("freq_ceiling")
        self.params["freq_ceiling"] = {"mhz": want}
        return [Action("apply", "freq_ceiling", f"ceiling {current:.0f} -> {want:.0f} MHz: {why}",
                       {"mhz": want})]

    def _pl1_guard(self, o: Observation, throttled: bool) -> list[Action]:
        """No frequency ceiling: hold the thermal limit with PL1, never above the firmware's.
        With several packages each gets its own cap, from its own power."""
        cfg = self.config
        per_package = (o.pkg_power_packages_w is not None and o.pl1_firmware_packages_w
                       is not None and len(o.pkg_power_packages_w) ==
                       len(o.pl1_firmware_packages_w) > 1)
        firmware = list(o.pl1_firmware_packages_w) if per_package else \
            [o.pl1_firmware_w] if o.pl1_firmware_w is not None else None
        if not cfg.pl1 or firmware is None or o.pkg_power_w is None:
            return []
        powers = list(o.pkg_power_packages_w) if per_package else [o.pkg_power_w]
        read = list(o.pl1_packages_w or []) if per_package else \
            [o.pl1_w] if o.pl1_w is not None else []
        written = self.params.get("rapl_pl1", {}).get("pl1_w")
        wrote = None if written is None else (written if isinstance(written, list) else [written])
        if wrote is not None and len(read) == len(wrote) and o.time_s - self._changed_s >= 1.0 \
                and any(abs(r - w) > 1.0 for r, w in zip(read, wrote)):
            # read back: the firmware ignores PL1 writes; stop using it (no limit cycle)
            self._refused.add("rapl_pl1")
            self.active.remove("rapl_pl1")
            self.params.pop("rapl_pl1")
            return [Action("release", "rapl_pl1", f"PL1 reads back {_watts(read)}, not the "
                           f"{_watts(wrote)} written: the firmware ignores it")]
        if "rapl_pl1" in self._refused:
            return []
        got = self.predict(o)
        if not throttled and (got is None or got[1] >= cfg.horizon_s):
            return []
        current = wrote if wrote is not None else firmware
        base_total = self._base[1] if self._base else 0.25 * o.pkg_power_w
        scale = 0.9 if throttled or got is None else min(0.97, self._dynamic_scale(o, got[0]))
        caps = []
        for power, now, top in zip(powers, current, firmware):
            base = base_total * power / max(1e-9, sum(powers))   # idle power, split by share
            cap = base + (min(now, power) - base) * scale
            caps.append(round(max(cfg.pl1_min_w, min(top, cap)), 1))
        if all(c >= n - 0.5 for c, n in zip(caps, current)) or \
                o.time_s - self._changed_s < cfg.dwell_s:
            return []
        caps = [min(c, n) for c, n in zip(caps, current)]        # only ever lowered
        self._changed_s = o.time_s
        self._temps = []
        if "rapl_pl1" not in self.active:
            self.active.append("rapl_pl1")
        value: float | list[float] = caps if per_package else caps[0]
        self.params["rapl_pl1"] = {"pl1_w": value}
        why = "the hardware throttled" if throttled else f"limit predicted in {got[1]:.0f} s"
        return [Action("apply", "rapl_pl1", f"PL1 {_watts(current)} -> {_watts(caps)} (firmware "
                       f"{_watts(firmware)}, from {_watts(powers)} drawn): {why}",
                       {"pl1_w": value})]

    def _release_all(self, why: str) -> list[Action]:
        out = [Action("release", rung, why, dict(self.params.pop(rung, {})))
               for rung in reversed(self.active)]
        self.active = []
        self._energy_mhz = self._thermal_mhz = None
        self._probing = False
        self._changed_s = -math.inf
        return out

    def _set_state(self, o: Observation, decoding: bool, throttled: bool) -> None:
        if self.active and not decoding:
            state = "recovering"
        elif throttled and not self.active:
            state = "throttling"
        elif self._thermal_mhz is not None and self.active:
            state = "mitigating"
        elif self._probing:
            state = "learning"
        elif self.active:
            state = "efficient"
        else:
            state = "none"
        self.state = state
        self.evidence = {
            "time_s": o.time_s, "state": state, "tokens_per_s": o.tokens_per_s,
            "busy_mhz": o.busy_mhz, "pkg_power_w": o.pkg_power_w, "pkg_temp_c": o.pkg_temp_c,
            "limit_temp_c": self._limit_c(o), "best_tokens_per_s": self._r_best or None,
            "energy_ceiling_mhz": self._energy_mhz, "thermal_ceiling_mhz": self._thermal_mhz,
            "hardware_throttled": throttled, "active": list(self.active),
        }
