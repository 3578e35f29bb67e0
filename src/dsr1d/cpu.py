"""This machine's CPU as /proc/cpuinfo names it: a shared leaf, so the engine and the edges read
the flags and the model name one way without importing the core (which reads them through a
root, for the fake roots the tests build)."""

from __future__ import annotations

CPUINFO = "/proc/cpuinfo"


def _field(name: str, path: str) -> str | None:
    try:
        with open(path) as f:
            for line in f:
                if line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags(path: str = CPUINFO) -> set[str]:
    """The first processor's flags (``avx512f``, ``amx_tile``…); empty when unreadable."""
    return set((_field("flags", path) or "").split())


def cpu_model(path: str = CPUINFO) -> str:
    """The first processor's model name, or ``unknown``."""
    return _field("model name", path) or "unknown"
