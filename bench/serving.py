"""Serving, side by side in one run: dsr1d's API, the llama-server it runs reached directly on
its private socket, and llama-server built from the llama.cpp release (the bench's stock build:
the same source with only the AMX tile fix it needs to run on AMX CPUs).

Same GGUF, same threads, the ``openai`` client, 1, 4 and 8 streams of distinct prompts, 128
tokens each (``ignore_eos``, greedy), one level at a time and one server at a time (nothing else
runs while one is timed); each level ``--rounds`` times (3), dsr1d's API and its server taking
turns in alternating order, every request a prompt no server has seen; the median round.
Printed per server and level: aggregate tok/s, time to first token
p50/p99, inter-token latency p50/p99; then the ratios the serving targets are about: dsr1d ÷
its own llama-server (the front's cost), dsr1d ÷ the release's server, 4 streams ÷ 1.

    python bench/serving.py --model MODEL.gguf [--streams 1,4,8] [--tokens 128] [--threads N]
                            [--write docs/benchmarks.md]

The release's llama-server is built once by ``DSR1D_LLAMA_PATCHES=amx-tile-config
tools/llama-server.sh`` (about as long as set-up's own build; cached). ``--no-release`` skips
it. A 1.5B R1 shape in int4, as the figures in docs use: ``dsr1d model synth --preset 1.5b
--gguf int4 /var/tmp/r1-1.5b`` (the file in that folder).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from results import add_write_option, write

REPO = Path(__file__).resolve().parent.parent
TOPICS = ["the sea", "a lighthouse", "bread", "winter", "a clock", "rivers", "a library",
          "bees", "the moon", "copper", "trains", "salt", "glass", "owls", "maps", "rain"]


def _client(sock: str) -> Any:
    import httpx
    import openai

    http = httpx.Client(transport=httpx.HTTPTransport(uds=sock), timeout=600)
    return openai.OpenAI(api_key="-", base_url="http://bench/v1", http_client=http,
                         max_retries=0)


def one_stream(client: Any, model: str, prompt: str, tokens: int) -> dict[str, Any]:
    """One streamed request: its tokens, first-token time and gaps between chunks."""
    start = time.perf_counter()
    stamps: list[float] = []
    usage = None
    with client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], stream=True,
            max_tokens=tokens, temperature=0, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True}) as stream:
        for chunk in stream:
            usage = chunk.usage or usage
            if any((c.delta.content or (c.delta.model_extra or {}).get("reasoning_content"))
                   for c in chunk.choices):
                stamps.append(time.perf_counter())
    return {"start": start, "stamps": stamps,
            "tokens": usage.completion_tokens if usage else len(stamps)}


def level(sock: str, model: str, streams: int, tokens: int, offset: int) -> dict[str, float]:
    """``streams`` requests at once; aggregate tok/s and the latency percentiles."""
    client = _client(sock)
    results: list[dict[str, Any]] = [{}] * streams

    def run(i: int) -> None:
        topic = TOPICS[(offset + i) % len(TOPICS)]
        results[i] = one_stream(client, model, f"Write a long essay about {topic}.", tokens)

    workers = [threading.Thread(target=run, args=(i,)) for i in range(streams)]
    began = time.perf_counter()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    wall = time.perf_counter() - began
    ttft = [r["stamps"][0] - r["start"] for r in results if r["stamps"]]
    gaps = [b - a for r in results for a, b in zip(r["stamps"], r["stamps"][1:])]
    return {"tok_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50": _pct(ttft, 50), "ttft_p99": _pct(ttft, 99),
            "itl_p50": _pct(gaps, 50), "itl_p99": _pct(gaps, 99)}


def _pct(values: list[float], q: int) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))] * 1000


@contextmanager
def dsr1d_daemon(model: Path, threads: int, parallel: int, context: int,
                 work: Path) -> Iterator[tuple[str, str, int]]:
    """The real daemon on a private bus: (its API socket, its llama-server's socket, its pid)."""
    sys.path.insert(0, str(REPO / "tests"))
    from harness.privbus import PrivateBus

    profiles = work / "profiles"
    profiles.mkdir()
    (profiles / "idle.conf").write_text("[main]\nsummary = changes nothing\n")
    conf = work / "dsr1d.conf"
    api = work / "api.sock"
    conf.write_text(f"[daemon]\ndefault_profile = idle\nengine_profile = idle\nmodel = {model}\n"
                    f"engine_threads = {threads}\nengine_parallel = {parallel}\n"
                    f"engine_context = {context}\nengine_cache_dir = {work / 'cache'}\n"
                    f"[api]\nsocket = {api}\n")
    with PrivateBus([REPO / "etc/dbus-1/system.d/org.dsr1d.conf"]) as bus:
        log = open(work / "daemon.log", "w")
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsr1d.edges.admin", "run", "--config", str(conf),
             "--bus-address", bus.address, "--journal", str(work / "state.json"),
             "--profiles-dir", str(profiles)], stderr=log)
        try:
            engine = _wait_for_server(proc.pid, api, work / "daemon.log")
            yield str(api), engine, proc.pid
        finally:
            proc.terminate()
            proc.wait(timeout=60)
            log.close()


