"""Decode at depth: what R1's long reasoning costs. One stream, greedy, ``--tokens`` decoded
after ``--depths`` tokens of context, on the synthetic R1-Distill-Qwen-1.5B (int4).

Rows: dsr1d's llama-server as the daemon starts it (``engine_command.arguments``, its placement:
threads pinned one per physical core) with flash attention off and on, with a q8_0 KV cache,
and llama-server built from the release
(``DSR1D_LLAMA_PATCHES=amx-tile-config tools/llama-server.sh``, its defaults: flash attention
``auto``). Each row in its own server, rounds interleaved, the median printed with the ratio to
the release at the same depth. Prints a table and JSON; never passes or fails.

    .venv/bin/python bench/depth.py [--depths 0,4096] [--tokens 64] [--rounds 2]
                                    [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from results import add_write_option, markdown_table, write

REPO = Path(__file__).resolve().parent.parent
MODEL = Path("/var/tmp/dsr1d-bench/r1-1.5b/model-int4.gguf")


def release_binary() -> Path:
    env = dict(os.environ, DSR1D_LLAMA_PATCHES="amx-tile-config")
    out = subprocess.run([str(REPO / "tools/llama-server.sh"), sys.executable], env=env,
                         capture_output=True, text=True, check=True).stdout
    return Path(out.strip().splitlines()[-1])


def arguments(row: str, sock: Path, threads: int, context: int) -> tuple[Path, list[str]]:
    from dsr1d.edges import engine_command

    if row == "release":
        return release_binary(), ["--model", str(MODEL), "--host", str(sock), "--threads",
                                  str(threads), "--ctx-size", str(context), "--parallel", "1",
                                  "--no-webui"]
    flash, kv = {"dsr1d fa off": ("off", "f16"), "dsr1d fa on": ("on", "f16"),
                 "dsr1d fa on, kv q8_0": ("on", "q8_0")}[row]
    spec = engine_command.ServerSpec(MODEL, sock, threads, context, cpus=placed_cpus(threads),
                                     flash_attn=flash, kv_type=kv)
    return engine_command.find_binary(), engine_command.arguments(spec)


def placed_cpus(threads: int) -> list[int]:
    """The daemon's placement: one CPU per physical core of one node, pinned."""
    from dsr1d.contract.sysroot import SysRoot
    from dsr1d.core.placement import plan, read_topology

    return plan(read_topology(SysRoot("/")), None, threads, sorted(os.sched_getaffinity(0))).cpus


def decode_rate(row: str, depth: int, tokens: int, threads: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "llama.sock"
        binary, args = arguments(row, sock, threads, depth + tokens + 64)
        proc = subprocess.Popen([str(binary), *args], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                              base_url="http://s", timeout=3600) as client:
                while True:
                    try:
                        if client.get("/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        time.sleep(0.1)
                # a warm-up, so that the first steps' page faults are no row's figure
                client.post("/completion", json={"prompt": [100], "n_predict": 8})
                body = {"prompt": [100 + (i * 7919) % 1000 for i in range(max(1, depth))],
                        "n_predict": tokens, "ignore_eos": True, "temperature": 0,
                        "cache_prompt": False}
                return client.post("/completion", json=body).json()["timings"][
                    "predicted_per_second"]
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--depths", default="0,4096")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    add_write_option(parser)
    args = parser.parse_args()
    if not MODEL.exists():
        subprocess.run([sys.executable, "-m", "dsr1d.edges.admin", "model", "synth", "--preset",
                        "1.5b", "--gguf", "int4", "--force", str(MODEL.parent)], check=True)
    rows = ["release", "dsr1d fa off", "dsr1d fa on", "dsr1d fa on, kv q8_0"]
    depths = [int(d) for d in args.depths.split(",")]
    rates: dict[str, dict[int, list[float]]] = {r: {d: [] for d in depths} for r in rows}
    for n in range(args.rounds):
        for depth in depths:
            for row in rows:
                rate = decode_rate(row, depth, args.tokens, args.threads)
                rates[row][depth].append(rate)
                print(f"round {n + 1}, depth {depth}: {row} {rate:.2f} tok/s", file=sys.stderr,
                      flush=True)
    print(f"decode tok/s (÷ release), {args.threads} threads, {args.tokens} tokens, median of "
          f"{args.rounds}")
    print(f"{'row':22}" + "".join(f"{'depth ' + str(d):>22}" for d in depths))
    figures = {}
    for row in rows:
        line = f"{row:22}"
        for depth in depths:
            median = statistics.median(rates[row][depth])
            ratio = median / statistics.median(rates["release"][depth])
            figures.setdefault(row, {})[depth] = {"tok_s": median, "vs_release": ratio}
            line += f"{median:14.2f} ({ratio:.2f}×)"
        print(line)
    print(json.dumps(figures))
    write(args.write, "depth", f"Decode tok/s (÷ the release's llama-server), {args.threads} "
          f"threads, {args.tokens} tokens, median of {args.rounds}:\n\n" + markdown_table(
              ["row"] + [f"at {d} tokens of context" for d in depths],
              [[row] + [f"{f[d]['tok_s']:.2f} ({f[d]['vs_release']:.2f}×)" for d in depths]
               for row, f in figures.items()]))


if __name__ == "__main__":
    main()
