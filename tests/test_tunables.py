"""Each tunable against a fake root: apply -> the files/MSRs hold the values -> restore."""

from __future__ import annotations

from pathlib import Path


from dsr1d.core.context import build_core
from dsr1d.core.profiles import Profile
from fakeroot import CPU, THP, FakeRoot


def profile(**sections: dict) -> Profile:
    return Profile("test", Path("test.conf"), "", sections)


def apply_and_restore(fake: FakeRoot, sections: dict, check_applied) -> None:
    """Apply ``sections``, run ``check_applied``, restore, and compare with the tree before."""
    before = fake.snapshot()
    core = build_core(fake.path)
    core.tuner.switch(profile(**sections))
    check_applied()
    restored, errors = core.tuner.restore()
    assert errors == []
    assert restored, "restore wrote nothing back"
    assert fake.snapshot() == before
    assert not core.journal.path.exists()


# -- thp -------------------------------------------------------------------------------------

def test_thp_round_trip(fake):
    def applied():
        assert fake.selected(f"{THP}/enabled") == "always"
        assert fake.selected(f"{THP}/defrag") == "defer+madvise"
        assert fake.read(f"{THP}/khugepaged/defrag") == "0"

    apply_and_restore(fake, {"thp": {"enabled": "always", "defrag": "defer+madvise",
                                     "khugepaged_defrag": False}}, applied)


def test_thp_unsupported_without_sysfs(tmp_path):
    fake = FakeRoot(tmp_path).add_cpu(0)
    support = build_core(fake.path).tunables["thp"].probe(build_core(fake.path).root)
    assert not support.supported
    assert "CONFIG_TRANSPARENT_HUGEPAGE" in support.detail


# -- epb -------------------------------------------------------------------------------------

def test_epb_round_trip_every_online_cpu(fake):
    fake.add_cpu(9, epb=6, online=False)   # offline: must not be touched

    def applied():
        for cpu in range(4):
            assert fake.read(f"{CPU}/cpu{cpu}/power/energy_perf_bias") == "4"
            assert fake.read(f"{CPU}/cpu{cpu}/cpufreq/energy_performance_preference") == "performance"
        assert fake.read(f"{CPU}/cpu9/power/energy_perf_bias") == "6"

    apply_and_restore(fake, {"epb": {"epb": "balance-performance", "epp": "performance"}}, applied)


def test_epb_msr_fallback(tmp_path):
    fake = FakeRoot(tmp_path, flags="fpu msr epb")
    for cpu in range(2):
        fake.add_cpu(cpu).add_msr(cpu, 0x1B0, 0xABC6)   # high bits are not EPB's

    def applied():
        for cpu in range(2):
            assert fake.msr(cpu, 0x1B0) == 0xABCF       # bits 3:0 = 15, the rest untouched

    apply_and_restore(fake, {"epb": {"epb": "power"}}, applied)


def test_epb_unsupported_says_why(tmp_path):
    fake = FakeRoot(tmp_path, vendor="AuthenticAMD", flags="fpu").add_cpu(0)
    core = build_core(fake.path)
    support = core.tunables["epb"].probe(core.root)
    assert not support.supported
    assert "energy_perf_bias" in support.detail and "'epb' flag" in support.detail


# -- prefetcher ------------------------------------------------------------------------------

def test_prefetcher_round_trip(fake):
    fake.add_msr(0, 0x1A4, 0xF0)   # bits above 3 belong to other features

    def applied():
        # l2_adjacent off -> bit 1 set; dcu_ip off -> bit 3 set
        assert fake.msr(0, 0x1A4) == 0xFA
        for cpu in range(1, 4):
            assert fake.msr(cpu, 0x1A4) == 0x0A

    apply_and_restore(fake, {"prefetcher": {"l2_streamer": True, "l2_adjacent": False,
                                            "dcu_streamer": True, "dcu_ip": False}}, applied)


