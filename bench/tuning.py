"""Time the tuning core on a fake root: plan, switch, verify and restore, in milliseconds.

Prints figures, never passes or fails. Usage: .venv/bin/python bench/tuning.py [--cpus N]
[--write docs/benchmarks.md]
The baseline is a plain Python loop writing the same files without journal or checks, measured in
the same run, so the ratio shows what the safety (journal fsyncs, reads, no-op skipping) costs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from fakeroot import intel_box  # noqa: E402
from results import add_write_option, markdown_table, write  # noqa: E402

from dsr1d.core.context import build_core  # noqa: E402


def timed(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cpus", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=20)
    add_write_option(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        fake = intel_box(Path(tmp) / "root", cpus=args.cpus)
        core = build_core(fake.path)
        throughput, balanced = core.store.load("throughput"), core.store.load("balanced")

        def switch_both():
            core.tuner.switch(throughput)
            core.tuner.switch(balanced)

        def raw_writes():
            for cpu in range(args.cpus):
                (fake.path / f"sys/devices/system/cpu/cpu{cpu}/power/energy_perf_bias").write_text("0")
                (fake.path / f"sys/devices/system/cpu/cpu{cpu}/power/energy_perf_bias").write_text("6")

        figures = {
            "cpus": args.cpus,
            "plan_ms": timed(lambda: core.tuner.plan(throughput), args.repeat),
            "switch_pair_ms": timed(switch_both, args.repeat),
            "noop_switch_ms": timed(lambda: core.tuner.switch(balanced), args.repeat),
            "verify_ms": timed(lambda: core.tuner.verify(), args.repeat),
            "baseline_raw_epb_pair_ms": timed(raw_writes, args.repeat),
        }
        core.tuner.restore()
    figures["switch_vs_raw_ratio"] = figures["switch_pair_ms"] / figures["baseline_raw_epb_pair_ms"]
    for key, value in figures.items():
        print(f"{key:28} {value:10.2f}" if isinstance(value, float) else f"{key:28} {value:10}")
    print(json.dumps(figures))
    write(args.write, "tuning", markdown_table(
        ["figure", f"median of {args.repeat}"],
        [(key, f"{value:.2f}" if isinstance(value, float) else value)
         for key, value in figures.items()]))


if __name__ == "__main__":
    main()
