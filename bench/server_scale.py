"""The engine at server scale: llama-bench of the release, ik_llama.cpp and dsr1d's build on a
many-core machine that is lent for minutes, with the roofline and the issue's targets.

Such a machine has no time to compile and little to write files. So, here, beforehand:

    DSR1D_IK_SOURCE=TREE tools/server-scale-kit.sh .kit .venv/bin/python
        # ~25 min: the three llama-bench, gzipped, built for -march=sapphirerapids

and there, in the checkout's copy, one prepared call (``.kit`` carried; python3 with numpy,
tokenizers and torch, as the lent machines have):

    python3 -m pip install -q --no-index --no-deps --target /tmp/site .kit/gguf-*.whl &&
    PYTHONPATH=/tmp/site:src python3 bench/server_scale.py --kit .kit --write docs/benchmarks.md

It unpacks the binaries, writes every random file first (``random_gguf.py``, the published
tensor mix of each type; nothing is timed while a file is written), then per round and per file
probes the memory bandwidth and runs each row once, the rows' order turning each round:
``llama-bench -t THREADS -p PROMPT -n TOKENS -r REPS -o json``; dsr1d's build as the daemon
serves it (weights read into memory, ``-lm none``; glibc's huge-page tunable; threads pinned one
per physical core of one node, ``-C MASK --cpu-strict 1``), the release with its defaults (the
file memory-mapped, threads unpinned), ik_llama.cpp with its run-time repack (``-rtr 1``) as its
users run it on CPU. On an AMX CPU a fourth column, ``dsr1d all``, runs dsr1d's build again with
``DSR1D_KQUANTS=all`` on the Q4_0 and Q8_0 files: its panels instead of amx/'s tiles, which the
2-core AMX VM measured faster; whether that holds at this many cores. Ratios are paired per
round, as in ``bench/inference.py`` (whose summary and table this shares); a binary that cannot
run on the CPU (an instruction it lacks) is reported and left out. It never fails: it reports.

With ``--depth N`` every row prefills and decodes after N tokens of context (``-d N``), where
R1's reasoning is: the peers with their defaults, dsr1d's build with flash attention on and a
q8_0 KV cache (``--dsr1d-attention``; what the daemon's calibration chose for the files measured
on the 2-core AMX VM, docs/engine.md), into the block ``server-scale-depth``. ik_llama.cpp's
llama-bench has no ``-d``: its ``-gp N,TOKENS`` times the decode alone, so its prompt at depth is
not measured.

A kit built with ``DSR1D_KIT_ARCH=x86-64-v3`` (AVX2, FMA and F16C, no AVX-512) measures what an
AVX2-only CPU (AMD Zen 2 and 3, Intel before Skylake-SP) gets from each: dsr1d's AVX2 kernels, the
release's and ik's AVX2 paths. It runs on any x86 machine, this one included, has no ``dsr1d all``
column, and writes the block ``server-scale-avx2``.

    python3 bench/server_scale.py [--kit .kit] [--preset 7b] [--types Q4_0,Q8_0,Q4_K_M]
        [--threads N] [--rounds 2] [--prompt 128] [--tokens 64] [--reps 2] [--depth N]
        [--dsr1d-attention on,q8_0] [--write PAGE]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import inference  # noqa: E402
from results import add_write_option, write  # noqa: E402

from dsr1d.edges.engine_command import cache_types, cpu_mask, environment  # noqa: E402

ROWS = ("release", "ik -rtr", "dsr1d", "dsr1d all")
KIT_NAMES = {"release": "release", "ik -rtr": "ik", "dsr1d": "dsr1d"}
# "dsr1d all": dsr1d's build with DSR1D_KQUANTS=all, on an AMX CPU only (elsewhere it is dsr1d) and
# on the files it changes: its panels instead of amx/'s tiles for Q4_0 and Q8_0, as a second
# dsr1d column (not a peer), to learn which is faster at this many cores
ALL_TYPES = ("Q4_0", "Q8_0")
# GCC -march levels without AVX-512: a kit built for one (DSR1D_KIT_ARCH=x86-64-v3) measures what an
# AVX2-only CPU gets (dsr1d's AVX2 kernels, the release's and ik's AVX2 paths) on any x86 machine,
# with no AMX and so no "dsr1d all" column; its figures go to a block of their own
AVX2_ARCHES = ("x86-64-v3", "haswell", "broadwell", "skylake", "znver1", "znver2", "znver3")


def kit_arch(kit: Path) -> str:
    """What the kit was built for (tools/server-scale-kit.sh writes it)."""
    return (kit / "arch.txt").read_text().strip() if (kit / "arch.txt").exists() else "?"


def avx2_kit(kit: Path) -> bool:
    """Whether the kit was built for an AVX2 level (no AVX-512, no AMX: no ``dsr1d all`` column)."""
    return kit_arch(kit) in AVX2_ARCHES


def unpack(kit: Path, into: Path) -> dict[str, Path]:
    """The kit's binaries that run on this CPU, by row."""
    bins = {}
    for row in ROWS:
        if row == "dsr1d all":   # dsr1d's binary, unpacked and probed already
            if "dsr1d" in bins and inference.has_amx() and not avx2_kit(kit):
                bins[row] = bins["dsr1d"]
            continue
        packed = kit / f"{KIT_NAMES[row]}-llama-bench.gz"
        if not packed.exists():
            print(f"{row}: no {packed} (tools/server-scale-kit.sh builds it)", file=sys.stderr)
            continue
        binary = into / f"{KIT_NAMES[row]}-llama-bench"
        with gzip.open(packed) as src, open(binary, "wb") as dst:
            shutil.copyfileobj(src, dst)
        binary.chmod(0o755)
        probe = subprocess.run([str(binary), "--help"], capture_output=True, text=True)
        if probe.returncode != 0:
            print(f"{row}: its llama-bench does not run here (exit {probe.returncode}; built for "
                  f"{kit_arch(kit)})", file=sys.stderr)
            continue
        bins[row] = binary
    return bins


