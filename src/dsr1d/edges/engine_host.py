"""The daemon's side of the engine: runs and supervises llama-server (no torch here).

Start: ``python -m dsr1d.engine.prepare`` makes the model ready (a Hugging Face directory
converted to GGUF once, the file checked, the memory counted; `dsr1d.engine.messages`), then
llama-server — built from dsr1d's patched llama.cpp — serves it on a private unix socket
(directory 0700, socket 0600) with the placement `engine_command` spells out. Health: its
``/health`` is asked every third of ``ping_timeout_s``; a server that exits, or answers nothing
for ``ping_timeout_s``, is killed and started again after a back-off. A model that fails to load
is retried the same way, the back-off growing, the reason kept in ``info["error"]`` and the log;
it is never given up for good, and `reload` retries at once. While it is busy, each health
check also reads its token counters (``/metrics``) and its slots (``/slots``): the decode rate,
and the bytes a decoded token reads (`bytes_per_token`: the weights, and the KV cache that grows
with the context), so that the power controller does not read a long context as a loss.

Callers: the HTTP front passes requests to `socket` and brackets each with `begin`/`end` (the
engine's busy state, which holds the engine profile). ``org.dsr1d.Engine1`` jobs (`submit`,
`generate`, `cancel`) are streamed chat completions on the same server: their pieces go to the
token listeners as they arrive. Where the server split reasoning off (only models whose
template opens a think block), it comes first, between two pieces that are exactly ``<think>``
and ``</think>``; the answer follows. So a client tells the two apart without parsing text.
"""

from __future__ import annotations

import asyncio
import ctypes
import dataclasses
import json
import logging
import os
import signal
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import aiohttp

from dsr1d.constants import NGRAM
from dsr1d.contract.sysroot import SysRoot
from dsr1d.core.placement import Placement, describe, plan, read_topology
from dsr1d.numa import bind_memory
from dsr1d.edges import engine_calibrate, engine_command
from dsr1d import engine_messages as messages
from dsr1d.table import human_size

log = logging.getLogger("dsr1d")

PING_TIMEOUT_S = 30.0
BACKOFF_S = (1, 2, 5, 10, 30, 60)
STABLE_S = 60.0               # a server that served this long restarts without a grown back-off
STDERR_TAIL = 20
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MAX_PROMPT_BYTES = 4 << 20    # an Engine1 prompt, refused by its size before anything reads it
READ_LIMIT = 1 << 22          # one server-sent event (a long piece with its log-probabilities)
OPTIONS: dict[str, tuple[type, float | None, float | None]] = {
    "max_new_tokens": (int, 1, 1_000_000),
    "temperature": (float, 0.0, 2.0),
    "top_p": (float, 0.0, 1.0),
    "greedy": (bool, None, None),
    "ignore_eos": (bool, None, None),
    "seed": (int, 0, 2**32 - 1),
}


class EngineUnavailable(Exception):
    """The engine is not running (not configured, loading, restarting)."""


class InvalidArgument(Exception):
    """A request option is unknown, of the wrong type, or out of range; or the server refused
    the request (the prompt longer than the context, say)."""


class Cancelled(Exception):
    """The job was cancelled before it produced a result."""


class _LoadFailure(Exception):
    """The model could not be made ready, or the server died before it was."""


def validate_options(options: dict[str, Any]) -> dict[str, Any]:
    """Check ``Engine1`` generation options; InvalidArgument names the key and what is allowed."""
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


