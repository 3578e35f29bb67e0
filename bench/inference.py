"""Decode and prefill of the files people download, served: dsr1d against the llama.cpp release and
ik_llama.cpp, with the roofline.

Rows, each a llama-server as its users run it, on the same threads:

- ``release``: llama-server built from the release (llama-cpp-python's vendored llama.cpp with
  only ``amx-tile-config``, without which it dies on an AMX CPU: ``DSR1D_LLAMA_PATCHES=
  amx-tile-config tools/llama-server.sh``), its defaults (the file memory-mapped).
- ``ik -rtr``: ik_llama.cpp's llama-server (``tools/ik-llama-server.sh``, built the same way) with
  its run-time repack ``-rtr``, as its users run it on CPU.
- ``dsr1d``: dsr1d's llama-server with the arguments and environment the daemon gives it
  (``engine_command``: weights read into memory with huge pages, threads pinned one per core;
  flash attention on or off as the daemon's calibration measures it per file, before anything
  is timed: about two minutes a file the first time, cached in
  ``/var/tmp/dsr1d-bench/calibration``).

Files: random weights in the R1-Distill-Qwen shape (``--preset``) with the real R1 tokenizer, one
per file type (``--types``), in the tensor mix llama-quantize gives that type, written by
``bench/random_gguf.py`` into ``/var/tmp/dsr1d-bench/inference/`` before anything is timed.

Per file, round after round (``--rounds``; the rows' order turns each round), the memory read
bandwidth is probed (summing 1 GiB with the same threads), then each row starts its own server,
is warmed up, and measures prefill (``--prompt`` tokens, one request, ``prompt_per_second``) and
decode (``--tokens`` tokens after each of ``--depths`` tokens of context, ``predicted_per_second``;
fewer tokens than asked is a failure), greedy, no prompt cache. A shared VM's bandwidth drifts by
tens of per cent within minutes, so ratios are paired: dsr1d ÷ the best peer (by median) within
each round, then the median of those; the roofline is each round's probe ÷ the bytes a decoded
token reads (the file's tensors but ``token_embd``, a row lookup), dsr1d's fraction of it paired
the same way. Targets (issue 27): decode ≥ 1.10× the best peer for Q4_K_M, Q8_0 and Q4_0 and ≥ 0.90 of
the roofline (both meant at 16 cores), prompt ≥ the best peer; a missed one is printed as missed.
It never fails: it reports. A peer that cannot be built or started is reported and left out.

    .venv/bin/python bench/inference.py [--preset 1.5b|7b] [--types Q4_K_M,Q8_0,...]
        [--depths 0,4096] [--prompt 128] [--tokens 64] [--rounds 2] [--threads N]
        [--rows release,ik -rtr,dsr1d] [--write docs/benchmarks.md [--block inference-amx]]

``--write`` fills the ``inference`` block, or ``inference-amx`` on a CPU with AMX.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import random_gguf
from results import add_write_option, machine, markdown_table, write

REPO = Path(__file__).resolve().parent.parent
FILES = Path("/var/tmp/dsr1d-bench/inference")
CALIBRATION = FILES.parent / "calibration"   # the daemon's flash-attention choices, per file
ROWS = ("release", "ik -rtr", "dsr1d")
TYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q8_0", "IQ4_XS", "Q4_0", "BF16")
DECODE_TARGET_TYPES = ("Q4_K_M", "Q8_0", "Q4_0")
# docs/benchmarks.md's tables without AMX and with it; docs/engine.md's deep in a context (on
# the AMX VM, and on a CPU with AVX-512 but no AMX)
BLOCKS = ("inference", "inference-amx", "inference-depth", "inference-16k",
          "inference-depth-avx512")


@dataclass
class Server:
    """One llama-server process and how to reach it."""

    proc: subprocess.Popen[bytes]
    client: httpx.Client
    log: Path

    def stop(self) -> None:
        self.client.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def build(script: str, env: dict[str, str] | None = None) -> Path:
    """The binary a tools/ build script prints (building it first if not cached)."""
    out = subprocess.run([str(REPO / "tools" / script), sys.executable], env=env, text=True,
                         stdout=subprocess.PIPE, check=True).stdout
    return Path(out.strip().splitlines()[-1])


def binaries(rows: list[str]) -> dict[str, Path]:
    """Each row's llama-server; a peer that does not build is reported and left out."""
    from dsr1d.edges import engine_command

    found: dict[str, Path] = {}
    for row in rows:
        try:
            if row == "release":
                found[row] = build("llama-server.sh",
                                   dict(os.environ, DSR1D_LLAMA_PATCHES="amx-tile-config"))
            elif row == "ik -rtr":
                found[row] = build("ik-llama-server.sh")
            else:
                binary = engine_command.find_binary()
                if binary is None:
                    raise FileNotFoundError("no dsr1d llama-server: run make setup")
                found[row] = binary
        except (subprocess.CalledProcessError, OSError) as exc:
            print(f"{row}: left out, its server did not build ({exc})", file=sys.stderr)
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def daemon_attention(binary: Path, files: dict[str, Path],
                     threads: int) -> dict[str, tuple[str, str]]:
    """Per file, flash attention and the KV cache's type as the daemon chooses them with its
    defaults (``engine_flash_attn = auto``, ``engine_kv_type = auto``): measured once per file,
    build, threads and CPU by the daemon's own calibration, and kept in ``CALIBRATION`` as the
    daemon keeps it in its cache."""
    from dsr1d.edges import engine_calibrate, engine_command

    CALIBRATION.mkdir(parents=True, exist_ok=True)
    measured = engine_calibrate.candidates("auto", "auto")
    choice = {}
    with tempfile.TemporaryDirectory() as tmp:
        for ftype, gguf in files.items():
            spec = engine_command.ServerSpec(gguf, Path(tmp) / "llama.sock", threads,
                                             engine_calibrate.DEPTH + 64,
                                             cpus=placed_cpus(threads))
            pick, why = asyncio.run(engine_calibrate.attention(spec, binary, CALIBRATION,
                                                               measured))
            print(f"dsr1d {ftype}: {engine_calibrate.label(pick)}: {why}", file=sys.stderr,
                  flush=True)
            choice[ftype] = pick
    return choice


