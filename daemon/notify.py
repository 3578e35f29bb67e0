"""systemd integration: sd_notify (readiness, status, watchdog) and where logs go."""

from __future__ import annotations

import logging
import os
import sys

try:
    from systemd import daemon as sd_daemon
    from systemd import journal as sd_journal
except ImportError:  # pragma: no cover - systemd-python is a dependency; degrade if absent
    sd_daemon = None
    sd_journal = None

JOURNAL_SOCKET = "/run/systemd/journal/socket"


def notify(**fields: str) -> bool:
    """Send ``READY=1``-style fields to ``$NOTIFY_SOCKET``; False when not under systemd."""
    if sd_daemon is None or not os.environ.get("NOTIFY_SOCKET"):
        return False
    return bool(sd_daemon.notify("\n".join(f"{k}={v}" for k, v in fields.items())))


def watchdog_interval_s() -> float | None:
    """Half the watchdog timeout systemd asked for, or None when there is no watchdog."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2_000_000


def under_journald() -> bool:
    """True when stderr is connected to journald (``$JOURNAL_STREAM``) and its socket exists."""
    return bool(os.environ.get("JOURNAL_STREAM")) and os.path.exists(JOURNAL_SOCKET)


def setup_logging(verbose: bool = False) -> logging.Logger:
    """Log to journald with structured fields when under it, to stderr otherwise."""
    logger = logging.getLogger("dsr1d")
    logger.handlers.clear()
    logger.setLevel(logging.DEBUG if verbose else logging.INFO)
    if sd_journal is not None and under_journald():
        handler: logging.Handler = sd_journal.JournalHandler(SYSLOG_IDENTIFIER="dsr1d")
        handler.setFormatter(logging.Formatter("%(message)s"))
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("dsr1d[%(process)d]: %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    return logger
