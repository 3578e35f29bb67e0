"""``dsr1ctl`` (``python -m dsr1d.client.cli``) against the real daemon on a private system-like bus.

Exit statuses (cli.py): 0 done; 1 the daemon could not do it / drift; 2 bad input (unknown
profile); 3 the daemon is not reachable; 4 access denied. ``hold`` exits with its command's.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("daemon_fixtures")
from daemon_fixtures import (BUILTINS, BUS_NAME, EPB, MANAGER, PATH, SUSTAINED_EPB,  # noqa: E402
                             active, dsr1ctl, eventually, knobs, prop)

pytest_plugins = ["daemon_fixtures"]


def rows(stdout: str) -> dict[str, list[str]]:
    """Rows of a table (cells two or more spaces apart), by their first non-marker cell."""
    out = {}
    for line in stdout.splitlines():
        cells = [c for c in re.split(r"\s{2,}", line.strip()) if c]
        if cells:
            key = cells[1] if cells[0] == "*" and len(cells) > 1 else cells[0]
            out[key] = cells
    return out


def test_status(daemon, bus):
    proc = dsr1ctl(bus, "status")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert re.search(r"^profile:\s+sustained$", out, re.M), out
    assert re.search(r"^holds:\s+none$", out, re.M), out
    assert re.search(r"^throttle:\s+none$", out, re.M), out
    assert re.search(r"^telemetry:\s+load \d", out, re.M), out
    assert re.search(rf"^version:\s+{re.escape(prop(bus, 'Version'))}$", out, re.M), out
    table = rows(out)
    for tunable in ("cpufreq", "cstate", "epb", "prefetcher", "rapl", "thp", "turbo"):
        assert table[tunable][1] == "yes", out

    watched = dsr1ctl(bus, "watch", "--count", "2", "--interval", "0.05")
    assert watched.returncode == 0, watched.stderr
    lines = watched.stdout.splitlines()
    assert len(lines) == 2 and all("profile sustained" in ln for ln in lines), lines


def test_status_as_nobody(daemon, bus):
    proc = dsr1ctl(bus, "status", nobody=True)
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^profile:\s+sustained$", proc.stdout, re.M)


def test_list_marks_the_active_profile(daemon, bus):
    proc = dsr1ctl(bus, "list")
    assert proc.returncode == 0, proc.stderr
    table = rows(proc.stdout)
    assert set(BUILTINS) <= set(table)
    marked = [name for name, cells in table.items() if cells[0] == "*"]
    assert marked == ["sustained"]


def test_profile_switches(daemon, bus, fake):
    proc = dsr1ctl(bus, "profile", "throughput")
    assert proc.returncode == 0, proc.stderr
    assert "throughput" in proc.stdout
    assert active(bus) == "throughput"
    assert [fake.read(EPB.format(cpu)) for cpu in range(4)] == ["0"] * 4
    listed = dsr1ctl(bus, "list")
    assert [n for n, cells in rows(listed.stdout).items() if cells[0] == "*"] == ["throughput"]


def test_unknown_profile_exits_2(daemon, bus, fake):
    before = knobs(fake)
    proc = dsr1ctl(bus, "profile", "warp-speed")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "warp-speed" in proc.stderr
    for name in BUILTINS:
        assert name in proc.stderr
    assert active(bus) == "sustained"
    assert knobs(fake) == before


def test_verify_exits_0_then_1_on_drift(daemon, bus, fake):
    clean = dsr1ctl(bus, "verify")
    assert clean.returncode == 0, clean.stderr
    assert "every knob holds its value" in clean.stdout

    fake.write(EPB.format(2), "9\n")  # behind the daemon's back
    drifted = dsr1ctl(bus, "verify")
    assert drifted.returncode == 1, (drifted.stdout, drifted.stderr)
    assert "1 knob(s) drifted" in drifted.stdout
    line = next(ln for ln in drifted.stdout.splitlines() if "cpu2/power/energy_perf_bias" in ln)
    assert re.search(rf"\s{SUSTAINED_EPB}\s+9$", line), line


def test_not_running_exits_3(bus):
    proc = dsr1ctl(bus, "status")
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "dsr1d is not running" in proc.stderr


def test_no_bus_exits_3(bus, tmp_path):
    proc = dsr1ctl(bus, "status", address=f"unix:path={tmp_path}/no-such-socket")
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "cannot reach the bus" in proc.stderr


@pytest.mark.parametrize("args", [("profile", "throughput"), ("hold", "throughput", "--", "true")],
                         ids=["profile", "hold"])
def test_nobody_is_denied_with_4(daemon, bus, fake, args):
    before = knobs(fake)
    proc = dsr1ctl(bus, *args, nobody=True)
    assert proc.returncode == 4, (proc.stdout, proc.stderr)
    assert "access denied" in proc.stderr
    assert active(bus) == "sustained"
    assert prop(bus, "Holds") == []
    assert knobs(fake) == before


def _shell(*words: str) -> str:
    return " ".join(shlex.quote(w) for w in words)


def test_hold_runs_the_command_and_exits_with_its_status(daemon, bus, fake):
    """While the command runs the profile is held (it sees that itself); afterwards the hold is
    gone and dsr1ctl exits with the command's status."""
    probe = _shell("busctl", "--system", "get-property", BUS_NAME, PATH, MANAGER,
                   "ActiveProfile")
    status = _shell(sys.executable, "-m", "dsr1d.client.cli", "--bus-address", bus.address, "status")
    command = f"{probe}; {status}; cat {shlex.quote(str(fake.path / EPB.format(0)))}; exit 7"
    proc = dsr1ctl(bus, "hold", "powersave", "--reason", "nightly batch", "--", "sh", "-c",
                   command)
    assert proc.returncode == 7, (proc.stdout, proc.stderr)
    lines = proc.stdout.splitlines()
    assert lines[0] == 's "powersave"', proc.stdout
    assert re.search(r"^holds:\s+1$", proc.stdout, re.M), proc.stdout
    assert re.search(r"#\d+ powersave by dsr1ctl: nightly batch", proc.stdout), proc.stdout
    assert lines[-1] == "15", proc.stdout  # EPB "power" while held
    # dsr1ctl released the hold before it exited.
    assert active(bus) == "sustained"
    assert prop(bus, "Holds") == []
    assert [fake.read(EPB.format(cpu)) for cpu in range(4)] == [SUSTAINED_EPB] * 4