def command(row: str, binary: Path, gguf: Path, threads: int, context: int,
            tmp: Path, attention: tuple[str, str] = ("", "f16"),
            ) -> tuple[list[str], dict[str, str], httpx.Client]:
    """The row's command line, environment and a client for it."""
    from dsr1d.edges import engine_command

    if row == "dsr1d":
        sock = tmp / "llama.sock"
        spec = engine_command.ServerSpec(gguf, sock, threads, context, cpus=placed_cpus(threads),
                                         flash_attn=attention[0], kv_type=attention[1])
        return ([str(binary), *engine_command.arguments(spec)], engine_command.environment(),
                unix_client(sock))
    if row == "release":
        sock = tmp / "llama.sock"
        return ([str(binary), "--model", str(gguf), "--host", str(sock), "--threads",
                 str(threads), "--ctx-size", str(context), "--parallel", "1", "--no-webui"],
                dict(os.environ), unix_client(sock))
    port = free_port()   # ik's server listens on TCP only
    return ([str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
             "--threads", str(threads), "--ctx-size", str(context), "--parallel", "1", "-rtr"],
            dict(os.environ), httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=3600))


def unix_client(sock: Path) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://s",
                        timeout=3600)


def placed_cpus(threads: int) -> list[int]:
    """The daemon's placement: one CPU per physical core of one node, pinned."""
    from dsr1d.contract.sysroot import SysRoot
    from dsr1d.core.placement import plan, read_topology

    return plan(read_topology(SysRoot("/")), None, threads, sorted(os.sched_getaffinity(0))).cpus


def start(row: str, binary: Path, gguf: Path, threads: int, context: int, tmp: Path,
          attention: tuple[str, str] = ("", "f16")) -> Server:
    """Start the row's server and wait until it answers; raises with its log's end if it dies."""
    argv, env, client = command(row, binary, gguf, threads, context, tmp, attention)
    log = tmp / "server.log"
    with log.open("wb") as out:
        # in the row's own folder: ik's server writes a llama.log into its working directory
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=tmp)
    server = Server(proc, client, log)
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"{row} exited with status {proc.returncode}:\n{tail}")
        try:
            if client.get("/health").status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.2)


def prompt_ids(n: int, seed: int) -> list[int]:
    """``n`` token ids from the middle of the vocabulary, different per seed (no cache reuse)."""
    return [1000 + (i * 7919 + seed * 104729) % 50000 for i in range(max(1, n))]


def complete(server: Server, prompt: list[int], tokens: int) -> dict[str, float]:
    body = {"prompt": prompt, "n_predict": tokens, "ignore_eos": True, "temperature": 0,
            "cache_prompt": False}
    reply = server.client.post("/completion", json=body)
    reply.raise_for_status()
    timings = reply.json()["timings"]
    if timings.get("predicted_n", tokens) != tokens:   # a short answer is no decode figure
        raise RuntimeError(f"asked for {tokens} tokens, got {timings.get('predicted_n')}")
    return timings


