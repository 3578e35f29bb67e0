"""Policies on a plant, the figures of a run, the best fixed ceiling (the oracle) and the ensemble.

Policies: ``stock`` (nothing), ``ceiling:MHZ`` (a fixed frequency ceiling from the start),
``pl1:W`` (a fixed PL1 cap from the start),
``ladder`` (the previous rung controller, `dsr1d.sim.ladder.Controller`) and ``dsr1d``
(`dsr1d.core.efficiency.EfficiencyController`). Each sees only what software on the machine can
see (`Plant.observed`) and acts through the plant's controls.
"""

from __future__ import annotations

import statistics
from typing import Any

from dsr1d.core.efficiency import Action, EfficiencyConfig, EfficiencyController, Observation
from dsr1d.sim.ladder import Controller, Sample
from dsr1d.sim.plant import Plant
from dsr1d.sim.scenarios import Scenario

POLICIES = ("stock", "dsr1d", "ladder", "ceiling:MHZ", "pl1:W")
WARMUP_S = 60.0
ORACLE_STEP_MHZ = 200.0


class Policy:
    """Does nothing: the machine as it ships."""

    name = "stock"
    state = "n/a"

    def start(self, plant: Plant) -> None:
        """Called once before the first step."""

    def step(self, plant: Plant) -> list[Action]:
        """Called after each step: look at ``plant.observed()``, set ``plant.controls``."""
        return []


class Ceiling(Policy):
    """A fixed frequency ceiling from the start, or from ``from_s`` seconds."""

    def __init__(self, mhz: float, from_s: float = 0.0) -> None:
        self.mhz, self.from_s = mhz, from_s
        self.name = f"ceiling:{mhz:.0f}" + (f"@{from_s:.0f}s" if from_s > 0 else "")

    def start(self, plant: Plant) -> None:
        if self.from_s <= 0:
            plant.controls.ceiling_ghz = self.mhz / 1000.0

    def step(self, plant: Plant) -> list[Action]:
        if 0 < self.from_s <= plant.time_s:
            plant.controls.ceiling_ghz = self.mhz / 1000.0
        return []


class PowerCap(Policy):
    """A fixed PL1 cap from the start (the oracle's knob where there is no frequency ceiling)."""

    def __init__(self, watts: float) -> None:
        self.watts = watts
        self.name = f"pl1:{watts:.0f}"

    def start(self, plant: Plant) -> None:
        plant.controls.pl1_w = self.watts


class ActionMapper:
    """Applies controller `Action`s to a plant as overlays: a release restores the value the
    knob had before its rung was applied (a re-apply of an active rung only updates it)."""

    def __init__(self, plant: Plant) -> None:
        self.plant = plant
        self.saved: dict[str, dict[str, Any]] = {}

    def __call__(self, action: Action) -> None:
        c = self.plant.controls
        knobs = {"rapl_pl1": ("pl1_w",), "no_turbo": ("no_turbo",), "epb_balance": ("epb",),
                 "engine_threads": ("threads",)}[action.rung]
        if action.kind == "apply":
            if action.rung not in self.saved:
                self.saved[action.rung] = {k: getattr(c, k) for k in knobs}
            base = self.saved[action.rung]
            if action.rung == "rapl_pl1":
                c.pl1_w = float(action.params["pl1_w"])
            elif action.rung == "no_turbo":
                c.no_turbo = bool(action.params.get("no_turbo", True))
            elif action.rung == "epb_balance":
                c.epb = int(action.params["epb"])
            elif action.rung == "engine_threads":
                threads = base["threads"] if base["threads"] is not None else self.plant.threads()
                c.threads = max(1, threads + int(action.params["threads_delta"]))
        elif action.kind == "release":
            for k, v in self.saved.pop(action.rung, {}).items():
                setattr(c, k, v)


def ladder_sample(plant: Plant) -> Sample:
    """What the rung ladder sees of the plant's last step."""
    o = plant.observed()
    return Sample(time_s=o["time_s"], pkg_temp_c=o["pkg_temp_c"], busy_mhz=o["busy_mhz"],
                  pkg_power_w=o["pkg_power_w"], throttle_count=o["throttle_count"],
                  tokens_per_s=o["tokens_per_s"])


class Ladder(Policy):
    """The previous rung controller (PL1 cap, turbo off, EPB, threads), for comparison."""

    name = "ladder"

    def __init__(self) -> None:
        self.controller = Controller()
        self.mapper: ActionMapper | None = None

    def step(self, plant: Plant) -> list[Action]:
        if self.mapper is None:
            self.mapper = ActionMapper(plant)
        actions = self.controller.step(ladder_sample(plant))
        for a in actions:
            self.mapper(a)
        self.state = self.controller.state
        return actions


