"""org.dsr1d.Manager1 on a private system-like bus, with the project's policy file, driven by
real clients: busctl and dbus-send as root and as nobody, and dbus-fast connections.

The daemon is the real ``dsr1d run`` subprocess against a fake Intel root (tests/fakeroot.py),
so every knob it writes is a file the test can read.
"""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytest.register_assert_rewrite("daemon_fixtures")
from daemon_fixtures import (BUILTINS, BUS_NAME, DBUS_INVALID_ARGS, EPB, EPP,
                             ERROR, MANAGER, PATH, SUSTAINED_EPB, active, busctl, dbus_send,
                             error_of, eventually, journal, knobs, manager_call, manager_data,
                             name_gone, prop,
                             read_line, write_profile)

pytest_plugins = ["daemon_fixtures"]

CPUS = range(4)
SIGNALS = f"type='signal',sender='{BUS_NAME}',path='{PATH}'"

# A hold made by another process: it holds a profile, prints its unique name and the cookie,
# then waits until it is killed.
HOLDER = """\
import asyncio, sys
from dbus_fast import Message, MessageType
from dbus_fast.aio import MessageBus

async def main():
    bus = await MessageBus(bus_address=sys.argv[1]).connect()
    reply = await bus.call(Message(destination="org.dsr1d", path="/org/dsr1d",
                                   interface="org.dsr1d.Manager1", member="HoldProfile",
                                   signature="sss", body=[sys.argv[2], "batch job", "holder-test"]))
    if reply.message_type != MessageType.METHOD_RETURN:
        print("ERROR", reply.error_name, *reply.body, flush=True)
        return 1
    print(bus.unique_name, reply.body[0], flush=True)
    await asyncio.Event().wait()

sys.exit(asyncio.run(main()))
"""


def epbs(fake) -> list[str]:
    return [fake.read(EPB.format(cpu)) for cpu in CPUS]


# -- access: reading is open to everyone, changing is not --------------------------------------

def test_reads_are_allowed_to_root_and_nobody(daemon, bus):
    for nobody in (False, True):
        check_reads(bus, nobody)


def check_reads(bus, nobody: bool) -> None:
    assert prop(bus, "ActiveProfile", nobody=nobody) == "sustained"
    assert prop(bus, "Profiles", nobody=nobody) == list(BUILTINS)
    assert prop(bus, "Version", nobody=nobody)
    assert prop(bus, "ThrottleState", nobody=nobody) == "none"
    assert prop(bus, "Mitigations", nobody=nobody) == []
    tunables = {name: supported for name, supported, _ in prop(bus, "Tunables", nobody=nobody)}
    assert tunables == {"cpufreq": True, "cstate": True, "epb": True, "prefetcher": True,
                        "rapl": True, "thp": True, "turbo": True, "uncore": True}

    every = busctl(bus, "--json=short", "call", BUS_NAME, PATH, "org.freedesktop.DBus.Properties",
                   "GetAll", "s", MANAGER, nobody=nobody)
    assert every.returncode == 0, every.stderr
    assert "ActiveProfile" in every.stdout and "Holds" in every.stdout

    (rows,) = manager_data(bus, "ListProfiles", nobody=nobody)
    assert [name for name, _ in rows] == list(BUILTINS)
    assert all(summary for _, summary in rows)

    assert manager_data(bus, "Verify", nobody=nobody) == [True, []]

    (sample,) = manager_data(bus, "GetTelemetry", nobody=nobody)
    # Read from the fake root's /proc; utilisation needs two differing /proc/stat reads,
    # which a static fake never gives, so it is absent rather than invented.
    assert {"load_1m", "memory_available_bytes", "unavailable"} <= set(sample)

    introspected = busctl(bus, "introspect", BUS_NAME, PATH, nobody=nobody)
    assert introspected.returncode == 0, introspected.stderr
    for member in (".SwitchProfile", ".HoldProfile", ".ReleaseProfile", ".Reload", ".Verify",
                   ".ProfileChanged", ".ActiveProfile"):
        assert member in introspected.stdout

    peer = busctl(bus, "call", BUS_NAME, PATH, "org.freedesktop.DBus.Peer", "Ping", nobody=nobody)
    assert peer.returncode == 0, peer.stderr


