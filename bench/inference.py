"""Decode speed of DeepSeek-R1-Distill-Qwen (synthetic weights) on this CPU: llama.cpp and torch.

One run prints this CPU's model and SIMD flags, llama.cpp's system info, the transparent-huge-page
mode and the machine's memory read bandwidth, then a table and JSON with one row per way of
running the model:

- ``stock-<p>``: stock llama.cpp as a user runs it — llama-cpp-python's ``Llama`` with its
  defaults (the file memory-mapped, no pinning, ``n_ctx`` 512 or what prompt + tokens need) and
  ``n_threads`` = physical cores; greedy ``Llama.generate(ids, temp=0)`` on the prompt's ids.
  Its llama.cpp is the release (``--stock released``, the default): the same llama-cpp-python
  version built for this CPU by tools/llama-wheel.sh without dsr1d's patches, except
  amx-tile-config on an AMX CPU (the release crashes there on its first prompt); built once
  (minutes) and installed into a folder of its own next to its wheel. ``--stock patched`` runs
  the stock rows on dsr1d's own build instead (what llama.cpp's defaults give with its kernels).
- ``served-<p>``: dsr1d's llama.cpp backend as the daemon serves it — an ``EngineHost`` and its
  worker process (weights read into anonymous memory with ``glibc.malloc.hugetlb=1`` so they get
  transparent huge pages, one thread pinned per physical core, the daemon's default context).
- ``torch-<dtype>``: dsr1d's torch engine (bf16, int8, int4; fp32 on request).
- ``baseline``: plain transformers fp32 ``generate``, as a new user runs it.

``<p>`` is a GGUF precision: bf16, q8_0, q4_0 (f32 on request). The GGUFs are converted once from
the synthesized model directory into ``<model>/bench-<p>.gguf`` (reused while newer than
config.json and of the converter's current layout). Rows of one precision (stock, served and
the matching torch row: bf16 with bf16, int8 with Q8_0, int4 with Q4_0; baseline and fp32
together) are loaded side by side, each in its
own process so that its peak RSS is its own, warmed up once, then measured interleaved: run ``i``
starts at the ``i``-th row of the group (stock, served, … then served, …, stock), which cancels
drift. Run ``i`` gives every row the same prompt: a corpus text (a different one per run and for
the warm-up, so that no row reuses a cached prompt beyond the template's first tokens) whose
chat-templated encoding by the GGUF's own tokenizer is ``--prompt`` tokens; the stock row is
given those ids, the others the text (each row reports the prompt tokens it actually saw).
Figures are medians over ``--runs``; peak RSS is ``VmHWM`` of the row's process (for served rows:
of the worker).

Columns: decode tok/s; × stock llama.cpp of the same precision; first-token latency (prefill and
the first sample); peak RSS; RSS ÷ weights (the GGUF file; for torch rows the parameters at the
row's bytes per weight); the roofline (bandwidth ÷ bytes read per decoded token: the GGUF's
tensor bytes without ``token_embd``, which is indexed, not read; for torch rows the linears at the
row's bytes per weight) and the fraction of it reached; the prompt tokens; for served rows the worker's
AnonHugePages. Then the issue's targets per precision (served ≥ 1.10× stock decode, first token no
slower, peak RSS ≤ 1.1× the weights). It never fails: it reports.

    .venv/bin/python bench/inference.py [--preset 1.5b|7b] [--model DIR] [--tokens 32]
        [--runs 3] [--prompt 128] [--precisions bf16,q8_0,q4_0] [--rows stock-bf16,served-bf16,…]
        [--context N] [--stock released|patched] [--profile] [--write docs/benchmarks.md]

The model is synthesised on first use (``dsr1d model synth --preset 1.5b``, 3.6 GB; 7b: 15 GB)
into ``--model`` (default /var/tmp/dsr1d-bench/r1-distill-qwen-<preset>). The 7B preset runs the
llama.cpp rows at Q8_0 and Q4_0 only (``--rows`` adds others). A group's rows are in memory
together: 1.5B bf16 needs about 11 GB, 7B Q8_0 about 16 GB (with the page cache).
A quick check on a tiny model: ``python -c 'from pathlib import Path; from dsr1d.engine.synth
import synthesize; synthesize("tiny", Path("/tmp/bench-tiny"))'``, then ``--model /tmp/bench-tiny
--tokens 8 --runs 1``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

from results import add_write_option, preformatted, write

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BENCH_DIR = Path("/var/tmp/dsr1d-bench")
PRESET_DIRS = {"1.5b": "r1-distill-qwen-1.5b", "7b": "r1-distill-qwen-7b"}
# GGUF precision -> dsr1d dtype (gguf_convert's and the torch engine's name for it).
PRECISIONS = {"bf16": "bf16", "q8_0": "int8", "q4_0": "int4", "f32": "fp32"}
DEFAULT_PRECISIONS = {"1.5b": "bf16,q8_0,q4_0", "7b": "q8_0,q4_0"}
TORCH_DTYPES = ("fp32", "bf16", "int8", "int4")
ALIASES = {dtype: f"torch-{dtype}" for dtype in TORCH_DTYPES}  # the rows' names before llama.cpp
# Bytes the torch engine reads per weight (int4: 4 bits + a bf16 scale and zero per 32 weights).
BYTES_PER_WEIGHT = {"fp32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5 + 4 / 32}
FLAG_PREFIXES = ("avx2", "avx512", "amx", "avx_vnni", "avxvnni", "fma", "f16c")
STOCK_MIN_CONTEXT = 512  # llama-cpp-python's default n_ctx
WARMUP_TOKENS = 4
SETTLE_S = 0.2  # between runs, so the last row's spinning threads go to sleep
FILLERS = (" a", " .", ".", ",")
PROMPT_STRIDE = 500  # corpus words between the starts of two runs' prompts
TARGET_SPEEDUP, TARGET_RSS = 1.10, 1.1


# -- rows -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Row:
    """One way of running the model; ``precision`` is the GGUF precision of its group."""

    name: str
    kind: str  # stock | served | torch | baseline
    precision: str

    @property
    def dtype(self) -> str:
        return PRECISIONS[self.precision]

    @property
    def label(self) -> str:
        if self.kind == "stock":
            return f"stock llama.cpp {self.precision.upper()}"
        if self.kind == "served":
            return f"dsr1d served llama.cpp {self.precision.upper()}"
        if self.kind == "torch":
            return f"dsr1d torch {self.dtype}"
        return "transformers fp32 generate (baseline)"


def parse_row(name: str) -> Row:
    name = ALIASES.get(name, name)
    if name == "baseline":
        return Row(name, "baseline", "f32")
    kind, _, rest = name.partition("-")
    if kind in ("stock", "served") and rest in PRECISIONS:
        return Row(name, kind, rest)
    by_dtype = {dtype: p for p, dtype in PRECISIONS.items()}
    if kind == "torch" and rest in by_dtype:
        return Row(name, kind, by_dtype[rest])
    raise SystemExit(f"unknown row {name!r}: stock-<p>, served-<p> (p: {', '.join(PRECISIONS)}), "
                     f"torch-<{'|'.join(TORCH_DTYPES)}> or baseline")


def default_rows(preset: str, precisions: list[str]) -> list[str]:
    rows = [f"{kind}-{p}" for p in precisions for kind in ("stock", "served")]
    if preset == "1.5b":
        rows += [f"torch-{PRECISIONS[p]}" for p in precisions] + ["baseline"]
    return rows


def groups(rows: list[Row], precisions: list[str]) -> list[list[Row]]:
    """Rows by precision, in ``precisions`` order, then any other precision."""
    order = precisions + [p for p in PRECISIONS if p not in precisions]
    return [[r for r in rows if r.precision == p] for p in order
            if any(r.precision == p for r in rows)]


# -- one row, in a child process ------------------------------------------------------------------

class Runner(Protocol):
    def run(self, prompt: dict[str, Any], tokens: int) -> dict[str, Any]: ...

    def finish(self) -> dict[str, Any]: ...


def peak_rss() -> int:
    """This process's peak RSS: VmHWM (``ru_maxrss`` would report the parent's if it was
    larger: Linux carries it over the fork and exec)."""
    return proc_fields("/proc/self/status", ("VmHWM",))["VmHWM"]


def timing(prompt_tokens: int, start: float, times: list[float]) -> dict[str, Any]:
    """First-token latency and decode tok/s over the tokens after the first."""
    rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return {"first_token_s": times[0] - start, "decode_tok_s": rate,
            "prompt_tokens": prompt_tokens, "new_tokens": len(times)}


def from_stats(stats: dict[str, Any]) -> dict[str, Any]:
    return {"first_token_s": stats["first_token_latency_s"],
            "decode_tok_s": stats["decode_tokens_per_s"], "prompt_tokens": stats["prompt_tokens"],
            "new_tokens": stats["new_tokens"]}


def generation_options(tokens: int) -> dict[str, Any]:
    return {"greedy": True, "ignore_eos": True, "max_new_tokens": tokens}


class StockRunner:
    """llama-cpp-python as a user runs it: defaults, n_threads = physical cores, mmap."""

    def __init__(self, spec: dict[str, Any], row: Row) -> None:
        from llama_cpp import Llama

        self.spec = spec
        start = time.perf_counter()
        self.llm = Llama(model_path=spec["ggufs"][row.precision], n_threads=spec["threads"],
                         n_ctx=spec["stock_context"], verbose=False)
        self.load_s = time.perf_counter() - start

    def run(self, prompt: dict[str, Any], tokens: int) -> dict[str, Any]:
        ids: list[int] = prompt["ids"]
        times: list[float] = []
        start = time.perf_counter()
        for _ in self.llm.generate(ids, temp=0.0):
            times.append(time.perf_counter())
            if len(times) >= tokens:
                break
        return timing(len(ids), start, times)

    def finish(self) -> dict[str, Any]:
        from dsr1d.engine.llama_build import patches

        return {"peak_rss_bytes": peak_rss(), "load_s": self.load_s, "context": self.llm.n_ctx(),
                "threads": self.llm.n_threads, "threads_batch": self.llm.n_threads_batch,
                "weights": "file mmap", "build": self.build(patches())}

    def build(self, marked: list[str]) -> str:
        if "stock_site" in self.spec:
            fixes = self.spec["stock_patches"]
            return "the release" + (f" + {', '.join(fixes)} (it crashes here without)" if fixes
                                    else "")
        return "dsr1d's build (" + ", ".join(marked) + ")"


def proc_fields(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    """``Key: N kB`` lines of a /proc file, in bytes."""
    out = {}
    for line in Path(path).read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keys:
            out[key] = int(value.split()[0]) * 1024
    return out


class ServedRunner:
    """dsr1d's llama.cpp backend through an EngineHost and its worker, as the daemon runs it."""

    def __init__(self, spec: dict[str, Any], row: Row) -> None:
        import logging

        from dsr1d.edges.engine_host import EngineHost

        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
        # The loop runs all the time, as in the daemon: health pings go on between runs.
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.host = EngineHost(Path(spec["ggufs"][row.precision]), backend="llamacpp", threads=0,
                               mmap=False, context=spec["context"],
                               cache_dir=Path(tempfile.gettempdir()))
        start = time.perf_counter()
        self.call(self._start())
        self.load_s = time.perf_counter() - start

    def call(self, coroutine: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    async def _start(self) -> None:
        await self.host.start()
        while self.host.state in ("loading", "stopped"):
            await asyncio.sleep(0.02)
        if self.host.state != "ready":
            raise RuntimeError(f"the engine is {self.host.state}: {self.host.info.get('error')}")

    def run(self, prompt: dict[str, Any], tokens: int) -> dict[str, Any]:
        return from_stats(self.call(self.host.generate(prompt["text"],
                                                       generation_options(tokens)))["stats"])

    def finish(self) -> dict[str, Any]:
        assert self.host._proc is not None
        pid = self.host._proc.pid
        status = proc_fields(f"/proc/{pid}/status", ("VmHWM", "VmRSS"))
        smaps = proc_fields(f"/proc/{pid}/smaps_rollup", ("AnonHugePages", "Anonymous"))
        cpus = sorted(os.sched_getaffinity(pid))
        self.call(self.host.stop())
        info = self.host.info
        return {"peak_rss_bytes": status["VmHWM"], "rss_bytes": status["VmRSS"],
                "anon_huge_pages_bytes": smaps.get("AnonHugePages", 0),
                "anonymous_bytes": smaps.get("Anonymous", 0), "load_s": self.load_s,
                "context": info.get("context"), "threads": info.get("threads"),
                "weights": info.get("weights"), "worker_cpus": cpus}


class TorchRunner:
    """dsr1d's torch engine in one dtype."""

    def __init__(self, spec: dict[str, Any], row: Row) -> None:
        import torch

        from dsr1d.engine.generate import Generator
        from dsr1d.engine.model import load

        torch.set_num_threads(spec["threads"])
        start = time.perf_counter()
        self.gen = Generator(load(Path(spec["model"]), row.dtype))
        self.load_s = time.perf_counter() - start
        self.text: str = spec["prompts"][0]["text"]
        self.profile: bool = spec["profile"]

    def run(self, prompt: dict[str, Any], tokens: int) -> dict[str, Any]:
        return from_stats(self.gen.generate(prompt["text"], generation_options(tokens)).stats)

    def finish(self) -> dict[str, Any]:
        result: dict[str, Any] = {"peak_rss_bytes": peak_rss(), "load_s": self.load_s}
        if self.profile:
            result["profile"] = profile_decode(self.gen, self.text)
        return result


def profile_decode(gen: Any, text: str) -> str:
    """Where decode time goes: the top operators over 8 decode steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        gen.generate(text, generation_options(8))
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)


class BaselineRunner:
    """Plain transformers fp32 ``generate``, timed by a streamer."""

    def __init__(self, spec: dict[str, Any], row: Row) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(spec["threads"])
        start = time.perf_counter()
        self.model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
        self.load_s = time.perf_counter() - start
        self.encode = hf_encoder(Path(spec["model"]))

    def run(self, prompt: dict[str, Any], tokens: int) -> dict[str, Any]:
        import torch
        from transformers.generation.streamers import BaseStreamer

        ids = torch.tensor([self.encode(prompt["text"])])
        times: list[float] = []

        class Clock(BaseStreamer):
            def put(self, value: Any) -> None:
                times.append(time.perf_counter())

            def end(self) -> None:
                pass

        start = time.perf_counter()
        self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                            min_new_tokens=tokens, streamer=Clock())
        return timing(ids.shape[1], start, times[1:])  # the first put() is the prompt

    def finish(self) -> dict[str, Any]:
        return {"peak_rss_bytes": peak_rss(), "load_s": self.load_s}


RUNNERS: dict[str, Callable[[dict[str, Any], Row], Runner]] = {
    "stock": StockRunner, "served": ServedRunner, "torch": TorchRunner,
    "baseline": BaselineRunner}


def reply(result: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(result), flush=True)


def child(row: Row, spec: dict[str, Any]) -> None:
    """Load, answer ``ready``; then ``warmup`` / ``run N`` / ``quit`` lines from stdin (the
    warm-up takes prompt 0, run N prompt N + 1)."""
    if row.kind == "stock" and spec.get("stock_site"):
        sys.path.insert(0, spec["stock_site"])  # before anything imports llama_cpp
    runner = RUNNERS[row.kind](spec, row)
    reply({"ready": True})
    for line in sys.stdin:
        command, _, index = line.strip().partition(" ")
        if command == "quit":
            reply(runner.finish())
            return
        if command == "warmup":
            reply(runner.run(spec["prompts"][0], WARMUP_TOKENS))
        else:
            reply(runner.run(spec["prompts"][int(index) + 1], spec["tokens"]))


# -- the parent's side of a child -----------------------------------------------------------------

class ChildFailed(Exception):
    pass


class Child:
    """A row's process, driven one command at a time; its stderr goes to a temporary file."""

    def __init__(self, row: Row, spec_path: Path) -> None:
        self.row = row
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", row.name, "--spec", str(spec_path)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        self.read()  # {"ready": true}

    def read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        self.proc.wait()
        self.stderr.seek(0)
        raise ChildFailed(f"exit status {self.proc.returncode}:\n{self.stderr.read()[-3000:]}")

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # read() reports how it died
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def start_children(group: list[Row], spec_path: Path) -> dict[str, Child]:
    children = {}
    for row in group:
        print(f"loading {row.label}…", file=sys.stderr, flush=True)
        try:
            children[row.name] = Child(row, spec_path)
        except ChildFailed as exc:
            print(f"{row.name} failed to load ({exc})", file=sys.stderr)
    return children


def ask_each(children: dict[str, Child], order: list[str], command: str
             ) -> dict[str, dict[str, Any]]:
    """``command`` to each child in ``order``; a child that fails is reported and dropped."""
    answers = {}
    for name in order:
        try:
            answers[name] = children[name].ask(command)
        except ChildFailed as exc:
            print(f"{name} failed ({exc})", file=sys.stderr)
            children.pop(name).close()
        if command.startswith("run"):
            time.sleep(SETTLE_S)
    return answers


def run_group(group: list[Row], spec_path: Path, runs: int) -> dict[str, dict[str, Any]]:
    """Load the group's rows side by side, warm each up, then measure them interleaved."""
    children = start_children(group, spec_path)
    if not children:
        return {}
    try:
        ask_each(children, list(children), "warmup")
        samples: dict[str, list[dict[str, Any]]] = {name: [] for name in children}
        for run in range(runs):
            live = list(children)
            order = live[run % len(live):] + live[:run % len(live)] if live else []
            print(f"run {run + 1}/{runs}: {', '.join(order)}", file=sys.stderr, flush=True)
            for name, answer in ask_each(children, order, f"run {run}").items():
                samples[name].append(answer)
        finals = ask_each(children, list(children), "quit")
    finally:
        for c in children.values():
            c.close()
    return {name: summarize(samples[name], finals[name]) for name in finals if samples[name]}


def summarize(samples: list[dict[str, Any]], final: dict[str, Any]) -> dict[str, Any]:
    return {"decode_tok_s": statistics.median(s["decode_tok_s"] for s in samples),
            "first_token_s": statistics.median(s["first_token_s"] for s in samples),
            "prompt_tokens": samples[0]["prompt_tokens"], "new_tokens": samples[0]["new_tokens"],
            "runs": samples, **final}


# -- the prompt -----------------------------------------------------------------------------------

def gguf_encoder(path: Path) -> Callable[[str], list[int]]:
    """The chat-templated ids of a user turn, by the GGUF's own tokenizer and template (what
    LlamaGenerator.encode does, on a vocabulary-only load)."""
    from llama_cpp import Llama

    from dsr1d.engine.gguf_file import inspect_gguf
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    info = inspect_gguf(path)
    vocab = Llama(model_path=str(path), vocab_only=True, verbose=False)
    bos = vocab.detokenize([info.bos_id], special=True).decode() if info.bos_id is not None else ""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    template = env.from_string(info.chat_template) if info.chat_template else None

    def encode(text: str) -> list[int]:
        chat = (template.render(messages=[{"role": "user", "content": text}],
                                add_generation_prompt=True, bos_token=bos)
                if template else f"{bos}<｜User｜>{text}<｜Assistant｜><think>\n")
        return vocab.tokenize(chat.encode(), add_bos=False, special=True)
    return encode


def hf_encoder(model_dir: Path) -> Callable[[str], list[int]]:
    """The chat-templated ids of a user turn, by the checkpoint's transformers tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def encode(text: str) -> list[int]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return encode


def fit_prompt(encode: Callable[[str], list[int]], target: int, start: int) -> str:
    """The longest run of corpus words from word ``start`` whose templated encoding has at most
    ``target`` tokens, topped up with one-token fillers to exactly ``target`` where they fit."""
    from dsr1d.engine.synth import CORPUS

    words = CORPUS.read_text().split()
    start %= len(words)
    words = words[start:] + words[:start]
    lo, hi = 0, len(words)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode(" ".join(words[:mid]))) <= target:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    while (n := len(encode(text))) < target:
        fits = [f for f in FILLERS if n < len(encode(text + f)) <= target]
        if not fits:
            break
        text += fits[0]
    return text


# -- what the parent prepares and measures --------------------------------------------------------

def ensure_model(path: Path, preset: str) -> None:
    if (path / "config.json").exists():
        return
    from dsr1d.engine.synth import synth_main

    print(f"synthesising the {preset} model into {path} (once)…", file=sys.stderr)
    if synth_main(["--preset", preset, "--force", str(path)]) != 0:
        sys.exit(1)


def ensure_gguf(model_dir: Path, precision: str) -> Path:
    """``<model>/bench-<precision>.gguf``, converted unless one newer than config.json, of the
    converter's current layout, exists."""
    from dsr1d.engine.gguf_convert import convert, is_current

    path = model_dir / f"bench-{precision}.gguf"
    if is_current(path, model_dir):
        return path
    print(f"converting {model_dir} to {path.name} (once)…", file=sys.stderr, flush=True)
    return convert(model_dir, path, PRECISIONS[precision])


def gguf_read_per_token(path: Path) -> int:
    """Tensor bytes a decoded token reads: all but ``token_embd`` (a row lookup)."""
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors if t.name != "token_embd.weight")


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


