"""The daemon's life: readiness (sd_notify), watchdog, stop, crash, recovery, reload, bad config.

The real ``dsr1d run`` runs as a subprocess against a fake root on a private system-like bus;
``$NOTIFY_SOCKET`` is an abstract datagram socket bound by the test.
"""

from __future__ import annotations

import re
import signal

import pytest

pytest.register_assert_rewrite("daemon_fixtures")
from conftest import run_dsr1d  # noqa: E402
from fakeroot import intel_box  # noqa: E402
from daemon_fixtures import (BUILTINS, EPB, ERROR, SUSTAINED_EPB, active, dbus_send,  # noqa: E402
                             error_of, eventually, journal, knobs, manager_call, manager_data,
                             prop, write_profile)

pytest_plugins = ["daemon_fixtures"]


def epbs(fake) -> list[str]:
    return [fake.read(EPB.format(cpu)) for cpu in range(4)]


def switch(bus, profile: str) -> None:
    proc = manager_call(bus, "SwitchProfile", "s", profile)
    assert proc.returncode == 0, proc.stderr
    assert active(bus) == profile


# -- readiness and the watchdog ----------------------------------------------------------------

def test_ready_status_and_stopping_are_notified(start_daemon, bus):
    daemon = start_daemon()  # waits for READY=1 on the notify socket
    ready = daemon.notify.find(lambda m: m.get("READY") == "1")
    assert len(ready) == 1
    assert "sustained" in ready[0].get("STATUS", ""), daemon.notify.messages
    # READY means ready: the API answers at once, with the default profile applied.
    assert active(bus) == "sustained"
    assert not daemon.notify.find(lambda m: m.get("STOPPING") == "1")

    daemon.send(signal.SIGTERM)
    daemon.notify.wait_for(lambda m: m.get("STOPPING") == "1", what="STOPPING=1")
    assert daemon.wait() == 0, daemon.log()


def test_runs_without_a_notify_socket(start_daemon, bus, fake):
    daemon = start_daemon(notify=False)  # ready once the bus answers
    assert active(bus) == "sustained"
    assert (fake.path / "run/dsr1d/api.sock").exists()
    assert daemon.stop() == 0, daemon.log()
    assert not journal(fake).exists()
    assert not (fake.path / "run/dsr1d/api.sock").exists()   # a clean stop leaves no socket


def test_status_follows_the_active_profile(daemon, bus):
    switch(bus, "latency")
    daemon.notify.wait_for(lambda m: "latency" in m.get("STATUS", ""),
                           what="a STATUS= line naming latency")


def test_watchdog_pings_when_asked(start_daemon):
    daemon = start_daemon(env={"WATCHDOG_USEC": "200000"})
    daemon.notify.wait_for(lambda m: m.get("WATCHDOG") == "1", count=3,
                           what="three WATCHDOG=1 pings")
    assert daemon.stop() == 0, daemon.log()


def test_no_watchdog_pings_for_another_pid(start_daemon):
    """``WATCHDOG_PID`` names the process systemd watches; another process must not ping."""
    daemon = start_daemon(env={"WATCHDOG_USEC": "200000", "WATCHDOG_PID": "1"})
    # The first ping would go out on the loop's next turn after READY=1, before the SIGTERM
    # sent here is handled.
    assert daemon.stop() == 0
    assert not daemon.notify.find(lambda m: m.get("WATCHDOG") == "1")


# -- stop, crash and recovery ------------------------------------------------------------------

def test_sigterm_restores_every_knob_and_removes_the_journal(start_daemon, bus, fake):
    before = knobs(fake)
    daemon = start_daemon()
    assert journal(fake).exists()
    assert knobs(fake) != before
    assert epbs(fake) == [SUSTAINED_EPB] * 4
    switch(bus, "latency")
    switch(bus, "powersave")
    switch(bus, "throughput")

    assert daemon.stop() == 0, daemon.log()
    assert knobs(fake) == before
    assert not journal(fake).exists()
    assert "stopped: restored" in daemon.log()


def test_sigkill_then_dsr1d_restore_restores_every_knob(start_daemon, bus, fake):
    before = knobs(fake)
    daemon = start_daemon()
    switch(bus, "throughput")
    daemon.kill()
    assert journal(fake).exists()
    assert knobs(fake) != before

    restored = run_dsr1d("restore", "--root", str(fake.path))
    assert restored.returncode == 0, restored.stderr
    assert knobs(fake) == before
    assert not journal(fake).exists()