def measure(server: Server, prompt: int, tokens: int, depths: list[int],
            seed: int) -> dict[str, float]:
    """Prefill and decode at each depth, after a warm-up (first-touch page faults are no row's
    figure)."""
    complete(server, prompt_ids(8, seed + 99), 8)
    figures = {"prompt": complete(server, prompt_ids(prompt, seed), 1)["prompt_per_second"]}
    for depth in depths:
        timings = complete(server, prompt_ids(depth, seed + 1 + depth), tokens)
        figures[f"decode@{depth}"] = timings["predicted_per_second"]
    return figures


def read_bytes_per_token(gguf: Path) -> int:
    """Tensor bytes a decoded token reads: all but ``token_embd`` (a row lookup)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(gguf).tensors if t.name != "token_embd.weight")


def memory_bandwidth(threads: int) -> float:
    """Best-of-5 read bandwidth in bytes/s: summing a 1 GiB tensor with ``threads`` threads."""
    import torch

    torch.set_num_threads(threads)
    data = torch.ones(256 * 1024 * 1024, dtype=torch.float32)
    data.sum()
    best = float("inf")
    for _ in range(5):
        begin = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - begin)
    return data.numel() * 4 / best


def ensure_files(preset: str, types: list[str]) -> dict[str, Path]:
    FILES.mkdir(parents=True, exist_ok=True)
    paths = {}
    for ftype in types:
        path = FILES / f"r1-{preset}-{ftype}.gguf"
        if not path.exists():
            print(f"writing {path}", file=sys.stderr, flush=True)
            random_gguf.write(preset, ftype, path)
        paths[ftype] = path
    return paths


Samples = dict[str, dict[str, dict[str, dict[int, float]]]]


def run(args: argparse.Namespace, files: dict[str, Path], bins: dict[str, Path],
        depths: list[int], attention: dict[str, tuple[str, str]]
        ) -> tuple[Samples, dict[str, dict[int, float]]]:
    """samples[type][row][metric][round], and bandwidth[type][round] probed just before that
    file's round; a row that fails on a file is reported and has no sample for that round."""
    context = max(depths) + args.tokens + args.prompt + 64
    rows = list(bins)
    samples: Samples = {}
    bandwidth: dict[str, dict[int, float]] = {}
    for n in range(args.rounds):
        for ftype, gguf in files.items():
            bandwidth.setdefault(ftype, {})[n] = memory_bandwidth(args.threads)
            order = rows[n % len(rows):] + rows[:n % len(rows)]
            for row in order:
                with tempfile.TemporaryDirectory() as tmp:
                    try:
                        server = start(row, bins[row], gguf, args.threads, context, Path(tmp),
                                       attention.get(ftype, ("", "f16")))
                    except RuntimeError as exc:
                        print(f"{ftype} {row}: did not start: {exc}", file=sys.stderr)
                        continue
                    try:
                        figures = measure(server, args.prompt, args.tokens, depths, n)
                    except (httpx.HTTPError, KeyError, RuntimeError) as exc:
                        print(f"{ftype} {row}: failed: {exc}", file=sys.stderr)
                        continue
                    finally:
                        server.stop()
                for metric, value in figures.items():
                    samples.setdefault(ftype, {}).setdefault(row, {}).setdefault(
                        metric, {})[n] = value
                print(f"round {n + 1} {ftype} {row}: " + ", ".join(
                    f"{k} {v:.2f}" for k, v in figures.items()), file=sys.stderr, flush=True)
    return samples, bandwidth


def paired(numerator: dict[int, float], denominator: dict[int, float]) -> float | None:
    """Median over the rounds both have of numerator ÷ denominator."""
    both = sorted(set(numerator) & set(denominator))
    return statistics.median(numerator[n] / denominator[n] for n in both) if both else None


def summarize(samples: Samples, files: dict[str, Path],
              bandwidth: dict[str, dict[int, float]]) -> list[dict[str, object]]:
    """One record per file type and metric: medians, dsr1d ÷ best peer and dsr1d's fraction of
    the roofline (both paired per round)."""
    records: list[dict[str, object]] = []
    for ftype, rows in samples.items():
        per_token = read_bytes_per_token(files[ftype])
        roof = {n: b / per_token for n, b in bandwidth[ftype].items()}
        metrics = sorted({m for r in rows.values() for m in r}, key=metric_order)
        for metric in metrics:
            med = {row: statistics.median(v[metric].values())
                   for row, v in rows.items() if metric in v}
            # "dsr1d all" (bench/server_scale.py) is dsr1d's other setting, not a peer
            peers = {row: v for row, v in med.items() if not row.startswith("dsr1d")}
            best = max(peers, key=peers.__getitem__) if peers else None
            ours = rows.get("dsr1d", {}).get(metric, {})
            ratio = paired(ours, rows[best][metric]) if best else None
            record: dict[str, object] = {"type": ftype, "metric": metric, "tok_s": med,
                                         "best_peer": best, "vs_best_peer": ratio}
            if metric.startswith("decode"):
                record["roofline_tok_s"] = statistics.median(roof.values())
                record["of_roofline"] = paired(ours, roof)
            record["verdict"] = verdict(ftype, metric, ratio, record.get("of_roofline"))
            records.append(record)
    return records