def weights_read_per_token(config: dict[str, Any]) -> int:
    """Torch: weights every decoded token reads, all linears incl. lm_head (not the embedding)."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    layers = config["num_hidden_layers"]
    kv = h // config["num_attention_heads"] * config["num_key_value_heads"]
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * inter
    return layers * per_layer + config["vocab_size"] * h


def cpu_line() -> str:
    """This CPU's model and the SIMD flags that matter for the kernels."""
    model, flags = "unknown CPU", []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            model = value.strip()
        elif key.strip() == "flags":
            flags = [f for f in value.split() if f.startswith(FLAG_PREFIXES)]
            break
    return f"CPU: {model}; flags: {' '.join(flags) or 'none of ' + '/'.join(FLAG_PREFIXES)}"


def thp_line() -> str:
    base = Path("/sys/kernel/mm/transparent_hugepage")
    try:
        return (f"transparent huge pages: enabled {(base / 'enabled').read_text().strip()}; "
                f"defrag {(base / 'defrag').read_text().strip()}")
    except OSError:
        return "transparent huge pages: not available"


def llama_line() -> str:
    try:
        from dsr1d.engine.llama_build import system_info

        return f"llama.cpp: {system_info()}"
    except ImportError as exc:
        return f"llama.cpp: not importable ({exc})"


