"""Named plants (`PLANTS`) and a seeded ensemble of them (`ensemble`), each with its schedule.

A `Scenario` is a `PlantParams`, a schedule (load, inlet temperature, CPUs going offline and
online, over simulated time) and what the right answer is known to be where it is known
(``quiet``: a controller must take no action at all).

Named plants (the XEON calibration of `dsr1d.sim.plant` unless said otherwise):

* ``step-tcc``: the default hardware shape, on-die TCC stepping 100 MHz, a soft decode curve
  (knee 1.6 GHz, overlap p = 2).
* ``floor-prochot``: an external PROCHOT# dropping the clock to 0.8 GHz, the hard roofline (knee
  2.6 GHz): the published collapse (3.8 GHz, then ~2.4 GHz on average after ~120 s).
* ``memory-knee``: a strong cooler (never hot), a sharp knee at 1.2 GHz: energy only.
* ``amd``: an EPYC-like shape: Tctl limit 95 °C stepping, PPT 280 W owned by the SMU (no PL1
  writes), no throttle counters, boost 3.7 / base 2.4 / min 1.5 GHz.
* ``pl2-expiry``: PL2 300 W for tau 28 s, then PL1 200 W (not thermal), a cool package, decode
  compute-bound at those clocks (knee 3.5 GHz): nothing to gain, so ``quiet``.
* ``inlet-step``: ``step-tcc`` with the inlet 8 °C warmer from 240 s.
* ``bursty``: ``step-tcc`` decoding in bursts of 5–25 s with 5–40 s pauses (seeded): never steady,
  never hot, ``quiet``.
* ``idle``: no decode at all, ``quiet``.
* ``vm``: no temperature, power or counters: ``quiet``.
* ``cpu-online``: ``memory-knee`` where a CPU goes offline at 100 s and comes back at 130 s with
  5,000 boot-time throttle events and 60 s of throttle time in its counters.
* ``pl1-ignored``: ``step-tcc`` with the BIOS ignoring PL1 writes.

Plants of shapes the controller was found to fail on (issue #28):

* ``pl1-only``: ``step-tcc`` without cpufreq (no ``scaling_max_freq``, ``cpuinfo_max_freq`` or
  ``intel_pstate``: the cpufreq driver is not loaded, as on some hosts and tuned-down images), PL1
  writable: a PL1 cap is the only knob. Its cooler is the XEON's, the published poor one (TjMax in
  about two minutes at turbo), so the thermal limit matters.
* ``pl1-only-cool``: ``memory-knee`` without cpufreq and a cooler twice as strong (heat sink to
  inlet 0.08 K/W: about 83 °C at turbo, 20 °C under the limit): energy is the only reason to cap.
* ``burst-sustain``: PL2 (420 W, above what turbo draws) while the power averaged over tau 28 s
  stays under PL1 210 W, which runs out after about 27 s; then PL1 holds about 2.8 GHz. Knee
  2.0 GHz (p = 2) makes that about 8 % fewer tokens/s; cool (0.12 K/W), never thermal. The best
  window a decode ever shows is the burst, and it never comes back.
* ``drift``: ``step-tcc`` decoding a small model whose KV cache grows: R1's reasoning runs to tens
  of thousands of tokens, and each one adds its keys and values to what every later token reads.
  R1-Distill-Qwen-1.5B in Q4_K_M reads about 1.1 GB of weights a token and caches 28 KiB of f16
  keys and values per token of context (28 layers x 2 KV heads x 128 x 2 x 2 bytes): at 100 tok/s
  that is 0.26 GB, about 23 % of the weights, every 90 s. So every 90 s of decode the bytes per
  token grow by a fraction of the weights' drawn from 0-20 % (seeded by ``--seed``), and the
  engine reports the figure (``gb_per_token`` in `Plant.observed`). Attention's compute grows
  with the bytes it reads, so the knee stays where it is: tokens/s falls as 1 / bytes at any clock.
* ``amd-90``, ``amd-95``, ``amd-100``: ``amd`` with a Tctl limit of 90, 95 or 100 °C that software
  cannot read (no ``limit_temp_c``, no ``temp1_crit`` or trip point), no throttle counters, no PL1
  writes, and AMD's boost instead of Intel's TCC bins: the clock cap falls linearly from boost to
  the minimum over the last 5 °C under the limit (``throttle = "slope"``), so the package settles
  2-3 °C under it on a continuous curve. AMD documents that Precision Boost lowers the clock as
  temperature rises, not its curve; the 5 °C is this model's.
* ``turbo-above-allcore``: ``step-tcc`` whose ``cpuinfo_max_freq`` (3.8 GHz, the turbo with one
  core busy) is well above what all 32 cores get (3.0 GHz, the turbo ratio limit for 32 active
  cores, as on server Xeons). It reaches the limit after about 7 minutes.
* ``never-hot``: ``step-tcc`` with a big heat sink (8000 J/K, about 9 kg of aluminium or a liquid
  loop's 2 L; 0.13 K/W to the inlet): it settles at 101.7 °C, 3.3 °C under the limit, with a time
  constant near 17 minutes (c_sink x r_sink_amb), so at 30 minutes it is at 93 °C and still
  rising 0.45 °C a minute, while a line through minutes 2 to 4 (1.8 °C a minute) crosses the
  limit before 30 minutes.
* ``slow-sink``: ``step-tcc`` with a heat sink nearly three times the XEON's (1800 J/K, time
  constant 7 minutes with 0.24 K/W to the inlet; the ensemble draws sinks of 220-1950 J/K): stock
  runs 3.8 GHz for five minutes, first throttles at 322 s and sustains 2.8 GHz from minute 10 on
  (0.94x the tokens/s of its first five minutes). An energy cut keeps such a package cool, so
  the decode never shows the heat that stock would meet.
* ``inlet-spike``: ``step-tcc`` with the inlet 10 °C warmer from 300 s to 480 s (a CRAC unit
  cycling, a neighbour's exhaust), then back.

Ensemble ranges (uniform unless said otherwise; the ranges of MITIGATION-NOTES.md):
throttle model TCC (80 %) or floor (20 %); TCC step 0.1 or 0.2 GHz, hysteresis 0.5–2 °C; knee
1–3 GHz and the decode elasticity at turbo 0.05–0.5 (``ensemble(elasticity=…)`` narrows it
for what-if studies; ``overlap_p`` solved from both, 1..49, so elasticity is capped by what a
knee allows); heat capacities ×0.3–3 (log-uniform), heat-sink
resistance ×0.7–1.4; V–f slope 0.10–0.20 V/GHz; leakage 0.5–2 %/°C; inlet 20–35 °C; a third of
the plants get an inlet step of +3–10 °C at 150–400 s.

Families (`families`): for each shape of issue #28, ``n`` plants drawn around its named plant,
reproducible from ``seed`` (each family from its own stream, so one family's draws do not move
another's, and the first ``n`` plants stay the same when ``n`` grows). The decode curve is the
least known parameter of all (no published frequency sweep: `dsr1d.sim.plant`), so every family
draws a knee, uniform 1–3 GHz unless said, and the ensemble's decode elasticity 0.05–0.5 at the
clock every core gets at turbo (``overlap_p`` solved from both); the rest is the named plant's:

* ``pl1-only``: no cpufreq; heat-sink resistance 0.16–0.32 K/W (the XEON's 0.24 ×0.7–1.3, as the
  ensemble spreads it: unthrottled at turbo every one would settle at 114–170 °C, so heat is
  always a reason to cap PL1), knee 1.2–3 GHz (``pl1-only-cool``'s knee to the hard end).
* ``burst-then-sustain``: PL1 150–260 W under PL2 420 W (tau 28 s; turbo draws about 320 W):
  after the burst PL1 holds from about 2.1 GHz to about 3.2 GHz; the cool 0.12 K/W of
  ``burst-sustain`` (60–82 °C): never thermal.
* ``drift``: the ``drift`` plant with its own growth seed, knee 1–3 GHz and a heat-sink
  resistance of 0.16–0.32 K/W; run for 30 minutes (`FAMILY_SECONDS`), because the drift is the
  point: at one step per 90 s, ten minutes show only six.
* ``amd``: ``amd-90``, ``amd-95`` or ``amd-100`` (a third each), knee 1–3 GHz.
* ``turbo-above-allcore``: all-core turbo 2.6–3.2 GHz under the 3.8 GHz that
  ``cpuinfo_max_freq`` shows (server parts with a 3.8 GHz one-core turbo list their all-core
  turbo around 3 GHz); elasticity taken at the all-core clock.
* ``never-hot``: big heat sinks, 4000–12000 J/K (log-uniform) at 0.08–0.13 K/W to the inlet:
  they settle at 83–102 °C, under the 105 °C limit, with time constants of 5–26 minutes, so a
  line through the first minutes may cross the limit while the plant never does.
* ``inlet-spike``: ``step-tcc`` with the inlet +5–12 °C from 200–500 s for 120–240 s (a CRAC
  unit cycling, a neighbour's exhaust).

Sensors are exact unless ``real_sensors`` (`with_real_sensors`): each sample of the engine's
tokens/s then carries 0–3 % noise (one interval's rate: sampling, prompt lengths), package power
0–2 %, and the temperature reads in whole degrees (coretemp, x86_pkg_temp) or 0.125 °C (AMD's
k10temp); drawn from their own seed, so the plants' physics stay the same.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, replace
from typing import Callable

from dsr1d.sim.plant import XEON, Plant, PlantParams

Schedule = Callable[[float, Plant], None]


@dataclass(frozen=True)
class Scenario:
    """A plant, its schedule and what is known about the right answer."""

    name: str
    params: PlantParams
    schedule: Schedule | None = None
    quiet: bool = False           # the right answer is to take no action at all
    description: str = ""


def _inlet_step(at_s: float, delta_c: float) -> Schedule:
    def schedule(t: float, plant: Plant) -> None:
        if t >= at_s:
            plant.controls.ambient_c = plant.params.ambient_c + delta_c
    return schedule


def _bursts(seed: int, on: tuple[float, float], off: tuple[float, float]) -> Schedule:
    rng = random.Random(seed)
    edges: list[float] = []
    t = 0.0
    while t < 10 * 3600:
        t += rng.uniform(*on)
        edges.append(t)
        t += rng.uniform(*off)
        edges.append(t)

    def schedule(t: float, plant: Plant) -> None:
        n = sum(1 for e in edges if e <= t)
        plant.controls.load = 1.0 if n % 2 == 0 else 0.0
    return schedule


def _inlet_spike(at_s: float, seconds: float, delta_c: float) -> Schedule:
    def schedule(t: float, plant: Plant) -> None:
        t += 1e-6     # the clock sums 0.1 s substeps: 300 s may read 299.99999
        hot = at_s <= t < at_s + seconds
        plant.controls.ambient_c = plant.params.ambient_c + delta_c if hot else None
    return schedule


def _idle(t: float, plant: Plant) -> None:
    plant.controls.load = 0.0


def _cpu_online(t: float, plant: Plant) -> None:
    if 100 <= t < 130:
        plant.online = plant.params.cores - 1
    elif t >= 130 and plant.online != plant.params.cores:
        plant.online = plant.params.cores
        plant.throttle_count += 5000
        plant.throttle_s += 60.0


STEP_TCC = replace(XEON, name="step-tcc", knee_ghz=1.6, overlap_p=2.0)
MEMORY_KNEE = replace(XEON, name="memory-knee", knee_ghz=1.2, overlap_p=4.0,
                      r_sink_amb_k_per_w=0.12)
FLOOR_PROCHOT = replace(XEON, name="floor-prochot", throttle="floor", knee_ghz=2.6,
                        overlap_p=50.0)
AMD = replace(XEON, name="amd", vendor="amd", tj_max_c=95.0, pl1_w=280.0, pl2_w=280.0,
              pl1_writable=False, f_turbo_ghz=3.7, f_base_ghz=2.4, f_min_ghz=1.5,
              knee_ghz=1.6, overlap_p=2.0)
PL1_ONLY = replace(STEP_TCC, name="pl1-only", cpufreq_ceiling=False)
PL1_ONLY_COOL = replace(MEMORY_KNEE, name="pl1-only-cool", cpufreq_ceiling=False,
                        r_sink_amb_k_per_w=0.08)
BURST_SUSTAIN = replace(STEP_TCC, name="burst-sustain", pl1_w=210.0, pl2_w=420.0, tau_s=28.0,
                        knee_ghz=2.0, r_sink_amb_k_per_w=0.12)
TURBO_ABOVE_ALLCORE = replace(STEP_TCC, name="turbo-above-allcore", f_allcore_ghz=3.0)
NEVER_HOT = replace(STEP_TCC, name="never-hot", c_sink_j_per_k=8000.0, r_sink_amb_k_per_w=0.13)
SLOW_SINK = replace(STEP_TCC, name="slow-sink", c_sink_j_per_k=1800.0)


def drift(seed: int = 0) -> PlantParams:
    """``step-tcc`` decoding a small model whose KV cache grows (module docstring)."""
    return replace(STEP_TCC, name="drift", gb_per_token=1.1, gb_growth_period_s=90.0,
                   gb_growth_max=0.2, gb_growth_seed=seed)


def amd_slope(limit_c: float) -> PlantParams:
    """``amd`` with an unreadable Tctl limit at ``limit_c`` and boost falling smoothly to it."""
    return replace(AMD, name=f"amd-{limit_c:.0f}", tj_max_c=limit_c, throttle="slope",
                   slope_width_c=5.0, limit_readable=False)


def plants(seed: int = 0) -> dict[str, Scenario]:
    """The named plants (the bursty schedule is drawn from ``seed``)."""
    return {s.name: s for s in (
        Scenario("step-tcc", STEP_TCC, description="on-die TCC steps, soft decode curve"),
        Scenario("floor-prochot", FLOOR_PROCHOT,
                 description="external PROCHOT# to the floor, hard roofline (published collapse)"),
        Scenario("memory-knee", MEMORY_KNEE, description="never hot, sharp knee at 1.2 GHz"),
        Scenario("amd", AMD, description="Tctl 95 °C, SMU-owned PPT, no counters"),
        Scenario("pl2-expiry", replace(XEON, name="pl2-expiry", pl1_w=200.0, pl2_w=300.0,
                                       r_sink_amb_k_per_w=0.12, knee_ghz=3.5, overlap_p=2.0),
                 quiet=True, description="PL2 runs out into PL1 200 W; compute-bound; cool"),
        Scenario("inlet-step", replace(STEP_TCC, name="inlet-step"), _inlet_step(240.0, 8.0),
                 description="step-tcc, inlet +8 °C at 240 s"),
        Scenario("bursty", replace(STEP_TCC, name="bursty"), _bursts(seed, (5, 25), (5, 40)),
                 quiet=True, description="decode bursts 5-25 s, pauses 5-40 s"),
        Scenario("idle", replace(STEP_TCC, name="idle"), _idle, quiet=True,
                 description="no decode"),
        Scenario("vm", replace(STEP_TCC, name="vm", sensors=False), quiet=True,
                 description="no temperature, power or counters"),
        Scenario("cpu-online", replace(MEMORY_KNEE, name="cpu-online"), _cpu_online,
                 description="a CPU back online with boot-time throttle counts"),
        Scenario("pl1-ignored", replace(STEP_TCC, name="pl1-ignored", pl1_writable=False),
                 description="step-tcc, the BIOS ignores PL1 writes"),
        *_issue_28_plants(seed),
    )}


def _issue_28_plants(seed: int) -> tuple[Scenario, ...]:
    """The shapes the controller was found to fail on (module docstring)."""
    return (
        Scenario("pl1-only", PL1_ONLY, description="no cpufreq: only PL1 acts; hot"),
        Scenario("pl1-only-cool", PL1_ONLY_COOL,
                 description="no cpufreq, never hot: PL1 for energy only"),
        Scenario("burst-sustain", BURST_SUSTAIN,
                 description="PL2 burst ~27 s, then PL1 210 W: ~8 % fewer tok/s for good"),
        Scenario("drift", drift(seed),
                 description="KV cache grows: bytes per token +0-20 % every 90 s"),
        *(Scenario(f"amd-{t}", amd_slope(t),
                   description=f"Tctl {t} °C unreadable, boost falls over the last 5 °C")
          for t in (90, 95, 100)),
        Scenario("turbo-above-allcore", TURBO_ABOVE_ALLCORE,
                 description="cpuinfo_max_freq 3.8 GHz, all-core turbo 3.0 GHz"),
        Scenario("never-hot", NEVER_HOT,
                 description="big heat sink: rises for 30 min, settles 3.3 °C under the limit"),
        Scenario("slow-sink", SLOW_SINK,
                 description="heat sink 1800 J/K: stock throttles only after 5 minutes"),
        Scenario("inlet-spike", replace(STEP_TCC, name="inlet-spike"),
                 _inlet_spike(300.0, 180.0, 10.0),
                 description="step-tcc, inlet +10 °C from 300 s to 480 s"),
    )


def _overlap_for(elasticity: float, knee_ghz: float, f_ghz: float) -> float:
    """The ``overlap_p`` giving ``elasticity`` at ``f`` for this knee (1..49)."""
    r = knee_ghz / f_ghz
    target = elasticity / (1 - elasticity)        # = r ** p
    if r >= 1 or target <= 0:
        return 1.0
    return max(1.0, min(49.0, math.log(target) / math.log(r)))


ELASTICITY = (0.05, 0.5)


def with_real_sensors(scenario: Scenario, seed: int = 0) -> Scenario:
    """``scenario`` seen through sensors like a real machine's (module docstring)."""
    rng = random.Random(f"{seed}-{scenario.name}-sensors")
    p = scenario.params
    return replace(scenario, params=replace(
        p, tokens_noise=rng.uniform(0.0, 0.03), power_noise=rng.uniform(0.0, 0.02),
        temp_step_c=1.0 if p.vendor == "intel" else 0.125, noise_seed=rng.randrange(1 << 30)))


