"""A CPU package decoding tokens: its heat, power, power limits and throttling, shaped like hardware.

Pure apart from `Plant.write_fake_root` and `read_controls`, the only functions that touch files.
Time is simulated: `Plant.step` advances the model by ``dt`` seconds without sleeping.

Model and equations
===================

Per package. ``f`` is the core frequency in GHz, ``n`` the engine's decode threads (one per core),
``u`` the load (fraction of time the threads decode: 1 in sustained decode, 0 idle).

Voltage, linear in frequency, and power: static (uncore and leakage, growing with die
temperature) plus dynamic ``C V² f`` per active core::

    V(f)          = v0 + kv * f                                                      [V]
    P_static(T)   = p_static * max(0.5, 1 + leak_per_c * (T_die - leak_ref_c))       [W]
    P(f, n, u, T) = P_static(T) + u * n * c_eff * V(f)**2 * f * 1e9                  [W]

Thermal: two RC nodes, the die (small capacitance, behind the thermal interface) and the heat
sink (large, cooled by the inlet air at ``ambient``)::

    c_die  * dT_die/dt  = P - (T_die - T_sink) / r_die_sink
    c_sink * dT_sink/dt = (T_die - T_sink) / r_die_sink - (T_sink - ambient) / r_sink_amb

Decode speed. One token reads every weight once (``t_mem = gb_per_token / mem_bw_gbs``) and does
compute that scales as ``1 / (f n)``; ``knee_ghz`` is where the two take equal time with every
core decoding. How much they overlap is ``overlap_p`` (1: not at all, times add, a soft curve;
large: fully, the slower one wins, a hard roofline)::

    t_cpu(f, n) = t_mem * knee_ghz * cores / (f * n)
    tok/s       = u / (t_mem**p + t_cpu**p) ** (1/p)

With ``p = 1`` this is the ``1/R = a + b/f`` form, elasticity ``d ln R / d ln f = knee'/(f + knee')``.
Where the KV cache grows (``gb_growth_period_s`` > 0: a long reasoning decode), every that many
seconds of decode ``gb_per_token`` gains ``gb_per_token(0) * U(0, gb_growth_max)`` (seeded by
``gb_growth_seed``; back to the weights' when the engine idles); compute time scales with it
(``t_cpu`` is tied to ``t_mem``), so tokens/s falls as one over the bytes at every clock. The
engine knows what it reads: `Plant.observed` reports the current ``gb_per_token``.
Published data supports the shape, not a particular knee: llama.cpp's decode saturates at a few
threads (llama.cpp #34, #12966, #6434) and reaches 84–91 % of STREAM read bandwidth (#26484);
no CPU core-frequency sweep of decode has been published, hence the ensemble's wide knee range.

Frequency, chosen every substep by the (modelled) power-control unit::

    request = min(f_base if no_turbo else f_turbo - epb_ghz_per_step * max(0, epb - epb_neutral),
                  ceiling,                               (cpufreq scaling_max_freq)
                  f_turbo + (f_allcore - f_turbo) * (n - 1) / (cores - 1))   (turbo ratio limit)
    limit   = PL1 once avg_P >= PL1 until avg_P < 0.9 PL1, else PL2   (avg_P: exp. average, tau)
    f_pl    = the highest f <= request with P(f) <= limit
    f       = min(f_pl, f_tcc)                           (throttle = "tcc")
    f       = f_floor while PROCHOT#, else f_pl          (throttle = "floor")
    f       = min(f_pl, f_turbo - (f_turbo - f_min) * clamp((T_die - T_lim + w) / w, 0, 1))
                                                         (throttle = "slope", w = slope_width_c)

PL1 is the firmware's value unless a write took (``pl1_writable``; AMD never: its limits belong to
the SMU). ``f_turbo`` is the 1-core turbo that ``cpuinfo_max_freq`` shows, ``f_allcore`` (None:
the same) what the turbo ratio limits allow with every core busy, linear in between. TCC (Intel's
Adaptive Thermal Monitor; the ``amd`` plant applies it to its Tctl limit too): while
``T_die >= tj_max - tcc_offset`` the ratio cap ``f_tcc`` drops ``tcc_step_ghz`` every
``tcc_period_s`` (never under ``f_min``); once ``T_die <= tj_max - tcc_offset - tcc_hyst_c`` it
climbs back one step a period. The die settles just under the activation temperature. The floor
variant models an external PROCHOT# (a VR hot, a laptop's BD-PROCHOT): the clock drops to
``f_floor`` until the die is ``floor_hyst_c`` cooler. The slope variant models AMD's boost near
its Tctl limit (Precision Boost lowers the clock as the temperature rises; AMD does not publish
the curve, so a straight line is this model's): no bins and no hysteresis, the cap falls from
``f_turbo`` to ``f_min`` over the last ``slope_width_c`` under the limit and the die settles on
it. Each activation counts as one thermal throttle event; the time ``f_tcc`` (the floor, the
slope) limits the clock is the throttle time, as the kernel's ``*_throttle_count`` /
``*_throttle_total_time_ms`` report them (Intel only). The limit
reasons (``MSR_CORE_PERF_LIMIT_REASONS`` 0x64F) say what holds the clock: bit 0 PROCHOT, bit 1
thermal, bit 10 PL1, bit 11 PL2.

Energy is the integral of ``P``; tokens the integral of tok/s. Explicit Euler at ``substep_s``
(0.1 s, under the smallest die time constant in the ensemble); observables are averages over
each ``step``. Where a machine shows no sensor (``sensors = False``, a VM) the sample says None;
without cpufreq (``cpufreq_ceiling = False``) there is no ceiling, maximum or minimum frequency to
read and no cpufreq or intel_pstate file in the fake root; where the thermal limit is the
firmware's secret (``limit_readable = False``: AMD's Tctl limit) the sample says None for it and
the fake root has no trip point and no ``temp1_crit``.
What software sees may carry sensor noise (``tokens_noise``, ``power_noise``: relative, Gaussian,
per sample) and a temperature resolution (``temp_step_c``); the figures use the truth.

The calibrated default (`XEON`) is the published sustained-inference case on a 32-core server
Xeon (3.8 GHz at first, about 2.4 GHz after roughly 120 s) with the thermal network fitted to it:
r_die_sink 0.08 K/W, c_die 20 J/K (1.6 s), r_sink_amb 0.24 K/W, c_sink 650 J/K (156 s); 8.0 W per
core at 3.8 GHz; a 7B-class bf16 model (15.2 GB per token) on 250 GB/s, knee 2.6 GHz.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# MSR_CORE_PERF_LIMIT_REASONS bits the plant sets
REASON_PROCHOT = 1 << 0
REASON_THERMAL = 1 << 1
REASON_PL1 = 1 << 10
REASON_PL2 = 1 << 11


@dataclass(frozen=True)
class PlantParams:
    """Physical parameters of one package; see the module docstring for the equations."""

    name: str = "xeon"
    vendor: str = "intel"                   # "intel" | "amd"
    sensors: bool = True                    # False: a VM, no temperature, power or counters
    cpufreq_ceiling: bool = True            # False: no cpufreq at all (no ceiling: PL1 only)
    limit_readable: bool = True             # False: the thermal limit is the firmware's secret
    cores: int = 32
    # thermal (two-node RC)
    ambient_c: float = 30.0
    r_die_sink_k_per_w: float = 0.08
    c_die_j_per_k: float = 20.0
    r_sink_amb_k_per_w: float = 0.24
    c_sink_j_per_k: float = 650.0
    start_temp_c: float | None = None       # None: the idle steady state
    # power
    p_static_w: float = 60.0
    leak_per_c: float = 0.01
    leak_ref_c: float = 60.0
    c_eff_nf: float = 1.54                  # per core
    v0: float = 0.60
    kv_per_ghz: float = 0.15
    # frequency
    f_turbo_ghz: float = 3.8                # one core busy: cpuinfo_max_freq
    f_allcore_ghz: float | None = None      # every core busy (None: f_turbo_ghz)
    f_base_ghz: float = 2.0
    f_min_ghz: float = 0.8
    epb_neutral: int = 4                    # EPB at or below this leaves the turbo ceiling alone
    epb_ghz_per_step: float = 0.1
    # firmware power limits
    pl1_w: float = 350.0
    pl2_w: float = 420.0
    tau_s: float = 28.0
    pl1_writable: bool = True               # False: locked by the BIOS, or AMD (SMU-owned)
    # thermal limit
    throttle: str = "tcc"                   # "tcc" (stepwise) | "floor" (PROCHOT#) | "slope"
    tj_max_c: float = 105.0
    tcc_offset_c: float = 0.0               # MSR 0x1A2 bits 29:24
    tcc_step_ghz: float = 0.1
    tcc_period_s: float = 0.1
    tcc_hyst_c: float = 1.0
    f_floor_ghz: float = 0.8
    floor_hyst_c: float = 1.5
    slope_width_c: float = 5.0              # "slope": boost falls over this many °C to the limit
    t_trip_c: float = 90.0                  # passive trip point (reported, not enforced)
    # decode
    mem_bw_gbs: float = 250.0
    gb_per_token: float = 15.2
    knee_ghz: float = 2.6
    overlap_p: float = 1.0                  # 1 soft (times add) .. >= 50 hard roofline
    gb_growth_period_s: float = 0.0         # the KV cache grows gb_per_token every this (0: never)
    gb_growth_max: float = 0.0              # by up to this fraction of the weights' (uniform)
    gb_growth_seed: int = 0
    # the uncore (mesh, last-level cache, memory controller): a knob where uncore_w > 0
    uncore_w: float = 0.0                   # its power at the top uncore clock (0: no knob)
    uncore_max_ghz: float = 2.4
    uncore_min_ghz: float = 0.8
    uncore_sat_ghz: float = 1.6             # where memory bandwidth stops growing with it
    uncore_knee_p: float = 4.0              # how sharply (as overlap_p: larger, harder)
    # what the sensors add (observed only; the figures use the truth)
    tokens_noise: float = 0.0               # relative sigma of one tokens/s sample
    power_noise: float = 0.0                # relative sigma of one package-power sample
    temp_step_c: float = 0.0                # sensor resolution (coretemp: 1 °C); 0 = exact
    noise_seed: int = 0
    # integration
    substep_s: float = 0.1

    @property
    def roofline_tok_s(self) -> float:
        return self.mem_bw_gbs / self.gb_per_token

    @property
    def t_mem_s(self) -> float:
        return self.gb_per_token / self.mem_bw_gbs

    @property
    def r_total_k_per_w(self) -> float:
        return self.r_die_sink_k_per_w + self.r_sink_amb_k_per_w

    @property
    def t_limit_c(self) -> float:
        """Where the hardware steps in: TjMax minus the TCC offset."""
        return self.tj_max_c - self.tcc_offset_c


XEON = PlantParams()


@dataclass
class Controls:
    """What the plant obeys: knobs the daemon (or a policy) sets. None: the firmware's value."""

    pl1_w: float | None = None
    ceiling_ghz: float | None = None        # scaling_max_freq
    no_turbo: bool = False
    epb: int = 4
    threads: int | None = None              # None: every core
    load: float = 1.0
    ambient_c: float | None = None          # None: the params' ambient
    uncore_ghz: float | None = None         # the uncore's max_freq_khz (None: the firmware's)


