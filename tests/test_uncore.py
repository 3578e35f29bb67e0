"""The ``[uncore]`` tunable against fake roots shaped like ``intel_uncore_frequency`` in sysfs.

Through the daemon's own paths: profiles loaded and validated by the store, planned and written
by the tuner, journaled, restored in process, and restored by ``dsr1d restore`` after the apply
was SIGKILLed at every write.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import crashplugin
from conftest import run_dsr1d
from dsr1d.core.context import build_core
from dsr1d.core.profiles import Profile, ProfileError
from fakeroot import CPU, FakeRoot
from fakeroot import diff_snapshots as diff
from fakeroot import snapshot_tree as snapshot

UNCORE = f"{CPU}/intel_uncore_frequency"
PKG0, PKG1 = f"{UNCORE}/package_00_die_00", f"{UNCORE}/package_01_die_00"
JOURNAL = "run/dsr1d/state.json"


def profile(**sections: dict) -> Profile:
    return Profile("test", Path("test.conf"), "", sections)


def two_packages(path: Path) -> FakeRoot:
    """Two Intel packages, one die each, with different firmware ranges and limits not at the
    firmware's top (what restore must bring back is not the initial value)."""
    fake = FakeRoot(path)
    for cpu in range(4):
        fake.add_cpu(cpu)
    fake.add_uncore(0, low_khz=800_000, high_khz=2_400_000, max_khz=2_300_000)
    return fake.add_uncore(1, low_khz=1_000_000, high_khz=2_200_000, max_khz=2_100_000,
                           min_khz=1_100_000)


def limits(fake: FakeRoot, leaf: str, dirs: tuple[str, ...] = (PKG0, PKG1)) -> list[str]:
    return [fake.read(f"{d}/{leaf}") for d in dirs]


def user_profile(fake: FakeRoot, name: str, text: str) -> None:
    fake.write(f"etc/dsr1d/profiles/{name}.conf", f"[main]\nsummary = {name}\n{text}")


# -- apply, verify, restore ------------------------------------------------------------------

def test_apply_sets_every_package_and_restore_puts_back_the_exact_values(tmp_path):
    fake = two_packages(tmp_path)
    before = snapshot(fake.path)
    core = build_core(fake.path)
    plan = core.tuner.switch(profile(uncore={"max_mhz": 2000}))
    assert [c.key for c in plan.changes] == [f"file:{PKG0}/max_freq_khz",
                                             f"file:{PKG1}/max_freq_khz"]
    assert limits(fake, "max_freq_khz") == ["2000000", "2000000"]
    assert limits(fake, "min_freq_khz") == ["800000", "1100000"]  # not in the profile
    assert core.tuner.verify().drift == []

    restored, errors = build_core(fake.path).tuner.restore()   # another process, from the journal
    assert errors == [] and len(restored) == 2
    assert limits(fake, "max_freq_khz") == ["2300000", "2100000"]
    assert diff(before, snapshot(fake.path)) == []
    assert not (fake.path / JOURNAL).exists()


def test_values_are_clamped_to_each_packages_range_and_rounded_to_the_100_mhz_step(tmp_path):
    fake = two_packages(tmp_path)
    core = build_core(fake.path)
    core.tuner.switch(profile(uncore={"max_mhz": 3000, "min_mhz": 500}))
    assert limits(fake, "max_freq_khz") == ["2400000", "2200000"]
    assert limits(fake, "min_freq_khz") == ["800000", "1000000"]
    core.tuner.switch(profile(uncore={"max_mhz": 1950, "min_mhz": 1999}))
    # the kernel keeps 1900 of 1950: anything else would be drift to verify, forever
    assert limits(fake, "max_freq_khz") == ["1900000", "1900000"]
    assert limits(fake, "min_freq_khz") == ["1900000", "1900000"]
    assert core.tuner.verify().drift == []
    core.tuner.switch(profile(uncore={"max_mhz": "max", "min_mhz": "max"}))   # pinned at the top
    assert limits(fake, "min_freq_khz") == ["2400000", "2200000"]
    assert limits(fake, "max_freq_khz") == ["2400000", "2200000"]
    core.tuner.switch(profile(uncore={"max_mhz": "max", "min_mhz": "min"}))
    assert limits(fake, "max_freq_khz") == ["2400000", "2200000"]
    assert limits(fake, "min_freq_khz") == ["800000", "1000000"]
    core.tuner.restore()
    assert limits(fake, "max_freq_khz") == ["2300000", "2100000"]
    assert limits(fake, "min_freq_khz") == ["800000", "1100000"]


