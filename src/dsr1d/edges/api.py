"""The OpenAI-compatible HTTP API: llama-server's, behind dsr1d's door (aiohttp).

What only the daemon adds is here: who may call (on the unix socket the caller's uid from
``SO_PEERCRED`` and D-Bus's rule: root, the ``dsr1d`` group, or polkit's
``org.dsr1d.run-inference``; on TCP ``Authorization: Bearer KEY`` with a key from the
root-only keys file, compared in constant time), a body that is checked before the engine sees
it (size, valid UTF-8 with no lone surrogate, nesting depth, message count, only parameters
llama-server honours: `openai_params`), the model's ids (the file's stem and the configured
aliases), per-request accounting and ``/metrics``. Everything else — sampling, tools, JSON
schema, log-probabilities, streaming, the reasoning split — is llama-server's: requests and
streams pass through unchanged, and a client that leaves cancels its generation.

Routes: ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/tokenize``,
``/detokenize``; ``GET /v1/models``, ``/props``, ``/metrics``; ``GET /slots`` for root only;
``GET /health`` for anyone, without a key (its status only). Errors come in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import socket
import struct
import time
from collections import deque
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
from aiohttp import web

from dsr1d.edges import openai_params
from dsr1d.edges.api_gate import Gate, Limits
from dsr1d.edges.engine_host import EngineHost, EngineUnavailable
from dsr1d.edges.metrics import Metrics

log = logging.getLogger("dsr1d")

_TAIL_BYTES = 65536   # a stream's end kept for its usage: the final event with timings is ~1 KiB

MAX_BODY_BYTES = 4 << 20
MAX_DEPTH = 32            # JSON nesting (a tool's schema is a few levels deep)
MAX_MESSAGES = 4096
BACKLOG = 128
Authorize = Callable[[int, int], Awaitable[bool]]     # (pid, uid) -> may run inference
OPEN = ("/health",)
PASSED = tuple(openai_params.ENDPOINT_FIELDS)


class ApiError(Exception):
    """An error reply: HTTP status, OpenAI error type and code, one line of message."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 code: str | None = None, param: str | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.type, self.code, self.param = status, type_, code, param
        self.close = close

    def response(self) -> web.Response:
        body = {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}
        response = web.json_response(body, status=self.status)
        if self.close:              # a caller without a key holds nothing after the answer
            response.force_close()
        return response


def check_text(value: Any, depth: int = 0) -> None:
    """Every string encodable as UTF-8 (no lone surrogate), nesting within MAX_DEPTH."""
    stack = [(value, depth)]
    while stack:
        item, level = stack.pop()
        if level > MAX_DEPTH:
            raise ApiError(400, f"the body nests deeper than {MAX_DEPTH} levels")
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ApiError(400, f"the body holds a lone surrogate ({item[exc.start]!a}): "
                                    f"text must be valid Unicode") from None
        elif isinstance(item, dict):
            stack += [(k, level + 1) for k in item] + [(v, level + 1) for v in item.values()]
        elif isinstance(item, list):
            stack += [(v, level + 1) for v in item]