def metric_order(metric: str) -> tuple[int, int]:
    return (0, 0) if metric == "prompt" else (1, int(metric.split("@")[1]))


def verdict(ftype: str, metric: str, ratio: float | None, of_roof: object) -> str:
    """The issue's targets for this figure: met, or missed with what missed it."""
    if ratio is None:
        return "no peer or no dsr1d figure"
    missed = []
    if metric == "prompt" and ratio < 1.0:
        missed.append("prompt < best peer")
    if metric.startswith("decode"):
        if ftype in DECODE_TARGET_TYPES and ratio < 1.10:
            missed.append("decode < 1.10x best peer")
        elif ratio < 1.0:
            missed.append("decode < best peer")
        if isinstance(of_roof, float) and of_roof < 0.90:
            missed.append("< 0.90 of roofline")
    return "met" if not missed else "missed: " + "; ".join(missed)


def table(records: list[dict[str, object]], rows: list[str]) -> str:
    def cell(value: object) -> str:
        return f"{value:.2f}" if isinstance(value, float) else "–"

    lines = []
    for r in records:
        tok_s = r["tok_s"]
        assert isinstance(tok_s, dict)
        of_roof = r.get("of_roofline")
        lines.append([r["type"], r["metric"]] + [cell(tok_s.get(row)) for row in rows]
                     + [f"{cell(r['vs_best_peer'])} ({r['best_peer'] or '–'})",
                        cell(r.get("roofline_tok_s")),
                        f"{of_roof:.2f}" if isinstance(of_roof, float) else "–", r["verdict"]])
    return markdown_table(["file", "tok/s"] + rows + ["dsr1d ÷ best peer", "roofline",
                                                      "dsr1d ÷ roofline", "targets"], lines)


def default_block() -> str:
    """The docs block for this CPU: amx/'s tiles keep Q4_0 and Q8_0 on an AMX CPU, so its figures
    get a table of their own."""
    return BLOCKS[1] if has_amx() else BLOCKS[0]


def has_amx() -> bool:
    from dsr1d.cpu import cpu_flags

    return "amx_int8" in cpu_flags()


def cpu_line() -> str:
    flags = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = " ".join(f for f in line.split(":", 1)[1].split()
                             if f.startswith(("avx512", "amx", "avx2", "avx_vnni")))
            break
    return f"{machine()}; {flags}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="1.5b", choices=["draft", "1.5b", "7b"])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--depths", default="0,4096")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rows", default=",".join(ROWS))
    add_write_option(parser)
    parser.add_argument("--block", choices=BLOCKS, default=None,
                        help="the block --write replaces (default: inference-amx on a CPU with "
                             "AMX, whose tiles keep some types, else inference; "
                             "inference-depth and inference-16k are docs/engine.md's)")
    args = parser.parse_args()
    types = [t for t in args.types.split(",") if t]
    unknown = [t for t in types if t not in random_gguf.FILE_TYPES]
    if unknown:
        parser.error(f"unknown file types {unknown}; known: {', '.join(random_gguf.FILE_TYPES)}")
    rows = [r for r in args.rows.split(",") if r]
    if set(rows) - set(ROWS):
        parser.error(f"unknown rows {sorted(set(rows) - set(ROWS))}; known: {', '.join(ROWS)}")
    depths = [int(d) for d in args.depths.split(",")]
    # everything is built and written before anything is timed
    bins = binaries(rows)
    files = ensure_files(args.preset, types)
    print(cpu_line())
    attention = daemon_attention(bins["dsr1d"], files, args.threads) if "dsr1d" in bins else {}
    samples, bandwidth = run(args, files, bins, depths, attention)
    probes = sorted(b / 1e9 for per_file in bandwidth.values() for b in per_file.values())
    band = (f"memory read bandwidth {statistics.median(probes):.1f} GB/s (median of "
            f"{len(probes)} probes, {probes[0]:.1f}–{probes[-1]:.1f})")
    print(f"{args.threads} threads; {band}")
    records = summarize(samples, files, bandwidth)
    present = [r for r in rows if r in bins]
    text = table(records, present)
    print(text)
    print(json.dumps(records))
    write(args.write, args.block or default_block(),
          f"{args.preset} R1 shape, random weights, {args.threads} threads, prefill of "
          f"{args.prompt} tokens, decode of {args.tokens} after each depth, median of "
          f"{args.rounds} interleaved rounds, ratios paired per round; {band}:\n\n" + text)


if __name__ == "__main__":
    main()
