"""A dsr1d plugin that stops the process at a chosen ``before_write`` call, and its test driver.

The plugin half runs inside ``dsr1d`` (``DSR1D_PLUGINS=crashplugin``, this directory on
``PYTHONPATH``). It counts the process's ``before_write`` hook calls (0-based: every journal
replacement and every knob write, just before it happens) and is steered by the environment:

``DSR1D_CRASH_AT`` unset or empty
    Does nothing at all.
``DSR1D_CRASH_AT=-1`` (any negative number)
    Trace mode: appends ``call N TARGET KEY VALUE`` for every call to ``DSR1D_CRASH_REPORT``
    (when set) and never stops.
``DSR1D_CRASH_AT=N``
    At call N, writes one line ``paused N TARGET KEY VALUE`` to ``DSR1D_CRASH_REPORT`` (a FIFO
    the test reads, or a plain file) and blocks, before the write it announces happens, until
    the test SIGKILLs the process.

    When ``DSR1D_CRASH_RESUME`` names a FIFO, it waits for one line on that FIFO instead and
    then carries on with the write: the test can change the machine under a running apply.

A paused process that nobody attends to ends itself after ``DSR1D_CRASH_MAX_WAIT`` seconds
(default 600) by SIGALRM, whose default action terminates it without the announced write, so an
interrupted test run leaves no process behind for long.

The driver half (:func:`trace`, :func:`start`) runs in the test: it starts ``dsr1d`` as a real
subprocess, waits for the pause announcement (a bounded wait on the FIFO and on the process,
never a sleep) and then kills or resumes it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from dsr1d.contract.hookspecs import hookimpl

HERE = Path(__file__).resolve().parent

# -- plugin (inside dsr1d) -----------------------------------------------------------------------

_calls = 0


def _report(line: str) -> None:
    path = os.environ.get("DSR1D_CRASH_REPORT")
    if not path:
        return
    # "a" is O_WRONLY|O_APPEND|O_CREAT, which also opens an existing FIFO (it blocks until the
    # reader is there; the driver opens the reading end before it starts this process).
    with open(path, "a") as f:
        f.write(line + "\n")


def _wait_for_resume(fd: int) -> None:
    """Block until a line, or the writer's hang-up, arrives on the resume FIFO ``fd``."""
    data = b""
    while not data.endswith(b"\n"):
        select.select([fd], [], [])
        try:
            chunk = os.read(fd, 4096)
        except BlockingIOError:
            continue
        if not chunk:  # the writer came and went
            break
        data += chunk


@hookimpl
def before_write(target: str, key: str, value: str) -> None:
    global _calls
    at_text = os.environ.get("DSR1D_CRASH_AT", "").strip()
    if not at_text:
        return
    n = _calls
    _calls += 1
    at = int(at_text)
    if at < 0:
        _report(f"call {n} {target} {key} {value}")
        return
    if n != at:
        return
    signal.alarm(int(os.environ.get("DSR1D_CRASH_MAX_WAIT", "600")))
    resume = os.environ.get("DSR1D_CRASH_RESUME")
    resume_fd = None
    if resume:
        # The reading end is opened before the announcement, so that the driver can open the
        # writing end without blocking as soon as it has read it.
        resume_fd = os.open(resume, os.O_RDONLY | os.O_NONBLOCK)
    _report(f"paused {n} {target} {key} {value}")
    if resume_fd is None:
        while True:
            signal.pause()
    try:
        _wait_for_resume(resume_fd)
    finally:
        os.close(resume_fd)
    signal.alarm(0)


# -- driver (in the test) ------------------------------------------------------------------------

PAUSE_TIMEOUT_S = 60.0  # the longest the driver waits for an announcement
MAX_WAIT_S = 300.0      # a process the driver paused ends itself after this (test crashed)


@dataclass(frozen=True)
class Call:
    """One before_write call: ``journal`` + the journal's path, or ``knob`` + key + value."""

    n: int
    target: str
    key: str
    value: str

    @classmethod
    def parse(cls, line: str, word: str) -> Call:
        first, n, target, key, *value = line.split(" ", 4)
        if first != word:
            raise ValueError(f"expected a {word!r} line, got {line!r}")
        return cls(int(n), target, key, value[0] if value else "")


