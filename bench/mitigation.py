"""Throttle mitigation on hardware-shaped plants: stock, the old ladder, the oracle and dsr1d.

Per named plant (step TCC, floor PROCHOT, memory-bound knee, AMD, PL2 expiry, inlet step, bursty,
idle, VM, CPU online, PL1 ignored) and over a seeded ensemble (dsr1d.sim.scenarios), ten simulated
minutes each: the policies ``stock`` (nothing), ``ladder`` (the previous rung controller), the
``oracle`` (the best fixed frequency ceiling, searched every 200 MHz: least J/token within 2 % of
the best tokens/s) and ``dsr1d`` (the tokens-per-joule controller, dsr1d.core.efficiency).
Prints a table and a JSON object; never passes or fails. Simulated time: about a minute for 100
plants on 2 cores. Usage:
    .venv/bin/python bench/mitigation.py [--ensemble 100] [--seed 7] [--daemon-seconds 60]

Figures (everything after the first minute): tok/s (tokens / time), p5 tok/s (5th percentile of
the decoding samples), J/token, throttle duty (time the hardware limited the clock for heat),
events/min (thermal limit activations), lead (seconds from dsr1d's first action to the first
thermal event stock would have; + = acted first), false actions/hour (any action on a trace where
the right answer is none), regret (1 - dsr1d/oracle tok/s; dsr1d/oracle - 1 J/token).
Targets over the ensemble: median tok/s >= 0.99x stock, worst >= 0.97x; median J/token <= 0.85x
stock; regret <= 3 % tok/s and <= 5 % J/token; zero actions on idle, bursty, PL2-expiry and VM;
the first action before the first thermal event on >= 90 % of the plants that would throttle.
Then the frontier of the best fixed ceiling over the ensemble at delta 2, 5 and 10 %: what the
tokens/s and J/token targets cost each other on these plants, whatever the controller; and the
same ensemble seen through real sensors (noisy tokens/s and power, whole-degree temperatures;
``--exact-only`` skips it).

The controller's reaction: its own cost per sample (microseconds, pure Python), and with
``--reaction-samples N`` (default 20; 0 skips it) the real daemon against a fake root driven by
the plant in real time: milliseconds from the moment the root shows the hardware throttling to
the lower frequency ceiling the daemon writes, sampling every ``--reaction-interval`` s (1, as
shipped). A sample comes half an interval after the event on average. `DSR1D_BENCH_LOG=FILE`
keeps that daemon's log.

With ``--daemon-seconds N`` (default 60; 0 skips it) it also starts the real daemon on this
machine (``--root /``, a private bus, a scratch journal, and an empty profile so no knob
changes) with the telemetry sampler at 1 Hz, and prints its CPU share of one core over N s,
measured from /proc/PID/stat; the baseline is the same daemon with sampling every 3600 s.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsr1d.sim.run import (Ladder, best_fixed, ceiling_runs, compare, figures, percentile, run,
                           summary)
from dsr1d.sim.scenarios import ensemble, plants


REPO = Path(__file__).resolve().parent.parent


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def daemon_cpu_share(seconds: float, interval: float) -> float:
    """Percent of one core the real daemon uses on this machine, sampling every ``interval``."""
    sys.path.insert(0, str(REPO / "tests"))
    from harness.privbus import PrivateBus

    with tempfile.TemporaryDirectory() as tmp, \
            PrivateBus([REPO / "etc/dbus-1/system.d/org.dsr1d.conf"]) as bus:
        profiles = Path(tmp) / "profiles"
        profiles.mkdir()
        (profiles / "idle.conf").write_text("[main]\nsummary = changes nothing\n")
        conf = Path(tmp) / "dsr1d.conf"
        conf.write_text(f"[daemon]\ndefault_profile = idle\ntelemetry_interval_s = {interval}\n")
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsr1d.edges.admin", "run", "--config", str(conf), "--bus-address",
             bus.address, "--journal", f"{tmp}/state.json", "--profiles-dir", str(profiles)],
            stderr=subprocess.DEVNULL)
        try:
            time.sleep(5)  # start-up (imports, probes) is not the steady state
            before, start = _cpu_seconds(proc.pid), time.monotonic()
            time.sleep(seconds)
            return (_cpu_seconds(proc.pid) - before) / (time.monotonic() - start) * 100
        finally:
            proc.terminate()
            proc.wait(timeout=30)


REACT_PROFILE = """[main]
include = sustained
[mitigation]
steady_s = 2
dwell_s = 600
settle_s = 0.5
release_idle_s = 600
"""
THROTTLE_MS = "sys/devices/system/cpu/cpu0/thermal_throttle/package_throttle_total_time_ms"
CEILING = "sys/devices/system/cpu/cpu0/cpufreq/scaling_max_freq"


def _changed(path: Path, old: str, timeout: float) -> float | None:
    """monotonic() when ``path`` first reads other than ``old`` (polled every ms), or None."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if path.read_text() != old:
                return time.monotonic()
        except OSError:
            pass
        time.sleep(0.001)
    return None


