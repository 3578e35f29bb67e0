"""Closed-loop control on tokens per joule: samples in, actions out (pure, no I/O, no clock).

The objective: the lowest energy per token while decode keeps within ``delta_percent`` of what
the machine sustains without the controller, and the package under its thermal limit before the
hardware has to step in. Two actuators: a **frequency ceiling** (cpufreq ``scaling_max_freq``),
and where there is none a **PL1 cap** (never above the firmware's). Both serve one target
frequency; time comes from the samples.

When it acts
------------
Only in *steady decode*: the engine's tokens/s, the busy frequency and the package power all
present, tokens/s at least ``min_tokens_per_s``, the thread count unchanged, for ``steady_s``.
A missing value is never evidence: without power (a VM) it never acts. When decode has stopped
for ``release_idle_s`` every cap is lifted.

What it learns
--------------
Samples more than ``settle_s`` after the last change are averaged into windows of ``dwell_s``;
each window is one point: busy MHz f, tokens/s R, package watts P, the engine's bytes per token
B (``gb_per_token``; R1's reasoning grows the KV cache, so B rises as a decode goes on) and
whether the clock ran *free* (no cap of ours held it). Decode time per token is memory time,
proportional to the bytes, plus compute time: over the recent points it fits
``1/R = a β + b/f`` (β = B / B now) by least squares — two regressors, no intercept, so a growing
KV cache moves the points along β and is not read as a loss. Natural variation counts (a PL2
budget running out, the hardware's own throttling, a probe). The floor is relative to what the
package sustains now: the clock it runs free (the latest free window: after a PL2 burst, after
the die warmed) at today's bytes per token::

    f_energy = b / ((a + b / f_free) / (1 - delta) - a)

Power rises with f faster than tokens/s, so that lowest f is also the cheapest per token. With no
spread in f it probes ``probe_bins`` bins under the free clock; while the evidence keeps the
ceiling more than a bin over the fit's own answer it probes again at that answer every
``reprobe_s``. A window under the floor is a point like any other and moves the fit back up, and
the ceiling never again goes at or under a ceiling that broke the floor (until the workload
changes: new threads, or the bytes per token moving by a quarter; or the reference clock falls).
When the bytes per token grow by a quarter under an energy cut alone (R1's KV cache), no window
runs free again to measure the reference: it is carried. At the same cut, the first window's
seconds per token less the last one's before the change is what the bytes added, and the model
puts the same seconds on the reference clock (an overlap of memory and compute hides part of
them at the lower clock, so the carried floor errs on the side of tokens/s). Without it the
energy path waited for good wherever the cut then stood (docs/mitigation.md has the figures).

What the package sustains is also what it would settle at at its limit, where the limit is
known: `dsr1d.core.heat` fits the die and the heat sink to every sample of the decode and answers
the clock whose settled temperature is the limit (once the data spans the sink's own time
constant). Where that is under the free clock and the guard's, it is the floor's reference. The
energy cut keeps the package cool, so without it the reference stayed the cold die's clock for as
long as the cut held: on one plant 30 minutes at 2800 MHz where stock throttles after 8 minutes
and averages 3116, J/token 22 % over the oracle's at δ = 5 % (2.6 % with it). And the guard's clock,
set while the sink was still cold, stood for what the package sustains after the sink warmed
(3000 MHz where stock sustains 2670: 10.5 % over the oracle's over 30 minutes, 0.3 % with it).

Noise: a real engine's tokens/s moves a few per cent from sample to sample. Each window carries
the standard error of its mean (``se``); a window breaks the floor only when ``R + 2 se`` is under
it, and ``f_energy`` uses the slope two standard errors steeper (``se_b``: from the scatter about
the fit or the windows' own noise, the larger), turned about the points' centre.

Thermal guard
-------------
The limit is ``limit_temp_c``, or the machine's TjMax minus the TCC offset. Where neither is known
(AMD: the Tctl limit belongs to the SMU and is not readable) there is no predictive guard: the
firmware holds its own limit with a smooth slope, and a guessed limit under it only costs tokens/s
(a 95 °C guess held 100 °C parts 2.7 % under stock). Where the firmware shows it — the free clock
falling a bin or more while the temperature stands at its highest — that temperature is reported as
the limit it holds. The set point is ``limit_margin_c`` under the limit. Since the last change the
temperature is fitted as a first order lag, ``T[k+1] = alpha T[k] + c``: ``T_ss = c / (1 -
alpha)``, ``tau = -dt / ln(alpha)``, and the time to the set point ``t_hit = tau ln((T_ss - T) /
(T_ss - T_set))``. When ``t_hit`` is under ``horizon_s`` (or the package is already there) the
power that would settle at the set point is ``P_set = P_base + (P - P_base) (T_set - T_base) /
(T_ss - T_base)`` (``T_base``/ ``P_base``: the idle package before decode) and the target is the
frequency for it on the package's measured power curve. With more than a quarter of the horizon
left the cut is one bin and the next decision sees a fresh fit. Where the temperature has not yet
curved (no lag fits) only a straight-line reach under a quarter of the horizon is acted on, one bin
at a time: a long straight rise is usually a big heat sink that settles before the limit. Hardware
throttle evidence (throttle time rising, thermal limit-reason bits) lowers the target one bin under
the busy frequency at once, never more than ``max_move_bins`` under the cap in force. Cuts start
from the clock the package really runs (the busy frequency), not from the one-core maximum turbo
above it. The guard is relaxed a bin at a time while the temperature predicted one bin up stays a
sensor step (1 °C) under the set point, at most one bin per ``horizon_s / 2`` since its last move.
Under an energy cut the prediction extrapolates from a cooler package (less leakage, a sink
cooling), so there it relaxes one bin per ``reprobe_s`` and is not let go: it is the floor's
reference, and releasing it sent the floor back to the cold die's clock (on ``step-tcc`` a cycle
of cuts and hardware throttling, 57 actions in 30 minutes).

The energy ceiling goes under the guard once a window has measured what the package sustains
within two bins of the guard's clock, so the floor is read there and not carried by a noisy fit
from the cold die's clock far above (it had waited for the guard to stand still for
``horizon_s``; on a package still warming the guard moves a bin every 20-40 s for minutes, and
``efficient`` spent about 1 % of its 5 %). Where the guard holds the clock, the clock it holds
stands for the free one: after a workload change under the guard (a KV cache grown by a
quarter) no window runs free again, and the energy path had waited for one for good.

The uncore clock
----------------
With ``uncore = yes`` and Intel's intel_uncore_frequency driver, once the core's ceiling has
settled (a fit, no probe): the uncore's ``max_freq_khz`` one ``uncore_step_mhz`` down per window
while the window keeps the floor, one step back up when it does not, and no lower for this
workload; the core's energy ceiling waits while it steps. Off by default: one knob after the
other spends the floor's budget on whichever moves first, and on the simulated plants the gain
is not one-sided (docs/mitigation.md).

The PL1 actuator
----------------
Where there is no frequency ceiling, the same target frequency is turned into watts on the
package's measured power curve (``P = P_idle + k f^e``, ``e`` fitted from the windows once they
span a bin, else ``POWER_EXPONENT``), and PL1 moves toward it by at most ``pl1_step_percent`` of
the firmware's PL1 per move, one move per ``dwell_s``; it rises back the same way when the reason
is gone, and is released at the firmware's value. With several packages each gets the share of
the cap its own power draws. A PL1 that reads back other than written is never used again.

Counters that jump when a CPU comes online (its boot-time throttle counts) are rebased, not read
as throttling.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, fields
from typing import Any, Mapping, NamedTuple, TypedDict

from dsr1d.core.heat import BLOCK, sustained_clock


STATES = ("none", "learning", "efficient", "mitigating", "throttling", "recovering")
RUNGS = ("freq_ceiling", "rapl_pl1", "uncore_ceiling")
# t_hit under this share of the horizon: cut to the fitted power at once. A first-order fit over a
# short stretch takes the die's and the heat sink's lags for one and overshoots T_ss (the plant's
# two nodes: 1.6 s and 156 s on the calibrated Xeon), so with time left one bin and a fresh fit.
URGENT_FRACTION = 0.25
# Dynamic power ~ C V(f)^2 f with V rising about linearly with f over the DVFS range: between
# f^2 (V flat) and f^3 (V proportional to f); the prior until the windows span a bin and give
# the package's own exponent.
POWER_EXPONENT = 2.5
# The relax must leave the temperature a sensor step under the set point: coretemp reports whole
# degrees, so a prediction within 1 °C of the set point is not evidence that one bin up is safe.
RELAX_MARGIN_C = 1.0
# A decode's samples the sustained clock is learned from: half an hour, time constants of the
# largest heat sinks in the ensemble (8000 J/K x 0.12 K/W = 16 minutes) twice over.
HEAT_SAMPLES = 1800
# Bytes per token moving by this share is a new workload (another model, batch or context).
WORKLOAD_CHANGE = 0.25


@dataclass(frozen=True)
class Action:
    """One decision: ``apply`` (or re-apply with new params) or ``release`` a rung, and why."""

    kind: str            # "apply" | "release"
    rung: str            # "freq_ceiling" | "rapl_pl1" (the ladder: its own rung names)
    reason: str          # one line, with the evidence numbers
    params: dict[str, Any] = field(default_factory=dict)   # free-form: each rung its own


class RungParams(TypedDict, total=False):
    """What one of the controller's rungs holds: a ceiling's ``mhz``, or PL1's ``pl1_w`` (a list
    where there are several packages)."""

    mhz: float
    pl1_w: float | list[float]


def _setting(default: Any, help: str, lo: float | None = None, hi: float | None = None,
             unit: str = "") -> Any:
    return field(default=default, metadata={"help": help, "lo": lo, "hi": hi, "unit": unit})


@dataclass(frozen=True)
class EfficiencyConfig:
    """The profile's ``[mitigation]`` section: every field is a key (see `settings`)."""

    enabled: bool = _setting(True, "run the controller")
    delta_percent: float = _setting(2.0, "tokens/s may fall this far below what the package "
                                    "sustains without the controller", 0.0, 50.0, "%")
    limit_temp_c: float = _setting(0.0, "thermal limit; 0 = the hardware's TjMax minus the TCC "
                                   "offset (where unreadable, as AMD's Tctl limit, no guard: "
                                   "the firmware holds it)", 0.0, 125.0, "°C")
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
    probe_bins: int = _setting(2, "the first probe goes this many bins under the free clock", 1,
                               20, "bins")
    reprobe_s: float = _setting(120.0, "while noise holds the ceiling over the fit's answer, "
                                "probe at that answer again after this", 10.0, 3600.0, "s")
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
    pl1_step_percent: float = _setting(10.0, "one PL1 move changes the cap by at most this share "
                                       "of the firmware's PL1", 1.0, 100.0, "%")
    uncore: bool = _setting(False, "lower the uncore clock (Intel's intel_uncore_frequency) "
                            "while decode keeps its floor, once the core's ceiling has settled")
    uncore_step_mhz: float = _setting(100.0, "one uncore move", 10.0, 1000.0, "MHz")

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
    pkg_power_packages_w: tuple[float, ...] | None = None     # per package (two sockets or more)
    pl1_packages_w: tuple[float, ...] | None = None           # read back, per package
    pl1_firmware_packages_w: tuple[float, ...] | None = None  # the firmware's, per package
    gb_per_token: float | None = None      # bytes the engine reads per token (weights + KV)
    uncore_max_mhz: float | None = None    # the uncore's firmware range (None: no uncore knob)
    uncore_min_mhz: float | None = None
    uncore_limit_mhz: float | None = None  # its max_freq_khz as read back


