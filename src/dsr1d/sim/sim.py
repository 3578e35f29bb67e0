"""``dsr1d simulate``: plants, policies and the ensemble on the command line, and the run loop
that drives a `dsr1d.sim.ladder.Controller` (the rung ladder) directly.

The plant is `dsr1d.sim.plant`, the named plants and the ensemble `dsr1d.sim.scenarios`, the
policies, figures and the oracle `dsr1d.sim.run`. ``XEON_SUSTAINED`` is the ``floor-prochot``
plant: the published collapse (3.8 GHz, then about 2.4 GHz after roughly 120 s) that the ladder
was built against.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from dsr1d.core.efficiency import Action, EfficiencyConfig
from dsr1d.sim.ladder import Controller
from dsr1d.sim.plant import Plant, PlantParams, apply_controls, read_controls
from dsr1d.sim.run import (ActionMapper, compare, figures, ladder_sample, policy, run,
                           summary)
from dsr1d.sim.scenarios import FLOOR_PROCHOT, Scenario, ensemble, plants, with_real_sensors

XEON_SUSTAINED = FLOOR_PROCHOT


# -- plant + controller --------------------------------------------------------------------------

def simulate(params: PlantParams = XEON_SUSTAINED, seconds: float = 600.0,
             controller: Controller | None = None, dt: float = 1.0,
             schedule: Callable[[float, Plant], None] | None = None,
             plant: Plant | None = None) -> list[dict[str, Any]]:
    """Run plant and (optionally) controller for ``seconds`` of simulated time.

    Each row is the plant's observable state after one ``dt`` step plus the controller's view:
    ``state``, ``active`` (rungs, in order), ``actions`` (`Action`s taken on this sample).
    ``schedule(t, plant)`` runs before each step (change load or ambient, for scenarios).
    """
    plant = plant or Plant(params)
    mapper = ActionMapper(plant)
    rows: list[dict[str, Any]] = []
    for _ in range(int(round(seconds / dt))):
        if schedule is not None:
            schedule(plant.time_s, plant)
        row = plant.step(dt)
        actions: list[Action] = []
        if controller is not None:
            actions = controller.step(ladder_sample(plant))
            for action in actions:
                mapper(action)
            row["state"] = controller.state
            row["active"] = list(controller.active)
        else:
            row["state"] = "n/a"
            row["active"] = []
        row["actions"] = actions
        rows.append(row)
    return rows


CSV_FIELDS = ("time_s", "pkg_temp_c", "sink_temp_c", "limit_temp_c", "busy_mhz", "pkg_power_w",
              "throttle_count", "tokens_per_s", "gb_per_token", "energy_j", "pl1_w", "ceiling_mhz",
              "no_turbo", "epb", "threads", "state", "active", "actions")


def _csv_row(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: row.get(k) for k in CSV_FIELDS}
    for k in ("pkg_temp_c", "sink_temp_c", "limit_temp_c", "busy_mhz", "pkg_power_w",
              "tokens_per_s", "gb_per_token", "energy_j", "pl1_w", "ceiling_mhz"):
        out[k] = "" if row.get(k) is None else f"{row[k]:.3f}"
    out["active"] = " ".join(row.get("active", []))
    out["actions"] = " | ".join(f"{a.kind} {a.rung}: {a.reason}" for a in row.get("actions", []))
    return out


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsr1d simulate", description=(
        "Run the thermal plant simulator: one plant under one policy, the ensemble, or the "
        "plant behind a fake root for a real daemon."))
    ap.add_argument("--plant", default="step-tcc",
                    help="a named plant: " + ", ".join(plants()) + " (step-tcc)")
    ap.add_argument("--policy", default=None,
                    help="stock, dsr1d (the daemon's controller), ladder (the previous one), "
                         "ceiling:MHZ or pl1:W (a fixed cap; default: dsr1d)")
    ap.add_argument("--ensemble", type=int, metavar="N",
                    help="run stock, dsr1d and the oracle on N plants; print their ratios")
    ap.add_argument("--seed", type=int, default=0, help="ensemble, bursty-load and drift seed (0)")
    ap.add_argument("--sensors", choices=("exact", "real"), default="exact",
                    help="what software sees: exact readings, or a real machine's noise and "
                         "resolution (tokens/s 0-3 %%, power 0-2 %%, whole degrees) (exact)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--seconds", type=float, default=600.0, help="simulated seconds (600)")
    ap.add_argument("--dt", type=float, default=1.0, help="sample period in seconds (1)")
    ap.add_argument("--delta", type=float, default=None,
                    help="dsr1d: tokens/s tolerance in percent (2)")
    ap.add_argument("--mitigate", action=argparse.BooleanOptionalAction, default=None,
                    help="--no-mitigate is --policy stock")
    ap.add_argument("--csv", type=Path, help="write every sample to this CSV file")
    ap.add_argument("--fake-root", type=Path,
                    help="write the plant's state into this fake root each step and take its "
                         "controls (PL1, no_turbo, EPB, scaling_max_freq) from the files there")
    ap.add_argument("--realtime", action="store_true",
                    help="advance simulated time with the wall clock (with --fake-root)")
    return ap


def simulate_main(argv: list[str] | None = None) -> int:
    """``dsr1d simulate``: see ``--help``."""
    ap = _parser()
    args = ap.parse_args(argv)
    if not (0 < args.seconds < float("inf")) or not (0 < args.dt <= args.seconds):
        ap.error("--seconds must be positive and --dt between 0 and --seconds")
    if args.csv is not None and not args.csv.parent.is_dir():
        ap.error(f"--csv {args.csv}: no directory {args.csv.parent}")
    if args.realtime and args.fake_root is None:
        ap.error("--realtime needs --fake-root")
    if args.fake_root is not None and (args.mitigate or args.policy):
        ap.error("with --fake-root the daemon mitigates (through the files); drop --policy")
    if args.fake_root is not None and args.sensors == "real":
        ap.error("--sensors real is what the simulated policies see; behind --fake-root the "
                 "files are exact")
    if args.ensemble is not None and not 1 <= args.ensemble <= 10000:
        ap.error("--ensemble N: N from 1 to 10000")
    named = plants(args.seed)
    if args.plant is not None and args.plant not in named:
        ap.error(f"--plant {args.plant!r}: unknown; known: {', '.join(named)}")
    config = EfficiencyConfig()
    if args.delta is not None:
        try:
            config = EfficiencyConfig(delta_percent=args.delta)
        except ValueError as exc:
            ap.error(f"--delta: {exc}")
    if args.ensemble is not None:
        drawn = ensemble(args.ensemble, args.seed, real_sensors=args.sensors == "real")
        results = [compare(sc, args.seconds, config) for sc in drawn]
        return _print_ensemble(results, summary(results), args.json)
    spec = args.policy or ("stock" if args.mitigate is False or args.fake_root else "dsr1d")
    if args.mitigate is False and args.policy not in (None, "stock"):
        ap.error("--no-mitigate and --policy disagree")
    try:
        pol = policy(spec, config)
    except ValueError as exc:
        ap.error(f"--policy: {exc}")
    scenario = named[args.plant]
    if args.sensors == "real":
        scenario = with_real_sensors(scenario, args.seed)
    if args.fake_root is not None:
        rows = _behind_fake_root(scenario, args.fake_root, args.seconds, args.dt, args.realtime)
    else:
        rows = run(scenario, pol, args.seconds, args.dt)
    if args.csv is not None and not _write_csv(args.csv, rows):
        return 1
    figs = figures(rows)
    if args.json:
        print(json.dumps({"plant": scenario.name, "policy": pol.name, "seconds": args.seconds,
                          **figs}, indent=1))
        return 0
    _print_rows(rows, args.dt)
    print(f"{scenario.name} under {pol.name}: {figs['tokens_per_s']:.2f} tok/s sustained (after "
          f"the first minute), p5 {figs['p5_tokens_per_s'] or 0:.2f}, "
          f"{figs['joules_per_token'] or 0:.2f} J/token, {figs['throttle_events_per_min']:.1f} "
          f"throttle events/min, duty {figs['throttle_duty']:.1%}, peak "
          f"{figs['peak_temp_c']:.1f} °C, {figs['actions']} actions")
    return 0


def _behind_fake_root(scenario: Scenario, root: Path, seconds: float, dt: float,
                      realtime: bool) -> list[dict[str, Any]]:
    rows = []
    plant = Plant(scenario.params)
    plant.write_fake_root(root)
    start = time.monotonic()
    for i in range(int(round(seconds / dt))):
        apply_controls(plant, read_controls(root))
        if scenario.schedule is not None:
            scenario.schedule(plant.time_s, plant)
        row = plant.step(dt)
        row.update(state="n/a", actions=[], active=[])
        plant.write_fake_root(root)
        rows.append(row)
        if realtime:
            time.sleep(max(0.0, start + (i + 1) * dt - time.monotonic()))
    return rows


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> bool:
    try:
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
            writer.writeheader()
            for row in rows:
                writer.writerow(_csv_row(row))
    except OSError as exc:
        print(f"dsr1d simulate: cannot write {path}: {exc.strerror}", file=sys.stderr)
        return False
    return True


def _print_rows(rows: list[dict[str, Any]], dt: float) -> None:
    print(f"{'time_s':>7} {'temp_C':>7} {'MHz':>6} {'W':>6} {'thr':>5} {'tok/s':>6}  state")
    every = max(1, int(round(30.0 / dt)))
    for row in rows[every - 1::every]:
        print(f"{row['time_s']:7.0f} {row['pkg_temp_c']:7.1f} {row['freq_mhz']:6.0f} "
              f"{row['pkg_power_w']:6.1f} {row['throttle_count']:5d} {row['tokens_per_s']:6.2f}  "
              f"{row['state']} {' '.join(row['active'])}")
    for row in rows:
        for a in row["actions"]:
            print(f"t={row['time_s']:.0f}s {a.kind} {a.rung}: {a.reason}")


def _print_ensemble(results: list[dict[str, Any]], summ: dict[str, Any], as_json: bool) -> int:
    if as_json:
        slim = [{k: r[k] for k in ("plant", "description", "oracle_policy", "tokens_ratio",
                                   "energy_ratio", "tokens_vs_oracle", "energy_vs_oracle",
                                   "would_throttle", "acted_before_throttling")}
                | {"actions": r["dsr1d"]["actions"]} for r in results]
        print(json.dumps({"plants": slim, "summary": summ}, indent=1))
        return 0
    print(f"{'plant':18} {'tok/stock':>9} {'J/stock':>8} {'tok/orac':>8} {'J/orac':>7} "
          f"{'actions':>7}  oracle")
    for r in results:
        print(f"{r['plant']:18} {r['tokens_ratio'] or 0:9.3f} {r['energy_ratio'] or 0:8.3f} "
              f"{r['tokens_vs_oracle'] or 0:8.3f} {r['energy_vs_oracle'] or 0:7.3f} "
              f"{r['dsr1d']['actions']:7d}  {r['oracle_policy']}")
    for k, v in summ.items():
        print(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}")
    return 0


def summarize(rows: list[dict[str, Any]], warmup_s: float = 60.0,
              steady_from_s: float | None = None) -> dict[str, Any]:
    """Figures over a run: sustained tok/s (mean over the second half, the steady state), mean
    tok/s after ``warmup_s``, throttle events after ``warmup_s``, peak temperature, energy per
    token, and the controller's reaction in samples (1 = acted on the first sample showing
    throttling; None when it never throttled or never acted)."""
    end = rows[-1]["time_s"]
    steady_from = end / 2 if steady_from_s is None else steady_from_s
    steady = [r for r in rows if r["time_s"] > steady_from]
    after = [r for r in rows if r["time_s"] > warmup_s]
    before = [r for r in rows if r["time_s"] <= warmup_s]
    base_count = before[-1]["throttle_count"] if before else 0
    first_throttle = next((i for i, r in enumerate(rows)
                           if r["throttle_count"] > (rows[i - 1]["throttle_count"] if i else 0)),
                          None)
    first_apply = next((i for i, r in enumerate(rows)
                        if any(a.kind == "apply" for a in r.get("actions", []))), None)
    reaction = None
    if first_throttle is not None and first_apply is not None:
        reaction = first_apply - first_throttle + 1
    return {
        "sustained_tok_s": sum(r["tokens_per_s"] for r in steady) / max(1, len(steady)),
        "mean_tok_s_after_warmup": sum(r["tokens_per_s"] for r in after) / max(1, len(after)),
        "sustained_mhz": sum(r["busy_mhz"] for r in steady) / max(1, len(steady)),
        "sustained_power_w": sum(r["pkg_power_w"] for r in steady) / max(1, len(steady)),
        "throttle_events_after_60s": rows[-1]["throttle_count"] - base_count,
        "throttle_events_total": rows[-1]["throttle_count"],
        "first_throttle_s": rows[first_throttle]["time_s"] if first_throttle is not None else None,
        "peak_temp_c": max(r["pkg_temp_c"] for r in rows),
        "peak_temp_after_warmup_c": max((r["pkg_temp_c"] for r in after), default=None),
        "energy_per_token_j": rows[-1]["energy_j"] / max(1e-9, rows[-1]["tokens"]),
        "tokens": rows[-1]["tokens"],
        "energy_j": rows[-1]["energy_j"],
        "reaction_samples": reaction,
        "actions": sum(len(r.get("actions", [])) for r in rows),
    }


if __name__ == "__main__":
    sys.exit(simulate_main())