def test_probe_and_read_name_every_package(tmp_path):
    fake = two_packages(tmp_path)
    core = build_core(fake.path)
    support = core.tunables["uncore"].probe(core.root)
    assert support.supported
    assert support.detail == ("2 domain(s) (package_00_die_00, package_01_die_00), firmware "
                              "range 800..2400 MHz")
    assert core.tunables["uncore"].read(core.root) == {
        "max_mhz": "package_00_die_00=2300 package_01_die_00=2100",
        "min_mhz": "package_00_die_00=800 package_01_die_00=1100"}


def test_a_lower_ceiling_under_the_present_floor_lowers_the_floor_first(tmp_path):
    fake = FakeRoot(tmp_path).add_cpu(0).add_uncore(0, min_khz=2_000_000)
    core = build_core(fake.path)
    plan = core.tuner.switch(profile(uncore={"max_mhz": 1200, "min_mhz": 1000}))
    assert [c.key for c in plan.changes] == [f"file:{PKG0}/min_freq_khz",
                                             f"file:{PKG0}/max_freq_khz"]
    assert (fake.read(f"{PKG0}/min_freq_khz"), fake.read(f"{PKG0}/max_freq_khz")) == \
        ("1000000", "1200000")
    core.tuner.restore()
    assert (fake.read(f"{PKG0}/min_freq_khz"), fake.read(f"{PKG0}/max_freq_khz")) == \
        ("2000000", "2400000")


# -- what is refused, and changes nothing ----------------------------------------------------

@pytest.mark.parametrize("line", ["max_mhz = 20000", "max_mhz = 0", "min_mhz = fast",
                                  "max_mhz = 2.4GHz", "max_mhz ="])
def test_a_bad_value_is_a_clear_error_that_changes_nothing(tmp_path, line):
    fake = two_packages(tmp_path)
    user_profile(fake, "bad", f"[uncore]\n{line}\n")
    before = snapshot(fake.path)
    with pytest.raises(ProfileError) as caught:
        build_core(fake.path).store.load("bad")
    key = line.split()[0]
    assert str(caught.value).endswith(f"bad.conf:4: [uncore] {key}: "
                                      f"{line.partition('= ')[2]!r} is not 100..12700 (MHz), "
                                      "min or max"), str(caught.value)
    proc = run_dsr1d("apply", "bad", "--root", str(fake.path))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "bad.conf:4" in proc.stderr and "100..12700 (MHz), min or max" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert diff(before, snapshot(fake.path)) == []
    assert not (fake.path / JOURNAL).exists()


def test_a_floor_above_the_ceiling_is_skipped_with_its_reason(tmp_path):
    fake = two_packages(tmp_path)
    before = snapshot(fake.path)
    plan = build_core(fake.path).tuner.switch(profile(uncore={"max_mhz": 1500, "min_mhz": 2000}))
    assert plan.writes == []
    assert [s.reason for s in plan.skips] == [
        "package_00_die_00: minimum 2000 MHz would be above maximum 1500 MHz",
        "package_01_die_00: minimum 2000 MHz would be above maximum 1500 MHz"]
    assert diff(before, snapshot(fake.path)) == []


def test_a_ceiling_under_a_floor_set_elsewhere_is_skipped(tmp_path):
    fake = two_packages(tmp_path)
    plan = build_core(fake.path).tuner.plan(profile(uncore={"max_mhz": 1000}))
    # package 1's floor is 1100 MHz: its ceiling cannot go under it; package 0's can
    assert [c.key for c in plan.changes] == [f"file:{PKG0}/max_freq_khz"]
    assert [s.reason for s in plan.skips] == [
        "package_01_die_00: minimum 1100 MHz would be above maximum 1000 MHz"]


def test_absent_directory_is_unsupported_with_its_reason(tmp_path):
    fake = FakeRoot(tmp_path, vendor="AuthenticAMD", flags="fpu").add_cpu(0)
    core = build_core(fake.path)
    support = core.tunables["uncore"].probe(core.root)
    assert not support.supported
    assert support.detail == (f"no {fake.path.resolve()}/{UNCORE} (AuthenticAMD CPU: Intel "
                              "servers only)")
    assert core.tunables["uncore"].read(core.root) == {"max_mhz": "-", "min_mhz": "-"}
    before = snapshot(fake.path)
    plan = core.tuner.switch(profile(uncore={"max_mhz": 2000}))
    assert plan.writes == [] and plan.unsupported == {"uncore": support.detail}
    assert diff(before, snapshot(fake.path)) == []


def test_intel_without_the_driver_says_so(tmp_path):
    fake = FakeRoot(tmp_path).add_cpu(0)
    core = build_core(fake.path)
    support = core.tunables["uncore"].probe(core.root)
    assert not support.supported and "intel_uncore_frequency not loaded" in support.detail
    (skip,) = core.tunables["uncore"].apply(core.root, {"max_mhz": 2000})
    assert (skip.option, skip.reason) == ("max_mhz", support.detail)


