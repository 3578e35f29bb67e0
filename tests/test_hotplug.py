"""CPU hotplug with REAL kernel uevents: the daemon runs on a fake root, the event comes from
this machine's cpu1, and the daemon re-applies the active profile's per-CPU knobs to the fake
cpu1 (its EPB file is changed behind the daemon's back first).

Needs root and a writable /sys/devices/system/cpu/cpu1/{uevent,online} (see
TESTING-RECIPES.md); the real ``online`` knob is always put back by a finalizer.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

pytest.register_assert_rewrite("daemon_fixtures")
from daemon_fixtures import (EPB, EPP, SUSTAINED_EPB, active, eventually,  # noqa: E402
                             manager_call, prop, write_profile)

pytest_plugins = ["daemon_fixtures"]

REAL_CPU1 = Path("/sys/devices/system/cpu/cpu1")


def _writable(path: Path) -> bool:
    return os.geteuid() == 0 and path.exists() and os.access(path, os.W_OK)


def behind_the_daemons_back(fake) -> None:
    """Drift on the fake cpu1 (and cpu2, which no event concerns)."""
    fake.write(EPB.format(1), "15\n")
    fake.write(EPP.format(1), "power\n")
    fake.write(EPB.format(2), "15\n")


def reapplied(fake) -> bool:
    return (fake.read(EPB.format(1)) == SUSTAINED_EPB
            and fake.read(EPP.format(1)) == "balance_performance")


@pytest.fixture
def cpu1_online():
    """The real cpu1 online file; whatever the test does, cpu1 is online again afterwards."""
    online = REAL_CPU1 / "online"
    if not _writable(online):
        pytest.skip(f"needs root and a writable {online}")
    assert online.read_text().strip() == "1", "cpu1 must be online before the test"
    try:
        yield online
    finally:
        online.write_text("1")
        assert online.read_text().strip() == "1"


@pytest.mark.skipif(not _writable(REAL_CPU1 / "uevent"),
                    reason=f"needs root and a writable {REAL_CPU1 / 'uevent'}")
def test_change_uevent_reapplies_the_profile_to_cpu1(daemon, fake):
    behind_the_daemons_back(fake)
    (REAL_CPU1 / "uevent").write_text("change")
    eventually(lambda: reapplied(fake), what="the daemon to re-apply sustained to the fake cpu1",
               detail=daemon.log)
    # The log line follows the writes: wait for it too.
    eventually(lambda: "cpu 1 online: re-applied sustained" in daemon.log(),
               what="the re-apply to be logged", detail=daemon.log)
    assert "cpu1: kernel event change" in daemon.log()
    assert fake.read(EPB.format(2)) == "15", "only the CPU of the event is re-applied"
    assert daemon.running()


@pytest.mark.realknob
def test_offline_online_reapplies_the_profile_to_cpu1(daemon, fake, cpu1_online):
    behind_the_daemons_back(fake)
    cpu1_online.write_text("0")
    cpu1_online.write_text("1")
    eventually(lambda: "cpu1: kernel event online" in daemon.log(),
               what="the daemon to see cpu1 come online", detail=daemon.log)
    eventually(lambda: reapplied(fake), what="the daemon to re-apply sustained to the fake cpu1",
               detail=daemon.log)
    eventually(lambda: "cpu 1 online: re-applied sustained" in daemon.log(),
               what="the re-apply to be logged", detail=daemon.log)
    assert fake.read(EPB.format(2)) == "15", "only the CPU of the event is re-applied"
    assert daemon.running()


MINE = "[main]\nsummary = a user profile\n\n[epb]\nepb = 7\n"


@pytest.mark.skipif(not _writable(REAL_CPU1 / "uevent"),
                    reason=f"needs root and a writable {REAL_CPU1 / 'uevent'}")
def test_hotplug_still_reapplies_after_a_reload_lost_the_active_profiles_file(daemon, bus, fake):
    """A user profile is active, its file is removed, the daemon reloads and keeps it (as it
    says); a CPU coming back must still get the active profile's per-CPU knobs."""
    path = write_profile(fake, "mine", MINE)
    daemon.send(signal.SIGHUP)
    daemon.notify.wait_for(lambda m: m.get("READY") == "1", count=2, what="the first reload")
    switched = manager_call(bus, "SwitchProfile", "s", "mine")
    assert switched.returncode == 0, switched.stderr
    path.unlink()
    reloaded = manager_call(bus, "Reload")
    assert daemon.running(), reloaded.stderr

    now = active(bus)
    assert now in prop(bus, "Profiles"), "ActiveProfile must be one of Profiles"
    wanted = {"mine": "7", "sustained": SUSTAINED_EPB}[now]
    fake.write(EPB.format(1), "15\n")
    (REAL_CPU1 / "uevent").write_text("change")
    eventually(lambda: "cpu1: kernel event change" in daemon.log(), what="the uevent",
               detail=daemon.log)
    eventually(lambda: fake.read(EPB.format(1)) == wanted,
               what=f"cpu1's EPB back to {now}'s {wanted}", detail=daemon.log)
    assert "re-apply on cpu1 failed" not in daemon.log()
