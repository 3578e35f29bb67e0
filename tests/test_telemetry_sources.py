"""Telemetry sources (the ``register_telemetry_sources`` hook) and the sampler.

turbostat's parser runs on real output published in bug reports and its manual
(tests/fixtures/turbostat/, each naming its source) and on malformed output; its runner runs a
real subprocess: a fake ``turbostat`` shell script first on PATH. RAPL, thermal zones, hwmon,
throttle counters, MSRs, cpufreq and /proc/stat run against small fake roots built here.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from dsr1d.contract.hookspecs import hookimpl
from dsr1d.core.plugin_manager import collect_tunables, make_manager
from dsr1d.plugins.procstat import ProcStat
from dsr1d.plugins.rapl import CVE_NOTE, Rapl
from dsr1d.plugins.thermal import (AperfMperf, CpufreqLimits, CpufreqMhz, Hwmon, MsrThermStatus,
                                   ThermalZones, ThrottleCounters)
from dsr1d.contract.sysroot import SysRoot
from dsr1d.contract.telemetry import Unavailable
from dsr1d.contract.tunable import Support
from dsr1d.core.plugin_manager import PluginError
from dsr1d.core.sampler import Sampler, collect_sources
from dsr1d.plugins.turbostat import SHOW, Turbostat, TurbostatParser, parse_turbostat
from fakeroot import FakeRoot

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "turbostat"
CPU = "sys/devices/system/cpu"
PCAP = "sys/class/powercap"


def fixture(name: str) -> str:
    """A recorded turbostat output, without the comment lines that name its source."""
    text = (FIXTURES / name).read_text()
    assert text.startswith("# Real turbostat output"), f"{name} must name its source"
    return "\n".join(line for line in text.splitlines() if not line.startswith("#")) + "\n"


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(step)


# -- turbostat: the parser on recorded output ----------------------------------------------------


def test_every_fixture_names_its_source() -> None:
    files = sorted(FIXTURES.glob("*.txt"))
    assert len(files) >= 2
    for path in files:
        head = path.read_text().split("\n", 3)
        assert "https://" in "".join(head[:3]), f"{path.name}: no source URL in its header"


def test_parse_intel_netdata_output() -> None:
    [iv] = parse_turbostat(fixture("netdata-pr2704-intel.txt"))
    values = iv.values()
    assert values["busy_mhz"] == 1562.0
    assert values["busy_percent"] == 4.06
    assert values["pkg_temp_c"] == 53.0
    assert values["pkg_power_w"] == 4.98
    assert values["core_temp_c"] == [49.0, 50.0, 47.0]          # one per core, not per thread
    assert values["cpu_mhz"] == [1816.0, 1436.0, 1497.0, 1509.0, 1660.0]  # CPUs 0 1 2 4 5
    # The stray line before the header is kept as garbage, never parsed into a number.
    assert iv.garbage == ["turbostat: cpu3 jitter 26083 8533"]
    # "GFXWattRAMWatt" in the header: two rows carry one value more than it names.
    assert iv.extra_values == 2
    assert "ram_power_w" not in values


def test_parse_amd_output_with_configuration_lines() -> None:
    [iv] = parse_turbostat(fixture("mangohud-1390-amd-7950x.txt"))
    values = iv.values()
    assert values["busy_mhz"] == 4547.0
    assert values["busy_percent"] == 99.65
    assert values["pkg_power_w"] == 152.59
    assert values["core_power_w"] == 100.23
    assert "pkg_temp_c" not in values and "core_temp_c" not in values  # not printed on AMD
    assert len(iv.cpus) == 5
    assert any(line.startswith("CPUID(0): AuthenticAMD") for line in iv.garbage)


def test_parse_manual_periodic_output_two_intervals() -> None:
    first, second = parse_turbostat(fixture("turbostat8-man-periodic.txt"))
    assert first.values()["busy_percent"] == 12.52
    assert second.values()["busy_percent"] == 12.59
    assert second.values()["cpu_mhz"] == [3900.0, 3883.0, 3889.0, 3856.0,
                                          3900.0, 3898.0, 3889.0, 3897.0]
    for iv in (first, second):
        assert len(iv.cpus) == 8 and not iv.garbage
        assert not {"pkg_temp_c", "pkg_power_w", "core_temp_c"} & set(iv.values())


def test_parser_splits_intervals_at_the_summary_row_without_repeated_headers() -> None:
    text = fixture("turbostat8-man-periodic.txt").splitlines()
    header = text[0]
    body = [line for line in text if line != header]
    ivs = parse_turbostat([header, *body])
    assert [iv.values()["busy_percent"] for iv in ivs] == [12.52, 12.59]


# -- turbostat: the parser on malformed output ---------------------------------------------------


@pytest.mark.parametrize("text", [
    "",
    "\n\n",
    "Segmentation fault\n",
    "\x00\x01\x02 binary noise \xff\n",
    "- - 63 4.06 1562\n0 0 73 4.00 1816\n",            # rows without any header
    "turbostat: no /dev/cpu/0/msr, Try \"# modprobe msr\" : No such file or directory\n",
])
def test_parser_invents_nothing_from_garbage(text: str) -> None:
    assert parse_turbostat(text) == []


def test_parser_rejects_rows_with_non_numbers_and_keeps_the_rest() -> None:
    ivs = parse_turbostat(
        "Core\tCPU\tBusy%\tBzy_MHz\tPkgTmp\n"
        "-\t-\t4.06\t15x62\t53\n"          # a corrupted summary row: dropped, not half-parsed
        "0\t0\t4.00\t1816\t53\n"
        "0\t1\t4.00\n")                    # truncated row: what it has is real
    [iv] = ivs
    assert iv.summary is None
    assert iv.garbage == ["-\t-\t4.06\t15x62\t53"]
    values = iv.values()
    assert "busy_mhz" not in values and "busy_percent" not in values
    assert "cpu_mhz" not in values        # CPU 1 has no Bzy_MHz: no list with a hole
    assert values["pkg_temp_c"] == 53.0   # no summary: the package row's own value


def test_parser_dash_means_missing() -> None:
    [iv] = parse_turbostat("Core CPU Busy% Bzy_MHz PkgWatt\n- - - 2000 -\n0 0 5.0 2000 -\n")
    assert iv.values() == {"busy_mhz": 2000.0, "cpu_mhz": [2000.0]}


def test_parser_is_incremental() -> None:
    parser = TurbostatParser()
    lines = fixture("turbostat8-man-periodic.txt").splitlines()
    done = [iv for iv in map(parser.feed, lines) if iv is not None]
    assert len(done) == 1                      # the second ends only at flush (a pause)
    last = parser.flush()
    assert last is not None and last.values()["busy_percent"] == 12.59
    assert parser.flush() is None


# -- turbostat: the runner, with a fake turbostat executable -----------------------------------


def fake_turbostat(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> Path:
    """A ``turbostat`` shell script first on PATH; it logs its argv to ``argv.log``."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    script = bindir / "turbostat"
    script.write_text("#!/bin/sh\n"
                      f"echo \"$*\" >> '{tmp_path}/argv.log'\n"
                      f"n=$(wc -l < '{tmp_path}/argv.log')\n"
                      + textwrap.dedent(body))
    script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ.get('PATH', '/usr/bin:/bin')}")
    return script


