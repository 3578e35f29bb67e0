"""The daemon's side of the engine: owns the worker process (no torch here).

Starts ``python -m dsr1d.engine.worker`` with a socket, pins it to CPUs, sets its thread count,
health-checks it with pings, restarts it with back-off when it dies (pending callers get
``EngineUnavailable`` at once, never a hang), and turns its JSON-lines events into callbacks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from dsr1d.contract.sysroot import SysRoot
from dsr1d.core.placement import Placement, describe, plan, read_topology
from dsr1d.table import human_size

log = logging.getLogger("dsr1d")

PING_TIMEOUT_S = 30.0    # a worker silent this long is killed (pings every third of it)
BACKOFF_S = (1, 2, 5, 10, 30, 60)
MAX_LOAD_FAILURES = 3    # deaths before ever becoming ready: then ``failed``, with the reason
LINE_LIMIT = 1 << 20     # a protocol line longer than this is a broken worker (text is chunked)
STDERR_TAIL = 20
OPTIONS: dict[str, tuple[type, float | None, float | None]] = {
    "max_new_tokens": (int, 1, 1_000_000),
    "temperature": (float, 0.0, 2.0),
    "top_p": (float, 0.0, 1.0),
    "greedy": (bool, None, None),
    "ignore_eos": (bool, None, None),
    "seed": (int, 0, 2**63 - 1),
}


class EngineUnavailable(Exception):
    """The engine is not running (not configured, loading, restarting, or failed)."""


class InvalidArgument(Exception):
    """A request option is unknown, of the wrong type, or out of range; or the prompt is too long."""


class Cancelled(Exception):
    """The job was cancelled before it produced a result."""


def validate_options(options: dict[str, Any]) -> dict[str, Any]:
    """Check generation options; InvalidArgument names the key and what is allowed."""
    clean: dict[str, Any] = {}
    for key, value in options.items():
        if key not in OPTIONS:
            raise InvalidArgument(f"unknown option {key!r} (known: {', '.join(OPTIONS)})")
        kind, lo, hi = OPTIONS[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidArgument(f"option {key!r} must be {kind.__name__}, "
                                  f"got {type(value).__name__}")
        if lo is not None and not lo <= value <= hi:
            raise InvalidArgument(f"option {key!r} = {value} is outside {lo}..{hi}")
        if key == "top_p" and value == 0:
            raise InvalidArgument("option 'top_p' must be above 0")
        clean[key] = value
    return clean


def _call(listener: Callable[..., None], *args: Any) -> None:
    """A listener's failure is logged; it never stops a job's result from being delivered."""
    try:
        listener(*args)
    except Exception:
        log.exception("engine event listener failed")


def worker_environment() -> dict[str, str]:
    """The worker's environment: glibc madvises its large allocations for huge pages, so
    llama.cpp's weights (read into anonymous memory, not mapped) get THP in ``madvise`` mode."""
    env = dict(os.environ)
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.startswith("glibc.malloc.hugetlb=") for t in tunables):
        tunables.append("glibc.malloc.hugetlb=1")
    env["GLIBC_TUNABLES"] = ":".join(tunables)
    return env


def physical_cores() -> int:
    """One decode thread per physical core (hyperthreads do not help decode)."""
    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


@dataclass
class Job:
    """A generation: its request, the text assembled from the worker's chunks, and the
    caller's future."""

    id: int
    prompt: str | list[dict[str, str]]     # one user turn, or a conversation
    options: dict[str, Any]
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    text: list[str] = field(default_factory=list)


TokenListener = Callable[[int, str], None]
FinishedListener = Callable[[int, dict[str, Any]], None]
ChangeListener = Callable[[list[str]], None]
BusyListener = Callable[[bool], None]


