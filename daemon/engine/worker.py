"""The engine worker process: loads the model and serves generation jobs over a socket.

Run by the daemon as ``python -m dsr1d.engine.worker --fd N --model PATH --dtype D --threads T
--backend auto|llamacpp|torch [--cache-dir DIR] [--context N] [--mmap] [--mem-nodes 0]``: a ``.gguf``
file or a Hugging Face directory, served by llama.cpp (an HF directory converted once into the
cache) or by torch (``dsr1d.engine.backend`` has the rules). The protocol is JSON lines on the
inherited socket ``N``, the same for both backends.

Daemon -> worker: ``{"op": "generate", "job": 1, "prompt": "…" | [{"role", "content"}…], "options": {…}}``,
``{"op": "cancel", "job": 1}``, ``{"op": "threads", "n": 2}``, ``{"op": "ping"}``.

Worker -> daemon: ``{"ev": "loading", "done": b, "total": b, "file": "…"}``,
``{"ev": "converting", "done": n, "total": n, "file": "…"}``, ``{"ev": "log", "message": "…"}``,
``{"ev": "ready", "model": "…", "dtype": "…", "dtype_reason": "…", "threads": n,
"parameters": n, "context": n, "backend": "…", "backend_reason": "…"}`` (llama.cpp adds
``gguf``, ``system_info`` and ``weights``), ``{"ev": "token", "job": 1, "piece": "…"}`` (raw text,
``</think>`` included), then ``{"ev": "text", "job": 1, "chunk": "…"}`` (the final text, special
tokens left out, in pieces of at most TEXT_CHUNK characters, so that no line is unbounded) and
``{"ev": "finished", "job": 1, "stats": {…}}``; ``{"ev": "error", "job": 1|null, "name": "…",
"message": "…"}``, ``{"ev": "pong"}``. A fatal load error — any exception while loading, which
would recur on every restart — is an ``error`` with ``job`` null, then exit 2. Any line longer
than the daemon's limit, or garbage, makes the daemon treat the worker as dead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import socket
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, Iterator

from dsr1d.constants import ENGINE_BACKENDS

# Before torch is imported: 2 MiB+ allocations (the weights) get madvise(MADV_HUGEPAGE). For
# llama.cpp's buffers glibc does the same (GLIBC_TUNABLES=glibc.malloc.hugetlb=1, which must be in
# the environment when the process starts: EngineHost sets it).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


TEXT_CHUNK = 16384  # characters of result text per line


class Channel:
    """JSON lines over a stream socket; sends are serialised across threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("r", encoding="utf-8")
        self.lock = threading.Lock()
        self._held: list[bytes] | None = None      # lines `held` back by the generating thread
        self._holder = 0

    def send(self, **message: Any) -> None:
        data = (json.dumps(message) + "\n").encode()
        if self._held is not None and threading.get_ident() == self._holder:
            self._held.append(data)
            return
        with self.lock:
            self.sock.sendall(data)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """This thread's sends go out together at the end, in one write: a batch step's tokens
        of every sequence wake the daemon once, not once a sequence."""
        self._held, self._holder = [], threading.get_ident()
        try:
            yield
        finally:
            lines, self._held = self._held, None
            if lines:
                with self.lock:
                    self.sock.sendall(b"".join(lines))

    def receive(self) -> dict[str, Any] | None:
        line = self.reader.readline()
        return json.loads(line) if line else None


