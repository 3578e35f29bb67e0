"""turbostat as a telemetry source (``turbostat``): one long-lived subprocess.

``turbostat --quiet --interval S --show Core,CPU,Busy%,Bzy_MHz,CoreTmp,PkgTmp,PkgWatt`` prints,
every S seconds, a header line and a table: a summary row (``-`` in Core/CPU) and one row per
CPU. Columns vary by machine and version (what the CPU lacks is not printed); a value that
exists only once per core or package (CoreTmp, PkgTmp, PkgWatt) is printed on the first CPU of
that core or package and left blank on its siblings.

Keys: ``busy_mhz`` and ``busy_percent`` (summary), ``cpu_mhz`` (Bzy_MHz, list by CPU number),
``pkg_temp_c`` (summary PkgTmp: the hottest package), ``core_temp_c`` (list, one per core),
``pkg_power_w`` (summary PkgWatt: packages summed), and where printed ``avg_mhz``,
``core_power_w`` (CorWatt), ``ram_power_w`` (RAMWatt).

Faults: a missing binary, or one that exits at once (no ``/dev/cpu/*/msr``, no
CAP_SYS_RAWIO…), makes ``probe()`` say so with turbostat's own message; a turbostat that dies
later is restarted (with back-off) and its message reported; lines that are not turbostat's
table are counted and reported, never parsed into numbers.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import select
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from dsr1d.constants import BUSY_MHZ, CPU_MHZ, PKG_POWER_W, PKG_TEMP_C
from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.sysroot import SysRoot
from dsr1d.contract.telemetry import UNAVAILABLE, Pending, Unavailable
from dsr1d.contract.tunable import Support

log = logging.getLogger("dsr1d")

SHOW = "Core,CPU,Busy%,Bzy_MHz,CoreTmp,PkgTmp,PkgWatt"
KNOWN_COLUMNS = frozenset({
    "Package", "Die", "Node", "Core", "CPU", "APIC", "X2APIC", "Avg_MHz", "Busy%", "%Busy",
    "Bzy_MHz", "TSC_MHz", "IPC", "IRQ", "SMI", "CoreTmp", "PkgTmp", "PkgWatt", "CorWatt",
    "GFXWatt", "RAMWatt", "PKG_%", "RAM_%", "CoreThr", "Totl%C0", "Any%C0", "GFX%C0",
    "CPUGFX%", "GFXMHz", "GFX%rc6", "POLL", "POLL%", "CPU%c1", "CPU%c3", "CPU%c6", "CPU%c7",
    "Mod%c6", "UncMHz", "SysWatt", "Time_Of_Day_Seconds", "usec",
})
# summary column -> sample key
SUMMARY_KEYS = {
    "Busy%": "busy_percent", "%Busy": "busy_percent", "Bzy_MHz": BUSY_MHZ,
    "Avg_MHz": "avg_mhz", "PkgTmp": PKG_TEMP_C, "PkgWatt": PKG_POWER_W,
    "CorWatt": "core_power_w", "RAMWatt": "ram_power_w",
}
PROBE_WAIT_S = 0.5


# -- parsing -------------------------------------------------------------------------------------


def _is_value(token: str) -> bool:
    if token == "-":
        return True
    if token.startswith("0x"):
        try:
            int(token, 16)
            return True
        except ValueError:
            return False
    try:
        float(token)
        return True
    except ValueError:
        return False


_NAME = re.compile(r"^[A-Za-z%][\w%]*$")


def _is_header(tokens: list[str]) -> bool:
    """Column names only (``Core CPU Busy% …``), at least one of them turbostat's."""
    return bool(tokens) and all(_NAME.match(t) for t in tokens) and \
        any(t in KNOWN_COLUMNS for t in tokens)


def _float(token: str | None) -> float | None:
    if token is None or token == "-" or token.startswith("0x"):
        return None
    try:
        return float(token)
    except ValueError:
        return None


