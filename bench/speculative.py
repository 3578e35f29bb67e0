"""Speculative decoding as dsr1d serves it: llama-server started with the daemon's own flags
(``engine_command.arguments``), one stream, greedy, ``--tokens`` tokens a request.

Rows, each in its own server, rounds interleaved, the median round printed:
- the synthetic R1-Distill-Qwen-1.5B (int4) alone, and with the synthetic ``draft`` shape (same
  vocabulary) drafting at llama-server's synthetic acceptance lengths (``--spec-synth-len``,
  benchmarking only: random weights accept nothing on their own) and at the real acceptance of
  two random networks (what speculation costs when every draft is wrong);
- SmolLM2-135M-Instruct (a real model) alone and with n-gram drafting (``draft_model = ngram``),
  on a text that repeats itself and on a chat answer that does not.

Speed-up is decode tok/s over the same model's row without speculation in the same run. Prints
a table and JSON; never passes or fails.

    .venv/bin/python bench/speculative.py [--tokens 128] [--rounds 3] [--lens 2,3,4]
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
BENCH = Path("/var/tmp/dsr1d-bench")
WEEK = ", ".join(["monday tuesday wednesday thursday friday saturday sunday"] * 3) + \
    ", monday tuesday"
CHAT = "Explain in a few sentences why the sky is blue."


def synthetic(preset: str, dtype: str) -> Path:
    """``dsr1d model synth --preset PRESET --gguf DTYPE``, once."""
    out = BENCH / f"r1-{preset}"
    gguf = out / f"model-{dtype}.gguf"
    if not gguf.exists():
        print(f"writing the synthetic {preset} model…", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "dsr1d.edges.admin", "model", "synth", "--preset",
                        preset, "--gguf", dtype, "--force", str(out)], check=True)
    return gguf


def smollm2() -> Path:
    return Path(subprocess.run([str(REPO / "tools/smollm2.sh")], capture_output=True, text=True,
                               check=True).stdout.strip())


def run_row(model: Path, extra: list[str], request: dict, threads: int) -> dict:
    """One server, one warm-up and one measured request: its timings."""
    from dsr1d.edges import engine_command

    binary = engine_command.find_binary()
    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "llama.sock"
        spec = engine_command.ServerSpec(model, sock, threads, 2048, mmap=False,
                                         draft=Path(extra[1]) if extra[:1] == ["draft"] else None,
                                         ngram=extra[:1] == ["ngram"])
        args = engine_command.arguments(spec) + extra[2 if extra[:1] == ["draft"] else 1:]
        proc = subprocess.Popen([str(binary), *args], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=engine_command.environment())
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)),
                              base_url="http://engine", timeout=600) as client:
                for _ in range(600):
                    try:
                        if client.get("/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    time.sleep(0.1)
                path = "/v1/chat/completions" if "messages" in request else "/v1/completions"
                client.post(path, json={**request, "max_tokens": 8})
                return client.post(path, json=request).json()["timings"]
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lens", default="2,3,4", help="synthetic mean acceptance lengths")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    add_write_option(parser)
    args = parser.parse_args()
    target, draft, small = synthetic("1.5b", "int4"), synthetic("draft", "int8"), smollm2()
    greedy = {"temperature": 0, "max_tokens": args.tokens}
    synth = {"prompt": "The", **greedy, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": CHAT}], **greedy}
    week = {"prompt": WEEK, **greedy}
    # name: (model, speculation, request, the row without speculation it is compared with)
    rows = {"1.5b": (target, [], synth, "1.5b"),
            "1.5b + draft, random acceptance": (target, ["draft", str(draft)], synth, "1.5b")}
    for length in args.lens.split(","):
        rows[f"1.5b + draft, synthetic len {length}"] = (
            target, ["draft", str(draft), "--spec-synth-len", length], synth, "1.5b")
    rows |= {"smollm2, repeating text": (small, [], week, "smollm2, repeating text"),
             "smollm2 + ngram, repeating text": (small, ["ngram"], week,
                                                 "smollm2, repeating text"),
             "smollm2, chat": (small, [], chat, "smollm2, chat"),
             "smollm2 + ngram, chat": (small, ["ngram"], chat, "smollm2, chat")}
    measured: dict[str, list[dict]] = {name: [] for name in rows}
    for r in range(args.rounds):
        for name, (model, extra, request, _) in rows.items():
            measured[name].append(run_row(model, extra, request, args.threads))
            print(f"round {r + 1}: {name}: "
                  f"{measured[name][-1]['predicted_per_second']:.1f} tok/s", file=sys.stderr,
                  flush=True)
    figures = {}
    print(f"{'row':40} {'tok/s':>7} {'drafted':>8} {'accepted':>9} {'tok/step':>9} "
          f"{'speed-up':>9}   ({args.threads} threads, {args.tokens} tokens, median of "
          f"{args.rounds})")
    for name in rows:
        runs = sorted(measured[name], key=lambda t: t["predicted_per_second"])
        t = runs[len(runs) // 2]
        base = statistics.median(x["predicted_per_second"] for x in measured[rows[name][3]])
        drafted, accepted = t.get("draft_n", 0), t.get("draft_n_accepted", 0)
        per_step = t["predicted_n"] / max(1, t["predicted_n"] - accepted)
        figures[name] = {"tok_s": t["predicted_per_second"], "draft_n": drafted,
                         "draft_n_accepted": accepted, "tokens_per_target_step": per_step,
                         "speed_up": t["predicted_per_second"] / base}
        print(f"{name:40} {t['predicted_per_second']:7.1f} {drafted:8d} {accepted:9d} "
              f"{per_step:9.2f} {t['predicted_per_second'] / base:8.2f}×")
    print(json.dumps(figures))
    write(args.write, "speculative", f"{args.threads} threads, {args.tokens} tokens, median of "
          f"{args.rounds}:\n\n" + markdown_table(
              ["row", "tok/s", "drafted", "accepted", "tokens per target step", "speed-up"],
              [(name, f"{f['tok_s']:.1f}", f["draft_n"], f["draft_n_accepted"],
                f"{f['tokens_per_target_step']:.2f}", f"{f['speed_up']:.2f}×")
               for name, f in figures.items()]))


if __name__ == "__main__":
    main()