class Worker:
    """Reads commands on a thread; generates on the main thread, one job at a time."""

    def __init__(self, channel: Channel, threads: int) -> None:
        self.channel = channel
        self.jobs: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.cancelled: set[int] = set()
        self.threads = threads

    def read_commands(self) -> None:
        while (command := self.channel.receive()) is not None:
            op = command.get("op")
            if op == "generate":
                self.jobs.put(command)
            elif op == "cancel":
                self.cancelled.add(int(command["job"]))
            elif op == "threads":
                self.threads = max(1, int(command["n"]))
            elif op == "ping":
                self.channel.send(ev="pong")
        self.jobs.put(None)  # the daemon went away: finish

    def serve(self, generator: Any, sampling: dict[str, float] | None = None) -> None:
        """Generate each job in turn; the model's ``sampling`` defaults under its options."""
        from dsr1d.engine.request import InvalidRequest

        while (job := self.jobs.get()) is not None:
            job_id = int(job["job"])
            if job_id in self.cancelled:
                self.channel.send(ev="error", job=job_id, name="Cancelled",
                                  message="cancelled before it started")
                continue

            try:
                options = {**(sampling or {}), **job.get("options", {})}
                result = generator.generate(job["prompt"], options, self._on_text(job_id),
                                            cancelled=lambda: job_id in self.cancelled,
                                            threads=lambda: self.threads)
            except InvalidRequest as exc:
                self.channel.send(ev="error", job=job_id, name="InvalidArgument", message=str(exc))
                continue
            self._result(job_id, result)

    def serve_batched(self, batcher: Any, sampling: dict[str, float] | None = None) -> None:
        """Continuous batching: a job joins at the next step while a slot is free, a finished
        one leaves (`dsr1d.engine.llama_batch`)."""
        from dsr1d.engine.request import InvalidRequest

        ending = False
        while True:
            while batcher.free and not ending:
                try:
                    job = self.jobs.get(block=not batcher.active)
                except queue.Empty:
                    break
                if job is None:
                    ending = True
                    break
                job_id = int(job["job"])
                if job_id in self.cancelled:
                    self.channel.send(ev="error", job=job_id, name="Cancelled",
                                      message="cancelled before it started")
                    continue
                options = {**(sampling or {}), **job.get("options", {})}
                try:
                    done = batcher.admit(job_id, job["prompt"], options, self._on_text(job_id),
                                         lambda j=job_id: j in self.cancelled)
                except InvalidRequest as exc:
                    self.channel.send(ev="error", job=job_id, name="InvalidArgument",
                                      message=str(exc))
                    continue
                for finished, result in done:
                    self._result(finished, result)
            if not batcher.active:
                if ending:
                    return
                continue
            with self.channel.held():
                for finished, result in batcher.step(self.threads):
                    self._result(finished, result)

    def _on_text(self, job_id: int) -> Any:
        def on_text(piece: str) -> None:
            self.channel.send(ev="token", job=job_id, piece=piece)
        return on_text

    def _result(self, job_id: int, result: Any) -> None:
        # The text goes in chunks so that no line is unbounded (R1 reasons for thousands of
        # tokens); it keeps its </think>, so a client splits reasoning from answer there.
        for start in range(0, len(result.text), TEXT_CHUNK):
            self.channel.send(ev="text", job=job_id, chunk=result.text[start:start + TEXT_CHUNK])
        self.channel.send(ev="finished", job=job_id, stats=result.stats)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dsr1d-engine")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--backend", default="auto", choices=ENGINE_BACKENDS)
    parser.add_argument("--cache-dir", default="/var/cache/dsr1d")
    parser.add_argument("--context", type=int, default=0, help="llama.cpp context (0: default)")
    parser.add_argument("--parallel", type=int, default=1,
                        help="llama.cpp: sequences decoded together (continuous batching)")
    parser.add_argument("--mmap", action="store_true",
                        help="llama.cpp: map the file instead of reading it into anonymous memory")
    parser.add_argument("--mem-nodes", default="", help="NUMA nodes to bind memory to (e.g. 0)")
    return parser


def _load_torch(args: argparse.Namespace, channel: Channel, reason: str) -> tuple[Any, dict]:
    import torch

    from dsr1d.engine.generate import Generator
    from dsr1d.engine.model import load

    torch.set_num_threads(max(1, args.threads))
    loaded = load(Path(args.model), args.dtype,
                  lambda done, total, name: channel.send(ev="loading", done=done, total=total,
                                                         file=name))
    from dsr1d.engine.request import model_sampling

    generation = Path(args.model) / "generation_config.json"
    try:
        sampling = model_sampling(json.loads(generation.read_text())) if generation.is_file() \
            else {}
    except (OSError, ValueError):
        sampling = {}
    return Generator(loaded), {
        "model": loaded.name, "dtype": loaded.dtype, "dtype_reason": loaded.dtype_reason,
        "threads": torch.get_num_threads(), "parameters": loaded.parameters,
        "context": loaded.context, "backend": "torch", "backend_reason": reason,
        "sampling": sampling}


