"""Timelines of a run: the CSV ``dsr1ctl record`` writes, read back with the one
``dsr1d simulate --csv`` writes, and drawn by ``dsr1ctl plot`` (PNG, SVG or PDF).

The record CSV has one row per sample: ``time_s`` (seconds since the recording started),
``active_profile``, ``throttle_state``, ``mitigations`` (the active rungs joined with ``+``),
then one column per telemetry key, named as the daemon names it (the unit is in the name). A
list (per-CPU values) is stored as its mean under the same name; a nested dict (``unavailable``)
is left out. A key the daemon did not report in a sample is an empty cell: nothing is invented.

The plot needs matplotlib (``pip install 'dsr1d[plot]'``), imported only when drawing; reading
and recording do not.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Iterable

RECORD_FIRST = ("time_s", "active_profile", "throttle_state", "mitigations")
# Telemetry keys put first (in this order) when present; the others follow sorted.
PREFERRED = ("pkg_temp_c", "package_temp_c", "busy_mhz", "cpu_mhz_avg", "cpu_mhz", "cpu_freq_mhz",
             "pkg_power_w", "package_power_w", "engine_tokens_per_s", "tokens_per_s")

# What each panel shows: the CSV columns tried in order, then a suffix any column may match.
SERIES: dict[str, tuple[tuple[str, ...], str]] = {
    "temp": (("pkg_temp_c", "package_temp_c"), "_temp_c"),
    "mhz": (("busy_mhz", "cpu_mhz_avg", "cpu_mhz", "cpu_freq_mhz"), "_mhz"),
    "power": (("pkg_power_w", "package_power_w"), "_power_w"),
    "tokens": (("engine_tokens_per_s", "tokens_per_s", "decode_tokens_per_s"), "tokens_per_s"),
}
PANELS = (("temp", "temperature (°C)"), ("mhz", "frequency (MHz)"), ("power", "power (W)"),
          ("tokens", "tokens/s"))
EXTRA = {"sink": "sink_temp_c", "pl1": "pl1_w", "throttle_count": "throttle_count",
         "ceiling": "ceiling_mhz", "limit": "limit_temp_c", "tj_max": "tj_max_c",
         "tcc_offset": "tcc_offset_c"}
FORMATS = {".png": "png", ".svg": "svg", ".pdf": "pdf"}
WARMUP_S = 60.0
NO_STATE = ("", "none", "n/a")


class PlotError(Exception):
    """A one-line reason, with the exit status it maps to (2: bad input, 1: failed)."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


# -- recording -----------------------------------------------------------------------------------

def _cell(value: Any) -> str | None:
    """A telemetry value as a CSV cell; None when it is not a flat value (left out)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ""
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)):
        numbers = [float(v) for v in value
                   if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not value or len(numbers) != len(value):
            return None if value else ""
        return repr(sum(numbers) / len(numbers))
    return None


def flatten(time_s: float, props: dict[str, Any], telemetry: dict[str, Any]) -> dict[str, str]:
    """One record row from the Manager1 properties and a GetTelemetry sample."""
    mitigations = props.get("Mitigations")
    row = {
        "time_s": f"{time_s:.3f}",
        "active_profile": str(props.get("ActiveProfile", "")),
        "throttle_state": str(props.get("ThrottleState", "")),
        "mitigations": "+".join(str(m) for m in mitigations) if mitigations else "",
    }
    for key, value in telemetry.items():
        if key in row:
            continue
        cell = _cell(value)
        if cell is not None:
            row[key] = cell
    return row


def progress_line(row: dict[str, str]) -> str:
    """One line for a recorded row (shown on a terminal): state, then what the panels plot."""
    parts = [f"{float(row['time_s']):7.1f}s", f"profile {row['active_profile'] or '?'}",
             f"throttle {row['throttle_state'] or '?'}"
             + (f" ({row['mitigations']})" if row["mitigations"] else "")]
    for key, unit, digits in (("temp", "°C", 1), ("mhz", "MHz", 0), ("power", "W", 1),
                              ("tokens", "tok/s", 2)):
        column = _pick(list(row), *SERIES[key])
        try:
            parts.append(f"{float(row[column]):.{digits}f} {unit}")
        except (KeyError, TypeError, ValueError):
            pass  # not reported in this sample
    return "  ".join(parts)


class RecordWriter:
    """Writes record rows as they come, flushed after each; a column that first appears in a
    later sample rewrites the file with the wider header (earlier rows get empty cells)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.fields: list[str] = list(RECORD_FIRST)
        self.rows: list[dict[str, str]] = []
        self.fh: IO[str] = open(self.path, "w", newline="")

    def add(self, row: dict[str, str]) -> None:
        new = [k for k in row if k not in self.fields]
        new.sort(key=lambda k: (PREFERRED.index(k) if k in PREFERRED else len(PREFERRED), k))
        self.fields.extend(new)
        self.rows.append(row)
        if new or len(self.rows) == 1:
            self.fh.seek(0)
            self.fh.truncate()
            writer = csv.DictWriter(self.fh, fieldnames=self.fields, restval="")
            writer.writeheader()
            writer.writerows(self.rows)
        else:
            csv.DictWriter(self.fh, fieldnames=self.fields, restval="").writerow(row)
        self.fh.flush()

    def close(self) -> None:
        """Close the file; one without a single sample is removed (nothing was recorded)."""
        if not self.fh.closed:
            self.fh.close()
            if not self.rows:
                try:
                    self.path.unlink()
                except OSError:
                    pass


