"""Crash safety, driven systematically (DESIGN.md, "State and rollback").

``tests/crashplugin.py`` stops ``dsr1d`` right before its N-th journal replacement or knob
write; the test SIGKILLs it there, runs ``dsr1d restore`` and checks that every knob of the fake
machine is back to what it was before dsr1d first touched it, and that the journal is gone. This
is done for every N, from "killed before the first write" to "killed after a complete run".

Also: a journal that is corrupt or belongs to another root is refused (exit 3), left byte for
byte as it is, and changes nothing; ``dsr1d restore --discard`` moves it aside.
"""

from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import crashplugin
from conftest import run_dsr1d
from dsr1d.core.context import build_core
from fakeroot import CPU, THP, intel_box
from fakeroot import diff_snapshots as diff
from fakeroot import snapshot_tree as snapshot

JOURNAL = "run/dsr1d/state.json"
NCPUS = 2  # per-CPU knobs on more than one CPU, and as few kill points as that allows

# Knobs that must come back; snapshot() takes these and every other file below sys/, dev/cpu/.
NAMED_KNOBS = (
    [f"{CPU}/cpu{n}/power/energy_perf_bias" for n in range(NCPUS)]
    + [f"{CPU}/cpu{n}/cpufreq/energy_performance_preference" for n in range(NCPUS)]
    + [f"dev/cpu/{n}/msr/{reg}" for n in range(NCPUS) for reg in ("0x1a4", "0x1b0", "0xe2")]
    + [f"{CPU}/cpu{n}/cpuidle/state{k}/disable" for n in range(NCPUS) for k in range(4)]
    + [f"{CPU}/cpuidle/current_governor", f"{THP}/enabled", f"{THP}/defrag",
       f"{THP}/khugepaged/defrag"]
)


# -- helpers -------------------------------------------------------------------------------------

def make_root(path: Path) -> Path:
    intel_box(path, cpus=NCPUS)
    return path


def apply_in_process(root: Path, profile: str) -> None:
    """Apply ``profile`` fully, as `dsr1d apply` does, without the cost of a subprocess."""
    core = build_core(root)
    try:
        core.tuner.switch(core.store.load(profile))
    finally:
        core.root.pm_qos_release()


# -- the plugin itself ---------------------------------------------------------------------------

def test_crashplugin_is_inert_without_crash_at(tmp_path):
    root = make_root(tmp_path / "root")
    before = snapshot(root)
    report = tmp_path / "report"
    env = crashplugin.env(DSR1D_CRASH_REPORT=str(report), DSR1D_TRACE_PLUGINS="1")
    proc = run_dsr1d("apply", "throughput", "--root", str(root), env=env)
    assert proc.returncode == 0, proc.stderr
    # It was loaded and called (the trace names it among the before_write implementations)…
    assert any("before_write(" in line and "crashplugin" in line
               for line in proc.stderr.splitlines()), proc.stderr
    # …and did nothing: no report, and the apply went through (the knobs changed).
    assert not report.exists()
    assert diff(before, snapshot(root)) != []
    assert run_dsr1d("restore", "--root", str(root)).returncode == 0
    assert snapshot(root) == before


def test_trace_mode_sees_journal_first_and_every_knob(tmp_path):
    root = make_root(tmp_path / "root")
    proc, calls = crashplugin.trace(["apply", "throughput", "--root", str(root)],
                                    tmp_path / "trace")
    assert proc.returncode == 0, proc.stderr
    steps = [(c.target, c.key, c.value) for c in calls]
    journal = str(root / JOURNAL)
    # The journal once, before the first knob; then only knobs (nothing to drop afterwards).
    assert steps[0] == ("journal", journal, "")
    assert all(target == "knob" for target, _, _ in steps[1:])
    assert ("knob", f"file:{CPU}/cpu1/power/energy_perf_bias", "0") in steps
    assert ("knob", f"select:{THP}/enabled", "always") in steps


def test_paused_process_makes_no_further_write(tmp_path):
    """Killed before call N: the knob call N announces keeps its value (the pause is *before*)."""
    root = make_root(tmp_path / "root")
    _, calls = crashplugin.trace(["apply", "throughput", "--root", str(make_root(
        tmp_path / "count" / "root"))], tmp_path / "count" / "trace")
    n = next(c.n for c in calls if c.key == f"select:{THP}/enabled")
    before = snapshot(root)
    with crashplugin.start(["apply", "throughput", "--root", str(root)], n, tmp_path) as paused:
        paused.kill()
    assert (paused.call.target, paused.call.key, paused.call.value) == (
        "knob", f"select:{THP}/enabled", "always")
    after = snapshot(root)
    assert after[f"{THP}/enabled"] == before[f"{THP}/enabled"] == "madvise"
    # Every knob written before it did change, and the journal lists their originals.
    assert after[f"{CPU}/cpu1/power/energy_perf_bias"] == "0"
    journal = json.loads((root / JOURNAL).read_text())
    assert {o["key"] for o in journal["originals"]} >= {c.key for c in calls if c.target == "knob"}
    assert journal["profile"] == "throughput"  # the switch under way


