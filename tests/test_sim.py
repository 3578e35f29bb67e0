"""The thermal plant simulator (dsr1d.sim.sim): calibration, physics, fake root, command line.

Simulated time only: nothing here sleeps or measures the wall clock.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest

from dsr1d.sim.plant import CPU, MAX_ENERGY_UJ, RAPL, Controls, Plant, apply_controls, read_controls
from dsr1d.sim.sim import XEON_SUSTAINED, simulate, simulate_main, summarize


@pytest.fixture(scope="module")
def unmitigated() -> list[dict]:
    return simulate(XEON_SUSTAINED, 600, None)


def window(rows: list[dict], key: str, start: float, end: float) -> float:
    vals = [r[key] for r in rows if start < r["time_s"] <= end]
    return sum(vals) / len(vals)


def test_calibration_matches_the_published_case(unmitigated: list[dict]) -> None:
    s = summarize(unmitigated)
    # ~3.8 GHz at first, PROCHOT (105 °C) after roughly 120 s, then a collapse to ~2.4 GHz
    assert all(r["busy_mhz"] >= 3790 for r in unmitigated if r["time_s"] < s["first_throttle_s"])
    assert 100 <= s["first_throttle_s"] <= 140
    assert 2300 <= window(unmitigated, "busy_mhz", 300, 600) <= 2500
    assert window(unmitigated, "busy_mhz", 180, 300) < 2600
    assert 104 <= s["peak_temp_c"] <= 106.5
    assert s["throttle_events_after_60s"] > 100          # PROCHOT keeps cycling
    assert 100 <= window(unmitigated, "pkg_temp_c", 300, 600) <= 105.5


def test_power_voltage_and_roofline() -> None:
    plant = Plant(XEON_SUSTAINED)
    p = plant.params
    powers = [plant.power_w(f / 10, 32, 1.0, 70.0) for f in range(8, 39)]
    assert powers == sorted(powers)
    assert 300 <= plant.power_w(3.8, 32, 1.0, 60.0) <= 330
    assert plant.power_w(2.0, 32, 1.0, 90.0) > plant.power_w(2.0, 32, 1.0, 50.0)  # leakage
    assert plant.power_w(2.0, 16, 1.0, 60.0) < plant.power_w(2.0, 32, 1.0, 60.0)
    # decode: linear in f below the knee, flat (memory bound) above it
    assert plant.tokens_per_s(3.8) == pytest.approx(p.roofline_tok_s)
    assert plant.tokens_per_s(p.knee_ghz) == pytest.approx(p.roofline_tok_s)
    assert plant.tokens_per_s(1.3) == pytest.approx(p.roofline_tok_s / 2)
    plant.controls.threads = 16
    assert plant.tokens_per_s(3.8) == pytest.approx(p.roofline_tok_s * 3.8 / p.knee_ghz / 2)


def test_controls_pl1_no_turbo_epb() -> None:
    capped = Plant(controls=Controls(pl1_w=150.0))
    rows = [capped.step(1.0) for _ in range(120)]
    # PL2 (420 W) while the average power is under PL1, then PL1 holds: a budget, not a wall
    assert rows[0]["pkg_power_w"] > 300 and rows[0]["limit_reasons"] == 0
    assert all(r["pkg_power_w"] <= 150.5 for r in rows[60:])
    assert rows[-1]["busy_mhz"] < 3000 and rows[-1]["limit_reasons"] & (1 << 10)
    locked = Plant(replace(XEON_SUSTAINED, pl1_writable=False), Controls(pl1_w=150.0))
    assert locked.step(1.0)["busy_mhz"] == pytest.approx(3800)
    plant = Plant(XEON_SUSTAINED)
    plant.controls.no_turbo = True
    assert plant.step(1.0)["busy_mhz"] == pytest.approx(2000)
    plant.controls.no_turbo = False
    plant.controls.epb = 8
    assert plant.step(1.0)["busy_mhz"] == pytest.approx(3400)
    plant.controls.epb = 0
    assert plant.step(1.0)["busy_mhz"] == pytest.approx(3800)


def test_prochot_counts_assertions_and_energy_adds_up(unmitigated: list[dict]) -> None:
    counts = [r["throttle_count"] for r in unmitigated]
    assert counts == sorted(counts)
    assert unmitigated[-1]["energy_j"] == pytest.approx(sum(r["pkg_power_w"] for r in unmitigated))
    assert unmitigated[-1]["tokens"] == pytest.approx(sum(r["tokens_per_s"] for r in unmitigated))
    # a hot package with the engine idle cools down and stops throttling
    plant = Plant(replace(XEON_SUSTAINED, start_temp_c=104.0))
    plant.controls.load = 0.0
    rows = [plant.step(1.0) for _ in range(120)]
    assert rows[-1]["pkg_temp_c"] < 90 and rows[-1]["tokens_per_s"] == 0
    assert rows[-1]["throttle_count"] == rows[0]["throttle_count"]


def test_fake_root_shows_the_state_like_a_machine(tmp_path: Path) -> None:
    plant = Plant()
    for _ in range(130):
        plant.step(1.0)
    plant.write_fake_root(tmp_path)
    read = lambda rel: (tmp_path / rel).read_text().strip()  # noqa: E731
    assert read("sys/class/thermal/thermal_zone0/type") == "x86_pkg_temp"
    assert int(read("sys/class/thermal/thermal_zone0/temp")) == round(plant.t_die_c * 1000)
    assert read(f"{RAPL}/name") == "package-0"
    assert read(f"{RAPL}/constraint_0_name") == "long_term"
    assert int(read(f"{RAPL}/max_energy_range_uj")) == MAX_ENERGY_UJ
    assert int(read(f"{RAPL}/energy_uj")) == int(plant.energy_j * 1e6)
    assert int(read(f"{RAPL}/constraint_0_power_limit_uw")) == 350_000_000
    assert read(f"{CPU}/intel_pstate/no_turbo") == "0"
    for n in (0, 31):
        assert int(read(f"{CPU}/cpu{n}/cpufreq/scaling_cur_freq")) == \
            round(plant.last["busy_mhz"] * 1000)
        assert int(read(f"{CPU}/cpu{n}/thermal_throttle/core_throttle_count")) == \
            plant.throttle_count > 0
        assert read(f"{CPU}/cpu{n}/thermal_throttle/package_throttle_count") == \
            str(plant.throttle_count)
        assert read(f"{CPU}/cpu{n}/power/energy_perf_bias") == "4"
    assert not list(tmp_path.rglob(".*.tmp"))


def test_energy_counter_wraps(tmp_path: Path) -> None:
    plant = Plant()
    plant.energy_j = MAX_ENERGY_UJ / 1e6 + 5.0
    plant.write_fake_root(tmp_path)
    assert int((tmp_path / RAPL / "energy_uj").read_text()) == pytest.approx(5_000_000, abs=2)


def test_controls_close_the_loop_through_files(tmp_path: Path) -> None:
    plant = Plant()
    plant.write_fake_root(tmp_path)
    assert read_controls(tmp_path) == {"pl1_w": 350.0, "no_turbo": False, "epb": 4,
                                       "ceiling_ghz": 3.8}
    # what a daemon writes there
    (tmp_path / RAPL / "constraint_0_power_limit_uw").write_text("150000000\n")
    (tmp_path / CPU / "intel_pstate/no_turbo").write_text("1\n")
    for n in range(32):
        (tmp_path / CPU / f"cpu{n}/power/energy_perf_bias").write_text("6\n")
    controls = read_controls(tmp_path)
    assert controls == {"pl1_w": 150.0, "no_turbo": True, "epb": 6, "ceiling_ghz": 3.8}
    apply_controls(plant, controls)
    for _ in range(10):
        row = plant.step(1.0)
    assert row["pkg_power_w"] <= 150.5 and row["busy_mhz"] <= 1800.1
    plant.write_fake_root(tmp_path)   # state rewritten, the daemon's knobs kept
    assert read_controls(tmp_path) == controls
    assert read_controls(tmp_path / "nowhere") == {}


def test_simulate_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.csv"
    assert simulate_main(["--seconds", "180", "--csv", str(out)]) == 0
    text = capsys.readouterr().out
    # the daemon's controller on the default plant: a ceiling before the package gets hot
    assert "apply freq_ceiling" in text and "step-tcc under dsr1d" in text
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 180 and rows[-1]["active"] == "freq_ceiling"
    assert all(float(r["ceiling_mhz"]) == 3800 for r in rows[:39])
    assert float(rows[-1]["ceiling_mhz"]) < 3500
    assert simulate_main(["--seconds", "5", "--no-mitigate"]) == 0
    root = tmp_path / "root"
    assert simulate_main(["--seconds", "20", "--fake-root", str(root)]) == 0
    assert (root / "sys/class/thermal/thermal_zone0/temp").exists()
    with pytest.raises(SystemExit):
        simulate_main(["--realtime"])
    with pytest.raises(SystemExit):
        simulate_main(["--fake-root", str(root), "--mitigate"])


def test_dsr1d_simulate_command_writes_a_csv(tmp_path):
    """`dsr1d simulate` is wired into the admin CLI and writes one row per simulated second."""
    from conftest import run_dsr1d

    out = tmp_path / "run.csv"
    proc = run_dsr1d("simulate", "--seconds", "150", "--csv", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = out.read_text().splitlines()
    assert len(rows) == 151            # header + 150 samples
    assert "tok/s" in proc.stdout + proc.stderr


def test_profile_mitigation_section_builds_a_controller_config(tmp_path):
    """Every [mitigation] key a profile sets reaches the controller's configuration, typed."""
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from fakeroot import intel_box

    from dsr1d.core.context import build_core
    from dsr1d.core.efficiency import EfficiencyConfig

    fake = intel_box(tmp_path / "root", cpus=1)
    (fake.path / "etc/dsr1d/profiles").mkdir(parents=True)
    (fake.path / "etc/dsr1d/profiles/cool.conf").write_text(
        "[main]\ninclude = sustained\n[mitigation]\ndelta_percent = 5\nprobe_bins = 3\n"
        "pl1 = no\nlimit_temp_c = 92.5\n")
    section = build_core(fake.path).store.load("cool").sections["mitigation"]
    config = EfficiencyConfig.from_section(section)
    assert (config.delta_percent, config.probe_bins, config.pl1, config.limit_temp_c,
            config.limit_margin_c) == (5.0, 3, False, 92.5, 1.5)


@pytest.mark.parametrize("args, why", [
    (["--seconds", "-5"], "--seconds must be positive"),
    (["--seconds", "nan"], "--seconds must be positive"),
    (["--seconds", "10", "--dt", "0"], "--dt between"),
    (["--seconds", "5", "--csv", "/nonexistent/x.csv"], "no directory /nonexistent"),
])
def test_bad_simulate_arguments_are_clear_errors_not_tracebacks(args: list[str], why: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "dsr1d.edges.admin", "simulate", *args],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and why in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