def env(**extra: str) -> dict[str, str]:
    """The environment for a ``dsr1d`` that loads this plugin (no other DSR1D_* leaks in)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("DSR1D_")}
    return {**base, "PYTHONPATH": str(HERE), "DSR1D_PLUGINS": "crashplugin", **extra}


def dsr1d_command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "dsr1d.edges.admin", *args]


def trace(args: list[str], report: Path) -> tuple[subprocess.CompletedProcess[str], list[Call]]:
    """Run ``dsr1d ARGS`` to the end in trace mode: its result and every before_write call."""
    proc = subprocess.run(dsr1d_command(args), capture_output=True, text=True, timeout=120,
                          env=env(DSR1D_CRASH_AT="-1", DSR1D_CRASH_REPORT=str(report)))
    lines = report.read_text().splitlines() if report.exists() else []
    calls = [Call.parse(line, "call") for line in lines]
    assert [c.n for c in calls] == list(range(len(calls))), lines
    return proc, calls


def _read_line(fd: int, pid: int, timeout: float) -> str | None:
    """The first line written to the FIFO ``fd``; None if process ``pid`` ends first."""
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    poller.register(pidfd, select.POLLIN)
    deadline = time.monotonic() + timeout
    data = b""
    try:
        while b"\n" not in data:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            ready = {ready_fd for ready_fd, _ in poller.poll(remaining * 1000)}
            try:
                chunk = os.read(fd, 4096)
            except BlockingIOError:
                chunk = None
            if chunk:
                data += chunk
            elif (chunk == b"" and fd in ready) or pidfd in ready:
                break  # the writer hung up without a full line, or the process ended
    finally:
        os.close(pidfd)
    return data.decode().split("\n")[0] if b"\n" in data else None


class Paused:
    """A ``dsr1d`` process stopped right before before_write call ``call.n``."""

    def __init__(self, proc: subprocess.Popen[str], call: Call, resume_fifo: Path | None) -> None:
        self.proc = proc
        self.call = call
        self._resume_fifo = resume_fifo

    def __enter__(self) -> Paused:
        return self

    def __exit__(self, *exc: object) -> None:
        """Whatever happened in the block, leave no paused process behind."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()

    def kill(self) -> None:
        """SIGKILL it where it stands."""
        self.proc.kill()
        self.proc.communicate()
        assert self.proc.returncode == -signal.SIGKILL, self.proc.returncode

    def resume(self) -> subprocess.CompletedProcess[str]:
        """Let it make the announced write and run to the end; its result."""
        assert self._resume_fifo is not None, "started without resumable=True"
        fd = os.open(self._resume_fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(fd, b"resume\n")
        finally:
            os.close(fd)
        out, err = self.proc.communicate(timeout=120)
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)


def start(args: list[str], at: int, workdir: Path, resumable: bool = False) -> Paused:
    """Start ``dsr1d ARGS`` and return once it has paused before before_write call ``at``.

    ``workdir`` must exist; the FIFOs are made in it. AssertionError when the process ends
    without pausing there (it is killed first if it is still running after the wait). Use the
    result as a context manager so that a failing test leaves no paused process behind.
    """
    report = workdir / f"report-{at}.fifo"
    os.mkfifo(report)
    extra = {"DSR1D_CRASH_AT": str(at), "DSR1D_CRASH_REPORT": str(report),
             "DSR1D_CRASH_MAX_WAIT": str(int(MAX_WAIT_S))}
    resume = None
    if resumable:
        resume = workdir / f"resume-{at}.fifo"
        os.mkfifo(resume)
        extra["DSR1D_CRASH_RESUME"] = str(resume)
    rfd = os.open(report, os.O_RDONLY | os.O_NONBLOCK)
    try:
        proc = subprocess.Popen(dsr1d_command(args), env=env(**extra), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            line = _read_line(rfd, proc.pid, PAUSE_TIMEOUT_S)
        except BaseException:
            proc.kill()
            proc.communicate()
            raise
    finally:
        os.close(rfd)
    if line is None:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"dsr1d {' '.join(args)} did not pause before call {at} "
                             f"(exit {proc.returncode})\n{out}\n{err}")
    return Paused(proc, Call.parse(line, "paused"), resume)
