"""A knob write that fails (DESIGN.md, "State and rollback": a switch is transactional).

The failure must name the tunable, the path and the errno; the writes this apply already made
are undone; the previous profile stays in force; the command line exits 1. As root, permissions
do not stop writes, so the failures here are real ones, made by what the knob file is:

- EISDIR: the knob is a directory;
- EINVAL: the knob is a symlink to the real ``/sys/kernel/mm/transparent_hugepage/enabled``,
  which rejects numbers (only numbers are written through it, and the real file is checked
  unchanged afterwards);
- ENOSPC: the knob is a symlink to ``/dev/full``.

A knob that is already broken when the apply starts fails when the plan *reads* it (EISDIR, and
the symlink to ``/dev/full`` for a plain file, refused with EFBIG since it never ends),
so nothing is written at all. To fail a *write* after other writes were made, the knob is broken
while the apply runs: ``tests/crashplugin.py`` pauses ``dsr1d`` right before that knob's write,
the test breaks the knob, and lets it carry on.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

import crashplugin
from conftest import run_dsr1d
from dsr1d.contract.hookspecs import hookimpl
from dsr1d.core.context import build_core
from dsr1d.core.tuning import ApplyFailed, TuningError
from fakeroot import CPU, THP, intel_box
from fakeroot import diff_snapshots as diff
from fakeroot import snapshot_tree as snapshot

JOURNAL = "run/dsr1d/state.json"
REAL_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
PM_QOS = "dev/cpu_dma_latency"
NCPUS = 2

EPB1 = f"{CPU}/cpu1/power/energy_perf_bias"
IDLE13 = f"{CPU}/cpu1/cpuidle/state3/disable"   # set by throughput, not by balanced
DEFRAG = f"{THP}/defrag"


# -- helpers -------------------------------------------------------------------------------------

def broken(snap: dict[str, object], rel: str, entry: object) -> dict[str, object]:
    """``snap`` with knob ``rel`` as it was broken (if the snapshot covers it at all)."""
    return {**snap, rel: entry} if rel in snap else snap


def make_root(path: Path) -> Path:
    intel_box(path, cpus=NCPUS)
    return path


@dataclass(frozen=True)
class Breakage:
    """How a knob is broken, and the errno its write then fails with."""

    errno_name: str
    make: Callable[[Path], object]   # breaks the knob at this path; returns its snapshot entry


def _directory(path: Path) -> object:
    path.unlink()
    path.mkdir()
    return ("dir",)


def _symlink_to(target: str) -> Callable[[Path], object]:
    def make(path: Path) -> object:
        path.unlink()
        path.symlink_to(target)
        return ("symlink", target)
    return make


EISDIR = Breakage("EISDIR", _directory)
EINVAL = Breakage("EINVAL", _symlink_to(str(REAL_THP_ENABLED)))
ENOSPC = Breakage("ENOSPC", _symlink_to("/dev/full"))


@pytest.fixture
def real_thp():
    """Guards the real THP ``enabled`` file the EINVAL cases point at: unchanged afterwards."""
    if not REAL_THP_ENABLED.exists() or os.geteuid() != 0:
        pytest.skip("needs root and /sys/kernel/mm/transparent_hugepage")
    before = REAL_THP_ENABLED.read_text()
    fd = os.open(REAL_THP_ENABLED, os.O_WRONLY)
    try:
        os.write(fd, b"0")
        rejects = False
    except OSError as exc:
        rejects = exc.errno == errno.EINVAL
    finally:
        os.close(fd)
    if not rejects or REAL_THP_ENABLED.read_text() != before:
        _put_back(before)
        pytest.skip("this kernel's THP 'enabled' does not reject a number with EINVAL")
    yield
    after = REAL_THP_ENABLED.read_text()
    if after != before:
        _put_back(before)
    assert after == before, "the real THP 'enabled' was changed"


def _put_back(text: str) -> None:
    REAL_THP_ENABLED.write_text(text[text.index("[") + 1:text.index("]")])


def _breakage(request: pytest.FixtureRequest, breakage: Breakage) -> Breakage:
    if breakage is EINVAL:
        request.getfixturevalue("real_thp")
    return breakage


def _assert_names_it(stderr: str, tunable: str, root: Path, rel: str, errno_name: str) -> None:
    assert f"dsr1d: {tunable}: " in stderr, stderr
    assert str(root / rel) in stderr, stderr
    assert errno_name in stderr, stderr
    assert "Traceback" not in stderr, stderr


def _journal(root: Path) -> dict | None:
    path = root / JOURNAL
    return json.loads(path.read_text()) if path.exists() else None


# -- broken before the apply starts --------------------------------------------------------------

FRESH = [
    # (tunable, knob, breakage, whether the plan's read already fails)
    pytest.param("epb", EPB1, EISDIR, True, id="EISDIR-epb"),
    pytest.param("thp", DEFRAG, EISDIR, True, id="EISDIR-thp-defrag"),
    pytest.param("epb", EPB1, EINVAL, False, id="EINVAL-epb", marks=pytest.mark.realknob),
    pytest.param("cstate", PM_QOS, ENOSPC, False, id="ENOSPC-pmqos"),
]

# Knobs that throughput sets and balanced does not, so that balanced's verify stays clean.
SWITCH = [
    pytest.param("cstate", IDLE13, EISDIR, True, id="EISDIR-cpuidle"),
    pytest.param("cstate", IDLE13, EINVAL, False, id="EINVAL-cpuidle",
                 marks=pytest.mark.realknob),
    pytest.param("cstate", PM_QOS, ENOSPC, False, id="ENOSPC-pmqos"),
]


@pytest.mark.parametrize("tunable, rel, breakage, at_plan", FRESH)
def test_apply_fails_names_it_and_changes_nothing(request, tmp_path, tunable, rel, breakage,
                                                  at_plan):
    breakage = _breakage(request, breakage)
    root = make_root(tmp_path / "root")
    breakage.make(root / rel)
    before = snapshot(root)
    proc = run_dsr1d("apply", "throughput", "--root", str(root))
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    _assert_names_it(proc.stderr, tunable, root, rel, breakage.errno_name)
    assert ("cannot read" if at_plan else "cannot write") in proc.stderr
    assert diff(before, snapshot(root)) == []
    assert _journal(root) is None
    verify = run_dsr1d("verify", "--root", str(root))
    assert (verify.returncode, verify.stdout) == (0, "no profile applied (no journal)\n")


@pytest.mark.parametrize("tunable, rel, breakage, at_plan", SWITCH)
def test_switch_fails_names_it_and_keeps_the_previous_profile(request, tmp_path, tunable, rel,
                                                              breakage, at_plan):
    breakage = _breakage(request, breakage)
    root = make_root(tmp_path / "root")
    original = snapshot(root)
    run_dsr1d("apply", "balanced", "--root", str(root), check=True)
    entry = breakage.make(root / rel)
    balanced = snapshot(root)
    journal = _journal(root)
    assert journal["profile"] == "balanced"

    proc = run_dsr1d("apply", "throughput", "--root", str(root))
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    _assert_names_it(proc.stderr, tunable, root, rel, breakage.errno_name)
    if not at_plan:
        assert "balanced still in force" in proc.stderr
    assert diff(balanced, snapshot(root)) == []
    assert _journal(root) == journal
    verify = run_dsr1d("verify", "--root", str(root))
    assert (verify.returncode, verify.stdout) == (0, "balanced: every knob holds its value\n")
    # And the journal still gets everything back to before balanced.
    run_dsr1d("restore", "--root", str(root), check=True)
    assert diff(broken(original, rel, entry), snapshot(root)) == []
    assert _journal(root) is None


# -- broken while the apply runs: a write fails after others were made ---------------------------

MIDWAY = [
    pytest.param(EISDIR, id="EISDIR"),
    pytest.param(EINVAL, id="EINVAL", marks=pytest.mark.realknob),
    pytest.param(ENOSPC, id="ENOSPC"),
]


def _call_index(tmp_path: Path, prepare: list[str], args: list[str], key: str) -> tuple[int, int]:
    """Which before_write call writes ``key`` in an uninterrupted run, and how many knob writes
    come before it."""
    count = make_root(tmp_path / "count" / "root")
    for profile in prepare:
        run_dsr1d("apply", profile, "--root", str(count), check=True)
    proc, calls = crashplugin.trace([*args, "--root", str(count)], tmp_path / "count" / "trace")
    assert proc.returncode == 0, proc.stderr
    n = next(c.n for c in calls if c.target == "knob" and c.key == key)
    return n, sum(c.target == "knob" for c in calls[:n])


@pytest.mark.parametrize("breakage", MIDWAY)
@pytest.mark.parametrize("prepare", [[], ["balanced"]], ids=["apply", "switch-from-balanced"])
def test_write_failing_midway_undoes_the_writes_already_made(request, tmp_path, prepare,
                                                             breakage):
    breakage = _breakage(request, breakage)
    # From nothing, cpu1's EPB; from balanced (which sets EPB) a knob only throughput sets.
    tunable, rel = ("epb", EPB1) if not prepare else ("cstate", IDLE13)
    key = f"file:{rel}"
    n, earlier_writes = _call_index(tmp_path, prepare, ["apply", "throughput"], key)
    assert earlier_writes >= 3  # there is something to undo

    root = make_root(tmp_path / "root")
    original = snapshot(root)
    for profile in prepare:
        run_dsr1d("apply", profile, "--root", str(root), check=True)
    previous = snapshot(root)
    journal = _journal(root)

    with crashplugin.start(["apply", "throughput", "--root", str(root)], n, tmp_path,
                           resumable=True) as paused:
        assert (paused.call.target, paused.call.key) == ("knob", key)
        # The earlier writes were made: the undo has work to do.
        assert diff(previous, snapshot(root)) != []
        entry = breakage.make(root / rel)
        proc = paused.resume()

    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    _assert_names_it(proc.stderr, tunable, root, rel, breakage.errno_name)
    assert "cannot write" in proc.stderr
    assert f"nothing changed, {prepare[-1] if prepare else 'no profile'} still in force" \
        in proc.stderr
    assert diff(broken(previous, rel, entry), snapshot(root)) == []
    assert _journal(root) == journal
    verify = run_dsr1d("verify", "--root", str(root))
    if prepare:
        assert (verify.returncode, verify.stdout) == (0, "balanced: every knob holds its value\n")
    else:
        assert (verify.returncode, verify.stdout) == (0, "no profile applied (no journal)\n")
    run_dsr1d("restore", "--root", str(root), check=True)
    assert diff(broken(original, rel, entry), snapshot(root)) == []


# -- the same at the Python level ----------------------------------------------------------------

class BreakBefore:
    """A plugin that breaks one knob right before the core writes it (once)."""

    def __init__(self, root: Path, key: str, rel: str, breakage: Breakage) -> None:
        self.root, self.key, self.rel, self.breakage = root, key, rel, breakage
        self.entry: object = None

    @hookimpl
    def before_write(self, target: str, key: str, value: str) -> None:
        if target == "knob" and key == self.key and self.entry is None:
            self.entry = self.breakage.make(self.root / self.rel)


@pytest.fixture
def core_for():
    cores = []

    def make(root: Path):
        core = build_core(root)
        cores.append(core)
        return core

    yield make
    for core in cores:
        core.root.pm_qos_release()


@pytest.mark.parametrize("prepare", [None, "balanced"], ids=["apply", "switch-from-balanced"])
@pytest.mark.parametrize("breakage", [pytest.param(EINVAL, id="EINVAL", marks=pytest.mark.realknob),
                                      pytest.param(ENOSPC, id="ENOSPC")])
def test_python_switch_raises_apply_failed(request, tmp_path, core_for, prepare, breakage):
    breakage = _breakage(request, breakage)
    tunable, rel = ("cstate", IDLE13) if breakage is EINVAL else ("cstate", PM_QOS)
    root = make_root(tmp_path / "root")
    core = core_for(root)
    if prepare:
        core.tuner.switch(core.store.load(prepare))
    entry = breakage.make(root / rel)
    previous = snapshot(root)
    journal = _journal(root)

    with pytest.raises(ApplyFailed) as info:
        core.tuner.switch(core.store.load("throughput"))
    cause = info.value.cause
    assert (cause.errno_name, cause.knob, cause.path, cause.action) == (
        breakage.errno_name, tunable, str(root / rel), "write '1' to" if rel == IDLE13
        else "write '2' to")
    assert info.value.undo_errors == []
    assert f"{prepare or 'no profile'} still in force" in str(info.value)
    assert diff(previous, snapshot(root)) == []
    assert _journal(root) == journal
    assert core.tuner.active() == prepare
    assert core.tuner.verify().drift == []
    assert core.tuner.restore()[1] == []
    assert _journal(root) is None
    assert os.readlink(root / rel) == entry[1]


@pytest.mark.parametrize("breakage", MIDWAY)
def test_python_write_failing_midway(request, tmp_path, core_for, breakage):
    breakage = _breakage(request, breakage)
    root = make_root(tmp_path / "root")
    core = core_for(root)
    core.tuner.switch(core.store.load("balanced"))
    previous = snapshot(root)
    journal = _journal(root)
    breaker = BreakBefore(root, f"file:{IDLE13}", IDLE13, breakage)
    core.pm.register(breaker)

    with pytest.raises(ApplyFailed) as info:
        core.tuner.switch(core.store.load("throughput"))
    assert breaker.entry is not None
    assert (info.value.cause.errno_name, info.value.cause.knob, info.value.cause.path) == (
        breakage.errno_name, "cstate", str(root / IDLE13))
    assert info.value.undo_errors == []
    assert diff(broken(previous, IDLE13, breaker.entry), snapshot(root)) == []
    assert _journal(root) == journal
    assert core.tuner.active() == "balanced"
    assert core.tuner.verify().drift == []


def test_python_unreadable_knob_fails_the_plan(tmp_path, core_for):
    """A knob that cannot even be read fails before anything is written: TuningError, not
    ApplyFailed (tuning.py: "A profile could not be planned … nothing was written")."""
    root = make_root(tmp_path / "root")
    EISDIR.make(root / EPB1)
    before = snapshot(root)
    core = core_for(root)
    with pytest.raises(TuningError) as info:
        core.tuner.switch(core.store.load("throughput"))
    assert f"epb: cannot read {root / EPB1}: EISDIR" in str(info.value)
    assert diff(before, snapshot(root)) == []
    assert _journal(root) is None


# -- a knob file that never ends -----------------------------------------------------------------

def _limit_memory() -> None:
    limit = 512 << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def test_knob_that_never_ends_is_refused_not_read_forever(tmp_path):
    """A knob whose file never ends (a symlink to /dev/full) fails its read with EFBIG."""
    root = make_root(tmp_path / "root")
    entry = ENOSPC.make(root / EPB1)
    before = snapshot(root)
    assert before[EPB1] == entry
    proc = subprocess.run(crashplugin.dsr1d_command(["apply", "throughput", "--root", str(root)]),
                          capture_output=True, text=True, timeout=120, preexec_fn=_limit_memory,
                          env=crashplugin.env())
    assert diff(before, snapshot(root)) == []
    assert proc.returncode == 1, proc.stderr[-2000:]
    _assert_names_it(proc.stderr, "epb", root, EPB1, "EFBIG")
