"""Throttle mitigation on the calibrated thermal plant: mitigated vs unmitigated.

One run each of 10 simulated minutes of sustained decode on the `XEON_SUSTAINED` preset
(dsr1d.sim.sim), the controller with its default `[mitigation]` configuration. Prints a table and a
JSON object; never passes or fails (the exit status is 0 either way). Simulated time: it takes
about a second. Usage: .venv/bin/python bench/mitigation.py [--seconds 600] [--json-only]

Figures:
  sustained tok/s           mean decode tokens/s over the second half of the run (steady state)
  mean tok/s after 60 s     the same over everything after the first minute
  throttle events > 60 s    PROCHOT assertions (thermal_throttle counter increments) after 60 s
  peak temperature          package (die) maximum, °C
  energy per token          package energy / tokens decoded, J
  reaction                  samples from the first one that shows throttling to the first applied
                            rung, counting that first one (1 = acted on the first sample)
Targets (the issue's): >= 1.15x sustained tok/s, >= 90 % fewer throttle events after the first
minute, reaction within 2 samples.

With ``--daemon-seconds N`` (default 60; 0 skips it) it also starts the real daemon on this
machine (``--root /``, a private bus, a scratch journal, and an empty profile so no knob
changes) with the telemetry sampler at 1 Hz, and prints its CPU share of one core over N s,
measured from /proc/PID/stat; the baseline is the same daemon with sampling every 3600 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dsr1d.core.mitigation import Controller, MitigationConfig
from dsr1d.sim.sim import XEON_SUSTAINED, simulate, summarize


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--json-only", action="store_true")
    ap.add_argument("--daemon-seconds", type=float, default=60.0)
    args = ap.parse_args()

    config = MitigationConfig()
    off_rows = simulate(XEON_SUSTAINED, args.seconds, None)
    on_rows = simulate(XEON_SUSTAINED, args.seconds, Controller(config))
    off, on = summarize(off_rows), summarize(on_rows)
    ev_off, ev_on = off["throttle_events_after_60s"], on["throttle_events_after_60s"]
    result = {
        "preset": XEON_SUSTAINED.name,
        "simulated_s": args.seconds,
        "unmitigated": off,
        "mitigated": on,
        "ratios": {
            "sustained_tok_s": on["sustained_tok_s"] / off["sustained_tok_s"],
            "throttle_events_reduction_percent":
                100.0 * (1 - ev_on / ev_off) if ev_off else None,
            "energy_per_token": on["energy_per_token_j"] / off["energy_per_token_j"],
        },
        "actions": [f"t={r['time_s']:.0f}s {a.kind} {a.rung}: {a.reason}"
                    for r in on_rows for a in r["actions"]],
    }
    ratios = result["ratios"]
    result["targets"] = {
        "sustained_tok_s_ge_1.15x": ratios["sustained_tok_s"] >= 1.15,
        "throttle_events_ge_90_percent_fewer":
            ratios["throttle_events_reduction_percent"] is not None
            and ratios["throttle_events_reduction_percent"] >= 90.0,
        "reaction_within_2_samples": on["reaction_samples"] is not None
            and on["reaction_samples"] <= 2,
    }
    if not args.json_only:
        rows = [
            ("sustained tok/s (2nd half)", "sustained_tok_s", "{:.2f}"),
            ("mean tok/s after 60 s", "mean_tok_s_after_warmup", "{:.2f}"),
            ("sustained busy MHz", "sustained_mhz", "{:.0f}"),
            ("sustained package W", "sustained_power_w", "{:.1f}"),
            ("throttle events after 60 s", "throttle_events_after_60s", "{}"),
            ("first throttle at s", "first_throttle_s", "{}"),
            ("peak temperature °C", "peak_temp_c", "{:.1f}"),
            ("energy per token J", "energy_per_token_j", "{:.2f}"),
            ("reaction (samples)", "reaction_samples", "{}"),
        ]
        print(f"{'':30} {'unmitigated':>12} {'mitigated':>12}")
        for label, key, fmt in rows:
            a = "-" if off[key] is None else fmt.format(off[key])
            b = "-" if on[key] is None else fmt.format(on[key])
            print(f"{label:30} {a:>12} {b:>12}")
        red = ratios["throttle_events_reduction_percent"]
        print(f"\nsustained tok/s {ratios['sustained_tok_s']:.2f}x, throttle events after 60 s "
              f"{'-' if red is None else f'{red:.1f} %'} fewer, energy per token "
              f"{ratios['energy_per_token']:.2f}x, reaction {on['reaction_samples']} sample(s)")
        for name, ok in result["targets"].items():
            print(f"target {name}: {'met' if ok else 'NOT met'}")
        print("\ncontroller log:")
        for line in result["actions"]:
            print("  " + line)
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
    print(json.dumps(result, indent=2, default=str, ensure_ascii=False))


if __name__ == "__main__":
    main()
