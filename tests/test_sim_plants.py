"""The plants of issue #28 have the shapes they claim: each run with no controller (the stock
policy, or a fixed ceiling where a fixed clock is the point), through the simulator's own run().

Simulated time only: nothing here sleeps or measures the wall clock.
"""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from dsr1d.sim.plant import CPU, RAPL, Controls, Plant, apply_controls, read_controls
from dsr1d.sim.run import Ceiling, Policy, figures, run
from dsr1d.sim.scenarios import FAMILIES, Scenario, families, plants
from dsr1d.sim.sim import simulate_main

PLANTS = plants()
NEW = ("pl1-only", "pl1-only-cool", "burst-sustain", "drift", "amd-90", "amd-95", "amd-100",
       "turbo-above-allcore", "never-hot", "slow-sink", "inlet-spike")


def mean(rows: list[dict[str, Any]], key: str, start: float, end: float) -> float:
    """The mean of ``key`` over the rows with ``start < time_s <= end``."""
    vals = [r[key] for r in rows if start < r["time_s"] <= end]
    return sum(vals) / len(vals)


def observations(scenario: Scenario, seconds: int, controls: Controls | None = None
                 ) -> list[dict[str, Any]]:
    """What software sees each second of the plant under ``controls`` (its schedule applied)."""
    plant, out = Plant(scenario.params, controls), []
    for _ in range(seconds):
        if scenario.schedule is not None:
            scenario.schedule(plant.time_s, plant)
        plant.step(1.0)
        out.append(plant.observed())
    return out


def fake_root(scenario: Scenario, root: Path, seconds: int = 30) -> Plant:
    """The plant stepped ``seconds`` and written under ``root``."""
    plant = Plant(scenario.params)
    for _ in range(seconds):
        plant.step(1.0)
    plant.write_fake_root(root)
    return plant


def test_every_new_plant_is_named_and_documented() -> None:
    import dsr1d.sim.scenarios as scenarios

    for name in NEW:
        assert PLANTS[name].name == PLANTS[name].params.name == name
        assert PLANTS[name].description and f"``{name}``" in (scenarios.__doc__ or "")
        assert not PLANTS[name].quiet


# -- pl1-only, pl1-only-cool ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["pl1-only", "pl1-only-cool"])
def test_without_cpufreq_only_a_pl1_write_acts(name: str) -> None:
    sc = PLANTS[name]
    stock = observations(sc, 300)
    capped = observations(sc, 300, Controls(pl1_w=150.0))
    for o in stock + capped:
        assert o["max_mhz"] is None and o["min_mhz"] is None and o["ceiling_mhz"] is None
        assert o["pl1_firmware_w"] == 350.0 and o["limit_temp_c"] == 105.0
    assert capped[-1]["pl1_w"] == 150.0                         # the write took, read back
    assert mean(capped, "pkg_power_w", 240, 300) <= 150.5 < mean(stock, "pkg_power_w", 240, 300)


def test_pl1_only_runs_into_its_thermal_limit_and_a_pl1_cap_keeps_it_under() -> None:
    stock = figures(run(PLANTS["pl1-only"], Policy(), 600))
    assert stock["first_thermal_event_s"] is not None and stock["throttle_duty"] > 0.5
    plant = Plant(PLANTS["pl1-only"].params, Controls(pl1_w=200.0))
    assert max(plant.step(1.0)["pkg_temp_c"] for _ in range(600)) < 100.0
    assert plant.events == 0


def test_pl1_only_cool_never_nears_its_limit_so_energy_is_the_only_reason_to_cap() -> None:
    sc = PLANTS["pl1-only-cool"]
    rows = run(sc, Policy(), 1800)
    assert max(r["pkg_temp_c"] for r in rows) < sc.params.t_limit_c - 15
    assert rows[-1]["events"] == 0
    stock = figures(rows[:600])
    plant = Plant(sc.params, Controls(pl1_w=150.0))
    capped = figures([plant.step(1.0) | {"actions": []} for _ in range(600)])
    # memory-bound: 2 % of the tokens for less than half the joules
    assert capped["tokens_per_s"] >= 0.97 * stock["tokens_per_s"]
    assert capped["joules_per_token"] < 0.5 * stock["joules_per_token"]