# -- killed at every point -----------------------------------------------------------------------

@dataclass(frozen=True)
class Scenario:
    prepare: tuple[str, ...]   # profiles applied fully first
    killed: tuple[str, ...]    # the command that is killed at every point


SCENARIOS = {
    "apply-throughput": Scenario((), ("apply", "throughput")),
    "switch-balanced-to-throughput": Scenario(("balanced",), ("apply", "throughput")),
    # Releases (knobs the new profile no longer sets) are written back during this switch.
    "switch-throughput-to-balanced": Scenario(("throughput",), ("apply", "balanced")),
    # A restore killed half-way is finished by the next one.
    "restore-after-throughput": Scenario(("throughput",), ("restore",)),
}


def _one_point(base: Path, scenario: Scenario, point: int, calls: list[crashplugin.Call]
               ) -> list[str]:
    """Prepare a fresh root, kill the command before call ``point``, restore; what went wrong."""
    work = base / f"point{point}"
    root = make_root(work / "root")
    before = snapshot(root)
    missing = [k for k in NAMED_KNOBS if k not in before]
    assert not missing, missing
    for profile in scenario.prepare:
        apply_in_process(root, profile)
    args = [*scenario.killed, "--root", str(root)]
    problems = []
    if point == len(calls):
        proc = run_dsr1d(*args)
        if proc.returncode != 0:
            problems.append(f"uninterrupted run exited {proc.returncode}: {proc.stderr}")
    else:
        with crashplugin.start(args, point, work) as paused:
            paused.kill()
        expected = calls[point]
        key = str(root / JOURNAL) if expected.target == "journal" else expected.key
        if (paused.call.n, paused.call.target, paused.call.key) != (point, expected.target, key):
            problems.append(f"paused at {paused.call}, expected {expected}")
    restore = run_dsr1d("restore", "--root", str(root))
    if restore.returncode != 0:
        problems.append(f"restore exited {restore.returncode}: {restore.stdout}{restore.stderr}")
    problems += diff(before, snapshot(root))
    run_dir = (root / JOURNAL).parent
    leftovers = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    if leftovers:  # the journal, or a temporary file of it
        problems.append(f"left in {run_dir}: {leftovers}")
    return problems


@pytest.mark.parametrize("name", SCENARIOS)
def test_killed_at_every_point_then_restored(tmp_path, name):
    scenario = SCENARIOS[name]
    # Count the before_write calls of an uninterrupted run from the same starting state.
    count_root = make_root(tmp_path / "count" / "root")
    for profile in scenario.prepare:
        apply_in_process(count_root, profile)
    proc, calls = crashplugin.trace([*scenario.killed, "--root", str(count_root)],
                                    tmp_path / "count" / "trace")
    assert proc.returncode == 0, proc.stderr
    assert any(c.target == "knob" for c in calls), calls
    if scenario.killed[0] == "apply":
        assert calls[0].target == "journal", calls  # the originals go first

    # Point N < total: killed right before call N; point total: after a complete run.
    points = range(len(calls) + 1)
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        results = list(pool.map(lambda p: _one_point(tmp_path, scenario, p, calls), points))
    failures = {p: problems for p, problems in zip(points, results) if problems}
    assert not failures, "\n".join(
        f"killed before call {p} ({calls[p] if p < len(calls) else 'after the run'}):\n  "
        + "\n  ".join(problems) for p, problems in failures.items())


# -- corrupt and foreign journals ----------------------------------------------------------------

def _journal_for(root: Path, **fields: object) -> bytes:
    data = {"format": 1, "root": str(root),
            "originals": [{"key": f"select:{THP}/enabled", "tunable": "thp", "value": "never"}],
            "profile": "throughput", "wanted": {}, "pid": 0}
    data.update(fields)
    return (json.dumps(data, indent=1) + "\n").encode()


