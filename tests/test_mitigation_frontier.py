"""The controller on the plant shapes the independent plant found it failing on (issue 28's
findings), each in simulated time against the same plant left alone (stock): the PL1-only path,
a workload whose bytes per token drift, AMD's unreadable limit, noisy sensors, a rise that levels
off under the limit, cuts that cannot bind; and a package still warming, where the guard moves
for minutes. Each of these fails with the controller before it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from dsr1d.core.efficiency import EfficiencyConfig, EfficiencyController, Observation
from dsr1d.sim.plant import Plant
from dsr1d.sim.run import Dsr1d, Policy, best_fixed, ceiling_runs, figures, run
from dsr1d.sim.scenarios import Scenario, drift, families, plants, with_real_sensors

PLANTS = plants()


def ratios(scenario: Scenario, seconds: float,
           config: EfficiencyConfig | None = None) -> tuple[float, float, list[dict]]:
    """dsr1d's tokens/s and J/token over stock's on ``scenario``, and dsr1d's rows."""
    stock = figures(run(scenario, Policy(), seconds))
    rows = run(scenario, Dsr1d(config), seconds)
    ours = figures(rows)
    return (ours["tokens_per_s"] / stock["tokens_per_s"],
            ours["joules_per_token"] / stock["joules_per_token"], rows)


def test_without_cpufreq_pl1_saves_energy_where_no_heat_calls_for_it() -> None:
    # memory-bound and cool: before, PL1 moved only for heat (J/token 1.000 here)
    tok, joules, rows = ratios(PLANTS["pl1-only-cool"], 600)
    assert tok >= 0.97 and joules <= 0.7
    assert {a.rung for r in rows for a in r["actions"]} == {"rapl_pl1"}


def test_without_cpufreq_pl1_holds_the_limit_without_giving_up_throughput() -> None:
    # before: one cut from a short temperature fit, 0.957x stock tokens/s
    tok, _, rows = ratios(PLANTS["pl1-only"], 600)
    assert tok >= 0.98
    assert max(r["pkg_temp_c"] for r in rows) < PLANTS["pl1-only"].params.t_limit_c


def final_cap(rows: list[dict], firmware: float) -> tuple[float, float]:
    """(the lowest PL1 applied, the PL1 at the end) of a run."""
    cap, lowest = firmware, firmware
    for r in rows:
        for a in r["actions"]:
            cap = a.params["pl1_w"] if a.kind == "apply" else firmware
            lowest = min(lowest, cap)
    return lowest, cap


def test_pl1_rises_back_when_an_inlet_spike_is_over() -> None:
    spike = PLANTS["inlet-spike"]          # the inlet 10 °C warmer from 300 s to 480 s
    params = replace(spike.params, cpufreq_ceiling=False)
    heat_only = EfficiencyConfig(delta_percent=0.0)          # no energy reason to hold a cap
    tok, _, rows = ratios(Scenario("pl1-spike", params, spike.schedule), 1200, heat_only)
    _, _, calm = ratios(Scenario("pl1-calm", params), 1200, heat_only)
    firmware = params.pl1_w
    lowest, end = final_cap(rows, firmware)
    _, calm_end = final_cap(calm, firmware)
    # before: the cap taken for the spike was held to the end (0.68-0.72x the firmware's)
    assert lowest < calm_end - 0.05 * firmware
    assert abs(end - calm_end) <= 0.05 * firmware
    assert tok >= 0.97


@pytest.mark.parametrize("cpufreq", [True, False])
def test_a_growing_kv_cache_is_not_read_as_a_loss(cpufreq: bool) -> None:
    # memory-bound, cool: tokens/s falls as the bytes per token grow; before, each new window
    # under the best one broke the floor and the energy path stayed off (J/token 0.98-1.00)
    params = replace(drift(0), knee_ghz=1.2, overlap_p=4.0, r_sink_amb_k_per_w=0.12,
                     cpufreq_ceiling=cpufreq)
    tok, joules, rows = ratios(Scenario("drift-memory", params), 1800)
    assert rows[-1]["gb_per_token"] > 1.5 * rows[0]["gb_per_token"]
    assert tok >= 0.97 and joules <= 0.7