@pytest.mark.parametrize("name", ["pl1-only", "pl1-only-cool"])
def test_pl1_only_fake_root_has_no_cpufreq_and_takes_a_pl1_write(name: str, tmp_path: Path) -> None:
    plant = fake_root(PLANTS[name], tmp_path)
    assert not list((tmp_path / CPU).rglob("cpufreq")) and not (tmp_path / CPU / "intel_pstate").exists()
    assert (tmp_path / CPU / "cpu0/thermal_throttle/package_throttle_count").exists()
    assert read_controls(tmp_path) == {"pl1_w": 350.0, "epb": 4}
    (tmp_path / RAPL / "constraint_0_power_limit_uw").write_text("150000000\n")
    apply_controls(plant, read_controls(tmp_path))
    rows = [plant.step(1.0) for _ in range(120)]
    assert rows[-1]["pkg_power_w"] <= 150.5
    plant.write_fake_root(tmp_path)
    assert read_controls(tmp_path)["pl1_w"] == 150.0            # the daemon's write stays


# -- burst-sustain -------------------------------------------------------------------------------

def test_burst_sustain_the_best_window_is_the_pl2_burst() -> None:
    rows = run(PLANTS["burst-sustain"], Policy(), 600)
    burst, sustained = mean(rows, "tokens_per_s", 0, 30), mean(rows, "tokens_per_s", 540, 600)
    assert burst >= 1.05 * sustained
    # the burst lasts about tau, and it is PL1 that ends it, not heat
    end = next(r["time_s"] for r in rows if r["limit_reasons"] & (1 << 10))
    assert 20 <= end <= 35
    assert all(r["limit_reasons"] & (1 << 10) for r in rows if r["time_s"] > end)
    assert rows[-1]["events"] == 0
    windows = [mean(rows, "tokens_per_s", t, t + 10) for t in range(0, 590, 10)]
    assert max(windows) == windows[0] and max(windows[4:]) < 0.95 * windows[0]


# -- drift ---------------------------------------------------------------------------------------

def test_drift_bytes_per_token_rise_and_tokens_fall_with_them_at_a_fixed_clock() -> None:
    sc = PLANTS["drift"]
    rows = run(sc, Ceiling(2000), 900)
    assert {round(r["busy_mhz"], 6) for r in rows} == {2000.0}          # a fixed clock
    seen = [o["gb_per_token"] for o in observations(sc, 900, Controls(ceiling_ghz=2.0))]
    assert seen == [r["gb_per_token"] for r in rows]
    assert seen == sorted(seen) and seen[0] == sc.params.gb_per_token
    assert seen[-1] > 1.3 * seen[0]
    steps = [i for i in range(1, len(seen)) if seen[i] > seen[i - 1]]
    assert len(steps) >= 7 and all(b - a == 90 for a, b in zip(steps, steps[1:]))
    for a, b in zip(seen, seen[1:]):
        assert b <= a * 1.2 + 1e-9 * a
    # tokens/s falls as one over the bytes
    for r in rows[1:]:
        if r["time_s"] % 90:                                   # not a step's own second
            assert r["tokens_per_s"] * r["gb_per_token"] == pytest.approx(
                rows[0]["tokens_per_s"] * rows[0]["gb_per_token"])
    assert rows[-1]["tokens_per_s"] < 0.77 * rows[0]["tokens_per_s"]


def test_drift_is_seeded_and_an_idle_engine_frees_its_kv_cache() -> None:
    def gb(seed: int) -> list[float]:
        return [r["gb_per_token"] for r in run(plants(seed)["drift"], Policy(), 400)]
    assert gb(1) == gb(1) != gb(2)
    plant = Plant(PLANTS["drift"].params)
    for _ in range(200):
        plant.step(1.0)
    assert plant.gb_per_token > PLANTS["drift"].params.gb_per_token
    plant.controls.load = 0.0
    assert plant.step(1.0)["gb_per_token"] == PLANTS["drift"].params.gb_per_token


def test_every_plant_reports_the_engines_bytes_per_token() -> None:
    for name, sc in PLANTS.items():
        assert observations(sc, 2)[-1]["gb_per_token"] == sc.params.gb_per_token, name


# -- amd-90, amd-95, amd-100 ---------------------------------------------------------------------

@pytest.mark.parametrize("limit", [90, 95, 100])
def test_amd_limit_is_unreadable_and_the_clock_slides_smoothly_under_it(limit: int) -> None:
    sc = PLANTS[f"amd-{limit}"]
    assert sc.params.t_limit_c == limit
    for o in observations(sc, 300, Controls(pl1_w=150.0)):
        assert o["limit_temp_c"] is None and o["throttle_count"] is None
        assert o["throttle_ms"] is None and o["limit_reasons"] is None and o["pl1_w"] is None
    rows = run(sc, Policy(), 600, dt=0.1)
    assert mean(rows, "pkg_power_w", 500, 600) < 250      # the PL1 write above took no effect
    near = [r for r in rows if r["pkg_temp_c"] > limit - 5]
    assert len(near) > 3000                               # most of the run on the slope
    steps = [abs(b["freq_mhz"] - a["freq_mhz"]) for a, b in zip(near, near[1:])]
    assert max(steps) < 20                                 # no 100 MHz bins
    assert len({round(r["freq_mhz"]) for r in near}) > 500
    assert limit - 3.5 < max(r["pkg_temp_c"] for r in rows) < limit
    assert 1500 < mean(rows, "freq_mhz", 500, 600) < 3000