def daemon_reaction(samples: int, interval: float) -> list[float]:
    """Milliseconds from the moment a fake root shows the hardware throttling (more throttle
    time in ``thermal_throttle``) to the lower frequency ceiling the real daemon writes in
    answer, ``samples`` times, the daemon sampling every ``interval`` s. The root is driven in
    real time by the memory-bound plant (never hot on its own); the profile's energy windows are
    ten minutes long, so throttle evidence is the only thing that moves the ceiling."""
    sys.path.insert(0, str(REPO / "tests"))
    from harness.plant_driver import PlantDriver, plant_root
    from harness.privbus import PrivateBus

    from dsr1d.sim.scenarios import MEMORY_KNEE

    out: list[float] = []
    with tempfile.TemporaryDirectory() as tmp, \
            PrivateBus([REPO / "etc/dbus-1/system.d/org.dsr1d.conf"]) as bus:
        root = plant_root(Path(tmp) / "root", {"react": REACT_PROFILE})
        conf = Path(tmp) / "dsr1d.conf"
        conf.write_text(f"[daemon]\ndefault_profile = react\ntelemetry_interval_s = {interval}\n")
        env = bus.env({**os.environ, "DSR1D_PLUGINS": "plant_tokens",
                       "PYTHONPATH": str(REPO / "tests")})
        with PlantDriver(root, MEMORY_KNEE) as driver, \
                open(os.environ.get("DSR1D_BENCH_LOG", os.devnull), "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dsr1d.edges.admin", "run", "--root", str(root),
                 "--config", str(conf), "--bus-address", bus.address], env=env, stderr=log)
            try:
                time.sleep(8)   # start-up, then steady_s of decode
                for _ in range(samples):
                    time.sleep(random.uniform(1.2, 1.2 + interval))   # any phase of the sampler
                    ceiling, throttle = (root / CEILING).read_text(), (root / THROTTLE_MS).read_text()
                    driver.inject_throttle()
                    shown = _changed(root / THROTTLE_MS, throttle, 2.0)
                    written = _changed(root / CEILING, ceiling, 10 * interval + 5)
                    if shown is not None and written is not None:
                        out.append((written - shown) * 1000)
            finally:
                proc.terminate()
                proc.wait(timeout=30)
    return out


def controller_step_us(seconds: float = 600.0) -> float:
    """Microseconds the controller takes per sample (pure Python, building the observation
    included) over a step-tcc run."""
    from dsr1d.sim.plant import Plant
    from dsr1d.sim.run import Dsr1d
    plant, pol, spent = Plant(plants()["step-tcc"].params), Dsr1d(), 0.0
    for _ in range(int(seconds)):
        plant.step(1.0)
        t = time.perf_counter()
        pol.step(plant)
        spent += time.perf_counter() - t
    return spent / int(seconds) * 1e6