def request_body(prompt: str, options: dict[str, Any]) -> dict[str, Any]:
    """The chat completion an ``Engine1`` job is: one user turn, streamed, with usage."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}], "stream": True,
                            "stream_options": {"include_usage": True}}
    if "max_new_tokens" in options:
        body["max_tokens"] = options["max_new_tokens"]
    for key in ("temperature", "top_p", "seed", "ignore_eos"):
        if key in options:
            body[key] = options[key]
    if options.get("greedy"):
        body["temperature"] = 0.0
    return body


def _call(listener: Callable[..., None], *args: Any) -> None:
    """A listener's failure is logged; it never stops a job's result from being delivered."""
    try:
        listener(*args)
    except Exception:
        log.exception("engine event listener failed")


def physical_cores() -> int:
    """One decode thread per physical core (hyperthreads do not help decode)."""
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1


@dataclass
class Job:
    """An ``Engine1`` generation: its request, the pieces so far, the caller's future."""

    id: int
    prompt: str
    options: dict[str, Any]
    done: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    reasoning: list[str] = field(default_factory=list)
    answer: list[str] = field(default_factory=list)
    task: asyncio.Task | None = None


TokenListener = Callable[[int, str], None]
FinishedListener = Callable[[int, dict[str, Any]], None]
ChangeListener = Callable[[list[str]], None]
BusyListener = Callable[[bool], None]