def stock_patches() -> list[str]:
    """What the release needs to run on this CPU: amx-tile-config on an AMX CPU (without it
    llama.cpp dies on its first prompt of two or more tokens here), else nothing."""
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("flags")), "").split()
    return ["amx-tile-config"] if "amx_int8" in flags else []


def stock_site(patches: list[str]) -> Path:
    """llama-cpp-python as released, built for this CPU by tools/llama-wheel.sh with only
    ``patches``, installed once into ``site`` next to its wheel; the build says on stderr when
    it takes minutes."""
    env = {**os.environ, "DSR1D_LLAMA_PATCHES": " ".join(patches)}
    script = Path(__file__).resolve().parent.parent / "tools" / "llama-wheel.sh"
    folder = Path(subprocess.run([str(script), sys.executable], env=env, check=True,
                                 stdout=subprocess.PIPE, text=True).stdout.split()[-1])
    site = folder / "site"
    if not site.is_dir():
        wheel = next(folder.glob("llama_cpp_python-*.whl"))
        partial = folder / ".site.partial"
        subprocess.run(["rm", "-rf", str(partial)], check=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(partial), str(wheel)], check=True)
        partial.rename(site)
    return site


def stock_context(prompt: int, tokens: int) -> int:
    """llama-cpp-python's default n_ctx, or the next multiple of 256 that holds the run."""
    need = prompt + tokens + WARMUP_TOKENS
    return max(STOCK_MIN_CONTEXT, -(-need // 256) * 256)


# -- figures and the report -----------------------------------------------------------------------

@dataclass(frozen=True)
class Machine:
    bandwidth: float
    config: dict[str, Any]
    ggufs: dict[str, Path]

    def read_per_token(self, row: Row) -> float:
        if row.kind in ("stock", "served"):
            return float(gguf_read_per_token(self.ggufs[row.precision]))
        return weights_read_per_token(self.config) * BYTES_PER_WEIGHT[row.dtype]

    def weights(self, row: Row) -> float:
        if row.kind in ("stock", "served"):
            return float(self.ggufs[row.precision].stat().st_size)
        from dsr1d.engine.synth import parameter_count

        return parameter_count(self.config) * BYTES_PER_WEIGHT[row.dtype]


def add_figures(results: dict[str, dict[str, Any]], rows: list[Row], machine: Machine) -> None:
    """Roofline, its fraction, RSS ÷ weights and the ratio to stock llama.cpp, per row."""
    base = results.get("baseline", {}).get("decode_tok_s")
    for row in rows:
        r = results.get(row.name)
        if r is None:
            continue
        roofline = machine.bandwidth / machine.read_per_token(row)
        stock = results.get(f"stock-{row.precision}", {}).get("decode_tok_s")
        r.update(label=row.label, roofline_tok_s=roofline,
                 roofline_fraction=r["decode_tok_s"] / roofline,
                 weights_bytes=machine.weights(row),
                 rss_to_weights=r["peak_rss_bytes"] / machine.weights(row),
                 ratio_to_stock=r["decode_tok_s"] / stock if stock else None,
                 ratio_to_baseline=r["decode_tok_s"] / base if base else None)


def fmt(value: float | None, spec: str, width: int, unit: str = "") -> str:
    """``value`` in ``spec`` and ``unit``, right-aligned in ``width``; a dash for None."""
    text = f"{value:{spec}}{unit}" if value is not None else "—"
    return f"{text:>{width}}"


def table(results: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'':36} {'decode tok/s':>12} {'x stock':>7} {'1st token':>9} {'peak RSS':>8} "
             f"{'RSS/wts':>7} {'roofline':>8} {'of roof':>7} {'prompt':>6} {'hugepages':>9}"]
    for r in results.values():
        huge = r.get("anon_huge_pages_bytes")
        lines.append(
            f"{r['label']:36} {r['decode_tok_s']:12.2f} {fmt(r['ratio_to_stock'], '.2f', 7)} "
            f"{r['first_token_s'] * 1000:7.0f}ms {r['peak_rss_bytes'] / 1e9:6.2f}GB "
            f"{r['rss_to_weights']:7.2f} {r['roofline_tok_s']:8.1f} "
            f"{r['roofline_fraction'] * 100:6.0f}% {r['prompt_tokens']:6d} "
            f"{fmt(huge / 1e9 if huge is not None else None, '.2f', 9, 'GB')}")
    return "\n".join(lines)


def print_targets(results: dict[str, dict[str, Any]]) -> None:
    """The issue's targets, for each precision with both llama.cpp rows."""
    for p in PRECISIONS:
        stock, served = results.get(f"stock-{p}"), results.get(f"served-{p}")
        if not (stock and served):
            continue
        checks = [
            (f"decode {served['ratio_to_stock']:.2f}x stock", served["ratio_to_stock"]
             >= TARGET_SPEEDUP, f">= {TARGET_SPEEDUP:.2f}x"),
            (f"first token {served['first_token_s'] * 1000:.0f} ms vs "
             f"{stock['first_token_s'] * 1000:.0f} ms", served["first_token_s"]
             <= stock["first_token_s"], "no slower"),
            (f"peak RSS {served['rss_to_weights']:.2f}x weights", served["rss_to_weights"]
             <= TARGET_RSS, f"<= {TARGET_RSS}x")]
        print(f"target {p.upper():5}: " + "; ".join(
            f"{what} ({want}: {'met' if ok else 'MISSED'})" for what, ok, want in checks))
        if served["prompt_tokens"] != stock["prompt_tokens"]:
            print(f"  note: served saw {served['prompt_tokens']} prompt tokens, stock "
                  f"{stock['prompt_tokens']}")


def print_notes(results: dict[str, dict[str, Any]]) -> None:
    for name, r in results.items():
        if "context" in r:
            print(f"{name}: context {r['context']}, {r['threads']} threads, weights "
                  f"{r['weights']}" + (f", CPUs {r['worker_cpus']}" if "worker_cpus" in r else "")
                  + (f", llama.cpp: {r['build']}" if "build" in r else ""))
    for r in results.values():
        if "profile" in r:
            print(f"\nwhere {r['label']} decode time goes:\n{r.pop('profile')}")


# -- the parent -----------------------------------------------------------------------------------

def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=list(PRESET_DIRS), default="1.5b")
    parser.add_argument("--model", type=Path, help="model directory (default: by --preset)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    parser.add_argument("--threads", type=int, default=0,
                        help="stock and torch rows (0: one per physical core; served rows "
                             "follow the daemon's placement)")
    parser.add_argument("--precisions", help="GGUF precisions (default: bf16,q8_0,q4_0; 7b: "
                                             "q8_0,q4_0)")
    parser.add_argument("--rows", help="rows to run (default: stock and served per precision, "
                                       "the torch rows and the baseline; 7b: llama.cpp only)")
    parser.add_argument("--context", type=int, default=0,
                        help="llama.cpp context of the stock and served rows (0: as shipped)")
    parser.add_argument("--stock", choices=("released", "patched"), default="released",
                        help="the stock rows' llama.cpp: the release built for this CPU (with "
                             "only the AMX crash fix), or dsr1d's own build")
    parser.add_argument("--profile", action="store_true", help="torch rows: where decode goes")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    add_write_option(parser)
    args = parser.parse_args()
    args.model = args.model or BENCH_DIR / PRESET_DIRS[args.preset]
    args.precisions = (args.precisions or DEFAULT_PRECISIONS[args.preset]).split(",")
    for p in args.precisions:
        if p not in PRECISIONS:
            parser.error(f"unknown precision {p!r} (one of {', '.join(PRECISIONS)})")
    if not args.threads:
        import psutil

        args.threads = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    return args