def test_amd_tcc_plant_steps_where_the_slope_plants_slide() -> None:
    rows = run(PLANTS["amd"], Policy(), 600, dt=0.1)
    near = [r for r in rows if r["pkg_temp_c"] > 90]
    assert any(abs(b["freq_mhz"] - a["freq_mhz"]) >= 99 for a, b in zip(near, near[1:]))
    hotter = [mean(run(PLANTS[f"amd-{t}"], Policy(), 600), "freq_mhz", 500, 600)
              for t in (90, 95, 100)]
    assert hotter == sorted(hotter) and hotter[2] - hotter[0] > 200


def test_amd_fake_root_shows_no_limit_counters_or_pl1(tmp_path: Path) -> None:
    fake_root(PLANTS["amd-95"], tmp_path)
    assert (tmp_path / "sys/class/hwmon/hwmon0/temp1_label").read_text() == "Tctl\n"
    assert not (tmp_path / "sys/class/hwmon/hwmon0/temp1_crit").exists()
    assert not list(tmp_path.rglob("trip_point_*"))
    assert not list(tmp_path.rglob("thermal_throttle"))
    assert not list((tmp_path / RAPL).glob("constraint_*"))
    assert (tmp_path / RAPL / "energy_uj").exists()
    assert read_controls(tmp_path) == {"no_turbo": False, "epb": 4, "ceiling_ghz": 3.7}


# -- turbo-above-allcore -------------------------------------------------------------------------

def test_turbo_above_allcore_busy_clock_is_well_under_cpuinfo_max(tmp_path: Path) -> None:
    sc = PLANTS["turbo-above-allcore"]
    obs = observations(sc, 60)
    assert all(o["busy_mhz"] <= o["max_mhz"] - 500 for o in obs)
    assert obs[-1]["max_mhz"] == 3800 and obs[-1]["busy_mhz"] == pytest.approx(3000)
    one = Plant(sc.params, Controls(threads=1))
    assert one.step(1.0)["busy_mhz"] == pytest.approx(3800)     # one core busy: the full turbo
    plant = fake_root(sc, tmp_path)
    assert (tmp_path / CPU / "cpu0/cpufreq/cpuinfo_max_freq").read_text() == "3800000\n"
    assert int((tmp_path / CPU / "cpu0/cpufreq/scaling_cur_freq").read_text()) == 3000000
    assert read_controls(tmp_path)["ceiling_ghz"] == 3.8 and plant.last["ceiling_mhz"] == 3800


# -- never-hot -----------------------------------------------------------------------------------

def test_never_hot_rises_for_half_an_hour_and_stays_under_its_limit() -> None:
    sc = PLANTS["never-hot"]
    limit = sc.params.t_limit_c
    rows = run(sc, Policy(), 1800)
    assert rows[-1]["events"] == 0 and max(r["pkg_temp_c"] for r in rows) < limit
    temp = {round(r["time_s"]): r["pkg_temp_c"] for r in rows}
    assert temp[1800] - temp[1500] > 1.0                       # still rising at 30 minutes
    # a line through minutes 2 to 4 crosses the limit well within the half hour
    slope = (temp[240] - temp[120]) / 120
    assert temp[240] + slope * (1800 - 240) > limit + 5
    settled = run(sc, Policy(), 6 * 3600, dt=10.0)[-1]["pkg_temp_c"]
    assert limit - 5 < settled < limit - 2


# -- slow-sink -----------------------------------------------------------------------------------

def test_slow_sink_throttles_only_after_minutes_and_sustains_less_for_good() -> None:
    rows = run(PLANTS["slow-sink"], Policy(), 1800)
    first = next(r["time_s"] for r in rows if r["events"] > 0)
    assert 240 < first < 420                      # five minutes at turbo before the limit
    early, late = mean(rows, "freq_mhz", 0, 240), mean(rows, "freq_mhz", 1200, 1800)
    assert early > 3700 and late < early - 800    # what it sustains is far under the start
    assert mean(rows, "tokens_per_s", 1200, 1800) < 0.96 * mean(rows, "tokens_per_s", 0, 240)