def bench(row: str, binary: Path, gguf: Path, args: argparse.Namespace) -> dict[str, float]:
    """One llama-bench run: prompt and decode tok/s (mean of its repetitions)."""
    command = [str(binary), "-m", str(gguf), "-t", str(args.threads), "-p", str(args.prompt),
               "-n", str(args.tokens), "-r", str(args.reps), "-o", "json"]
    if args.depth and row == "ik -rtr":
        # ik's llama-bench has no -d; -gp PP,TG times TG tokens after PP (decode only)
        command[command.index("-p") + 1] = command[command.index("-n") + 1] = "0"
        command += ["-gp", f"{args.depth},{args.tokens}"]
    elif args.depth:
        command += ["-d", str(args.depth)]
    env = dict(os.environ)
    if row == "ik -rtr":
        command += ["-rtr", "1"]      # its run-time repack, as its users run it on CPU
    if row.startswith("dsr1d"):
        mask = cpu_mask(inference.placed_cpus(args.threads)[:args.threads])
        command += ["-lm", "none", "-C", mask, "--cpu-strict", "1"]
        if args.depth:
            flash, kv = args.dsr1d_attention.split(",")
            k, v = cache_types(flash, kv)
            command += ["-fa", flash, "-ctk", k, "-ctv", v]
        env = environment(env)
    if row == "dsr1d all":
        env["DSR1D_KQUANTS"] = "all"
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr[-500:]}")
    figures = {}
    for test in json.loads(proc.stdout):
        metric = "prompt" if test["n_gen"] == 0 else f"decode@{args.depth}"
        figures[metric] = float(test["avg_ts"])
    return figures


def run(args: argparse.Namespace, files: dict[str, Path],
        bins: dict[str, Path]) -> tuple[inference.Samples, dict[str, dict[int, float]]]:
    """samples[type][row][metric][round] and bandwidth[type][round], as bench/inference.py's."""
    rows = list(bins)
    samples: inference.Samples = {}
    bandwidth: dict[str, dict[int, float]] = {}
    for n in range(args.rounds):
        for ftype, gguf in files.items():
            bandwidth.setdefault(ftype, {})[n] = inference.memory_bandwidth(args.threads)
            for row in rows[n % len(rows):] + rows[:n % len(rows)]:
                if row == "dsr1d all" and ftype not in ALL_TYPES:
                    continue
                try:
                    figures = bench(row, bins[row], gguf, args)
                except (RuntimeError, subprocess.TimeoutExpired, ValueError, KeyError) as exc:
                    print(f"round {n + 1} {ftype} {row}: failed: {exc}", file=sys.stderr)
                    continue
                for metric, value in figures.items():
                    samples.setdefault(ftype, {}).setdefault(row, {}).setdefault(metric, {})[n] = value
                print(f"round {n + 1} {ftype} {row}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in figures.items()), file=sys.stderr, flush=True)
    return samples, bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kit", type=Path, default=Path(".kit"))
    parser.add_argument("--preset", choices=("1.5b", "7b"), default="7b")
    parser.add_argument("--types", default=",".join(inference.DECODE_TARGET_TYPES))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--depth", type=int, default=0,
                        help="tokens of context before the prompt and the decode (llama-bench -d)")
    parser.add_argument("--dsr1d-attention", default="on,q8_0",
                        help="flash attention and KV cache type of dsr1d's rows with --depth")
    add_write_option(parser)
    args = parser.parse_args()
    start = time.monotonic()
    print(inference.cpu_line(), file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        bins = unpack(args.kit, Path(tmp))
        if not bins:
            raise SystemExit("server_scale: no binary runs here")
        files = inference.ensure_files(args.preset, args.types.split(","))
        print(f"files ready in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        samples, bandwidth = run(args, files, bins)
    records = inference.summarize(samples, files, bandwidth)
    probes = sorted(b / 1e9 for per_file in bandwidth.values() for b in per_file.values())
    attention = args.dsr1d_attention.replace(",", ", KV ")
    deep = f" -d {args.depth} (dsr1d: flash attention {attention})" if args.depth else ""
    head = (f"{args.threads} threads, {args.preset} shape, llama-bench -p {args.prompt} -n "
            f"{args.tokens} -r {args.reps}{deep}, {args.rounds} interleaved rounds; memory read "
            f"bandwidth {probes[len(probes) // 2]:.1f} GB/s (median of {len(probes)} probes, "
            f"{probes[0]:.1f}–{probes[-1]:.1f}); kit built for {kit_arch(args.kit)}")
    text = inference.table(records, list(bins))
    print(head)
    print(text)
    print(json.dumps(records))
    print(f"{time.monotonic() - start:.0f} s in all", file=sys.stderr)
    block = "server-scale-avx2" if avx2_kit(args.kit) else "server-scale"
    block += "-depth" if args.depth else ""
    write(args.write, block, f"{inference.cpu_line()}\n\n{head}:\n\n{text}")


if __name__ == "__main__":
    main()