def _row(name: str, f: dict) -> str:
    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else fmt.format(v)
    return (f"  {name:14} {f['tokens_per_s']:7.2f} {num(f['p5_tokens_per_s'], '{:7.2f}'):>7} "
            f"{num(f['joules_per_token'], '{:7.2f}'):>7} {f['throttle_duty']:6.1%} "
            f"{f['throttle_events_per_min']:7.1f} {f['actions']:5d}")


def named_plants(seconds: float) -> dict:
    """Every named plant under the four policies."""
    out = {}
    print(f"  {'policy':14} {'tok/s':>7} {'p5':>7} {'J/tok':>7} {'duty':>6} {'ev/min':>7} "
          f"{'acts':>5}")
    for name, sc in plants().items():
        r = compare(sc, seconds)
        ladder = figures(run(sc, Ladder(), seconds))
        event = r["stock"]["first_thermal_event_s"]
        first = r["dsr1d"]["first_action_s"]
        lead = None if event is None or first is None else event - first
        hours = seconds / 3600
        false_per_h = r["dsr1d"]["actions"] / hours if sc.quiet else 0.0
        print(f"{name} ({sc.description})")
        for label, f in (("stock", r["stock"]), ("ladder", ladder),
                         (r["oracle_policy"], r["oracle"]), ("dsr1d", r["dsr1d"])):
            print(_row(label, f))
        print(f"  dsr1d/stock tok/s {r['tokens_ratio'] or 0:.3f}, J/token "
              f"{r['energy_ratio'] or 0:.3f}; lead {'-' if lead is None else f'{lead:+.0f} s'}; "
              f"false actions/h {false_per_h:.0f}")
        out[name] = {**r, "ladder": ladder, "lead_s": lead, "false_actions_per_h": false_per_h}
    return out


FRONTIER_DELTAS = (2.0, 5.0, 10.0)


