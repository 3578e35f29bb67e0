"""The D-Bus adapter: ``org.dsr1d.Manager1`` on ``/org/dsr1d``. The only module importing dbus-fast.

Methods are dispatched here rather than by dbus-fast, for three reasons dbus-fast's own dispatch
cannot serve: a call with the wrong argument types must get ``InvalidArgs`` (dbus-fast answers
``UnknownMethod``), a hold must know which connection made it, and every mutating call is
authorised against the caller's uid even when the bus policy would let it through. Properties,
signals and introspection stay with dbus-fast's ``ServiceInterface``.
"""

import array
import asyncio
import grp
import logging
import pwd
import socket
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from dbus_fast import (BusType, Message, MessageFlag, MessageType, NameFlag, RequestNameReply,
                       Variant)
from dbus_fast import introspection as intr
from dbus_fast.aio import MessageBus
from dbus_fast.aio.message_bus import _MessageWriter
from dbus_fast.constants import PropertyAccess
from dbus_fast.service import ServiceInterface, dbus_property, signal
from dbus_fast.signature import get_signature_tree

from dsr1d import __version__
from dsr1d.constants import ENGINE, ENGINE_PATH, ERROR, MANAGER, PATH
from dsr1d.contract.sysroot import KnobError
from dsr1d.core.manager import HoldError, Manager
from dsr1d.core.profiles import ProfileError, UnknownProfile
from dsr1d.core.state import JournalError
from dsr1d.core.tuning import ApplyFailed, TuningError
from dsr1d.edges.engine_host import Cancelled, EngineHost, EngineUnavailable, InvalidArgument
from dsr1d.edges.ratelog import Tally
from dsr1d.table import clip

log = logging.getLogger("dsr1d")

INVALID_ARGS = "org.freedesktop.DBus.Error.InvalidArgs"
PROPERTIES = "org.freedesktop.DBus.Properties"
MESSAGE_LIMIT = 500           # characters of an error reply
NAME_LIMIT = 255              # D-Bus names (interfaces, members) are at most 255 bytes
ADMIN_GROUP = "dsr1d"
# CheckAuthorization's flag AllowUserInteraction: an agent may ask the caller for a password.
POLKIT_ALLOW_INTERACTION = 1
POLKIT_ACTIONS = {"SwitchProfile": "org.dsr1d.switch-profile", "Reload": "org.dsr1d.reload",
                  "HoldProfile": "org.dsr1d.hold-profile", "ReleaseProfile": "org.dsr1d.hold-profile",
                  "Generate": "org.dsr1d.run-inference", "Submit": "org.dsr1d.run-inference",
                  "Cancel": "org.dsr1d.run-inference"}


class AccessDenied(Exception):
    """The caller may not change anything."""


@dataclass(frozen=True)
class Caller:
    """Who sent a method call."""

    sender: str
    uid: int
    # The caller set ALLOW_INTERACTIVE_AUTHORIZATION: polkit may ask it for a password.
    interactive: bool = False


@dataclass(frozen=True)
class Method:
    """One exported method: its D-Bus signature, whether it changes anything, its handler."""

    name: str
    in_args: tuple[tuple[str, str], ...]
    out_sig: str
    mutating: bool
    call: Callable[..., Any]

    @property
    def in_sig(self) -> str:
        return "".join(sig for _, sig in self.in_args)

    @property
    def out_types(self) -> list[str]:
        return [t.signature for t in get_signature_tree(self.out_sig).types]

    def body(self, result: Any) -> list[Any]:
        """The reply body: a handler returns one value, or a list when there are several."""
        count = len(self.out_types)
        return [] if count == 0 else [result] if count == 1 else list(result)


def error_reply(exc: Exception) -> tuple[str, str]:
    """The D-Bus error name and one-line message for a domain error (one place for all), at
    most MESSAGE_LIMIT characters: whatever a caller sent that it echoes stays bounded."""
    name, text = _error_reply(exc)
    return name, clip(text, MESSAGE_LIMIT)