# -- reading ------------------------------------------------------------------------------------

@dataclass
class Timeline:
    """What the plot draws, read from one CSV."""

    path: Path
    source: str                                   # "recorded" or "simulation"
    time: list[float]
    series: dict[str, list[float]] = field(default_factory=dict)   # NaN where missing
    columns: dict[str, str] = field(default_factory=dict)          # series -> CSV column
    rungs: list[list[str]] | None = None          # active rungs per sample, in order
    states: list[str] | None = None               # throttle / controller state per sample
    profiles: list[str] | None = None

    def changes(self) -> list[tuple[float, str, str]]:
        """``(time_s, "apply"|"release", rung)`` for every change of the active rungs."""
        out: list[tuple[float, str, str]] = []
        if self.rungs is None:
            return out
        before: list[str] = []
        for t, now in zip(self.time, self.rungs):
            out += [(t, "release", r) for r in before if r not in now]
            out += [(t, "apply", r) for r in now if r not in before]
            before = now
        return out

    def spans(self) -> dict[str, list[tuple[float, float]]]:
        """Per rung, the ``(start, end)`` times it was active (end: the last sample if never
        released)."""
        out: dict[str, list[tuple[float, float]]] = {}
        start: dict[str, float] = {}
        for t, kind, rung in self.changes():
            if kind == "apply":
                start[rung] = t
            else:
                out.setdefault(rung, []).append((start.pop(rung), t))
        for rung, t in start.items():
            out.setdefault(rung, []).append((t, self.time[-1]))
        return out


def _number(cell: str | None, where: str, column: str) -> float:
    if cell is None or cell.strip() == "":
        return math.nan
    text = cell.strip()
    if text in ("True", "False"):
        return 1.0 if text == "True" else 0.0
    try:
        return float(text)
    except ValueError:
        raise PlotError(f"{where}: column {column}: not a number: {cell!r}") from None


def _pick(header: list[str], candidates: tuple[str, ...], suffix: str) -> str | None:
    for name in candidates:
        if name in header:
            return name
    return next((h for h in header if h.endswith(suffix) and h not in EXTRA.values()), None)