class Dsr1d(Policy):
    """The tokens-per-joule controller."""

    name = "dsr1d"

    def __init__(self, config: EfficiencyConfig | None = None) -> None:
        self.controller = EfficiencyController(config)

    def step(self, plant: Plant) -> list[Action]:
        actions = self.controller.step(Observation(**plant.observed()))
        c = plant.controls
        for a in actions:
            if a.rung == "freq_ceiling":
                c.ceiling_ghz = a.params["mhz"] / 1000.0 if a.kind == "apply" else None
            elif a.rung == "rapl_pl1":
                c.pl1_w = float(a.params["pl1_w"]) if a.kind == "apply" else None
            elif a.rung == "uncore_ceiling":
                c.uncore_ghz = a.params["mhz"] / 1000.0 if a.kind == "apply" else None
        self.state = self.controller.state
        return actions


def policy(spec: str, config: EfficiencyConfig | None = None) -> Policy:
    """A policy from its name (``stock``, ``dsr1d``, ``ladder``, ``ceiling:MHZ``, ``pl1:W``)."""
    if spec == "stock":
        return Policy()
    if spec == "dsr1d":
        return Dsr1d(config)
    if spec == "ladder":
        return Ladder()
    if spec.startswith("ceiling:"):
        return Ceiling(_value(spec, 100, 10000, "the ceiling is in MHz"))
    if spec.startswith("pl1:"):
        return PowerCap(_value(spec, 1, 5000, "the PL1 cap is in watts"))
    raise ValueError(f"unknown policy {spec!r}; known: {', '.join(POLICIES)}")


def _value(spec: str, lo: float, hi: float, what: str) -> float:
    try:
        value = float(spec.split(":", 1)[1])
    except ValueError:
        value = lo - 1
    if not lo <= value <= hi:
        raise ValueError(f"{spec!r}: {what}, {lo:g}..{hi:g}")
    return value