class Plant:
    """The simulated package. `step` advances it; attributes are its current state."""

    def __init__(self, params: PlantParams = XEON, controls: Controls | None = None) -> None:
        self.params = params
        self.controls = controls or Controls()
        self.time_s = 0.0
        amb = self.ambient_c()
        idle = self.power_w(params.f_min_ghz, 0, 0.0, amb)
        start = params.start_temp_c
        if start is None:  # idle steady state (leakage evaluated at the result, iterated)
            start = amb
            for _ in range(20):
                idle = self.power_w(params.f_min_ghz, 0, 0.0, start)
                start = amb + params.r_total_k_per_w * idle
            self.t_sink_c = amb + params.r_sink_amb_k_per_w * idle
        else:
            self.t_sink_c = start
        self.t_die_c = start
        self.freq_ghz = params.f_turbo_ghz
        self.avg_power_w = idle
        self.budget_spent = False       # the PL2 budget ran out: PL1 holds
        self.f_tcc = params.f_turbo_ghz
        self.tcc_active = False
        self.floor_active = False
        self._tcc_clock = 0.0
        self.throttle_count = 0         # as the kernel shows it (a schedule may add boot counts)
        self.throttle_s = 0.0
        self.events = 0                 # the truth: thermal limit activations in this run
        self.hot_s = 0.0
        self.energy_j = 0.0
        self.tokens = 0.0
        self.reasons = 0
        self.online = params.cores
        self.gb_per_token = params.gb_per_token     # what the engine reads per token, now
        self._gb_clock = 0.0
        self._gb_rng = random.Random(params.gb_growth_seed)
        self.last: dict[str, Any] = {}
        self._noise = random.Random(params.noise_seed)
        self._written: dict[str, dict[str, str]] = {}   # fake root -> what was written there

    # -- model -------------------------------------------------------------------------------

    def ambient_c(self) -> float:
        c = self.controls.ambient_c
        return self.params.ambient_c if c is None else c

    def threads(self) -> int:
        n = self.controls.threads
        return self.params.cores if n is None else max(0, min(self.params.cores, n))

    def power_w(self, f_ghz: float, cores: int, load: float, t_die_c: float) -> float:
        p = self.params
        static = p.p_static_w * max(0.5, 1.0 + p.leak_per_c * (t_die_c - p.leak_ref_c))
        v = p.v0 + p.kv_per_ghz * f_ghz
        uncore = p.uncore_w * (self.uncore_ghz(load) / p.uncore_max_ghz) ** 2
        return static + uncore + load * cores * p.c_eff_nf * v * v * f_ghz

    def uncore_ghz(self, load: float | None = None) -> float:
        """The uncore clock: its limit under load, the floor idle (the hardware's own scaling)."""
        p, c = self.params, self.controls
        if (c.load if load is None else load) <= 0:
            return p.uncore_min_ghz
        top = c.uncore_ghz if c.uncore_ghz is not None else p.uncore_max_ghz
        return max(p.uncore_min_ghz, min(p.uncore_max_ghz, top))

    def bandwidth_gbs(self) -> float:
        """Memory bandwidth at today's uncore clock: saturating softly past ``uncore_sat_ghz``
        (``(1 + (sat/f)^p)^(-1/p)``, normalised to 1 at the top clock)."""
        p = self.params
        if p.uncore_w <= 0:
            return p.mem_bw_gbs

        def reach(f: float) -> float:
            q = p.uncore_knee_p
            return float((1 + (p.uncore_sat_ghz / f) ** q) ** (-1 / q))
        return p.mem_bw_gbs * reach(self.uncore_ghz()) / reach(p.uncore_max_ghz)

    def pl1_effective_w(self) -> float:
        p, c = self.params, self.controls
        return c.pl1_w if (c.pl1_w is not None and p.pl1_writable) else p.pl1_w

    def request_ghz(self) -> float:
        """The frequency software allows: turbo or base, EPB, the cpufreq ceiling."""
        p, c = self.params, self.controls
        top = p.f_base_ghz if c.no_turbo else p.f_turbo_ghz
        top = max(p.f_min_ghz, top - p.epb_ghz_per_step * max(0, c.epb - p.epb_neutral))
        if c.ceiling_ghz is not None:
            top = max(p.f_min_ghz, min(top, c.ceiling_ghz))
        return top

    def turbo_ghz(self) -> float:
        """The turbo ratio limit for the cores now decoding: the 1-core turbo for one, falling
        linearly to the all-core turbo with every core busy (the cpufreq ceiling stays put)."""
        p = self.params
        busy = self.threads() if self.controls.load > 0 else 0
        if p.f_allcore_ghz is None or busy <= 1 or p.cores <= 1:
            return p.f_turbo_ghz
        return p.f_turbo_ghz + (p.f_allcore_ghz - p.f_turbo_ghz) * (busy - 1) / (p.cores - 1)

    def _power_limited_ghz(self, request: float, cap: float) -> float:
        p, n, load, t = self.params, self.threads(), self.controls.load, self.t_die_c
        if self.power_w(request, n, load, t) <= cap:
            return request
        lo, hi = p.f_min_ghz, request
        if self.power_w(lo, n, load, t) > cap:
            return lo
        for _ in range(14):
            mid = (lo + hi) / 2
            if self.power_w(mid, n, load, t) <= cap:
                lo = mid
            else:
                hi = mid
        return lo

    def tokens_per_s(self, f_ghz: float) -> float:
        p, n, u = self.params, self.threads(), self.controls.load
        if n <= 0 or u <= 0:
            return 0.0
        t_mem = self.gb_per_token / self.bandwidth_gbs()
        t_cpu = self.gb_per_token / p.mem_bw_gbs * p.knee_ghz * p.cores / (max(f_ghz, 1e-3) * n)
        if p.overlap_p >= 50:
            t = max(t_mem, t_cpu)
        else:
            q = p.overlap_p
            t = (t_mem ** q + t_cpu ** q) ** (1.0 / q)
        return u / t

    def _thermal_limit(self, f_pl: float, h: float) -> float:
        """Apply TCC or PROCHOT# to the power-limited frequency; count events and time."""
        p = self.params
        if p.throttle == "slope":
            return self._slope_limit(f_pl, h)
        hot = self.t_die_c >= p.t_limit_c
        if p.throttle == "floor":
            if not self.floor_active and hot:
                self.floor_active = True
                self.throttle_count += 1
                self.events += 1
            elif self.floor_active and self.t_die_c <= p.t_limit_c - p.floor_hyst_c:
                self.floor_active = False
            if self.floor_active:
                self.throttle_s += h
                self.hot_s += h
                return min(f_pl, p.f_floor_ghz)
            return f_pl
        self._tcc_clock += h
        if self._tcc_clock >= p.tcc_period_s - 1e-9:
            self._tcc_clock = 0.0
            if hot:
                self.f_tcc = max(p.f_min_ghz, min(self.f_tcc, f_pl) - p.tcc_step_ghz)
            elif self.t_die_c <= p.t_limit_c - p.tcc_hyst_c:
                self.f_tcc = min(p.f_turbo_ghz, self.f_tcc + p.tcc_step_ghz)
        self._count_limit(self.f_tcc < f_pl - 1e-9, h)
        return min(f_pl, self.f_tcc)

    def _slope_limit(self, f_pl: float, h: float) -> float:
        """AMD's boost: the clock cap falls linearly from turbo to ``f_min`` over the last
        ``slope_width_c`` under the limit, continuously (no bins, no hysteresis)."""
        p = self.params
        over = (self.t_die_c - (p.t_limit_c - p.slope_width_c)) / p.slope_width_c
        cap = p.f_turbo_ghz - (p.f_turbo_ghz - p.f_min_ghz) * min(1.0, max(0.0, over))
        self._count_limit(cap < f_pl - 1e-9, h)
        return min(f_pl, cap)

    def _count_limit(self, limiting: bool, h: float) -> None:
        """One event when the thermal cap starts to hold the clock; time while it does."""
        if limiting and not self.tcc_active:
            self.throttle_count += 1
            self.events += 1
        self.tcc_active = limiting
        if limiting:
            self.throttle_s += h
            self.hot_s += h

    def _grow_kv(self, h: float) -> None:
        """R1's reasoning lengthens the context, so bytes per token grow while a decode runs;
        an idle engine has freed its KV cache."""
        p = self.params
        if p.gb_growth_period_s <= 0:
            return
        if self.controls.load <= 0:
            self.gb_per_token, self._gb_clock = p.gb_per_token, 0.0
            return
        self._gb_clock += h
        if self._gb_clock >= p.gb_growth_period_s - 1e-9:
            self._gb_clock -= p.gb_growth_period_s
            self.gb_per_token += p.gb_per_token * self._gb_rng.uniform(0.0, p.gb_growth_max)

    # -- time --------------------------------------------------------------------------------

    def step(self, dt: float = 1.0) -> dict[str, Any]:
        """Advance ``dt`` simulated seconds; return the observable state (averages over dt)."""
        p, c = self.params, self.controls
        steps = max(1, round(dt / p.substep_s))
        h = dt / steps
        n, amb = self.threads(), self.ambient_c()
        pl1 = self.pl1_effective_w()
        sum_f = sum_p = sum_tok = 0.0
        reasons = 0
        for _ in range(steps):
            request = min(self.request_ghz(), self.turbo_ghz())
            self._grow_kv(h)
            if self.avg_power_w >= pl1:
                self.budget_spent = True
            elif self.avg_power_w < 0.9 * pl1:   # budget regained (hysteresis, no chatter)
                self.budget_spent = False
            cap = pl1 if self.budget_spent else max(pl1, p.pl2_w)
            f_pl = self._power_limited_ghz(request, cap)
            f = self._thermal_limit(f_pl, h)
            if f_pl < request - 1e-9:
                reasons |= REASON_PL1 if self.budget_spent else REASON_PL2
            if f < f_pl - 1e-9:
                reasons |= REASON_PROCHOT if p.throttle == "floor" else REASON_THERMAL
            self.freq_ghz = f
            power = self.power_w(f, n, c.load, self.t_die_c)
            tok = self.tokens_per_s(f)
            self.avg_power_w += (power - self.avg_power_w) * min(1.0, h / p.tau_s)
            flow = (self.t_die_c - self.t_sink_c) / p.r_die_sink_k_per_w
            self.t_die_c += h * (power - flow) / p.c_die_j_per_k
            self.t_sink_c += h * (flow - (self.t_sink_c - amb) / p.r_sink_amb_k_per_w) \
                / p.c_sink_j_per_k
            sum_f += f * h
            sum_p += power * h
            sum_tok += tok * h
            self.time_s += h
        self.energy_j += sum_p
        self.tokens += sum_tok
        self.reasons = reasons
        busy = sum_f / dt * 1000.0 if c.load > 0 else None
        self.last = {
            "time_s": round(self.time_s, 6),
            "pkg_temp_c": self.t_die_c,
            "sink_temp_c": self.t_sink_c,
            "busy_mhz": busy,
            "freq_mhz": sum_f / dt * 1000.0,
            "pkg_power_w": sum_p / dt,
            "throttle_count": self.throttle_count,
            "throttle_ms": self.throttle_s * 1000.0,
            "events": self.events,
            "hot_s": self.hot_s,
            "limit_reasons": reasons,
            "tokens_per_s": sum_tok / dt,
            "gb_per_token": self.gb_per_token,
            "tokens": self.tokens,
            "energy_j": self.energy_j,
            "pl1_w": pl1,
            "ceiling_mhz": self.request_ghz() * 1000.0,
            "no_turbo": c.no_turbo,
            "epb": c.epb,
            "threads": n,
            "load": c.load,
            "ambient_c": amb,
            "limit_temp_c": p.t_limit_c,
            "uncore_limit_mhz": (c.uncore_ghz or p.uncore_max_ghz) * 1000.0,
        }
        return dict(self.last)

    def observed(self) -> dict[str, Any]:
        """What software on this machine can see of the last step (None where it cannot)."""
        s, p = self.last, self.params
        intel = p.vendor == "intel"
        temp = s["pkg_temp_c"]
        if p.temp_step_c > 0:
            temp = math.floor(temp / p.temp_step_c) * p.temp_step_c
        power = s["pkg_power_w"] * (1 + self._noise.gauss(0.0, p.power_noise))
        tokens = s["tokens_per_s"] * (1 + self._noise.gauss(0.0, p.tokens_noise))
        cpufreq = p.cpufreq_ceiling
        return {
            "time_s": s["time_s"],
            "pkg_temp_c": temp if p.sensors else None,
            "busy_mhz": s["busy_mhz"],
            "pkg_power_w": power if p.sensors else None,
            "throttle_count": s["throttle_count"] if p.sensors and intel else None,
            "throttle_ms": s["throttle_ms"] if p.sensors and intel else None,
            "limit_reasons": s["limit_reasons"] if p.sensors and intel else None,
            "tokens_per_s": tokens,
            "threads": s["threads"],
            "online_cpus": self.online,
            "limit_temp_c": p.t_limit_c if p.sensors and p.limit_readable else None,
            "ceiling_mhz": s["ceiling_mhz"] if cpufreq else None,
            "max_mhz": p.f_turbo_ghz * 1000.0 if cpufreq else None,
            "min_mhz": p.f_min_ghz * 1000.0 if cpufreq else None,
            "pl1_w": s["pl1_w"] if p.sensors and intel else None,
            "pl1_firmware_w": p.pl1_w if p.sensors and intel else None,
            "gb_per_token": s["gb_per_token"],      # the engine's own figure: weights + KV read
            "uncore_max_mhz": p.uncore_max_ghz * 1000.0 if p.uncore_w > 0 else None,
            "uncore_min_mhz": p.uncore_min_ghz * 1000.0 if p.uncore_w > 0 else None,
            "uncore_limit_mhz": s["uncore_limit_mhz"] if p.uncore_w > 0 else None,
        }

    # -- a fake root -------------------------------------------------------------------------

    def write_fake_root(self, root: Path) -> None:
        """Write the observable state under ``root`` the way a real machine shows it.

        State files (temperatures, energy, counters, frequencies) are rewritten when their value
        changed, atomically (a reader never sees half a file). Control files (PL1, no_turbo, EPB,
        scaling_max_freq) are written only when missing, so that what a daemon writes there stays
        and `read_controls` picks it up; a PL1 the firmware ignores is put back to its value.
        """
        root = Path(root)
        p, c = self.params, self.controls
        state: dict[str, str] = {f"{CPU}/online": f"0-{p.cores - 1}"}
        controls: dict[str, str] = {}
        if p.sensors:
            state.update(self._sensor_files())
        if p.sensors and p.vendor == "intel":
            state.update({
                f"{RAPL}/constraint_0_name": "long_term",
                f"{RAPL}/constraint_0_time_window_us": str(int(p.tau_s * 1e6)),
                f"{RAPL}/constraint_0_max_power_uw": str(int(p.pl1_w * 1e6)),
                f"{RAPL}/constraint_1_name": "short_term",
                f"{RAPL}/constraint_1_power_limit_uw": str(int(p.pl2_w * 1e6)),
            })
            pl1 = str(int((c.pl1_w if c.pl1_w is not None else p.pl1_w) * 1e6))
            if not p.pl1_writable:
                state[f"{RAPL}/constraint_0_power_limit_uw"] = str(int(p.pl1_w * 1e6))
            else:
                controls[f"{RAPL}/constraint_0_power_limit_uw"] = pl1
        # no_turbo and boost belong to the cpufreq drivers: no cpufreq, no such file
        if p.cpufreq_ceiling and p.sensors and p.vendor == "intel":
            state[f"{CPU}/intel_pstate/status"] = "active"
            controls[f"{CPU}/intel_pstate/no_turbo"] = "1" if c.no_turbo else "0"
        elif p.cpufreq_ceiling and p.vendor == "amd":
            state[f"{CPU}/amd_pstate/status"] = "active"
            controls[f"{CPU}/cpufreq/boost"] = "0" if c.no_turbo else "1"
        for n in range(p.cores):
            self._cpu_files(f"{CPU}/cpu{n}", n, state, controls)
        if p.uncore_w > 0:
            self._uncore_files(state, controls)
        written = self._written.setdefault(str(root), {})
        for rel, text in state.items():
            if written.get(rel) != text or not (root / rel).exists():
                _atomic_write(root / rel, text + "\n")
                written[rel] = text
        for rel, text in controls.items():
            if not (root / rel).exists():
                _atomic_write(root / rel, text + "\n")

    def _sensor_files(self) -> dict[str, str]:
        """Temperatures and the energy counter; the limit only where software can read it."""
        p = self.params
        temp_mc = str(int(round(self.t_die_c * 1000)))
        intel = p.vendor == "intel"
        files = {
            "sys/class/thermal/thermal_zone0/type": "x86_pkg_temp",
            "sys/class/thermal/thermal_zone0/temp": temp_mc,
            "sys/class/thermal/thermal_zone0/trip_point_0_type": "passive",
            "sys/class/thermal/thermal_zone0/trip_point_0_temp": str(int(p.t_trip_c * 1000)),
            "sys/class/hwmon/hwmon0/name": "coretemp" if intel else "k10temp",
            "sys/class/hwmon/hwmon0/temp1_label": "Package id 0" if intel else "Tctl",
            "sys/class/hwmon/hwmon0/temp1_input": temp_mc,
            "sys/class/hwmon/hwmon0/temp1_crit": str(int(p.t_limit_c * 1000)),
            f"{RAPL}/name": "package-0",
            f"{RAPL}/energy_uj": str(int(self.energy_j * 1e6) % MAX_ENERGY_UJ),
            f"{RAPL}/max_energy_range_uj": str(MAX_ENERGY_UJ),
            f"{RAPL}/enabled": "1",
        }
        if not p.limit_readable:
            for rel in ("sys/class/thermal/thermal_zone0/trip_point_0_type",
                        "sys/class/thermal/thermal_zone0/trip_point_0_temp",
                        "sys/class/hwmon/hwmon0/temp1_crit"):
                del files[rel]
        return files

    def _uncore_files(self, state: dict[str, str], controls: dict[str, str]) -> None:
        """intel_uncore_frequency's package directory: the firmware's range, the limits."""
        p, c = self.params, self.controls
        d = f"{UNCORE}/package_00_die_00"
        state[f"{d}/initial_max_freq_khz"] = str(int(p.uncore_max_ghz * 1e6))
        state[f"{d}/initial_min_freq_khz"] = str(int(p.uncore_min_ghz * 1e6))
        state[f"{d}/current_freq_khz"] = str(int(round(self.uncore_ghz() * 1e6)))
        top = c.uncore_ghz if c.uncore_ghz is not None else p.uncore_max_ghz
        controls[f"{d}/max_freq_khz"] = str(int(round(top * 1e6)))
        controls[f"{d}/min_freq_khz"] = str(int(p.uncore_min_ghz * 1e6))

    def _cpu_files(self, d: str, n: int, state: dict[str, str], controls: dict[str, str]) -> None:
        """One CPU's files: topology and EPB always, cpufreq where there is a driver, the
        throttle counters on Intel."""
        p, c = self.params, self.controls
        if p.cpufreq_ceiling:
            mhz = self.last.get("freq_mhz", self.freq_ghz * 1000.0)
            ceiling = c.ceiling_ghz if c.ceiling_ghz is not None else p.f_turbo_ghz
            state[f"{d}/cpufreq/scaling_cur_freq"] = str(int(round(mhz * 1000)))
            state[f"{d}/cpufreq/cpuinfo_max_freq"] = str(int(p.f_turbo_ghz * 1e6))
            state[f"{d}/cpufreq/cpuinfo_min_freq"] = str(int(p.f_min_ghz * 1e6))
            state[f"{d}/cpufreq/base_frequency"] = str(int(p.f_base_ghz * 1e6))
            controls[f"{d}/cpufreq/scaling_max_freq"] = str(int(round(ceiling * 1e6)))
        state[f"{d}/topology/core_id"] = str(n)
        state[f"{d}/topology/physical_package_id"] = "0"
        if p.sensors and p.vendor == "intel":
            throttle_ms = str(int(self.throttle_s * 1000))
            state[f"{d}/thermal_throttle/core_throttle_count"] = str(self.throttle_count)
            state[f"{d}/thermal_throttle/package_throttle_count"] = str(self.throttle_count)
            state[f"{d}/thermal_throttle/core_throttle_total_time_ms"] = throttle_ms
            state[f"{d}/thermal_throttle/package_throttle_total_time_ms"] = throttle_ms
        controls[f"{d}/power/energy_perf_bias"] = str(c.epb)

