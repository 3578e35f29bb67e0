"""No partial state, ever: a plugin hook that raises mid-switch, a switch back that fails when a
hold is released, re-applying the active profile after drift, a journaled knob that vanished
while dsr1d was down, journal keys that point outside the root, temporaries left by kills, a CPU
unplugged under a profile, drift that the tuner's memory of its own writes does not see."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("daemon_fixtures")
from daemon_fixtures import EPB, ERROR, active, knobs, prop  # noqa: E402
from fakeroot import FakeRoot  # noqa: E402

pytest_plugins = ["daemon_fixtures"]

HERE = Path(__file__).resolve().parent


def dsr1d(fake: FakeRoot, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("DSR1D_")}
    return subprocess.run([sys.executable, "-m", "dsr1d.edges.admin", *args, "--root", str(fake.path)],
                          capture_output=True, text=True, timeout=60, env={**base, **env})


def test_a_plugin_hook_that_raises_mid_switch_leaves_the_previous_profile(fake) -> None:
    assert dsr1d(fake, "apply", "balanced").returncode == 0
    before = knobs(fake)
    proc = dsr1d(fake, "apply", "throughput", PYTHONPATH=str(HERE), DSR1D_PLUGINS="raiseplugin",
                 DSR1D_RAISE_AT="3")
    assert proc.returncode == 1, proc.stderr
    assert "RuntimeError: plugin bug at knob write 3" in proc.stderr
    assert "nothing changed, balanced still in force" in proc.stderr
    assert knobs(fake) == before
    assert "balanced: every knob holds" in dsr1d(fake, "verify").stdout


def test_a_failed_switch_back_keeps_the_hold_and_says_so(daemon, bus, fake, client) -> None:
    holder = client()
    (cookie,) = holder.ok("HoldProfile", "sss", "latency", "bench", "test")
    epb1 = fake.path / EPB.format(1)
    epb1.unlink()
    # Writes now fail with EINVAL: the real THP file takes only its own words (it stays as it is).
    epb1.symlink_to("/sys/kernel/mm/transparent_hugepage/enabled")
    reply = holder.call("ReleaseProfile", "u", cookie)
    assert reply.error_name == ERROR + "ApplyFailed", reply.body
    assert "EINVAL" in reply.body[0] and "latency still in force" in reply.body[0]
    assert active(bus) == "latency"
    assert [h[0] for h in prop(bus, "Holds")] == [cookie]
    # Once the knob works again, releasing succeeds.
    epb1.unlink()
    epb1.write_text("0\n")
    assert holder.call("ReleaseProfile", "u", cookie).error_name is None
    assert active(bus) == "sustained" and prop(bus, "Holds") == []


def test_switching_to_the_active_profile_repairs_drift(daemon, bus, fake, client) -> None:
    epb0 = fake.path / EPB.format(0)
    wanted = epb0.read_text()
    epb0.write_text("15\n")  # someone else changed it
    c = client()
    ok, drift = c.ok("Verify")
    assert not ok and drift
    assert c.call("SwitchProfile", "s", "sustained").error_name is None
    assert epb0.read_text() == wanted
    assert c.ok("Verify")[0] is True


def test_a_journaled_knob_that_vanished_is_skipped_and_the_rest_restored(fake) -> None:
    before = knobs(fake)
    assert dsr1d(fake, "apply", "latency").returncode == 0
    # CPU 3 is unplugged while no daemon runs: its knobs are gone from sysfs.
    gone = fake.path / "sys/devices/system/cpu/cpu3"
    for path in sorted(gone.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
    gone.rmdir()
    proc = dsr1d(fake, "restore")
    assert proc.returncode == 0, proc.stderr
    assert "cpu3" in proc.stderr and "no longer exists" in proc.stderr
    left = {k: v for k, v in before.items() if "/cpu3/" not in k}
    assert {k: v for k, v in knobs(fake).items() if "/cpu3/" not in k} == left
    assert not (fake.path / "run/dsr1d/state.json").exists()


def test_a_journal_key_outside_the_root_is_refused_and_nothing_written(fake, tmp_path) -> None:
    outside = fake.path.parent / "outside"
    outside.write_text("precious\n")
    journal = fake.path / "run/dsr1d/state.json"
    journal.parent.mkdir(parents=True, exist_ok=True)
    journal.write_text(json.dumps({"format": 1, "root": str(fake.path), "originals": [
        {"key": "file:../outside", "tunable": "x", "value": "owned"}], "profile": None,
        "wanted": {}, "pid": 1}))
    proc = dsr1d(fake, "restore")
    assert proc.returncode == 3, proc.stderr
    assert "outside the hardware root" in proc.stderr
    assert outside.read_text() == "precious\n" and journal.exists()


def test_temporaries_left_by_killed_writers_are_cleaned_up(fake) -> None:
    run = fake.path / "run/dsr1d"
    run.mkdir(parents=True, exist_ok=True)
    stale = [run / f".state.json.{pid}.tmp" for pid in (999999991, 999999992)]
    for path in stale:
        path.write_text("{}")
    assert dsr1d(fake, "apply", "latency").returncode == 0
    assert not any(p.exists() for p in stale)
    assert dsr1d(fake, "restore").returncode == 0
    assert sorted(p.name for p in run.iterdir()) == []


def _unplug(fake: FakeRoot, cpu: int) -> None:
    gone = fake.path / f"sys/devices/system/cpu/cpu{cpu}"
    for path in sorted(gone.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
    gone.rmdir()
    online = [c for c in fake.cpus if c != cpu]
    fake.write("sys/devices/system/cpu/online", ",".join(map(str, online)) + "\n")


def test_a_cpu_unplugged_under_a_profile_is_kept_journaled_by_the_next_switch(fake) -> None:
    from dsr1d.core.context import build_core

    core = build_core(fake.path)
    core.tuner.switch(core.store.load("throughput"))  # idle states off on every CPU
    assert fake.state_disabled(3, "C6") == "1"
    _unplug(fake, 3)
    # balanced gives the idle states back: CPU 3's cannot be, and that is not a failure.
    plan = core.tuner.switch(core.store.load("balanced"))
    assert fake.state_disabled(0, "C6") == "0"
    assert any("/cpu3/" in skip.option for skip in plan.skips)
    journaled = [o.key for o in core.journal.load().originals]
    assert any("/cpu3/" in key for key in journaled)
    assert not any("/cpu0/cpuidle" in key for key in journaled)


def test_drift_on_a_knob_the_next_profile_also_sets_is_repaired_by_re_applying(fake) -> None:
    from dsr1d.core.context import build_core

    core = build_core(fake.path)
    core.tuner.switch(core.store.load("throughput"))
    core.tuner.switch(core.store.load("latency"))
    epb0 = fake.path / EPB.format(0)
    wanted = epb0.read_text()
    epb0.write_text("15\n")  # someone else's write, unknown to the daemon
    drift = core.tuner.verify().drift
    assert [d.actual for d in drift] == ["15"]
    core.tuner.switch(core.store.load("latency"))
    assert epb0.read_text() == wanted and not core.tuner.verify().drift