def test_prefetcher_amd_is_unsupported_not_guessed(tmp_path):
    fake = FakeRoot(tmp_path, vendor="AuthenticAMD").add_cpu(0).add_msr(0, 0x1A4, 0)
    core = build_core(fake.path)
    support = core.tunables["prefetcher"].probe(core.root)
    assert not support.supported and "AuthenticAMD" in support.detail
    plan = core.tuner.switch(profile(prefetcher={"l2_streamer": False}))
    assert plan.writes == [] and "prefetcher" in plan.unsupported
    assert fake.msr(0, 0x1A4) == 0


# -- cstate ----------------------------------------------------------------------------------

def test_cstate_round_trip_by_latency_and_name(fake):
    def applied():
        for cpu in range(4):
            assert fake.state_disabled(cpu, "C6") == "1"
            assert fake.state_disabled(cpu, "C1E") == "1"
            assert fake.state_disabled(cpu, "C1") == "0"
            assert fake.state_disabled(cpu, "POLL") == "0"
        assert fake.msr(0, 0xE2) & 0xF == 1

    apply_and_restore(fake, {"cstate": {"disable_deeper_than_us": 100, "disable": ["C1E"],
                                        "pkg_cstate_limit": 1}}, applied)


def test_cstate_haltpoll_switches_to_menu_and_back(tmp_path):
    fake = FakeRoot(tmp_path).add_cpu(0).add_cpu(1)
    fake.add_cpuidle([("POLL", 0), ("C1", 1), ("C2", 50)], governor="haltpoll",
                     available="ladder menu haltpoll", driver="haltpoll")

    def applied():
        assert fake.read(f"{CPU}/cpuidle/current_governor") == "menu"
        assert fake.state_disabled(0, "C2") == "1"

    apply_and_restore(fake, {"cstate": {"disable": ["C2"]}}, applied)
    assert fake.read(f"{CPU}/cpuidle/current_governor") == "haltpoll"


def test_cstate_haltpoll_without_menu_is_skipped_with_reason(tmp_path):
    fake = FakeRoot(tmp_path).add_cpu(0)
    fake.add_cpuidle([("POLL", 0), ("C2", 50)], governor="haltpoll", available="haltpoll")
    plan = build_core(fake.path).tuner.plan(profile(cstate={"disable": ["C2"]}))
    assert plan.writes == []
    assert any("haltpoll" in s.reason for s in plan.skips)


def test_cstate_unknown_state_name_is_skipped_with_the_names_here(fake):
    plan = build_core(fake.path).tuner.plan(profile(cstate={"disable": ["C10"]}))
    assert plan.writes == []
    assert any("C10" in s.reason and "C6" in s.reason for s in plan.skips)


def test_cstate_locked_package_limit_is_not_written(fake):
    fake.add_msr(0, 0xE2, 0x8008)   # bit 15: locked by firmware
    plan = build_core(fake.path).tuner.plan(profile(cstate={"pkg_cstate_limit": 0}))
    assert plan.writes == []
    assert any("locked" in s.reason for s in plan.skips)


def test_cstate_pm_qos_is_held_by_the_process_and_released(fake):
    core = build_core(fake.path)
    core.tuner.switch(profile(cstate={"max_latency_us": 0}))
    assert core.root.pm_qos_held() == 0
    assert fake.pm_qos() == 0                       # the request reached the device
    assert core.tuner.verify().drift == []
    core.tuner.restore()
    assert core.root.pm_qos_held() is None


# -- the core's rules ------------------------------------------------------------------------

def test_noop_writes_are_skipped(fake):
    core = build_core(fake.path)
    first = core.tuner.switch(profile(thp={"enabled": "always"}, epb={"epb": 6}))
    assert [c.key for c in first.changes] == [f"select:{THP}/enabled"]
    assert len(first.unchanged) == 4              # EPB was already 6 on all four CPUs
    second = core.tuner.switch(profile(thp={"enabled": "always"}, epb={"epb": 6}))
    assert second.writes == []