class EngineHost:
    """Runs and supervises one engine worker."""

    def __init__(self, model: Path, dtype: str = "auto", threads: int = 0,
                 cpus: list[int] | None = None, python: str = sys.executable,
                 backend: str = "auto", cache_dir: Path = Path("/var/cache/dsr1d"),
                 context: int = 0, mmap: bool = False, root: str = "/",
                 ping_timeout_s: float = PING_TIMEOUT_S, parallel: int = 1) -> None:
        self.model = model
        self.ping_timeout_s = ping_timeout_s
        self.dtype = dtype
        self.backend = backend
        self.cache_dir = cache_dir
        self.context = context
        self.mmap = mmap
        self.parallel = parallel             # llama.cpp sequences decoded together
        self.root = root
        self._wanted_threads = threads
        self.thread_cap: int | None = None
        self.cpus = cpus
        self._cores = 1
        self._placement()                    # sets _cores; again at each spawn (hotplug)
        self.threads = self.effective_threads()
        self.python = python
        self.state = "stopped"
        self.info: dict[str, Any] = {}
        self.tokens_per_s = 0.0
        self.tokens_seen = 0                 # every token of every job: a live decode rate
        self.jobs: dict[int, Job] = {}
        self._next_job = 1
        self._proc: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._restarts = 0
        self._load_failures = 0
        self._stderr: deque[str] = deque(maxlen=STDERR_TAIL)
        self._stopping = False
        self._last_pong = 0.0
        self.token_listeners: list[TokenListener] = []
        self.finished_listeners: list[FinishedListener] = []
        self.change_listeners: list[ChangeListener] = []
        self.busy_listeners: list[BusyListener] = []

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._stopping = False
        await self._spawn()
        self._spawn_task(self._health())

    async def stop(self) -> None:
        self._stopping = True
        for task in list(self._tasks):
            task.cancel()
        self._fail_jobs("the daemon is stopping")
        if self._writer is not None:
            self._writer.close()
        if self._proc is not None and self._proc.returncode is None:
            try:
                await asyncio.wait_for(self._proc.wait(), 5)
            except asyncio.TimeoutError:
                _kill(self._proc)
                await self._proc.wait()
        self._set_state("stopped")

    async def _spawn(self) -> None:
        parent, child = socket.socketpair()
        self._set_state("loading")
        self.info.pop("converted_tenths", None)
        placement = self._placement()
        self.threads = self.effective_threads()
        args = ["--fd", str(child.fileno()), "--model", str(self.model), "--dtype", self.dtype,
                "--threads", str(self.threads), "--backend", self.backend,
                "--cache-dir", str(self.cache_dir), "--context", str(self.context),
                "--parallel", str(self.parallel)]
        if self.mmap:
            args.append("--mmap")
        if placement.mem_bind_nodes:
            args += ["--mem-nodes", ",".join(map(str, placement.mem_bind_nodes))]
        self._proc = await asyncio.create_subprocess_exec(
            self.python, "-m", "dsr1d.engine.worker", *args, env=worker_environment(),
            pass_fds=(child.fileno(),), stdin=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE, limit=LINE_LIMIT)
        child.close()
        try:
            if placement.cpus:
                os.sched_setaffinity(self._proc.pid, placement.cpus)
        except OSError as exc:
            log.warning("cannot pin the engine to CPUs %s: %s", placement.cpus, exc.strerror)
        reader, self._writer = await asyncio.open_unix_connection(sock=parent, limit=LINE_LIMIT)
        self._last_pong = asyncio.get_running_loop().time()
        self._stderr.clear()
        self._spawn_task(self._read(reader, self._proc))
        self._spawn_task(self._forward_stderr(self._proc))
        log.info("engine worker %d started: %s, backend %s, dtype %s, %d thread(s); %s",
                 self._proc.pid, self.model, self.backend, self.dtype, self.threads,
                 describe(placement))

    def _placement(self) -> Placement:
        """One CPU per physical core of one NUMA node, within engine_cpus: the worker is pinned
        to all of them, and runs the effective thread count (which may change) on them."""
        placement = plan(read_topology(SysRoot(self.root)), self.cpus, 0,
                         sorted(os.sched_getaffinity(0)))
        self._cores = max(1, len(placement.cpus) or placement.threads)
        return placement

    # -- requests ----------------------------------------------------------------------------

    async def submit(self, prompt: str | list[dict[str, str]], options: dict[str, Any],
                     on_job: Callable[[Job], None] | None = None) -> Job:
        """Queue a generation of one user turn or a conversation (role/content dicts, the
        last the user's); tokens and the result arrive through the listeners. ``on_job`` sees
        the job before the worker does, so that no token can come before its listener."""
        if self.state not in ("ready", "busy"):
            raise EngineUnavailable(f"the engine is {self.state}"
                                    + (f": {self.info['error']}" if "error" in self.info else ""))
        clean = validate_options(options)
        job = Job(self._next_job, prompt, clean)
        self._next_job += 1
        self.jobs[job.id] = job
        if on_job is not None:
            on_job(job)
        await self._send(op="generate", job=job.id, prompt=prompt, options=clean)
        if self.state == "ready":
            self._set_state("busy")
        return job

    async def generate(self, prompt: str | list[dict[str, str]],
                       options: dict[str, Any]) -> dict[str, Any]:
        """Generate and wait for the result (text, reasoning, answer, stats)."""
        job = await self.submit(prompt, options)
        return await job.done

    async def cancel(self, job_id: int) -> None:
        if job_id not in self.jobs:
            raise InvalidArgument(f"no running or queued job {job_id}")
        await self._send(op="cancel", job=job_id)

    async def set_profile_threads(self, threads: int) -> None:
        """The profile's (or config's) wish, 0 = one per physical core of the placement."""
        self._wanted_threads = threads
        await self._apply_threads()

    async def set_thread_cap(self, cap: int | None) -> None:
        """A controller's ceiling on threads (None: no ceiling). The tokens-per-joule controller
        acts on frequency and PL1 today; a threads actuator would set its cap here, the one
        place the profile's count and a cap combine."""
        self.thread_cap = cap
        await self._apply_threads()

    def effective_threads(self) -> int:
        """The one place the thread count is decided: the profile's wish, within the
        placement's cores, under the controller's cap."""
        wanted = self._wanted_threads or self._cores
        if self.thread_cap is not None:
            wanted = min(wanted, self.thread_cap)
        return max(1, min(wanted, self._cores))

    async def _apply_threads(self) -> None:
        """A running job picks a change up before its next token."""
        threads = self.effective_threads()
        if threads == self.threads:
            return
        self.threads = threads
        if self._writer is not None and self.state in ("ready", "busy"):
            await self._send(op="threads", n=threads)
        self._changed(["Threads"])

    # -- worker events -----------------------------------------------------------------------

    async def _read(self, reader: asyncio.StreamReader, proc: asyncio.subprocess.Process) -> None:
        """Events until the worker's channel ends. Any failure of the channel — a line over the
        limit, a reset connection, garbage — means a broken worker: it is killed, and handled
        like any other death."""
        try:
            while line := await reader.readline():
                self._event(json.loads(line))
        except Exception as exc:
            log.error("engine worker %d: %s on its channel; killing it", proc.pid,
                      f"{type(exc).__name__}: {exc}"[:300])
        if proc.returncode is None:
            _kill(proc)
        code = await proc.wait()
        if not self._stopping:
            await self._died(proc, code)

    async def _died(self, proc: asyncio.subprocess.Process, code: int) -> None:
        """Answer every caller, release the engine's hold, then restart with back-off — or give
        up with the reason when it never got as far as ready."""
        why = f"signal {-code}" if code < 0 else f"exit status {code}"
        if code == -signal.SIGKILL:
            log.error("engine worker %d was killed (SIGKILL: out of memory, the health check "
                      "or an operator)", proc.pid)
        self._fail_jobs(f"the engine worker died ({why}); it is being restarted")
        if self.state == "failed":
            return
        if self.state in ("loading", "restarting"):
            self._load_failures += 1
        if self._load_failures >= MAX_LOAD_FAILURES:
            last = self._stderr[-1] if self._stderr else "no output"
            self.info["error"] = (f"the engine worker died {self._load_failures} times while "
                                  f"loading {self.model} (last: {why}; its last words: {last})")
            log.error("engine failed: %s", self.info["error"])
            self._set_state("failed")
            return
        delay = BACKOFF_S[min(self._restarts, len(BACKOFF_S) - 1)]
        self._restarts += 1
        log.error("engine worker %d died (%s); restarting in %d s", proc.pid, why, delay)
        self._set_state("restarting")
        await asyncio.sleep(delay)
        if not self._stopping:
            await self._spawn()

    async def _forward_stderr(self, proc: asyncio.subprocess.Process) -> None:
        """The worker's stderr (llama.cpp's warnings, a traceback) into the daemon's log; the
        last lines are kept for the reason of a failure."""
        assert proc.stderr is not None
        while True:
            try:
                line = await proc.stderr.readline()
            except ValueError:  # a line over the limit: keep reading what follows
                continue
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            if text:
                self._stderr.append(text[:500])
                log.warning("engine worker: %s", text[:2000])

    def _event(self, event: dict[str, Any]) -> None:
        kind = event["ev"]
        if kind == "pong":
            self._last_pong = asyncio.get_running_loop().time()
        elif kind == "loading":
            log.info("engine loading %s: %.1f/%.1f GB", event["file"], event["done"] / 1e9,
                     event["total"] / 1e9)
        elif kind == "converting":
            self._log_conversion(event["done"], event["total"], event["file"])
        elif kind == "log":
            log.info("engine: %s", event["message"])
        elif kind == "ready":
            self.info = {k: v for k, v in event.items() if k != "ev"}
            self._restarts = 0
            self._load_failures = 0
            log.info("engine ready: %s as %s (%s) on %s (%s), %d thread(s)", event["model"],
                     event["dtype"], event["dtype_reason"], event.get("backend", "?"),
                     event.get("backend_reason", ""), event["threads"])
            self._set_state("ready")
            self._changed(["Model", "Threads"])
        elif kind == "token":
            self.tokens_seen += 1
            for listener in self.token_listeners:
                _call(listener, event["job"], event["piece"])
        elif kind == "text":
            job = self.jobs.get(event["job"])
            if job is not None:
                job.text.append(event["chunk"])
        elif kind == "finished":
            self._finish(event)
        elif kind == "error":
            self._error(event)

    def _log_conversion(self, done: int, total: int, name: str) -> None:
        """Conversion progress, once per tenth (a 7B model has ~340 tensors)."""
        tenth = 10 * done // max(total, 1)
        if tenth > self.info.get("converted_tenths", -1):
            self.info["converted_tenths"] = tenth
            log.info("engine converting to GGUF: %d %% (%s of %s, %s)", 10 * tenth,
                     human_size(done), human_size(total), name)

    def _finish(self, event: dict[str, Any]) -> None:
        job = self.jobs.pop(event["job"], None)
        stats = dict(event["stats"])
        text = ""
        if job is not None:
            text = "".join(job.text)
        if stats.get("decode_tokens_per_s"):
            self.tokens_per_s = float(stats["decode_tokens_per_s"])
            self._changed(["TokensPerSecond"])
        for listener in self.finished_listeners:
            _call(listener, event["job"], stats)
        if job and not job.done.done():
            job.done.set_result({"text": text, "stats": stats})
        self._idle_if_done()

    def _error(self, event: dict[str, Any]) -> None:
        if event.get("job") is None:
            self.info["error"] = event["message"]
            log.error("engine cannot start: %s", event["message"])
            self._set_state("failed")
            return
        job = self.jobs.pop(event["job"], None)
        exc = {"InvalidArgument": InvalidArgument, "Cancelled": Cancelled}.get(
            event["name"], EngineUnavailable)(event["message"])
        reason = "cancelled" if event["name"] == "Cancelled" else "error"
        for listener in self.finished_listeners:
            _call(listener, event["job"], {"error": event["message"], "finish_reason": reason})
        if job and not job.done.done():
            job.done.set_exception(exc)
        self._idle_if_done()

    # -- internals ---------------------------------------------------------------------------

    async def _send(self, **message: Any) -> None:
        if self._writer is None:
            raise EngineUnavailable(f"the engine is {self.state}")
        try:
            self._writer.write((json.dumps(message) + "\n").encode())
            await self._writer.drain()
        except (ConnectionError, OSError) as exc:
            raise EngineUnavailable(f"the engine worker is gone ({exc})") from None

    async def _health(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.ping_timeout_s / 3)
            if self.state not in ("ready", "busy") or self._proc is None:
                continue
            if loop.time() - self._last_pong > self.ping_timeout_s:
                log.error("engine worker %d stopped answering pings; killing it", self._proc.pid)
                _kill(self._proc)
                continue
            try:
                await self._send(op="ping")
            except EngineUnavailable:
                pass

    def _fail_jobs(self, message: str) -> None:
        for job in self.jobs.values():
            if not job.done.done():
                job.done.set_exception(EngineUnavailable(message))
            for listener in self.finished_listeners:
                _call(listener, job.id, {"error": message, "finish_reason": "error"})
        self.jobs.clear()
        self._writer = None
        for listener in self.busy_listeners:
            listener(False)

    def _idle_if_done(self) -> None:
        if not self.jobs and self.state == "busy":
            self._set_state("ready")

    def _set_state(self, state: str) -> None:
        if state == self.state:
            return
        was_busy = self.state == "busy"
        self.state = state
        if (state == "busy") != was_busy:
            for listener in self.busy_listeners:
                listener(state == "busy")
        self._changed(["State"])

    def _changed(self, names: list[str]) -> None:
        for listener in self.change_listeners:
            listener(names)

    def _spawn_task(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


def _kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the worker without reaping it.

    ``Process.kill()`` polls first (subprocess's guard against signalling a reaped pid), and
    that poll can reap a worker that has just died, before asyncio's child watcher sees it: the
    watcher then reports exit status 255 and the real cause (signal 9: the OOM killer) is lost.
    Until the watcher reaps it the pid cannot be reused, so a plain kill is safe."""
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