def run(scenario: Scenario, pol: Policy, seconds: float = 600.0,
        dt: float = 1.0) -> list[dict[str, Any]]:
    """``seconds`` of simulated time; one row per ``dt``: the plant's state, the policy's
    ``state`` and the ``actions`` it took after that step."""
    plant = Plant(scenario.params)
    pol.start(plant)
    rows = []
    for _ in range(int(round(seconds / dt))):
        if scenario.schedule is not None:
            scenario.schedule(plant.time_s, plant)
        row = plant.step(dt)
        row["actions"] = pol.step(plant)
        row["state"] = pol.state
        row["active"] = list(getattr(getattr(pol, "controller", None), "active", []))
        rows.append(row)
    return rows


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``th percentile (nearest rank) of ``values``; None when there are none."""
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q / 100 * (len(values) - 1)))))]


def figures(rows: list[dict[str, Any]], warmup_s: float = WARMUP_S) -> dict[str, Any]:
    """The figures of one run, everything after ``warmup_s`` (the first minute) unless said:
    ``tokens_per_s`` (tokens / time), ``p5_tokens_per_s`` (5th percentile of the decoding
    samples), ``joules_per_token``, ``throttle_events_per_min``, ``throttle_duty`` (fraction of
    time the hardware limited the clock for heat), ``actions``, ``first_action_s`` and
    ``first_thermal_event_s`` (whole run), ``peak_temp_c``."""
    warm = next((r for r in rows if r["time_s"] >= warmup_s), rows[0])
    end = rows[-1]
    span = max(1e-9, end["time_s"] - warm["time_s"])
    tokens = end["tokens"] - warm["tokens"]
    energy = end["energy_j"] - warm["energy_j"]
    after = [r for r in rows if r["time_s"] > warm["time_s"]]
    decoding = [r["tokens_per_s"] for r in after if r["load"] > 0]
    first_event = next((r["time_s"] for r in rows if r["events"] > 0), None)
    first_action = next((r["time_s"] for r in rows if r["actions"]), None)
    return {
        "tokens_per_s": tokens / span,
        "p5_tokens_per_s": percentile(decoding, 5),
        "joules_per_token": energy / tokens if tokens > 0 else None,
        "throttle_events_per_min": (end["events"] - warm["events"]) / span * 60,
        "throttle_duty": (end["hot_s"] - warm["hot_s"]) / span,
        "actions": sum(len(r["actions"]) for r in rows),
        "first_action_s": first_action,
        "first_thermal_event_s": first_event,
        "peak_temp_c": max(r["pkg_temp_c"] for r in rows),
        "mean_mhz": sum(r["freq_mhz"] for r in after) / max(1, len(after)),
    }


def ceiling_runs(scenario: Scenario, seconds: float = 600.0,
                 step_mhz: float = ORACLE_STEP_MHZ) -> dict[str, dict[str, Any]]:
    """The figures of ``stock`` and of every fixed ceiling from the floor up, ``step_mhz`` apart;
    on a plant without a frequency ceiling, every fixed PL1 cap from the firmware's down, 5 %
    of it apart (to a third of it)."""
    p = scenario.params
    runs = {"stock": figures(run(scenario, Policy(), seconds))}
    if not p.cpufreq_ceiling:
        if p.pl1_writable:
            for share in range(95, 30, -5):
                cap = PowerCap(p.pl1_w * share / 100)
                runs[cap.name] = figures(run(scenario, cap, seconds))
        return runs
    mhz = p.f_min_ghz * 1000
    while mhz < p.f_turbo_ghz * 1000 - 1:
        runs[f"ceiling:{mhz:.0f}"] = figures(run(scenario, Ceiling(mhz), seconds))
        mhz += step_mhz
    return runs


def best_fixed(runs: dict[str, dict[str, Any]],
               delta_percent: float = 2.0) -> tuple[str, dict[str, Any]]:
    """Of `ceiling_runs`, the least J/token among those whose tokens/s is within
    ``delta_percent`` of the best of them."""
    best = max(f["tokens_per_s"] for f in runs.values())
    ok = {k: f for k, f in runs.items() if f["tokens_per_s"] >= (1 - delta_percent / 100) * best
          and f["joules_per_token"] is not None}
    if not ok:
        return "stock", runs["stock"]
    name = min(ok, key=lambda k: ok[k]["joules_per_token"])
    return name, ok[name]


def oracle(scenario: Scenario, seconds: float = 600.0, delta_percent: float = 2.0,
           step_mhz: float = ORACLE_STEP_MHZ) -> tuple[str, dict[str, Any]]:
    """The best fixed ceiling (or PL1 cap, where there is no ceiling): the least J/token among
    them (every ``step_mhz`` and none) whose tokens/s is within ``delta_percent`` of the best."""
    return best_fixed(ceiling_runs(scenario, seconds, step_mhz), delta_percent)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def compare(scenario: Scenario, seconds: float = 600.0,
            config: EfficiencyConfig | None = None,
            runs: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """stock, dsr1d and the oracle on one plant, with dsr1d's ratios to both; ``runs``: this
    plant's `ceiling_runs` over ``seconds`` where already made (stock and the oracle from them)."""
    cfg = config or EfficiencyConfig()
    runs = runs if runs is not None else ceiling_runs(scenario, seconds)
    stock = runs["stock"]
    ours = figures(run(scenario, Dsr1d(cfg), seconds))
    best_name, best = best_fixed(runs, cfg.delta_percent)
    would_throttle = stock["first_thermal_event_s"] is not None
    lead = None
    if would_throttle:
        first, event = ours["first_action_s"], ours["first_thermal_event_s"]
        lead = first is not None and (event is None or first < event)
    return {
        "plant": scenario.name, "description": scenario.description,
        "stock": stock, "dsr1d": ours, "oracle": best, "oracle_policy": best_name,
        "tokens_ratio": _ratio(ours["tokens_per_s"], stock["tokens_per_s"]),
        "energy_ratio": _ratio(ours["joules_per_token"], stock["joules_per_token"]),
        "tokens_vs_oracle": _ratio(ours["tokens_per_s"], best["tokens_per_s"]),
        "energy_vs_oracle": _ratio(ours["joules_per_token"], best["joules_per_token"]),
        "would_throttle": would_throttle, "acted_before_throttling": lead,
    }


def summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians and worst cases over `compare` results (dsr1d ÷ stock, dsr1d ÷ oracle)."""
    def col(key: str) -> list[float]:
        return [r[key] for r in results if r[key] is not None]
    tok, en = col("tokens_ratio"), col("energy_ratio")
    tok_o, en_o = col("tokens_vs_oracle"), col("energy_vs_oracle")
    throttling = [r for r in results if r["would_throttle"]]
    return {
        "plants": len(results),
        "median_tokens_ratio": statistics.median(tok) if tok else None,
        "worst_tokens_ratio": min(tok) if tok else None,
        "median_energy_ratio": statistics.median(en) if en else None,
        "worst_energy_ratio": max(en) if en else None,
        "median_tokens_vs_oracle": statistics.median(tok_o) if tok_o else None,
        "worst_tokens_vs_oracle": min(tok_o) if tok_o else None,
        "median_energy_vs_oracle": statistics.median(en_o) if en_o else None,
        "worst_energy_vs_oracle": max(en_o) if en_o else None,
        "plants_that_throttle": len(throttling),
        "acted_before_throttling": sum(1 for r in throttling if r["acted_before_throttling"]),
    }