def test_switch_restores_knobs_the_new_profile_no_longer_sets(fake):
    core = build_core(fake.path)
    core.tuner.switch(profile(thp={"enabled": "always"}, epb={"epb": 0}))
    plan = core.tuner.switch(profile(thp={"enabled": "never"}))
    assert {c.key for c in plan.releases} == {f"file:{CPU}/cpu{n}/power/energy_perf_bias"
                                              for n in range(4)}
    assert fake.read(f"{CPU}/cpu0/power/energy_perf_bias") == "6"
    assert fake.read(f"{THP}/enabled") == "never"
    core.tuner.restore()
    assert fake.selected(f"{THP}/enabled") == "madvise"   # the first original, not "always"


def test_verify_reports_drift(fake):
    core = build_core(fake.path)
    core.tuner.switch(profile(epb={"epb": 0}))
    fake.write(f"{CPU}/cpu2/power/energy_perf_bias", "15\n")
    result = core.tuner.verify()
    assert [(d.where.endswith("cpu2/power/energy_perf_bias"), d.wanted, d.actual)
            for d in result.drift] == [(True, "0", "15")]


def test_per_cpu_apply_reaches_a_cpu_that_came_online(fake):
    core = build_core(fake.path)
    core.tuner.switch(profile(epb={"epb": 0}))
    fake.add_cpu(4, epb=6)
    plan = core.tuner.plan(profile(epb={"epb": 0}), cpus=[4])
    assert [c.key for c in plan.changes] == [f"file:{CPU}/cpu4/power/energy_perf_bias"]


def test_journal_records_the_root_it_belongs_to(fake):
    core = build_core(fake.path)
    core.tuner.switch(profile(thp={"enabled": "never"}))
    import json
    assert json.loads(core.journal.path.read_text())["root"] == str(fake.path.resolve())
    assert core.journal.path == fake.path / "run/dsr1d/state.json"


# -- cpufreq (the frequency ceiling) ---------------------------------------------------------

def test_cpufreq_ceiling_round_trip_clamped_to_the_hardware(fake):

    def applied():
        assert [fake.read(f"{CPU}/cpu{c}/cpufreq/scaling_max_freq") for c in range(4)] == \
            ["2800000"] * 4

    apply_and_restore(fake, {"cpufreq": {"max_mhz": 2800}}, applied)

    def clamped():
        assert fake.read(f"{CPU}/cpu0/cpufreq/scaling_max_freq") == "800000"

    apply_and_restore(fake, {"cpufreq": {"max_mhz": 200}}, clamped)


def test_cpufreq_unsupported_without_cpufreq_says_why(tmp_path):
    fake = FakeRoot(tmp_path).add_cpu(0)
    core = build_core(fake.path)
    support = core.tunables["cpufreq"].probe(core.root)
    assert not support.supported and "no cpufreq driver" in support.detail


# -- rapl (PL1), per package -----------------------------------------------------------------

def test_pl1_one_value_caps_every_package_a_list_each(tmp_path):
    fake = FakeRoot(tmp_path).add_cpu(0).add_rapl(205, 0).add_rapl(190, 1)
    zone = "sys/class/powercap/intel-rapl:{}/constraint_0_power_limit_uw"

    def each():
        assert [fake.read(zone.format(p)) for p in (0, 1)] == ["180000000", "150000000"]

    apply_and_restore(fake, {"rapl": {"pl1_w": [180, 150]}}, each)

    def both():
        assert [fake.read(zone.format(p)) for p in (0, 1)] == ["170000000", "170000000"]

    apply_and_restore(fake, {"rapl": {"pl1_w": 170}}, both)
    core = build_core(fake.path)
    skipped = core.tunables["rapl"].apply(core.root, {"pl1_w": [1, 2, 3]})
    assert len(skipped) == 1 and "3 limits for 2 package(s)" in skipped[0].reason
