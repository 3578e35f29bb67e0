"""The engine worker process: loads the model and serves generation jobs over a socket.

Run by the daemon as ``python -m dsr1d.engine.worker --fd N --model DIR --dtype D --threads T``.
The protocol is JSON lines on the inherited socket ``N``.

Daemon -> worker: ``{"op": "generate", "job": 1, "prompt": "…", "options": {…}}``,
``{"op": "cancel", "job": 1}``, ``{"op": "threads", "n": 2}``, ``{"op": "ping"}``.

Worker -> daemon: ``{"ev": "loading", "done": b, "total": b, "file": "…"}``,
``{"ev": "ready", "model": "…", "dtype": "…", "dtype_reason": "…", "threads": n,
"parameters": n, "context": n}``, ``{"ev": "token", "job": 1, "piece": "…"}`` (raw text,
``</think>`` included), ``{"ev": "finished", "job": 1, "text": "…", "reasoning": "…", "answer": "…",
"stats": {…}}``, ``{"ev": "error", "job": 1|null, "name": "…", "message": "…"}``,
``{"ev": "pong"}``. A fatal load error is an ``error`` with ``job`` null, then exit 2.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import sys
import threading
from typing import Any

# Before torch is imported: 2 MiB+ allocations (the weights) get madvise(MADV_HUGEPAGE).
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


class Channel:
    """JSON lines over a stream socket; sends are serialised across threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = sock.makefile("r", encoding="utf-8")
        self.lock = threading.Lock()

    def send(self, **message: Any) -> None:
        data = (json.dumps(message) + "\n").encode()
        with self.lock:
            self.sock.sendall(data)

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

    def serve(self, generator: Any) -> None:
        from .generate import InvalidRequest

        while (job := self.jobs.get()) is not None:
            job_id = int(job["job"])
            if job_id in self.cancelled:
                self.channel.send(ev="error", job=job_id, name="Cancelled",
                                  message="cancelled before it started")
                continue

            def on_text(piece: str, job_id: int = job_id) -> None:
                self.channel.send(ev="token", job=job_id, piece=piece)

            try:
                result = generator.generate(job["prompt"], job.get("options", {}), on_text,
                                            cancelled=lambda: job_id in self.cancelled,
                                            threads=lambda: self.threads)
            except InvalidRequest as exc:
                self.channel.send(ev="error", job=job_id, name="InvalidArgument", message=str(exc))
                continue
            self.channel.send(ev="finished", job=job_id, text=result.text,
                              reasoning=result.reasoning, answer=result.answer, stats=result.stats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dsr1d-engine")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    channel = Channel(socket.socket(fileno=args.fd))
    worker = Worker(channel, args.threads)
    threading.Thread(target=worker.read_commands, daemon=True).start()

    import torch

    from pathlib import Path

    from .generate import Generator
    from .model import ModelError, load

    torch.set_num_threads(max(1, args.threads))
    try:
        loaded = load(Path(args.model), args.dtype,
                      lambda done, total, name: channel.send(ev="loading", done=done,
                                                             total=total, file=name))
    except ModelError as exc:
        channel.send(ev="error", job=None, name="ModelError", message=str(exc))
        return 2
    channel.send(ev="ready", model=loaded.name, dtype=loaded.dtype,
                 dtype_reason=loaded.dtype_reason, threads=torch.get_num_threads(),
                 parameters=loaded.parameters, context=loaded.context)
    worker.serve(Generator(loaded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