def _wait_for_server(pid: int, api: Path, log: Path, timeout: float = 600) -> str:
    import httpx
    import psutil

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(pid).children(recursive=True):
            if child.name() == "llama-server" and api.exists():
                cmd = child.cmdline()
                sock = cmd[cmd.index("--host") + 1]
                try:
                    with httpx.Client(transport=httpx.HTTPTransport(uds=str(api))) as c:
                        if c.get("http://bench/health").status_code == 200:
                            return sock
                except httpx.TransportError:
                    pass
        time.sleep(0.2)
    raise RuntimeError(f"the daemon's engine did not come up:\n{log.read_text()[-3000:]}")


@contextmanager
def release_server(model: Path, threads: int, parallel: int, context: int,
                   work: Path) -> Iterator[str]:
    """llama-server built from the release, with its defaults plus threads, slots, context."""
    env = dict(os.environ, DSR1D_LLAMA_PATCHES="amx-tile-config")
    binary = subprocess.run([str(REPO / "tools/llama-server.sh"), sys.executable], env=env,
                            check=True, capture_output=True, text=True).stdout.strip()
    sock = work / "release.sock"
    with open(work / "release.log", "w") as log:
        proc = subprocess.Popen([binary, "-m", str(model), "--host", str(sock), "--port", "1",
                                 "-t", str(threads), "-np", str(parallel),
                                 "-c", str(context * parallel), "--jinja"],
                                stdout=log, stderr=log)
        try:
            _wait_health(str(sock))
            yield str(sock)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def _wait_health(sock: str, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with httpx.Client(transport=httpx.HTTPTransport(uds=sock)) as c:
                if c.get("http://bench/health").status_code == 200:
                    return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"llama-server on {sock} did not come up")


def measure(servers: dict[str, str], model: str, levels: list[int], tokens: int,
            rounds: int, cpu: Callable[[], float] = lambda: 0.0) -> dict[str, dict[int, dict]]:
    """Each level ``rounds`` times, the servers taking turns in alternating order, every
    request a prompt no server has seen (no prompt-cache hits); the median round of each.
    ``cpu()``: the daemon's CPU seconds so far, summed per server over its rounds."""
    for sock in servers.values():
        level(sock, model, 1, 8, 0)      # warm-up: first-request costs are not the steady state
    samples: dict[str, dict[int, list[dict]]] = {name: {n: [] for n in levels}
                                                 for name in servers}
    offset = 1
    for n in levels:
        for r in range(rounds):
            order = list(servers.items())[::1 if r % 2 == 0 else -1]
            for name, sock in order:
                before = cpu()
                figures = level(sock, model, n, tokens, offset)
                figures["daemon_cpu_s"] = cpu() - before
                samples[name][n].append(figures)
                offset += n
    return {name: {n: _median_round(runs) for n, runs in by_level.items()}
            for name, by_level in samples.items()}