@pytest.mark.parametrize("limit", [90, 95, 100])
def test_an_unreadable_amd_limit_is_left_to_the_firmware(limit: int) -> None:
    # before: 95 °C assumed, so a 100 °C part was held under a limit it allows (0.984x)
    plant = PLANTS[f"amd-{limit}"]
    sensed = Plant(plant.params)
    sensed.step(1.0)
    assert sensed.observed()["limit_temp_c"] is None
    tok, _, _ = ratios(plant, 600)
    assert tok >= 0.99


def test_noisy_sensors_keep_most_of_the_saving() -> None:
    knee = PLANTS["memory-knee"]
    noisy = replace(knee, params=replace(knee.params, tokens_noise=0.03, power_noise=0.02,
                                         temp_step_c=1.0, noise_seed=3))
    _, exact, _ = ratios(knee, 600)
    tok, joules, _ = ratios(noisy, 600)
    # before: 0.580 noisy against 0.470 exact, one probe a decode under the two-error rule
    assert tok >= 0.97 and joules <= exact + 0.06


def test_a_rise_that_levels_off_under_the_set_point_gets_no_cut_that_cannot_bind() -> None:
    cfg = EfficiencyConfig(limit_temp_c=105.0, dwell_s=600)     # the thermal guard alone
    ctl = EfficiencyController(cfg)
    moves, cuts, ceiling = [], [], 3800.0
    for t in range(900):
        temp = float(round(min(101.0, 90.0 + 0.05 * t)))      # whole degrees, as coretemp
        busy = min(3000.0, ceiling)                            # the package runs 3000 MHz
        for a in ctl.step(Observation(time_s=float(t), tokens_per_s=12.0, busy_mhz=busy,
                                      pkg_power_w=250.0, pkg_temp_c=temp, max_mhz=3800.0,
                                      min_mhz=800.0, ceiling_mhz=ceiling, throttle_ms=0.0)):
            moves.append(a)
            new = a.params["mhz"] if a.kind == "apply" else 3800.0
            if new < ceiling:
                cuts.append(new)
            ceiling = new
    # before: a cut to 3700 MHz, over the 3000 MHz the package ran (it changed nothing)
    assert cuts and all(c < 3000.0 for c in cuts), moves
    # one cut, relaxed a bin at a time and let go once the clock runs under it: no cycle
    assert len(cuts) == 1 and len(moves) <= 4 and moves[-1].kind == "release", moves


def test_no_ceiling_is_set_over_the_all_core_clock() -> None:
    # cpuinfo_max_freq 3.8 GHz, 3.0 GHz with every core busy; compute-bound, so the energy path
    # keeps the clock high: before, a ceiling of 3500 MHz was set and taken back (no effect)
    params = replace(PLANTS["turbo-above-allcore"].params, knee_ghz=3.5, overlap_p=2.0)
    _, _, rows = ratios(Scenario("turbo-compute", params), 900)
    applied = [a.params["mhz"] for r in rows for a in r["actions"] if a.kind == "apply"]
    assert applied and max(applied) <= 3000.0


def test_the_uncore_clock_is_lowered_where_decode_keeps_its_floor_and_given_back() -> None:
    knee = PLANTS["memory-knee"]           # memory-bound: bandwidth saturates under the top
    params = replace(knee.params, p_static_w=35.0, uncore_w=50.0, uncore_sat_ghz=1.4,
                     uncore_knee_p=8.0)

    def stop_at_400(t: float, plant: Plant) -> None:
        plant.controls.load = 1.0 if t < 400 else 0.0
    plant = Scenario("memory-knee-uncore", params, stop_at_400)
    _, without, _ = ratios(plant, 480, EfficiencyConfig(uncore=False))
    tok, joules, rows = ratios(plant, 480, EfficiencyConfig(uncore=True))
    uncore = [(r["time_s"], a) for r in rows for a in r["actions"] if a.rung == "uncore_ceiling"]
    assert any(a.kind == "apply" and a.params["mhz"] < 2400 for _, a in uncore)
    assert tok >= 0.97 and joules < without
    last_t, last = uncore[-1]
    assert last.kind == "release" and last_t > 400          # given back when decode stops
    assert rows[-1]["uncore_limit_mhz"] == 2400.0


def test_an_uncore_action_is_an_uncore_profile_overlay() -> None:
    from dsr1d.core.efficiency import Action
    from dsr1d.core.mitigator import overlay_for
    apply = Action("apply", "uncore_ceiling", "test", {"mhz": 2000.0})
    assert overlay_for(apply) == {"uncore": {"max_mhz": 2000}}


