"""Telemetry available today: load, per-CPU utilisation and frequency (psutil).

Keys carry their unit. What the machine does not report is left out, never invented.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psutil


class Sampler:
    """Takes one sample on demand; utilisation is measured since the previous sample."""

    def __init__(self) -> None:
        psutil.cpu_percent(percpu=True)  # primes the counters for the first real sample
        self.latest: dict[str, Any] = {}

    def sample(self) -> dict[str, Any]:
        """A fresh sample: ``{key_with_unit: value}``."""
        load1, load5, load15 = os.getloadavg()
        sample: dict[str, Any] = {
            "time_unix_s": time.time(),
            "load_1m": load1,
            "load_5m": load5,
            "load_15m": load15,
            "cpu_util_percent": [float(p) for p in psutil.cpu_percent(percpu=True)],
            "memory_available_bytes": int(psutil.virtual_memory().available),
        }
        freqs = psutil.cpu_freq(percpu=True) or []
        if freqs and any(f.current for f in freqs):
            sample["cpu_freq_mhz"] = [float(f.current) for f in freqs]
        self.latest = sample
        return sample