def _error_reply(exc: Exception) -> tuple[str, str]:
    names = {UnknownProfile: "UnknownProfile", ProfileError: "InvalidProfile",
             ApplyFailed: "ApplyFailed", TuningError: "ApplyFailed", KnobError: "ApplyFailed",
             AccessDenied: "AccessDenied", JournalError: "Journal",
             EngineUnavailable: "EngineUnavailable", InvalidArgument: "InvalidArgument",
             Cancelled: "Cancelled"}
    if isinstance(exc, HoldError):
        return ERROR + exc.name, str(exc)
    for kind, name in names.items():
        if isinstance(exc, kind):
            return ERROR + name, str(exc).splitlines()[0]
    return ERROR + "Internal", f"internal error ({type(exc).__name__}); see the daemon's log"


def dbus_string(text: str) -> str:
    """D-Bus strings cannot hold NUL; a model can emit one (the byte token 0x00)."""
    return text.replace("\0", "\ufffd")


def to_variant(value: Any) -> Variant:
    """A Variant for the plain values telemetry holds."""
    if isinstance(value, bool):
        return Variant("b", value)
    if isinstance(value, int):
        return Variant("x", value)
    if isinstance(value, float):
        return Variant("d", value)
    if isinstance(value, str):
        return Variant("s", dbus_string(value))
    if isinstance(value, dict):
        return Variant("a{sv}", {k: to_variant(v) for k, v in value.items()})
    if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
        return Variant("ad", value)
    if isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        return Variant("ax", value)
    return Variant("as", [str(v) for v in value])