RAPL = "sys/class/powercap/intel-rapl:0"
CPU = "sys/devices/system/cpu"
UNCORE = f"{CPU}/intel_uncore_frequency"
MAX_ENERGY_UJ = 262143328850


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _int(path: Path) -> int | None:
    try:
        return int(path.read_text())
    except (OSError, ValueError):
        return None


def read_controls(root: Path) -> dict[str, Any]:
    """Knob values a daemon wrote under ``root``: ``pl1_w``, ``no_turbo``, ``epb``,
    ``ceiling_ghz`` (the lowest ``scaling_max_freq`` over the CPUs, what caps a parallel decode).

    Only what is present and parses is returned; EPB is the most common value over the CPUs
    (ties: the higher, the more power-saving one).
    """
    root = Path(root)
    out: dict[str, Any] = {}
    pl1 = _int(root / RAPL / "constraint_0_power_limit_uw")
    if pl1 is not None:
        out["pl1_w"] = pl1 / 1e6
    for rel, invert in (("intel_pstate/no_turbo", False), ("cpufreq/boost", True)):
        v = _int(root / CPU / rel)
        if v is not None:
            out["no_turbo"] = (v == 0) if invert else (v != 0)
    counts: dict[int, int] = {}
    for f in (root / CPU).glob("cpu[0-9]*/power/energy_perf_bias"):
        v = _int(f)
        if v is not None:
            counts[v] = counts.get(v, 0) + 1
    if counts:
        out["epb"] = max(counts, key=lambda v: (counts[v], v))
    ceilings = [v for f in (root / CPU).glob("cpu[0-9]*/cpufreq/scaling_max_freq")
                if (v := _int(f)) is not None]
    if ceilings:
        out["ceiling_ghz"] = min(ceilings) / 1e6
    uncore = _int(root / UNCORE / "package_00_die_00" / "max_freq_khz")
    if uncore is not None:
        out["uncore_ghz"] = uncore / 1e6
    return out


def apply_controls(plant: Plant, controls: dict[str, Any]) -> None:
    """Set the plant's controls from a `read_controls` result."""
    for key in ("pl1_w", "ceiling_ghz", "no_turbo", "epb", "threads", "load", "ambient_c",
                "uncore_ghz"):
        if key in controls:
            setattr(plant.controls, key, controls[key])

