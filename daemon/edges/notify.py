"""systemd integration: sd_notify (readiness, status, watchdog) and where logs go."""

from __future__ import annotations

import logging
import os
import socket
import sys

try:
    from systemd import journal as sd_journal
except ImportError:  # pragma: no cover - systemd-python is a dependency; degrade if absent
    sd_journal = None

JOURNAL_SOCKET = "/run/systemd/journal/socket"


def notify(**fields: str) -> bool:
    """Send ``READY=1``-style fields to ``$NOTIFY_SOCKET``; False when not under systemd.

    Never blocks: a notify socket nobody reads (a stuck manager, a test) must not stall the
    event loop, so a full queue drops the message (sd_notify itself would wait).
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    data = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        try:
            sock.sendto(data, socket.MSG_DONTWAIT, address)
        except OSError:
            return False
    return True


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