def prepare(args: argparse.Namespace, rows: list[Row]) -> tuple[dict[str, Any], Machine]:
    """Model, GGUFs, prompt and bandwidth: what every child is given, and the roofline inputs."""
    ensure_model(args.model, args.preset)
    config = json.loads((args.model / "config.json").read_text())
    ggufs = {p: ensure_gguf(args.model, p) for p in dict.fromkeys(
        r.precision for r in rows if r.kind in ("stock", "served"))}
    encode = gguf_encoder(next(iter(ggufs.values()))) if ggufs else hf_encoder(args.model)
    texts = [fit_prompt(encode, args.prompt, i * PROMPT_STRIDE) for i in range(args.runs + 1)]
    prompts = [{"text": text, "ids": encode(text)} for text in texts]
    longest = max(len(p["ids"]) for p in prompts)
    spec = {"model": str(args.model), "ggufs": {p: str(g) for p, g in ggufs.items()},
            "threads": args.threads, "tokens": args.tokens, "prompts": prompts,
            "context": args.context, "profile": args.profile,
            "stock_context": args.context or stock_context(longest, args.tokens)}
    if args.stock == "released" and any(r.kind == "stock" for r in rows):
        spec["stock_patches"] = stock_patches()
        spec["stock_site"] = str(stock_site(spec["stock_patches"]))
    machine = Machine(memory_bandwidth(args.threads), config, ggufs)
    return spec, machine