class Point(NamedTuple):
    """One measuring window's means."""

    f: float        # busy MHz
    r: float        # tokens/s
    p: float        # package watts
    se: float       # standard error of r
    gb: float       # bytes per token (1.0 where the engine does not say)
    free: bool      # no cap of ours held the clock
    sustained: bool  # free, or held by the thermal guard alone: what the package sustains
    uncore: float = 0.0  # the uncore limit in force (0: its top, or no uncore knob)


@dataclass
class _Window:
    start_s: float
    n: int = 0
    f: float = 0.0
    r: float = 0.0
    r2: float = 0.0
    p: float = 0.0
    gb: float = 0.0
    free: bool = True
    sustained: bool = True
    uncore: float = 0.0

    def add(self, o: Observation, free: bool, sustained: bool) -> None:
        self.n += 1
        self.f += o.busy_mhz or 0.0
        self.r += o.tokens_per_s or 0.0
        self.r2 += (o.tokens_per_s or 0.0) ** 2
        self.p += o.pkg_power_w or 0.0
        self.gb += o.gb_per_token or 1.0
        self.free = self.free and free
        self.sustained = self.sustained and sustained

    def point(self) -> Point:
        """The window's means and the standard error of its tokens/s (0 from a single sample)."""
        mean = self.r / self.n
        var = max(0.0, self.r2 / self.n - mean * mean) * self.n / (self.n - 1) \
            if self.n > 1 else 0.0
        return Point(self.f / self.n, mean, self.p / self.n, math.sqrt(var / self.n),
                     self.gb / self.n, self.free, self.sustained, self.uncore)