MUTATING = {
    "SwitchProfile": (("s", "throughput"), ("string:throughput",)),
    "Reload": ((), ()),
    "HoldProfile": (("sss", "throughput", "r", "app"), ("string:throughput", "string:r",
                                                        "string:app")),
    "ReleaseProfile": (("u", "{cookie}"), ("uint32:{cookie}",)),
}


def test_mutating_methods_are_refused_to_nobody_by_the_daemon(daemon, bus, fake, client):
    """The bus lets the call through (so that polkit can be asked); the daemon refuses it."""
    holder = client()
    (cookie,) = holder.ok("HoldProfile", "sss", "sustained", "kept", "test")
    before = knobs(fake)
    for method, (busctl_args, send_args) in MUTATING.items():
        busctl_args = tuple(a.format(cookie=cookie) for a in busctl_args)
        send_args = tuple(a.format(cookie=cookie) for a in send_args)
        denied = manager_call(bus, method, *busctl_args, nobody=True)
        assert denied.returncode != 0, method
        assert "needs root, the dsr1d group or polkit" in denied.stderr, (method, denied.stderr)
        name, message = error_of(dbus_send(bus, method, *send_args, nobody=True))
        assert name == ERROR + "AccessDenied", method
        assert "uid 65534" in message, (method, message)

    # Nothing happened: same profile, the hold is still there, no knob moved, no reload.
    assert active(bus) == "sustained"
    assert [h[0] for h in prop(bus, "Holds")] == [cookie]
    assert knobs(fake) == before
    assert not daemon.notify.find(lambda m: m.get("RELOADING") == "1")
    assert "reload" not in daemon.log().lower()


def test_the_bus_still_denies_what_the_daemon_does_not_serve(daemon, bus):
    """Only the daemon's own interfaces and reads are open; Properties.Set is not."""
    proc = busctl(bus, "set-property", BUS_NAME, PATH, "org.dsr1d.Manager1", "ActiveProfile",
                  "s", "latency", nobody=True)
    assert proc.returncode != 0 and "Access denied" in proc.stderr, proc.stderr
    assert active(bus) == "sustained"


def test_root_may_switch(daemon, bus, fake):
    switched = manager_call(bus, "SwitchProfile", "s", "throughput")
    assert switched.returncode == 0, switched.stderr
    assert active(bus) == "throughput"
    assert epbs(fake) == ["0"] * 4  # performance


# -- errors ------------------------------------------------------------------------------------

WRONG_TYPES = [
    ("SwitchProfile", ("i", "3"), ("int32:3",)),
    ("SwitchProfile", ("ss", "throughput", "x"), ("string:throughput", "string:x")),
    ("SwitchProfile", (), ()),
    ("HoldProfile", ("s", "throughput"), ("string:throughput",)),
    ("ReleaseProfile", ("s", "1"), ("string:1",)),
    ("ListProfiles", ("s", "x"), ("string:x",)),
]


def test_wrong_argument_types_are_invalid_args(daemon, bus, fake):
    before = knobs(fake)
    for method, busctl_args, send_args in WRONG_TYPES:
        by_busctl = manager_call(bus, method, *busctl_args)
        assert by_busctl.returncode != 0, (method, busctl_args)
        assert f"{method} takes" in by_busctl.stderr, by_busctl.stderr
        name, message = error_of(dbus_send(bus, method, *send_args))
        assert name == DBUS_INVALID_ARGS, (method, send_args, name)
        assert method in message
    assert active(bus) == "sustained"
    assert knobs(fake) == before
    assert "Traceback" not in daemon.log()


def test_unknown_profile_names_the_available_ones(daemon, bus, fake):
    before = knobs(fake)
    for method, args in (("SwitchProfile", ("string:warp-speed",)),
                         ("HoldProfile", ("string:warp-speed", "string:r", "string:app"))):
        name, message = error_of(dbus_send(bus, method, *args))
        assert name == ERROR + "UnknownProfile", method
        assert "warp-speed" in message
        for profile in BUILTINS:
            assert profile in message
        assert "\n" not in message.strip()
    assert active(bus) == "sustained"
    assert prop(bus, "Holds") == []
    assert knobs(fake) == before