# -- the TPMI layout (uncoreNN directories) --------------------------------------------------

def test_tpmi_package_level_is_written_and_its_clusters_left_to_the_kernel(tmp_path):
    """Where both exist, the package/die directory is the control: the kernel passes its write
    on to every uncoreNN of the package (writing those too would journal one setting twice)."""
    fake = FakeRoot(tmp_path).add_cpu(0).add_uncore(0)
    fake.add_uncore_cluster(0, package=0, domain=0).add_uncore_cluster(1, package=0, domain=1)
    core = build_core(fake.path)
    plan = core.tuner.switch(profile(uncore={"max_mhz": 1800}))
    assert [c.key for c in plan.changes] == [f"file:{PKG0}/max_freq_khz"]
    assert limits(fake, "max_freq_khz", (f"{UNCORE}/uncore00", f"{UNCORE}/uncore01")) == \
        ["2400000", "2400000"]


def test_tpmi_clusters_alone_are_each_written_within_their_range(tmp_path):
    fake = FakeRoot(tmp_path).add_cpu(0)
    fake.add_uncore_cluster(0, package=0, domain=0, high_khz=2_000_000)
    fake.add_uncore_cluster(1, package=0, domain=1, high_khz=2_500_000, max_khz=2_200_000)
    fake.add_uncore_cluster(2, package=1, domain=0, low_khz=1_200_000)
    clusters = tuple(f"{UNCORE}/uncore{n:02d}" for n in range(3))
    core = build_core(fake.path)
    assert core.tunables["uncore"].probe(core.root).detail == \
        "3 domain(s) (uncore00, uncore01, uncore02), firmware range 800..2500 MHz"

    def applied():
        assert limits(fake, "max_freq_khz", clusters) == ["2000000", "2300000", "2300000"]
        assert limits(fake, "min_freq_khz", clusters) == ["1000000", "1000000", "1200000"]

    before = snapshot(fake.path)
    core.tuner.switch(profile(uncore={"max_mhz": 2300, "min_mhz": 1000}))
    applied()
    restored, errors = core.tuner.restore()
    # uncore00's max is already its top, uncore02's min clamps to its own floor: 4 writes
    assert errors == [] and len(restored) == 4
    assert diff(before, snapshot(fake.path)) == []


# -- crash: SIGKILL at every write, then `dsr1d restore` -------------------------------------

def test_killed_at_every_point_of_an_apply_then_restored(tmp_path):
    def make(path: Path) -> FakeRoot:
        fake = two_packages(path)
        user_profile(fake, "uncorecap", "[uncore]\nmax_mhz = 1800\nmin_mhz = 1200\n")
        return fake

    count = make(tmp_path / "count" / "root")
    proc, calls = crashplugin.trace(["apply", "uncorecap", "--root", str(count.path)],
                                    tmp_path / "count" / "trace")
    assert proc.returncode == 0, proc.stderr
    assert [(c.target, c.value) for c in calls] == [("journal", "")] + [("knob", "1800000"),
                                                     ("knob", "1200000")] * 2
    for point in range(len(calls) + 1):
        work = tmp_path / f"point{point}"
        fake = make(work / "root")
        before = snapshot(fake.path)
        args = ["apply", "uncorecap", "--root", str(fake.path)]
        if point == len(calls):
            assert run_dsr1d(*args).returncode == 0
            assert limits(fake, "max_freq_khz") == ["1800000", "1800000"]
        else:
            with crashplugin.start(args, point, work) as paused:
                paused.kill()
            assert paused.call.n == point
        restore = run_dsr1d("restore", "--root", str(fake.path))
        assert restore.returncode == 0, (point, restore.stdout, restore.stderr)
        assert diff(before, snapshot(fake.path)) == [], point
        assert not (fake.path / JOURNAL).exists(), point


def test_the_uncore_range_and_limit_reach_the_telemetry(tmp_path: Path) -> None:
    from dsr1d.contract.sysroot import SysRoot
    from dsr1d.contract.telemetry import Unavailable
    from dsr1d.plugins.uncore import UncoreLimits
    fake = FakeRoot(tmp_path / "root")
    fake.add_uncore(0, max_khz=2_000_000).add_uncore(1, max_khz=2_200_000)
    src = UncoreLimits()
    assert src.probe(SysRoot(fake.path)).supported
    # the controller reads the lowest limit in force, and the firmware's range
    assert src.read(SysRoot(fake.path), 0) == {"uncore_max_mhz": 2400.0, "uncore_min_mhz": 800.0,
                                               "uncore_limit_mhz": 2000.0}
    bare = FakeRoot(tmp_path / "bare", vendor="AuthenticAMD")
    with pytest.raises(Unavailable, match="Intel servers only"):
        src.read(SysRoot(bare.path), 0)