CORRUPT = [
    pytest.param(lambda root: b"this is not JSON {{{\n", id="garbage-text"),
    pytest.param(lambda root: b"", id="empty"),
    pytest.param(lambda root: _journal_for(root)[:40], id="truncated"),
    pytest.param(lambda root: b"[1, 2, 3]\n", id="json-list"),
    pytest.param(lambda root: b"null\n", id="json-null"),
    pytest.param(lambda root: _journal_for(root, format=99), id="wrong-format"),
    pytest.param(lambda root: json.dumps({"format": 1, "root": str(root)}).encode(),
                 id="no-originals"),
    pytest.param(lambda root: _journal_for(root, originals=[{"knob": "x"}]), id="bad-original"),
    pytest.param(lambda root: _journal_for(root, pid="not a number"), id="bad-pid"),
    pytest.param(lambda root: b"\xff\xfe\x00\x9c garbage \x80\n", id="garbage-binary"),
    pytest.param(
        lambda root: _journal_for(root, originals=[
            {"key": "bogus:x", "tunable": "thp", "value": "never"}]), id="unknown-knob-key"),
]

FOREIGN = [
    pytest.param(lambda root: _journal_for(root.parent / "another-root"), id="other-directory"),
    pytest.param(lambda root: _journal_for(Path("/")), id="real-root"),
    pytest.param(lambda root: _journal_for(root / "sys"), id="root-subdirectory"),
]


def _refused(root: Path, content: bytes, command: list[str]) -> subprocess.CompletedProcess[str]:
    journal = root / JOURNAL
    journal.parent.mkdir(parents=True, exist_ok=True)
    journal.write_bytes(content)
    before = snapshot(root)
    proc = run_dsr1d(*command, "--root", str(root))
    assert proc.returncode == 3, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    # Says what is wrong with which file, and how to get out of it.
    assert str(journal) in proc.stderr
    assert "dsr1d restore --discard" in proc.stderr
    assert journal.read_bytes() == content
    assert sorted(p.name for p in journal.parent.iterdir()) == ["state.json"]
    assert diff(before, snapshot(root)) == []
    return proc


@pytest.mark.parametrize("command", [["apply", "throughput"], ["restore"]])
@pytest.mark.parametrize("content", CORRUPT)
def test_corrupt_journal_is_refused_and_left_alone(fake, content, command):
    _refused(fake.path, content(fake.path), command)


@pytest.mark.parametrize("command", [["apply", "throughput"], ["restore"]])
@pytest.mark.parametrize("content", FOREIGN)
def test_foreign_journal_is_refused_and_left_alone(fake, content, command):
    proc = _refused(fake.path, content(fake.path), command)
    assert "belongs to root" in proc.stderr


def test_journal_of_a_test_root_is_never_replayed_on_this_machine(tmp_path, fake):
    """``dsr1d restore`` on the real root with a journal made for a fake root refuses it.

    The journal lists the real THP ``enabled`` knob with the value it has now, so even a broken
    refusal would write nothing that changes this machine.
    """
    real = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not real.exists():
        pytest.skip("no THP on this machine")
    now = real.read_text()
    current = now[now.index("[") + 1:now.index("]")]
    journal = tmp_path / "state.json"
    content = _journal_for(fake.path, originals=[
        {"key": f"select:{THP}/enabled", "tunable": "thp", "value": current}])
    journal.write_bytes(content)
    for command in (["restore"], ["verify"]):
        proc = run_dsr1d(*command, "--journal", str(journal))
        assert proc.returncode == 3, (proc.stdout, proc.stderr)
        assert f"belongs to root {fake.path}" in proc.stderr
        assert journal.read_bytes() == content
    assert real.read_text() == now


@pytest.mark.parametrize("content", [CORRUPT[0], FOREIGN[0]])
def test_restore_discard_moves_an_unusable_journal_aside(fake, content):
    content = content(fake.path)
    journal = fake.path / JOURNAL
    journal.parent.mkdir(parents=True)
    journal.write_bytes(content)
    before = snapshot(fake.path)
    proc = run_dsr1d("restore", "--discard", "--root", str(fake.path))
    assert proc.returncode == 0, proc.stderr
    assert not journal.exists()
    aside = list(journal.parent.glob("state.json.discarded-*"))
    assert len(aside) == 1, list(journal.parent.iterdir())
    assert aside[0].read_bytes() == content
    assert str(aside[0]) in proc.stdout
    assert diff(before, snapshot(fake.path)) == []
    # With the journal out of the way, dsr1d works again.
    run_dsr1d("apply", "throughput", "--root", str(fake.path), check=True)
    run_dsr1d("restore", "--root", str(fake.path), check=True)
    assert diff(before, snapshot(fake.path)) == []
    assert aside[0].read_bytes() == content


def test_restore_discard_without_journal(fake):
    proc = run_dsr1d("restore", "--discard", "--root", str(fake.path))
    assert proc.returncode == 0
    assert "no journal" in proc.stdout
