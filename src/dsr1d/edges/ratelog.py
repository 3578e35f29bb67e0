"""One log line per interval for a thing that repeats, with the count of those not logged: a
stranger repeating a refused call or connection cannot flood the journal."""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable

INTERVAL_S = 10.0


class Tally:
    """``tally(key, level, fmt, *args)`` logs the first of each ``key`` in an interval and
    counts the rest; the next line logged for that key says how many were not."""

    def __init__(self, logger: logging.Logger, interval_s: float = INTERVAL_S) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self._seen: dict[Hashable, tuple[float, int]] = {}

    def __call__(self, key: Hashable, level: int, fmt: str, *args: object) -> bool:
        """Log (True) or count (False) one occurrence of ``key``."""
        now = time.monotonic()
        since, count = self._seen.get(key, (-self.interval_s, 0))
        if now - since < self.interval_s:
            self._seen[key] = (since, count + 1)
            return False
        if len(self._seen) > 4096:       # keys a caller chooses must not grow without bound
            self._seen.clear()
        more = f" ({count} more like it in the last {self.interval_s:.0f} s)" if count else ""
        self.logger.log(level, fmt + "%s", *args, more)
        self._seen[key] = (now, 0)
        return True
