"""A skipped test is a lost check, not a pass, where it should run.

``make test`` (and so CI) sets ``DSR1D_NO_SKIPS=1``: on the machines it runs on every test can
run (root, dbus-daemon, systemd-nspawn, the model set-up fetched), so a skip there fails the
session, listing each skipped test and why. Plain ``pytest`` still skips what a machine lacks.
"""

from __future__ import annotations

import os

import pytest

_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _skipped.append(f"{report.nodeid}: {reason}")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _skipped and os.environ.get("DSR1D_NO_SKIPS") == "1" and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _skipped and os.environ.get("DSR1D_NO_SKIPS") == "1":
        terminalreporter.section("skipped where every test should run (DSR1D_NO_SKIPS=1)",
                                 red=True)
        for line in _skipped:
            terminalreporter.line(line)
