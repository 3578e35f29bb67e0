"""A thermal plant simulator: a CPU package decoding tokens, its heat, its power and its throttling.

Pure apart from `Plant.write_fake_root`, `read_controls` and `simulate_main` (the
``dsr1d simulate`` command), which are the only functions that touch files or the clock. Time is
simulated: `Plant.step` advances the model by ``dt`` seconds without sleeping.

Model and equations
===================

All quantities are per package. ``f`` is the core frequency in GHz, ``n`` the active cores (the
engine's decode threads, one per core), ``u`` the load (fraction of time the threads decode; 1 in
sustained decode, 0 when idle).

Voltage, linear in frequency::

    V(f) = v0 + kv * f                                     [V]

Power: static (uncore and leakage, leakage growing with die temperature) plus dynamic ``C V² f``
per active core::

    P_static(T) = p_static * max(0.5, 1 + leak_per_c * (T_die - leak_ref_c))      [W]
    P(f, n, u, T) = P_static(T) + u * n * c_eff * V(f)**2 * f * 1e9               [W]

Thermal: a two-node RC network, the die (small capacitance, behind the thermal interface) and the
heat sink (large capacitance, cooled to ambient)::

    c_die  * dT_die/dt  = P - (T_die - T_sink) / r_die_sink
    c_sink * dT_sink/dt = (T_die - T_sink) / r_die_sink - (T_sink - ambient) / r_sink_amb

In steady state ``T_die = ambient + (r_die_sink + r_sink_amb) * P``. The package temperature that
the machine reports (``x86_pkg_temp``, coretemp "Package id 0") is ``T_die``.

Frequency chosen by the (modelled) power-control unit, every internal substep::

    top     = f_base if no_turbo else f_turbo
    ceiling = max(f_min, top - epb_ghz_per_step * max(0, epb - epb_neutral))
    f       = the highest f in [f_min, ceiling] with P(f, n, u, T_die) <= PL1   (RAPL PL1)
    f       = f_prochot                     while PROCHOT is asserted

PL1 is enforced as an instantaneous ceiling (its averaging window is shorter than a sample);
``rapl_locked`` models a BIOS that locks the limit, so writes to it are ignored. PROCHOT is
asserted when ``T_die >= t_prochot`` and released when ``T_die <= t_prochot - prochot_hyst``;
every assertion is one thermal throttle event (the kernel's ``*_throttle_count`` counts them).
While asserted, the clock is clamped to ``f_prochot``: PROCHOT is a blunt instrument that drops
the package to its lowest ratio rather than to the frequency that would hold the temperature.

Decode speed, a roofline: compute-bound work grows with frequency and threads; a decode step
reads every weight once, so memory bandwidth caps it::

    tok/s = u * min(tok_per_ghz_thread * f * n,  mem_bw_gbs / gb_per_token)

Energy is the integral of ``P``; tokens the integral of tok/s. The model is integrated with
explicit Euler at ``substep_s`` (0.05 s, well under the die time constant of 1.6 s); the observable
state reports time averages over each ``step``.

Calibration preset `XEON_SUSTAINED`
===================================

Calibrated to a published sustained-inference case on a server Xeon: all-core frequency held at
about 3.8 GHz at first and collapsed to about 2.4 GHz after roughly 120 s, with the thermal target
near 90 °C and PROCHOT near 105 °C. Values (a 32-core package, decode on every core):

* frequencies: turbo 3.8 GHz, base 2.0 GHz, minimum 0.8 GHz; PROCHOT clamps to 0.8 GHz with 1.5 °C
  hysteresis at 105 °C; TDP (default PL1) 350 W, above what the package draws, so only heat limits.
* V(f) = 0.60 V + 0.15 V/GHz * f, c_eff = 1.54 nF per core: 8.0 W per core at 3.8 GHz, 0.64 W at
  0.8 GHz. Static 60 W at 60 °C, +1 %/°C. The package draws 316 W at 3.8 GHz and 60 °C.
* thermal: ambient (inlet side of the heat sink) 30 °C, r_die_sink 0.08 K/W, c_die 20 J/K (1.6 s),
  r_sink_amb 0.24 K/W, c_sink 650 J/K (156 s). At 3.8 GHz (316 W cool, 343 W at 104 °C with the
  leakage) the die would settle near 140 °C, so it must throttle. Starting from the idle steady
  state (die 47 °C) it reaches 105 °C after 121 s at 3.8 GHz: the time the published case held
  its turbo. r_sink_amb and c_sink were fitted for those two figures (the onset time and the
  2.4 GHz plateau below) by a grid search over the unmitigated run.
* then PROCHOT cycles, 1.6 assertions a second (the die node is fast): the clock alternates
  between 3.8 and 0.8 GHz and its one-second average falls to 3.0 GHz in the first minute after
  the onset, 2.5 GHz in the next two while the heat sink keeps warming, and holds 2.39 GHz from
  300 s on: the published collapse. The package then sits at 104 °C drawing 232 W, what the
  cooler removes at that temperature.
* decode: a 7B-class model in bf16 (15.2 GB read per token) on 250 GB/s of memory bandwidth caps
  decode at 16.4 tok/s; the compute term reaches that cap at 2.6 GHz on 32 threads (so the last
  turbo bins buy nothing, as with real memory-bound decode).
* the 90 °C thermal target is the passive trip point written to the fake root and the mitigation
  controller's default target; the plant itself enforces only PROCHOT.

Under those values a PL1 cap that holds the package at 88 °C settles at 180 W and a steady
2.33 GHz, 90 % of the roofline, whereas PROCHOT cycling spends a little under half its time at
0.8 GHz (31 % of the roofline) and the rest at 3.8 GHz, above the roofline knee, where the extra
heat buys no tokens: a slightly lower average frequency, cooler, gives a third more tokens at
two thirds of the energy per token. ``bench/mitigation.py`` measures it.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from dsr1d.core.mitigation import Action, Controller, MitigationConfig, Sample


@dataclass(frozen=True)
class PlantParams:
    """Physical parameters of the plant; see the module docstring for the equations."""

    name: str = "xeon-sustained"
    cores: int = 32
    # thermal (two-node RC)
    ambient_c: float = 30.0
    r_die_sink_k_per_w: float = 0.08
    c_die_j_per_k: float = 20.0
    r_sink_amb_k_per_w: float = 0.24
    c_sink_j_per_k: float = 650.0
    start_temp_c: float | None = None      # None: the idle steady state
    # power
    p_static_w: float = 60.0
    leak_per_c: float = 0.01
    leak_ref_c: float = 60.0
    c_eff_nf: float = 1.54                  # per core
    v0: float = 0.60
    kv_per_ghz: float = 0.15
    # frequency
    f_turbo_ghz: float = 3.8
    f_base_ghz: float = 2.0
    f_min_ghz: float = 0.8
    epb_neutral: int = 4                    # EPB at or below this leaves the turbo ceiling alone
    epb_ghz_per_step: float = 0.1
    tdp_w: float = 350.0                    # the default PL1
    rapl_locked: bool = False
    # PROCHOT
    t_target_c: float = 90.0                # passive trip point (reported, not enforced)
    t_prochot_c: float = 105.0
    prochot_hyst_c: float = 1.5
    f_prochot_ghz: float = 0.8
    # decode
    mem_bw_gbs: float = 250.0
    gb_per_token: float = 15.2
    knee_ghz: float = 2.6                   # compute term meets the roofline here at `cores` threads
    # integration
    substep_s: float = 0.05

    @property
    def roofline_tok_s(self) -> float:
        return self.mem_bw_gbs / self.gb_per_token

    @property
    def tok_per_ghz_thread(self) -> float:
        return self.roofline_tok_s / (self.knee_ghz * self.cores)

    @property
    def r_total_k_per_w(self) -> float:
        return self.r_die_sink_k_per_w + self.r_sink_amb_k_per_w


XEON_SUSTAINED = PlantParams()
PRESETS = {XEON_SUSTAINED.name: XEON_SUSTAINED}


@dataclass
class Controls:
    """What the plant obeys: knobs the daemon (or `simulate`) sets."""

    pl1_w: float
    no_turbo: bool = False
    epb: int = 4
    threads: int = 32
    load: float = 1.0
    ambient_c: float = 30.0


class Plant:
    """The simulated package. `step` advances it; attributes are its current state."""

    def __init__(self, params: PlantParams = XEON_SUSTAINED, controls: Controls | None = None) -> None:
        self.params = params
        self.controls = controls or Controls(pl1_w=params.tdp_w, threads=params.cores,
                                             ambient_c=params.ambient_c)
        self.time_s = 0.0
        idle = self.power_w(params.f_min_ghz, 0, 0.0, params.ambient_c)
        start = params.start_temp_c
        if start is None:  # idle steady state (leakage evaluated at the result, iterated)
            start = params.ambient_c
            for _ in range(20):
                idle = self.power_w(params.f_min_ghz, 0, 0.0, start)
                start = params.ambient_c + params.r_total_k_per_w * idle
        self.t_die_c = start
        self.t_sink_c = params.ambient_c + params.r_sink_amb_k_per_w * idle if \
            params.start_temp_c is None else start
        self.freq_ghz = params.f_turbo_ghz
        self.prochot = False
        self.throttle_count = 0
        self.prochot_s = 0.0
        self.energy_j = 0.0
        self.tokens = 0.0
        self.last: dict[str, Any] = {}
        self._written: dict[str, dict[str, str]] = {}   # fake root -> what was written there

    # -- model -------------------------------------------------------------------------------

    def voltage(self, f_ghz: float) -> float:
        return self.params.v0 + self.params.kv_per_ghz * f_ghz

    def power_w(self, f_ghz: float, cores: int, load: float, t_die_c: float) -> float:
        p = self.params
        static = p.p_static_w * max(0.5, 1.0 + p.leak_per_c * (t_die_c - p.leak_ref_c))
        dynamic = load * cores * p.c_eff_nf * 1e-9 * self.voltage(f_ghz) ** 2 * f_ghz * 1e9
        return static + dynamic

    def ceiling_ghz(self) -> float:
        p, c = self.params, self.controls
        top = p.f_base_ghz if c.no_turbo else p.f_turbo_ghz
        return max(p.f_min_ghz, top - p.epb_ghz_per_step * max(0, c.epb - p.epb_neutral))

    def effective_pl1_w(self) -> float:
        return self.params.tdp_w if self.params.rapl_locked else self.controls.pl1_w

    def target_ghz(self) -> float:
        """The frequency the power-control unit picks now (before PROCHOT)."""
        p, c = self.params, self.controls
        n, load, t = max(0, c.threads), c.load, self.t_die_c
        top = self.ceiling_ghz()
        cap = self.effective_pl1_w()
        if self.power_w(top, n, load, t) <= cap:
            return top
        lo, hi = p.f_min_ghz, top
        if self.power_w(lo, n, load, t) > cap:
            return lo
        for _ in range(24):
            mid = (lo + hi) / 2
            if self.power_w(mid, n, load, t) <= cap:
                lo = mid
            else:
                hi = mid
        return lo

    def tokens_per_s(self, f_ghz: float) -> float:
        p, c = self.params, self.controls
        compute = p.tok_per_ghz_thread * f_ghz * max(0, c.threads)
        return c.load * min(compute, p.roofline_tok_s)

    # -- time --------------------------------------------------------------------------------

    def step(self, dt: float = 1.0) -> dict[str, Any]:
        """Advance ``dt`` simulated seconds; return the observable state (averages over dt)."""
        p, c = self.params, self.controls
        steps = max(1, round(dt / p.substep_s))
        h = dt / steps
        sum_f = sum_p = sum_tok = 0.0
        for _ in range(steps):
            if not self.prochot and self.t_die_c >= p.t_prochot_c:
                self.prochot = True
                self.throttle_count += 1
            elif self.prochot and self.t_die_c <= p.t_prochot_c - p.prochot_hyst_c:
                self.prochot = False
            f = p.f_prochot_ghz if self.prochot else self.target_ghz()
            if self.prochot:
                self.prochot_s += h
            self.freq_ghz = f
            power = self.power_w(f, max(0, c.threads), c.load, self.t_die_c)
            tok = self.tokens_per_s(f)
            flow = (self.t_die_c - self.t_sink_c) / p.r_die_sink_k_per_w
            self.t_die_c += h * (power - flow) / p.c_die_j_per_k
            self.t_sink_c += h * (flow - (self.t_sink_c - c.ambient_c) / p.r_sink_amb_k_per_w) \
                / p.c_sink_j_per_k
            sum_f += f * h
            sum_p += power * h
            sum_tok += tok * h
            self.time_s += h
        self.energy_j += sum_p
        self.tokens += sum_tok
        self.last = {
            "time_s": round(self.time_s, 6),
            "pkg_temp_c": self.t_die_c,
            "sink_temp_c": self.t_sink_c,
            "busy_mhz": sum_f / dt * 1000.0,
            "pkg_power_w": sum_p / dt,
            "throttle_count": self.throttle_count,
            "prochot": self.prochot,
            "prochot_s": self.prochot_s,
            "tokens_per_s": sum_tok / dt,
            "tokens": self.tokens,
            "energy_j": self.energy_j,
            "pl1_w": c.pl1_w,
            "no_turbo": c.no_turbo,
            "epb": c.epb,
            "threads": c.threads,
            "load": c.load,
        }
        return dict(self.last)

    def sample(self) -> Sample:
        """The last observable state as the controller's `Sample`."""
        s = self.last
        return Sample(time_s=s["time_s"], pkg_temp_c=s["pkg_temp_c"], busy_mhz=s["busy_mhz"],
                      pkg_power_w=s["pkg_power_w"], throttle_count=s["throttle_count"],
                      tokens_per_s=s["tokens_per_s"])

    # -- a fake root -------------------------------------------------------------------------

    def write_fake_root(self, root: Path) -> None:
        """Write the observable state under ``root`` the way a real machine shows it.

        State files (temperatures, energy, counters, frequencies) are rewritten when their value
        changed, atomically (a reader never sees half a file). Control files (PL1, no_turbo, EPB) are
        written only when missing, so that what a daemon writes there stays and `read_controls`
        picks it up.
        """
        root = Path(root)
        p, c = self.params, self.controls
        temp_mc = str(int(round(self.t_die_c * 1000)))
        mhz = self.last.get("busy_mhz", self.freq_ghz * 1000.0)
        state: dict[str, str] = {
            "sys/class/thermal/thermal_zone0/type": "x86_pkg_temp",
            "sys/class/thermal/thermal_zone0/temp": temp_mc,
            "sys/class/thermal/thermal_zone0/trip_point_0_type": "passive",
            "sys/class/thermal/thermal_zone0/trip_point_0_temp": str(int(p.t_target_c * 1000)),
            "sys/class/hwmon/hwmon0/name": "coretemp",
            "sys/class/hwmon/hwmon0/temp1_label": "Package id 0",
            "sys/class/hwmon/hwmon0/temp1_input": temp_mc,
            "sys/class/hwmon/hwmon0/temp1_max": str(int(p.t_target_c * 1000)),
            "sys/class/hwmon/hwmon0/temp1_crit": str(int(p.t_prochot_c * 1000)),
            f"{RAPL}/name": "package-0",
            f"{RAPL}/energy_uj": str(int(self.energy_j * 1e6) % MAX_ENERGY_UJ),
            f"{RAPL}/max_energy_range_uj": str(MAX_ENERGY_UJ),
            f"{RAPL}/constraint_0_name": "long_term",
            f"{RAPL}/constraint_0_time_window_us": "999424",
            f"{RAPL}/constraint_0_max_power_uw": str(int(p.tdp_w * 1e6)),
            f"{RAPL}/constraint_1_name": "short_term",
            f"{RAPL}/constraint_1_power_limit_uw": str(int(p.tdp_w * 1.2e6)),
            f"{RAPL}/enabled": "1",
            f"{CPU}/online": f"0-{p.cores - 1}",
            f"{CPU}/intel_pstate/status": "active",
        }
        controls: dict[str, str] = {
            f"{RAPL}/constraint_0_power_limit_uw": str(int(c.pl1_w * 1e6)),
            f"{CPU}/intel_pstate/no_turbo": "1" if c.no_turbo else "0",
        }
        khz = str(int(round(mhz * 1000)))
        prochot_ms = str(int(self.prochot_s * 1000))
        for n in range(p.cores):
            d = f"{CPU}/cpu{n}"
            state[f"{d}/cpufreq/scaling_cur_freq"] = khz
            state[f"{d}/cpufreq/cpuinfo_max_freq"] = str(int(p.f_turbo_ghz * 1e6))
            state[f"{d}/cpufreq/cpuinfo_min_freq"] = str(int(p.f_min_ghz * 1e6))
            state[f"{d}/cpufreq/base_frequency"] = str(int(p.f_base_ghz * 1e6))
            state[f"{d}/thermal_throttle/core_throttle_count"] = str(self.throttle_count)
            state[f"{d}/thermal_throttle/package_throttle_count"] = str(self.throttle_count)
            state[f"{d}/thermal_throttle/core_throttle_total_time_ms"] = prochot_ms
            state[f"{d}/thermal_throttle/package_throttle_total_time_ms"] = prochot_ms
            state[f"{d}/topology/core_id"] = str(n)
            state[f"{d}/topology/physical_package_id"] = "0"
            controls[f"{d}/power/energy_perf_bias"] = str(c.epb)
        written = self._written.setdefault(str(root), {})
        for rel, text in state.items():
            if written.get(rel) != text or not (root / rel).exists():
                _atomic_write(root / rel, text + "\n")
                written[rel] = text
        for rel, text in controls.items():
            if not (root / rel).exists():
                _atomic_write(root / rel, text + "\n")


