"""Real knobs of this machine, changed and put back for real (root on Linux only).

Every test saves the knobs it may touch in a fixture whose finalizer writes them back, so the
machine is left as it was even when an assertion fails half-way.
"""

from __future__ import annotations

import os
import struct
import time
from pathlib import Path

import pytest

from dsr1d.core.context import build_core
from dsr1d.core.profiles import Profile

pytestmark = [
    pytest.mark.realknob,
    pytest.mark.skipif(os.geteuid() != 0, reason="real knobs need root"),
]

THP = Path("/sys/kernel/mm/transparent_hugepage")
CPUIDLE = Path("/sys/devices/system/cpu/cpuidle")


def _driver() -> str:
    path = CPUIDLE / "current_driver"
    return path.read_text().strip() if path.exists() else "absent"


PM_QOS = Path("/dev/cpu_dma_latency")


def selected(path: Path) -> str:
    text = path.read_text()
    return text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()


def profile(**sections) -> Profile:
    return Profile("realtest", Path("realtest.conf"), "", sections)


@pytest.fixture
def saved_knobs():
    """Record real knob files; write every one back at teardown, whatever happened."""
    saved: dict[Path, str] = {}

    def save(*paths: Path) -> None:
        for path in paths:
            if path.exists() and path not in saved:
                saved[path] = selected(path)

    yield save
    for path, value in reversed(list(saved.items())):
        try:
            if selected(path) != value:
                path.write_text(value)
        except OSError as exc:  # pragma: no cover - reported, never hidden
            print(f"could not restore {path}: {exc}")
    leftovers = {p: (v, selected(p)) for p, v in saved.items() if selected(p) != v}
    assert not leftovers, f"real knobs not restored: {leftovers}"


def deep_states(cpu: int = 0) -> list[Path]:
    """This CPU's idle states other than POLL, shallowest first."""
    base = Path(f"/sys/devices/system/cpu/cpu{cpu}/cpuidle")
    states = sorted(base.glob("state*"), key=lambda p: int(p.name[5:]))
    return [s for s in states if (s / "name").read_text().strip() != "POLL"]


def usage(state: Path) -> int:
    return int((state / "usage").read_text())


def idle_a_little() -> None:
    """Let the CPUs go idle many times: short sleeps are the idle entries we count."""
    for _ in range(50):
        time.sleep(0.01)


@pytest.mark.skipif(not (THP / "enabled").exists(), reason="kernel without THP")
def test_thp_really_changes_and_comes_back(tmp_path, saved_knobs):
    saved_knobs(THP / "enabled", THP / "defrag")
    original = selected(THP / "enabled"), selected(THP / "defrag")
    wanted = ("never" if original[0] != "never" else "always",
              "defer" if original[1] != "defer" else "never")
    core = build_core("/", journal=tmp_path / "state.json")
    core.tuner.switch(profile(thp={"enabled": wanted[0], "defrag": wanted[1]}))
    assert (selected(THP / "enabled"), selected(THP / "defrag")) == wanted
    assert core.tuner.verify().drift == []
    restored, errors = core.tuner.restore()
    assert errors == [] and len(restored) == 2
    assert (selected(THP / "enabled"), selected(THP / "defrag")) == original


@pytest.mark.skipif(not PM_QOS.exists(), reason="no /dev/cpu_dma_latency")
def test_pm_qos_request_holds_while_the_process_lives(tmp_path):
    def effective() -> int:
        with open(PM_QOS, "rb") as f:
            return struct.unpack("<i", f.read(4))[0]

    before = effective()
    assert before > 0, "another process already holds a 0 µs request; cannot observe ours"
    core = build_core("/", journal=tmp_path / "state.json")
    try:
        core.tuner.switch(profile(cstate={"max_latency_us": 0}))
        assert effective() == 0            # the kernel now enforces our request
    finally:
        core.tuner.restore()
    assert effective() == before           # released: the kernel's own default again


@pytest.mark.skipif(not deep_states(), reason="this machine has no cpuidle states "
                    f"(driver: {_driver()})")
def test_pm_qos_zero_stops_deep_idle(tmp_path):
    deepest = deep_states()[-1]
    core = build_core("/", journal=tmp_path / "state.json")
    try:
        core.tuner.switch(profile(cstate={"max_latency_us": 0}))
        start = usage(deepest)
        idle_a_little()
        held = usage(deepest) - start
    finally:
        core.tuner.restore()
    assert held == 0, f"{deepest.name} entered {held} times while 0 µs was requested"


@pytest.mark.skipif(not deep_states(), reason="this machine has no cpuidle states "
                    f"(driver: {_driver()})")
def test_cpuidle_disable_takes_effect_with_the_governor_handled(tmp_path, saved_knobs):
    cpus = [int(p.name[3:]) for p in Path("/sys/devices/system/cpu").glob("cpu[0-9]*")]
    deepest = deep_states()[-1]
    name = (deepest / "name").read_text().strip()
    saved_knobs(CPUIDLE / "current_governor",
                *[Path(f"/sys/devices/system/cpu/cpu{c}/cpuidle/{deepest.name}/disable") for c in cpus])
    governor_before = (CPUIDLE / "current_governor").read_text().strip()
    core = build_core("/", journal=tmp_path / "state.json")
    core.tuner.switch(profile(cstate={"disable": [name]}))
    try:
        assert (deepest / "disable").read_text().strip() == "1"
        if governor_before == "haltpoll":
            assert (CPUIDLE / "current_governor").read_text().strip() == "menu"
        start = usage(deepest)
        idle_a_little()
        assert usage(deepest) == start, f"{name} still entered while disabled"
    finally:
        core.tuner.restore()
    assert (deepest / "disable").read_text().strip() == "0"
    assert (CPUIDLE / "current_governor").read_text().strip() == governor_before


def test_cli_apply_and_restore_real_machine(tmp_path, saved_knobs, dsr1d):
    """The README's run path: apply sustained on this machine, verify, restore."""
    saved_knobs(THP / "enabled", THP / "defrag", THP / "khugepaged/defrag",
                CPUIDLE / "current_governor")
    before = {p: selected(p) for p in (THP / "enabled", THP / "defrag")}
    journal = str(tmp_path / "state.json")
    applied = dsr1d("apply", "sustained", "--journal", journal, check=True)
    assert "PM QoS" in applied.stderr          # the warning about process lifetime
    assert selected(THP / "enabled") == "always"
    assert dsr1d("verify", "--journal", journal).returncode == 0
    dsr1d("restore", "--journal", journal, check=True)
    assert {p: selected(p) for p in before} == before
    assert not Path(journal).exists()
