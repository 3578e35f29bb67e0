"""The clock a package would sustain at its thermal limit, learned from its heat
(`dsr1d.core.heat`), against what the simulated package really settles at."""

from __future__ import annotations

import pytest

from dsr1d.core.heat import BLOCK, MIN_BLOCKS, sustained_clock
from dsr1d.sim.plant import Plant
from dsr1d.sim.scenarios import plants, with_real_sensors

PLANTS = plants()


def heat_record(name: str, ceiling_mhz: float, seconds: int, real: bool = False
                ) -> list[tuple[float, float, float]]:
    """(°C, W, busy MHz) each second of ``name`` decoding, as read: free for the first minute,
    then under ``ceiling_mhz`` (as the controller's first energy cut)."""
    sc = with_real_sensors(PLANTS[name], 3) if real else PLANTS[name]
    plant = Plant(sc.params)
    out = []
    for t in range(seconds):
        if t == 60:
            plant.controls.ceiling_ghz = ceiling_mhz / 1000
        plant.step(1.0)
        o = plant.observed()
        out.append((o["pkg_temp_c"], o["pkg_power_w"], o["busy_mhz"]))
    return out


def sustained_at_limit(name: str) -> float:
    """The busy MHz the package holds at its limit once its heat sink has settled: stock's mean
    over the third hour."""
    plant = Plant(PLANTS[name].params)
    rows = [plant.step(1.0) for _ in range(3 * 3600)]
    return sum(r["freq_mhz"] for r in rows[-3600:]) / 3600


@pytest.mark.parametrize("real", [False, True])
def test_the_clock_that_settles_at_the_limit_is_learned_from_a_cooler_package(real: bool) -> None:
    # slow-sink under a 2.6 GHz cut stays 5 °C under its limit; from a minute free and 14 at
    # 2.6 GHz, the clock stock holds at the limit once the sink has warmed (2.82 GHz), within
    # a bin under it and the bound's margin (it errs high: uncertainty costs joules) over it
    name = "slow-sink"
    mhz = sustained_clock(heat_record(name, 2600, 900, real), PLANTS[name].params.t_limit_c)
    truth = sustained_at_limit(name)
    assert mhz is not None and truth - 100 < mhz < truth + 250


def test_no_answer_before_two_minutes_of_blocks() -> None:
    record = heat_record("step-tcc", 2600, BLOCK * MIN_BLOCKS - 1)
    assert sustained_clock(record, PLANTS["step-tcc"].params.t_limit_c) is None


def test_a_sink_slower_than_the_data_gives_no_answer_rather_than_a_guess() -> None:
    # never-hot's sink has a 17-minute time constant: five minutes do not show its gain
    record = heat_record("never-hot", 3800, 300)
    assert sustained_clock(record, PLANTS["never-hot"].params.t_limit_c) is None


def test_a_steady_package_or_a_single_clock_gives_no_answer() -> None:
    # no change in power: nothing to learn the heat's response from
    flat = [(80.0, 200.0, 3000.0)] * (BLOCK * 30)
    assert sustained_clock(flat, 105.0) is None
    # one clock throughout: no power curve to carry the answer to another clock
    one_clock = [(60.0 + 20 * (1 - 0.99 ** t), 200.0 + 0.2 * t ** 0.5, 3000.0) for t in range(900)]
    assert sustained_clock(one_clock, 105.0) is None