RAPL = "sys/class/powercap/intel-rapl:0"
CPU = "sys/devices/system/cpu"
MAX_ENERGY_UJ = 262143328850


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def read_controls(root: Path) -> dict[str, Any]:
    """Knob values a daemon wrote under ``root``: ``pl1_w``, ``no_turbo``, ``epb``.

    Only what is present and parses is returned; EPB is the most common value over the CPUs
    (ties: the higher, the more power-saving one).
    """
    root = Path(root)
    out: dict[str, Any] = {}
    try:
        out["pl1_w"] = int((root / RAPL / "constraint_0_power_limit_uw").read_text()) / 1e6
    except (OSError, ValueError):
        pass
    try:
        out["no_turbo"] = int((root / CPU / "intel_pstate/no_turbo").read_text()) != 0
    except (OSError, ValueError):
        pass
    counts: dict[int, int] = {}
    for f in (root / CPU).glob("cpu[0-9]*/power/energy_perf_bias"):
        try:
            v = int(f.read_text())
        except (OSError, ValueError):
            continue
        counts[v] = counts.get(v, 0) + 1
    if counts:
        out["epb"] = max(counts, key=lambda v: (counts[v], v))
    return out


def apply_controls(plant: Plant, controls: dict[str, Any]) -> None:
    """Set the plant's controls from a `read_controls` result."""
    for key in ("pl1_w", "no_turbo", "epb", "threads", "load", "ambient_c"):
        if key in controls:
            setattr(plant.controls, key, controls[key])