def test_releasing_a_hold_of_another_connection_is_refused(daemon, bus, fake, client):
    holder = client()
    (cookie,) = holder.ok("HoldProfile", "sss", "powersave", "nightly batch", "holder-test")
    assert active(bus) == "powersave"

    name, message = error_of(dbus_send(bus, "ReleaseProfile", f"uint32:{cookie}"))
    assert name == ERROR + "NotHolder"
    assert str(cookie) in message
    assert prop(bus, "Holds") == [[cookie, "powersave", "nightly batch", "holder-test"]]
    assert active(bus) == "powersave"
    assert epbs(fake) == ["15"] * 4

    name, _ = error_of(dbus_send(bus, "ReleaseProfile", f"uint32:{cookie + 100}"))
    assert name == ERROR + "NoSuchHold"

    holder.ok("ReleaseProfile", "u", cookie)  # its owner may
    assert active(bus) == "sustained"
    assert prop(bus, "Holds") == []
    assert epbs(fake) == [SUSTAINED_EPB] * 4


QOS_ONLY = """\
[main]
summary = a PM QoS request and nothing else

[cstate]
max_latency_us = 0
"""


def test_failing_write_undoes_the_switch(start_daemon, bus, fake, tmp_path):
    """A write that fails half-way through a switch (EISDIR) undoes the writes made before it.

    powersave -> qos: first the knobs powersave set and qos does not are put back (EPB, EPP,
    THP: ten writes), then the PM QoS request is written, which fails because the fake
    ``dev/cpu_dma_latency`` is now a directory. Those ten writes must be undone.
    """
    write_profile(fake, "qos", QOS_ONLY)
    original = knobs(fake)
    config = tmp_path / "powersave.conf"
    config.write_text("[daemon]\ndefault_profile = powersave\n")
    daemon = start_daemon(config_path=config)
    assert active(bus) == "powersave"
    qos_device = fake.path / "dev/cpu_dma_latency"
    qos_device.unlink()
    qos_device.mkdir()
    before = knobs(fake)
    assert before != original and epbs(fake) == ["15"] * 4

    name, message = error_of(dbus_send(bus, "SwitchProfile", "string:qos"))
    assert name == ERROR + "ApplyFailed"
    assert "cstate" in message and str(qos_device) in message
    assert "EISDIR" in message
    assert "\n" not in message.strip()

    assert active(bus) == "powersave"
    assert knobs(fake) == before, "the releases made before the failing write were not undone"
    assert manager_data(bus, "Verify") == [True, []]

    # The journal still knows every original: a clean stop puts the machine back.
    qos_device.rmdir()
    qos_device.write_bytes(b"\0" * 4)
    assert daemon.stop() == 0, daemon.log()
    assert knobs(fake) == original
    assert not journal(fake).exists()


def test_unreadable_knob_rejects_the_switch(daemon, bus, fake):
    """A knob that became a directory (EISDIR) makes the switch fail with the knob and errno,
    and the previous profile stays fully in force."""
    before = knobs(fake)
    knob = fake.path / EPB.format(3)
    knob.unlink()
    knob.mkdir()

    name, message = error_of(dbus_send(bus, "SwitchProfile", "string:powersave"))
    assert name == ERROR + "ApplyFailed"
    assert "epb" in message and str(knob) in message
    assert "EISDIR" in message

    assert active(bus) == "sustained"
    after = knobs(fake)
    assert after == {k: v for k, v in before.items() if k != EPB.format(3)}
    assert [fake.read(EPB.format(cpu)) for cpu in range(3)] == [SUSTAINED_EPB] * 3
    assert fake.read(EPP.format(3)) == "balance_performance"

    knob.rmdir()
    knob.write_text(SUSTAINED_EPB)
    assert daemon.stop() == 0, daemon.log()


# -- signals -----------------------------------------------------------------------------------

def test_switch_emits_profile_changed_and_properties_changed(daemon, bus, fake, client):
    watcher = client()
    watcher.subscribe(SIGNALS)
    switched = manager_call(bus, "SwitchProfile", "s", "throughput")
    assert switched.returncode == 0, switched.stderr

    changed = eventually(lambda: watcher.received("ProfileChanged", MANAGER),
                         what="ProfileChanged")
    assert [m.body for m in changed] == [["sustained", "throughput", "manual"]]
    assert changed[0].signature == "sss"

    def active_changed():
        return [m for m in watcher.received("PropertiesChanged",
                                            "org.freedesktop.DBus.Properties")
                if m.body[0] == MANAGER and "ActiveProfile" in m.body[1]]

    props = eventually(active_changed, what="PropertiesChanged(ActiveProfile)")
    assert props[-1].body[1]["ActiveProfile"].value == "throughput"
    assert epbs(fake) == ["0"] * 4

    # Switching to the active profile changes nothing and says nothing.
    watcher.sync()
    count = len(watcher.signals)
    again = manager_call(bus, "SwitchProfile", "s", "throughput")
    assert again.returncode == 0, again.stderr
    assert active(bus) == "throughput"
    watcher.sync()
    assert len(watcher.received("ProfileChanged")) == 1
    assert len(watcher.signals) == count


