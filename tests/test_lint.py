"""ruff (pyflakes and pycodestyle, pyproject.toml's [tool.ruff]) passes on the whole tree, and
mypy --strict on the contract layer and the whole core layer (every module of dsr1d.core):
undefined and unused names, redefinitions and type errors fail make test, not a user. (What
they import from outside those two packages is followed silently: its errors are not reported.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "src", "tests", "bench", "tools"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_mypy_strict_passes_on_the_contract_and_core() -> None:
    """The contract and core packages, every module of both; what they import from elsewhere is
    followed silently (--follow-imports=silent): its errors are not reported."""
    proc = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--ignore-missing-imports",
                           "--follow-imports=silent", "--no-incremental", "-p", "dsr1d.contract",
                           "-p", "dsr1d.core"],
                          cwd=REPO / "src", capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
