"""CPU utilisation and load from /proc (telemetry source ``procstat``).

``/proc/stat`` jiffies since the previous read give ``cpu_util_percent`` (list, one per CPU
line, by CPU number) and ``util_percent`` (all CPUs); ``/proc/loadavg`` gives ``load_1m``,
``load_5m``, ``load_15m``; ``/proc/meminfo`` ``MemAvailable`` gives
``memory_available_bytes``. Read through the root like every other source, so a fake root
tests it; psutil parses the same files on a real machine and is not needed.
"""

from __future__ import annotations

from typing import Any

from dsr1d.constants import LOAD_1M
from dsr1d.contract.hookspecs import hookimpl
from dsr1d.contract.sysroot import SysRoot
from dsr1d.contract.telemetry import UNAVAILABLE, Unavailable, describe_oserror
from dsr1d.contract.tunable import Support

STAT = "proc/stat"
LOADAVG = "proc/loadavg"
MEMINFO = "proc/meminfo"


def parse_stat(text: str) -> dict[str, tuple[int, int]]:
    """``{"cpu": (busy, total), "cpu0": …}`` in jiffies; idle = idle + iowait."""
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        if not line.startswith("cpu"):
            continue
        parts = line.split()
        try:
            fields = [int(x) for x in parts[1:]]
        except ValueError:
            continue
        if len(fields) < 4:
            continue
        # user nice system idle iowait irq softirq steal guest guest_nice; guest time is
        # already counted in user/nice.
        total = sum(fields[:8])
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        out[parts[0]] = (total - idle, total)
    return out


def _cpu_number(name: str) -> int:
    return int(name[3:])


class ProcStat:
    name = "procstat"
    summary = "CPU utilisation (/proc/stat), load (/proc/loadavg), available memory"
    priority = 80

    def __init__(self) -> None:
        self.last: dict[str, tuple[int, int]] | None = None

    def probe(self, root: SysRoot) -> Support:
        if not root.exists(STAT):
            return Support(False, f"{root.display(STAT)} is missing (no procfs)")
        return Support(True, root.display(STAT))

    def start(self, root: SysRoot) -> None:
        self.last = None

    def stop(self) -> None:
        self.last = None

    def read(self, root: SysRoot, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        missing: dict[str, str] = {}
        try:
            load = root.read(LOADAVG).split()
            out[LOAD_1M], out["load_5m"], out["load_15m"] = (float(x) for x in load[:3])
        except (OSError, ValueError) as exc:
            missing["loadavg"] = describe_oserror(exc) if isinstance(exc, OSError) \
                else f"{root.display(LOADAVG)}: unparseable"
        try:
            text = root.path(MEMINFO).read_text()
            for line in text.splitlines():
                if line.startswith("MemAvailable:"):
                    out["memory_available_bytes"] = int(line.split()[1]) * 1024
                    break
        except (OSError, ValueError, IndexError):
            pass  # old kernels lack MemAvailable: leave it out
        try:
            stat = parse_stat(root.path(STAT).read_text())
        except OSError as exc:
            raise Unavailable(describe_oserror(exc, root.display(STAT))) from exc
        previous, self.last = self.last, stat
        if previous is not None:
            util = self._util(previous, stat)
            if "cpu" in util:
                out["util_percent"] = util.pop("cpu")
            per_cpu = sorted(util.items(), key=lambda kv: _cpu_number(kv[0]))
            if per_cpu and set(util) == {k for k in stat if k != "cpu"}:
                out["cpu_util_percent"] = [v for _, v in per_cpu]
            elif per_cpu:
                missing["cpu_util"] = ("no per-CPU list this interval (a CPU went offline or "
                                       "online, or its counters reset)")
        if missing:
            out[UNAVAILABLE] = missing
        return out

    @staticmethod
    def _util(before: dict[str, tuple[int, int]],
              after: dict[str, tuple[int, int]]) -> dict[str, float]:
        out = {}
        for name, (busy, total) in after.items():
            if name not in before:
                continue
            d_busy = busy - before[name][0]
            d_total = total - before[name][1]
            if d_total <= 0 or d_busy < 0 or d_busy > d_total:
                continue  # no time passed, or counters reset (CPU hotplug): no value
            out[name] = round(100.0 * d_busy / d_total, 2)
        return out


@hookimpl
def register_telemetry_sources(register: Any) -> None:
    register(ProcStat())
