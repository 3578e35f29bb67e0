"""ruff (pyflakes and pycodestyle, pyproject.toml's [tool.ruff]) passes on the whole tree, and
mypy --strict on the contract layer and the whole core layer (every module of dsr1d.core):
undefined and unused names, redefinitions and type errors fail make test, not a user. (What
they import from outside those two packages is followed silently: its errors are not reported.)
And no docstring of the package carries a timing, which would go stale where no bench reruns it."""

from __future__ import annotations

import ast
import re
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


# a measured time or rate: "3.5–4.6 ms", "21.9 tok/s", "35 GB/s"
TIMING = re.compile(r"\d(?:[\d.,]*\d)?(?:\s?[–-]\s?\d[\d.,]*)?\s?(?:ms|µs|tok/s|GB/s|MB/s)(?![\w/])")


def test_docstrings_carry_no_timings() -> None:
    """Timings go stale where nothing reruns them: they belong to the benches' blocks in docs/.
    The simulator's docstrings are exempt: they state the simulated hardware's parameters."""
    found = []
    for path in sorted((REPO / "src" / "dsr1d").rglob("*.py")):
        if "sim" in path.relative_to(REPO / "src" / "dsr1d").parts[:1]:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                found += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in TIMING.finditer(doc)]
    assert not found, found