async def sse_events(content: aiohttp.StreamReader) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a server-sent event stream, until ``[DONE]`` or its end."""
    while line := await content.readline():
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


def _pdeathsig() -> None:
    """In the child before exec: die with the daemon (a SIGKILLed daemon leaves no engine
    holding the model's memory), and start a session of its own."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class EngineHost:
    """Runs and supervises one llama-server, and runs ``Engine1`` jobs on it."""

    def __init__(self, model: Path, dtype: str = "auto", threads: int = 0,
                 cpus: list[int] | None = None, python: str = sys.executable,
                 backend: str = "auto", cache_dir: Path = Path("/var/cache/dsr1d"),
                 context: int = 0, mmap: bool = False, root: str = "/",
                 ping_timeout_s: float = PING_TIMEOUT_S, parallel: int = 1,
                 server: str = "", aliases: tuple[str, ...] = (),
                 embeddings: bool = False, draft: str = "", draft_max: int = 0,
                 flash_attn: str = "auto", kv_type: str = "auto") -> None:
        self.model = model
        self.flash_attn = flash_attn
        self.kv_type = kv_type
        self.draft = draft
        self.draft_max = draft_max
        self.dtype = dtype
        self.backend = backend
        self.cache_dir = cache_dir
        self.context = context
        self.mmap = mmap
        self.parallel = parallel
        self.root = root
        self.ping_timeout_s = ping_timeout_s
        self.server = server
        self.aliases = aliases
        self.embeddings = embeddings
        self.python = python
        self.cpus = cpus
        self._wanted_threads = threads
        self.thread_cap: int | None = None
        self._cores = 1
        self._placement()
        self.threads = self.effective_threads()
        self.state = "stopped"
        self.info: dict[str, Any] = {}
        self.tokens_per_s = 0.0
        self.tokens_seen = 0                 # the server's decoded tokens: a live decode rate
        self.prompt_tokens_seen = 0
        self.bytes_per_token: float | None = None   # read per decoded token now; None: idle
        self._read_costs: tuple[int, float] | None = None   # weight bytes, KV bytes a token
        self.restarts = 0
        self.jobs: dict[int, Job] = {}
        self.active = 0                      # requests and jobs in flight
        self.session: aiohttp.ClientSession | None = None
        self._next_job = 1
        self._proc: asyncio.subprocess.Process | None = None
        self._supervisor: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._restart_when_idle = False
        self._counters_stale = True
        self._stopping = False
        self._stderr: deque[str] = deque(maxlen=STDERR_TAIL)
        self._run_dir: Path | None = None
        self.token_listeners: list[TokenListener] = []
        self.finished_listeners: list[FinishedListener] = []
        self.change_listeners: list[ChangeListener] = []
        self.busy_listeners: list[BusyListener] = []

    @property
    def socket(self) -> Path | None:
        """llama-server's private socket (None before the first start)."""
        return self._run_dir / "llama.sock" if self._run_dir is not None else None

    def model_ids(self) -> list[str]:
        """What requests may call the model: its file's stem, then the configured aliases."""
        return self._ids(str(self.info.get("model") or self.model.stem))

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._stopping = False
        self._wake = asyncio.Event()
        self._run_dir = Path(tempfile.mkdtemp(prefix="dsr1d-engine-", dir=_runtime_dir()))
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        for job in list(self.jobs.values()):
            if job.task is not None:
                job.task.cancel()
        await self._end_server()
        if self._supervisor is not None:
            self._supervisor.cancel()
            try:
                await self._supervisor
            except asyncio.CancelledError:
                pass
        self._fail_jobs("the daemon is stopping")
        if self._run_dir is not None:
            for leftover in self._run_dir.iterdir():
                leftover.unlink(missing_ok=True)
            self._run_dir.rmdir()
            self._run_dir = None
        self._set_state("stopped")

    def reload(self) -> None:
        """Retry at once a model that is waiting out its back-off."""
        self._wake.set()

    async def _supervise(self) -> None:
        """Start the server, and again after each end, waiting a back-off that grows with
        every start that did not last and falls back once a server has served a while."""
        step = 0
        while not self._stopping:
            try:
                await self._run_once()
                why = None
            except _LoadFailure as exc:
                why = str(exc)
            if self._stopping:
                return
            if self._restart_when_idle:                # a new thread count: at once
                self._restart_when_idle = False
                continue
            ready_since = self.info.pop("ready_since", None)
            if ready_since is not None and time.monotonic() - ready_since > STABLE_S:
                step = 0                               # it served a while: a fresh start
            delay = BACKOFF_S[min(step, len(BACKOFF_S) - 1)]
            step += 1
            self.restarts += 1
            if why:
                self.info["error"] = why
                log.error("engine cannot start: %s; trying again in %d s", why, delay)
            self._set_state("restarting")
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def _run_once(self) -> None:
        """Prepare, start, serve until the server ends; _LoadFailure before it was ready."""
        self._set_state("loading")
        prepared = await self._prepare()
        draft = await self._prepare_draft(prepared)
        binary = engine_command.find_binary(self.server)
        if binary is None:
            raise _LoadFailure("llama-server is not installed (make setup builds it; or set "
                               "engine_server = PATH in [daemon])")
        placement = self._placement()
        self.threads = self.effective_threads()
        assert self.socket is not None
        self.socket.unlink(missing_ok=True)
        spec = engine_command.ServerSpec(
            Path(prepared.gguf), self.socket, self.threads, prepared.context, self.parallel,
            placement.cpus, self.mmap, tuple(self._ids(prepared.name)), self.embeddings,
            draft, self.draft == NGRAM, self.draft_max, kv_type=self.kv_type)
        spec = await self._with_attention(spec, binary)
        self._read_costs = (prepared.weight_bytes,
                            engine_command.kv_bytes_per_token(spec, prepared.kv_elements))
        nodes = placement.mem_bind_nodes

        def child() -> None:
            _pdeathsig()
            if nodes:
                bind_memory(nodes)   # the memory policy survives exec

        self._stderr.clear()
        try:
            self._proc = await asyncio.create_subprocess_exec(
                str(binary), *engine_command.arguments(spec), env=engine_command.environment(),
                stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, umask=0o077, preexec_fn=child,
                start_new_session=True)
        except OSError as exc:
            raise _LoadFailure(f"cannot run {binary}: {exc.strerror or exc}") from None
        proc = self._proc
        stderr = asyncio.get_running_loop().create_task(self._forward_stderr(proc))
        log.info("engine: llama-server %d serving %s (%s), %d thread(s), %d slot(s) of %d "
                 "tokens; %s", proc.pid, prepared.gguf, prepared.file_type, self.threads,
                 self.parallel, prepared.context, describe(placement))
        self.session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(self.socket), limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), read_bufsize=READ_LIMIT)
        try:
            await self._until_ready(proc, prepared)
            await self._watch(proc)
        finally:
            session, self.session = self.session, None
            self.bytes_per_token = None
            self._fail_jobs(self._death_note(proc))
            await session.close()
            await stderr

    def _ids(self, name: str) -> list[str]:
        """``name`` first, then the configured aliases."""
        return [name] + [a for a in self.aliases if a != name]

    async def _with_attention(self, spec: engine_command.ServerSpec,
                              binary: Path) -> engine_command.ServerSpec:
        """``spec`` with flash attention and the KV cache's type as configured, or measured
        where ``auto`` (`engine_calibrate`), and said why."""
        measured = engine_calibrate.candidates(self.flash_attn, self.kv_type)
        if len(measured) == 1:
            (fa, kv), why = measured[0], "engine_flash_attn and engine_kv_type"
        else:
            try:
                (fa, kv), why = await engine_calibrate.attention(spec, binary, self.cache_dir,
                                                                 measured)
            except (OSError, KeyError, ValueError, aiohttp.ClientError) as exc:
                fa = "" if self.flash_attn == "auto" else self.flash_attn
                kv = "f16" if self.kv_type == "auto" else self.kv_type
                why = f"measuring failed ({exc}); llama-server's own choice, or as configured"
        chosen = dataclasses.replace(spec, flash_attn=fa, kv_type=kv)
        k, v = engine_command.kv_types(chosen)
        cache = kv if k == v else f"K {k}, V {v} (no quantised V without flash attention)"
        log.info("engine: flash attention %s, KV cache %s: %s", fa or "auto", cache, why)
        self.info["flash_attn"] = fa or "auto"
        self.info["kv_type"] = kv
        return chosen

    async def _prepare(self) -> messages.Prepared:
        """The served model, prepared; what it is goes into ``info``."""
        outcome = await self._prepared(self.model, self.context)
        self.info.update(model=outcome.name, dtype=outcome.file_type, gguf=outcome.gguf,
                         dtype_reason=outcome.dtype_reason, parameters=outcome.parameters,
                         context=outcome.context, thinks=outcome.thinks)
        return outcome

    async def _prepare_draft(self, target: messages.Prepared) -> Path | None:
        """The draft model's file (prepared like the served one, for the same context), or
        None without one; ``info["speculative"]`` says which kind of speculation runs."""
        if self.draft in ("", NGRAM):
            self.info["speculative"] = "ngram" if self.draft == NGRAM else "off"
            return None
        outcome = await self._prepared(Path(self.draft), target.context)
        self.info["speculative"] = f"draft {outcome.name} ({outcome.file_type})"
        return Path(outcome.gguf)

    async def _prepared(self, model: Path, context: int) -> messages.Prepared:
        """The preparation process's outcome; conversion progress and notes to the log."""
        proc = await asyncio.create_subprocess_exec(
            self.python, "-m", "dsr1d.engine.prepare", "--model", str(model),
            "--dtype", self.dtype, "--cache-dir", str(self.cache_dir),
            "--context", str(context), "--parallel", str(self.parallel),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, limit=1 << 20)
        assert proc.stdout is not None and proc.stderr is not None
        outcome: messages.Message | None = None
        tenth = -1
        while line := await proc.stdout.readline():
            try:
                outcome = messages.decode(line)
            except ValueError:
                continue
            if isinstance(outcome, messages.Progress):
                done = 10 * outcome.done // max(outcome.total, 1)
                if done > tenth:
                    tenth = done
                    log.info("engine converting to GGUF: %d %% (%s of %s, %s)", 10 * done,
                             human_size(outcome.done), human_size(outcome.total), outcome.file)
            elif isinstance(outcome, messages.Note):
                log.info("engine: %s", outcome.message)
        err = (await proc.stderr.read()).decode(errors="replace").strip().splitlines()
        code = await proc.wait()
        if isinstance(outcome, messages.Failed):
            raise _LoadFailure(outcome.message)
        if not isinstance(outcome, messages.Prepared):
            last = err[-1] if err else f"exit status {code}"
            raise _LoadFailure(f"preparing {model} failed: {last}"[:2000])
        return outcome

    async def _until_ready(self, proc: asyncio.subprocess.Process,
                           prepared: messages.Prepared) -> None:
        """Poll ``/health`` until the model is loaded; _LoadFailure if the server ends first."""
        while True:
            if proc.returncode is not None:
                raise _LoadFailure(self._death_note(proc))
            if await self._healthy():
                break
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), 0.2)
            except asyncio.TimeoutError:
                pass
        await self._build_info()
        self.info.pop("error", None)
        self.info["parallel"] = self.parallel
        self.info["threads"] = self.threads
        self.info["server_pid"] = proc.pid
        self.info["ready_since"] = time.monotonic()
        log.info("engine ready: %s (%s, %s), %d thread(s), speculative decoding: %s",
                 prepared.name, prepared.file_type, prepared.dtype_reason, self.threads,
                 self.info.get("speculative", "off"))
        self._set_state("busy" if self.active else "ready")
        self._changed(["Model", "Threads"])

    async def _watch(self, proc: asyncio.subprocess.Process) -> None:
        """Health and the token counters until the server ends (or is ended)."""
        last_ok = time.monotonic()
        period = max(0.2, min(1.0, self.ping_timeout_s / 3))
        while proc.returncode is None:
            try:
                await asyncio.wait_for(asyncio.shield(proc.wait()), period)
                break
            except asyncio.TimeoutError:
                pass
            if self._restart_when_idle and self.active == 0:
                log.info("engine: restarting llama-server with %d thread(s)", self.threads)
                await self._end_server()
                return
            # while it decodes, the counters' answer is the health check: each request to
            # llama-server costs its decode threads a little (at 10 a second, /health cost a
            # 1.5B decode 2.4 % of its tokens/s on 2 cores, /metrics 2.0 %, /slots 1.3 %)
            if self.active or self._counters_stale:      # idle: nothing can have moved them
                self._counters_stale = bool(self.active)
                ok = await self._poll_counters() or await self._healthy()
            else:
                ok = await self._healthy()
            if ok:
                last_ok = time.monotonic()
            elif time.monotonic() - last_ok > self.ping_timeout_s:
                log.error("engine: llama-server %d answered no health check for %.0f s; "
                          "killing it", proc.pid, self.ping_timeout_s)
                _kill(proc)
        if not self._stopping and not self._restart_when_idle:
            log.error("engine: %s", self._death_note(proc))

    def _death_note(self, proc: asyncio.subprocess.Process) -> str:
        code = proc.returncode
        if code is None:
            return "the engine is restarting"
        why = f"signal {-code}" if code < 0 else f"exit status {code}"
        if code == -signal.SIGKILL:
            why += " (SIGKILL: out of memory, the health check or an operator)"
        last = self._stderr[-1] if self._stderr else "no output"
        return f"llama-server ended ({why}; its last words: {last})"[:2000]

    async def _end_server(self) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except asyncio.TimeoutError:
            _kill(proc)
            await proc.wait()

    async def _healthy(self) -> bool:
        try:
            async with self._get("/health", timeout=self.ping_timeout_s) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, EngineUnavailable):
            return False

    def _get(self, path: str, timeout: float = 10.0) -> Any:
        if self.session is None:
            raise EngineUnavailable(f"the engine is {self.state}")
        return self.session.get(f"http://engine{path}",
                                timeout=aiohttp.ClientTimeout(total=timeout))

    async def _build_info(self) -> None:
        try:
            async with self._get("/props") as resp:
                props = await resp.json()
            self.info["build"] = str(props.get("build_info", ""))
            caps = str(props.get("chat_template_caps", ""))
            self.info["tools"] = "'supports_tools': True" in caps or '"supports_tools": true' in caps
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, EngineUnavailable):
            pass

    async def server_metrics(self) -> str:
        """llama-server's own Prometheus text (``llamacpp:…``), or "" when it has none now."""
        try:
            async with self._get("/metrics", timeout=5) as resp:
                return await resp.text() if resp.status == 200 else ""
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, EngineUnavailable):
            return ""

    async def _poll_counters(self) -> bool:
        """The decoded and prompt token counters (the closed loop's tokens/s); False when
        llama-server gave none."""
        text = await self.server_metrics()
        if not text:
            return False
        values = parse_counters(text)
        predicted = int(values.get("llamacpp:tokens_predicted_total", self.tokens_seen))
        self.prompt_tokens_seen = int(values.get("llamacpp:prompt_tokens_total",
                                                 self.prompt_tokens_seen))
        self.tokens_seen = max(self.tokens_seen, predicted)
        await self._poll_slots()
        return True

    async def _poll_slots(self) -> None:
        """What a decoded token reads now, from the slots' contexts (None while none decodes)."""
        figure = None
        if self.active and self._read_costs is not None:
            figure = bytes_per_token(await self._slots(), *self._read_costs)
        self.bytes_per_token = figure if self.active else None   # it may have ended meanwhile

    async def _slots(self) -> list[dict[str, Any]]:
        """llama-server's ``/slots`` (``--slots``), [] when it has no answer now."""
        try:
            async with self._get("/slots", timeout=5) as resp:
                slots = await resp.json() if resp.status == 200 else []
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, EngineUnavailable):
            return []
        return [s for s in slots if isinstance(s, dict)] if isinstance(slots, list) else []

    async def _forward_stderr(self, proc: asyncio.subprocess.Process) -> None:
        """llama-server's log: kept for the reason of a failure, in the daemon's debug log."""
        assert proc.stderr is not None
        while True:
            try:
                line = await proc.stderr.readline()
            except ValueError:    # a line over the limit: keep reading what follows
                continue
            if not line:
                return
            text = line.decode(errors="replace").rstrip()
            if text:
                self._stderr.append(text[:500])
                log.debug("llama-server: %s", text[:2000])

    # -- in-flight accounting ----------------------------------------------------------------

    def begin(self) -> None:
        """A request or job starts: the engine is busy (and holds the engine profile)."""
        self.active += 1
        if self.state == "ready":
            self._set_state("busy")

    def end(self) -> None:
        self.active = max(0, self.active - 1)
        if self.active == 0:
            self.bytes_per_token = None
            if self.state == "busy":
                self._set_state("ready")

    def available(self) -> None:
        """EngineUnavailable unless the server is up, with the reason it is not."""
        if self.state not in ("ready", "busy") or self.session is None:
            raise EngineUnavailable(f"the engine is {self.state}"
                                    + (f": {self.info['error']}" if "error" in self.info else ""))

    # -- Engine1 jobs ------------------------------------------------------------------------

    async def submit(self, prompt: str, options: dict[str, Any],
                     on_job: Callable[[Job], None] | None = None) -> Job:
        """Start a generation of one user turn; pieces and the end reach the listeners.
        ``on_job`` sees the job before its first piece can arrive."""
        size = len(prompt.encode())
        if size > MAX_PROMPT_BYTES:
            raise InvalidArgument(f"the prompt is {size} bytes; at most {MAX_PROMPT_BYTES}")
        self.available()
        clean = validate_options(options)
        job = Job(self._next_job, prompt, clean)
        # a Submit caller never awaits the result: its error is read here, not left for
        # asyncio to report as "Future exception was never retrieved"
        job.done.add_done_callback(lambda done: done.cancelled() or done.exception())
        self._next_job += 1
        self.jobs[job.id] = job
        if on_job is not None:
            on_job(job)
        job.task = asyncio.get_running_loop().create_task(self._run_job(job))
        return job

    async def generate(self, prompt: str, options: dict[str, Any]) -> dict[str, Any]:
        """Generate and wait for the result (text, reasoning, stats)."""
        job = await self.submit(prompt, options)
        return await job.done

    async def cancel(self, job_id: int) -> None:
        job = self.jobs.get(job_id)
        if job is None or job.task is None:
            raise InvalidArgument(f"no running or queued job {job_id}")
        job.task.cancel()

    async def _run_job(self, job: Job) -> None:
        self.begin()
        started = time.monotonic()
        first: float | None = None
        final: dict[str, Any] = {}
        try:
            assert self.session is not None
            async with self.session.post("http://engine/v1/chat/completions",
                                         json=request_body(job.prompt, job.options)) as resp:
                if resp.status != 200:
                    raise _refusal(resp.status, await resp.text())
                async for event in sse_events(resp.content):
                    if "error" in event:
                        raise EngineUnavailable(str(event["error"].get("message", event)))
                    for choice in event.get("choices") or []:
                        delta = choice.get("delta") or {}
                        if first is None and (delta.get("content") or
                                              delta.get("reasoning_content")):
                            first = time.monotonic()
                        self._pieces(job, delta)
                        if choice.get("finish_reason"):
                            final["finish_reason"] = choice["finish_reason"]
                    final.update({k: event[k] for k in ("usage", "timings") if k in event})
        except asyncio.CancelledError:
            self._finish_error(job, Cancelled("the job was cancelled"), "cancelled")
            raise
        except (InvalidArgument, EngineUnavailable) as exc:
            self._finish_error(job, exc, "error")
            return
        except (aiohttp.ClientError, OSError, ValueError, AssertionError) as exc:
            self._finish_error(job, EngineUnavailable(f"the engine went away ({exc})"), "error")
            return
        finally:
            self.end()
        self._finish(job, final, started, first)

    def _pieces(self, job: Job, delta: dict[str, Any]) -> None:
        reasoning, content = delta.get("reasoning_content"), delta.get("content")
        if reasoning:
            if not job.reasoning:
                self._emit(job.id, THINK_OPEN)
            job.reasoning.append(reasoning)
            self._emit(job.id, reasoning)
        if content:
            if job.reasoning and not job.answer:
                self._emit(job.id, THINK_CLOSE)
            job.answer.append(content)
            self._emit(job.id, content)

    def _emit(self, job: int, piece: str) -> None:
        for listener in self.token_listeners:
            _call(listener, job, piece)

    def _finish(self, job: Job, final: dict[str, Any], started: float,
                first: float | None) -> None:
        self.jobs.pop(job.id, None)
        timings, usage = final.get("timings") or {}, final.get("usage") or {}
        reasoning, answer = "".join(job.reasoning), "".join(job.answer)
        rate = float(timings.get("predicted_per_second") or 0.0)
        stats = {
            "finish_reason": final.get("finish_reason", "stop"),
            "new_tokens": int(usage.get("completion_tokens", timings.get("predicted_n", 0))),
            "prompt_tokens": int(usage.get("prompt_tokens", timings.get("prompt_n", 0))),
            "first_token_latency_s": (first or time.monotonic()) - started,
            "decode_tokens_per_s": rate, "reasoning": reasoning,
            "reasoning_chars": len(reasoning), "answer_chars": len(answer),
            "dtype": str(self.info.get("dtype", "")), "backend": "llama-server",
            "threads": self.threads, "model": str(self.info.get("model", ""))}
        if rate:
            self.tokens_per_s = rate
            self._changed(["TokensPerSecond"])
        for listener in self.finished_listeners:
            _call(listener, job.id, stats)
        if not job.done.done():
            job.done.set_result({"text": answer, "reasoning": reasoning, "stats": stats})

    def _finish_error(self, job: Job, exc: Exception, reason: str) -> None:
        if self.jobs.pop(job.id, None) is None:
            return
        for listener in self.finished_listeners:
            _call(listener, job.id, {"error": str(exc), "finish_reason": reason})
        if not job.done.done():
            job.done.set_exception(exc)

    def _fail_jobs(self, message: str) -> None:
        for job in list(self.jobs.values()):
            if job.task is not None and not job.task.done():
                job.task.cancel()
            self._finish_error(job, EngineUnavailable(message), "error")

    # -- threads -----------------------------------------------------------------------------

    async def set_profile_threads(self, threads: int) -> None:
        """The profile's (or config's) wish, 0 = one per physical core of the placement."""
        self._wanted_threads = threads
        self._apply_threads()

    async def set_thread_cap(self, cap: int | None) -> None:
        """A controller's ceiling on threads (None: no ceiling)."""
        self.thread_cap = cap
        self._apply_threads()

    def effective_threads(self) -> int:
        """The one place the thread count is decided: the profile's wish, within the
        placement's cores, under the controller's cap."""
        wanted = self._wanted_threads or self._cores
        if self.thread_cap is not None:
            wanted = min(wanted, self.thread_cap)
        return max(1, min(wanted, self._cores))

    def _apply_threads(self) -> None:
        """llama-server takes its thread count at start: a change restarts it once it is
        idle (requests in flight finish first)."""
        threads = self.effective_threads()
        if threads == self.threads:
            return
        self.threads = threads
        if self.state in ("ready", "busy"):
            self._restart_when_idle = True
        self._changed(["Threads"])

    def _placement(self) -> Placement:
        """One CPU per physical core of one NUMA node, within engine_cpus."""
        placement = plan(read_topology(SysRoot(self.root)), self.cpus, 0,
                         sorted(os.sched_getaffinity(0)))
        self._cores = max(1, len(placement.cpus) or placement.threads)
        return placement

    # -- internals ---------------------------------------------------------------------------

    def _set_state(self, state: str) -> None:
        if state == self.state:
            return
        was_busy = self.state == "busy"
        self.state = state
        if (state == "busy") != was_busy:
            for listener in self.busy_listeners:
                _call(listener, state == "busy")
        self._changed(["State"])

    def _changed(self, names: list[str]) -> None:
        for listener in self.change_listeners:
            _call(listener, names)