def read_timeline(path: Path) -> Timeline:
    """Read a record or simulate CSV; PlotError (exit 2) with a one-line reason if it is not one."""
    path = Path(path)
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            reader = csv.reader(fh)
            try:
                header = next(reader, None)
                lines = [(reader.line_num, r) for r in reader if r]
            except csv.Error as exc:
                raise PlotError(f"{path}:{reader.line_num}: not a valid CSV: {exc}") from None
    except UnicodeDecodeError:
        raise PlotError(f"{path}: not a text CSV file") from None
    except OSError as exc:
        raise PlotError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not header:
        raise PlotError(f"{path}: empty: expected a CSV from dsr1ctl record or dsr1d simulate "
                        "--csv")
    header = [h.strip() for h in header]
    if "time_s" not in header:
        raise PlotError(f"{path}: no time_s column: not a CSV from dsr1ctl record or dsr1d "
                        "simulate --csv")
    if not lines:
        raise PlotError(f"{path}: no samples, only a header")
    rows: list[tuple[str, dict[str, str]]] = []
    for line, cells in lines:
        where = f"{path}:{line}"
        if len(cells) != len(header):
            raise PlotError(f"{where}: {len(cells)} fields, the header has {len(header)}")
        rows.append((where, dict(zip(header, cells))))

    time = [_number(r["time_s"], w, "time_s") for w, r in rows]
    bad = next((w for (w, _), t in zip(rows, time) if math.isnan(t)), None)
    if bad is not None:
        raise PlotError(f"{bad}: column time_s: empty")

    simulation = "mitigations" not in header and "active" in header
    tl = Timeline(path=path, source="simulation" if simulation else "recorded", time=time)
    for key, (candidates, suffix) in SERIES.items():
        column = _pick(header, candidates, suffix)
        if column is not None:
            tl.columns[key] = column
    for key, column in EXTRA.items():
        if column in header:
            tl.columns[key] = column
    for key, column in tl.columns.items():
        tl.series[key] = [_number(r[column], w, column) for w, r in rows]

    if "mitigations" in header:
        tl.rungs = [[m for m in r["mitigations"].split("+") if m.strip()] for _, r in rows]
    elif "active" in header:
        tl.rungs = [r["active"].split() for _, r in rows]
    state_col = "throttle_state" if "throttle_state" in header else \
        "state" if "state" in header else None
    if state_col is not None:
        tl.states = [r[state_col].strip() for _, r in rows]
    if "active_profile" in header:
        tl.profiles = [r["active_profile"].strip() for _, r in rows]

    if not any(k in tl.series for k in SERIES) and tl.rungs is None:
        wanted = ", ".join(c for cands, _ in SERIES.values() for c in cands)
        raise PlotError(f"{path}: nothing to plot: none of the columns {wanted}, mitigations "
                        "or active")
    return tl


# -- drawing ------------------------------------------------------------------------------------

RUNG_COLORS = ("tab:orange", "tab:purple", "tab:green", "tab:brown", "tab:pink", "tab:olive",
               "tab:cyan", "tab:gray")
STATE_COLORS = {"throttling": "tab:red", "mitigating": "gold", "recovering": "tab:green",
                "learning": "tab:purple", "efficient": "tab:cyan"}
MAX_LABELS = 16


def _runs(values: list[str], time: list[float]) -> Iterable[tuple[str, float, float]]:
    """``(value, start, end)`` for each run of equal values (end: the next run's start)."""
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[i]:
            j += 1
        end = time[j + 1] if j + 1 < len(time) else time[j]
        yield values[i], time[i], end
        i = j + 1


def default_title(tl: Timeline) -> str:
    span = tl.time[-1] - tl.time[0]
    parts = [tl.path.name, "simulation" if tl.source == "simulation" else "recorded",
             f"{len(tl.time)} samples over {span:.0f} s" if span >= 10 else
             f"{len(tl.time)} samples over {span:.1f} s"]
    if tl.profiles:
        seen = list(dict.fromkeys(p for p in tl.profiles if p))
        if seen:
            parts.append("profile " + " → ".join(seen))
    return "dsr1d timeline: " + ", ".join(parts)


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if not math.isnan(v)]


def summary(tl: Timeline) -> dict[str, float | None]:
    """Sustained tok/s (mean after the first minute, or over all of a shorter run), J/token
    (package energy over tokens, both integrated over the same samples) and peak temperature."""
    t = tl.time
    start = t[0] + WARMUP_S if t[-1] - t[0] > 2 * WARMUP_S else t[0]
    tokens = energy = span = 0.0
    have_power = "power" in tl.series
    for i in range(1, len(t)):
        if t[i] <= start:
            continue
        dt = t[i] - t[i - 1]
        tok = tl.series.get("tokens", [math.nan] * len(t))[i]
        watts = tl.series["power"][i] if have_power else math.nan
        if math.isnan(tok):
            continue
        tokens += tok * dt
        span += dt
        if not math.isnan(watts):
            energy += watts * dt
        else:
            have_power = False
    temps = _finite(tl.series.get("temp", []))
    return {"tokens_per_s": tokens / span if span else None,
            "joules_per_token": energy / tokens if tokens and have_power else None,
            "peak_temp_c": max(temps) if temps else None}


