"""The real ``dsr1d`` command line, run as a subprocess against fake roots.

Every command gets ``--root`` so nothing here touches this machine's knobs. Note that a fake
root is plain files: a select-style knob (THP ``enabled``) reads back as the word written, not
with brackets, and the fake ``dev/cpu_dma_latency`` keeps the last request written to it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from conftest import REPO, run_dsr1d
from fakeroot import CPU, THP, FakeRoot, intel_box

BUILTINS = ("balanced", "efficient", "latency", "powersave", "sustained", "throughput")
JOURNAL = "run/dsr1d/state.json"
PM_QOS_NOTE = "PM QoS latency request (cstate max_latency_us)"


def dsr1d(root: FakeRoot | Path, *args: str, **kwargs):
    return run_dsr1d(*args, "--root", str(root), **kwargs)


def snapshot(root: FakeRoot) -> dict[str, bytes]:
    """Every file under the root and its bytes."""
    return {str(p.relative_to(root.path)): p.read_bytes()
            for p in sorted(root.path.rglob("*")) if p.is_file()}


def values(files: dict[str, bytes]) -> dict[str, bytes]:
    """A snapshot as the kernel would show it: text knobs without their trailing newline.

    dsr1d writes ``6``, not ``6\\n``; sysfs would show both the same. Binary files under
    dev/ (MSRs) are compared byte for byte.
    """
    return {rel: data if rel.startswith("dev/") else data.strip() for rel, data in files.items()}


def select_value(root: FakeRoot, rel: str) -> str:
    """A select-style knob as the kernel reports it: the bracketed word, or the word written."""
    text = root.read(rel)
    match = re.search(r"\[([^\]]+)\]", text)
    return match.group(1) if match else text


def table(stdout: str) -> dict[str, list[str]]:
    """Rows of a ``render`` table by first column (columns are two or more spaces apart); the
    table ends at the first blank line."""
    lines = stdout.split("\n\n")[0].splitlines()
    return {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[1:])}


def user_profile(root: FakeRoot, name: str, text: str) -> Path:
    path = root.path / "etc/dsr1d/profiles" / f"{name}.conf"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def bare(tmp_path: Path) -> FakeRoot:
    """An AMD machine with nothing but one CPU and transparent hugepages."""
    return FakeRoot(tmp_path / "bare", vendor="AuthenticAMD", flags="fpu").add_cpu(0).add_thp()


@pytest.fixture
def box(tmp_path: Path) -> FakeRoot:
    """An Intel server whose knobs all differ from what ``throughput`` wants."""
    fake = intel_box(tmp_path / "intel")
    for cpu in fake.cpus:
        fake.add_msr(cpu, 0x1A4, 0xF0F)  # every prefetcher off, plus unrelated high bits
    fake.write(f"{CPU}/cpuidle/current_governor", "haltpoll\n")
    return fake


# -- probe -------------------------------------------------------------------------------------


def test_probe_intel(fake: FakeRoot) -> None:
    proc = dsr1d(fake, "probe", check=True)
    rows = table(proc.stdout)
    assert proc.stdout.splitlines()[0].split() == ["TUNABLE", "SUPPORTED", "CURRENT", "DETAIL"]
    assert list(rows) == ["cpufreq", "cstate", "epb", "prefetcher", "rapl", "thp", "turbo",
                          "uncore"]
    assert all(row[1] == "yes" for row in rows.values())
    assert rows["epb"][2:] == ["epb=6 epp=balance_performance",
                               "EPB via sysfs on 4/4 CPUs; EPP on 4/4 CPUs"]
    assert rows["prefetcher"][2:] == ["l2_streamer=on l2_adjacent=on dcu_streamer=on dcu_ip=on",
                                      "Intel MSR 0x1A4 on every online CPU"]
    assert rows["thp"][2] == "enabled=madvise defrag=madvise khugepaged_defrag=1"
    assert rows["cstate"][3] == ("PM QoS via /dev/cpu_dma_latency; 4 idle states (POLL, C1, C1E, "
                                 "C6), governor menu; package C-state limit via MSR 0xE2")


def test_probe_says_what_the_llama_cpp_build_uses_and_where_threads_go(fake: FakeRoot) -> None:
    lines = dsr1d(fake, "probe", check=True).stdout.split("\n\n")[1].splitlines()
    # the engine: the llama-server set-up built, and its version line
    assert lines[0].startswith("engine: /") and "llama-server (version: " in lines[0], lines
    assert lines[1].startswith("reference binding: llama.cpp 0.3.") and "AVX" in lines[1], lines
    # the set-up builds with every patch in tools/llama-patches/, and the marker names them
    shipped = sorted(p.stem for p in (REPO / "tools" / "llama-patches").glob("*.patch"))
    assert "amx-tile-config" in shipped and "build-marker" in shipped
    assert lines[2] == "patches: " + ", ".join(shipped), lines
    # the fake box: 4 CPUs without SMT lists, all within this process's affinity or not
    assert lines[3].startswith("placement: "), lines


def test_probe_bare_amd_says_why_not(bare: FakeRoot) -> None:
    proc = dsr1d(bare, "probe", check=True)
    rows = table(proc.stdout)
    root = bare.path.resolve()
    assert list(rows) == ["cpufreq", "cstate", "epb", "prefetcher", "rapl", "thp", "turbo",
                          "uncore"]
    assert {name: row[1] for name, row in rows.items()} == {"cpufreq": "no",
        "cstate": "no", "epb": "no", "prefetcher": "no", "rapl": "no", "thp": "yes", "turbo": "no",
        "uncore": "no"}
    assert rows["prefetcher"][2:] == [
        "-", "AuthenticAMD CPU: only Intel's MSR 0x1A4 is supported; other vendors' prefetch "
             "controls are not verified"]
    assert rows["epb"][2:] == [
        "-", f"no {root}/{CPU}/cpu0/power/energy_perf_bias; the CPU does not report the 'epb' "
             "flag; no cpufreq energy_performance_preference"]
    assert rows["cstate"][2:] == [
        "-", "no cpuidle states (driver: absent); package C-state limit: Intel only (MSR 0xE2)"]
    assert rows["thp"][2:] == ["enabled=madvise defrag=madvise khugepaged_defrag=1",
                               f"{root}/{THP}"]


def test_probe_intel_without_msr_module(tmp_path: Path) -> None:
    fake = FakeRoot(tmp_path / "r").add_cpu(0).add_cpu(1)
    rows = table(dsr1d(fake, "probe", check=True).stdout)
    root = fake.path.resolve()
    assert rows["prefetcher"][1:] == ["no", "-",
                                      f"no {root}/dev/cpu/0/msr (load the msr module: modprobe msr)"]
    assert rows["epb"][3] == (f"no {root}/{CPU}/cpu0/power/energy_perf_bias; no {root}/dev/cpu/0/msr "
                              "(msr module not loaded); no cpufreq energy_performance_preference")
    assert rows["thp"][1:] == ["no", "-", f"{root}/{THP} is missing (kernel built without "
                                          "CONFIG_TRANSPARENT_HUGEPAGE)"]


# -- list --------------------------------------------------------------------------------------


def active_rows(stdout: str) -> list[str]:
    return [line.split()[1] for line in stdout.splitlines()[1:] if line.startswith("*")]


def test_list_shows_builtins_and_marks_the_active_one(fake: FakeRoot) -> None:
    before = dsr1d(fake, "list", check=True)
    names = [line.split()[0] for line in before.stdout.splitlines()[1:]]
    assert names == list(BUILTINS)
    assert active_rows(before.stdout) == []
    assert "sustained throughput within thermal limits" in before.stdout
    dsr1d(fake, "apply", "balanced", check=True)
    after = dsr1d(fake, "list", check=True)
    assert active_rows(after.stdout) == ["balanced"]
    dsr1d(fake, "apply", "powersave", check=True)
    assert active_rows(dsr1d(fake, "list", check=True).stdout) == ["powersave"]


def test_list_reports_broken_user_profiles_and_lists_the_rest(fake: FakeRoot) -> None:
    path = user_profile(fake, "broken", "[main]\nsummary = broken\n[thp]\nenabled = sometimes\n")
    user_profile(fake, "mine", "[main]\nsummary = my own\n")
    proc = dsr1d(fake, "list", check=True)
    names = [line.split()[0] for line in proc.stdout.splitlines()[1:]]
    assert names == sorted((*BUILTINS, "mine"))
    assert f"skipped broken profile: {path.resolve()}:4: [thp] enabled:" in proc.stderr


# -- apply -------------------------------------------------------------------------------------


def test_dry_run_changes_no_file(box: FakeRoot) -> None:
    before = snapshot(box)
    proc = dsr1d(box, "apply", "throughput", "--dry-run", check=True)
    assert proc.stdout.startswith("dry run: applying throughput would make ")
    assert "would set" in proc.stdout
    assert snapshot(box) == before
    assert not (box.path / JOURNAL).exists()


def test_apply_changes_the_knobs(box: FakeRoot) -> None:
    proc = dsr1d(box, "apply", "throughput", check=True)
    assert re.match(r"applied throughput: [1-9]\d* write\(s\)", proc.stdout)
    assert select_value(box, f"{THP}/enabled") == "always"
    assert select_value(box, f"{THP}/defrag") == "defer+madvise"
    assert box.read(f"{THP}/khugepaged/defrag") == "1"
    for cpu in box.cpus:
        assert box.read(f"{CPU}/cpu{cpu}/power/energy_perf_bias") == "0"
        assert box.read(f"{CPU}/cpu{cpu}/cpufreq/energy_performance_preference") == "performance"
        assert box.msr(cpu, 0x1A4) == 0xF00  # prefetchers on, other bits untouched
        # exit latency > 2 µs: C1E (10) and C6 (170) off, POLL and C1 stay
        assert [box.state_disabled(cpu, s) for s in ("POLL", "C1", "C1E", "C6")] == [
            "0", "0", "1", "1"]
    # haltpoll ignores per-state disable, so the governor is switched with them
    assert box.read(f"{CPU}/cpuidle/current_governor") == "menu"
    assert box.msr(0, 0xE2) == 0x8  # the profile sets no package C-state limit
    assert (box.path / JOURNAL).is_file()


def test_apply_epb_through_the_msr_fallback(tmp_path: Path) -> None:
    fake = FakeRoot(tmp_path / "r")
    for cpu in (0, 1):
        fake.add_cpu(cpu).add_msr(cpu, 0x1B0, 0x36)  # EPB 6 in bits 3:0, other bits set
    assert "EPB via MSR 0x1B0 on 2/2 CPUs" in dsr1d(fake, "probe", check=True).stdout
    dsr1d(fake, "apply", "sustained", check=True)  # balance-performance = 4
    assert [fake.msr(cpu, 0x1B0) for cpu in (0, 1)] == [0x34, 0x34]
    dsr1d(fake, "restore", check=True)
    assert [fake.msr(cpu, 0x1B0) for cpu in (0, 1)] == [0x36, 0x36]


def test_apply_on_a_bare_machine_skips_what_is_unsupported(bare: FakeRoot) -> None:
    proc = dsr1d(bare, "apply", "throughput", check=True)
    assert "applied throughput: 2 write(s)" in proc.stdout
    for name in ("cstate", "epb", "prefetcher"):
        assert re.search(rf"^\s+{name}\s+skipped: unsupported here: ", proc.stdout, re.M), name
    assert select_value(bare, f"{THP}/enabled") == "always"


@pytest.mark.parametrize("profile", ["balanced", "powersave"])
def test_second_apply_writes_nothing(fake: FakeRoot, profile: str) -> None:
    first = dsr1d(fake, "apply", profile, check=True)
    assert not first.stdout.startswith(f"applied {profile}: 0 write(s)")
    after_first = snapshot(fake)
    second = dsr1d(fake, "apply", profile, check=True)
    assert second.stdout.splitlines()[0] == f"applied {profile}: 0 write(s)"
    assert "knob(s) already as wanted" in second.stdout
    assert snapshot(fake) == after_first


def test_pm_qos_note_on_stderr(fake: FakeRoot) -> None:
    proc = dsr1d(fake, "apply", "latency", check=True)
    assert PM_QOS_NOTE in proc.stderr
    assert "dsr1d run" in proc.stderr
    quiet = dsr1d(fake, "apply", "powersave", check=True)
    assert PM_QOS_NOTE not in quiet.stderr


# -- verify ------------------------------------------------------------------------------------


def test_verify_without_a_journal(fake: FakeRoot) -> None:
    proc = dsr1d(fake, "verify")
    assert (proc.returncode, proc.stdout.strip()) == (0, "no profile applied (no journal)")


def test_verify_clean_then_drift(fake: FakeRoot) -> None:
    dsr1d(fake, "apply", "powersave", check=True)
    clean = dsr1d(fake, "verify")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert clean.stdout.strip() == "powersave: every knob holds its value"

    fake.write(f"{CPU}/cpu2/power/energy_perf_bias", "6\n")  # behind dsr1d's back
    drift = dsr1d(fake, "verify")
    assert drift.returncode == 1
    assert drift.stdout.splitlines()[0] == "powersave: 1 knob(s) drifted"
    rows = table("\n".join(drift.stdout.splitlines()[1:]))
    where = f"{fake.path.resolve()}/{CPU}/cpu2/power/energy_perf_bias"
    assert rows["epb"] == ["epb", where, "15", "6"]


def test_verify_after_a_pm_qos_profile_notes_the_dead_holder(fake: FakeRoot) -> None:
    dsr1d(fake, "apply", "latency", check=True)
    fake.add_pm_qos()  # the fake device forgets the request, as the kernel does on exit
    proc = dsr1d(fake, "verify")
    assert proc.returncode == 0, proc.stdout
    assert re.search(r"^note: cstate: .*cpu_dma_latency 0: the request ended with process \d+",
                     proc.stdout, re.M)


# -- restore -----------------------------------------------------------------------------------


def test_restore_puts_everything_back(box: FakeRoot) -> None:
    select_files = (f"{THP}/enabled", f"{THP}/defrag")
    before = snapshot(box)
    selected = {rel: select_value(box, rel) for rel in select_files}
    dsr1d(box, "apply", "throughput", check=True)
    dsr1d(box, "apply", "balanced", check=True)  # a switch in between
    assert active_rows(dsr1d(box, "list", check=True).stdout) == ["balanced"]

    proc = dsr1d(box, "restore", check=True)
    assert re.search(r"^restored \d+ knob\(s\)$", proc.stdout, re.M)
    assert not (box.path / JOURNAL).exists()
    after = snapshot(box)
    # The fake PM QoS device keeps the last request written (the kernel would drop it).
    ignore = {*select_files, "dev/cpu_dma_latency"}
    assert {k: v for k, v in values(after).items() if k not in ignore} == \
           {k: v for k, v in values(before).items() if k not in ignore}
    assert {rel: select_value(box, rel) for rel in select_files} == selected
    assert box.read(f"{CPU}/cpuidle/current_governor") == "haltpoll"
    assert box.msr(3, 0x1A4) == 0xF0F

    again = dsr1d(box, "restore", check=True)
    assert again.stdout.strip() == "nothing to restore"
    assert active_rows(dsr1d(box, "list", check=True).stdout) == []


# -- bad input ---------------------------------------------------------------------------------


def test_unknown_profile_exits_2_and_lists_the_available(fake: FakeRoot) -> None:
    before = snapshot(fake)
    proc = dsr1d(fake, "apply", "nosuch")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"dsr1d: unknown profile 'nosuch'; available: {', '.join(BUILTINS)}"
    assert "Traceback" not in proc.stderr
    assert snapshot(fake) == before


def test_malformed_user_profile_exits_2_with_file_and_line(fake: FakeRoot) -> None:
    path = user_profile(fake, "broken", "# mine\n[main]\ninclude = balanced\n[thp]\nenabled\n")
    before = snapshot(fake)
    proc = dsr1d(fake, "apply", "broken")
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"dsr1d: {path.resolve()}:5: expected 'key = value'")
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""
    assert snapshot(fake) == before


def test_malformed_profile_keeps_the_active_one(fake: FakeRoot) -> None:
    dsr1d(fake, "apply", "powersave", check=True)
    path = user_profile(fake, "broken", "[main]\n[prefetcher]\nl2_streamer = maybe\n")
    before = snapshot(fake)
    proc = dsr1d(fake, "apply", "broken")
    assert proc.returncode == 2
    assert f"{path.resolve()}:3: [prefetcher] l2_streamer: 'maybe'" in proc.stderr
    assert snapshot(fake) == before
    assert active_rows(dsr1d(fake, "list", check=True).stdout) == ["powersave"]


def test_profiles_dir_option(fake: FakeRoot, tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "quiet.conf").write_text("[main]\nsummary = quiet hugepages\ninclude = balanced\n"
                                     "[thp]\nenabled = never\n")
    (mine / "latency.conf").write_text("[main]\nsummary = my latency\n")
    listed = run_dsr1d("list", "--root", str(fake), "--profiles-dir", str(mine), check=True)
    assert "quiet hugepages" in listed.stdout
    assert "my latency" in listed.stdout
    assert "lowest latency" not in listed.stdout
    # without the option the directory is not read
    assert "quiet" not in dsr1d(fake, "list", check=True).stdout
    assert dsr1d(fake, "apply", "quiet").returncode == 2

    run_dsr1d("apply", "quiet", "--root", str(fake), "--profiles-dir", str(mine), check=True)
    assert select_value(fake, f"{THP}/enabled") == "never"
    assert fake.read(f"{CPU}/cpu0/power/energy_perf_bias") == "6"  # balanced: normal
    assert fake.read(f"{CPU}/cpuidle/current_governor") == "menu"


# -- plugin tracing ----------------------------------------------------------------------------


def test_trace_plugins_shows_hook_calls(fake: FakeRoot) -> None:
    proc = dsr1d(fake, "apply", "powersave", env={"DSR1D_TRACE_PLUGINS": "1"}, check=True)
    trace = [line for line in proc.stderr.splitlines() if line.startswith("dsr1d trace: ")]
    assert trace[0].startswith("dsr1d trace: register_tunables(register=")
    assert "dsr1d.plugins.thp" in trace[0]
    writes = [line for line in trace if line.startswith("dsr1d trace: before_write(")]
    assert writes[0].startswith("dsr1d trace: before_write(target='journal'")
    assert ("dsr1d trace: before_write(target='knob', key='select:sys/kernel/mm/"
            "transparent_hugepage/defrag', value='defer') -> []") in writes
    quiet = dsr1d(fake, "apply", "balanced", check=True)
    assert "dsr1d trace:" not in quiet.stderr


def test_read_commands_speak_json(fake: FakeRoot) -> None:
    import json

    probe = json.loads(dsr1d(fake, "probe", "--json", check=True).stdout)
    assert {t["name"] for t in probe["tunables"]} >= {"epb", "thp", "cstate", "prefetcher"}
    assert probe["engine"][0].startswith("engine: ")
    listed = json.loads(dsr1d(fake, "list", "--json", check=True).stdout)
    assert "sustained" in {p["name"] for p in listed}
    assert json.loads(dsr1d(fake, "verify", "--json", check=True).stdout)["profile"] is None
    # before the command too, as dsr1ctl takes it
    assert json.loads(dsr1d(fake, "--json", "list", check=True).stdout) == listed
