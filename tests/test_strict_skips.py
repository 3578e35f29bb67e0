"""`make test` fails when a test is skipped (DSR1D_NO_SKIPS=1); plain pytest does not."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def run(tmp_path: Path, strict: bool) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n\n"
        "def test_runs():\n    assert True\n\n"
        "def test_cannot_here():\n    pytest.skip('needs a thing this machine lacks')\n")
    env = {**os.environ, "PYTHONPATH": str(TESTS), "DSR1D_NO_SKIPS": "1" if strict else "0"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "strict_skips", str(tmp_path / "test_sample.py")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)


def test_a_skip_fails_the_strict_run_and_is_named(tmp_path: Path) -> None:
    proc = run(tmp_path, strict=True)
    assert proc.returncode == 1, proc.stdout
    assert "test_cannot_here: Skipped: needs a thing this machine lacks" in proc.stdout


def test_a_plain_run_still_skips(tmp_path: Path) -> None:
    proc = run(tmp_path, strict=False)
    assert proc.returncode == 0, proc.stdout
    assert "1 passed, 1 skipped" in proc.stdout