def _median_round(runs: list[dict]) -> dict:
    ordered = sorted(runs, key=lambda f: f["tok_s"])
    return {**ordered[len(ordered) // 2], "tok_s_all": [round(f["tok_s"], 1) for f in runs],
            "daemon_cpu_s": sum(f["daemon_cpu_s"] for f in runs)}


def machine() -> str:
    flags = Path("/proc/cpuinfo").read_text().split("flags", 1)[1].split("\n", 1)[0].split()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_int8") if f in flags]
    model = next((line.split(":", 1)[1].strip() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
                 platform.processor())
    return f"{model}, {os.cpu_count()} CPUs ({' '.join(isa)})"


def report(rows: dict[str, dict[int, dict]], levels: list[int]) -> tuple[list[str], list[str]]:
    """The table's lines and the figures under it: the front's cost (the median rounds' ratio,
    and each round's, the two taking turns within it) and the ratio to the release."""
    table = ["| server | streams | tok/s (median; every round) | TTFT p50 / p99 ms | "
             "ITL p50 / p99 ms |", "|---|---|---|---|---|"]
    for server, by_level in rows.items():
        for n, f in by_level.items():
            table.append(f"| {server} | {n} | {f['tok_s']:.1f} "
                         f"({', '.join(map(str, f['tok_s_all']))}) | {f['ttft_p50']:.0f} / "
                         f"{f['ttft_p99']:.0f} | {f['itl_p50']:.1f} / {f['itl_p99']:.1f} |")
    ours = rows["dsr1d API"]
    notes = []
    for n in levels:
        line = f"{n} stream(s): dsr1d / its llama-server " \
               f"{ours[n]['tok_s'] / rows['its llama-server'][n]['tok_s']:.3f} (target >= 0.98)"
        if "release llama-server" in rows:
            line += f", dsr1d / release {ours[n]['tok_s'] / rows['release llama-server'][n]['tok_s']:.3f}" \
                    f" (target >= 1.0)"
        notes.append(line)
        rounds = [a / b for a, b in zip(ours[n]["tok_s_all"],
                                        rows["its llama-server"][n]["tok_s_all"])]
        if len(rounds) > 1:
            notes.append(f"{n} stream(s), dsr1d / its llama-server round by round (the two "
                         f"take turns within a round): {', '.join(f'{r:.3f}' for r in rounds)}, "
                         f"median {statistics.median(rounds):.3f}")
    front = sum(f["daemon_cpu_s"] for f in ours.values())
    direct = sum(f["daemon_cpu_s"] for f in rows["its llama-server"].values())
    notes.append(f"the daemon's CPU while its API served: {front:.2f} s; while its llama-server "
                 f"was reached directly: {direct:.2f} s (all rounds of all levels)")
    if 1 in ours and 4 in ours:
        notes.append(f"dsr1d 4 streams / 1: {ours[4]['tok_s'] / ours[1]['tok_s']:.2f} "
                     f"(target >= 2.5)")
    return table, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a GGUF file")
    parser.add_argument("--streams", default="1,4,8")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="0: one per physical core")
    parser.add_argument("--context", type=int, default=1024, help="tokens a slot may use")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per level (median)")
    parser.add_argument("--no-release", action="store_true")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    add_write_option(parser)
    args = parser.parse_args()
    import psutil

    threads = args.threads or psutil.cpu_count(logical=False) or 1
    levels = [int(n) for n in args.streams.split(",")]
    name = args.model.stem
    about = f"{args.model.name}, {threads} threads, {args.tokens} tokens a request, greedy"
    print(f"# serving, {time.strftime('%Y-%m-%d %H:%M')}, {machine()}\n# {about}")
    rows: dict[str, dict[int, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="dsr1d-bench-") as tmp:
        work = Path(tmp)
        with dsr1d_daemon(args.model.resolve(), threads, max(levels), args.context,
                          work) as (api, engine, pid):
            daemon = psutil.Process(pid)
            rows.update(measure({"dsr1d API": api, "its llama-server": engine}, name, levels,
                                args.tokens, args.rounds,
                                lambda: sum(daemon.cpu_times()[:2])))
        if not args.no_release:
            with release_server(args.model.resolve(), threads, max(levels), args.context,
                                work) as sock:
                rows.update(measure({"release llama-server": sock}, name, levels, args.tokens,
                                    args.rounds))
    table, notes = report(rows, levels)
    print("\n" + "\n".join(table) + "\n\n" + "\n".join(notes))
    write(args.write, "serving", f"{about}:\n\n" + "\n".join(table) + "\n\n"
          + "\n".join(f"- {note}" for note in notes))
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "model": str(args.model),
                                         "threads": threads, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