def test_hold_while_a_command_sleeps(daemon, bus):
    proc = dsr1ctl(bus, "hold", "latency", "--", "sleep", "0.3")
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert active(bus) == "sustained"
    assert prop(bus, "Holds") == []
    assert "hold 1: latency for dsr1ctl" in daemon.log()


def test_hold_of_an_unknown_profile_runs_nothing(daemon, bus, tmp_path):
    marker = tmp_path / "ran"
    proc = dsr1ctl(bus, "hold", "warp-speed", "--", "touch", str(marker))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert not marker.exists()
    assert active(bus) == "sustained"


def test_hold_of_a_missing_command_releases_and_exits_127(daemon, bus):
    proc = dsr1ctl(bus, "hold", "latency", "--", "/nonexistent/command")
    assert proc.returncode == 127, (proc.stdout, proc.stderr)
    assert active(bus) == "sustained"
    assert prop(bus, "Holds") == []


def test_failed_switch_exits_1(daemon, bus, fake):
    knob = fake.path / EPB.format(3)
    knob.unlink()
    knob.mkdir()
    proc = dsr1ctl(bus, "profile", "powersave")
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "EISDIR" in proc.stderr and str(knob) in proc.stderr
    assert active(bus) == "sustained"
    knob.rmdir()
    knob.write_text(SUSTAINED_EPB)


def test_hold_exits_128_plus_the_signal_that_ended_its_command(daemon, bus):
    proc = dsr1ctl(bus, "hold", "latency", "--", "sh", "-c", "kill -TERM $$")
    assert proc.returncode == 128 + signal.SIGTERM, (proc.stdout, proc.stderr)
    assert active(bus) == "sustained"
    assert prop(bus, "Holds") == []