@dataclass
class Interval:
    """One turbostat interval: the summary row and the per-CPU rows, by column name."""

    header: list[str]
    summary: dict[str, str] | None = None
    cpus: list[dict[str, str]] = field(default_factory=list)
    garbage: list[str] = field(default_factory=list)
    extra_values: int = 0       # rows with more values than the header has names

    def empty(self) -> bool:
        return self.summary is None and not self.cpus

    def values(self) -> dict[str, Any]:
        """The sample keys this interval measured (nothing is filled in)."""
        out: dict[str, Any] = {}
        summary = self.summary or {}
        for column, key in SUMMARY_KEYS.items():
            value = _float(summary.get(column))
            if value is not None and key not in out:
                out[key] = value
        rows = [r for r in self.cpus if _float(r.get("CPU")) is not None]
        rows.sort(key=lambda r: int(float(r["CPU"])))
        mhz = [_float(r.get("Bzy_MHz")) for r in rows]
        if rows and all(m is not None for m in mhz):
            out[CPU_MHZ] = mhz
        temps = [_float(r.get("CoreTmp")) for r in self.cpus if r.get("CoreTmp") not in (None, "-")]
        temps = [t for t in temps if t is not None]
        if temps:
            out["core_temp_c"] = temps
        if PKG_TEMP_C not in out:  # no summary row: the hottest package row
            pkg = [t for t in (_float(r.get("PkgTmp")) for r in self.cpus) if t is not None]
            if pkg:
                out[PKG_TEMP_C] = max(pkg)
        return out


class TurbostatParser:
    """Feed it turbostat's stdout line by line; it hands back each finished interval.

    An interval starts at a header line (turbostat prints one per interval) or, where the
    header is printed once, at the next summary row; it ends at the next start or at
    :meth:`flush` (the reader calls it when the output pauses between intervals).
    """

    def __init__(self) -> None:
        self.header: list[str] | None = None
        self.current: Interval | None = None
        self.pending_garbage: list[str] = []
        self.garbage_total = 0
        self.last_garbage = ""

    def feed(self, line: str) -> Interval | None:
        tokens = line.split()
        if not tokens:
            return None
        if _is_header(tokens):
            done = self.flush()
            self.header = tokens
            self.current = Interval(tokens, garbage=self._take_garbage())
            return done
        if self.header is None or not all(_is_value(t) for t in tokens):
            self._garbage(line)
            return None
        row = dict(zip(self.header, tokens))
        is_summary = self._is_summary(row)
        done = None
        if self.current is None or (is_summary and not self.current.empty()):
            done = self.flush()
            self.current = Interval(self.header, garbage=self._take_garbage())
        assert self.current is not None
        if len(tokens) > len(self.header):
            self.current.extra_values += 1
        if is_summary:
            self.current.summary = row
        else:
            self.current.cpus.append(row)
        return done

    def flush(self) -> Interval | None:
        """The interval in progress, if it has rows (else None); starts afresh."""
        done, self.current = self.current, None
        if done is not None:
            done.garbage.extend(self._take_garbage())
            if done.empty():
                self.pending_garbage = done.garbage
                return None
        return done

    def _garbage(self, line: str) -> None:
        self.garbage_total += 1
        self.last_garbage = line.rstrip("\n")[:200]
        target = self.current.garbage if self.current is not None else self.pending_garbage
        target.append(line.rstrip("\n")[:200])

    def _take_garbage(self) -> list[str]:
        out, self.pending_garbage = self.pending_garbage, []
        return out

    @staticmethod
    def _is_summary(row: dict[str, str]) -> bool:
        for column in ("CPU", "Core", "Package"):
            if column in row:
                return row[column] == "-"
        return True  # no topology columns: every row is a system summary