# -- plant + controller --------------------------------------------------------------------------

class ActionMapper:
    """Applies controller `Action`s to a plant as overlays: a release restores the value the
    knob had before its rung was applied (a re-apply of an active rung only updates it)."""

    def __init__(self, plant: Plant) -> None:
        self.plant = plant
        self.saved: dict[str, dict[str, Any]] = {}

    def __call__(self, action: Action) -> None:
        c = self.plant.controls
        knobs = {"rapl_pl1": ("pl1_w",), "no_turbo": ("no_turbo",), "epb_balance": ("epb",),
                 "engine_threads": ("threads",)}[action.rung]
        if action.kind == "apply":
            if action.rung not in self.saved:
                self.saved[action.rung] = {k: getattr(c, k) for k in knobs}
            base = self.saved[action.rung]
            if action.rung == "rapl_pl1":
                c.pl1_w = float(action.params["pl1_w"])
            elif action.rung == "no_turbo":
                c.no_turbo = bool(action.params.get("no_turbo", True))
            elif action.rung == "epb_balance":
                c.epb = int(action.params["epb"])
            elif action.rung == "engine_threads":
                c.threads = max(1, base["threads"] + int(action.params["threads_delta"]))
        elif action.kind == "release":
            for k, v in self.saved.pop(action.rung, {}).items():
                setattr(c, k, v)


