"""A control plane nobody can knock over: floods of reads and holds from unprivileged and
privileged clients, on the real daemon and a private system-like bus.

Every flood is bounded (a fixed number of calls, a deadline) and local (the private bus), and
stops by itself. After each one the daemon must still own ``org.dsr1d``, answer, and keep its
knobs — the failure this guards against left the process running without its bus name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytest.register_assert_rewrite("daemon_fixtures")
from daemon_fixtures import (AS_NOBODY, BUS_NAME, ERROR, active, manager_data,  # noqa: E402
                             journal, knobs, name_gone, prop, write_profile)

pytest_plugins = ["daemon_fixtures"]

# Opens CONNS connections and sends CALLS calls on each, all at once, without waiting between
# them; prints how many got a method return, how many an error (by name), how many nothing.
FLOOD = """\
import asyncio, collections, json, sys
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

ADDRESS, CONNS, CALLS, KIND = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
CALLS_BY_KIND = {
    "reads": [("/org/dsr1d", "org.dsr1d.Manager1", "GetTelemetry", "", []),
              ("/org/dsr1d", "org.freedesktop.DBus.Properties", "Get", "ss",
               ["org.dsr1d.Manager1", "ActiveProfile"]),
              ("/org/dsr1d", "org.dsr1d.Manager1", "ListProfiles", "", [])],
    "holds": [("/org/dsr1d", "org.dsr1d.Manager1", "HoldProfile", "sss",
               ["latency", "flood " * 40, "flood-test"])],
}

async def one(bus, i):
    path, iface, member, sig, body = CALLS_BY_KIND[KIND][i % len(CALLS_BY_KIND[KIND])]
    try:
        reply = await asyncio.wait_for(bus.call(Message(
            destination="org.dsr1d", path=path, interface=iface, member=member,
            signature=sig, body=body)), 60)
    except Exception as exc:
        return "lost:" + type(exc).__name__
    if reply.message_type == MessageType.METHOD_RETURN:
        return "ok"
    return reply.error_name

async def main():
    buses = [await MessageBus(bus_address=ADDRESS).connect() for _ in range(CONNS)]
    results = await asyncio.gather(*(one(b, i) for b in buses for i in range(CALLS)))
    print(json.dumps(collections.Counter(results)))

asyncio.run(main())
"""


def flood(bus, kind: str, conns: int, calls: int, nobody: bool) -> dict[str, int]:
    prefix = AS_NOBODY if nobody else ()
    proc = subprocess.run([*prefix, sys.executable, "-c", FLOOD, bus.address, str(conns),
                           str(calls), kind], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def still_serving(bus, daemon) -> None:
    assert daemon.running(), daemon.log()
    assert not name_gone(bus, BUS_NAME), "the daemon lost org.dsr1d"
    assert active(bus) == "sustained"
    assert manager_data(bus, "ListProfiles", nobody=True)


@pytest.fixture
def many_profiles(fake) -> None:
    """120 user profiles with long summaries: ListProfiles answers ~140 KB, more than a socket
    buffer, so replies queue behind a partly written one (where the old writer gave up)."""
    for i in range(120):
        write_profile(fake, f"site-{i:03d}", f"[main]\nsummary = {'site tuning ' * 95}\n"
                                             f"include = throughput\n")


def test_a_thousand_concurrent_reads_from_fifty_unprivileged_connections_are_all_answered(
        bus, many_profiles, daemon) -> None:
    counts = flood(bus, "reads", conns=50, calls=20, nobody=True)
    assert counts == {"ok": 1000}, counts
    still_serving(bus, daemon)


def test_a_second_flood_right_after_the_first_is_answered_too(bus, many_profiles,
                                                              daemon) -> None:
    for _ in range(2):
        assert flood(bus, "reads", conns=25, calls=40, nobody=True) == {"ok": 1000}
    still_serving(bus, daemon)


def test_holds_are_limited_per_connection_and_answered_not_dropped(bus, daemon) -> None:
    counts = flood(bus, "holds", conns=4, calls=40, nobody=False)
    # 16 per connection are taken; the rest are refused with a clear error, none is lost.
    assert counts == {"ok": 64, ERROR + "TooManyHolds": 96}, counts
    # The flood's connections are gone: so are their holds.
    assert prop(bus, "Holds") == []
    still_serving(bus, daemon)


def test_an_over_long_hold_reason_is_refused(bus, daemon, client) -> None:
    c = client()
    reply = c.call("HoldProfile", "sss", "latency", "x" * 5000, "long")
    assert reply.error_name == ERROR + "InvalidArgument", reply.body
    assert "at most 256" in reply.body[0]
    assert prop(bus, "Holds") == []


def test_a_daemon_that_loses_the_bus_restores_every_knob_and_exits_non_zero(
        bus, fake, start_daemon) -> None:
    """Never nameless: with its connection gone the daemon cannot be reached, so it puts the
    machine back and exits 1, and systemd's Restart= brings it back onto the bus."""
    before = knobs(fake)
    daemon = start_daemon()
    assert knobs(fake) != before
    os.kill(bus.pid, signal.SIGKILL)
    assert daemon.wait() == 1
    assert "lost the bus connection" in daemon.log()
    assert knobs(fake) == before
    assert not journal(fake).exists()
