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


_sock: socket.socket | None = None
_spare: list[int] = []
SPARE_FDS = 16


def reserve() -> None:
    """Open now what the way out needs, so a process out of descriptors can still restore:
    the notify socket (kept for every later ``notify``), the soft descriptor limit raised to
    the hard one, and ``SPARE_FDS`` descriptors held until ``release_spares``."""
    global _sock
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError):
            pass
    if _sock is None and os.environ.get("NOTIFY_SOCKET"):
        _sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
    while len(_spare) < SPARE_FDS:
        _spare.append(os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC))


def release_spares() -> None:
    """Give the reserved descriptors back: the lowest free numbers, so the restore that
    follows can open the journal and every knob even when the table was full."""
    while _spare:
        os.close(_spare.pop())


def notify(**fields: str) -> bool:
    """Send ``READY=1``-style fields to ``$NOTIFY_SOCKET``; False when not under systemd or
    when it cannot be sent (never an exception: STOPPING=1 must not stop a restore).

    Never blocks: a notify socket nobody reads (a stuck manager, a test) must not stall the
    event loop, so a full queue drops the message (sd_notify itself would wait).
    """
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    data = "\n".join(f"{k}={v}" for k, v in fields.items()).encode()
    try:
        if _sock is not None:
            _sock.sendto(data, socket.MSG_DONTWAIT, address)
            return True
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
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