def oracle_frontier(scenarios: list, seconds: float) -> list[dict]:
    """What the best fixed ceiling reaches over the plants when it may give up ``delta`` % of
    tokens/s: the trade between the tokens/s and the J/token targets."""
    per: dict[float, tuple[list[float], list[float]]] = {d: ([], []) for d in FRONTIER_DELTAS}
    for sc in scenarios:
        runs = ceiling_runs(sc, seconds)
        stock = runs["stock"]
        for d in FRONTIER_DELTAS:
            _, f = best_fixed(runs, d)
            per[d][0].append(f["tokens_per_s"] / stock["tokens_per_s"])
            per[d][1].append(f["joules_per_token"] / stock["joules_per_token"])
    return [{"delta_percent": d, "median_tokens_ratio": statistics.median(tok),
             "worst_tokens_ratio": min(tok), "median_energy_ratio": statistics.median(en)}
            for d, (tok, en) in per.items()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--ensemble", type=int, default=100)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--elasticity", default="0.05,0.5", metavar="LO,HI",
                    help="the ensemble's range of decode elasticity at turbo")
    ap.add_argument("--json-only", action="store_true")
    ap.add_argument("--daemon-seconds", type=float, default=60.0)
    ap.add_argument("--exact-only", action="store_true",
                    help="skip the ensemble through real sensors' noise and resolution")
    ap.add_argument("--reaction-samples", type=int, default=20)
    ap.add_argument("--reaction-interval", type=float, default=1.0)
    args = ap.parse_args()

    result: dict = {"simulated_s": args.seconds}
    result["plants"] = {k: {kk: v[kk] for kk in ("tokens_ratio", "energy_ratio",
                                                   "tokens_vs_oracle", "energy_vs_oracle",
                                                   "oracle_policy", "lead_s",
                                                   "false_actions_per_h")}
                        for k, v in named_plants(args.seconds).items()}
    t0 = time.monotonic()
    lo, hi = (float(x) for x in args.elasticity.split(","))
    plants_drawn = ensemble(args.ensemble, args.seed, (lo, hi))
    results = [compare(sc, args.seconds) for sc in plants_drawn]
    summ = summary(results)
    result["ensemble"] = summ
    quiet = [n for n, sc in plants().items() if sc.quiet]
    targets = {
        "median_tokens_ge_0.99x_stock": summ["median_tokens_ratio"] >= 0.99,
        "worst_tokens_ge_0.97x_stock": summ["worst_tokens_ratio"] >= 0.97,
        "median_energy_le_0.85x_stock": summ["median_energy_ratio"] <= 0.85,
        "regret_tokens_le_3_percent": summ["median_tokens_vs_oracle"] >= 0.97,
        "regret_energy_le_5_percent": summ["median_energy_vs_oracle"] <= 1.05,
        "no_action_on_" + "_".join(quiet): all(result["plants"][n]["false_actions_per_h"] == 0
                                               for n in quiet),
        "first_action_before_throttling_ge_90_percent":
            summ["acted_before_throttling"] >= 0.9 * summ["plants_that_throttle"],
    }
    result["targets"] = targets
    result["oracle_frontier"] = oracle_frontier(plants_drawn, args.seconds)
    print(f"\nensemble of {args.ensemble} (seed {args.seed}, elasticity {lo:g}-{hi:g}, "
          f"{time.monotonic() - t0:.0f} s):")
    for k, v in summ.items():
        print(f"  {k}: {v:.3f}" if isinstance(v, float) else f"  {k}: {v}")
    for name, ok in targets.items():
        print(f"target {name}: {'met' if ok else 'MISSED'}")
    print("the best fixed ceiling over the ensemble, giving up delta % of tokens/s:")
    for row in result["oracle_frontier"]:
        print(f"  delta {row['delta_percent']:4.1f} %: median tok/s "
              f"{row['median_tokens_ratio']:.3f}x stock (worst {row['worst_tokens_ratio']:.3f}), "
              f"median J/token {row['median_energy_ratio']:.3f}x")
    if not args.exact_only:
        real = summary([compare(sc, args.seconds) for sc in
                        ensemble(args.ensemble, args.seed, (lo, hi), real_sensors=True)])
        result["ensemble_real_sensors"] = real
        print("the same plants through real sensors (tokens/s 0-3 % noise, power 0-2 %, "
              "whole degrees):")
        print("  " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in real.items()))
    print()
    if args.daemon_seconds > 0:
        sampling = daemon_cpu_share(args.daemon_seconds, 1.0)
        baseline = daemon_cpu_share(args.daemon_seconds, 3600.0)
        result["daemon_cpu_percent_sampling_1hz"] = sampling
        result["daemon_cpu_percent_baseline"] = baseline
        if not args.json_only:
            print(f"daemon CPU share on this machine over {args.daemon_seconds:.0f} s: "
                  f"{sampling:.3f} % of one core sampling at 1 Hz (target < 0.5 %), "
                  f"{baseline:.3f} % without sampling\n")
    result["controller_step_us"] = controller_step_us()
    if args.reaction_samples > 0:
        react = sorted(daemon_reaction(args.reaction_samples, args.reaction_interval))
        pct = {q: percentile(react, q) for q in (50, 90, 100)}
        result["daemon_reaction_ms"] = {"interval_s": args.reaction_interval,
                                        "samples": len(react), "p50": pct[50], "p90": pct[90],
                                        "max": pct[100]}
        if not args.json_only:
            print(f"controller: {result['controller_step_us']:.0f} us a sample; the real daemon "
                  f"sampling every {args.reaction_interval:g} s answered the hardware throttling "
                  f"with a lower ceiling in p50 {pct[50] or 0:.0f} ms, p90 {pct[90] or 0:.0f} ms, "
                  f"max {pct[100] or 0:.0f} ms ({len(react)} of {args.reaction_samples}; the "
                  f"next sample comes {args.reaction_interval * 500:.0f} ms later on average)\n")
    print(json.dumps(result, indent=2, default=str, ensure_ascii=False))


if __name__ == "__main__":
    main()
