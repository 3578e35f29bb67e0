"""Shared fixtures for the tests that run the real daemon: a private system-like bus with the
project's policy file, the daemon as a subprocess against a fake root, a notify socket, a small
synchronous dbus-fast client and an ``eventually`` helper.

Test modules load this file as a plugin (``pytest_plugins = ["daemon_fixtures"]``) so that its
fixtures and its report hook (which attaches the daemon's log to a failing test's report) are
active, and import the helpers they use from it.

Nothing here sleeps for a fixed time to synchronise: every wait polls a condition with a
deadline (``eventually``) or blocks on an event with a timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from fakeroot import FakeRoot
from harness.privbus import PrivateBus

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent
POLICY = REPO / "etc/dbus-1/system.d/org.dsr1d.conf"

BUS_NAME, PATH, MANAGER = "org.dsr1d", "/org/dsr1d", "org.dsr1d.Manager1"
ERROR = "org.dsr1d.Error."
DBUS_INVALID_ARGS = "org.freedesktop.DBus.Error.InvalidArgs"
AS_NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
BUILTINS = ("balanced", "efficient", "latency", "powersave", "sustained", "throughput")
JOURNAL = "run/dsr1d/state.json"
CPU = "sys/devices/system/cpu"
EPB = CPU + "/cpu{}/power/energy_perf_bias"
EPP = CPU + "/cpu{}/cpufreq/energy_performance_preference"
# What the default profile (sustained: throughput + balance-performance) writes to a fake root.
SUSTAINED_EPB = "4"

STARTUP_TIMEOUT = 30.0
STOP_TIMEOUT = 20.0

_TOOLS = ("dbus-daemon", "busctl", "dbus-send", "setpriv")

_DAEMONS = pytest.StashKey[list]()
_BUSES = pytest.StashKey[list]()


# -- polling ----------------------------------------------------------------------------------

_NOT_YET = (OSError, AssertionError, ValueError, LookupError, subprocess.SubprocessError)


def eventually(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02,
               what: str = "condition", detail: Callable[[], str] | None = None) -> Any:
    """Call ``check`` until it returns something truthy (returned) or ``timeout`` passes.

    An OSError, AssertionError, ValueError or LookupError from ``check`` counts as "not yet"
    (a file half-written, a bus call refused); the last value or exception is shown in the
    failure, followed by ``detail()`` when given (a log, say). Other exceptions are bugs in the
    test and propagate at once.
    """
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            value = check()
        except _NOT_YET as exc:  # "not yet"; shown if it never comes
            value, last = None, exc
        else:
            last = value
        if value:
            return value
        if time.monotonic() >= deadline:
            extra = f"\n{detail()}" if detail is not None else ""
            pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}; last: {last!r}{extra}")
        time.sleep(interval)


def read_line(stream, timeout: float = 10.0, what: str = "a line") -> str:
    """One line from a subprocess pipe, failing after ``timeout`` instead of blocking forever."""
    ready, _, _ = select.select([stream], [], [], timeout)
    if not ready:
        pytest.fail(f"timed out after {timeout:.0f}s waiting for {what}")
    return stream.readline()


# -- sd_notify ---------------------------------------------------------------------------------

class NotifySocket:
    """An ``AF_UNIX``/``SOCK_DGRAM`` socket standing in for systemd's ``$NOTIFY_SOCKET``.

    Abstract (``@name``), so the path length of pytest's temporary directories does not matter.
    """

    def __init__(self) -> None:
        self.name = f"dsr1d-test-{uuid.uuid4().hex}"
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind("\0" + self.name)
        self.sock.setblocking(False)
        self.messages: list[dict[str, str]] = []

    @property
    def address(self) -> str:
        """The value for ``$NOTIFY_SOCKET``."""
        return "@" + self.name

    def drain(self) -> list[dict[str, str]]:
        """Receive whatever has arrived; every datagram becomes one ``{FIELD: value}`` dict."""
        while True:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return self.messages
            fields = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append(fields)

    def find(self, predicate: Callable[[dict[str, str]], bool]) -> list[dict[str, str]]:
        return [m for m in self.drain() if predicate(m)]

    def wait_for(self, predicate: Callable[[dict[str, str]], bool], timeout: float = 10.0,
                 what: str = "a notify message", count: int = 1) -> list[dict[str, str]]:
        def enough() -> list[dict[str, str]] | None:
            found = self.find(predicate)
            return found if len(found) >= count else None

        return eventually(enough, timeout=timeout, what=what,
                          detail=lambda: f"notify messages so far: {self.messages!r}")

    def close(self) -> None:
        self.sock.close()


# -- the daemon as a subprocess ----------------------------------------------------------------

class Daemon:
    """``python -m dsr1d.edges.admin run`` against a fake root on the private bus."""

    _count = 0

    def __init__(self, bus: PrivateBus, root: Path, config: Path, workdir: Path,
                 env: dict[str, str] | None = None, notify: bool = True,
                 args: tuple[str, ...] = ()) -> None:
        Daemon._count += 1
        self.bus = bus
        self.root = Path(root)
        self.config = config
        self.logfile = workdir / f"dsr1d-{Daemon._count}.stderr"
        self.outfile = workdir / f"dsr1d-{Daemon._count}.stdout"
        self.notify = NotifySocket() if notify else None
        self.extra_env = env or {}
        self.args = args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        return [sys.executable, "-m", "dsr1d.edges.admin", "run", "--root", str(self.root),
                "--config", str(self.config), "--bus-address", self.bus.address, *self.args]

    def start(self) -> "Daemon":
        env = {k: v for k, v in self.bus.env().items()
               if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID", "JOURNAL_STREAM")}
        env["PYTHONUNBUFFERED"] = "1"
        if self.notify is not None:
            env["NOTIFY_SOCKET"] = self.notify.address
        env.update(self.extra_env)
        with open(self.logfile, "wb") as err, open(self.outfile, "wb") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=err,
                                         stdin=subprocess.DEVNULL, env=env)
        return self

    def log(self) -> str:
        """What the daemon wrote to stderr so far (its log when not under journald)."""
        try:
            return self.logfile.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT) -> "Daemon":
        """Until ``READY=1`` arrives on the notify socket (or, without one, the name is owned
        and the object answers); fails at once, with the log, if the daemon exits instead."""

        def ready() -> str | None:
            if not self.running():
                return "exited"
            if self.notify is not None:
                return "ready" if self.notify.find(lambda m: m.get("READY") == "1") else None
            return "ready" if busctl(self.bus, "get-property", BUS_NAME, PATH, MANAGER,
                                     "ActiveProfile").returncode == 0 else None

        state = eventually(ready, timeout=timeout, what="dsr1d to become ready",
                           detail=lambda: f"--- dsr1d log ---\n{self.log()}")
        if state == "exited":
            pytest.fail(f"dsr1d exited with {self.proc.returncode} before it was ready:\n"
                        f"{self.log()}")
        return self

    def send(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait(self, timeout: float = STOP_TIMEOUT) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"dsr1d did not exit within {timeout:.0f}s:\n{self.log()}") \
                from None

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM and wait for the exit status."""
        self.send(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> int:
        """SIGKILL: the daemon dies without restoring anything."""
        self.send(signal.SIGKILL)
        return self.wait()

    def cleanup(self) -> None:
        """Always leaves no daemon behind: SIGTERM, then SIGKILL if it does not go."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.notify is not None:
            self.notify.close()


# -- running the real tools --------------------------------------------------------------------

def run(bus: PrivateBus, *cmd: str, nobody: bool = False, timeout: float = 30,
        env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` with the private bus as the system bus, as root or as nobody."""
    prefix = AS_NOBODY if nobody else ()
    return subprocess.run([*prefix, *cmd], env=bus.env({**os.environ, **(env or {})}),
                          capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def busctl(bus: PrivateBus, *args: str, nobody: bool = False) -> subprocess.CompletedProcess[str]:
    return run(bus, "busctl", "--system", "--no-pager", *args, nobody=nobody)


def manager_call(bus: PrivateBus, member: str, *args: str,
                 nobody: bool = False) -> subprocess.CompletedProcess[str]:
    """``busctl --system call org.dsr1d /org/dsr1d org.dsr1d.Manager1 MEMBER [SIG ARGS…]``."""
    return busctl(bus, "--json=short", "call", BUS_NAME, PATH, MANAGER, member, *args,
                  nobody=nobody)


def manager_data(bus: PrivateBus, member: str, *args: str, nobody: bool = False) -> list[Any]:
    """The reply body of a successful ``manager_call``, decoded from busctl's JSON."""
    proc = manager_call(bus, member, *args, nobody=nobody)
    assert proc.returncode == 0, f"{member}: {proc.stderr}"
    return json.loads(proc.stdout)["data"] if proc.stdout.strip() else []


def dbus_send(bus: PrivateBus, member: str, *args: str, interface: str = MANAGER,
              nobody: bool = False) -> subprocess.CompletedProcess[str]:
    """``dbus-send --system --print-reply`` to the manager: its stderr names the D-Bus error."""
    return run(bus, "dbus-send", "--system", "--print-reply", f"--dest={BUS_NAME}", PATH,
               f"{interface}.{member}", *args, nobody=nobody)


def error_of(proc: subprocess.CompletedProcess[str]) -> tuple[str, str]:
    """``(error name, message)`` from dbus-send's ``Error NAME: message`` answer."""
    assert proc.returncode != 0, f"expected an error reply, got: {proc.stdout}"
    line = next((ln for ln in proc.stderr.splitlines() if ln.startswith("Error ")), None)
    assert line is not None, f"no error name in dbus-send's output: {proc.stderr!r}"
    name, _, message = line[len("Error "):].partition(": ")
    return name, message


def prop(bus: PrivateBus, name: str, nobody: bool = False) -> Any:
    """A property of the manager, read with ``busctl get-property --json``."""
    proc = busctl(bus, "--json=short", "get-property", BUS_NAME, PATH, MANAGER, name,
                  nobody=nobody)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["data"]


def active(bus: PrivateBus) -> str:
    return prop(bus, "ActiveProfile")


def dsr1ctl(bus: PrivateBus, *args: str, nobody: bool = False, address: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The real ``dsr1ctl`` (``python -m dsr1d.client.cli``) with ``--bus-address``."""
    return run(bus, sys.executable, "-m", "dsr1d.client.cli", "--bus-address", address or bus.address,
               *args, nobody=nobody, timeout=timeout)


def name_gone(bus: PrivateBus, name: str) -> bool:
    """True once the bus no longer knows ``name`` (it has sent NameOwnerChanged for it)."""
    proc = run(bus, "dbus-send", "--system", "--print-reply", "--dest=org.freedesktop.DBus",
               "/org/freedesktop/DBus", "org.freedesktop.DBus.NameHasOwner", f"string:{name}")
    assert proc.returncode == 0, proc.stderr
    return "boolean false" in proc.stdout


def knobs(fake: FakeRoot) -> dict[str, object]:
    """Every knob file of the fake root as the kernel would show it (FakeRoot.snapshot, which
    leaves out run/ and the PM QoS device), without the profiles a test wrote under etc/."""
    return {rel: value for rel, value in fake.snapshot().items() if not rel.startswith("etc/")}


def journal(fake: FakeRoot) -> Path:
    return fake.path / JOURNAL


def write_profile(fake: FakeRoot, name: str, text: str) -> Path:
    """A user profile in ``ROOT/etc/dsr1d/profiles`` (the daemon's default user directory)."""
    path = fake.path / "etc/dsr1d/profiles" / f"{name}.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# -- a synchronous dbus-fast client -----------------------------------------------------------

class BusClient:
    """One dbus-fast connection driven from a background event loop, for synchronous tests.

    Keeps every signal it receives (after ``subscribe``), so a test can wait for one.
    """

    def __init__(self, address: str) -> None:
        from dbus_fast import MessageType
        from dbus_fast.aio import MessageBus

        self._signal_type = MessageType.SIGNAL
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.signals: list[Any] = []
        self._lock = threading.Lock()
        async def connect() -> MessageBus:  # dbus-fast wants a running loop at construction
            return await MessageBus(bus_address=address).connect()

        self.bus = self._run(connect())
        self.bus.add_message_handler(self._on_message)

    def _run(self, coro, timeout: float = 20.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _on_message(self, msg) -> None:
        if msg.message_type == self._signal_type:
            with self._lock:
                self.signals.append(msg)
        return None

    @property
    def unique_name(self) -> str:
        return self.bus.unique_name

    def call(self, member: str, signature: str = "", *body: Any, interface: str = MANAGER,
             destination: str = BUS_NAME, path: str = PATH):
        """The reply Message (a method return or an error: check ``message_type``)."""
        from dbus_fast import Message

        return self._run(self.bus.call(Message(destination=destination, path=path,
                                               interface=interface, member=member,
                                               signature=signature, body=list(body))))

    def ok(self, member: str, signature: str = "", *body: Any, **kw: Any) -> list[Any]:
        """The reply body; fails the test on an error reply."""
        reply = self.call(member, signature, *body, **kw)
        if reply.error_name:
            pytest.fail(f"{member} failed: {reply.error_name}: {reply.body}")
        return reply.body

    def sync(self) -> None:
        """A round trip to the daemon: every signal it emitted before has arrived here."""
        self.ok("Ping", interface="org.freedesktop.DBus.Peer")

    def subscribe(self, rule: str) -> None:
        self.ok("AddMatch", "s", rule, interface="org.freedesktop.DBus",
                destination="org.freedesktop.DBus", path="/org/freedesktop/DBus")

    def received(self, member: str, interface: str | None = None) -> list[Any]:
        with self._lock:
            return [m for m in self.signals
                    if m.member == member and (interface is None or m.interface == interface)]

    def close(self) -> None:
        if self.loop.is_closed():
            return
        try:
            self.bus.disconnect()
            self._run(self.bus.wait_for_disconnect(), timeout=5)
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)
        self.loop.close()


# -- fixtures ----------------------------------------------------------------------------------

@pytest.fixture
def extra_policy() -> str | None:
    """Text of one more policy file for the private bus; parametrize ``extra_policy`` to set it."""
    return None


@pytest.fixture
def bus(request: pytest.FixtureRequest, tmp_path: Path,
        extra_policy: str | None) -> Iterator[PrivateBus]:
    """A private dbus-daemon shaped like the system bus, with etc/dbus-1/system.d/org.dsr1d.conf
    (and ``extra_policy`` after it, when a test gives one)."""
    if os.geteuid() != 0 or not all(shutil.which(t) for t in _TOOLS):
        pytest.skip(f"needs root and {', '.join(_TOOLS)}")
    policies: list[Path] = [POLICY]
    if extra_policy is not None:
        extra = tmp_path / "zz-test-extra.conf"
        extra.write_text(extra_policy)
        policies.append(extra)
    with PrivateBus(policies) as private:
        request.node.stash.setdefault(_BUSES, []).append(private)
        yield private


@pytest.fixture
def config(tmp_path: Path) -> Path:
    """A daemon configuration that applies ``sustained`` at start (never the host's file)."""
    path = tmp_path / "dsr1d.conf"
    path.write_text("[daemon]\ndefault_profile = sustained\ntelemetry_interval_s = 1.0\n")
    return path


@pytest.fixture
def start_daemon(request: pytest.FixtureRequest, bus: PrivateBus, fake: FakeRoot, config: Path,
                 tmp_path: Path) -> Iterator[Callable[..., Daemon]]:
    """Factory: ``start_daemon(ready=True, root=…, config_path=…, env=…, notify=True)`` starts
    ``dsr1d run`` on the private bus, by default against conftest's ``fake`` root with the
    ``config`` above, and (``ready=True``) returns once it is ready: ``READY=1`` on its notify
    socket, or without one (``notify=False``) once ``ActiveProfile`` answers on the bus.

    Every daemon it started is stopped (SIGTERM, then SIGKILL) when the test ends, and the
    logs of all of them are attached to the report of a failing test.
    """
    started: list[Daemon] = request.node.stash.setdefault(_DAEMONS, [])

    def start(ready: bool = True, root: Path | FakeRoot | None = None,
              config_path: Path | None = None, env: dict[str, str] | None = None,
              notify: bool = True, args: tuple[str, ...] = ()) -> Daemon:
        root_path = Path(str(root)) if root is not None else fake.path
        daemon = Daemon(bus, root_path, config_path or config, tmp_path, env=env, notify=notify,
                        args=args)
        started.append(daemon)
        daemon.start()
        if ready:
            daemon.wait_ready()
        return daemon

    yield start
    for daemon in reversed(started):
        daemon.cleanup()


@pytest.fixture
def daemon(start_daemon: Callable[..., Daemon]) -> Daemon:
    """A running, ready daemon on the fake root with ``sustained`` applied."""
    return start_daemon()


@pytest.fixture
def client(bus: PrivateBus) -> Iterator[Callable[[], BusClient]]:
    """Factory of dbus-fast connections to the private bus; all closed at the end."""
    pytest.importorskip("dbus_fast")
    made: list[BusClient] = []

    def make() -> BusClient:
        made.append(BusClient(bus.address))
        return made[-1]

    yield make
    for c in made:
        c.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):
    """Attach the daemon's (and the bus's) log to the report of a failing test phase."""
    report = yield
    if report.failed:
        for daemon in item.stash.get(_DAEMONS, []):
            report.sections.append(
                (f"dsr1d log ({daemon.logfile.name}, pid {daemon.proc.pid if daemon.proc else '-'})",
                 daemon.log() or "(empty)"))
        for private in item.stash.get(_BUSES, []):
            text = private.log()
            if text:
                report.sections.append(("dbus-daemon log", text))
    return report