def test_restart_after_sigkill_recovers_the_journal_first(start_daemon, bus, fake):
    before = knobs(fake)
    first = start_daemon()
    switch(bus, "powersave")
    first.kill()
    assert epbs(fake) == ["15"] * 4

    second = start_daemon()
    log = second.log()
    found = re.search(rf"journal of a previous run \(pid {first.pid}, profile powersave\) "
                      r"found: it died without restoring; restoring \d+ knob\(s\) now", log)
    assert found, log
    applied = log.index("profile sustained applied (start)")
    assert found.start() < applied, "the leftover journal must be restored before the default"
    assert active(bus) == "sustained"
    assert epbs(fake) == [SUSTAINED_EPB] * 4
    assert manager_data(bus, "Verify") == [True, []]

    # The originals are the machine's, not the dead run's: a stop puts the machine back.
    assert second.stop() == 0, second.log()
    assert knobs(fake) == before
    assert not journal(fake).exists()


def test_second_daemon_on_the_same_bus_exits_1(start_daemon, bus, fake, tmp_path):
    first = start_daemon()
    switch(bus, "latency")
    during = knobs(fake)
    journal_text = journal(fake).read_text()

    # Another machine's root (so another journal, not locked): the bus name is what stops it.
    other = intel_box(tmp_path / "other-root")
    second = start_daemon(ready=False, root=other)
    assert second.wait() == 1, second.log()
    assert "org.dsr1d is already owned" in second.log()
    assert first.running()
    assert active(bus) == "latency"
    assert knobs(fake) == during
    assert journal(fake).read_text() == journal_text


# -- configuration and reload ------------------------------------------------------------------

def test_broken_config_exits_78_without_touching_a_knob(start_daemon, fake, tmp_path):
    before = knobs(fake)
    config = tmp_path / "broken.conf"
    config.write_text("[daemon]\ndefault_profile = sustained\nturbo_mode = ludicrous\n")
    daemon = start_daemon(ready=False, config_path=config)
    assert daemon.wait() == 78, daemon.log()
    stderr = daemon.log()
    assert f"{config}:3" in stderr, stderr
    assert "unknown key 'turbo_mode'" in stderr
    assert knobs(fake) == before
    assert not journal(fake).exists()
    assert daemon.notify.find(lambda m: "configuration rejected" in m.get("STATUS", ""))
    assert not daemon.notify.find(lambda m: m.get("READY") == "1")


def test_unknown_default_profile_exits_78_without_touching_a_knob(start_daemon, fake, tmp_path):
    before = knobs(fake)
    config = tmp_path / "typo.conf"
    config.write_text("[daemon]\ndefault_profile = sustaned\n")
    daemon = start_daemon(ready=False, config_path=config)
    assert daemon.wait() == 78, daemon.log()
    assert "sustaned" in daemon.log() and "sustained" in daemon.log()
    assert knobs(fake) == before
    assert not journal(fake).exists()


BROKEN_SUSTAINED = """\
[main]
summary = broken on purpose
this line has no equals sign
[epb
"""


def test_sighup_with_a_broken_profile_keeps_the_old_version(daemon, bus, fake):
    during = knobs(fake)
    path = write_profile(fake, "sustained", BROKEN_SUSTAINED)
    daemon.send(signal.SIGHUP)
    daemon.notify.wait_for(lambda m: m.get("READY") == "1", count=2,
                           what="READY=1 after the reload")
    assert daemon.notify.find(lambda m: m.get("RELOADING") == "1")
    assert daemon.running()
    log = daemon.log()
    assert f"{path}:3" in log, log
    assert "keeping the previous version" in log
    assert active(bus) == "sustained"
    assert prop(bus, "Profiles") == list(BUILTINS)
    assert knobs(fake) == during
    assert epbs(fake) == [SUSTAINED_EPB] * 4

    # The Reload method says the same, as a D-Bus error naming file:line.
    name, message = error_of(dbus_send(bus, "Reload"))
    assert name == ERROR + "InvalidProfile"
    assert f"{path}:3" in message
    assert daemon.running() and active(bus) == "sustained"


def test_sighup_picks_up_a_changed_profile(daemon, bus, fake):
    write_profile(fake, "sustained", "[main]\nsummary = cooler\ninclude = sustained\n\n"
                                     "[epb]\nepb = 9\n")
    daemon.send(signal.SIGHUP)
    eventually(lambda: epbs(fake) == ["9"] * 4, what="the edited profile to be applied")
    assert active(bus) == "sustained"
    assert daemon.stop() == 0, daemon.log()
