"""The OpenAI-compatible HTTP API (aiohttp, on the daemon's event loop).

``POST /v1/chat/completions`` (multi-turn ``messages``, ``stream`` as server-sent events,
``max_tokens``, ``temperature``, ``top_p``, ``seed``, ``stop``, ``usage``; the reasoning as
``reasoning_content``, as DeepSeek's API returns it, in the stream deltas too), ``POST
/v1/completions`` (the prompt as one user turn), ``GET /v1/models``, ``GET /health`` and ``GET
/metrics`` (Prometheus text). Earlier assistant turns go back to the model without their
reasoning, as DeepSeek advises. Errors come in OpenAI's shape, ``{"error": {"message", "type",
"param", "code"}}``, with 400, 401, 403, 404, 429 or 503; a failure of ours is a 500 with one
line, never a traceback.

Who may call: on the unix socket the caller's uid comes from ``SO_PEERCRED`` and the rule is
D-Bus's (root, the ``dsr1d`` group, or polkit's ``org.dsr1d.run-inference``); on TCP every
request carries ``Authorization: Bearer KEY`` with a key from the root-only keys file. A
request's text never reaches the log or the metrics. A client that disconnects cancels its job.
The engine runs one generation at a time; up to ``queue`` more wait, the rest get 429.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

from aiohttp import web

from dsr1d.edges.engine_host import Cancelled, EngineHost, EngineUnavailable, InvalidArgument
from dsr1d.edges.metrics import Metrics
from dsr1d.textstream import THINK_CLOSE, ThinkSplitter

log = logging.getLogger("dsr1d")

MAX_BODY_BYTES = 4 << 20
MAX_STOPS = 4
FINISH = {"eos": "stop", "length": "length", "stop": "stop", "cancelled": "stop"}
Authorize = Callable[[int, int], Awaitable[bool]]     # (pid, uid) -> may run inference


class ApiError(Exception):
    """An error reply: HTTP status, OpenAI error type and code, one line of message."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type_, code, param

    def response(self) -> web.Response:
        body = {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}
        return web.json_response(body, status=self.status)


def strip_reasoning(content: str) -> str:
    """An earlier assistant turn without its reasoning (everything up to ``</think>``)."""
    index = content.find(THINK_CLOSE)
    return content[index + len(THINK_CLOSE):].lstrip() if index >= 0 else content


