"""ruff (pyflakes and pycodestyle, pyproject.toml's [tool.ruff]) passes on the whole tree:
undefined and unused names and redefinitions fail make test, not a user."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing() -> None:
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "daemon", "plugins", "tests",
                           "bench", "tools"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