def main() -> None:
    args = parse_args()
    if args.child:
        child(parse_row(args.child), json.loads(args.spec.read_text()))
        return
    rows = [parse_row(n) for n in (args.rows.split(",") if args.rows else
                                   default_rows(args.preset, args.precisions))]
    print(cpu_line(), llama_line(), thp_line(), sep="\n")
    spec, machine = prepare(args, rows)
    setting = (f"memory read bandwidth: {machine.bandwidth / 1e9:.1f} GB/s ({args.threads} "
               f"threads); prompts {sorted({len(p['ids']) for p in spec['prompts']})} tokens, "
               f"{args.tokens} new tokens, median of {args.runs}")
    print(setting, flush=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        for group in groups(rows, args.precisions):
            results.update(run_group(group, spec_path, args.runs))
    add_figures(results, rows, machine)
    print("\n" + table(results))
    print_targets(results)
    print_notes(results)
    print(json.dumps({"bandwidth_bytes_per_s": machine.bandwidth, "threads": args.threads,
                      "tokens": args.tokens, "runs": args.runs,
                      "prompt_tokens": [len(p["ids"]) for p in spec["prompts"]],
                      "cpu": cpu_line(), "llama_cpp": llama_line(), "thp": thp_line(),
                      "rows": results}))
    write(args.write, "inference", f"{setting}:\n\n{preformatted(table(results))}")


if __name__ == "__main__":
    main()
