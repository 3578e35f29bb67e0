"""The real daemon on a private bus against a fake root driven by the thermal plant simulator.

The plant runs in real time in a thread: it reads its controls (``scaling_max_freq``, PL1, …)
from the files the daemon writes and writes its state where a real machine shows it, plus its
decode tokens/s, which the `plant_tokens` test plugin reports as the engine's. The daemon's own
sampler, controller and tunables do the rest, with a profile whose ``[mitigation]`` timings are
scaled to seconds. Asserted: the frequency ceiling reaches every CPU's file, ``Mitigations`` and
``ThrottleStateChanged`` say so, SIGTERM and SIGKILL + ``dsr1d restore`` put every knob back, and a
ceiling the machine refuses is given up once for a PL1 cap that never rises above the firmware's,
and the kernel's throttle time rising lowers the ceiling at the next sample.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.register_assert_rewrite("daemon_fixtures")
from conftest import TESTS, run_dsr1d  # noqa: E402
from daemon_fixtures import eventually, prop  # noqa: E402
from dsr1d.sim.scenarios import MEMORY_KNEE, STEP_TCC
from harness.plant_driver import PlantDriver, plant_root

pytest_plugins = ["daemon_fixtures"]
CPUS = 4
PL1 = "sys/class/powercap/intel-rapl:0/constraint_0_power_limit_uw"
PROFILE = """[main]
include = sustained
[mitigation]
steady_s = 2
dwell_s = 2
settle_s = 0.6
release_idle_s = 5
"""
ENV = {"DSR1D_PLUGINS": "plant_tokens", "PYTHONPATH": str(TESTS)}


def ceiling_files(root: Path) -> list[Path]:
    return [root / f"sys/devices/system/cpu/cpu{n}/cpufreq/scaling_max_freq" for n in range(CPUS)]


@pytest.fixture
def sim_root(tmp_path: Path) -> Path:
    return plant_root(tmp_path / "root", {"fastsim": PROFILE}, CPUS)


@pytest.fixture
def sim_config(tmp_path: Path) -> Path:
    path = tmp_path / "sim.conf"
    path.write_text("[daemon]\ndefault_profile = fastsim\ntelemetry_interval_s = 0.2\n")
    return path


def test_the_ceiling_is_applied_shown_and_restored_by_sigterm(start_daemon, bus, client,
                                                              sim_root, sim_config):
    original = [int(f.read_text()) for f in ceiling_files(sim_root)]
    driver = PlantDriver(sim_root, MEMORY_KNEE, CPUS)
    watcher = client()
    watcher.subscribe("type='signal',interface='org.dsr1d.Manager1',member='ThrottleStateChanged'")
    daemon = start_daemon(root=sim_root, config_path=sim_config, notify=False, env=ENV)
    with driver:
        eventually(lambda: all(int(f.read_text()) < 3_000_000 for f in ceiling_files(sim_root)),
                   timeout=60, what="a frequency ceiling on every CPU (memory-bound decode)")
        states = eventually(lambda: watcher.received("ThrottleStateChanged"), timeout=30,
                            what="ThrottleStateChanged")
        state, evidence = states[0].body
        assert state in ("learning", "efficient", "mitigating") and evidence
        assert evidence["limit_temp_c"].value == 105.0     # TjMax from MSR 0x1A2
        mitigations = eventually(lambda: prop(bus, "Mitigations"), timeout=30,
                                 what="Mitigations")
        assert any(m.startswith("freq_ceiling") and m.endswith("MHz") for m in mitigations)
        assert "mitigation apply freq_ceiling" in daemon.log()
        eventually(lambda: (driver.plant.controls.ceiling_ghz or 9) < 3.8, timeout=10,
                   what="the plant under the ceiling it reads from the files")
    assert daemon.stop() == 0
    assert [int(f.read_text()) for f in ceiling_files(sim_root)] == original
    assert not (sim_root / "run/dsr1d/state.json").exists()


def test_sigkill_leaves_the_ceiling_journaled_and_restore_puts_it_back(
        start_daemon, bus, sim_root, sim_config):
    original = [int(f.read_text()) for f in ceiling_files(sim_root)]
    driver = PlantDriver(sim_root, MEMORY_KNEE, CPUS)      # its files before the daemon probes
    daemon = start_daemon(root=sim_root, config_path=sim_config, notify=False, env=ENV)
    with driver:
        eventually(lambda: all(int(f.read_text()) < 3_000_000 for f in ceiling_files(sim_root)),
                   timeout=60, what="a frequency ceiling on every CPU")
        daemon.kill()
    assert (sim_root / "run/dsr1d/state.json").exists()
    restored = run_dsr1d("restore", "--root", str(sim_root))
    assert restored.returncode == 0, restored.stderr
    assert [int(f.read_text()) for f in ceiling_files(sim_root)] == original
    assert not (sim_root / "run/dsr1d/state.json").exists()


def test_a_refused_ceiling_is_given_up_once_for_a_pl1_cap_below_the_firmwares(
        start_daemon, bus, sim_root, sim_config):
    firmware = int((sim_root / PL1).read_text())
    driver = PlantDriver(sim_root, STEP_TCC, CPUS)
    refusing = {**ENV, "DSR1D_PLUGINS": "plant_tokens,refuse_ceiling"}   # EBUSY on the ceiling
    daemon = start_daemon(root=sim_root, config_path=sim_config, notify=False, env=refusing)
    seen: list[int] = []
    with driver:
        def capped() -> bool:
            seen.append(int((sim_root / PL1).read_text()))
            return seen[-1] < firmware
        eventually(capped, timeout=90, what="a PL1 cap after the refused ceiling")
        assert daemon.log().count("freq_ceiling refused by the machine") == 1
        mitigations = eventually(lambda: prop(bus, "Mitigations"), timeout=30,
                                 what="Mitigations")
        assert any(m.startswith("rapl_pl1") for m in mitigations), mitigations
        assert not any(m.startswith("freq_ceiling") for m in mitigations)
        assert daemon.running()
    assert max(seen) <= firmware
    assert daemon.stop() == 0
    assert int((sim_root / PL1).read_text()) == firmware


def test_the_kernels_throttle_time_lowers_the_ceiling_at_once(start_daemon, sim_root,
                                                               sim_config):
    driver = PlantDriver(sim_root, MEMORY_KNEE, CPUS)       # never hot on its own
    daemon = start_daemon(root=sim_root, config_path=sim_config, notify=False, env=ENV)
    with driver:
        eventually(lambda: "mitigation apply freq_ceiling" in daemon.log(), timeout=60,
                   what="a first (energy) ceiling")
        assert "the hardware throttled" not in daemon.log()

        def answered() -> str | None:
            # the kernel's throttle time rising, as long as the hardware throttles (the
            # controller leaves evidence within a second of its own last change alone)
            driver.inject_throttle(0.1)
            return next((ln for ln in daemon.log().splitlines()
                         if "the hardware throttled" in ln), None)
        line = eventually(answered, timeout=15, interval=0.3,
                          what="a cut answering the throttle time")
        was, now = (int(x) for x in line.split("ceiling ", 1)[1].split(" MHz", 1)[0]
                    .split(" -> "))
        assert now < was
        eventually(lambda: all(int(f.read_text()) == now * 1000 for f in ceiling_files(sim_root)),
                   timeout=10, what=f"the {now} MHz ceiling on every CPU")
    assert daemon.stop() == 0