def _load_llama(args: argparse.Namespace, channel: Channel, choice: Any) -> tuple[Any, dict]:
    from dsr1d.engine import llama_backend
    from dsr1d.engine.backend import gguf_dtype

    path = Path(args.model)
    dtype_reason = "the GGUF file's precision"
    if choice.convert:
        from dsr1d.engine.gguf_cache import cached_gguf
        from dsr1d.engine.gguf_convert import convert

        dtype = gguf_dtype(args.dtype)
        dtype_reason = "requested" if args.dtype != "auto" else \
            "auto: the checkpoint's bf16 (llama.cpp computes it at memory speed on AVX2 too)"
        path = cached_gguf(path, dtype, Path(args.cache_dir), convert,
                           lambda done, total, name: channel.send(ev="converting", done=done,
                                                                  total=total, file=name),
                           lambda message: channel.send(ev="log", message=message))
    elif args.dtype != "auto":
        dtype_reason = f"the GGUF file's precision (engine_dtype {args.dtype} applies to " \
                       f"Hugging Face directories only)"
    system_info = llama_backend.system_info()
    applied = llama_backend.patches()
    channel.send(ev="log", message=f"llama.cpp: {system_info}; patches: "
                                   f"{', '.join(applied) or 'none'}")
    if (warning := llama_backend.amx_warning(system_info, applied)) is not None:
        channel.send(ev="log", message=warning)
    from dsr1d.engine.request import model_sampling

    parallel = max(1, args.parallel)
    generator = llama_backend.load(path, max(1, args.threads), args.context, args.mmap, parallel)
    _log_given_back(channel, generator.given_back, "the context")
    if generator.embedding_in_file:
        channel.send(ev="log", message=f"the embedding table "
                                       f"({generator.embedding_in_file / 2**20:.0f} MiB) stays "
                                       f"in the file, read a row a token")
    info = generator.info
    return generator, {
        "parallel": parallel,
        "sampling": model_sampling(info.sampling),
        "model": info.name, "dtype": info.file_type, "dtype_reason": dtype_reason,
        "threads": generator.threads, "parameters": info.parameters,
        "context": generator.context, "backend": "llamacpp", "backend_reason": choice.reason,
        "gguf": str(path), "system_info": system_info,
        "weights": "file mmap" if args.mmap else "anonymous memory",
        "embedding_in_file": generator.embedding_in_file}


def _log_given_back(channel: Channel, size: int, what: str) -> None:
    if size >= 1 << 20:
        channel.send(ev="log", message=f"gave back {size / 2**20:.0f} MiB that {what} held as "
                                       f"zeros (the KV cache, resident as it fills)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    channel = Channel(socket.socket(fileno=args.fd))
    worker = Worker(channel, args.threads)
    threading.Thread(target=worker.read_commands, daemon=True).start()

    from dsr1d.engine import llama_backend
    from dsr1d.engine.backend import choose, resolve_model
    from dsr1d.engine.errors import ModelError

    if args.mem_nodes:
        from dsr1d.core.placement import bind_memory

        problem = bind_memory([int(n) for n in args.mem_nodes.split(",")])
        if problem:
            channel.send(ev="log", message=f"memory not bound to node(s) {args.mem_nodes}: "
                                           f"{problem}")
    try:
        args.model = str(resolve_model(Path(args.model)))
        choice = choose(args.backend, Path(args.model), llama_backend.installed())
        if choice.backend == "torch":
            generator, ready = _load_torch(args, channel, choice.reason)
        else:
            generator, ready = _load_llama(args, channel, choice)
    except ModelError as exc:
        channel.send(ev="error", job=None, name="ModelError", message=str(exc))
        return 2
    except Exception as exc:  # e.g. a config.json with wrong types: it would fail every time
        traceback.print_exc()
        channel.send(ev="error", job=None, name="ModelError",
                     message=f"loading {args.model} failed: {type(exc).__name__}: {exc}"[:2000])
        return 2
    if ready.get("parallel", 1) > 1:
        from dsr1d.engine.llama_batch import Batcher

        try:
            batcher = Batcher(generator, ready["parallel"])
        except ModelError as exc:
            channel.send(ev="error", job=None, name="ModelError", message=str(exc))
            return 2
        _log_given_back(channel, batcher.given_back, f"{ready['parallel']} slots")
        channel.send(ev="ready", **ready)
        worker.serve_batched(batcher, ready.get("sampling", {}))
        return 0
    channel.send(ev="ready", **ready)
    worker.serve(generator, ready.get("sampling", {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
