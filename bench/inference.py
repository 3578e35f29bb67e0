"""Decode speed of DeepSeek-R1-Distill-Qwen-1.5B (synthetic weights) on this CPU.

One run prints a table and JSON: the machine's memory read bandwidth; then one row per way of
running the model — plain transformers as a new user runs it (fp32, default ``generate``: the
baseline), then dsr1d's engine in fp32, bf16, int8 and int4 — with decode tokens/s (median of
``--runs`` runs after a warm-up), first-token latency for a 128-token prompt, peak RSS, the ratio
to the baseline, the roofline (bandwidth ÷ weight bytes read per decoded token) and the fraction of
it reached. Each row runs in its own process so its peak RSS is its own. Never passes or fails.

    .venv/bin/python bench/inference.py [--model DIR] [--tokens 32] [--runs 3] [--profile]

The model is synthesised on first use (``dsr1d model synth --preset 1.5b``, 3.6 GB) into
``--model`` (default /var/tmp/dsr1d-bench/r1-distill-qwen-1.5b).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DEFAULT_MODEL = Path("/var/tmp/dsr1d-bench/r1-distill-qwen-1.5b")
ROWS = ("baseline", "fp32", "bf16", "int8", "int4")
LABELS = {"baseline": "transformers fp32 generate (baseline)", "fp32": "dsr1d fp32",
          "bf16": "dsr1d bf16", "int8": "dsr1d int8 (weight-only)",
          "int4": "dsr1d int4 (weight-only, group 32)"}
# Bytes read per weight when decoding one token (int4: 4 bits + a bf16 scale and zero per 32).
BYTES_PER_WEIGHT = {"baseline": 4.0, "fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 32}


# -- figures the parent computes ---------------------------------------------------------------

def memory_bandwidth(threads: int) -> float:
    """Best-of-5 read bandwidth in bytes/s: summing a 1 GiB tensor with ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def weights_read_per_token(config: dict) -> int:
    """Weights every decoded token reads: all linears incl. lm_head (the embedding is indexed)."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter
    return layers * per_layer + config["vocab_size"] * h


# -- one row, in a child process ----------------------------------------------------------------

def prompt_ids(tokenizer, target: int) -> list[int]:
    """Chat-templated prompt ids of exactly ``target`` tokens, from the shipped corpus text."""
    from dsr1d.engine.synth import CORPUS

    words = CORPUS.read_text().split()
    lo, hi = 1, len(words)
    encode = lambda n: tokenizer.apply_chat_template(  # noqa: E731
        [{"role": "user", "content": " ".join(words[:n])}], add_generation_prompt=True,
        tokenize=True)
    while lo < hi:
        mid = (lo + hi) // 2
        ids = encode(mid)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        if len(ids) < target:
            lo = mid + 1
        else:
            hi = mid
    ids = encode(lo)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return ids[:target - 1] + ids[-1:] if len(ids) > target else ids


def run_baseline(model_dir: Path, tokens: int, runs: int, threads: int, prompt: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor([prompt_ids(tokenizer, prompt)])

    class Clock(BaseStreamer):
        def __init__(self) -> None:
            self.times: list[float] = []

        def put(self, value) -> None:
            self.times.append(time.perf_counter())

        def end(self) -> None:
            pass

    def once(n: int) -> tuple[float, float]:
        clock = Clock()
        start = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                       min_new_tokens=n, streamer=clock)
        new = clock.times[1:]  # the first put() is the prompt
        return new[0] - start, (len(new) - 1) / (new[-1] - new[0])

    once(4)
    results = [once(tokens) for _ in range(runs)]
    return {"first_token_s": statistics.median(r[0] for r in results),
            "decode_tok_s": statistics.median(r[1] for r in results)}


def run_dsr1d(model_dir: Path, dtype: str, tokens: int, runs: int, threads: int, prompt: int,
              profile: bool) -> dict:
    import torch

    from dsr1d.engine.generate import Generator
    from dsr1d.engine.model import load

    torch.set_num_threads(threads)
    start = time.perf_counter()
    loaded = load(model_dir, dtype)
    load_s = time.perf_counter() - start
    gen = Generator(loaded)
    text = loaded.tokenizer.decode(prompt_ids(loaded.tokenizer, prompt)[:-8])
    options = {"max_new_tokens": tokens, "ignore_eos": True, "greedy": True}
    gen.generate(text, {**options, "max_new_tokens": 4})
    stats = [gen.generate(text, options).stats for _ in range(runs)]
    result = {"first_token_s": statistics.median(s["first_token_latency_s"] for s in stats),
              "decode_tok_s": statistics.median(s["decode_tokens_per_s"] for s in stats),
              "prompt_tokens": stats[0]["prompt_tokens"], "load_s": load_s}
    if profile:
        result["profile"] = profile_decode(gen, text)
    return result


def profile_decode(gen, text: str) -> str:
    """Where decode time goes: the top operators over 8 decode steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        gen.generate(text, {"max_new_tokens": 8, "ignore_eos": True, "greedy": True})
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


