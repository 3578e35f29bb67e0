"""Who may hold a connection to the API, and for how long.

A connection is a file descriptor; a stranger who can open them without limit starves the
daemon of the descriptors its own work (the journal, the engine, sd_notify) needs. So every
connection is admitted at accept, before aiohttp sees it: at most ``per_peer`` from one address
(TCP) or one uid (the unix socket; root is not limited per peer), at most ``total`` in all (root
on the unix socket has ``ROOT_EXTRA`` more, so a flood never locks root out). An admitted
connection must send a request's header within ``header_s`` and may then sit idle between
requests for ``idle_s``; past either it is closed. Refusals are logged once per interval with a
count.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import socket
import struct
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from dsr1d.edges.ratelog import Tally

log = logging.getLogger("dsr1d.api")

ROOT_EXTRA = 64                # connections root may open on the unix socket past ``total``
FDS_RESERVED = 256             # descriptors kept for everything but the API's connections
Peer = tuple[str, Any]         # ("tcp", address) or ("uid", uid)


@dataclass(frozen=True)
class Limits:
    """The API's connection limits (``[api]`` connections, connections_per_client)."""

    total: int = 512
    per_peer: int = 32
    header_s: float = 10.0
    idle_s: float = 30.0

    def within_descriptors(self) -> "Limits":
        """These limits, ``total`` lowered to what the process's descriptor limit allows: each
        connection may take two (the caller's and the one to the engine)."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        room = max(8, (soft - FDS_RESERVED - ROOT_EXTRA) // 2)
        if room >= self.total:
            return self
        log.warning("API: %d connections at most (the descriptor limit is %d; the unit's "
                    "LimitNOFILE raises it)", room, soft)
        return Limits(room, min(self.per_peer, room), self.header_s, self.idle_s)


class _Connection:
    __slots__ = ("peer", "transport", "timer")

    def __init__(self, peer: Peer, transport: asyncio.BaseTransport) -> None:
        self.peer = peer
        self.transport = transport
        self.timer: asyncio.TimerHandle | None = None


class Gate:
    """Admits connections, times them out, and counts them by peer."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.open = 0
        self.by_peer: dict[Peer, int] = {}
        self._connections: dict[asyncio.BaseTransport, _Connection] = {}
        self._tally = Tally(log)

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for ``loop.create_server`` around aiohttp's."""
        return lambda: _Gated(self, inner)

    def admit(self, transport: asyncio.BaseTransport) -> _Connection | None:
        """The new connection's record, or None (refused: the caller closes it)."""
        peer = _peer(transport)
        root = peer == ("uid", 0)
        total = self.limits.total + (ROOT_EXTRA if root else 0)
        mine = self.by_peer.get(peer, 0)
        if self.open >= total or (not root and mine >= self.limits.per_peer):
            full = self.open >= total
            # one line per interval for each limit, however many addresses a flood comes from
            self._tally(full, logging.WARNING,
                        "API: refused a connection from %s: %d open %s (the limit)",
                        _name(peer), total if full else self.limits.per_peer,
                        "in all" if full else f"from {_name(peer)}")
            return None
        self.open += 1
        self.by_peer[peer] = mine + 1
        connection = _Connection(peer, transport)
        self._connections[transport] = connection
        self._arm(connection, self.limits.header_s)
        return connection

    def release(self, connection: _Connection) -> None:
        """The connection is gone."""
        if self._connections.pop(connection.transport, None) is None:
            return
        self._disarm(connection)
        self.open -= 1
        left = self.by_peer[connection.peer] - 1
        if left:
            self.by_peer[connection.peer] = left
        else:
            del self.by_peer[connection.peer]

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """No deadline while a request runs (its header is in); the idle one after it."""
        connection = self._connections.get(request.transport) if request.transport else None
        if connection is None:
            return await handler(request)
        self._disarm(connection)
        try:
            return await handler(request)
        finally:
            if connection.transport in self._connections:
                self._arm(connection, self.limits.idle_s)

    def _arm(self, connection: _Connection, seconds: float) -> None:
        self._disarm(connection)
        connection.timer = asyncio.get_running_loop().call_later(
            seconds, connection.transport.abort)

    @staticmethod
    def _disarm(connection: _Connection) -> None:
        if connection.timer is not None:
            connection.timer.cancel()
            connection.timer = None


class _Gated(asyncio.Protocol):
    """aiohttp's protocol for an admitted connection; nothing at all for a refused one."""

    def __init__(self, gate: Gate, inner: Callable[[], asyncio.Protocol]) -> None:
        self.gate = gate
        self.make_inner = inner
        self.inner: asyncio.Protocol | None = None
        self.connection: _Connection | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.connection = self.gate.admit(transport)
        if self.connection is None:
            transport.abort()
            return
        self.inner = self.make_inner()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self.connection is not None:
            self.gate.release(self.connection)
        if self.inner is not None:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()


def _peer(transport: asyncio.BaseTransport) -> Peer:
    address = transport.get_extra_info("peername")
    if isinstance(address, tuple):
        return ("tcp", address[0])
    sock = transport.get_extra_info("socket")
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):
        return ("uid", None)
    return ("uid", struct.unpack("3i", raw)[1])


def _name(peer: Peer) -> str:
    kind, value = peer
    return str(value) if kind == "tcp" else f"uid {value}"