def ensemble(n: int, seed: int = 0, elasticity: tuple[float, float] = ELASTICITY,
             real_sensors: bool = False) -> list[Scenario]:
    """``n`` plants drawn from the module docstring's ranges, reproducible from ``seed``;
    ``elasticity`` narrows the range of decode elasticity at turbo (what-if studies),
    ``real_sensors`` adds the sensors' noise and resolution."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        knee = rng.uniform(1.0, 3.0)
        elast = rng.uniform(*elasticity)
        log3 = math.log(3.0)
        params = replace(
            XEON, name=f"ensemble-{seed}-{i}",
            throttle="tcc" if rng.random() < 0.8 else "floor",
            tcc_step_ghz=rng.choice((0.1, 0.2)), tcc_hyst_c=rng.uniform(0.5, 2.0),
            knee_ghz=knee, overlap_p=_overlap_for(elast, knee, XEON.f_turbo_ghz),
            c_sink_j_per_k=XEON.c_sink_j_per_k * math.exp(rng.uniform(-log3, log3)),
            c_die_j_per_k=XEON.c_die_j_per_k * math.exp(rng.uniform(-log3, log3)),
            r_sink_amb_k_per_w=XEON.r_sink_amb_k_per_w * rng.uniform(0.7, 1.4),
            kv_per_ghz=rng.uniform(0.10, 0.20), leak_per_c=rng.uniform(0.005, 0.02),
            ambient_c=rng.uniform(20.0, 35.0))
        schedule = None
        if rng.random() < 1 / 3:
            schedule = _inlet_step(rng.uniform(150.0, 400.0), rng.uniform(3.0, 10.0))
        scenario = Scenario(params.name, params, schedule,
                            description=f"knee {knee:.2f} GHz, p {params.overlap_p:.1f}, "
                                        f"{params.throttle}")
        out.append(with_real_sensors(scenario, seed) if real_sensors else scenario)
    return out


FAMILIES = ("pl1-only", "burst-then-sustain", "drift", "amd", "turbo-above-allcore", "never-hot",
            "inlet-spike")
# simulated seconds a family's plants run where ten minutes would not show their shape
FAMILY_SECONDS = {"drift": 1800.0}


def _decode_curve(rng: random.Random, p: PlantParams, knee: tuple[float, float] = (1.0, 3.0)
                  ) -> PlantParams:
    """``p`` with a knee drawn from ``knee`` and the ensemble's elasticity at the all-core clock."""
    k, elasticity = rng.uniform(*knee), rng.uniform(*ELASTICITY)
    f = p.f_allcore_ghz or p.f_turbo_ghz
    return replace(p, knee_ghz=k, overlap_p=_overlap_for(elasticity, k, f))