def parse_turbostat(text: str | Iterable[str]) -> list[Interval]:
    """Every interval in recorded turbostat output (fixtures, ``--out`` files)."""
    lines = text.splitlines() if isinstance(text, str) else text
    parser = TurbostatParser()
    out = [iv for iv in (parser.feed(line) for line in lines) if iv is not None]
    last = parser.flush()
    if last is not None:
        out.append(last)
    elif parser.pending_garbage and out:
        out[-1].garbage.extend(parser.pending_garbage)
    return out


# -- the subprocess ------------------------------------------------------------------------------


class TurbostatRunner:
    """Runs turbostat, parses its output in a thread, keeps the latest interval."""

    def __init__(self, argv: list[str], pause_s: float = 0.1) -> None:
        self.argv = argv
        self.pause_s = pause_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.latest: Interval | None = None
        self.latest_t: float = 0.0
        self.intervals = 0
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=5)
        self.started_t = 0.0
        self._threads: list[threading.Thread] = []
        self.parser = TurbostatParser()

    def garbage_note(self) -> str:
        p = self.parser
        if not p.garbage_total:
            return ""
        return (f"; it printed {p.garbage_total} line(s) that are not its table, "
                f"e.g. {p.last_garbage!r}")

    def start(self) -> None:
        self.stderr_tail.clear()
        self.proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            close_fds=True)  # the unit's cgroup reaps it if the daemon is killed
        self.started_t = time.monotonic()
        proc = self.proc
        self._threads = [
            threading.Thread(target=self._read_stdout, args=(proc,), daemon=True,
                             name="turbostat-stdout"),
            threading.Thread(target=self._read_stderr, args=(proc,), daemon=True,
                             name="turbostat-stderr"),
        ]
        for t in self._threads:
            t.start()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_exit(self, timeout: float) -> int | None:
        """The exit status if it exits within ``timeout`` s, else None (still running)."""
        assert self.proc is not None
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None
        for t in self._threads:
            t.join(1.0)
        return rc

    def exit_message(self) -> str:
        rc = self.proc.returncode if self.proc else None
        how = (f"killed by {signal.Signals(-rc).name}" if rc is not None and rc < 0
               else f"exited with status {rc}")
        tail = " / ".join(line for line in self.stderr_tail if line)
        return f"turbostat {how}" + (f": {tail}" if tail else "")

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                if stream:
                    stream.close()
            except OSError:
                pass
        for t in self._threads:
            t.join(1.0)

    def _read_stdout(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        parser = self.parser = TurbostatParser()
        buf = b""
        while True:
            # Block while idle; once a table is arriving, a pause means the interval is done.
            timeout = self.pause_s if parser.current is not None else None
            try:
                ready, _, _ = select.select([fd], [], [], timeout)
            except (OSError, ValueError):
                break
            if not ready:
                self._publish(parser.flush())
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                self._publish(parser.feed(raw.decode("utf-8", "replace")))
        if buf:
            self._publish(parser.feed(buf.decode("utf-8", "replace")))
        self._publish(parser.flush())

    def _read_stderr(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            line = raw.decode("utf-8", "replace").strip()
            if line:
                self.stderr_tail.append(line[:300])

    def _publish(self, interval: Interval | None) -> None:
        if interval is None:
            return
        with self.lock:
            self.latest = interval
            self.latest_t = time.monotonic()
            self.intervals += 1

    def take(self) -> tuple[Interval | None, float]:
        with self.lock:
            return self.latest, self.latest_t


class Turbostat:
    """The ``turbostat`` telemetry source."""

    name = "turbostat"
    summary = "turbostat: measured busy MHz, Busy%, core/package temperature, package watts"
    priority = 10

    def __init__(self, binary: str = "turbostat", interval_s: float = 1.0,
                 show: str = SHOW, restart_backoff_s: float = 5.0,
                 probe_wait_s: float = PROBE_WAIT_S, real_root_only: bool = True) -> None:
        self.binary = binary
        self.interval_s = interval_s
        self.show = show
        self.restart_backoff_s = restart_backoff_s
        self.probe_wait_s = probe_wait_s
        self.real_root_only = real_root_only
        self.runner: TurbostatRunner | None = None
        self.restarts = 0
        self._next_restart = 0.0
        self._backoff = restart_backoff_s
        self._last_taken: Interval | None = None

    def argv(self, path: str) -> list[str]:
        return [path, "--quiet", "--interval", f"{self.interval_s:g}", "--show", self.show]

    def _which(self) -> str | None:
        return shutil.which(self.binary)

    def probe(self, root: SysRoot) -> Support:
        if self.real_root_only and str(root.root) != "/":
            return Support(False, f"turbostat measures this machine, not the root {root.root}")
        path = self._which()
        if path is None:
            return Support(False, f"{self.binary} not found on PATH "
                                  "(Debian/Ubuntu: apt-get install linux-cpupower)")
        runner = TurbostatRunner(self.argv(path))
        try:
            runner.start()
        except OSError as exc:
            return Support(False, f"cannot run {path}: {exc.strerror or exc}")
        rc = runner.wait_exit(self.probe_wait_s)
        if rc is not None:
            message = runner.exit_message()
            runner.stop()
            return Support(False, message)
        runner.stop()
        return Support(True, " ".join(self.argv(path)))

    def start(self, root: SysRoot) -> None:
        path = self._which()
        if path is None:
            raise Unavailable(f"{self.binary} not found on PATH")
        self.runner = TurbostatRunner(self.argv(path))
        self.runner.start()
        self._backoff = self.restart_backoff_s

    def stop(self) -> None:
        if self.runner is not None:
            self.runner.stop()
        self.runner = None

    def read(self, root: SysRoot, now: float) -> dict[str, Any]:
        runner = self.runner
        if runner is None:
            raise Unavailable("turbostat is not running")
        out: dict[str, Any] = {}
        missing: dict[str, str] = {}
        if not runner.alive():
            runner.wait_exit(1.0)
            why = runner.exit_message()
            mono = time.monotonic()
            if mono >= self._next_restart:
                path = self._which()
                if path is None:
                    raise Unavailable(f"{why}; {self.binary} is gone from PATH")
                runner.stop()
                self.runner = runner = TurbostatRunner(self.argv(path))
                runner.start()
                self.restarts += 1
                self._next_restart = mono + self._backoff
                self._backoff = min(self._backoff * 2, 300.0)
                raise Unavailable(f"{why}; restarted")
            raise Unavailable(f"{why}; restarting after a back-off")
        interval, at = runner.take()
        # Reasons are stable strings (no running clocks in them): each is logged once.
        limit = 2 * self.interval_s + 1.0
        if interval is None:
            note = runner.garbage_note()
            if not note and time.monotonic() - runner.started_t < limit:
                raise Pending("waiting for turbostat's first interval")
            raise Unavailable(f"no turbostat interval within {limit:g} s of its start" + note)
        if time.monotonic() - at > limit:
            raise Unavailable(f"no turbostat interval for more than {limit:g} s"
                              + runner.garbage_note())
        if runner.intervals > 1 and self._backoff > self.restart_backoff_s:
            self._backoff = self.restart_backoff_s  # it runs again: reset the back-off
        out.update(interval.values())
        if interval.garbage:
            missing["garbage"] = (f"ignored {len(interval.garbage)} line(s) that are not "
                                  f"turbostat's table, e.g. {interval.garbage[0]!r}")
        if interval.extra_values:
            missing["columns"] = (f"{interval.extra_values} row(s) had more values than the "
                                  "header has names; extra values ignored")
        if not out:
            missing["values"] = "the interval had none of the columns " + self.show
        if missing:
            out[UNAVAILABLE] = missing
        return out


@hookimpl
def register_telemetry_sources(register: Any) -> None:
    register(Turbostat())
