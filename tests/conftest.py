"""Shared fixtures: fake roots, the CLI as a subprocess, and real-knob guards."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from fakeroot import FakeRoot, intel_box

pytest_plugins = ["strict_skips"]
REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent


@pytest.fixture
def fake(tmp_path: Path) -> FakeRoot:
    """An Intel server with every tunable present."""
    return intel_box(tmp_path / "root")


def run_dsr1d(*args: str, env: dict[str, str] | None = None,
              check: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the real ``dsr1d`` command line in a subprocess."""
    full_env = {**os.environ, "PYTHONPATH": str(TESTS), **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "dsr1d.edges.admin", *args], capture_output=True,
                          text=True, env=full_env, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"dsr1d {' '.join(args)} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture
def dsr1d():
    return run_dsr1d