def _family_plant(family: str, rng: random.Random, name: str) -> Scenario:
    """One plant of ``family`` drawn from ``rng`` (module docstring)."""
    schedule = None
    if family == "pl1-only":
        p = replace(_decode_curve(rng, PL1_ONLY, (1.2, 3.0)),
                    r_sink_amb_k_per_w=rng.uniform(0.16, 0.32))
        what = f"r_sink {p.r_sink_amb_k_per_w:.2f} K/W"
    elif family == "burst-then-sustain":
        p = replace(_decode_curve(rng, BURST_SUSTAIN), pl1_w=rng.uniform(150.0, 260.0),
                    pl2_w=420.0)
        what = f"PL1 {p.pl1_w:.0f} W"
    elif family == "drift":
        p = replace(_decode_curve(rng, drift(rng.randrange(1 << 30))),
                    r_sink_amb_k_per_w=rng.uniform(0.16, 0.32))
        what = f"r_sink {p.r_sink_amb_k_per_w:.2f} K/W, growth seed {p.gb_growth_seed}"
    elif family == "amd":
        p = _decode_curve(rng, amd_slope(rng.choice((90, 95, 100))))
        what = f"Tctl {p.tj_max_c:.0f} °C"
    elif family == "turbo-above-allcore":
        p = _decode_curve(rng, replace(TURBO_ABOVE_ALLCORE, f_allcore_ghz=rng.uniform(2.6, 3.2)))
        what = f"all-core {p.f_allcore_ghz:.2f} GHz"
    elif family == "never-hot":
        log_c = rng.uniform(math.log(4000.0), math.log(12000.0))
        p = replace(_decode_curve(rng, NEVER_HOT), c_sink_j_per_k=math.exp(log_c),
                    r_sink_amb_k_per_w=rng.uniform(0.08, 0.13))
        what = f"c_sink {p.c_sink_j_per_k:.0f} J/K, r_sink {p.r_sink_amb_k_per_w:.3f} K/W"
    elif family == "inlet-spike":
        p = _decode_curve(rng, STEP_TCC)
        at, seconds, delta = rng.uniform(200.0, 500.0), rng.uniform(120.0, 240.0), \
            rng.uniform(5.0, 12.0)
        schedule = _inlet_spike(at, seconds, delta)
        what = f"inlet +{delta:.1f} °C at {at:.0f} s for {seconds:.0f} s"
    else:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    p = replace(p, name=name)
    return Scenario(name, p, schedule, description=f"{what}; knee {p.knee_ghz:.2f} GHz, "
                                                   f"p {p.overlap_p:.1f}")


def families(n: int, seed: int = 0) -> dict[str, list[Scenario]]:
    """``n`` plants of each family of `FAMILIES`, drawn around the named plants of issue #28
    (module docstring), reproducible from ``seed``."""
    out = {}
    for family in FAMILIES:
        rng = random.Random(f"{seed}-{family}")
        out[family] = [_family_plant(family, rng, f"{family}-{seed}-{i}") for i in range(n)]
    return out
