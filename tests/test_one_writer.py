"""One writer: while the daemon runs it owns the journal, and the admin commands that write
(``dsr1d apply``, ``dsr1d restore``) refuse and say so instead of fighting it; after a crash the
unit's ``ExecStopPost=dsr1d restore`` finds the journal the daemon used through the daemon's own
configuration file. The real daemon on a private bus against a fake root.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.register_assert_rewrite("daemon_fixtures")
from daemon_fixtures import active, knobs  # noqa: E402

pytest_plugins = ["daemon_fixtures"]

EXIT_BUSY = 4


def dsr1d(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dsr1d.edges.admin", *args], capture_output=True,
                          text=True, timeout=60)


def test_apply_and_restore_refuse_while_the_daemon_owns_the_journal(daemon, bus, fake) -> None:
    applied = knobs(fake)
    journal = fake.path / "run/dsr1d/state.json"
    for command in (["apply", "latency"], ["restore"], ["restore", "--discard"]):
        proc = dsr1d(*command, "--root", str(fake.path))
        assert proc.returncode == EXIT_BUSY, (command, proc.stdout, proc.stderr)
        assert "the dsr1d daemon" in proc.stderr and f"pid {daemon.pid}" in proc.stderr
        assert "dsr1ctl profile" in proc.stderr
        assert knobs(fake) == applied and journal.exists()
    assert active(bus) == "sustained"
    # Reading is fine while it runs.
    assert dsr1d("verify", "--root", str(fake.path)).returncode == 0
    assert dsr1d("apply", "latency", "--dry-run", "--root", str(fake.path)).returncode == 0


def test_after_the_daemon_stops_the_admin_commands_work_again(daemon, fake) -> None:
    assert daemon.stop() == 0
    assert dsr1d("apply", "latency", "--root", str(fake.path)).returncode == 0
    assert dsr1d("restore", "--root", str(fake.path)).returncode == 0


def test_a_second_daemon_on_the_same_journal_does_not_start(daemon, start_daemon) -> None:
    second = start_daemon(ready=False)
    assert second.wait() == 1
    assert "owns" in second.log()


def test_restore_after_a_crash_finds_the_journal_named_in_the_config(
        start_daemon, fake, tmp_path: Path) -> None:
    """The unit runs plain ``dsr1d restore``: the journal path must come from dsr1d.conf."""
    before = knobs(fake)
    journal = tmp_path / "elsewhere" / "journal.json"
    config = tmp_path / "custom.conf"
    config.write_text(f"[daemon]\ndefault_profile = sustained\nroot = {fake.path}\n"
                      f"journal = {journal}\n")
    daemon = start_daemon(config_path=config)
    assert journal.exists() and knobs(fake) != before
    daemon.kill()
    proc = dsr1d("restore", "--config", str(config))
    assert proc.returncode == 0, proc.stderr
    assert knobs(fake) == before and not journal.exists()
    assert "restored" in proc.stdout


def test_verify_without_a_journal_says_nothing_is_applied(fake) -> None:
    proc = dsr1d("verify", "--root", str(fake.path))
    assert proc.returncode == 0 and "no profile applied" in proc.stdout


def test_the_flags_the_daemon_ran_with_reach_its_journal_from_every_command(
        start_daemon, fake, tmp_path: Path) -> None:
    """``dsr1d run --root R --config C`` with ``journal = J`` in C: ``apply`` and ``restore``
    given the same ``--root R --config C`` use J too — refused while the daemon runs, restoring
    from J after it was killed — and never R's default journal."""
    before = knobs(fake)
    journal = tmp_path / "elsewhere" / "journal.json"
    config = tmp_path / "custom.conf"
    config.write_text(f"[daemon]\ndefault_profile = sustained\njournal = {journal}\n")
    default = fake.path / "run/dsr1d/state.json"
    flags = ("--root", str(fake.path), "--config", str(config))
    daemon = start_daemon(config_path=config)
    assert journal.exists() and not default.exists()
    applied = knobs(fake)
    proc = dsr1d("apply", "latency", *flags)
    assert proc.returncode == EXIT_BUSY, proc.stderr     # the one writer is the daemon
    assert knobs(fake) == applied and not default.exists()
    daemon.kill()
    proc = dsr1d("restore", *flags)
    assert proc.returncode == 0 and "restored" in proc.stdout, proc.stderr
    assert knobs(fake) == before and not journal.exists() and not default.exists()
    # --journal still wins over the config's
    other = tmp_path / "other.json"
    assert dsr1d("apply", "latency", *flags, "--journal", str(other)).returncode == 0
    assert other.exists() and not journal.exists()
    assert dsr1d("restore", *flags, "--journal", str(other)).returncode == 0
    assert knobs(fake) == before