def parse_messages(raw: Any) -> list[dict[str, str]]:
    """OpenAI ``messages`` as the engine's conversation; ApiError 400 with the reason."""
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, "messages must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
            raise ApiError(400, f"messages[{i}]: role must be system, user or assistant",
                           param="messages")
        content = m.get("content")
        if isinstance(content, list):      # content parts: the text ones
            content = "".join(p.get("text", "") for p in content
                              if isinstance(p, dict) and p.get("type") == "text")
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}]: content must be a string", param="messages")
        if m["role"] == "assistant":
            content = strip_reasoning(content)
        out.append({"role": m["role"], "content": content})
    if out[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", param="messages")
    return out


def parse_options(body: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Engine options and stop strings from an OpenAI request body."""
    options: dict[str, Any] = {}
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    if limit is not None:
        options["max_new_tokens"] = limit
    for key in ("temperature", "top_p", "seed"):
        if body.get(key) is not None:
            options[key] = body[key]
    if isinstance(body.get("ignore_eos"), bool):     # vLLM's extension: decode to max_tokens
        options["ignore_eos"] = body["ignore_eos"]
    if options.get("temperature") == 0:
        options["greedy"] = True
        del options["temperature"]
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1", param="n")
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or \
            not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop must be a string or up to {MAX_STOPS} non-empty strings",
                       param="stop")
    return options, stops


@dataclass
class Run:
    """One job's pieces as they arrive, split into reasoning and answer, cut at a stop string."""

    job: int
    stops: list[str]
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    splitter: ThinkSplitter = field(default_factory=ThinkSplitter)
    answer: str = ""
    sent_answer: int = 0
    stopped: bool = False

    def feed(self, piece: str) -> list[tuple[str, str]]:
        """Pieces ready to send; an answer piece is held back while it may begin a stop."""
        out: list[tuple[str, str]] = []
        for kind, text in self.splitter.feed(piece):
            if kind == "reasoning":
                out.append((kind, text))
            else:
                out += self._answer(text)
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for kind, text in self.splitter.finish():
            out += [(kind, text)] if kind == "reasoning" else self._answer(text)
        if not self.stopped and self.sent_answer < len(self.answer):
            out.append(("answer", self.answer[self.sent_answer:]))
            self.sent_answer = len(self.answer)
        return out

    def _answer(self, text: str) -> list[tuple[str, str]]:
        if self.stopped:
            return []
        self.answer += text
        cut = min((i for i in (self.answer.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.answer, self.stopped = self.answer[:cut], True
        hold = 0 if self.stopped else max((len(s) - 1 for s in self.stops), default=0)
        ready = max(self.sent_answer, len(self.answer) - hold)
        piece = self.answer[self.sent_answer:ready]
        self.sent_answer = ready
        return [("answer", piece)] if piece else []


class Api:
    """The routes, bound to one engine host (or none), the authoriser and the metrics."""

    def __init__(self, engine: EngineHost | None, authorize: Authorize, metrics: Metrics,
                 keys: set[str] | None = None, queue: int = 16) -> None:
        self.engine = engine
        self.authorize = authorize
        self.metrics = metrics
        self.keys = keys or set()
        self.queue_limit = queue
        self.runs: dict[int, Run] = {}           # running and queued, by job id
        self._authorized: dict[tuple[int, int], tuple[bool, float]] = {}
        if engine is not None:
            engine.token_listeners.append(self._token)
        self.app = web.Application(client_max_size=MAX_BODY_BYTES,
                                   middlewares=[self._errors, self._access])
        self.app.add_routes([web.get("/health", self.health), web.get("/v1/models", self.models),
                             web.get("/metrics", self.metrics_text),
                             web.post("/v1/chat/completions", self.chat),
                             web.post("/v1/completions", self.completions)])

    # -- middlewares -------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            self.metrics.request(request.path, str(exc.status))
            return exc.response()
        except web.HTTPException as exc:
            if exc.status == 404:
                return ApiError(404, f"no route {request.method} {request.path}",
                                code="not_found").response()
            if exc.status == 405:
                return ApiError(405, f"{request.method} is not allowed on {request.path}",
                                code="method_not_allowed").response()
            if exc.status == 413:
                return ApiError(413, f"the request is over {MAX_BODY_BYTES} bytes").response()
            raise
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:   # ours: one line, never a traceback to the caller
            log.exception("API %s %s failed", request.method, request.path)
            self.metrics.request(request.path, "500")
            return ApiError(500, f"internal error: {type(exc).__name__}", "server_error").response()

    @web.middleware
    async def _access(self, request: web.Request, handler: Any) -> web.StreamResponse:
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if isinstance(peer, tuple):                      # TCP: an API key, always
            header = request.headers.get("Authorization", "")
            key = header[7:].strip() if header.startswith("Bearer ") else ""
            if not key or key not in self.keys:
                raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY",
                               "authentication_error", "invalid_api_key")
            return await handler(request)
        pid, uid = _peer_credentials(request)
        if not await self._allowed(pid, uid):
            raise ApiError(403, f"needs root, the dsr1d group or polkit authorisation "
                                f"(caller uid {uid})", "permission_error", "forbidden")
        return await handler(request)

    async def _allowed(self, pid: int, uid: int) -> bool:
        now = time.monotonic()
        cached = self._authorized.get((pid, uid))
        if cached is not None and now - cached[1] < 10.0:
            return cached[0]
        allowed = await self.authorize(pid, uid)
        self._authorized[(pid, uid)] = (allowed, now)
        return allowed

    # -- routes ------------------------------------------------------------------------------

    def slots(self) -> int:
        """Requests the engine decodes together (its ``parallel``)."""
        return int(self.engine.info.get("parallel", 1)) if self.engine is not None else 1

    def model_id(self) -> str:
        if self.engine is None:
            return "none"
        return str(self.engine.info.get("model") or Path(self.engine.model).name)

    async def health(self, request: web.Request) -> web.Response:
        state = self.engine.state if self.engine is not None else "none"
        ok = state in ("ready", "busy")
        self.metrics.request("/health", "200" if ok else "503")
        defaults = self.engine.info.get("sampling", {}) if self.engine is not None else {}
        return web.json_response({"status": "ok" if ok else "unavailable", "engine": state,
                                  "model": self.model_id(), "sampling_defaults": defaults},
                                 status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        data = [] if self.engine is None else [{"id": self.model_id(), "object": "model",
                                                "created": 0, "owned_by": "dsr1d"}]
        self.metrics.request("/v1/models", "200")
        return web.json_response({"object": "list", "data": data})

    async def metrics_text(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        messages = parse_messages(body.get("messages"))
        return await self._serve(request, body, messages, "chat.completion", "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await _json(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise ApiError(400, "prompt must be a non-empty string", param="prompt")
        return await self._serve(request, body, [{"role": "user", "content": prompt}],
                                 "text_completion", "/v1/completions")

    # -- serving one request -----------------------------------------------------------------

    def _check(self, body: dict[str, Any]) -> EngineHost:
        engine = self.engine
        if engine is None or engine.state not in ("ready", "busy"):
            state = engine.state if engine is not None else "not configured"
            raise ApiError(503, f"the engine is {state}", "server_error", "engine_unavailable")
        model = body.get("model")
        if model not in (None, "", self.model_id()):
            raise ApiError(404, f"the model {model!r} does not exist here; "
                                f"served: {self.model_id()}", code="model_not_found",
                           param="model")
        if len(self.runs) >= self.slots() + self.queue_limit:
            raise ApiError(429, f"{len(self.runs)} request(s) running or queued; try again "
                                "later", "rate_limit_error", "queue_full")
        return engine

    async def _serve(self, request: web.Request, body: dict[str, Any],
                     messages: list[dict[str, str]], kind: str, path: str) -> web.StreamResponse:
        engine = self._check(body)
        options, stops = parse_options(body)
        stream = bool(body.get("stream"))
        started = time.monotonic()

        made: list[int] = []

        def register(job: Any) -> None:      # before the worker sees it: no token is lost
            self.runs[job.id] = Run(job.id, stops)
            made.append(job.id)

        try:
            job = await engine.submit(messages, options, register)
        except (InvalidArgument, EngineUnavailable) as exc:
            for job_id in made:
                self.runs.pop(job_id, None)
            if isinstance(exc, InvalidArgument):
                raise ApiError(400, str(exc)) from None
            raise ApiError(503, str(exc), "server_error", "engine_unavailable") from None
        run = self.runs[job.id]
        self.metrics.active(len(self.runs), self.slots())
        outcome: str | None = "499"            # the client left before the end
        try:
            if stream:
                response = await self._stream(request, engine, job, run, kind, body, started)
            else:
                response = await self._whole(engine, job, run, kind, started)
            outcome = "200"
            return response
        except ApiError:
            outcome = None                      # counted with its status by the middleware
            raise
        finally:
            self.runs.pop(job.id, None)
            self.metrics.active(len(self.runs), self.slots())
            if outcome is not None:
                self.metrics.request(path, outcome)
            if not job.done.done():            # the caller left, or we failed: free the slot
                try:
                    await engine.cancel(job.id)
                except (InvalidArgument, EngineUnavailable):
                    pass

    def _token(self, job: int, piece: str) -> None:
        run = self.runs.get(job)
        if run is not None:
            run.queue.put_nowait(piece)

    async def _pieces(self, engine: EngineHost, job: Any, run: Run,
                      started: float) -> AsyncIterator[tuple[str, str]]:
        """(kind, text) as they come; then the job's result is in ``job.done``."""
        last = None
        # the job's end comes after its last piece (one worker stream, read in order): a None
        # queued behind them, so a piece costs one queue get, not a task and a wait
        job.done.add_done_callback(lambda _: run.queue.put_nowait(None))
        while (piece := await run.queue.get()) is not None:
            now = time.monotonic()
            if last is None:
                self.metrics.first_token(now - started)
            else:
                self.metrics.inter_token(now - last)
            last = now
            for text in run.feed(piece):
                yield text
            if run.stopped:
                await engine.cancel(job.id)
                break
        for piece in run.finish():
            yield piece

    async def _result(self, job: Any, run: Run) -> dict[str, Any]:
        try:
            result = await job.done
        except Cancelled:
            if run.stopped:
                return {"stats": {"finish_reason": "stop"}}
            raise ApiError(503, "the job was cancelled", "server_error", "cancelled") from None
        except InvalidArgument as exc:
            raise ApiError(400, str(exc)) from None
        except EngineUnavailable as exc:
            raise ApiError(503, str(exc), "server_error", "engine_unavailable") from None
        return result

    def _usage(self, stats: dict[str, Any]) -> dict[str, int]:
        prompt = int(stats.get("prompt_tokens", 0))
        completion = int(stats.get("new_tokens", 0))
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    async def _whole(self, engine: EngineHost, job: Any, run: Run, kind: str,
                     started: float) -> web.Response:
        reasoning, answer = [], []
        async for k, text in self._pieces(engine, job, run, started):
            (reasoning if k == "reasoning" else answer).append(text)
        stats = (await self._result(job, run))["stats"]
        finish = "stop" if run.stopped else FINISH.get(str(stats.get("finish_reason")), "stop")
        base = {"id": _id(kind, job.id), "object": kind, "created": int(time.time()),
                "model": self.model_id()}
        if "usage" in stats or stats.get("prompt_tokens") is not None:
            base["usage"] = self._usage(stats)
        content = "".join(answer)
        if kind == "text_completion":
            choice = {"index": 0, "text": content, "finish_reason": finish,
                      "reasoning_content": "".join(reasoning)}
        else:
            choice = {"index": 0, "finish_reason": finish,
                      "message": {"role": "assistant", "content": content,
                                  "reasoning_content": "".join(reasoning)}}
        return web.json_response({**base, "choices": [choice]})

    async def _stream(self, request: web.Request, engine: EngineHost, job: Any, run: Run,
                      kind: str, body: dict[str, Any], started: float) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        chunk_kind = "chat.completion.chunk" if kind == "chat.completion" else kind
        base = {"id": _id(kind, job.id), "object": chunk_kind, "created": int(time.time()),
                "model": self.model_id()}

        async def send(choice: dict[str, Any], **extra: Any) -> None:
            data = json.dumps({**base, "choices": [choice] if choice else [], **extra})
            await response.write(f"data: {data}\n\n".encode())

        if kind == "chat.completion":
            await send({"index": 0, "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None})
        async for k, text in self._pieces(engine, job, run, started):
            if kind == "chat.completion":
                delta = {"reasoning_content": text} if k == "reasoning" else {"content": text}
                await send({"index": 0, "delta": delta, "finish_reason": None})
            elif k == "answer":
                await send({"index": 0, "text": text, "finish_reason": None})
        try:
            stats = (await self._result(job, run))["stats"]
        except ApiError as exc:         # after the headers went: the error is the last event
            error = {"error": {"message": str(exc), "type": exc.type, "code": exc.code}}
            await response.write(f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode())
            return response
        finish = "stop" if run.stopped else FINISH.get(str(stats.get("finish_reason")), "stop")
        last = {"index": 0, "finish_reason": finish}
        last.update({"delta": {}} if kind == "chat.completion" else {"text": ""})
        await send(last)
        if (body.get("stream_options") or {}).get("include_usage"):
            await send({}, usage=self._usage(stats))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _id(kind: str, job: int) -> str:
    return f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-dsr1d-{os.getpid()}-{job}"


async def _json(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        raise ApiError(400, "the body is not JSON") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def _peer_credentials(request: web.Request) -> tuple[int, int]:
    sock = request.transport.get_extra_info("socket") if request.transport else None
    if sock is None:
        raise ApiError(403, "cannot tell who the caller is", "permission_error", "forbidden")
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _gid = struct.unpack("3i", raw)
    return pid, uid


def read_keys(path: str) -> set[str]:
    """API keys, one a line (``#`` comments); the file must be root's and private to it."""
    st = os.stat(path)
    if st.st_uid != 0 or st.st_mode & 0o077:
        raise PermissionError(f"{path}: API keys must be in a file owned by root, mode 0600 "
                              f"(it is uid {st.st_uid}, mode {st.st_mode & 0o777:04o})")
    keys = set()
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            line = line.strip()
            if line and not line.startswith("#"):
                keys.add(line)
    if not keys:
        raise ValueError(f"{path}: no API key in it")
    return keys


class ApiServer:
    """The API's sites: the unix socket (and TCP when configured)."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.runner = web.AppRunner(api.app, handler_cancellation=True, access_log=None)

    async def start(self, socket_path: str | None, tcp: str = "") -> list[str]:
        """Listen; returns where. An address that cannot be taken is logged, not fatal."""
        await self.runner.setup()
        where = []
        if socket_path:
            try:
                Path(socket_path).parent.mkdir(parents=True, exist_ok=True)
                if os.path.exists(socket_path):
                    os.unlink(socket_path)          # a stale socket of an earlier run
                site = web.UnixSite(self.runner, socket_path)
                await site.start()
                _restrict(socket_path)
                where.append(f"unix:{socket_path}")
            except OSError as exc:
                log.error("API socket %s: %s", socket_path, exc)
        if tcp:
            host, _, port = tcp.rpartition(":")
            try:
                site = web.TCPSite(self.runner, host.strip("[]"), int(port))
                await site.start()
                where.append(f"tcp:{tcp}")
            except OSError as exc:
                log.error("API on %s: %s", tcp, exc)
        return where

    async def stop(self) -> None:
        await self.runner.cleanup()


def _restrict(path: str) -> None:
    """Mode 0660, group dsr1d where that group exists (else root's only)."""
    import grp

    try:
        os.chown(path, 0, grp.getgrnam("dsr1d").gr_gid)
        os.chmod(path, 0o660)
    except KeyError:
        os.chmod(path, 0o600)
    except PermissionError as exc:      # not root (a test daemon): leave it to the umask
        log.warning("API socket %s: %s", path, exc)
