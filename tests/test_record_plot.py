"""``dsr1ctl record`` (against the real daemon on a private bus) and ``dsr1ctl plot`` (no bus:
a CSV of record or of ``dsr1d simulate --csv`` drawn as a PNG timeline)."""

from __future__ import annotations

import csv
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("daemon_fixtures")
from daemon_fixtures import dsr1ctl, eventually  # noqa: E402

from dsr1d.client.plot import RecordWriter, flatten, read_timeline  # noqa: E402

pytest_plugins = ["daemon_fixtures"]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NO_BUS = "unix:path=/nonexistent/dsr1d-test-no-bus"


def ctl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m dsr1d.client.cli`` pointed at a bus that does not exist (plot must not need one)."""
    return subprocess.run([sys.executable, "-m", "dsr1d.client.cli", "--bus-address", NO_BUS, *args],
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL,
                          env={**os.environ, **(env or {})})


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, data[:16]
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data.endswith(b"IEND\xaeB`\x82")  # complete: ends with the IEND chunk
    return width, height


def assert_sensible_png(path: Path) -> None:
    width, height = png_size(path)
    assert 800 <= width <= 3000 and 600 <= height <= 3000, (width, height)
    assert path.stat().st_size > 20_000  # four panels of lines and text, not a blank image


def read_rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


# -- plot -----------------------------------------------------------------------------------

def test_plot_a_simulation_run(dsr1d, tmp_path):
    pytest.importorskip("matplotlib")
    data, out = tmp_path / "sim.csv", tmp_path / "sim.png"
    dsr1d("simulate", "--seconds", "200", "--csv", str(data), check=True)
    proc = ctl("plot", str(data), str(out))
    assert proc.returncode == 0, proc.stderr
    assert_sensible_png(out)
    # The 200 s run sets a frequency ceiling once decode has been steady for 30 s (then only
    # moves it: one change of what is active); plot saw it.
    assert "200 samples (simulation), 1 mitigation change(s)" in proc.stdout, proc.stdout
    tl = read_timeline(data)
    assert set(tl.columns) >= {"temp", "mhz", "power", "tokens"}
    assert [(kind, rung) for _, kind, rung in tl.changes()] == [("apply", "freq_ceiling")]
    assert 30 <= tl.changes()[0][0] <= 50


def test_plot_against_a_baseline_as_svg_with_limits_and_a_summary(dsr1d, tmp_path):
    pytest.importorskip("matplotlib")
    ours, stock = tmp_path / "dsr1d.csv", tmp_path / "stock.csv"
    dsr1d("simulate", "--seconds", "200", "--csv", str(ours), check=True)
    dsr1d("simulate", "--seconds", "200", "--policy", "stock", "--csv", str(stock), check=True)
    out = tmp_path / "compare.svg"
    proc = ctl("plot", str(ours), "--baseline", str(stock), str(out))
    assert proc.returncode == 0, proc.stderr
    svg = out.read_text()
    assert svg.startswith("<?xml") and "<svg" in svg
    for text in ("frequency ceiling", "thermal limit 105", "baseline stock.csv", "this run:",
                 "J/token", "PL1 limit"):
        assert text in svg, text
    from dsr1d.client.plot import summary
    s_ours, s_stock = summary(read_timeline(ours)), summary(read_timeline(stock))
    assert s_ours["joules_per_token"] < s_stock["joules_per_token"]
    assert s_stock["peak_temp_c"] > s_ours["peak_temp_c"]


def test_plot_refuses_a_format_it_cannot_name(tmp_path):
    data = tmp_path / "sim.csv"
    data.write_text("time_s,pkg_temp_c\n1,50\n")
    proc = ctl("plot", str(data), str(tmp_path / "out.jpg"))
    assert proc.returncode == 2 and ".png, .svg, .pdf" in proc.stderr
    assert not (tmp_path / "out.jpg").exists()


def test_plot_a_recorded_csv_with_steps_applied_and_released(tmp_path):
    pytest.importorskip("matplotlib")
    data, out = tmp_path / "rec.csv", tmp_path / "rec.png"
    writer = RecordWriter(data)
    ladder = [[]] * 5 + [["rapl_pl1"]] * 5 + [["rapl_pl1", "no_turbo"]] * 5 + [["rapl_pl1"]] * 5 \
        + [[]] * 5
    for i, rungs in enumerate(ladder):
        telemetry = {"load_1m": 1.0 + i / 10, "cpu_util_percent": [90.0, 100.0],
                     "cpu_freq_mhz": [3000.0 - 40 * i, 3100.0 - 40 * i],
                     "engine_tokens_per_s": 10.0 - 0.1 * i, "unavailable": {"rapl": "no"}}
        if i >= 3:  # a sensor that appears later: the header widens, earlier cells stay empty
            telemetry["pkg_temp_c"] = 80.0 + i
        props = {"ActiveProfile": "sustained", "ThrottleState": "mitigating" if rungs else "none",
                 "Mitigations": rungs}
        writer.add(flatten(i * 0.5, props, telemetry))
    writer.close()
    rows = read_rows(data)
    assert len(rows) == 25
    assert rows[0]["pkg_temp_c"] == "" and rows[3]["pkg_temp_c"] == "83.0"
    assert rows[12]["mitigations"] == "rapl_pl1+no_turbo"
    assert float(rows[0]["cpu_freq_mhz"]) == 3050.0
    assert "unavailable" not in rows[0] and "pkg_power_w" not in rows[0]

    proc = ctl("plot", str(data), str(out), "--title", "a recorded ladder")
    assert proc.returncode == 0, proc.stderr
    assert "4 mitigation change(s)" in proc.stdout, proc.stdout
    assert_sensible_png(out)
    tl = read_timeline(data)
    assert tl.source == "recorded"
    assert tl.columns["mhz"] == "cpu_freq_mhz" and "power" not in tl.columns
    assert tl.spans() == {"rapl_pl1": [(2.5, 10.0)], "no_turbo": [(5.0, 7.5)]}


def test_flatten_never_invents():
    row = flatten(1.25, {}, {"cpu_util_percent": [], "load_1m": 0.5, "on": True,
                             "engine_state": "idle", "nested": {"a": 1}, "mixed": [1, "x"],
                             "nan": float("nan")})
    assert row == {"time_s": "1.250", "active_profile": "", "throttle_state": "",
                   "mitigations": "", "cpu_util_percent": "", "load_1m": "0.5", "on": "1",
                   "engine_state": "idle", "nan": ""}


@pytest.mark.parametrize("text, reason", [
    ("", "empty"),
    ("a,b\n1,2\n", "no time_s column"),
    ("time_s,pkg_temp_c\n", "no samples"),
    ("time_s,pkg_temp_c\n1,50\n2\n", ":3: 1 fields, the header has 2"),
    ("time_s,pkg_temp_c\n1,50\n2,hot\n", ":3: column pkg_temp_c: not a number: 'hot'"),
    ("time_s,pkg_temp_c\n,50\n", ":2: column time_s: empty"),
    ("time_s,colour\n1,red\n", "nothing to plot"),
    (b"\x89PNG\r\n\x1a\n\x00\xff\xfe", "not a text CSV file"),
], ids=["empty", "no-time", "header-only", "ragged", "not-a-number", "no-time-value",
        "no-columns", "binary"])
def test_malformed_csv_exits_2_with_one_line(tmp_path, text, reason):
    data, out = tmp_path / "bad.csv", tmp_path / "bad.png"
    data.write_bytes(text if isinstance(text, bytes) else text.encode())
    proc = ctl("plot", str(data), str(out))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("dsr1ctl: ") and reason in proc.stderr, proc.stderr
    assert not out.exists()


def test_missing_csv_exits_2(tmp_path):
    proc = ctl("plot", str(tmp_path / "nope.csv"), str(tmp_path / "out.png"))
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == f"dsr1ctl: cannot read {tmp_path / 'nope.csv'}: " \
                                  "No such file or directory"


def test_plot_without_matplotlib_names_the_extra(tmp_path):
    data = tmp_path / "ok.csv"
    data.write_text("time_s,pkg_temp_c\n0,50\n1,51\n")
    blocker = tmp_path / "block" / "matplotlib"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('blocked by the test')\n")
    proc = ctl("plot", str(data), str(tmp_path / "out.png"),
               env={"PYTHONPATH": os.pathsep.join([str(blocker.parent),
                                                   os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert "pip install 'dsr1d[plot]'" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert not (tmp_path / "out.png").exists()


# -- record (real daemon, private bus) -------------------------------------------------------

def test_record_then_plot(daemon, bus, tmp_path):
    data, out = tmp_path / "rec.csv", tmp_path / "rec.png"
    proc = dsr1ctl(bus, "record", "--seconds", "2", "--interval", "0.5", str(data))
    assert proc.returncode == 0, proc.stderr
    rows = read_rows(data)
    assert len(rows) >= 3, rows
    assert f"{data}: {len(rows)} samples" in proc.stdout  # not a tty: no per-sample lines
    assert len(proc.stdout.splitlines()) == 1, proc.stdout
    assert all(r["active_profile"] == "sustained" for r in rows), rows
    assert all(r["throttle_state"] for r in rows), rows
    times = [float(r["time_s"]) for r in rows]
    assert times[0] < 0.5 and times == sorted(times) and times[-1] <= 3.0, times
    header = list(rows[0])
    assert header[:4] == ["time_s", "active_profile", "throttle_state", "mitigations"]
    assert "load_1m" in header
    for r in rows:  # every telemetry cell is a number or empty (never a Python repr of a list)
        float(r["load_1m"])
        assert not any(c.startswith(("[", "{")) for c in r.values())

    pytest.importorskip("matplotlib")
    plotted = ctl("plot", str(data), str(out))
    assert plotted.returncode == 0, plotted.stderr
    assert_sensible_png(out)


def test_record_rejects_a_non_positive_interval(daemon, bus, tmp_path):
    proc = dsr1ctl(bus, "record", "--seconds", "1", "--interval", "0", str(tmp_path / "r.csv"))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "must be positive" in proc.stderr


def test_record_without_a_daemon_exits_3(bus, tmp_path):
    proc = dsr1ctl(bus, "record", "--seconds", "1", str(tmp_path / "r.csv"))
    assert proc.returncode == 3, (proc.stdout, proc.stderr)
    assert "dsr1d is not running" in proc.stderr
    assert not (tmp_path / "r.csv").exists()  # no sample, no file


def test_record_stops_early_on_sigint_and_keeps_the_samples(daemon, bus, tmp_path):
    data = tmp_path / "rec.csv"
    ctl_proc = subprocess.Popen(
        [sys.executable, "-m", "dsr1d.client.cli", "--bus-address", bus.address, "record", "--seconds",
         "60", "--interval", "0.2", str(data)],
        env=bus.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        stdin=subprocess.DEVNULL)
    try:
        eventually(lambda: len(read_rows(data)) >= 2, what="two samples recorded")
        ctl_proc.send_signal(signal.SIGINT)
        out, err = ctl_proc.communicate(timeout=20)
    finally:
        if ctl_proc.poll() is None:
            ctl_proc.kill()
            ctl_proc.wait()
    assert ctl_proc.returncode == 0, err
    assert "(stopped early)" in out, out
    rows = read_rows(data)
    assert len(rows) >= 2 and all(r["active_profile"] == "sustained" for r in rows)


def test_progress_line_shows_only_what_was_reported():
    from dsr1d.client.plot import progress_line

    full = flatten(1.5, {"ActiveProfile": "sustained", "ThrottleState": "mitigating",
                         "Mitigations": ["rapl_pl1"]},
                   {"pkg_temp_c": 88.2, "cpu_mhz": [2000.0, 2100.0], "pkg_power_w": 150.0,
                    "engine_tokens_per_s": 12.3})
    assert progress_line(full).split() == [
        "1.5s", "profile", "sustained", "throttle", "mitigating", "(rapl_pl1)", "88.2", "°C",
        "2050", "MHz", "150.0", "W", "12.30", "tok/s"]
    assert progress_line(flatten(0, {}, {"load_1m": 0.5})).split() == [
        "0.0s", "profile", "?", "throttle", "?"]
