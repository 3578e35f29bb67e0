"""The real daemon on a private bus against a fake root driven by the thermal plant simulator.

The test runs the simulated Xeon in real time, with a heat sink of small heat capacity so that
it reaches PROCHOT in seconds rather than two minutes (energy counters and the wall clock then
agree, so RAPL watts are true), and writes its state where a real machine shows it; the daemon's
own sampler, controller and tunables do the rest. Asserted: ThrottleStateChanged arrives, the PL1 knob in the fake root
is capped, ``Mitigations`` says so, and SIGTERM restores PL1 like any other knob.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

pytest.register_assert_rewrite("daemon_fixtures")
from daemon_fixtures import eventually, prop  # noqa: E402
from dsr1d.sim.plant import Plant, apply_controls, read_controls
from dsr1d.sim.sim import XEON_SUSTAINED
from fakeroot import intel_box

pytest_plugins = ["daemon_fixtures"]
PL1 = "sys/class/powercap/intel-rapl:0/constraint_0_power_limit_uw"


class PlantDriver:
    """Steps the plant in a thread: controls from the files, state into the files."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.plant = Plant(replace(XEON_SUSTAINED, c_sink_j_per_k=15.0))
        self.stop = threading.Event()
        self.plant.write_fake_root(root)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(0.05):
            now = time.monotonic()
            apply_controls(self.plant, read_controls(self.root))
            self.plant.step(now - last)
            last = now
            self.plant.write_fake_root(self.root)

    def __enter__(self) -> "PlantDriver":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


@pytest.fixture
def sim_root(tmp_path: Path) -> Path:
    fake = intel_box(tmp_path / "root", cpus=XEON_SUSTAINED.cores)  # the plant writes them all
    return fake.path


@pytest.fixture
def sim_config(tmp_path: Path) -> Path:
    path = tmp_path / "sim.conf"
    path.write_text("[daemon]\ndefault_profile = sustained\ntelemetry_interval_s = 0.2\n")
    return path


def test_throttling_is_detected_and_mitigated_then_restored(start_daemon, bus, client,
                                                           sim_root, sim_config):
    original_pl1 = (sim_root / PL1).read_text().strip()
    driver = PlantDriver(sim_root)
    watcher = client()
    watcher.subscribe("type='signal',interface='org.dsr1d.Manager1',member='ThrottleStateChanged'")
    daemon = start_daemon(root=sim_root, config_path=sim_config, notify=False)
    with driver:
        states = eventually(lambda: watcher.received("ThrottleStateChanged"), timeout=90,
                            what="ThrottleStateChanged")
        state, evidence = states[0].body
        assert state in ("throttling", "mitigating")
        assert evidence, "the state change carries its evidence"
        capped = eventually(lambda: (sim_root / PL1).read_text().strip() != original_pl1,
                            timeout=60, what="the PL1 cap in the fake root")
        assert capped
        mitigations = eventually(lambda: prop(bus, "Mitigations"), timeout=30,
                                 what="Mitigations")
        assert any(m.startswith("rapl_pl1") for m in mitigations), mitigations
        assert prop(bus, "ThrottleState") in ("throttling", "mitigating", "recovering")
        assert "mitigation apply rapl_pl1" in daemon.log()
    assert daemon.stop() == 0
    assert (sim_root / PL1).read_text().strip() == original_pl1
    assert not (sim_root / "run/dsr1d/state.json").exists()


def test_a_refused_mitigation_write_is_logged_once_and_the_ladder_goes_on(
        start_daemon, bus, client, sim_root, sim_config):
    # PL1 that cannot be written (a directory where the file should be): rung 1 is refused.
    (sim_root / PL1).unlink()
    (sim_root / PL1).mkdir()
    no_turbo = sim_root / "sys/devices/system/cpu/intel_pstate/no_turbo"
    driver = PlantDriver(sim_root)
    daemon = start_daemon(root=sim_root, config_path=sim_config, notify=False)
    with driver:
        eventually(lambda: no_turbo.read_text().strip() == "1", timeout=90,
                   what="the next rung (turbo off) after the refused PL1 cap")
        assert daemon.log().count("refused by the machine") == 1
        mitigations = prop(bus, "Mitigations")
        assert "no_turbo" in mitigations
        assert not any(m.startswith("rapl_pl1") for m in mitigations)
        assert daemon.running()
    assert daemon.stop() == 0
    assert no_turbo.read_text().strip() == "0"