# -- inlet-spike ---------------------------------------------------------------------------------

def test_inlet_spike_is_180_s_of_10_degrees_then_back() -> None:
    rows = run(PLANTS["inlet-spike"], Policy(), 900)
    amb = {round(r["time_s"]): r["ambient_c"] for r in rows}
    assert {amb[t] for t in range(1, 301)} == {30.0} == {amb[t] for t in range(481, 901)}
    assert {amb[t] for t in range(301, 481)} == {40.0}
    before, during = mean(rows, "freq_mhz", 240, 300), mean(rows, "freq_mhz", 420, 480)
    after = mean(rows, "freq_mhz", 840, 900)
    assert during < before - 200 and after > during + 200


# -- families ------------------------------------------------------------------------------------

def test_families_are_seeded_and_reproducible() -> None:
    def params(n: int, seed: int) -> dict[str, list[Any]]:
        return {f: [sc.params for sc in scs] for f, scs in families(n, seed).items()}
    one = params(4, 3)
    assert list(one) == list(FAMILIES) and all(len(ps) == 4 for ps in one.values())
    assert one == params(4, 3)
    other = params(4, 4)
    for family in FAMILIES:      # every plant differs from the other seed's (names aside)
        for a, b in zip(one[family], other[family]):
            assert a.name != b.name and replace(a, name="") != replace(b, name="")
    assert {f: ps[:2] for f, ps in one.items()} == params(2, 3)     # n grows: the first stay
    spikes = [sc.description for sc in families(3, 3)["inlet-spike"]]
    assert spikes == [sc.description for sc in families(3, 3)["inlet-spike"]]
    assert spikes != [sc.description for sc in families(3, 4)["inlet-spike"]]


def test_each_family_keeps_its_named_plants_shape() -> None:
    fam = families(5, 1)
    names = [sc.name for scs in fam.values() for sc in scs]
    assert len(set(names)) == len(names)
    for sc in fam["pl1-only"]:
        assert not sc.params.cpufreq_ceiling and sc.params.pl1_writable
        assert 0.16 <= sc.params.r_sink_amb_k_per_w <= 0.32 and 1.2 <= sc.params.knee_ghz <= 3
    for sc in fam["burst-then-sustain"]:
        assert 150 <= sc.params.pl1_w <= 260 and sc.params.pl2_w == 420
    assert all(sc.params.gb_growth_period_s == 90 for sc in fam["drift"])
    assert len({sc.params.gb_growth_seed for sc in fam["drift"]}) == 5
    for sc in fam["amd"]:
        assert sc.params.throttle == "slope" and sc.params.tj_max_c in (90, 95, 100)
    assert all(2.6 <= sc.params.f_allcore_ghz <= 3.2 for sc in fam["turbo-above-allcore"])
    for sc in fam["never-hot"]:
        rows = run(sc, Policy(), 1800)
        assert rows[-1]["events"] == 0 and max(r["pkg_temp_c"] for r in rows) < 103
    for sc in fam["inlet-spike"]:
        amb = [r["ambient_c"] for r in run(sc, Policy(), 900)]
        hot = [i for i, a in enumerate(amb) if a > sc.params.ambient_c]
        assert 200 <= hot[0] <= 501 and 119 <= len(hot) <= 241
        assert hot == list(range(hot[0], hot[-1] + 1)) and 5 <= max(amb) - amb[0] <= 12


# -- the command line and the fake root ----------------------------------------------------------

@pytest.mark.parametrize("name", NEW)
def test_each_plant_runs_behind_a_fake_root(name: str, tmp_path: Path) -> None:
    out = tmp_path / "run.csv"
    assert simulate_main(["--plant", name, "--seconds", "20", "--fake-root", str(tmp_path / "r"),
                          "--csv", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 20 and float(rows[-1]["gb_per_token"]) == PLANTS[name].params.gb_per_token
    root = tmp_path / "r"
    params = PLANTS[name].params
    assert (root / CPU / "cpu0/cpufreq").exists() == params.cpufreq_ceiling
    assert (root / CPU / "cpu0/thermal_throttle").exists() == (params.vendor == "intel")
    assert (root / "sys/class/hwmon/hwmon0/temp1_crit").exists() == params.limit_readable


def test_simulate_stock_on_a_new_plant(capsys: pytest.CaptureFixture[str]) -> None:
    assert simulate_main(["--plant", "burst-sustain", "--policy", "stock", "--seconds", "60"]) == 0
    assert "burst-sustain under stock" in capsys.readouterr().out