class Fit(NamedTuple):
    """``1/R = a β + b/f`` (f in MHz, β = bytes per token over today's)."""

    a: float
    b: float
    se_b: float
    centre: float       # the points' mean 1/f per unit β: the slope turns about it

    def seconds(self, mhz: float, beta: float = 1.0) -> float:
        """Predicted time per token at ``mhz`` and ``beta``."""
        return self.a * beta + self.b / mhz

    def steeper(self, sigmas: float = 2.0) -> Fit:
        """The slope ``sigmas`` standard errors steeper, turned about the centre."""
        return Fit(self.a - sigmas * self.se_b * self.centre, self.b + sigmas * self.se_b,
                   self.se_b, self.centre)


class _Carry(NamedTuple):
    """What the energy path knew when the bytes per token grew under its cut."""

    cut: float          # the energy ceiling in force (MHz)
    r_cut: float        # tokens/s of the last window at it
    gb: float           # bytes per token of that window
    ref_rate: float     # what the package sustained, at the floor's reference clock: the
    #                     windows' mean less two standard errors (tokens/s)
    ref: float          # that reference clock (MHz)
    free: float         # the free clock (MHz)
    fit: Fit


def _watts(values: list[float]) -> str:
    return "+".join(f"{v:.0f}" for v in values) + " W"