def test_holds_emit_signals_with_their_reason(daemon, bus, client):
    watcher = client()
    watcher.subscribe(SIGNALS)
    holder = client()
    (cookie,) = holder.ok("HoldProfile", "sss", "latency", "interactive demo", "demo-app")
    holder.ok("ReleaseProfile", "u", cookie)
    changed = eventually(lambda: len(watcher.received("ProfileChanged")) == 2
                         and watcher.received("ProfileChanged"), what="two ProfileChanged")
    assert changed[0].body[:2] == ["sustained", "latency"]
    assert "demo-app" in changed[0].body[2] and "interactive demo" in changed[0].body[2]
    assert changed[1].body[:2] == ["latency", "sustained"]
    assert str(cookie) in changed[1].body[2]
    def holds() -> list:
        return [[list(h) for h in m.body[1]["Holds"].value]
                for m in watcher.received("PropertiesChanged") if "Holds" in m.body[1]]

    # Property changes are coalesced per turn of the daemon's loop: they may trail the signal.
    eventually(lambda: len(holds()) >= 2, what="two Holds changes")
    assert holds() == [[[cookie, "latency", "interactive demo", "demo-app"]], []]


# -- holds -------------------------------------------------------------------------------------

def test_hold_applies_the_profile_and_release_restores(daemon, bus, fake, client):
    holder = client()
    (cookie,) = holder.ok("HoldProfile", "sss", "powersave", "overnight", "batch")
    assert active(bus) == "powersave"
    assert epbs(fake) == ["15"] * 4
    assert prop(bus, "Holds") == [[cookie, "powersave", "overnight", "batch"]]

    # Holds stack: the newest wins, releasing it falls back to the one before.
    (second,) = holder.ok("HoldProfile", "sss", "latency", "demo", "batch")
    assert active(bus) == "latency"
    holder.ok("ReleaseProfile", "u", second)
    assert active(bus) == "powersave"
    holder.ok("ReleaseProfile", "u", cookie)
    assert active(bus) == "sustained"
    assert epbs(fake) == [SUSTAINED_EPB] * 4


def test_hold_ends_when_the_holding_process_is_killed(daemon, bus, fake):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, bus.address, "powersave"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=bus.env())
    try:
        line = read_line(holder.stdout, what="the holder's cookie")
        unique, cookie = line.split()
        assert active(bus) == "powersave", line
        assert epbs(fake) == ["15"] * 4
        assert [h[0] for h in prop(bus, "Holds")] == [int(cookie)]

        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        eventually(lambda: active(bus) == "sustained", what="the hold to end with its holder")
        assert prop(bus, "Holds") == []
        assert epbs(fake) == [SUSTAINED_EPB] * 4
        assert f"holder {unique} left the bus" in daemon.log()
    finally:
        if holder.poll() is None:
            holder.kill()
        holder.communicate()


def test_manual_switch_cancels_holds(daemon, bus, fake, client):
    holder = client()
    (cookie,) = holder.ok("HoldProfile", "sss", "powersave", "overnight", "batch")
    holder.ok("HoldProfile", "sss", "latency", "demo", "batch")
    assert len(prop(bus, "Holds")) == 2

    switched = manager_call(bus, "SwitchProfile", "s", "throughput")
    assert switched.returncode == 0, switched.stderr
    assert prop(bus, "Holds") == []
    assert active(bus) == "throughput"
    assert epbs(fake) == ["0"] * 4

    reply = holder.call("ReleaseProfile", "u", cookie)
    assert reply.error_name == ERROR + "NoSuchHold"

    # The former holder leaving changes nothing any more.
    unique = holder.unique_name
    holder.close()
    eventually(lambda: name_gone(bus, unique), what="the holder to leave the bus")
    assert active(bus) == "throughput"
    assert epbs(fake) == ["0"] * 4