@pytest.fixture
def man_fixture(tmp_path: Path) -> Path:
    path = tmp_path / "man.txt"
    path.write_text(fixture("turbostat8-man-periodic.txt"))
    return path


def test_turbostat_missing_binary(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    support = Turbostat().probe(SysRoot("/"))
    assert support == Support(False, "turbostat not found on PATH "
                                      "(Debian/Ubuntu: apt-get install linux-cpupower)")


def test_turbostat_that_exits_at_once_is_unavailable_with_its_message(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_turbostat(tmp_path, monkeypatch, """
        echo 'turbostat: no /dev/cpu/0/msr, Try "# modprobe msr" : No such file or directory' >&2
        exit 1
        """)
    support = Turbostat().probe(SysRoot("/"))
    assert not support.supported
    assert support.detail == ('turbostat exited with status 1: turbostat: no /dev/cpu/0/msr, '
                              'Try "# modprobe msr" : No such file or directory')


def test_turbostat_is_not_run_against_a_fake_root(tmp_path: Path) -> None:
    support = Turbostat().probe(SysRoot(tmp_path))
    assert not support.supported and "measures this machine" in support.detail


def test_turbostat_runner_parses_each_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               man_fixture: Path) -> None:
    fake_turbostat(tmp_path, monkeypatch, f"""
        while :; do cat '{man_fixture}'; sleep 0.2; done
        """)
    source = Turbostat(interval_s=0.5)
    sampler = Sampler(SysRoot("/"), {"turbostat": source})
    try:
        assert sampler.start()["turbostat"].supported
        sample = wait_for(lambda: (s := sampler.sample()).get("busy_mhz") and s)
    finally:
        sampler.stop()
    intervals = [iv.values() for iv in parse_turbostat(man_fixture.read_text())]
    measured = {k: v for k, v in sample.items() if k not in ("time_unix_s", "unavailable")}
    assert measured in intervals                     # one whole interval, nothing mixed in
    assert "turbostat" not in sample["unavailable"]
    argv = (tmp_path / "argv.log").read_text().splitlines()
    assert argv[-1] == f"--quiet --interval 0.5 --show {SHOW}"
    assert source.runner is None


def test_turbostat_that_dies_is_restarted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          man_fixture: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    # run 1 is probe(); run 2 prints one interval and dies; run 3 (the restart) keeps going.
    fake_turbostat(tmp_path, monkeypatch, f"""
        [ "$n" -eq 1 ] && exec sleep 30
        if [ "$n" -eq 2 ]; then
            cat '{man_fixture}'; sleep 0.3
            echo 'turbostat: cpu7: died' >&2; exit 3
        fi
        while :; do cat '{man_fixture}'; sleep 0.2; done
        """)
    source = Turbostat(interval_s=0.5, restart_backoff_s=0.0)
    sampler = Sampler(SysRoot("/"), {"turbostat": source})
    caplog.set_level(logging.WARNING, logger="dsr1d")
    try:
        assert sampler.start()["turbostat"].supported
        dead = wait_for(lambda: "exited" in (s := sampler.sample())["unavailable"]
                        .get("turbostat", "") and s)
        assert dead["unavailable"]["turbostat"] == \
            "turbostat exited with status 3: turbostat: cpu7: died; restarted"
        assert "busy_mhz" not in dead
        back = wait_for(lambda: (s := sampler.sample()).get("busy_mhz") and s)
    finally:
        sampler.stop()
    assert back["busy_mhz"] == 3900.0
    assert source.restarts == 1
    assert caplog.text.count("exited with status 3") == 1   # logged once


def test_turbostat_printing_garbage_gives_no_values(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    fake_turbostat(tmp_path, monkeypatch, """
        while :; do printf 'Segmentation fault\\nCore CPU\\nxx yy zz\\n'; sleep 0.1; done
        """)
    sampler = Sampler(SysRoot("/"), {"turbostat": Turbostat(interval_s=0.2)})
    try:
        assert sampler.start()["turbostat"].supported
        reason = wait_for(lambda: "not its table" in (r := sampler.sample()["unavailable"]
                                                       .get("turbostat", "")) and r)
        sample = sampler.sample()
    finally:
        sampler.stop()
    assert "e.g. 'xx yy zz'" in reason or "e.g. 'Segmentation fault'" in reason
    assert set(sample) == {"time_unix_s", "unavailable"}


@pytest.mark.skipif(shutil.which("turbostat") is None, reason="linux-cpupower not installed")
def test_real_turbostat_probe_says_why_not_or_works() -> None:
    source = Turbostat()
    support = source.probe(SysRoot("/"))
    if not support.supported:  # e.g. here: "turbostat exited with status 1: ... rlimit ..."
        assert support.detail.startswith("turbostat exited with status"), support.detail
        assert ": " in support.detail


# -- RAPL ------------------------------------------------------------------------------------------


def add_rapl(fake: FakeRoot, zone: str, name: str, energy_uj: int,
             max_uj: int = 262143328850) -> FakeRoot:
    fake.write(f"{PCAP}/{zone}/name", f"{name}\n")
    fake.write(f"{PCAP}/{zone}/energy_uj", f"{energy_uj}\n")
    fake.write(f"{PCAP}/{zone}/max_energy_range_uj", f"{max_uj}\n")
    return fake


def set_energy(fake: FakeRoot, zone: str, energy_uj: int) -> None:
    fake.write(f"{PCAP}/{zone}/energy_uj", f"{energy_uj}\n")


@pytest.fixture
def rapl_root(tmp_path: Path) -> FakeRoot:
    fake = FakeRoot(tmp_path / "root")
    add_rapl(fake, "intel-rapl:0", "package-0", 1_000_000)
    add_rapl(fake, "intel-rapl:0:0", "core", 500_000)
    add_rapl(fake, "intel-rapl:0:1", "dram", 100_000)
    add_rapl(fake, "intel-rapl:1", "package-1", 2_000_000)
    return fake


def test_rapl_watts_from_energy_deltas(rapl_root: FakeRoot) -> None:
    root = SysRoot(rapl_root.path)
    rapl = Rapl()
    assert rapl.probe(root).supported
    rapl.start(root)
    assert rapl.read(root, 100.0) == {}                      # primes the counters
    set_energy(rapl_root, "intel-rapl:0", 1_000_000 + 60_000_000)   # 60 J in 2 s
    set_energy(rapl_root, "intel-rapl:0:0", 500_000 + 40_000_000)
    set_energy(rapl_root, "intel-rapl:0:1", 100_000 + 6_000_000)
    set_energy(rapl_root, "intel-rapl:1", 2_000_000 + 50_000_000)
    assert rapl.read(root, 102.0) == {
        "rapl_package_0_w": 30.0, "rapl_package_0_core_w": 20.0,
        "rapl_package_0_dram_w": 3.0, "rapl_package_1_w": 25.0, "pkg_power_w": 55.0,
        "pkg_power_packages_w": [30.0, 25.0], "ram_power_w": 3.0}


def test_rapl_gives_each_packages_power_and_limit_for_per_socket_caps(
        rapl_root: FakeRoot) -> None:
    for zone, uw in (("intel-rapl:0", 180_000_000), ("intel-rapl:1", 150_000_000)):
        rapl_root.write(f"{PCAP}/{zone}/constraint_0_power_limit_uw", f"{uw}\n")
    root = SysRoot(rapl_root.path)
    rapl = Rapl()
    rapl.start(root)
    rapl.read(root, 100.0)
    set_energy(rapl_root, "intel-rapl:0", 1_000_000 + 60_000_000)
    set_energy(rapl_root, "intel-rapl:1", 2_000_000 + 50_000_000)
    got = rapl.read(root, 102.0)
    assert got["pkg_power_packages_w"] == [30.0, 25.0] and got["pkg_power_w"] == 55.0
    assert got["pl1_packages_w"] == [180.0, 150.0] and got["pl1_w"] == 180.0


def test_rapl_reads_package_0s_pl1_back(rapl_root: FakeRoot) -> None:
    rapl_root.write("sys/class/powercap/intel-rapl:0/constraint_0_power_limit_uw", "180500000\n")
    root = SysRoot(rapl_root.path)
    rapl = Rapl()
    rapl.start(root)
    assert rapl.read(root, 100.0) == {"pl1_w": 180.5}       # before any watts: a limit is a read


def test_rapl_counter_wraps_at_max_energy_range(tmp_path: Path) -> None:
    fake = add_rapl(FakeRoot(tmp_path / "root"), "intel-rapl:0", "package-0",
                    energy_uj=990_000_000, max_uj=1_000_000_000)
    root = SysRoot(fake.path)
    rapl = Rapl()
    rapl.start(root)
    rapl.read(root, 10.0)
    set_energy(fake, "intel-rapl:0", 40_000_000)       # 10 J to the top, then 40 J: 50 J in 1 s
    assert rapl.read(root, 11.0) == {"rapl_package_0_w": 50.0, "pkg_power_w": 50.0}


def test_rapl_counter_going_backwards_is_unavailable_for_that_interval(tmp_path: Path) -> None:
    fake = add_rapl(FakeRoot(tmp_path / "root"), "intel-rapl:0", "package-0",
                    energy_uj=500_000_000, max_uj=1_000_000_000)
    root = SysRoot(fake.path)
    sampler = Sampler(root, {"rapl": Rapl()}, clock=iter([1.0, 2.0, 3.0]).__next__)
    sampler.start()
    sampler.sample()
    set_energy(fake, "intel-rapl:0", 499_000_000)      # 1 J back: not a wrap
    back = sampler.sample()
    assert "rapl_package_0_w" not in back and "pkg_power_w" not in back
    assert back["unavailable"]["rapl:package-0"].startswith(
        "intel-rapl:0 energy_uj went backwards (500000000 -> 499000000")
    set_energy(fake, "intel-rapl:0", 519_000_000)      # counts on from the new value
    again = sampler.sample()
    assert again["rapl_package_0_w"] == 20.0 and again["unavailable"] == {}


def test_rapl_root_only_since_cve_2020_8694(tmp_path: Path) -> None:
    """energy_uj readable by root only: a real EACCES, from a subprocess that may not
    override file permissions (root without CAP_DAC_OVERRIDE, via setpriv)."""
    fake = add_rapl(FakeRoot(tmp_path / "root"), "intel-rapl:0", "package-0", 1234)
    energy = fake.path / PCAP / "intel-rapl:0/energy_uj"
    try:
        code = textwrap.dedent(f"""
            from dsr1d.plugins.rapl import Rapl
            from dsr1d.contract.sysroot import SysRoot
            from dsr1d.core.sampler import Sampler
            root = SysRoot({str(fake.path)!r})
            print(Rapl().probe(root).detail)
            print(Sampler(root, {{"rapl": Rapl()}}).sample()["unavailable"]["rapl"])
            """)
        energy.chmod(0)
        argv = [sys.executable, "-c", code]
        if os.geteuid() == 0:
            if shutil.which("setpriv") is None:
                pytest.skip("root without setpriv (util-linux) cannot be denied a read")
            argv = ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--", *argv]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        probe_line, sample_line = proc.stdout.splitlines()
        assert probe_line == f"{energy}: permission denied ({CVE_NOTE})"
        assert sample_line == probe_line
    finally:
        energy.chmod(0o644)


def test_rapl_domain_vanishing_is_unavailable_then_rediscovered(rapl_root: FakeRoot) -> None:
    root = SysRoot(rapl_root.path)
    rapl = Rapl()
    rapl.start(root)
    rapl.read(root, 1.0)
    shutil.rmtree(rapl_root.path / PCAP / "intel-rapl:1")
    out = rapl.read(root, 2.0)
    assert out["unavailable"]["package-1"].startswith("vanished: ")
    assert "pkg_power_w" not in out            # a sum missing a package would be invented
    assert "rapl_package_1_w" not in out
    assert [d.zone for d in rapl.domains] == ["intel-rapl:0", "intel-rapl:0:0", "intel-rapl:0:1"]
    rapl.read(root, 3.0)
    set_energy(rapl_root, "intel-rapl:0", 1_000_000 + 7_000_000)
    assert rapl.read(root, 4.0)["pkg_power_w"] == 7.0


def test_rapl_absent() -> None:
    with tempfile.TemporaryDirectory() as d:
        support = Rapl().probe(SysRoot(d))
    assert not support.supported and "no RAPL domains" in support.detail


# -- thermal zones, hwmon, throttle counters, MSRs, cpufreq ---------------------------------------


def add_cpu(fake: FakeRoot, n: int, core: int, pkg: int = 0, core_count: int | None = None,
            pkg_count: int | None = None, cur_khz: int | None = None) -> None:
    fake.write(f"{CPU}/cpu{n}/topology/core_id", f"{core}\n")
    fake.write(f"{CPU}/cpu{n}/topology/physical_package_id", f"{pkg}\n")
    if core_count is not None:
        fake.write(f"{CPU}/cpu{n}/thermal_throttle/core_throttle_count", f"{core_count}\n")
    if pkg_count is not None:
        fake.write(f"{CPU}/cpu{n}/thermal_throttle/package_throttle_count", f"{pkg_count}\n")
    if cur_khz is not None:
        fake.write(f"{CPU}/cpu{n}/cpufreq/scaling_cur_freq", f"{cur_khz}\n")


def add_hwmon(fake: FakeRoot, n: int, name: str, temps: dict[str, int]) -> None:
    fake.write(f"sys/class/hwmon/hwmon{n}/name", f"{name}\n")
    for i, (label, milli) in enumerate(temps.items(), start=1):
        fake.write(f"sys/class/hwmon/hwmon{n}/temp{i}_input", f"{milli}\n")
        fake.write(f"sys/class/hwmon/hwmon{n}/temp{i}_label", f"{label}\n")


@pytest.fixture
def hot_box(tmp_path: Path) -> FakeRoot:
    """2 cores x 2 threads, one package, coretemp + x86_pkg_temp + acpitz."""
    fake = FakeRoot(tmp_path / "root")
    fake.write(f"{CPU}/online", "0-3\n")
    for cpu, core in ((0, 0), (1, 1), (2, 0), (3, 1)):
        add_cpu(fake, cpu, core, core_count=5 if core == 0 else 7, pkg_count=11,
                cur_khz=2_400_000 + cpu * 100_000)
    fake.write("sys/class/thermal/thermal_zone0/type", "acpitz\n")
    fake.write("sys/class/thermal/thermal_zone0/temp", "27800\n")
    fake.write("sys/class/thermal/thermal_zone1/type", "x86_pkg_temp\n")
    fake.write("sys/class/thermal/thermal_zone1/temp", "71000\n")
    add_hwmon(fake, 0, "acpitz", {"temp1": 27800})
    add_hwmon(fake, 1, "coretemp", {"Package id 0": 72000, "Core 0": 70000, "Core 1": 69000})
    return fake


def test_thermal_zones(hot_box: FakeRoot) -> None:
    root = SysRoot(hot_box.path)
    zones = ThermalZones()
    assert zones.probe(root) == Support(True, "acpitz, x86_pkg_temp")
    zones.start(root)
    assert zones.read(root, 0) == {"thermal_zone_acpitz_c": 27.8,
                                   "thermal_zone_x86_pkg_temp_c": 71.0, "pkg_temp_c": 71.0}


def test_hwmon_coretemp(hot_box: FakeRoot) -> None:
    root = SysRoot(hot_box.path)
    hwmon = Hwmon()
    hwmon.start(root)
    assert hwmon.read(root, 0) == {
        "hwmon_acpitz_temp1_c": 27.8, "hwmon_coretemp_package_id_0_c": 72.0,
        "hwmon_coretemp_core_0_c": 70.0, "hwmon_coretemp_core_1_c": 69.0,
        "pkg_temp_c": 72.0, "core_temp_c": [70.0, 69.0]}


def test_hwmon_k10temp(tmp_path: Path) -> None:
    fake = FakeRoot(tmp_path / "root", vendor="AuthenticAMD")
    add_hwmon(fake, 0, "k10temp", {"Tctl": 61250, "Tccd1": 58000})
    root = SysRoot(fake.path)
    hwmon = Hwmon()
    hwmon.start(root)
    assert hwmon.read(root, 0) == {"hwmon_k10temp_tctl_c": 61.2, "hwmon_k10temp_tccd1_c": 58.0,
                                   "pkg_temp_c": 61.2}


def test_sensor_vanishing_on_hotplug_is_logged_once(hot_box: FakeRoot,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    root = SysRoot(hot_box.path)
    sampler = Sampler(root, {"hwmon": Hwmon()})
    sampler.start()
    assert sampler.sample()["core_temp_c"] == [70.0, 69.0]
    (hot_box.path / "sys/class/hwmon/hwmon1/temp3_input").unlink()   # Core 1 goes away
    caplog.set_level(logging.WARNING, logger="dsr1d")
    gone = sampler.sample()
    assert "hwmon_coretemp_core_1_c" not in gone
    assert gone["unavailable"]["hwmon:coretemp/Core 1"].startswith("vanished: ")
    assert gone["core_temp_c"] == [70.0]
    again = sampler.sample()                    # rediscovered: no longer expected
    assert again["unavailable"] == {} and again["core_temp_c"] == [70.0]
    (hot_box.path / "sys/class/hwmon/hwmon1/temp2_input").unlink()
    (hot_box.path / "sys/class/hwmon/hwmon1/temp2_input").write_text("x\n")
    sampler.sample()
    sampler.sample()
    assert caplog.text.count("Core 1") == 1
    assert caplog.text.count("Core 0") == 1     # the garbage value: logged once, not per sample


def test_throttle_counters_count_each_core_and_package_once(hot_box: FakeRoot) -> None:
    root = SysRoot(hot_box.path)
    throttle = ThrottleCounters()
    assert throttle.probe(root) == Support(True, "2 cores, 1 packages")
    throttle.start(root)
    assert throttle.read(root, 0) == {"throttle_core_count": 12, "throttle_package_count": 11,
                                      "throttle_count": 23, "online_cpus": 4}
    (hot_box.path / CPU / "cpu1/thermal_throttle/core_throttle_count").unlink()
    with pytest.raises(Unavailable, match="vanished"):
        throttle.read(root, 1)                  # a partial sum would look like a decrease
    # rediscovered: cpu3 (core 1's other thread) carries the core count now
    assert throttle.read(root, 2)["throttle_count"] == 23


def write_msr(fake: FakeRoot, cpu: int, reg: int, value: int) -> None:
    path = fake.path / f"dev/cpu/{cpu}/msr/{reg:#x}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(value.to_bytes(8, "little"))


def test_msr_thermal_status_bits(hot_box: FakeRoot) -> None:
    root = SysRoot(hot_box.path)
    src = MsrThermStatus()
    assert not src.probe(root).supported            # no dev/cpu/N/msr yet
    for cpu in range(4):
        write_msr(hot_box, cpu, 0x19C, 0x88450000)  # valid readout, not throttling
        write_msr(hot_box, cpu, 0x1B1, 0x88450000)
    assert src.probe(root).supported
    src.start(root)
    assert src.read(root, 0) == {"throttle_active": False, "prochot_active": False,
                                 "throttle_logged": False}
    write_msr(hot_box, 1, 0x19C, 0x88450007)        # core 1: throttling, logged, PROCHOT
    assert src.read(root, 1) == {"throttle_active": True, "prochot_active": True,
                                 "throttle_logged": True}
    # where they read: what limits the clock (0x64F) and where TCC steps in (0x1A2)
    write_msr(hot_box, 0, 0x64F, 0x0402)            # thermal + PL1
    write_msr(hot_box, 0, 0x1A2, (5 << 24) | (100 << 16))
    got = src.read(root, 2)
    assert (got["limit_reasons"], got["tj_max_c"], got["tcc_offset_c"]) == (0x0402, 100, 5)


def test_aperf_mperf_give_the_busy_clock_of_the_cpus_that_work(hot_box: FakeRoot) -> None:
    root = SysRoot(hot_box.path)
    src = AperfMperf()
    assert "msr" in src.probe(root).detail              # no dev/cpu/N/msr: unsupported

    def counters(seconds: float, busy: dict[int, tuple[float, float]]) -> None:
        # a 2,000 MHz TSC; ``busy`` CPU: (share of the time awake, clock in MHz while awake)
        for cpu in range(4):
            awake, mhz = busy.get(cpu, (0.0, 0.0))
            tsc = int(2_000e6 * seconds)
            write_msr(hot_box, cpu, 0x10, 10**12 + tsc)
            write_msr(hot_box, cpu, 0xE7, 10**11 + int(tsc * awake))
            write_msr(hot_box, cpu, 0xE8, 10**11 + int(mhz * 1e6 * seconds * awake))

    counters(0, {})
    assert src.probe(root).supported
    src.start(root)
    with pytest.raises(Unavailable, match="first reading"):
        src.read(root, 100.0)
    # CPUs 0 and 1 decode at 3,100 MHz; 2 and 3 wake now and then at 800 MHz: they weigh
    # next to nothing, where a plain mean of per-CPU clocks would say 1,950 MHz
    counters(1, {0: (1.0, 3100.0), 1: (1.0, 3100.0), 2: (0.01, 800.0), 3: (0.01, 800.0)})
    got = src.read(root, 101.0)
    assert 3070 < got["busy_mhz"] <= 3100
    assert got["busy_percent"] == pytest.approx(50.5, abs=0.01)
    assert got["cpu_mhz"] == [3100.0, 3100.0, 800.0, 800.0]
    counters(0.5, {0: (1.0, 3100.0)})                  # the counters went back: a reset
    with pytest.raises(Unavailable, match="went back"):
        src.read(root, 102.0)


def test_without_a_busy_clock_idle_cpus_do_not_dilute_cpufreq_mhz() -> None:
    from dsr1d.core.mitigator import busy_mhz

    two_busy = {"cpu_mhz": [3100.0, 3100.0, 800.0, 800.0],
                "cpu_util_percent": [100.0, 100.0, 0.5, 0.5]}
    assert busy_mhz(two_busy) == pytest.approx(3088.6, abs=0.1)
    assert busy_mhz({**two_busy, "busy_mhz": 2900.0}) == 2900.0      # a measured one wins
    assert busy_mhz({"cpu_mhz": [3000.0, 1000.0]}) == 2000.0          # no utilisation: a mean
    assert busy_mhz({}) is None


def test_throttle_time_and_a_cpu_coming_online_rediscovers(hot_box: FakeRoot) -> None:
    root = SysRoot(hot_box.path)
    for cpu, ms in ((0, 120), (1, 340)):
        hot_box.write(f"{CPU}/cpu{cpu}/thermal_throttle/core_throttle_total_time_ms", f"{ms}\n")
    throttle = ThrottleCounters()
    throttle.start(root)
    assert throttle.read(root, 0)["throttle_ms"] == 340        # the most throttled core
    add_cpu(hot_box, 4, 2, core_count=5000, pkg_count=11, cur_khz=2_400_000)
    hot_box.write(f"{CPU}/online", "0-4\n")                   # boot-time counts come with it
    got = throttle.read(root, 1)
    assert got["online_cpus"] == 5 and got["throttle_core_count"] == 5012


def test_cpufreq_limits_give_the_range_and_the_lowest_ceiling(hot_box: FakeRoot) -> None:
    root = SysRoot(hot_box.path)
    for cpu in range(4):
        hot_box.write(f"{CPU}/cpu{cpu}/cpufreq/cpuinfo_max_freq", "3800000\n")
        hot_box.write(f"{CPU}/cpu{cpu}/cpufreq/cpuinfo_min_freq", "800000\n")
        hot_box.write(f"{CPU}/cpu{cpu}/cpufreq/scaling_max_freq",
                      "2800000\n" if cpu == 2 else "3800000\n")
    src = CpufreqLimits()
    assert src.probe(root).supported
    src.start(root)
    assert src.read(root, 0) == {"ceiling_mhz": 2800.0, "cpu_max_mhz": 3800.0,
                                 "cpu_min_mhz": 800.0}


def test_msr_thermal_status_is_intel_only(tmp_path: Path) -> None:
    fake = FakeRoot(tmp_path / "root", vendor="AuthenticAMD")
    support = MsrThermStatus().probe(SysRoot(fake.path))
    assert not support.supported and "Intel" in support.detail


def test_cpufreq_mhz(hot_box: FakeRoot) -> None:
    root = SysRoot(hot_box.path)
    src = CpufreqMhz()
    src.start(root)
    assert src.read(root, 0) == {"cpu_mhz": [2400.0, 2500.0, 2600.0, 2700.0],
                                 "cpu_mhz_avg": 2550.0}


# -- /proc/stat ------------------------------------------------------------------------------------


def proc_stat(fake: FakeRoot, rows: dict[str, tuple[int, int]]) -> None:
    """rows: name -> (busy jiffies in user, idle jiffies)."""
    lines = [f"{name} {busy} 0 0 {idle} 0 0 0 0 0 0" for name, (busy, idle) in rows.items()]
    fake.write("proc/stat", "\n".join(lines) + "\nintr 1 2 3\nctxt 99\n")


def test_procstat_utilisation_and_load(tmp_path: Path) -> None:
    fake = FakeRoot(tmp_path / "root")
    fake.write("proc/loadavg", "1.50 0.75 0.25 2/345 6789\n")
    fake.write("proc/meminfo", "MemTotal: 1000 kB\nMemAvailable: 512 kB\n")
    proc_stat(fake, {"cpu": (100, 100), "cpu0": (50, 50), "cpu1": (50, 50)})
    root = SysRoot(fake.path)
    src = ProcStat()
    src.start(root)
    first = src.read(root, 0)
    assert first == {"load_1m": 1.5, "load_5m": 0.75, "load_15m": 0.25,
                     "memory_available_bytes": 512 * 1024}
    proc_stat(fake, {"cpu": (250, 150), "cpu0": (140, 60), "cpu1": (110, 90)})
    second = src.read(root, 1)
    assert second["util_percent"] == 75.0
    assert second["cpu_util_percent"] == [90.0, 60.0]


# -- the sampler and the hook ----------------------------------------------------------------------


class _Fixed:
    def __init__(self, name: str, values: dict[str, Any], priority: int = 100) -> None:
        self.name, self.values, self.priority = name, values, priority

    def probe(self, root: SysRoot) -> Support:
        return Support(True, "here")

    def read(self, root: SysRoot, now: float) -> dict[str, Any]:
        return dict(self.values)


class _Broken(_Fixed):
    def read(self, root: SysRoot, now: float) -> dict[str, Any]:
        raise ZeroDivisionError("plugin bug")


class _Absent(_Fixed):
    def probe(self, root: SysRoot) -> Support:
        return Support(False, "no such sensor here")


class _Registers:
    def __init__(self, *sources: Any) -> None:
        self.sources = sources

    @hookimpl
    def register_telemetry_sources(self, register: Any) -> None:
        for source in self.sources:
            register(source)


def test_sampler_merges_by_priority_and_contains_faults(tmp_path: Path,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    sources = {
        "measured": _Fixed("measured", {"cpu_mhz": [3900.0]}, priority=10),
        "requested": _Fixed("requested", {"cpu_mhz": [2400.0], "cpu_mhz_avg": 2400.0}, 70),
        "broken": _Broken("broken", {}),
        "absent": _Absent("absent", {}),
    }
    sampler = Sampler(SysRoot(tmp_path), sources, clock=lambda: 42.0)
    caplog.set_level(logging.INFO, logger="dsr1d")
    sampler.start()
    first = sampler.sample()
    sampler.sample()
    assert first == {"time_unix_s": 42.0, "cpu_mhz": [3900.0], "cpu_mhz_avg": 2400.0,
                     "unavailable": {"broken": "read failed: ZeroDivisionError: plugin bug",
                                     "absent": "no such sensor here"}}
    assert sampler.provenance == {"cpu_mhz": "measured", "cpu_mhz_avg": "requested"}
    assert caplog.text.count("ZeroDivisionError: plugin bug") == 1
    assert caplog.text.count("no such sensor here") == 1


def test_a_fallback_is_not_read_while_a_preferred_source_gives_its_keys(tmp_path: Path) -> None:
    fallback = _Broken("cpufreq", {})
    fallback.provides = frozenset({"cpu_mhz"})
    sampler = Sampler(SysRoot(tmp_path), {"turbostat": _Fixed("turbostat", {"cpu_mhz": [1.0]}, 10),
                                          "cpufreq": fallback})
    sampler.start()
    assert sampler.sample()["unavailable"] == {}      # _Broken.read() was never called
    sampler.sources["turbostat"].values = {}
    assert sampler.sample()["unavailable"] == {
        "cpufreq": "read failed: ZeroDivisionError: plugin bug"}


def test_collect_sources_rejects_bad_sources() -> None:
    pm = make_manager()
    pm.register(_Registers(_Fixed("procstat", {})))
    with pytest.raises(PluginError, match="two plugins register a telemetry source named "
                                          "'procstat'"):
        collect_sources(pm)
    pm = make_manager()
    pm.register(_Registers(object()))
    with pytest.raises(PluginError, match="has no name"):
        collect_sources(pm)


def test_builtin_sources_and_unchanged_tunables() -> None:
    pm = make_manager()
    assert list(collect_tunables(pm)) == ["cpufreq", "cstate", "epb", "prefetcher", "rapl", "thp",
                                         "turbo", "uncore"]
    assert list(collect_sources(pm)) == ["turbostat", "rapl", "hwmon", "aperf",
                                         "thermal_zones", "throttle", "msr_throttle", "cpufreq",
                                         "cpufreq_limits", "uncore_limits", "procstat"]


def test_register_telemetry_sources_from_a_third_party_plugin(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module named in DSR1D_PLUGINS implements register_telemetry_sources; the sampler
    shows what it measures."""
    (tmp_path / "gpu_probe.py").write_text(textwrap.dedent("""
        from dsr1d.contract.hookspecs import hookimpl
        from dsr1d.contract.tunable import Support

        class Fan:
            name = "fan"
            def probe(self, root):
                return Support(root.exists("sys/fan/rpm"), "sys/fan/rpm")
            def read(self, root, now):
                return {"fan_rpm": int(root.read("sys/fan/rpm"))}

        @hookimpl
        def register_telemetry_sources(register):
            register(Fan())
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("DSR1D_PLUGINS", "gpu_probe")
    fake = FakeRoot(tmp_path / "root").write("sys/fan/rpm", "1200\n")
    sampler = Sampler.from_manager(make_manager(), fake.path)
    try:
        sampler.start()
        sample = sampler.sample()
    finally:
        sampler.stop()
    assert sample["fan_rpm"] == 1200
    assert sampler.provenance["fan_rpm"] == "fan"
    assert "fan" not in sample["unavailable"]
    assert "turbostat" in sample["unavailable"]          # a fake root: never the real turbostat
    sys.modules.pop("gpu_probe", None)


def test_rapl_reports_no_dram_total_when_a_dram_domain_is_unreadable(
        rapl_root: FakeRoot) -> None:
    add_rapl(rapl_root, "intel-rapl:1:0", "dram", 0)
    root = SysRoot(rapl_root.path)
    rapl = Rapl()
    rapl.start(root)
    rapl.read(root, 100.0)
    set_energy(rapl_root, "intel-rapl:0:1", 100_000 + 6_000_000)
    set_energy(rapl_root, "intel-rapl:1:0", 4_000_000)
    both = rapl.read(root, 102.0)
    assert both["ram_power_w"] == 5.0                        # 3 W + 2 W
    rapl_root.write(f"{PCAP}/intel-rapl:1:0/energy_uj", "garbage\n")
    one = rapl.read(root, 104.0)
    assert "ram_power_w" not in one                          # half the DRAM is no total
