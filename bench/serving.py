"""Serving through the OpenAI API: dsr1d (unix socket, continuous batching) vs llama-cpp-python's
own OpenAI server, the same GGUF, the real ``openai`` client, 1/2/4/8 concurrent streams.

One run, interleaved by concurrency level: per level, every stream asks for ``--tokens`` (256)
new tokens of the 1.5B synthetic model in Q4_0 (``bench/inference.py`` writes it under
/var/tmp/dsr1d-bench), streamed, with the same prompt (so from the second level on a server that
caches prompts has it cached); then once more 4 streams with 4 distinct prompts never sent
before (the same opening, a different last sentence). Printed per server and level: aggregate
decode tok/s (all streams' tokens over the wall time from the first request to the last
token), per-stream time-to-first-token and inter-token latency p50/p99 (streamed chunks: one a
token, except where the text holds back a partial character or ``</think>`` tag); then dsr1d's
single stream decode rate (first chunk to last) against the engine's own in-process (the API's
cost), medians of 3 pairs run one after the other while the daemon is idle, and 1,000
``/health`` calls made while 4 streams decode (p50/p99). First, what bounds the 4-stream
target whatever the API does: the engine's own `Batcher` step at 1 and at 4 rows, in a child
with the worker's environment (weights in huge pages), and the most 4 streams can gain from it.
Never passes or fails.

The peer is run as a user runs it: ``python -m llama_cpp.server --model M --n_threads T``
(needs ``pip install fastapi uvicorn sse-starlette starlette-context pydantic-settings``), on
TCP at 127.0.0.1; by default it abandons a running request when a new one arrives, so it is run
a second time with ``--interrupt_requests False`` (each request to its end, one at a time).
dsr1d runs as ``dsr1d run`` on a private bus with ``--root /``, a scratch journal and an empty
profile (no knob changes), ``engine_parallel = 8``.

Usage: .venv/bin/python bench/serving.py [--model GGUF] [--tokens 256] [--threads N]
Targets (the issue's): aggregate tok/s at 4 streams >= 2.5x our single stream and >= 2x the
peer's; TTFT p50 at 4 streams <= the peer's; single stream within 3 % of the engine's decode.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = Path("/var/tmp/dsr1d-bench/r1-distill-qwen-1.5b/bench-q4_0.gguf")
LEVELS = (1, 2, 4, 8)
PROMPT = "Explain, step by step, why the sky is blue and sunsets are red."
OURS = {"ignore_eos": True}      # the synthetic model's random text would end anywhere
PAIRS = 3                        # single streams in-process and through the API, interleaved
CEILING_STEPS = 40               # in-process batch steps timed at 1 and at 4 rows


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def stream_once(client: Any, model: str, tokens: int, seed: int,
                extra: dict[str, Any] | None = None, prompt: str = PROMPT) -> dict[str, Any]:
    """One streamed chat completion: TTFT, inter-token gaps, tokens (the usage figure where the
    server sends one, else the chunks)."""
    start = time.perf_counter()
    times: list[float] = []
    usage = None
    with client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=tokens,
            temperature=0.6, seed=seed, stream=True, stream_options={"include_usage": True},
            extra_body=extra or {}) as stream:
        for chunk in stream:
            if getattr(chunk, "usage", None) is not None:
                usage = chunk.usage.completion_tokens
            for choice in chunk.choices:
                d = choice.delta
                if d.content or (d.model_extra or {}).get("reasoning_content"):
                    times.append(time.perf_counter())
    gaps = [b - a for a, b in zip(times, times[1:])]
    count = usage if usage else len(times)
    decode = (count - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return {"start": start, "end": times[-1] if times else time.perf_counter(),
            "ttft": times[0] - start if times else None, "gaps": gaps, "tokens": count,
            "chunks": len(times), "decode_tok_s": decode}


def level(client: Any, model: str, n: int, tokens: int, extra: dict[str, Any] | None = None,
          distinct: str = "") -> dict[str, Any]:
    """``n`` streams at once, every one the same prompt, or (``distinct``: a tag no earlier
    run used) each its own question, never asked before, after the same opening."""
    def prompt(i: int) -> str:
        return f"{PROMPT} Answer for reader {distinct}-{i}." if distinct else PROMPT

    with ThreadPoolExecutor(n) as pool:
        runs = list(pool.map(lambda i: stream_once(client, model, tokens, i + 1, extra,
                                                   prompt(i)), range(n)))
    wall = max(r["end"] for r in runs) - min(r["start"] for r in runs)
    total = sum(r["tokens"] for r in runs)
    gaps = [g for r in runs for g in r["gaps"]]
    ttfts = [r["ttft"] for r in runs if r["ttft"] is not None]
    return {"streams": n, "tokens": total, "aggregate_tok_s": total / wall if wall else 0.0,
            "per_stream_tok_s": statistics.mean(r["tokens"] / max(1e-9, r["end"] - r["start"])
                                                for r in runs),
            "per_stream_decode_tok_s": statistics.mean(r["decode_tok_s"] for r in runs),
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:
            pass
        time.sleep(0.5)
    raise SystemExit(f"bench/serving.py: {what} did not come up within {timeout:.0f} s")


def load_engine(model: Path, threads: int) -> Any:
    """The engine in-process, as the worker loads it (the figure the API must not lower)."""
    from dsr1d.engine import llama_backend

    gen = llama_backend.load(model, threads=threads, context=1024)
    gen.generate(PROMPT, {"max_new_tokens": 8, "ignore_eos": True})     # warm
    return gen


def engine_rate(gen: Any, tokens: int, seed: int) -> float:
    """The engine's own decode tok/s, first token to last, as the API's streams count it."""
    stats = gen.generate(PROMPT, {"max_new_tokens": tokens, "ignore_eos": True,
                                  "seed": seed}).stats
    return float(stats["decode_tokens_per_s"])


def ceiling_child(model: Path, threads: int) -> None:
    """In this process (started with the worker's environment): a `Batcher`'s step at 1 and at 4
    rows, sampled as the streams are (temperature 0.6), medians; prints them as JSON."""
    from dsr1d.engine.llama_backend import load
    from dsr1d.engine.llama_batch import Batcher

    batcher = Batcher(load(model, threads=threads, context=1024, parallel=4), 4)
    out: dict[str, float] = {}
    for rows in (1, 4):
        for i in range(rows):
            batcher.admit(i, f"{PROMPT} Answer for reader {i}.",
                          {"max_new_tokens": CEILING_STEPS, "temperature": 0.6, "seed": i + 1,
                           "ignore_eos": True}, None, lambda: False)
        times = []
        while batcher.active:
            full = len(batcher.active) == rows
            start = time.perf_counter()
            batcher.step()
            if full:
                times.append(time.perf_counter() - start)
        out[f"step_{rows}_s"] = statistics.median(times[3:])
    print(json.dumps(out))


def kernel_ceiling(model: Path, threads: int) -> dict[str, float]:
    """What 4 streams can gain over one whatever the API does: the engine's own 1-row and 4-row
    steps, in a child with the worker's environment (weights in huge pages, as served)."""
    from dsr1d.edges.engine_host import worker_environment

    child = subprocess.run([sys.executable, __file__, "--ceiling-child", "--model", str(model),
                            "--threads", str(threads)], env=worker_environment(),
                           capture_output=True, text=True, check=True)
    out = json.loads(child.stdout.splitlines()[-1])
    out["ceiling_at_4"] = 4 * out["step_1_s"] / out["step_4_s"]
    return out


def single_pairs(gen: Any, client: Any, model: str, tokens: int) -> dict[str, Any]:
    """One stream in-process, then one through the API, PAIRS times: this VM's neighbours move
    either figure by more than the API costs, so the two are compared as medians."""
    engine, api = [], []
    for i in range(PAIRS):
        engine.append(engine_rate(gen, tokens, i + 1))
        api.append(stream_once(client, model, tokens, i + 1, OURS)["decode_tok_s"])
    return {"engine_tok_s": engine, "api_tok_s": api,
            "engine_median": statistics.median(engine), "api_median": statistics.median(api)}


def run_dsr1d(model: Path, threads: int, tokens: int, tmp: Path, gen: Any) -> dict[str, Any]:
    import httpx
    import openai

    sys.path.insert(0, str(REPO / "tests"))
    from harness.privbus import PrivateBus

    profiles = tmp / "profiles"
    profiles.mkdir()
    (profiles / "idle.conf").write_text("[main]\nsummary = changes nothing\n")
    sock = tmp / "api.sock"
    conf = tmp / "dsr1d.conf"
    conf.write_text(f"[daemon]\ndefault_profile = idle\nengine_profile = idle\nmodel = {model}\n"
                    f"engine_threads = {threads}\nengine_parallel = 8\nengine_context = 1024\n"
                    f"[api]\nsocket = {sock}\nqueue = 16\n")
    out: dict[str, Any] = {}
    with PrivateBus([REPO / "etc/dbus-1/system.d/org.dsr1d.conf"]) as bus:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsr1d.edges.admin", "run", "--config", str(conf),
             "--bus-address", bus.address, "--journal", f"{tmp}/state.json", "--profiles-dir",
             str(profiles)], stderr=subprocess.DEVNULL)
        try:
            http = httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), timeout=600)
            wait_for(lambda: http.get("http://dsr1d/health").status_code == 200, 300,
                     "dsr1d's API")
            client = openai.OpenAI(api_key="-", base_url="http://dsr1d/v1", http_client=http,
                                   max_retries=0)
            model_id = client.models.list().data[0].id
            stream_once(client, model_id, 8, 0, OURS)                         # warm
            for n in LEVELS:
                out[n] = level(client, model_id, n, tokens, OURS)
                print(f"  dsr1d     {n} stream(s): {out[n]['aggregate_tok_s']:.2f} tok/s",
                      flush=True)
            out["4 distinct"] = level(client, model_id, 4, tokens, OURS, distinct="ours")
            out["health"] = health_under_load(http, client, model_id, tokens)
            out["single"] = single_pairs(gen, client, model_id, tokens)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    return out