class Authorizer:
    """Root, members of the ``dsr1d`` group, or a polkit "yes" may change things.

    A connection's uid cannot change while it is connected, so it is asked of the bus once per
    connection and forgotten when the connection leaves (``forget``)."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        self._uids: dict[str, int] = {}

    async def uid(self, sender: str) -> int:
        if sender in self._uids:
            return self._uids[sender]
        reply = await self.bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="GetConnectionUnixUser",
            signature="s", body=[sender]))
        if reply.message_type != MessageType.METHOD_RETURN:
            raise AccessDenied(f"cannot tell who {sender} is")
        self._uids[sender] = int(reply.body[0])
        return self._uids[sender]

    def forget(self, sender: str) -> None:
        self._uids.pop(sender, None)

    async def check(self, caller: Caller, method: str) -> None:
        if caller.uid == 0 or _in_group(caller.uid, ADMIN_GROUP):
            return
        if await self._polkit(caller, POLKIT_ACTIONS.get(method, "org.dsr1d.switch-profile")):
            return
        raise AccessDenied(f"{method} needs root, the {ADMIN_GROUP} group or polkit "
                           f"authorisation (caller uid {caller.uid})")

    async def _polkit(self, caller: Caller, action: str) -> bool:
        subject = ["system-bus-name", {"name": Variant("s", caller.sender)}]
        reply = await self.bus.call(Message(
            destination="org.freedesktop.PolicyKit1", path="/org/freedesktop/PolicyKit1/Authority",
            interface="org.freedesktop.PolicyKit1.Authority", member="CheckAuthorization",
            signature="(sa{sv})sa{ss}us",
            body=[subject, action, {}, POLKIT_ALLOW_INTERACTION if caller.interactive else 0, ""]))
        if reply.message_type != MessageType.METHOD_RETURN:
            return False  # no polkit on this bus (or it refused): only root and the group
        return bool(reply.body[0][0])


    async def process_allowed(self, pid: int, uid: int, action: str) -> bool:
        """Root, the group, or polkit's yes for a local process (the HTTP API's callers)."""
        if uid == 0 or _in_group(uid, ADMIN_GROUP):
            return True
        try:
            fields = open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()
            start = int(fields[19])             # starttime: field 22 of /proc/PID/stat
        except (OSError, ValueError, IndexError):
            return False                        # gone already: no one to authorise
        subject = ["unix-process", {"pid": Variant("u", pid), "start-time": Variant("t", start),
                                    "uid": Variant("i", uid)}]
        reply = await self.bus.call(Message(
            destination="org.freedesktop.PolicyKit1", path="/org/freedesktop/PolicyKit1/Authority",
            interface="org.freedesktop.PolicyKit1.Authority", member="CheckAuthorization",
            signature="(sa{sv})sa{ss}us", body=[subject, action, {}, 0, ""]))
        return reply.message_type == MessageType.METHOD_RETURN and bool(reply.body[0][0])


def _in_group(uid: int, group: str) -> bool:
    try:
        entry = grp.getgrnam(group)
        user = pwd.getpwuid(uid)
    except KeyError:
        return False
    return user.pw_gid == entry.gr_gid or user.pw_name in entry.gr_mem


class DispatchedInterface(ServiceInterface):
    """A ServiceInterface whose methods are dispatched by `Dispatcher` but introspected here."""

    def __init__(self, name: str, methods: dict[str, Method]) -> None:
        super().__init__(name)
        self.methods = methods
        self._pending_changes: set[str] = set()

    def introspect(self) -> intr.Interface:
        iface = super().introspect()
        for method in self.methods.values():
            in_args = [intr.Arg(sig, intr.ArgDirection.IN, name) for name, sig in method.in_args]
            out_args = [intr.Arg(t, intr.ArgDirection.OUT) for t in method.out_types]
            iface.methods.append(intr.Method(method.name, in_args, out_args))
        return iface

    def emit_changed(self, names: list[str]) -> None:
        """PropertiesChanged for ``names``, coalesced: changes made in one turn of the event loop
        (a burst of holds, say) go out as one signal carrying the latest values."""
        if not self._pending_changes:
            asyncio.get_running_loop().call_soon(self._flush_changes)
        self._pending_changes.update(names)

    def _flush_changes(self) -> None:
        names = sorted(self._pending_changes)
        self._pending_changes.clear()
        self.emit_properties_changed({name: getattr(self, name) for name in names})


class ManagerInterface(DispatchedInterface):
    """Properties and signals of ``org.dsr1d.Manager1``."""

    def __init__(self, manager: Manager, methods: dict[str, Method]) -> None:
        super().__init__(MANAGER, methods)
        self.manager = manager
        self.mitigator: Any = None  # set by the service when telemetry runs

    @dbus_property(access=PropertyAccess.READ)
    def ActiveProfile(self) -> "s":
        return self.manager.active or ""

    @dbus_property(access=PropertyAccess.READ)
    def Profiles(self) -> "as":
        return list(self.manager.profiles)

    @dbus_property(access=PropertyAccess.READ)
    def Tunables(self) -> "a(sbs)":
        return [[t.name, t.support.supported, t.support.detail] for t in self.manager.tunables]

    @dbus_property(access=PropertyAccess.READ)
    def Holds(self) -> "a(usss)":
        return [[h.cookie, h.profile, h.reason, h.application_id] for h in self.manager.holds]

    @dbus_property(access=PropertyAccess.READ)
    def ThrottleState(self) -> "s":
        return self.mitigator.state if self.mitigator else "none"

    @dbus_property(access=PropertyAccess.READ)
    def Mitigations(self) -> "as":
        return self.mitigator.active if self.mitigator else []

    @dbus_property(access=PropertyAccess.READ)
    def Version(self) -> "s":
        return __version__

    @signal()
    def ProfileChanged(self, old: str, new: str, reason: str) -> "sss":
        return [old, new, reason]

    @signal()
    def ThrottleStateChanged(self, state: str, evidence: dict) -> "sa{sv}":
        return [state, evidence]

class Dispatcher:
    """Routes method calls of our interfaces: signature check, caller's uid, authorisation,
    the handler, and one error mapping for all."""

    def __init__(self, bus: MessageBus) -> None:
        self.bus = bus
        self.auth = Authorizer(bus)
        self.routes: dict[tuple[str, str], dict[str, Method]] = {}
        self.signal_listeners: list[Callable[[Message], None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._refusals = Tally(log)
        bus.add_message_handler(self._handle)

    def add(self, path: str, interface: DispatchedInterface) -> None:
        self.routes[(path, interface.name)] = interface.methods
        self.bus.export(path, interface)

    def _find(self, msg: Message) -> Method | None:
        if msg.interface is not None:
            return self.routes.get((msg.path, msg.interface), {}).get(msg.member)
        for (path, _), methods in self.routes.items():
            if path == msg.path and msg.member in methods:
                return methods[msg.member]
        return None

    def _handle(self, msg: Message) -> Any:
        if msg.message_type == MessageType.SIGNAL:
            for listener in self.signal_listeners:
                listener(msg)
            return None
        if msg.message_type != MessageType.METHOD_CALL:
            return None
        if msg.interface == PROPERTIES and any(
                isinstance(arg, str) and len(arg) > NAME_LIMIT for arg in msg.body):
            # dbus-fast would repeat the whole name back (a 1 MB name, a 1 MB error)
            longest = max(len(a) for a in msg.body if isinstance(a, str))
            return Message.new_error(msg, INVALID_ARGS, f"a D-Bus name is at most {NAME_LIMIT} "
                                     f"bytes; got one of {longest}")
        method = self._find(msg)
        if method is None:
            return None
        if msg.signature != method.in_sig:
            return Message.new_error(msg, INVALID_ARGS, f"{method.name} takes ({method.in_sig}), "
                                     f"got ({msg.signature})")
        task = asyncio.get_running_loop().create_task(self._run(method, msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    def _refused(self, method: str, sender: str | None, name: str, text: str) -> None:
        """A refused call, logged once per interval for each method and error, with the
        count of those not logged: a client repeating a bad call cannot flood the journal."""
        self._refusals((method, name), logging.WARNING, "%s from %s: %s", method, sender, text)

    async def _run(self, method: Method, msg: Message) -> None:
        try:
            # Reads are open to everyone: no uid is needed, so none is asked for.
            caller = Caller(msg.sender, await self.auth.uid(msg.sender) if method.mutating else -1,
                            bool(msg.flags & MessageFlag.ALLOW_INTERACTIVE_AUTHORIZATION))
            if method.mutating:
                await self.auth.check(caller, method.name)
            result = method.call(caller, *msg.body)
            if asyncio.iscoroutine(result):
                result = await result
            reply = Message.new_method_return(msg, method.out_sig, method.body(result))
            reply._marshall(False)  # here, so that a reply that cannot be encoded gets an error
        except Exception as exc:
            name, text = error_reply(exc)
            if name == ERROR + "Internal":
                log.exception("%s failed", method.name)
            elif name != ERROR + "AccessDenied":
                self._refused(method.name, msg.sender, name, text)
            reply = Message.new_error(msg, name, text)
        self.bus.send(reply)


class ManagerService:
    """Exports the manager on a bus connection and dispatches its method calls."""

    def __init__(self, dispatcher: Dispatcher, manager: Manager,
                 reload: Callable[[], Awaitable[list[ProfileError]]],
                 telemetry: Callable[[], dict[str, Any]]) -> None:
        self.dispatcher = dispatcher
        self.bus = dispatcher.bus
        self.manager = manager
        self._reload = reload
        self._telemetry = telemetry
        self.interface = ManagerInterface(manager, {m.name: m for m in self._methods()})
        manager.profile_listeners.append(self.interface.ProfileChanged)
        manager.change_listeners.append(self.interface.emit_changed)

    def _methods(self) -> list[Method]:
        m = self.manager
        return [
            Method("SwitchProfile", (("profile", "s"),), "", True,
                   lambda caller, name: m.switch(name)),
            Method("ListProfiles", (), "a(ss)", False,
                   lambda caller: [[n, p.summary] for n, p in m.profiles.items()]),
            Method("Verify", (), "ba(sss)", False, lambda caller: self._verify()),
            Method("Reload", (), "", True, lambda caller: self._reload_checked()),
            Method("HoldProfile", (("profile", "s"), ("reason", "s"), ("application_id", "s")),
                   "u", True, lambda caller, p, r, a: self._hold(caller, p, r, a)),
            Method("ReleaseProfile", (("cookie", "u"),), "", True,
                   lambda caller, cookie: m.release(cookie, caller.sender)),
            Method("GetTelemetry", (), "a{sv}", False,
                   lambda caller: {k: to_variant(v) for k, v in self._telemetry().items()}),
        ]

    def attach_mitigator(self, mitigator: Any) -> None:
        """Expose throttle state and mitigations; emit ThrottleStateChanged."""
        self.interface.mitigator = mitigator
        mitigator.change_listeners.append(self.interface.emit_changed)
        mitigator.state_listeners.append(
            lambda state, evidence: self.interface.ThrottleStateChanged(state, _variants(evidence)))

    async def export(self) -> None:
        self.dispatcher.add(PATH, self.interface)
        self.dispatcher.signal_listeners.append(self._owner_changed)
        await self.bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="AddMatch", signature="s",
            body=["type='signal',sender='org.freedesktop.DBus',member='NameOwnerChanged'"]))

    def _verify(self) -> list[Any]:
        result = self.manager.verify()
        drift = [[f"{d.tunable}:{d.where}", d.wanted, d.actual] for d in result.drift]
        return [not drift, drift]

    async def _reload_checked(self) -> None:
        errors = await self._reload()
        if errors:
            raise ProfileError(errors[0].file, errors[0].line,
                               f"{errors[0].reason} (reloaded the rest; the previous version "
                               f"of a rejected profile stays)")

    async def _hold(self, caller: Caller, profile: str, reason: str, app_id: str) -> int:
        cookie = self.manager.hold(profile, reason, app_id, caller.sender)
        reply = await self.bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="GetNameOwner", signature="s",
            body=[caller.sender]))
        if reply.message_type == MessageType.ERROR:   # it left before we could watch it
            self.manager.release_owner(caller.sender)
        return cookie

    def _owner_changed(self, msg: Message) -> None:
        if (msg.member == "NameOwnerChanged" and msg.sender == "org.freedesktop.DBus"
                and len(msg.body) == 3 and msg.body[0].startswith(":") and not msg.body[2]):
            self.dispatcher.auth.forget(msg.body[0])
            self.manager.release_owner(msg.body[0])


class EngineInterface(DispatchedInterface):
    """Properties and signals of ``org.dsr1d.Engine1``."""

    def __init__(self, host: EngineHost | None, methods: dict[str, Method]) -> None:
        super().__init__(ENGINE, methods)
        self.host = host

    @dbus_property(access=PropertyAccess.READ)
    def Model(self) -> "s":
        if self.host is None:
            return ""
        return str(self.host.info.get("model") or self.host.model)

    @dbus_property(access=PropertyAccess.READ)
    def State(self) -> "s":
        return "unconfigured" if self.host is None else self.host.state

    @dbus_property(access=PropertyAccess.READ)
    def Threads(self) -> "u":
        return 0 if self.host is None else self.host.threads

    @dbus_property(access=PropertyAccess.READ)
    def TokensPerSecond(self) -> "d":
        return 0.0 if self.host is None else self.host.tokens_per_s

    @signal()
    def Token(self, job: int, piece: str) -> "ts":
        return [job, piece]

    @signal()
    def Finished(self, job: int, stats: dict) -> "ta{sv}":
        return [job, stats]


def _plain(options: dict[str, Variant]) -> dict[str, Any]:
    return {k: v.value if isinstance(v, Variant) else v for k, v in options.items()}


class EngineService:
    """Exports ``org.dsr1d.Engine1``; with no model configured every call says so.

    Generations are private: a job belongs to the connection that started it. Its ``Token`` and
    ``Finished`` signals are addressed to that connection only (unicast signals, which the
    system bus does not let other users eavesdrop on), only it or root may cancel it, and it is
    cancelled when its caller leaves the bus."""

    def __init__(self, dispatcher: Dispatcher, host: EngineHost | None) -> None:
        self.dispatcher = dispatcher
        self.host = host
        self.owners: dict[int, str] = {}
        self.interface = EngineInterface(host, {m.name: m for m in self._methods()})
        if host is not None:
            host.token_listeners.append(self._token)
            host.finished_listeners.append(self._finished)
            host.change_listeners.append(self.interface.emit_changed)
        dispatcher.signal_listeners.append(self._owner_changed)

    def _methods(self) -> list[Method]:
        return [
            Method("Generate", (("prompt", "s"), ("options", "a{sv}")), "sa{sv}", True,
                   lambda caller, prompt, options: self._generate(caller, prompt, options)),
            Method("Submit", (("prompt", "s"), ("options", "a{sv}")), "t", True,
                   lambda caller, prompt, options: self._submit(caller, prompt, options)),
            Method("Cancel", (("job", "t"),), "", True,
                   lambda caller, job: self._cancel(caller, job)),
        ]

    def export(self) -> None:
        self.dispatcher.add(ENGINE_PATH, self.interface)

    def _engine(self) -> EngineHost:
        if self.host is None:
            raise EngineUnavailable("no model configured (set model= in /etc/dsr1d/dsr1d.conf)")
        return self.host

    async def _generate(self, caller: Caller, prompt: str,
                        options: dict[str, Variant]) -> list[Any]:
        job = await self._engine().submit(prompt, _plain(options))
        self.owners[job.id] = caller.sender
        result = await job.done
        return [dbus_string(result["text"]), _variants(result["stats"])]

    async def _submit(self, caller: Caller, prompt: str, options: dict[str, Variant]) -> int:
        job = await self._engine().submit(prompt, _plain(options))
        self.owners[job.id] = caller.sender
        return job.id

    async def _cancel(self, caller: Caller, job: int) -> None:
        owner = self.owners.get(job)
        if owner is not None and owner != caller.sender and caller.uid != 0:
            raise AccessDenied(f"job {job} belongs to another client")
        await self._engine().cancel(job)

    def _token(self, job: int, piece: str) -> None:
        self._unicast(job, "Token", "ts", [job, dbus_string(piece)])

    def _finished(self, job: int, stats: dict[str, Any]) -> None:
        self._unicast(job, "Finished", "ta{sv}", [job, _variants(stats)])
        self.owners.pop(job, None)

    def _unicast(self, job: int, member: str, signature: str, body: list[Any]) -> None:
        owner = self.owners.get(job)
        if owner is None:  # a job nobody on the bus asked for (none today): nobody hears it
            return
        self.dispatcher.bus.send(Message(message_type=MessageType.SIGNAL, destination=owner,
                                         path=ENGINE_PATH, interface=ENGINE, member=member,
                                         signature=signature, body=body))

    def _owner_changed(self, msg: Message) -> None:
        """A caller that left the bus: its jobs are cancelled (nobody could read them)."""
        if (msg.member != "NameOwnerChanged" or msg.sender != "org.freedesktop.DBus"
                or len(msg.body) != 3 or msg.body[2] or self.host is None):
            return
        for job, owner in list(self.owners.items()):
            if owner == msg.body[0] and job in self.host.jobs:
                log.info("job %d: its caller %s left the bus; cancelling it", job, owner)
                asyncio.get_running_loop().create_task(self._quiet_cancel(job))

    async def _quiet_cancel(self, job: int) -> None:
        try:
            await self.host.cancel(job)  # type: ignore[union-attr]
        except (InvalidArgument, EngineUnavailable):
            pass  # it ended meanwhile


def _variants(values: dict[str, Any]) -> dict[str, Variant]:
    """a{sv} of plain values; what is unknown (None) is left out, not invented."""
    return {k: to_variant(v) for k, v in values.items() if v is not None}


# Other daemons that tune the same machine, by the bus name they own.
NEIGHBOURS = {
    "com.redhat.tuned": "tuned writes the same knobs: stop it (the unit Conflicts= with it)",
    "net.hadess.PowerProfiles": "power-profiles-daemon writes EPP/EPB: stop it "
                                "(the unit Conflicts= with it)",
    "org.freedesktop.UPower.PowerProfiles": "power-profiles-daemon writes EPP/EPB: stop it "
                                            "(the unit Conflicts= with it)",
    "org.freedesktop.thermald": "thermald runs: it acts only near thermal limits; dsr1d leaves "
                                "it running and cooperates",
}


async def neighbours(bus: MessageBus) -> dict[str, str]:
    """Which other tuning daemons own their names on this bus, with what that means."""
    found = {}
    for name, meaning in NEIGHBOURS.items():
        reply = await bus.call(Message(
            destination="org.freedesktop.DBus", path="/org/freedesktop/DBus",
            interface="org.freedesktop.DBus", member="NameHasOwner", signature="s", body=[name]))
        if reply.message_type == MessageType.METHOD_RETURN and reply.body[0]:
            found[name] = meaning
    return found


class _BackpressureWriter(_MessageWriter):
    """dbus-fast's writer, except that a full socket (EAGAIN) waits for the socket to drain.

    Upstream treats ``BlockingIOError`` from ``send`` like a broken connection and closes the
    bus (dbus-next #153, inherited by dbus-fast): a burst of replies — a thousand reads from
    unprivileged clients — then takes the daemon off the bus for good. Here the message stays
    queued at its offset and the writer callback resumes when the socket is writable."""

    def write_callback(self, remove_writer: bool = True) -> None:
        while True:
            if self.buf is None:
                if not self.messages:
                    if remove_writer:
                        self.loop.remove_writer(self.fd)
                    return
                buf, self.unix_fds, self.fut = self.messages.popleft()
                self.buf, self.offset = memoryview(buf), 0
            try:
                self.offset += self._send()
            except (BlockingIOError, InterruptedError):
                return  # the writer stays registered (schedule_write adds it if needed)
            except Exception as exc:  # a real failure: what upstream does
                if self.bus._user_disconnect:
                    _resolve(self.fut, None)
                else:
                    _resolve(self.fut, exc)
                self.bus._finalize(exc)
                return
            if self.offset < len(self.buf):
                return
            self.buf = None
            _resolve(self.fut, None)

    def _send(self) -> int:
        data = self.buf[self.offset:]
        if self.unix_fds and self.negotiate_unix_fd:
            fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", self.unix_fds))]
            sent = self.sock.sendmsg([data], fds)
            self.unix_fds = None
            return sent
        return self.sock.send(data)


def _resolve(future: asyncio.Future | None, outcome: Any) -> None:
    if future is None or future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


async def take_name(bus: MessageBus, name: str) -> bool:
    """Own ``name`` on ``bus`` now, or say it is taken (never queue behind its owner)."""
    return await bus.request_name(name, NameFlag.DO_NOT_QUEUE) == RequestNameReply.PRIMARY_OWNER


async def connect(address: str | None) -> MessageBus:
    """Connect to ``address``, or to the system bus (``$DBUS_SYSTEM_BUS_ADDRESS`` honoured),
    with a writer that applies back-pressure instead of disconnecting on a full socket."""
    bus = MessageBus(bus_address=address) if address else MessageBus(bus_type=BusType.SYSTEM)
    await bus.connect()
    bus._writer = _BackpressureWriter(bus)  # idle right after Hello: nothing queued to carry over
    return bus
