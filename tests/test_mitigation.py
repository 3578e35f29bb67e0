"""Throttle detection and the mitigation ladder (dsr1d.sim.ladder), alone and against the plant.

Simulated time only: nothing here sleeps or measures the wall clock.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from dsr1d.core.efficiency import Action
from dsr1d.sim.ladder import RUNGS, Controller, MitigationConfig, Sample
from dsr1d.sim.plant import Plant
from dsr1d.sim.sim import XEON_SUSTAINED, simulate, summarize


def feed(ctl: Controller, samples: list[Sample]) -> list[list[Action]]:
    return [ctl.step(s) for s in samples]


def hot(t: float, count: int, temp: float = 104.0, mhz: float = 3000.0,
        power: float | None = 300.0) -> Sample:
    return Sample(time_s=t, pkg_temp_c=temp, busy_mhz=mhz, pkg_power_w=power,
                  throttle_count=count, tokens_per_s=12.0)


def cool(t: float, count: int, temp: float = 70.0) -> Sample:
    return Sample(time_s=t, pkg_temp_c=temp, busy_mhz=2000.0, pkg_power_w=120.0,
                  throttle_count=count, tokens_per_s=12.0)


# -- detection -----------------------------------------------------------------------------------

def test_counter_rising_is_evidence_and_the_first_rung_follows_at_once() -> None:
    ctl = Controller(MitigationConfig())
    assert ctl.step(hot(0, 5)) == []          # no previous sample: nothing to compare
    assert ctl.state == "none"
    acts = ctl.step(hot(1, 7))
    assert [(a.kind, a.rung) for a in acts] == [("apply", "rapl_pl1")]
    assert ctl.state == "mitigating" and ctl.active == ["rapl_pl1"]
    assert ctl.evidence["counter_rising"] and ctl.evidence["throttle_events_delta"] == 2
    # PL1 at the sustainable estimate: 300 W * (90 - 35) / (104 - 35)
    assert acts[0].params == {"pl1_w": pytest.approx(300 * 55 / 69, abs=0.1)}
    assert "throttle counter +2" in acts[0].reason and "104.0 °C" in acts[0].reason


def test_missing_fields_are_never_evidence() -> None:
    ctl = Controller()
    samples = [Sample(time_s=t) for t in range(5)]
    samples += [Sample(time_s=5, throttle_count=3), Sample(time_s=6), Sample(time_s=7, throttle_count=9)]
    assert all(a == [] for a in feed(ctl, samples))
    assert ctl.state == "none" and not ctl.evidence["throttling"]
    assert "pkg_temp_c" in ctl.evidence["missing"]


def test_counter_reset_is_not_evidence() -> None:
    ctl = Controller()
    feed(ctl, [cool(0, 100)])
    assert ctl.step(cool(1, 0)) == [] and ctl.state == "none"


def test_frequency_collapse_near_the_limit_is_evidence() -> None:
    ctl = Controller()
    for t in range(10):
        ctl.step(Sample(time_s=t, pkg_temp_c=88.0, busy_mhz=3800.0))
    acts = ctl.step(Sample(time_s=10, pkg_temp_c=88.0, busy_mhz=2400.0, pkg_power_w=200.0))
    assert ctl.evidence["freq_collapse"] and ctl.evidence["freq_drop_percent"] == pytest.approx(36.8, abs=0.1)
    assert [a.rung for a in acts] == ["rapl_pl1"] and "37 % under" in acts[0].reason


def test_frequency_drop_while_cool_or_small_is_not_evidence() -> None:
    ctl = Controller()
    for t in range(10):
        ctl.step(Sample(time_s=t, pkg_temp_c=60.0, busy_mhz=3800.0))
    assert ctl.step(Sample(time_s=10, pkg_temp_c=60.0, busy_mhz=1200.0)) == []
    ctl = Controller()
    for t in range(10):
        ctl.step(Sample(time_s=t, pkg_temp_c=95.0, busy_mhz=3800.0))
    assert ctl.step(Sample(time_s=10, pkg_temp_c=95.0, busy_mhz=3500.0)) == []   # 8 %
    assert ctl.state == "none"


def test_disabled_reports_but_never_acts() -> None:
    ctl = Controller(MitigationConfig(enabled=False))
    acts = feed(ctl, [hot(t, t) for t in range(10)])
    assert all(a == [] for a in acts)
    assert ctl.state == "throttling" and ctl.active == []


def test_react_after_samples() -> None:
    ctl = Controller(MitigationConfig(react_after_samples=2))
    acts = feed(ctl, [hot(0, 0), hot(1, 1), hot(2, 2)])
    assert acts[1] == [] and ctl.state == "mitigating" and [a.rung for a in acts[2]] == ["rapl_pl1"]


# -- the ladder ----------------------------------------------------------------------------------

def test_escalation_one_rung_per_evidence_interval_and_params() -> None:
    ctl = Controller(MitigationConfig(escalate_after_samples=2))
    acts = feed(ctl, [hot(t, t) for t in range(12)])
    applied = [(t, a.rung, a.params) for t, step in enumerate(acts) for a in step]
    assert [(t, r) for t, r, _ in applied] == [(1, "rapl_pl1"), (3, "no_turbo"),
                                               (5, "epb_balance"), (7, "engine_threads")]
    assert applied[1][2] == {"no_turbo": 1}
    assert applied[2][2] == {"epb": 6}
    assert applied[3][2] == {"threads_delta": -1}
    assert ctl.active == list(RUNGS)
    assert "still throttling after no_turbo" in acts[5][0].reason


def test_rung_without_its_evidence_is_skipped() -> None:
    ctl = Controller()
    acts = feed(ctl, [hot(0, 0, power=None), hot(1, 1, power=None)])
    assert [a.rung for a in acts[1]] == ["no_turbo"]


def test_release_with_hysteresis_one_by_one_in_reverse() -> None:
    cfg = MitigationConfig(release_after_s=30, release_margin_c=5, pl1_trim=False)
    ctl = Controller(cfg)
    feed(ctl, [hot(t, t) for t in range(8)])
    assert ctl.active == list(RUNGS)
    t, count, log = 8, 7, []
    # clear, but only 3 °C under target: no release however long, state stays mitigating
    for t in range(8, 100):
        assert ctl.step(cool(t, count, temp=87.0)) == []
    assert ctl.state == "mitigating"
    # cool: a release every 30 s, most recent rung first
    for t in range(100, 300):
        for a in ctl.step(cool(t, count, temp=80.0)):
            log.append((t, a.kind, a.rung))
            assert "clear for 30 s" in a.reason
        if ctl.active:
            assert ctl.state == "recovering"
    # the count runs from the last sample that was not clear and cool (t=99)
    assert log == [(129, "release", "engine_threads"), (159, "release", "epb_balance"),
                   (189, "release", "no_turbo"), (219, "release", "rapl_pl1")]
    assert ctl.state == "none" and ctl.active == []


def test_release_count_restarts_on_evidence_or_heat_and_pauses_on_missing() -> None:
    cfg = MitigationConfig(release_after_s=30, pl1_trim=False)
    ctl = Controller(cfg)
    feed(ctl, [hot(0, 0), hot(1, 1)])
    assert ctl.active == ["rapl_pl1"]
    for t in range(2, 22):
        assert ctl.step(cool(t, 1)) == []
    ctl.step(hot(22, 2, mhz=2000.0))                      # evidence again: count restarts
    for t in range(23, 45):
        assert ctl.step(cool(t, 2)) == []
    ctl.step(cool(45, 2, temp=88.0))                      # warm again: restarts
    for t in range(46, 70):
        assert ctl.step(cool(t, 2)) == []
    for t in range(70, 90):                               # temperature unknown: paused
        assert ctl.step(Sample(time_s=t, throttle_count=2)) == []
    assert ctl.active == ["rapl_pl1"]
    acts = [a for t in range(90, 100) for a in ctl.step(cool(t, 2))]
    assert [(a.kind, a.rung) for a in acts] == [("release", "rapl_pl1")]


def test_pl1_trim_follows_the_temperature() -> None:
    ctl = Controller(MitigationConfig(trim_every_s=5))
    feed(ctl, [hot(0, 0), hot(1, 1)])
    cap = ctl.params["rapl_pl1"]["pl1_w"]
    acts = [a for t in range(2, 12) for a in ctl.step(cool(t, 1, temp=96.0))]
    assert acts and acts[0].rung == "rapl_pl1" and acts[0].kind == "apply"
    assert acts[-1].params["pl1_w"] < cap and acts[0].reason.startswith("trim PL1")
    assert ctl.active == ["rapl_pl1"]


def test_config_from_profile_section() -> None:
    cfg = MitigationConfig.from_section({"enabled": "no", "target_temp_c": "85",
                                         "ladder": "no_turbo, rapl_pl1", "release_after_s": "60",
                                         "epb_balance": "8"})
    assert cfg == MitigationConfig(enabled=False, target_temp_c=85.0,
                                   ladder=("no_turbo", "rapl_pl1"), release_after_s=60.0,
                                   epb_balance=8)
    assert MitigationConfig.from_section({"enabled": True, "target_temp_c": 90}) == MitigationConfig()
    for bad in ({"ladder": "fans_up"}, {"ladder": "no_turbo no_turbo"}, {"colour": "red"},
                {"enabled": "maybe"}, {"epb_balance": "16"}):
        with pytest.raises(ValueError):
            MitigationConfig.from_section(bad)


# -- against the simulator -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    return {"off": simulate(XEON_SUSTAINED, 600, None),
            "on": simulate(XEON_SUSTAINED, 600, Controller(MitigationConfig()))}


def test_detects_the_simulated_throttle_within_two_samples(runs: dict[str, list[dict]]) -> None:
    rows = runs["on"]
    first = next(i for i, r in enumerate(rows) if r["throttle_count"] > 0)
    assert all(r["state"] == "none" for r in rows[:first])
    apply = next(i for i, r in enumerate(rows) if r["actions"])
    assert apply - first + 1 <= 2
    assert rows[apply]["actions"][0].rung == "rapl_pl1" and rows[apply]["state"] == "mitigating"


def test_mitigation_beats_prochot_on_the_calibrated_plant(runs: dict[str, list[dict]]) -> None:
    off, on = summarize(runs["off"]), summarize(runs["on"])
    assert on["sustained_tok_s"] >= 1.15 * off["sustained_tok_s"]
    assert on["throttle_events_after_60s"] <= 0.1 * off["throttle_events_after_60s"]
    assert on["energy_per_token_j"] < off["energy_per_token_j"]
    assert on["reaction_samples"] <= 2
    late = [r for r in runs["on"] if r["time_s"] > 300]
    # PL2 lets the package overshoot a freshly written PL1 for a while: near the target, not under
    assert max(r["pkg_temp_c"] for r in late) < 93


@pytest.mark.parametrize("rung", RUNGS)
def test_each_rung_applies_and_releases_against_the_plant(rung: str) -> None:
    """One rung alone: applied on the simulated throttle, changes the plant, held while hot,
    released release_after_s after the engine goes idle and the package cools, restoring."""
    cfg = MitigationConfig(ladder=(rung,), release_after_s=30)
    ctl = Controller(cfg)
    plant = Plant(XEON_SUSTAINED)
    knob = {"rapl_pl1": "pl1_w", "no_turbo": "no_turbo", "epb_balance": "epb",
            "engine_threads": "threads"}[rung]
    before = getattr(plant.controls, knob)

    def idle_at_240(t: float, p: Plant) -> None:
        if t >= 240:
            p.controls.load = 0.0

    rows = simulate(XEON_SUSTAINED, 420, ctl, schedule=idle_at_240, plant=plant)
    acts = [(r["time_s"], a) for r in rows for a in r["actions"] if not a.reason.startswith("trim")]
    assert [(a.kind, a.rung) for _, a in acts] == [("apply", rung), ("release", rung)]
    (t_apply, _), (t_release, release) = acts
    first = next(r["time_s"] for r in rows if r["throttle_count"] > 0)
    assert t_apply - first <= 1
    during = next(r for r in rows if r["time_s"] == t_apply + 1)
    assert during[knob] != before and during["active"] == [rung]
    # hysteresis: not before the package has been under target - margin for release_after_s
    cool_since = next(r["time_s"] for r in rows if r["time_s"] > 240 and r["pkg_temp_c"] < 85)
    assert t_release >= cool_since + 29
    assert getattr(plant.controls, knob) == before
    assert rows[-1]["state"] == "none"


def test_whole_ladder_escalates_and_releases_in_reverse_against_the_plant() -> None:
    """A locked PL1 (the BIOS ignores it) in a hot aisle: every rung is needed; when the aisle
    cools and the engine idles, they come off one by one, 30 s apart, last applied first."""
    params = replace(XEON_SUSTAINED, pl1_writable=False, ambient_c=60.0)
    plant = Plant(params)
    ctl = Controller(MitigationConfig(release_after_s=30))

    def incident_over(t: float, p: Plant) -> None:
        if t >= 300:
            p.controls.load = 0.0
            p.controls.ambient_c = 30.0

    rows = simulate(params, 520, ctl, schedule=incident_over, plant=plant)
    steps = [(r["time_s"], a.kind, a.rung) for r in rows for a in r["actions"]
             if not a.reason.startswith("trim")]
    assert [(k, r) for _, k, r in steps] == [("apply", x) for x in RUNGS] + \
        [("release", x) for x in reversed(RUNGS)]
    releases = [t for t, k, _ in steps if k == "release"]
    assert all(b - a >= 30 for a, b in zip(releases, releases[1:]))
    assert min(r["threads"] for r in rows if "engine_threads" in r["active"]) == 31
    assert {r["state"] for r in rows} >= {"none", "mitigating", "recovering"}
    c = plant.controls
    assert (c.pl1_w, c.no_turbo, c.epb, c.threads) == (None, False, 4, None)  # firmware's
