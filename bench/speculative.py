"""Speculative decoding as dsr1d serves it: llama-server started with the daemon's own flags
(``engine_command.arguments``), one stream, greedy, ``--tokens`` tokens a request.

Rows, each in its own server, rounds interleaved, the median round printed:
- the target alone, and with its draft (same vocabulary) drafting at llama-server's synthetic
  acceptance lengths (``--spec-synth-len``, benchmarking only: random weights accept nothing on
  their own) and at the real acceptance of two random networks (what speculation costs when
  every draft is wrong). ``--target 1.5b``: the synthetic R1-Distill-Qwen-1.5B (int4) with the
  synthetic ``draft`` shape; ``--target 7b``: the 7B shape as a published Q4_K_M file with the
  1.5B shape's Q4_K_M as its draft (the pairing the R1 distills offer), both written by
  ``random_gguf.py`` before anything is timed;
- (1.5b only) SmolLM2-135M-Instruct (a real model) alone and with n-gram drafting
  (``draft_model = ngram``), on a text that repeats itself and on a chat answer that does not.

Speed-up is decode tok/s over the same model's row without speculation in the same run. Prints
a table and JSON; never passes or fails.

    .venv/bin/python bench/speculative.py [--target 1.5b|7b] [--tokens 128] [--rounds 3]
                                          [--lens 2,3,4] [--write docs/engine.md]
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


def published(preset: str, ftype: str) -> Path:
    """A random file of the preset's shape at llama-quantize's mix for ``ftype``, once (the
    inference bench's files)."""
    from inference import ensure_files

    return ensure_files(preset, [ftype])[ftype]


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


def small_rows(small: Path, week: dict, chat: dict) -> dict[str, tuple]:
    """SmolLM2 alone and with n-gram drafting, on a repeating text and on a chat answer."""
    return {"smollm2, repeating text": (small, [], week, "smollm2, repeating text"),
            "smollm2 + ngram, repeating text": (small, ["ngram"], week, "smollm2, repeating text"),
            "smollm2, chat": (small, [], chat, "smollm2, chat"),
            "smollm2 + ngram, chat": (small, ["ngram"], chat, "smollm2, chat")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--target", choices=("1.5b", "7b"), default="1.5b")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lens", default="2,3,4", help="synthetic mean acceptance lengths")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    add_write_option(parser)
    args = parser.parse_args()
    if args.target == "7b":
        target, draft = published("7b", "Q4_K_M"), published("1.5b", "Q4_K_M")
    else:
        target, draft = synthetic("1.5b", "int4"), synthetic("draft", "int8")
    greedy = {"temperature": 0, "max_tokens": args.tokens}
    synth = {"prompt": "The", **greedy, "ignore_eos": True}
    chat = {"messages": [{"role": "user", "content": CHAT}], **greedy}
    week = {"prompt": WEEK, **greedy}
    # name: (model, speculation, request, the row without speculation it is compared with)
    alone = args.target if args.target == "1.5b" else "7b Q4_K_M"
    with_draft = f"{alone} + {'draft' if args.target == '1.5b' else '1.5b Q4_K_M draft'}"
    rows = {alone: (target, [], synth, alone),
            f"{with_draft}, random acceptance": (target, ["draft", str(draft)], synth, alone)}
    for length in args.lens.split(","):
        rows[f"{with_draft}, synthetic len {length}"] = (
            target, ["draft", str(draft), "--spec-synth-len", length], synth, alone)
    if args.target == "1.5b":
        rows |= small_rows(smollm2(), week, chat)
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
    body = f"{args.threads} threads, {args.tokens} tokens, median of {args.rounds}:\n\n" + markdown_table(
        ["row", "tok/s", "drafted", "accepted", "tokens per target step", "speed-up"],
        [(name, f"{f['tok_s']:.1f}", f["draft_n"], f["draft_n_accepted"],
          f"{f['tokens_per_target_step']:.2f}", f"{f['speed_up']:.2f}×") for name, f in figures.items()])
    if args.target == "1.5b":
        write(args.write, "speculative", body)
    else:
        write(args.write, "speculative-7b", body)


if __name__ == "__main__":
    main()