def _summary_text(tl: Timeline, label: str) -> str:
    s = summary(tl)
    parts = [f"{s['tokens_per_s']:.2f} tok/s" if s["tokens_per_s"] is not None else "tok/s -",
             f"{s['joules_per_token']:.2f} J/token" if s["joules_per_token"] is not None
             else "J/token -",
             f"peak {s['peak_temp_c']:.1f} °C" if s["peak_temp_c"] is not None else "peak -"]
    return f"{label}: " + ", ".join(parts)


def _limit_c(tl: Timeline) -> float | None:
    """The thermal limit the run reports: the simulator's, or TjMax minus the TCC offset."""
    if "limit" in tl.series and _finite(tl.series["limit"]):
        return _finite(tl.series["limit"])[-1]
    if "tj_max" in tl.series and _finite(tl.series["tj_max"]):
        offset = _finite(tl.series.get("tcc_offset", [])) or [0.0]
        return _finite(tl.series["tj_max"])[-1] - offset[-1]
    return None


def draw(tl: Timeline, out: Path, title: str | None = None,
         baseline: Timeline | None = None) -> None:
    """Write the figure, in the format OUT's suffix names (.png, .svg, .pdf). PlotError (exit
    1) without matplotlib or when OUT cannot be written; a ``baseline`` run is drawn beneath."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.patches import Patch
    except ImportError:
        raise PlotError("plot needs matplotlib, which is not installed: "
                        "pip install 'dsr1d[plot]'", exit_code=1) from None

    spans = tl.spans()
    rungs = list(dict.fromkeys(rung for _, kind, rung in tl.changes() if kind == "apply"))
    colors = {r: RUNG_COLORS[i % len(RUNG_COLORS)] for i, r in enumerate(rungs)}
    show_state = tl.states is not None and any(s not in NO_STATE for s in tl.states)
    lanes = (["throttle state"] if show_state else []) + rungs   # top to bottom
    lane_panel = tl.rungs is not None or show_state

    heights = [3, 2.2, 2.2, 2.2] + ([0.45 * max(1, len(lanes)) + 0.4] if lane_panel else [])
    fig = Figure(figsize=(12, sum(heights) * 0.95 + 1.2), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights})
    t = tl.time
    changes = tl.changes()

    for ax, (key, label) in zip(axes, PANELS):
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        values = tl.series.get(key)
        if values is None or all(math.isnan(v) for v in values):
            ax.text(0.5, 0.5, f"not in this CSV ({', '.join(SERIES[key][0])})",
                    transform=ax.transAxes, ha="center", va="center", color="gray")
            ax.set_yticks([])
        else:
            ax.plot(t, values, color="tab:blue", lw=1.4, label=tl.columns[key],
                    marker="." if len(t) <= 60 else None)  # a lone sample still shows
        if baseline is not None and key in baseline.series:
            ax.plot(baseline.time, baseline.series[key], color="gray", lw=1, alpha=0.8,
                    label=f"baseline {baseline.path.name}")
        if key == "tokens":
            ax.set_ylim(bottom=0)
        if key == "mhz" and "ceiling" in tl.series:
            ax.plot(t, tl.series["ceiling"], color="tab:red", lw=1, ls=":",
                    drawstyle="steps-post", label="frequency ceiling")
        if key == "temp" and _limit_c(tl) is not None:
            ax.axhline(_limit_c(tl), color="tab:red", lw=1, ls="--",
                       label=f"thermal limit {_limit_c(tl):.0f} °C (TjMax - offset)")
        if key == "temp" and "sink" in tl.series:
            ax.plot(t, tl.series["sink"], color="gray", lw=1, ls="--", label="heat sink")
        if key == "power" and "pl1" in tl.series:
            ax.plot(t, tl.series["pl1"], color="tab:red", lw=1, ls=":", drawstyle="steps-post",
                    label="PL1 limit")
            top = max((v for v in tl.series["power"] if not math.isnan(v)), default=None) \
                if "power" in tl.series else None
            if top is not None:  # keep a far-away limit (the 350 W default) from flattening W
                ax.set_ylim(0, max(top, min(v for v in tl.series["pl1"] if not math.isnan(v)))
                            * 1.12)
        if key == "temp" and "throttle_count" in tl.series and _finite(tl.series["throttle_count"]):
            counts = tl.series["throttle_count"]
            first = _finite(counts)[0]
            if max(_finite(counts)) > first:    # one line, not a marker per event
                twin = ax.twinx()
                twin.plot(t, [c - first for c in counts], color="tab:red", lw=1,
                          drawstyle="steps-post", alpha=0.7)
                twin.set_ylabel("throttle events (cumulative)", color="tab:red", fontsize=8)
                twin.set_ylim(bottom=0)
        for rung, intervals in spans.items():
            for start, end in intervals:
                ax.axvspan(start, end, color=colors[rung], alpha=0.12, lw=0)
        for when, kind, rung in changes:
            ax.axvline(when, color=colors[rung], lw=1, ls="-" if kind == "apply" else "--")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=8)

    if changes and len(changes) <= MAX_LABELS:
        top = axes[0]
        for when, kind, rung in changes:
            top.annotate(f"{kind} {rung}", xy=(when, 1.0), xycoords=("data", "axes fraction"),
                         xytext=(3, -4), textcoords="offset points", rotation=90, ha="left",
                         va="top", fontsize=8, color=colors[rung],
                         bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none",
                               "alpha": 0.75})

    if lane_panel:
        ax = axes[-1]
        ax.set_ylabel("mitigation")
        for rung in rungs:
            y = lanes.index(rung)
            ax.broken_barh([(s, max(e - s, 1e-9)) for s, e in spans[rung]], (y - 0.35, 0.7),
                           color=colors[rung], alpha=0.8)
        if show_state:
            y = 0
            for state, s, e in _runs(tl.states, t):
                if state in NO_STATE:
                    continue
                color = STATE_COLORS.get(state, "tab:gray")
                ax.broken_barh([(s, max(e - s, 1e-9))], (y - 0.35, 0.7), color=color, alpha=0.6)
                ax.text(s, y, f" {state}", va="center", ha="left", fontsize=8, clip_on=True)
        ax.set_yticks(range(len(lanes)), lanes, fontsize=8)
        ax.set_ylim(max(1, len(lanes)) - 0.4, -0.6)   # the first lane on top
        if not lanes:
            ax.text(0.5, 0.5, "no mitigation step in this run", transform=ax.transAxes,
                    ha="center", va="center", color="gray")
            ax.set_yticks([])
        handles = [Patch(color=colors[r], alpha=0.5, label=r) for r in rungs]
        if handles:
            handles += [Line2D([], [], color="black", lw=1, label="applied"),
                        Line2D([], [], color="black", lw=1, ls="--", label="released")]
            ax.legend(handles=handles, loc="center left", bbox_to_anchor=(1.005, 0.5),
                      fontsize=8)
    box = [_summary_text(tl, "this run")]
    if baseline is not None:
        box.append(_summary_text(baseline, "baseline"))
    axes[0].text(0.01, 0.97, "\n".join(box), transform=axes[0].transAxes, va="top", ha="left",
                 fontsize=8, bbox={"boxstyle": "round", "fc": "white", "alpha": 0.85})
    axes[-1].set_xlabel("time (s)")
    axes[-1].set_xlim(t[0], t[-1] if t[-1] > t[0] else t[0] + 1)
    fig.suptitle(title or default_title(tl))

    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        fig.savefig(tmp, format=output_format(out))
        os.replace(tmp, out)
    except OSError as exc:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise PlotError(f"cannot write {out}: {exc.strerror or exc}", exit_code=1) from None


def output_format(out: Path) -> str:
    """The figure format OUT's suffix names; PlotError (exit 2) for any other."""
    fmt = FORMATS.get(Path(out).suffix.lower())
    if fmt is None:
        raise PlotError(f"{out}: the format comes from the file name: "
                        f"{', '.join(FORMATS)}")
    return fmt


def plot_file(csv_path: Path, out: Path, title: str | None = None,
              baseline: Path | None = None) -> Timeline:
    """Read ``csv_path`` (and ``baseline``) and draw it to ``out``; PlotError with the reason
    and exit status."""
    output_format(out)
    tl = read_timeline(csv_path)
    draw(tl, out, title, read_timeline(baseline) if baseline is not None else None)
    return tl
