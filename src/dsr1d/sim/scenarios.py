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

Ensemble ranges (uniform unless said otherwise; the ranges of MITIGATION-NOTES.md):
throttle model TCC (80 %) or floor (20 %); TCC step 0.1 or 0.2 GHz, hysteresis 0.5–2 °C; knee
1–3 GHz and the decode elasticity at turbo 0.05–0.5 (``ensemble(elasticity=…)`` narrows it
for what-if studies; ``overlap_p`` solved from both, 1..49, so elasticity is capped by what a
knee allows); heat capacities ×0.3–3 (log-uniform), heat-sink
resistance ×0.7–1.4; V–f slope 0.10–0.20 V/GHz; leakage 0.5–2 %/°C; inlet 20–35 °C; a third of
the plants get an inlet step of +3–10 °C at 150–400 s.

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
    )}


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