def test_sigterm_to_hold_reaches_the_command_and_releases(daemon, bus, tmp_path):
    """``systemctl stop`` of a unit running ``dsr1ctl hold … -- job``: the job gets the
    signal, the hold is released, the exit status says how the job ended."""
    out = open(tmp_path / "ctl.out", "w+")  # files, not pipes: nothing can block on them
    ctl = subprocess.Popen(
        [sys.executable, "-m", "dsr1d.client.cli", "--bus-address", bus.address, "hold", "latency",
         "--", "sleep", "600"],
        env=bus.env(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    sleeper = None
    try:
        eventually(lambda: prop(bus, "Holds"), what="the hold to be made")
        sleeper = eventually(lambda: _child_of(ctl.pid), what="dsr1ctl to start its command")
        # Signal only once the command runs and dsr1ctl has installed its SIGTERM handler.
        eventually(lambda: Path(f"/proc/{sleeper}/comm").read_text().strip() == "sleep"
                   and _catches(ctl.pid, signal.SIGTERM), what="dsr1ctl to forward SIGTERM")
        ctl.send_signal(signal.SIGTERM)
        code = ctl.wait(timeout=30)
        out.seek(0)
        assert code == 128 + signal.SIGTERM, out.read()
        assert _gone(sleeper)
        assert active(bus) == "sustained"
        assert prop(bus, "Holds") == []
    finally:
        if ctl.poll() is None:
            ctl.kill()
            ctl.wait()
        if sleeper is not None and not _gone(sleeper):
            os.kill(sleeper, signal.SIGKILL)
        out.close()


def _catches(pid: int, sig: int) -> bool:
    """Whether process ``pid`` has a handler for ``sig`` (SigCgt in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (sig - 1)))
    return False


def _child_of(pid: int) -> int | None:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return int(children[0]) if children else None


def _gone(pid: int) -> bool:
    """The process has exited (a zombie counts: only its parent may reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in "ZX"
    except FileNotFoundError:
        return True


# -- operator polish ------------------------------------------------------------------------------

def test_reload_rereads_profiles_and_reports_a_broken_one(daemon, bus, fake):
    from daemon_fixtures import write_profile

    write_profile(fake, "added", "[main]\nsummary = added by hand\ninclude = balanced\n")
    proc = dsr1ctl(bus, "reload")
    assert proc.returncode == 0 and proc.stdout.strip() == "reloaded", proc.stderr
    assert "added" in prop(bus, "Profiles")
    write_profile(fake, "broken", "[main]\nsummary = x\n[nosuch]\nk = v\n")
    proc = dsr1ctl(bus, "reload")
    assert proc.returncode != 0 and "broken.conf:3" in proc.stderr, proc.stderr


def test_profile_reapply_repairs_drift(daemon, bus, fake):
    epb0 = fake.path / EPB.format(0)
    epb0.write_text("15\n")
    proc = dsr1ctl(bus, "profile", "sustained", "--reapply")
    assert proc.returncode == 0, proc.stderr
    assert epb0.read_text().strip() == SUSTAINED_EPB
    assert dsr1ctl(bus, "verify").returncode == 0


def test_output_into_a_closed_pipe_is_not_a_traceback(daemon, bus):
    command = (f"{shlex.quote(sys.executable)} -m dsr1d.client.cli --bus-address "
               f"{shlex.quote(bus.address)} status | head -1")
    proc = subprocess.run(["bash", "-o", "pipefail", "-c", command], capture_output=True,
                          text=True, timeout=60)
    assert proc.stdout.startswith("profile:")
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_version_is_printed():
    proc = subprocess.run([sys.executable, "-m", "dsr1d.client.cli", "--version"], capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 0 and proc.stdout.startswith("dsr1ctl ")


@pytest.mark.parametrize("where", ["before", "after"])
def test_json_output_of_the_read_commands(daemon, bus, where):
    import json

    def run_json(command: str):
        args = ["--json", command] if where == "before" else [command, "--json"]
        proc = dsr1ctl(bus, *args)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)

    status = run_json("status")
    assert status["manager"]["ActiveProfile"] == "sustained"
    assert "load_1m" in status["telemetry"] and status["engine"]["State"] == "unconfigured"
    listed = run_json("list")
    assert {"name": "sustained", "summary": listed[[p["name"] for p in listed].index(
        "sustained")]["summary"], "active": True} in listed
    assert run_json("verify") == {"ok": True, "drift": []}