def parse_counters(text: str) -> dict[str, float]:
    """``name value`` lines of a Prometheus text, labels and comments left out."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.partition(" ")
            try:
                values[name] = float(value.split()[0])
            except (ValueError, IndexError):
                continue
    return values


def bytes_per_token(slots: list[dict[str, Any]], weights: int,
                    kv_token: float) -> float | None:
    """Bytes read per generated token: each decode step reads the weights once for all the
    slots decoding and each slot's KV cache, ``(weights + kv_token x contexts) / slots``; None
    while no slot decodes. A slot's context is its ``n_prompt_tokens``: llama-server counts
    there every token in the slot's cache, the ones it generated (``n_decoded``) included."""
    contexts = [int(s.get("n_prompt_tokens") or 0) for s in slots if _decoding(s)]
    if not contexts:
        return None
    return (weights + kv_token * sum(contexts)) / len(contexts)


def _decoding(slot: dict[str, Any]) -> bool:
    """A slot generating tokens: one still reading its prompt generates none yet."""
    steps = slot.get("next_token") or [{}]
    return bool(slot.get("is_processing")) and int(steps[0].get("n_decoded") or 0) > 0


def _refusal(status: int, body: str) -> Exception:
    """The server's error reply as the caller's exception."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body[:300] or f"HTTP {status}"
    return InvalidArgument(message) if 400 <= status < 500 else EngineUnavailable(message)


def _runtime_dir() -> str:
    """Where the server's private socket folder goes: systemd's RuntimeDirectory, else
    /run/dsr1d when it can be written, else the temporary folder (short paths: a unix socket's
    path has at most 107 bytes)."""
    for candidate in (os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0], "/run/dsr1d"):
        if candidate:
            try:
                os.makedirs(candidate, mode=0o755, exist_ok=True)
                if os.access(candidate, os.W_OK):
                    return candidate
            except OSError:
                continue
    return tempfile.gettempdir()


def _kill(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL without reaping (``Process.kill()`` may reap it first and lose the cause)."""
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