def simulate(params: PlantParams = XEON_SUSTAINED, seconds: float = 600.0,
             controller: Controller | None = None, dt: float = 1.0,
             schedule: Callable[[float, Plant], None] | None = None,
             plant: Plant | None = None) -> list[dict[str, Any]]:
    """Run plant and (optionally) controller for ``seconds`` of simulated time.

    Each row is the plant's observable state after one ``dt`` step plus the controller's view:
    ``state``, ``active`` (rungs, in order), ``actions`` (`Action`s taken on this sample).
    ``schedule(t, plant)`` runs before each step (change load or ambient, for scenarios).
    """
    plant = plant or Plant(params)
    mapper = ActionMapper(plant)
    rows: list[dict[str, Any]] = []
    for _ in range(int(round(seconds / dt))):
        if schedule is not None:
            schedule(plant.time_s, plant)
        row = plant.step(dt)
        actions: list[Action] = []
        if controller is not None:
            actions = controller.step(plant.sample())
            for action in actions:
                mapper(action)
            row["state"] = controller.state
            row["active"] = list(controller.active)
        else:
            row["state"] = "n/a"
            row["active"] = []
        row["actions"] = actions
        rows.append(row)
    return rows


CSV_FIELDS = ("time_s", "pkg_temp_c", "sink_temp_c", "busy_mhz", "pkg_power_w", "throttle_count",
              "tokens_per_s", "energy_j", "pl1_w", "no_turbo", "epb", "threads", "state", "active",
              "actions")