def fit_inverse(points: list[Point], gb_now: float | None = None) -> Fit | None:
    """Least squares of ``1/R = a β + b/f`` over ``points`` (β = the point's bytes per token over
    ``gb_now``, the last point's by default); ``se_b`` from the scatter about the fit or the
    windows' own noise, whichever is larger. None without a spread of about 1 % in 1/f beyond
    what β explains."""
    use = [pt for pt in points if pt.f > 0 and pt.r > 0]
    if len(use) < 2:
        return None
    now = gb_now or use[-1].gb
    bs = [pt.gb / now for pt in use]
    xs = [1.0 / pt.f for pt in use]
    ys = [1.0 / pt.r for pt in use]
    sbb = sum(b * b for b in bs)
    sbx = sum(b * x for b, x in zip(bs, xs))
    sxx = sum(x * x for x in xs)
    perp = sxx - sbx * sbx / sbb              # x's spread beyond what β explains
    mean_x = sum(xs) / len(xs)
    if perp <= len(xs) * (0.004 * mean_x) ** 2:
        return None
    sby = sum(b * y for b, y in zip(bs, ys))
    sxy = sum(x * y for x, y in zip(xs, ys))
    det = sbb * sxx - sbx * sbx
    b = (sbb * sxy - sbx * sby) / det
    a = (sxx * sby - sbx * sxy) / det
    if b < 0:                    # more frequency never slows decode: noise, not physics
        b, a = 0.0, sby / sbb
    noise = sum((pt.se / pt.r ** 2) ** 2 for pt in use) / len(use)      # var(1/R) of a window
    if len(use) > 2:
        scatter = sum((y - a * bb - b * x) ** 2 for bb, x, y in zip(bs, xs, ys)) / (len(use) - 2)
        noise = max(noise, scatter)
    return Fit(a, b, math.sqrt(noise * sbb / det), sbx / sbb)


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
        self.params: dict[str, RungParams] = {}
        self.history: list[tuple[float, Action]] = []
        self._prev: Observation | None = None
        self._steady_since: float | None = None
        self._idle_since: float | None = None
        self._threads: int | None = None
        self._gb: float | None = None             # bytes per token the points are learned at
        self._changed_s = -math.inf
        self._window: _Window | None = None
        self._points: deque[Point] = deque(maxlen=self.config.fit_points)
        self._free_mhz: float | None = None       # the clock the package runs with no cap of ours
        # windows at what the package sustains (free, or held by the thermal guard alone)
        self._sustained: deque[Point] = deque(maxlen=self.config.fit_points)
        self._bad_mhz = 0.0                       # a ceiling at or under this broke the floor
        self._bad_ref = 0.0                       # the floor's reference clock when it broke
        self._ref_mhz = 0.0                       # the floor's reference clock now
        self._heat: list[tuple[float, float, float]] = []   # (°C, W, MHz) of this decode
        self._sustain_mhz: float | None = None    # where the package would settle at its limit
        self._temps: list[tuple[float, float]] = []
        self._base: tuple[float, float] | None = None   # (T, P) idle before decode
        self._learned_limit_c: float | None = None
        self._thermal_mhz: float | None = None
        self._energy_mhz: float | None = None
        self._probing = False
        self._probed_s: float | None = None
        self._fit: Fit | None = None
        self._carried: _Carry | None = None       # the floor across a change under our cut
        self._asked_mhz: float | None = None      # a one-bin move the last window asked for
        self._uncore_bad = 0.0                    # an uncore limit that broke the floor
        self._thermal_moved_s = -math.inf         # when the thermal target last moved
        self._uncore_done = False                 # its descent is over for this workload
        self._refused: set[str] = set()          # actuators the machine would not take

    # -- the step ----------------------------------------------------------------------------

    def refuse(self, rung: str) -> None:
        """The machine refused ``rung``'s write: forget it was applied, never use it again."""
        self._refused.add(rung)
        if rung in self.active:
            self.active.remove(rung)
        self.params.pop(rung, None)
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
            self._heat, self._sustain_mhz = [], None
            self._note_idle(o)
            if self.active and self._idle_since is not None and \
                    o.time_s - self._idle_since >= cfg.release_idle_s:
                actions = self._release_all(f"decode stopped {o.time_s - self._idle_since:.0f} s "
                                            "ago")
        else:
            self._idle_since = None
            grown = self._steady_since is not None and o.threads == self._threads and \
                self._new_workload(o)
            if self._steady_since is None or o.threads != self._threads or grown:
                carried = self._carry_out() if grown else None
                self._steady_since, self._threads = o.time_s, o.threads
                self._window, self._temps = None, []
                self._forget()
                self._carried = carried
                if "uncore_ceiling" in self.active:    # learned for what no longer runs
                    actions = [self._uncore_release(o, "the workload changed")]
            if cfg.enabled and not actions:
                actions = self._decide(o, throttled)
        self._prev = o
        self._set_state(o, decoding, throttled)
        for a in actions:
            self.history.append((o.time_s, a))
        return actions

    def _forget(self) -> None:
        """A new workload: what was learned of the decode curve no longer holds."""
        self._points.clear()
        self._free_mhz, self._bad_mhz = None, 0.0
        self._sustained.clear()
        self._fit = None
        self._carried = None
        self._probed_s = None
        self._uncore_bad = 0.0
        self._uncore_done = False

    def _new_workload(self, o: Observation) -> bool:
        if o.gb_per_token is None:
            return False
        if self._gb is None or abs(o.gb_per_token / self._gb - 1) >= WORKLOAD_CHANGE:
            changed = self._gb is not None
            self._gb = o.gb_per_token
            return changed
        return False

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

    # -- measuring ---------------------------------------------------------------------------

    def _ceiling_actuator(self, o: Observation) -> bool:
        return bool(o.max_mhz) and "freq_ceiling" not in self._refused

    def _held(self, o: Observation) -> bool:
        """A cap of ours holds the clock now (the busy frequency is at it, or the uncore is
        under its top)."""
        step = self.config.step_mhz
        if "uncore_ceiling" in self.active:
            return True
        if "freq_ceiling" in self.active and o.busy_mhz is not None:
            return o.busy_mhz >= self.params["freq_ceiling"]["mhz"] - step / 2
        if "rapl_pl1" in self.active and o.pkg_power_w is not None:
            return o.pkg_power_w >= 0.97 * _total(self.params["rapl_pl1"]["pl1_w"])
        return False

    def _measure(self, o: Observation) -> bool:
        """Add ``o`` to the open window; True when that completed a window (a new point)."""
        cfg = self.config
        if self._window is None:
            self._window = _Window(o.time_s, uncore=self._uncore_limit())
        held = self._held(o)
        thermal_holds = self._thermal_mhz is not None and not self._energy_under_guard()
        lowered = "uncore_ceiling" in self.active        # the uncore is no one's sustained state
        self._window.add(o, not held, (not held or thermal_holds) and not lowered)
        period = o.time_s - self._prev.time_s if self._prev is not None else 1.0
        if o.time_s - self._window.start_s + period + 1e-9 < cfg.dwell_s:
            return False
        point = self._window.point()
        self._window = None
        self._points.append(point)
        if self._carried is not None:
            self._carry_in(point)
        if point.sustained:
            if self._sustained and abs(self._sustained[-1].f - point.f) >= cfg.step_mhz / 2:
                if point.f < self._sustained[-1].f:
                    # the floor falls with the sustained clock: a ceiling that broke the old
                    # floor may keep the new one (on AMD parts whose limit shows late, a probe
                    # judged against the cold die's clock had barred every cut for good)
                    self._bad_mhz = 0.0
                self._sustained.clear()       # it moved: PL2 ran out, the die warmed, the guard
            self._sustained.append(point)
        if point.free:
            self._free_mhz = point.f
            self._learn_limit(o, point)
        elif "freq_ceiling" in self.active and self._uncore_done:
            fit = fit_inverse(self._fit_points(), o.gb_per_token)
            floor = self._floor(fit, point.gb)
            if floor is not None and point.r + 2 * point.se < floor:
                self._bad_mhz = max(self._bad_mhz, self.params["freq_ceiling"]["mhz"])
                self._bad_ref = self._ref_mhz
        return True

    def _carry_out(self) -> _Carry | None:
        """The floor's reference and the fit, where the bytes per token grew under an energy
        cut of ours: under the cut no window runs free again, and the energy path had waited
        for one for good (on a growing KV cache, J/token 17 % over the oracle's)."""
        cut, fit, free = self._energy_mhz, self._fit, self._free_clock()
        if cut is None or fit is None or free is None or "freq_ceiling" not in self.active:
            return None
        at = [pt for pt in self._points
              if not pt.free and abs(pt.f - cut) < self.config.step_mhz / 2]
        floor = self._floor(fit, at[-1].gb) if at else None
        if floor is None:
            return None
        return _Carry(cut, at[-1].r, at[-1].gb, floor / (1 - self.config.delta_percent / 100),
                      self._ref_mhz, free, fit)

    def _carry_in(self, point: Point) -> None:
        """The first window after the change, at the same cut: the bytes added cost the same
        seconds per token at every clock (``1/R = a β + b/f``: they move the memory term only),
        so what the package sustains moved by what the cut's rate moved, in seconds per token.
        Where compute and memory overlap, a slower clock hides part of the added memory time,
        so the cut shows less of it than the reference clock would: the carried floor errs
        high, on the side of tokens/s. A free window, or the cut moved, ends it."""
        c, self._carried = self._carried, None
        assert c is not None
        if point.free or point.sustained or abs(point.f - c.cut) >= self.config.step_mhz / 2:
            return
        seconds = 1.0 / c.ref_rate + 1.0 / point.r - 1.0 / c.r_cut
        if seconds <= 0:
            return
        rate = 1.0 / seconds
        self._sustained.append(point._replace(f=c.ref, r=rate, se=rate * point.se / point.r,
                                              sustained=True))
        self._free_mhz = self._free_mhz or c.free
        k = point.gb / c.gb
        self._fit = self._fit or Fit(c.fit.a * k, c.fit.b, c.fit.se_b, c.fit.centre / k)

    def _uncore_limit(self) -> float:
        return float(self.params.get("uncore_ceiling", {}).get("mhz", 0.0))

    def _fit_points(self) -> list[Point]:
        """The points measured at today's uncore limit: the decode curve in f is another one
        at another uncore clock."""
        now = self._uncore_limit()
        return [pt for pt in self._points if pt.uncore == now]

    def _floor(self, fit: Fit | None, gb: float, share: float = 1.0) -> float | None:
        """The tokens/s decode must keep at ``gb`` bytes per token: ``1 - delta`` of what the
        package sustains — the latest windows at the free clock, or at the thermal guard's
        where it holds the clock (their mean, less two standard errors), carried by the fit to
        today's bytes per token and to the lowest of the free clock, the guard's and the clock
        the package would settle at at its limit."""
        if not self._sustained:
            return None
        at = min(x for x in (self._free_clock(), self._thermal_mhz, self._sustain_mhz)
                 if x is not None)
        if self._bad_mhz and at < self._bad_ref - self.config.step_mhz / 2:
            self._bad_mhz = 0.0     # judged against a higher reference: it may keep this floor
        self._ref_mhz = at
        rates = []
        for pt in self._sustained:
            scale = 1.0
            if fit is not None:
                scale = fit.seconds(pt.f, pt.gb / gb) / fit.seconds(at)
            rates.append(pt.r * scale)
        mean = sum(rates) / len(rates)
        se = math.sqrt(sum(pt.se ** 2 for pt in self._sustained)) / len(self._sustained)
        return (1 - share * self.config.delta_percent / 100) * (mean - 2 * se)

    def _learn_heat(self, o: Observation) -> None:
        """Add ``o`` to this decode's heat record; each block, what the package would sustain
        at its limit (only where the limit is known: the guard's set point has one)."""
        if o.pkg_temp_c is None or o.pkg_power_w is None or o.busy_mhz is None:
            return
        self._heat.append((o.pkg_temp_c, o.pkg_power_w, o.busy_mhz))
        del self._heat[:-HEAT_SAMPLES]
        t_set = self._set_c(o)
        if t_set is not None and len(self._heat) % BLOCK == 0:
            # an answer stands until a better one: a block the fit cannot answer says nothing
            # new, and a reference flipping with it moved the ceiling five bins and back
            got = sustained_clock(self._heat, t_set + self.config.limit_margin_c)
            self._sustain_mhz = got if got is not None else self._sustain_mhz

    def _learn_limit(self, o: Observation, point: Point) -> None:
        """Where the limit is unreadable: the free clock falling a bin or more while the
        temperature stands at its highest is the firmware holding it."""
        if self._limit_known(o) or len(self._points) < 2 or not self._temps:
            return
        before = [pt for pt in list(self._points)[:-1] if pt.free]
        hottest = max(t for _, t in self._temps)
        recent = [t for s, t in self._temps if s >= o.time_s - self.config.dwell_s]
        if before and before[-1].f - point.f >= self.config.step_mhz and recent and \
                max(recent) - min(recent) <= 1.0 and min(recent) >= hottest - 1.0:
            self._learned_limit_c = max(recent)

    # -- deciding ----------------------------------------------------------------------------

    def _decide(self, o: Observation, throttled: bool) -> list[Action]:
        cfg = self.config
        settled = o.time_s - self._changed_s >= cfg.settle_s
        completed = False
        self._learn_heat(o)
        if settled:
            if o.pkg_temp_c is not None:
                self._temps.append((o.time_s, o.pkg_temp_c))
                del self._temps[:-600]
            completed = self._measure(o)
        assert self._steady_since is not None      # step() set it: decode is steady
        if o.time_s - self._steady_since < cfg.steady_s:
            return []
        core = self._core(o, throttled, settled, completed)
        if core or not completed:
            return core
        return self._uncore_step(o)

    def _core(self, o: Observation, throttled: bool, settled: bool,
              completed: bool) -> list[Action]:
        cfg = self.config
        if not self._ceiling_actuator(o):
            return self._pl1_guard(o, throttled, settled, completed)
        if throttled and o.busy_mhz is not None and o.time_s - self._changed_s >= 1.0:
            self._throttle_cut(o)
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

    def _throttle_cut(self, o: Observation) -> None:
        # under a floor clamp (PROCHOT#) the busy clock is the floor's: never more than one
        # move's worth under the cap in force
        cfg = self.config
        assert o.busy_mhz is not None
        applied = self._in_force(o)
        self._thermal_moved_s = o.time_s
        self._thermal_mhz = self._bin_down(max(min(o.busy_mhz, applied) - cfg.step_mhz,
                                               applied - cfg.max_move_bins * cfg.step_mhz), o)

    def _top(self, o: Observation) -> float:
        return float(o.max_mhz) if o.max_mhz else self._free_mhz or o.busy_mhz or 0.0

    def _in_force(self, o: Observation) -> float:
        """The lowest of our caps, the top, and the free clock (where the package runs)."""
        held = [x for x in (self._energy_mhz, self._thermal_mhz) if x is not None]
        free = [self._bin_up(self._free_mhz)] if self._free_mhz is not None else []
        return min(held + free + [self._top(o)])

    def _target_mhz(self, o: Observation) -> float:
        """The frequency our caps aim at now: the lowest of them, and never over the clock the
        package runs (a cut from the one-core turbo above it would not bind)."""
        held = [x for x in (self._energy_mhz, self._thermal_mhz) if x is not None]
        running = o.busy_mhz if o.busy_mhz is not None else self._top(o)
        return min(held + [self._bin_up(running), self._top(o)])

    def _bin_down(self, mhz: float, o: Observation) -> float:
        step = self.config.step_mhz
        lo = o.min_mhz or step
        return max(lo, math.floor(mhz / step + 1e-9) * step)

    def _bin_up(self, mhz: float) -> float:
        step = self.config.step_mhz
        return math.ceil(mhz / step - 1e-6) * step

    def _energy(self, o: Observation) -> str | None:
        """Update the energy target from the fit (or probe); a note when it changed. Held while
        the uncore steps down: one knob at a time, the core's first."""
        cfg = self.config
        free = self._free_clock()
        if not self._points or free is None or \
                ("uncore_ceiling" in self.active and not self._uncore_done):
            return None
        fit = fit_inverse(self._fit_points(), o.gb_per_token) or self._fit
        if fit is None:
            if self._energy_mhz is not None or self._probing:
                return None
            return self._probe(o, self._bin_down(free - cfg.probe_bins * cfg.step_mhz, o),
                               f"{cfg.probe_bins} bins under the free {free:.0f} MHz")
        probed = self._probing
        self._probing = False
        self._fit = fit                       # held windows show no spread: the last fit stands
        floor = self._floor(fit, o.gb_per_token or self._points[-1].gb)
        if floor is None:
            return None
        if probed and self._energy_mhz is not None and self._points[-1].r < floor:
            # a probe whose window fell under the floor, even within its noise, is not
            # tried again this workload (each try costs a window under the floor)
            self._bad_mhz = max(self._bad_mhz, self._energy_mhz)
            self._bad_ref = self._ref_mhz
        nominal = self._lowest_mhz(fit, floor, o)
        want = self._lowest_mhz(fit.steeper(), floor, o)
        # no further than a probe's depth under the lowest clock measured: a decode curve can
        # bend (a memory knee) where no window has looked
        lowest = min(pt.f for pt in self._points)
        depth = cfg.probe_bins * cfg.step_mhz
        nominal, want = (max(x, self._bin_down(lowest - depth, o)) for x in (nominal, want))
        if self._probed_s is not None and want - nominal >= cfg.step_mhz and \
                o.time_s - self._probed_s >= cfg.reprobe_s and nominal < free - cfg.step_mhz / 2:
            return self._probe(o, nominal, "the fit's own answer, to narrow its slope")
        slack = self._slack_mhz(o, floor)
        if slack is not None and want >= slack and \
                o.time_s - (self._probed_s or -math.inf) >= cfg.reprobe_s:
            return self._probe(o, slack, "a bin under a ceiling whose windows keep the floor "
                                         "with room to spare")
        if want >= free - cfg.step_mhz / 2 or \
                (self._energy_mhz is None and want > free - cfg.probe_bins * cfg.step_mhz):
            # a ceiling at or over the free clock would not bind; a first one must be worth
            # an action (as deep as a probe)
            want = self._top(o)
        if self._thermal_mhz is not None and want < self._thermal_mhz and \
                not self._measured_at(self._thermal_mhz):
            # what the package sustains under the guard is the floor's reference: measured
            # there first, not carried by a noisy fit from the cold die's clock far above
            want = max(want, self._thermal_mhz)
        limit = cfg.max_move_bins * cfg.step_mhz
        previous = self._energy_mhz
        if previous is None:
            if want >= self._top(o):
                return None
            want = max(self._bin_up(free) - limit, want)       # moves start where the clock runs
        else:
            want = max(previous - limit, min(previous + limit, want))
            if want >= self._bin_up(free):
                want = self._top(o)                             # it would no longer bind
            if abs(want - previous) < cfg.step_mhz / 2:
                return None
            if abs(want - previous) < cfg.step_mhz * 1.5 and want != self._asked_mhz:
                # one bin either way is within a noisy fit's reach: move when two windows
                # in a row ask for it
                self._asked_mhz = want
                return None
        self._asked_mhz = None
        self._energy_mhz = None if want >= self._top(o) else want
        elasticity = fit.b / (fit.a * free + fit.b) if (fit.a * free + fit.b) > 0 else 0.0
        return (f"energy: {want:.0f} MHz keeps tokens/s over {floor:.2f}, within "
                f"{cfg.delta_percent:g} % of {self._reference()} (fit 1/R = {fit.a:.4g} β "
                f"+ {fit.b:.4g}/f, elasticity {elasticity:.2f} there)")

    def _reference(self) -> str:
        """What the floor is measured against, in words."""
        at = self._ref_mhz
        if self._sustain_mhz is not None and abs(at - self._sustain_mhz) < 0.5:
            return f"the {at:.0f} MHz the package would settle at at its limit"
        if self._thermal_mhz is not None and abs(at - self._thermal_mhz) < 0.5:
            return f"the thermal guard's {at:.0f} MHz"
        return f"the free {at:.0f} MHz's"

    def _free_clock(self) -> float | None:
        """The clock the package runs with no energy cut of ours: the last free window's, or
        where the thermal guard held it (after a workload change under the guard no window is
        free again, and the energy path would wait for one for good)."""
        if self._free_mhz is not None:
            return self._free_mhz
        return self._sustained[-1].f if self._sustained else None

    def _energy_under_guard(self) -> bool:
        """The energy ceiling holds the clock under the thermal guard's."""
        return self._energy_mhz is not None and self._thermal_mhz is not None and \
            self._energy_mhz < self._thermal_mhz

    def _measured_at(self, mhz: float) -> bool:
        """A window of what the package sustains lies within two bins of ``mhz``."""
        return any(abs(pt.f - mhz) <= 2 * self.config.step_mhz for pt in self._sustained)

    def _slack_mhz(self, o: Observation, floor: float) -> float | None:
        """One bin under the energy ceiling in force when its last windows (three or more at
        it) keep the floor by more than two standard errors of their mean: the evidence at the
        ceiling, not the fit, says there is room (a noisy fit can hold a ceiling up for good)."""
        if self._energy_mhz is None or self._thermal_mhz is not None and \
                self._thermal_mhz <= self._energy_mhz:
            return None
        at = [pt for pt in self._fit_points() if abs(pt.f - self._energy_mhz) < 0.5 *
              self.config.step_mhz]
        if len(at) < 3:
            return None
        mean = sum(pt.r for pt in at) / len(at)
        spread = math.sqrt(sum((pt.r - mean) ** 2 for pt in at) / (len(at) - 1))
        down = self._bin_down(self._energy_mhz - self.config.step_mhz, o)
        if mean - 2 * spread / math.sqrt(len(at)) <= floor or down <= self._bad_mhz:
            return None
        return down

    def _lowest_mhz(self, fit: Fit, floor: float, o: Observation) -> float:
        """The lowest whole bin keeping tokens/s over ``floor`` by ``fit`` at today's bytes per
        token; never at or under a ceiling that broke the floor."""
        cfg = self.config
        denom = 1.0 / floor - fit.a
        want = fit.b / denom if denom > 0 else self._top(o)
        want = max(want, self._bad_mhz + cfg.step_mhz, o.min_mhz or cfg.step_mhz)
        return min(self._top(o), self._bin_up(want))

    def _probe(self, o: Observation, mhz: float, where: str) -> str:
        self._probing = True
        self._probed_s = o.time_s
        self._energy_mhz = mhz
        return f"probe: {mhz:.0f} MHz, {where}, to learn how decode answers frequency"

    def _limit_known(self, o: Observation) -> bool:
        return self.config.limit_temp_c > 0 or o.limit_temp_c is not None

    def _limit_c(self, o: Observation) -> float | None:
        cfg = self.config
        if cfg.limit_temp_c > 0:
            return cfg.limit_temp_c
        return o.limit_temp_c if o.limit_temp_c is not None else self._learned_limit_c

    def _set_c(self, o: Observation) -> float | None:
        limit = self._limit_c(o)
        if limit is None:
            return None
        if not self._limit_known(o):
            return None     # learned where the firmware holds the clock: it holds it itself
        return limit - self.config.limit_margin_c

    def predict(self, o: Observation) -> tuple[float, float] | None:
        """(T_ss, t_hit) from the first-order fit since the last change, or None (no limit
        known, too few samples). T_ss is inf where the rise has not curved yet (t_hit then comes
        from the straight line)."""
        recent = [(s, t) for s, t in self._temps if s > self._changed_s]
        t_set = self._set_c(o)
        if len(recent) < 8 or o.pkg_temp_c is None or t_set is None:
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
            return None if slope <= 0 else (math.inf, max(0.0, (t_set - o.pkg_temp_c) / slope))
        c = my - alpha * mx
        t_ss = c / (1 - alpha)
        tau = -period / math.log(alpha)
        if o.pkg_temp_c >= t_set:
            return t_ss, 0.0
        if t_ss <= t_set:
            return t_ss, math.inf
        return t_ss, tau * math.log((t_ss - o.pkg_temp_c) / (t_ss - t_set))

    def _thermal(self, o: Observation) -> str | None:
        cfg = self.config
        got = self.predict(o)
        t_set = self._set_c(o)
        if got is None or t_set is None or o.pkg_power_w is None or o.busy_mhz is None:
            return None
        t_ss, t_hit = got
        urgent = t_hit < cfg.horizon_s * URGENT_FRACTION
        if t_hit < cfg.horizon_s and (math.isfinite(t_ss) or urgent):
            # a straight rise that has not curved yet is acted on only when close: it is most
            # often a big heat sink that settles before the limit
            bins = cfg.max_move_bins if urgent and math.isfinite(t_ss) else 1
            applied = self._target_mhz(o)
            want = self._mhz_for_watts(o, self._settling_watts(o, t_ss, t_set))
            want = max(self._bin_down(want, o), applied - bins * cfg.step_mhz)
            if self._thermal_mhz is not None and want >= self._thermal_mhz:
                return None
            if want >= applied:
                want = self._bin_down(applied - cfg.step_mhz, o)
            self._thermal_mhz = want
            self._thermal_moved_s = o.time_s
            return (f"thermal: {want:.0f} MHz, the package would reach {t_set:.1f} °C in "
                    f"{t_hit:.0f} s (settling at {t_ss:.1f} °C, {o.pkg_power_w:.0f} W)")
        # relax slowly: the heat sink answers over minutes, a fit since the last change
        # sees mostly the die, so a quick relax would undo what the sink needs
        energy_holds = self._energy_under_guard()
        # under an energy cut the prediction extrapolates from a cooler package (and its
        # leakage): one bin per re-probe, so a heat that returns is met before the next
        pace = cfg.reprobe_s if energy_holds else cfg.horizon_s / 2
        if self._thermal_mhz is not None and math.isfinite(t_ss) and \
                o.time_s - max(self._changed_s, self._thermal_moved_s) >= pace:
            up = self._thermal_mhz + cfg.step_mhz
            t_up = self._temp_at(o, t_ss, up)
            if t_up >= t_set - RELAX_MARGIN_C:
                return None
            # a ceiling the clock already runs under holds nothing: let it go (the guard
            # cuts again if the heat comes back)
            idle_cap = o.busy_mhz < self._thermal_mhz - cfg.step_mhz / 2 and not energy_holds
            self._thermal_mhz = None if up >= self._top(o) or idle_cap else up
            self._thermal_moved_s = o.time_s
            return (f"thermal relaxed: settling at {t_ss:.1f} °C, {t_up:.1f} °C predicted one bin "
                    f"up, under {t_set:.1f} °C")
        return None

    def _idle_package(self, o: Observation) -> tuple[float, float]:
        """(T, P) of the idle package before decode. Where none was seen (the daemon started
        mid-decode): the coolest reading of this decode less 5 °C and a quarter of today's
        power, a package's static share at full load on the calibrated plant (60 of 250 W) —
        erring toward a larger dynamic share, which cuts deeper."""
        assert o.pkg_power_w is not None
        coolest = min((t for _, t in self._temps), default=o.pkg_temp_c or 0.0)
        return self._base or (coolest - 5.0, 0.25 * o.pkg_power_w)

    def _settling_watts(self, o: Observation, t_ss: float, t_set: float) -> float:
        """The package power that settles at ``t_set``: the heat over the idle package is
        proportional to the power over it."""
        assert o.pkg_power_w is not None and o.pkg_temp_c is not None
        base_t, base_p = self._idle_package(o)
        if not math.isfinite(t_ss):
            t_ss = o.pkg_temp_c + 5.0
        share = max(0.0, min(1.0, (t_set - base_t) / max(1e-6, t_ss - base_t)))
        return base_p + (o.pkg_power_w - base_p) * share

    def _power_curve(self, o: Observation) -> tuple[float, float, float]:
        """(P_idle, k, e) of ``P = P_idle + k f^e`` through today's power: ``e`` from the
        windows when they span a bin (their log-log slope), else `POWER_EXPONENT`."""
        assert o.pkg_power_w is not None and o.busy_mhz
        _, base_p = self._idle_package(o)
        pts = [(pt.f, pt.p - base_p) for pt in self._points if pt.p > base_p and pt.f > 0]
        exponent = POWER_EXPONENT
        fs = [f for f, _ in pts]
        if fs and max(fs) - min(fs) >= self.config.step_mhz * 0.9:
            line = least_squares([math.log(f) for f in fs], [math.log(w) for _, w in pts])
            if line is not None:
                exponent = max(1.0, min(4.0, line[2]))
        dynamic = max(1e-6, o.pkg_power_w - base_p)
        return base_p, dynamic / o.busy_mhz ** exponent, exponent

    def _mhz_for_watts(self, o: Observation, watts: float) -> float:
        base_p, k, e = self._power_curve(o)
        # float(): typeshed gives float ** float as Any (a negative base makes a complex);
        # the bases here and in _watts_for_mhz are never negative
        return float((max(0.0, watts - base_p) / k) ** (1 / e))

    def _watts_for_mhz(self, o: Observation, mhz: float) -> float:
        base_p, k, e = self._power_curve(o)
        return base_p + k * float(mhz ** e)

    def _temp_at(self, o: Observation, t_ss: float, mhz: float) -> float:
        """Where the package would settle at ``mhz``, on the measured power curve."""
        assert o.pkg_power_w is not None
        base_t, base_p = self._idle_package(o)
        now = o.pkg_power_w - base_p
        if now <= 0:
            return t_ss
        return base_t + (t_ss - base_t) * (self._watts_for_mhz(o, mhz) - base_p) / now

    def _move(self, o: Observation, why: str) -> list[Action]:
        cfg = self.config
        top = float(o.max_mhz or 0.0)
        want = min(x for x in (self._energy_mhz, self._thermal_mhz, top) if x is not None)
        current = self.params["freq_ceiling"]["mhz"] if "freq_ceiling" in self.active else top
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

    # -- the PL1 actuator --------------------------------------------------------------------

    def _pl1_guard(self, o: Observation, throttled: bool, settled: bool,
                   completed: bool) -> list[Action]:
        """No frequency ceiling: the same target frequency through PL1, in bounded steps both
        ways, never above the firmware's. With several packages each gets its share."""
        cfg = self.config
        per_package = (o.pkg_power_packages_w is not None and o.pl1_firmware_packages_w
                       is not None and len(o.pkg_power_packages_w) ==
                       len(o.pl1_firmware_packages_w) > 1)
        # `or ()` only for mypy, which cannot narrow through per_package: both are there
        firmware = list(o.pl1_firmware_packages_w or ()) if per_package else \
            [o.pl1_firmware_w] if o.pl1_firmware_w is not None else None
        if not cfg.pl1 or firmware is None or o.pkg_power_w is None or o.busy_mhz is None:
            return []
        powers = list(o.pkg_power_packages_w or ()) if per_package else [o.pkg_power_w]
        read = list(o.pl1_packages_w or []) if per_package else \
            [o.pl1_w] if o.pl1_w is not None else []
        written = self.params.get("rapl_pl1", {}).get("pl1_w")
        wrote = None if written is None else (written if isinstance(written, list) else [written])
        if wrote is not None and len(read) == len(wrote) and o.time_s - self._changed_s >= 1.0 \
                and any(abs(r - w) > 1.0 for r, w in zip(read, wrote)):
            # read back: the firmware ignores PL1 writes; stop using it (no limit cycle)
            self.refuse("rapl_pl1")
            return [Action("release", "rapl_pl1", f"PL1 reads back {_watts(read)}, not the "
                           f"{_watts(wrote)} written: the firmware ignores it")]
        if "rapl_pl1" in self._refused:
            return []
        notes = []
        before = self._thermal_mhz
        # PL1 limits a time-averaged power: a cut shows only as the average falls, so one a
        # window (a cut each second would stack up before the first took hold)
        if throttled and o.time_s - self._changed_s >= cfg.dwell_s:
            self._throttle_cut(o)
            notes.append("the hardware throttled")
        elif settled:
            notes += [n for n in (self._thermal(o), self._energy(o) if completed else None) if n]
        if not notes and ("rapl_pl1" not in self.active or not settled or
                          self._energy_mhz is not None or self._thermal_mhz is not None):
            return []
        if o.time_s - self._changed_s < cfg.dwell_s:
            return []
        cut = self._thermal_mhz is not None and (before is None or self._thermal_mhz < before)
        why = "; ".join(notes) or "no reason left to hold PL1 under the firmware's"
        return self._move_pl1(o, firmware, powers, wrote, why, cut)

    def _move_pl1(self, o: Observation, firmware: list[float], powers: list[float],
                  wrote: list[float] | None, why: str, thermal_cut: bool) -> list[Action]:
        cfg = self.config
        top_total = sum(firmware)
        current = wrote if wrote is not None else firmware
        target = [x for x in (self._energy_mhz, self._thermal_mhz) if x is not None]
        assert o.busy_mhz is not None
        # one frequency bin's worth of watts on the measured curve: the least worth a move, and
        # the most a rise may add (a PL1 raised far over the average power grants a PL2 burst)
        bin_w = max(1.0, self._watts_for_mhz(o, o.busy_mhz + cfg.step_mhz)
                    - self._watts_for_mhz(o, o.busy_mhz))
        now, drawn = sum(current), sum(powers)
        want_total = top_total if not target else self._watts_for_mhz(o, min(target))
        if thermal_cut:
            want_total = min(want_total, drawn - bin_w)         # a thermal cut must bind
        step = cfg.pl1_step_percent / 100 * top_total
        if want_total < now:
            if want_total >= drawn - bin_w / 2:
                return []                     # a cap over what is drawn would not bind
            want_total = max(min(now, drawn) - step, want_total)
        else:
            want_total = min(now + bin_w, want_total)
        if abs(want_total - now) < bin_w / 2:
            return []
        caps = [round(max(cfg.pl1_min_w, min(top, want_total * p / max(1e-9, sum(powers)))), 1)
                for p, top in zip(powers, firmware)]
        if all(abs(c - n) < 0.5 for c, n in zip(caps, current)):
            return []
        self._changed_s = o.time_s
        self._window = None
        self._temps = [t for t in self._temps if t[0] >= o.time_s]
        if want_total >= top_total - 0.5 or all(c >= t - 0.5 for c, t in zip(caps, firmware)):
            self.active.remove("rapl_pl1")
            self.params.pop("rapl_pl1", None)
            return [Action("release", "rapl_pl1", f"PL1 back to the firmware's "
                           f"{_watts(firmware)}: {why}")]
        if "rapl_pl1" not in self.active:
            self.active.append("rapl_pl1")
        per_package = len(firmware) > 1
        value: float | list[float] = caps if per_package else caps[0]
        self.params["rapl_pl1"] = {"pl1_w": value}
        return [Action("apply", "rapl_pl1", f"PL1 {_watts(current)} -> {_watts(caps)} (firmware "
                       f"{_watts(firmware)}, from {_watts(powers)} drawn): {why}",
                       {"pl1_w": value})]

    # -- the uncore clock --------------------------------------------------------------------

    def _uncore_settled(self, o: Observation) -> bool:
        cfg = self.config
        return (self._uncore_done or not cfg.uncore or o.uncore_max_mhz is None
                or "uncore_ceiling" in self._refused)

    def _uncore_step(self, o: Observation) -> list[Action]:
        """Before the core's energy ceiling: the uncore one step down while the last window
        kept half the floor's budget (``delta / 2``; the core's ceiling spends the rest), one
        step back up and done when it did not, done at the bottom."""
        cfg = self.config
        top, bottom = o.uncore_max_mhz, o.uncore_min_mhz
        if self._uncore_settled(o) or top is None or self._fit is None or self._probing:
            return []
        point = self._points[-1]
        floor = self._floor(self._fit, o.gb_per_token or point.gb)
        if floor is None:
            return []
        now = self._uncore_limit() or top
        step = cfg.uncore_step_mhz
        if point.r + 2 * point.se < floor:
            self._uncore_done = True
            if now >= top:
                return []
            self._uncore_bad = max(self._uncore_bad, now)
            why = (f"{point.r:.2f} tok/s at {now:.0f} MHz is under {floor:.2f}, half the "
                   "floor's budget: back up a step, and there for this workload")
            return [self._uncore_release(o, why)] if now + step >= top else \
                [self._uncore_apply(o, now + step, why)]
        down = max(bottom or step, now - step)
        if down <= self._uncore_bad or down >= now:
            self._uncore_done = True
            return []
        return [self._uncore_apply(o, down, f"{point.r:.2f} tok/s at {now:.0f} MHz keeps "
                                            f"{floor:.2f}, half the floor's budget: a step down")]

    def _uncore_apply(self, o: Observation, mhz: float, why: str) -> Action:
        before = self.params.get("uncore_ceiling", {}).get("mhz", o.uncore_max_mhz)
        self._changed_s = o.time_s
        self._window = None
        if "uncore_ceiling" not in self.active:
            self.active.append("uncore_ceiling")
        self.params["uncore_ceiling"] = {"mhz": mhz}
        return Action("apply", "uncore_ceiling", f"uncore {before:.0f} -> {mhz:.0f} MHz: {why}",
                      {"mhz": mhz})

    def _uncore_release(self, o: Observation, why: str) -> Action:
        self._changed_s = o.time_s
        self._window = None
        self.active.remove("uncore_ceiling")
        self.params.pop("uncore_ceiling", None)
        return Action("release", "uncore_ceiling", f"uncore back to its top: {why}")

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
            "limit_temp_c": self._limit_c(o), "free_mhz": self._free_mhz,
            "energy_ceiling_mhz": self._energy_mhz, "thermal_ceiling_mhz": self._thermal_mhz,
            "hardware_throttled": throttled, "active": list(self.active),
        }


def _total(value: float | list[float]) -> float:
    return float(sum(value)) if isinstance(value, list) else float(value)
