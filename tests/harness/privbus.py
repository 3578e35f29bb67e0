"""A private dbus-daemon shaped like the system bus (TESTING-RECIPES.md).

The host's ``/usr/share/dbus-1/system.conf`` is copied with the parts that tie it to the real
system bus removed (``<user>``, ``<syslog/>``, the service helper, the standard include
directories and the host's local overrides); it listens on ``$T/system_bus_socket`` and reads
policy files from ``$T/system.d``.  Clients find it through ``DBUS_SYSTEM_BUS_ADDRESS``, so
``busctl --system``, ``dbus-send --system`` and ``BusType.SYSTEM`` all reach it.

Usable without pytest::

    python3 tests/harness/privbus.py etc/dbus-1/system.d/org.dsr1d.conf

prints ``export DBUS_SYSTEM_BUS_ADDRESS=...`` and keeps the bus up until interrupted.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable

SYSTEM_CONF = Path("/usr/share/dbus-1/system.conf")

# (pattern, replacement); every pattern must match once, so a changed system.conf fails loudly.
_DROP = (
    r"<user>[^<]*</user>",
    r"<syslog/>",
    r"<servicehelper>[^<]*</servicehelper>",
    r"<pidfile>[^<]*</pidfile>",
    r"<includedir>/etc/dbus-1/system\.d</includedir>",
    # The host's own overrides would make the private bus depend on this machine's set-up.
    r'<include ignore_missing="yes">/etc/dbus-1/system\.conf</include>',
    r'<include ignore_missing="yes">/etc/dbus-1/system-local\.conf</include>',
)


def make_config(template: str, tmpdir: Path) -> str:
    """Return ``template`` (a system.conf) rewritten to live entirely in ``tmpdir``."""
    text = template
    for pattern in _DROP:
        text = _sub_once(pattern, "", text)
    text = _sub_once(r"<listen>[^<]*</listen>",
                     f"<listen>unix:path={tmpdir}/system_bus_socket</listen>", text)
    # The relative includedir sits after the default policy; ours takes its place.
    return _sub_once(r"<includedir>system\.d</includedir>",
                     f"<includedir>{tmpdir}/system.d</includedir>", text)


def _sub_once(pattern: str, replacement: str, text: str) -> str:
    new, count = re.subn(pattern, lambda _m: replacement, text)
    if count != 1:
        raise RuntimeError(f"{SYSTEM_CONF}: expected one match of {pattern!r}, found {count}")
    return new


class PrivateBus:
    """Context manager: a private system-like bus; ``.address`` and ``.env()`` reach it."""

    def __init__(self, policies: Iterable[str | os.PathLike[str]] = (),
                 tmpdir: str | os.PathLike[str] | None = None) -> None:
        self.policies = [Path(p) for p in policies]
        self._given_tmpdir = tmpdir
        self.tmpdir: Path | None = None
        self.address: str | None = None
        self.pid: int | None = None

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """``base`` (default: ``os.environ``) with ``DBUS_SYSTEM_BUS_ADDRESS`` set to this bus."""
        if self.address is None:
            raise RuntimeError("the private bus is not running")
        return {**(os.environ if base is None else base), "DBUS_SYSTEM_BUS_ADDRESS": self.address}

    def start(self) -> "PrivateBus":
        if self._given_tmpdir is None:
            self.tmpdir = Path(tempfile.mkdtemp(prefix="dsr1d-bus-"))
        else:
            self.tmpdir = Path(self._given_tmpdir)
            self.tmpdir.mkdir(parents=True, exist_ok=True)
        # mkdtemp makes 0700; an unprivileged client must be able to reach the socket inside.
        os.chmod(self.tmpdir, 0o755)
        (self.tmpdir / "system.d").mkdir(exist_ok=True)
        for policy in self.policies:
            shutil.copy(policy, self.tmpdir / "system.d" / policy.name)
        conf = self.tmpdir / "system.conf"
        conf.write_text(make_config(SYSTEM_CONF.read_text(), self.tmpdir))
        self._spawn(conf)
        return self

    def _spawn(self, conf: Path) -> None:
        log = open(self.tmpdir / "dbus-daemon.log", "ab")
        with log:
            # With --fork the parent exits once the daemon has printed both lines; the daemon
            # itself lets go of our stdout, so communicate() does not wait for it.
            proc = subprocess.run(
                ["dbus-daemon", f"--config-file={conf}", "--print-address=1", "--print-pid=1",
                 "--fork", "--nopidfile"],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                timeout=30)
        lines = proc.stdout.split()
        if proc.returncode != 0 or len(lines) < 2:
            raise RuntimeError(f"dbus-daemon failed ({proc.returncode}): {proc.stdout!r}\n"
                               f"{self.log()}")
        self.address, self.pid = lines[0], int(lines[1])
        _check_socket(self.tmpdir / "system_bus_socket")

    def log(self) -> str:
        """What dbus-daemon wrote to stderr (policy parse errors land here)."""
        try:
            return (self.tmpdir / "dbus-daemon.log").read_text(errors="replace")
        except (OSError, TypeError):
            return ""

    def stop(self) -> None:
        if self.pid is not None:
            _kill_and_wait(self.pid)
            self.pid = None
        self.address = None
        if self.tmpdir is not None and self._given_tmpdir is None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def __enter__(self) -> "PrivateBus":
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _check_socket(path: Path) -> None:
    for _ in range(100):
        if path.exists():
            return
        time.sleep(0.05)
    raise RuntimeError(f"dbus-daemon did not create {path}")


def _kill_and_wait(pid: int, timeout: float = 5.0) -> None:
    """Terminate the forked daemon (not our child: it was reparented) and wait until it is gone."""
    for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, timeout)):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.02)
    raise RuntimeError(f"dbus-daemon {pid} survived SIGKILL")


def _alive(pid: int) -> bool:
    # A zombie counts as gone: whoever adopted the daemon may be slow to reap it.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")


def main(argv: list[str] | None = None) -> int:
    """Run a private bus with the given policy files until interrupted."""
    policies = sys.argv[1:] if argv is None else argv
    if any(p in ("-h", "--help") for p in policies):
        print(f"usage: {Path(sys.argv[0]).name} [POLICY.conf ...]")
        return 0
    with PrivateBus(policies) as bus:
        print(f"export DBUS_SYSTEM_BUS_ADDRESS={bus.address}", flush=True)
        print(f"# dbus-daemon pid {bus.pid}, files in {bus.tmpdir}; Ctrl-C stops it",
              file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