def oracle_joules(scenario: Scenario, seconds: float, delta: float) -> float:
    """The best fixed ceiling's J/token over stock's at ``delta`` (the bench's oracle)."""
    runs = ceiling_runs(scenario, seconds)
    return best_fixed(runs, delta)[1]["joules_per_token"] / runs["stock"]["joules_per_token"]


def test_a_warming_package_reaches_the_oracle_without_cycling() -> None:
    # The guard moves a bin every 20-40 s while the heat sink warms. Before: no energy cut
    # under a guard that had moved within a minute, then the guard relaxed each sample under
    # an energy cut and let go, the floor went back to the cold die's clock: a cycle of cuts,
    # 57 actions in 30 minutes at 0.972x stock J/token where the oracle gets 0.960x.
    plant = PLANTS["step-tcc"]
    tok, joules, rows = ratios(plant, 1800)
    assert tok >= 0.98
    assert joules <= oracle_joules(plant, 1800, 2.0) + 0.005
    assert sum(len(r["actions"]) for r in rows) <= 30


@pytest.mark.parametrize("name, sensors", [("step-tcc", "exact"), ("inlet-step", "real")])
def test_efficient_spends_its_budget_on_a_warming_package(name: str, sensors: str) -> None:
    # before: 0.957x (step-tcc) and 0.962x (inlet-step, real sensors) stock J/token over 30
    # minutes at delta 5 %, spending about 1 % of tokens/s; the oracle gets 0.816x / 0.897x
    plant = PLANTS[name] if sensors == "exact" else with_real_sensors(PLANTS[name], 1)
    tok, joules, _ = ratios(plant, 1800, EfficiencyConfig(delta_percent=5.0))
    assert tok >= 0.95
    assert joules <= 0.945


@pytest.mark.parametrize("seed, delta, before", [(1, 2.0, 0.982), (0, 5.0, 0.979)])
def test_a_growing_kv_cache_under_the_guard_keeps_the_energy_path(seed: int, delta: float,
                                                                   before: float) -> None:
    # hot and drifting: when the bytes per token move a quarter the decode curve is learned
    # again, but under the thermal guard no window runs free; before, the energy path waited
    # for a free one for good (its last move at 164-248 s of 30 minutes, J/token ``before``)
    tok, joules, _ = ratios(plants(seed)["drift"], 1800, EfficiencyConfig(delta_percent=delta))
    assert tok >= 0.98 - delta / 100
    assert joules <= before - 0.02


@pytest.mark.parametrize("index, bound, before", [(None, 1.10, 1.145), (3, 1.04, 1.096)])
def test_a_growing_kv_cache_under_an_energy_cut_alone_keeps_the_energy_path(
        index: int | None, bound: float, before: float) -> None:
    # cool enough that the guard never holds: when the bytes per token move a quarter under the
    # energy cut no window runs free again, and the floor had no reference; the energy path
    # waited for good (J/token ``before`` x the oracle's over 30 minutes at delta 5 %). The
    # reference is carried now: the extra seconds per token the bytes cost at the cut
    plant = PLANTS["drift"] if index is None else families(10, 7)["drift"][index]
    tok, joules, _ = ratios(plant, 1800, EfficiencyConfig(delta_percent=5.0))
    assert tok >= 0.95
    assert joules <= bound * oracle_joules(plant, 1800, 5.0)


@pytest.mark.parametrize("sensors", ["exact", "real"])
def test_an_energy_cut_that_keeps_the_package_cool_is_judged_against_what_stock_sustains(
        sensors: str) -> None:
    # a heat sink that takes minutes to warm: under the energy cut the package never shows the
    # heat stock meets after 322 s, so the floor stayed 5 % under the cold die's 3.8 GHz for
    # the whole half hour (J/token 1.080x / 1.092x the oracle's); the clock the package would
    # settle at at its limit, learned from its heat, is the floor's reference now
    plant = PLANTS["slow-sink"] if sensors == "exact" else with_real_sensors(PLANTS["slow-sink"], 7)
    tok, joules, _ = ratios(plant, 1800, EfficiencyConfig(delta_percent=5.0))
    assert tok >= 0.93
    assert joules <= 1.03 * oracle_joules(PLANTS["slow-sink"], 1800, 5.0)