def parse_body(raw: bytes) -> dict[str, Any]:
    """The request's JSON object, checked; ApiError 400 with the reason."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the body is not valid UTF-8 (byte {exc.start})") from None
    try:
        body = json.loads(text)
    except RecursionError:
        raise ApiError(400, f"the body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:
        raise ApiError(400, f"the body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    check_text(body)
    messages = body.get("messages")
    if isinstance(messages, list) and len(messages) > MAX_MESSAGES:
        raise ApiError(400, f"{len(messages)} messages: at most {MAX_MESSAGES}",
                       param="messages")
    return body


class Api:
    """The routes, bound to one engine host (or none), the authoriser and the metrics."""

    def __init__(self, engine: EngineHost | None, authorize: Authorize, metrics: Metrics,
                 keys: set[str] | None = None, queue: int = 16, gate: Gate | None = None) -> None:
        self.engine = engine
        self.gate = gate or Gate(Limits())
        self.authorize = authorize
        self.metrics = metrics
        self.keys = [k.encode() for k in keys or ()]
        self.queue_limit = queue
        self.inflight = 0
        self._authorized: dict[tuple[int, int], tuple[bool, float]] = {}
        self.app = web.Application(client_max_size=MAX_BODY_BYTES,
                                   middlewares=[self.gate.middleware, self._errors,
                                                self._access])
        self.app.add_routes([web.get("/health", self.health), web.get("/v1/models", self.models),
                             web.get("/metrics", self.metrics_text),
                             web.get("/props", self.props), web.get("/slots", self.slots)]
                            + [web.post(path, self.passed) for path in PASSED])

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
        if request.path in OPEN:
            return await handler(request)
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if isinstance(peer, tuple):                      # TCP: an API key, always
            if not self._key_ok(request.headers.get("Authorization", "")):
                raise ApiError(401, "a valid API key is needed: Authorization: Bearer KEY",
                               "authentication_error", "invalid_api_key", close=True)
            request["uid"] = None
            return await handler(request)
        pid, uid = _peer_credentials(request)
        if not await self._allowed(pid, uid):
            raise ApiError(403, f"needs root, the dsr1d group or polkit authorisation "
                                f"(caller uid {uid})", "permission_error", "forbidden")
        request["uid"] = uid
        return await handler(request)

    def _key_ok(self, header: str) -> bool:
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            return False
        given = key.strip().encode()
        # every key compared, each in constant time: no early exit tells which came close
        return sum(hmac.compare_digest(given, k) for k in self.keys) > 0

    async def _allowed(self, pid: int, uid: int) -> bool:
        now = time.monotonic()
        cached = self._authorized.get((pid, uid))
        if cached is not None and now - cached[1] < 10.0:
            return cached[0]
        allowed = await self.authorize(pid, uid)
        self._authorized[(pid, uid)] = (allowed, now)
        return allowed

    # -- routes of our own -------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        state = self.engine.state if self.engine is not None else "unconfigured"
        ok = state in ("ready", "busy")
        self.metrics.request("/health", "200" if ok else "503")
        status = "ok" if ok else ("loading" if state == "loading" else "unavailable")
        return web.json_response({"status": status}, status=200 if ok else 503)

    async def models(self, request: web.Request) -> web.Response:
        ids = self.engine.model_ids() if self.engine is not None else []
        self.metrics.request("/v1/models", "200")
        return web.json_response({"object": "list", "data": [
            {"id": i, "object": "model", "created": 0, "owned_by": "dsr1d"} for i in ids]})

    async def metrics_text(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.exposition()
        if self.engine is not None and self.engine.session is not None:
            body += (await self.engine.server_metrics()).encode()   # llama-server's own series
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def props(self, request: web.Request) -> web.StreamResponse:
        return await self._forward(request, "GET", "/props", b"", {})

    async def slots(self, request: web.Request) -> web.StreamResponse:
        if request.get("uid") != 0:
            raise ApiError(403, "/slots shows every caller's requests: root only, on the unix "
                                "socket", "permission_error", "forbidden")
        return await self._forward(request, "GET", "/slots", b"", {})

    # -- passed through ----------------------------------------------------------------------

    async def passed(self, request: web.Request) -> web.StreamResponse:
        try:
            raw = await asyncio.wait_for(request.read(), self.gate.limits.header_s)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request's body did not arrive within "
                                f"{self.gate.limits.header_s:.0f} s", close=True) from None
        body = parse_body(raw)
        refused = openai_params.unsupported(request.path, body)
        if refused is not None:
            raise ApiError(400, refused[1], param=refused[0], code="unsupported_parameter")
        self._check_model(body)
        self._check_tools(request.path, body)
        return await self._forward(request, "POST", request.path, raw, body)

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model in (None, "") or self.engine is None:
            return
        ids = self.engine.model_ids()
        if model not in ids:
            raise ApiError(404, f"the model {str(model)[:200]!r} does not exist here; served: "
                                f"{', '.join(ids)}", code="model_not_found", param="model")

    def _check_tools(self, path: str, body: dict[str, Any]) -> None:
        """llama-server drops ``tools`` silently when the model's template has no tool calls."""
        if path != "/v1/chat/completions" or self.engine is None or not body.get("tools"):
            return
        if self.engine.info.get("tools") is False:
            raise ApiError(400, "this model's chat template has no tool calls, so tools cannot "
                                "be honoured", param="tools", code="unsupported_parameter")

    def _engine(self) -> EngineHost:
        engine = self.engine
        if engine is None:
            raise ApiError(503, "the engine is not configured (set model= in "
                                "/etc/dsr1d/dsr1d.conf)", "server_error", "engine_unavailable")
        try:
            engine.available()
        except EngineUnavailable as exc:
            raise ApiError(503, str(exc), "server_error", "engine_unavailable") from None
        if self.inflight >= engine.parallel + self.queue_limit:
            raise ApiError(429, f"{self.inflight} request(s) running or queued; try again "
                                "later", "rate_limit_error", "queue_full")
        return engine

    async def _forward(self, request: web.Request, method: str, path: str, raw: bytes,
                       body: dict[str, Any]) -> web.StreamResponse:
        engine = self._engine()
        session = engine.session
        assert session is not None
        started = time.monotonic()
        self.inflight += 1
        engine.begin()
        self.metrics.active(self.inflight, engine.parallel)
        code = "499"                      # the client left before the end
        try:
            async with session.request(method, f"http://engine{path}", data=raw or None,
                                       headers={"Content-Type": "application/json"}) as up:
                code = str(up.status)
                if up.content_type == "text/event-stream":
                    return await self._stream(request, up, started)
                data = await up.read()
                if path in PASSED and up.status == 200:
                    self._account(data)
                return web.Response(body=data, status=up.status,
                                    headers={"Content-Type": up.headers.get(
                                        "Content-Type", "application/json")})
        except (aiohttp.ClientError, OSError) as exc:
            code = "503"
            raise ApiError(503, f"the engine went away ({type(exc).__name__}); it is being "
                                "restarted", "server_error", "engine_unavailable") from None
        finally:
            self.inflight -= 1
            engine.end()
            self.metrics.active(self.inflight, engine.parallel)
            if code != "503":
                self.metrics.request(path, code)

    async def _stream(self, request: web.Request, up: aiohttp.ClientResponse,
                      started: float) -> web.StreamResponse:
        response = web.StreamResponse(status=up.status, headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        last: float | None = None
        # the stream's last 64 KiB or more, where its usage comes: kept as chunks, since joining
        # every chunk to the tail copied 64 KiB a token once a reasoning stream had grown past it
        tail: deque[bytes] = deque()
        held = 0
        async for chunk in up.content.iter_any():
            await response.write(chunk)
            now = time.monotonic()
            if _has_text(chunk):
                if last is None:
                    self.metrics.first_token(now - started)
                else:
                    self.metrics.inter_token(now - last)
                last = now
            tail.append(chunk)
            held += len(chunk)
            while held - len(tail[0]) >= _TAIL_BYTES:
                held -= len(tail.popleft())
        self._account_stream(b"".join(tail))
        await response.write_eof()
        return response

    def _account(self, data: bytes) -> None:
        try:
            usage = json.loads(data).get("usage") or {}
        except (ValueError, AttributeError):
            return
        self.metrics.usage(int(usage.get("prompt_tokens", 0) or 0),
                           int(usage.get("completion_tokens", 0) or 0))

    def _account_stream(self, tail: bytes) -> None:
        for event in reversed(tail.split(b"\n\n")):
            if event.startswith(b"data: {") and (b'"usage"' in event or b'"timings"' in event):
                try:
                    final = json.loads(event[6:])
                except ValueError:
                    return
                usage = final.get("usage") or {}
                timings = final.get("timings") or {}
                self.metrics.usage(int(usage.get("prompt_tokens", timings.get("prompt_n", 0))),
                                   int(usage.get("completion_tokens",
                                                 timings.get("predicted_n", 0))))
                return


def _has_text(chunk: bytes) -> bool:
    """A stream chunk that carries generated text (not the opening role or the usage)."""
    return any(marker in chunk and (marker + b'"') not in chunk for marker in
               (b'"content":"', b'"reasoning_content":"', b'"text":"'))


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
    """The API's listeners: the unix socket (and TCP when configured), every connection
    admitted by the API's gate before aiohttp sees it."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.runner = web.AppRunner(api.app, handler_cancellation=True, access_log=None,
                                    keepalive_timeout=api.gate.limits.idle_s)
        self.socket_path: str | None = None
        self._servers: list[asyncio.AbstractServer] = []

    async def start(self, socket_path: str | None, tcp: str = "") -> list[str]:
        """Listen; returns where. An address that cannot be taken is logged, not fatal."""
        await self.runner.setup()
        loop = asyncio.get_running_loop()
        protocol = self.api.gate.factory(self.runner.server)   # type: ignore[arg-type]
        where = []
        if socket_path:
            try:
                Path(socket_path).parent.mkdir(parents=True, exist_ok=True)
                if os.path.exists(socket_path):
                    os.unlink(socket_path)          # a stale socket of an earlier run
                self._servers.append(await loop.create_unix_server(protocol, socket_path,
                                                                   backlog=BACKLOG))
                _restrict(socket_path)
                self.socket_path = socket_path
                where.append(f"unix:{socket_path}")
            except OSError as exc:
                log.error("API socket %s: %s", socket_path, exc)
        if tcp:
            host, _, port = tcp.rpartition(":")
            try:
                self._servers.append(await loop.create_server(
                    protocol, host.strip("[]"), int(port), backlog=BACKLOG, reuse_address=True))
                where.append(f"tcp:{tcp}")
            except OSError as exc:
                log.error("API on %s: %s", tcp, exc)
        return where

    async def stop(self) -> None:
        for server in self._servers:
            server.close()
        await self.runner.cleanup()
        if self.socket_path is not None:
            Path(self.socket_path).unlink(missing_ok=True)


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