def health_under_load(http: Any, client: Any, model: str, tokens: int) -> dict[str, Any]:
    """1,000 /health calls while 4 streams decode."""
    latencies: list[float] = []

    def poll() -> None:
        for _ in range(1000):
            t = time.perf_counter()
            http.get("http://dsr1d/health")
            latencies.append(time.perf_counter() - t)

    streams = threading.Thread(target=level, args=(client, model, 4, tokens, OURS))
    streams.start()
    time.sleep(1.0)
    poll()
    streams.join()
    return {"calls": len(latencies), "p50_ms": pct(latencies, 50) * 1000,
            "p99_ms": pct(latencies, 99) * 1000}


def run_peer(model: Path, threads: int, tokens: int, *flags: str) -> dict[str, Any]:
    import openai

    from dsr1d.engine.gguf_file import inspect_gguf

    # No ignore_eos there: the OpenAI way, a bias that bars the end-of-sequence token.
    eos = inspect_gguf(model).eos_id
    extra = {"logit_bias": {str(eos): -100}} if eos is not None else {}
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "llama_cpp.server", "--model", str(model),
                             "--n_threads", str(threads), "--n_ctx", "2048", "--host",
                             "127.0.0.1", "--port", str(port), *flags],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out: dict[str, Any] = {}
    try:
        client = openai.OpenAI(api_key="-", base_url=f"http://127.0.0.1:{port}/v1",
                               max_retries=0, timeout=1800)
        wait_for(lambda: client.models.list() is not None, 300, "llama_cpp.server")
        model_id = client.models.list().data[0].id
        stream_once(client, model_id, 8, 0, extra)
        for n in LEVELS:
            out[n] = level(client, model_id, n, tokens, extra)
            print(f"  llama_cpp.server {' '.join(flags)} {n} stream(s): "
                  f"{out[n]['aggregate_tok_s']:.2f} tok/s", flush=True)
        out["4 distinct"] = level(client, model_id, 4, tokens, extra, distinct="peer")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2)))
    ap.add_argument("--ceiling-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ceiling_child:
        ceiling_child(args.model, args.threads)
        return
    if not args.model.is_file():
        raise SystemExit(f"bench/serving.py: no {args.model}: run bench/inference.py once to "
                         "write the synthetic 1.5B model's GGUFs, or pass --model")
    print(f"model {args.model.name}, {args.threads} threads, {args.tokens} tokens a stream")
    ceiling = kernel_ceiling(args.model, args.threads)
    print(f"  in process, as the worker runs: a step of 1 row "
          f"{ceiling['step_1_s'] * 1000:.1f} ms, of 4 rows {ceiling['step_4_s'] * 1000:.1f} ms: "
          f"4 streams gain at most {ceiling['ceiling_at_4']:.2f}x over one", flush=True)
    gen = load_engine(args.model, args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        ours = run_dsr1d(args.model, args.threads, args.tokens, Path(tmp), gen)
    del gen
    peer = run_peer(args.model, args.threads, args.tokens)
    # as one would run it for several users: each request runs to its end, one at a time
    queued = run_peer(args.model, args.threads, args.tokens, "--interrupt_requests", "False")

    print(f"\n{'server':18} {'streams':>7} {'tokens':>6} {'agg tok/s':>9} {'per-stream':>10} "
          f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}")
    for name, runs in (("dsr1d", ours), ("llama_cpp.server", peer),
                       ("  no interrupts", queued)):
        for n in (*LEVELS, "4 distinct"):
            r = runs[n]
            print(f"{name:18} {n!s:>7} {r['tokens']:6d} {r['aggregate_tok_s']:9.2f} "
                  f"{r['per_stream_decode_tok_s']:10.2f} "
                  f"{r['ttft_p50_s'] * 1000:7.0f}ms {r['ttft_p99_s'] * 1000:7.0f}ms "
                  f"{r['itl_p50_s'] * 1000:6.1f}ms {r['itl_p99_s'] * 1000:6.1f}ms")
    single, engine = ours["single"]["api_median"], ours["single"]["engine_median"]
    h = ours["health"]
    targets = {
        "aggregate_at_4_ge_2.5x_single": ours[4]["aggregate_tok_s"] >= 2.5 * ours[1]["aggregate_tok_s"],
        "aggregate_at_4_ge_2x_peer": ours[4]["aggregate_tok_s"] >= 2 * peer[4]["aggregate_tok_s"],
        "ttft_p50_at_4_le_peer": ours[4]["ttft_p50_s"] <= peer[4]["ttft_p50_s"],
        "single_stream_within_3_percent_of_engine": single >= 0.97 * engine,
    }
    print(f"\nsingle stream through the API {single:.2f} tok/s vs the engine's {engine:.2f} "
          f"in-process ({single / engine:.3f}x; medians of {PAIRS} interleaved pairs: API "
          f"{', '.join(f'{x:.2f}' for x in ours['single']['api_tok_s'])}, engine "
          f"{', '.join(f'{x:.2f}' for x in ours['single']['engine_tok_s'])}); "
          f"/health while 4 streams decode: {h['calls']} calls, p50 "
          f"{h['p50_ms']:.2f} ms, p99 {h['p99_ms']:.2f} ms")
    print(f"at 4 streams: {ours[4]['aggregate_tok_s'] / ours[1]['aggregate_tok_s']:.2f}x our "
          f"single stream (the engine's steps allow {ceiling['ceiling_at_4']:.2f}x), "
          f"{ours[4]['aggregate_tok_s'] / peer[4]['aggregate_tok_s']:.2f}x the "
          f"peer's ({ours[4]['aggregate_tok_s'] / queued[4]['aggregate_tok_s']:.2f}x without "
          f"interrupts); TTFT p50 at 4 streams {ours[4]['ttft_p50_s'] * 1000:.0f} ms vs "
          f"{peer[4]['ttft_p50_s'] * 1000:.0f} ms ({queued[4]['ttft_p50_s'] * 1000:.0f} ms "
          f"without interrupts); 4 distinct prompts: TTFT p50 "
          f"{ours['4 distinct']['ttft_p50_s'] * 1000:.0f} ms vs "
          f"{peer['4 distinct']['ttft_p50_s'] * 1000:.0f} ms")
    for name, ok in targets.items():
        print(f"target {name}: {'met' if ok else 'MISSED'}")
    print(json.dumps({"engine_tok_s": engine, "ceiling": ceiling, "dsr1d": ours, "peer": peer,
                      "peer_no_interrupts": queued, "targets": targets},
                     indent=1, default=str))


if __name__ == "__main__":
    main()