def _csv_row(row: dict[str, Any]) -> dict[str, Any]:
    out = {k: row.get(k) for k in CSV_FIELDS}
    for k in ("pkg_temp_c", "sink_temp_c", "busy_mhz", "pkg_power_w", "tokens_per_s",
              "energy_j", "pl1_w"):
        out[k] = f"{row[k]:.3f}"
    out["active"] = " ".join(row.get("active", []))
    out["actions"] = " | ".join(f"{a.kind} {a.rung}: {a.reason}" for a in row.get("actions", []))
    return out


def simulate_main(argv: list[str] | None = None) -> int:
    """``dsr1d simulate``: run the calibrated plant, print a summary, optionally a CSV."""
    ap = argparse.ArgumentParser(prog="dsr1d simulate", description=(
        "Run the thermal plant simulator (sustained decode on the calibrated Xeon preset)."))
    ap.add_argument("--seconds", type=float, default=600.0, help="simulated seconds (600)")
    ap.add_argument("--dt", type=float, default=1.0, help="sample period in seconds (1)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default=XEON_SUSTAINED.name)
    ap.add_argument("--mitigate", action=argparse.BooleanOptionalAction, default=None,
                    help="run the mitigation controller (default: on, off with --fake-root)")
    ap.add_argument("--target-temp", type=float, default=None, help="controller target °C")
    ap.add_argument("--csv", type=Path, help="write every sample to this CSV file")
    ap.add_argument("--fake-root", type=Path,
                    help="write the plant's state into this fake root each step and take its "
                         "controls (PL1, no_turbo, EPB) from the files there")
    ap.add_argument("--realtime", action="store_true",
                    help="advance simulated time with the wall clock (with --fake-root)")
    args = ap.parse_args(argv)
    if not (0 < args.seconds < float("inf")) or not (0 < args.dt <= args.seconds):
        ap.error("--seconds must be positive and --dt between 0 and --seconds")
    if args.csv is not None and not args.csv.parent.is_dir():
        ap.error(f"--csv {args.csv}: no directory {args.csv.parent}")
    if args.realtime and args.fake_root is None:
        ap.error("--realtime needs --fake-root")
    if args.fake_root is not None and args.mitigate:
        ap.error("with --fake-root the daemon mitigates (through the files); drop --mitigate")
    mitigate = args.mitigate if args.mitigate is not None else args.fake_root is None
    params = PRESETS[args.preset]
    controller = None
    if mitigate:
        cfg = MitigationConfig() if args.target_temp is None else \
            MitigationConfig(target_temp_c=args.target_temp)
        controller = Controller(cfg)

    rows: list[dict[str, Any]]
    if args.fake_root is None:
        rows = simulate(params, args.seconds, controller, args.dt)
    else:
        rows = []
        plant = Plant(params)
        plant.write_fake_root(args.fake_root)
        start = time.monotonic()
        for i in range(int(round(args.seconds / args.dt))):
            apply_controls(plant, read_controls(args.fake_root))
            row = plant.step(args.dt)
            row.update(state="n/a", active=[], actions=[])
            plant.write_fake_root(args.fake_root)
            rows.append(row)
            if args.realtime:
                time.sleep(max(0.0, start + (i + 1) * args.dt - time.monotonic()))

    if args.csv is not None:
        try:
            with open(args.csv, "w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
                writer.writeheader()
                for row in rows:
                    writer.writerow(_csv_row(row))
        except OSError as exc:
            print(f"dsr1d simulate: cannot write {args.csv}: {exc.strerror}", file=sys.stderr)
            return 1
    print(f"{'time_s':>7} {'temp_C':>7} {'MHz':>6} {'W':>6} {'thr':>5} {'tok/s':>6}  state / rungs")
    every = max(1, int(round(30.0 / args.dt)))
    for row in rows[every - 1::every]:
        print(f"{row['time_s']:7.0f} {row['pkg_temp_c']:7.1f} {row['busy_mhz']:6.0f} "
              f"{row['pkg_power_w']:6.1f} {row['throttle_count']:5d} {row['tokens_per_s']:6.2f}  "
              f"{row['state']} {' '.join(row['active'])}")
    for row in rows:
        for a in row["actions"]:
            print(f"t={row['time_s']:.0f}s {a.kind} {a.rung}: {a.reason}")
    s = summarize(rows)
    print(f"sustained {s['sustained_tok_s']:.2f} tok/s, {s['throttle_events_after_60s']} throttle "
          f"events after 60 s, peak {s['peak_temp_c']:.1f} °C, {s['energy_per_token_j']:.2f} J/token")
    return 0


def summarize(rows: list[dict[str, Any]], warmup_s: float = 60.0,
              steady_from_s: float | None = None) -> dict[str, Any]:
    """Figures over a run: sustained tok/s (mean over the second half, the steady state), mean
    tok/s after ``warmup_s``, throttle events after ``warmup_s``, peak temperature, energy per
    token, and the controller's reaction in samples (1 = acted on the first sample showing
    throttling; None when it never throttled or never acted)."""
    end = rows[-1]["time_s"]
    steady_from = end / 2 if steady_from_s is None else steady_from_s
    steady = [r for r in rows if r["time_s"] > steady_from]
    after = [r for r in rows if r["time_s"] > warmup_s]
    before = [r for r in rows if r["time_s"] <= warmup_s]
    base_count = before[-1]["throttle_count"] if before else 0
    first_throttle = next((i for i, r in enumerate(rows)
                           if r["throttle_count"] > (rows[i - 1]["throttle_count"] if i else 0)),
                          None)
    first_apply = next((i for i, r in enumerate(rows)
                        if any(a.kind == "apply" for a in r.get("actions", []))), None)
    reaction = None
    if first_throttle is not None and first_apply is not None:
        reaction = first_apply - first_throttle + 1
    return {
        "sustained_tok_s": sum(r["tokens_per_s"] for r in steady) / max(1, len(steady)),
        "mean_tok_s_after_warmup": sum(r["tokens_per_s"] for r in after) / max(1, len(after)),
        "sustained_mhz": sum(r["busy_mhz"] for r in steady) / max(1, len(steady)),
        "sustained_power_w": sum(r["pkg_power_w"] for r in steady) / max(1, len(steady)),
        "throttle_events_after_60s": rows[-1]["throttle_count"] - base_count,
        "throttle_events_total": rows[-1]["throttle_count"],
        "first_throttle_s": rows[first_throttle]["time_s"] if first_throttle is not None else None,
        "peak_temp_c": max(r["pkg_temp_c"] for r in rows),
        "peak_temp_after_warmup_c": max((r["pkg_temp_c"] for r in after), default=None),
        "energy_per_token_j": rows[-1]["energy_j"] / max(1e-9, rows[-1]["tokens"]),
        "tokens": rows[-1]["tokens"],
        "energy_j": rows[-1]["energy_j"],
        "reaction_samples": reaction,
        "actions": sum(len(r.get("actions", [])) for r in rows),
    }


if __name__ == "__main__":
    sys.exit(simulate_main())