def child(args: argparse.Namespace) -> None:
    if args.row == "baseline":
        result = run_baseline(args.model, args.tokens, args.runs, args.threads, args.prompt)
    else:
        result = run_dsr1d(args.model, args.row, args.tokens, args.runs, args.threads,
                           args.prompt, args.profile)
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("RESULT " + json.dumps(result), flush=True)


# -- the parent ----------------------------------------------------------------------------------

def ensure_model(path: Path) -> None:
    if (path / "config.json").exists():
        return
    from dsr1d.engine.synth import synth_main

    print(f"synthesising the 1.5B model into {path} (once)…", file=sys.stderr)
    if synth_main(["--preset", "1.5b", "--force", str(path)]) != 0:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--threads", type=int, default=0, help="0: one per physical core")
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--profile", action="store_true", help="print where decode time goes")
    parser.add_argument("--row", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.threads:
        import psutil

        args.threads = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    if args.row:
        child(args)
        return
    ensure_model(args.model)
    config = json.loads((args.model / "config.json").read_text())
    bandwidth = memory_bandwidth(args.threads)
    weights = weights_read_per_token(config)
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s ({args.threads} threads); "
          f"{weights / 1e9:.2f} G weights read per token", file=sys.stderr)
    rows = {}
    for row in args.rows.split(","):
        print(f"running {LABELS[row]}…", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, __file__, "--row", row, "--model", str(args.model),
                               "--tokens", str(args.tokens), "--runs", str(args.runs),
                               "--prompt", str(args.prompt), "--threads", str(args.threads)]
                              + (["--profile"] if args.profile else []),
                              capture_output=True, text=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{row} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        result = json.loads(lines[-1][7:])
        roofline = bandwidth / (weights * BYTES_PER_WEIGHT[row])
        result.update(roofline_tok_s=roofline, roofline_fraction=result["decode_tok_s"] / roofline)
        rows[row] = result
    base = rows.get("baseline", {}).get("decode_tok_s")
    print(f"\n{'':40} {'decode tok/s':>12} {'x baseline':>10} {'roofline':>9} {'of roof':>8} "
          f"{'1st token':>10} {'peak RSS':>9}")
    for row, r in rows.items():
        ratio = r["decode_tok_s"] / base if base else float("nan")
        r["ratio_to_baseline"] = ratio
        print(f"{LABELS[row]:40} {r['decode_tok_s']:12.2f} {ratio:10.2f} "
              f"{r['roofline_tok_s']:9.2f} {r['roofline_fraction'] * 100:7.0f}% "
              f"{r['first_token_s'] * 1000:8.0f}ms {r['peak_rss_bytes'] / 1e9:7.2f}GB")
    for row, r in rows.items():
        if "profile" in r:
            print(f"\nwhere {LABELS[row]} decode time goes:\n{r.pop('profile')}")
    print(json.dumps({"bandwidth_bytes_per_s": bandwidth, "threads": args.threads,
                      "weights_per_token": weights, "tokens": args.tokens, "runs": args.runs,
                      "prompt_tokens": args.prompt, "rows": rows}))


if __name__ == "__main__":
    main()
