"""dsr1d's llama.cpp patches apply to the release source exactly (``patch --fuzz=0``): every one
applies as it is, and one whose context has drifted stops the build with its name instead of
landing somewhere else."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def source(tools: Path, out: Path) -> subprocess.CompletedProcess[str]:
    """``llama_source`` of ``tools/llama-source.sh`` (as the wheel and server builds call it)."""
    return subprocess.run(["bash", "-c", f'set -e; source "{tools}/llama-source.sh"; '
                                         f'llama_source "{sys.executable}" "{out}"'],
                          capture_output=True, text=True, timeout=600)


def test_every_patch_applies_without_fuzz(tmp_path: Path) -> None:
    proc = source(REPO / "tools", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (tree,) = tmp_path.glob("llama_cpp_python-*/vendor/llama.cpp")
    assert "@DSR1D_PATCHES@" not in (tree / "src/llama.cpp").read_text()   # the marker filled


def test_a_patch_whose_context_drifted_stops_the_build(tmp_path: Path) -> None:
    tools = tmp_path / "tools"
    shutil.copytree(REPO / "tools", tools)
    patch = tools / "llama-patches/amx-tile-config.patch"
    lines = patch.read_text().splitlines(keepends=True)
    first_hunk = next(i for i, line in enumerate(lines) if line.startswith("@@"))
    context = next(i for i in range(first_hunk + 1, len(lines)) if lines[i].startswith(" ")
                   and lines[i].strip())
    lines[context] = " // a line that moved upstream\n"   # patch's default fuzz would take this
    patch.write_text("".join(lines))
    proc = source(tools, tmp_path / "out")
    assert proc.returncode != 0
    assert "amx-tile-config.patch: does not apply" in proc.stderr
