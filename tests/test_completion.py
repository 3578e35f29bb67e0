"""Bash completion: commands, options and profile names, completed by the real scripts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def complete(tmp_path: Path, tool: str, *words: str) -> list[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    module = "dsr1d.edges.admin" if tool == "dsr1d" else "dsr1d.client.cli"
    launcher = bin_dir / tool
    launcher.write_text(f"#!/bin/sh\nexec {sys.executable} -m {module} \"$@\"\n")
    launcher.chmod(0o755)
    script = REPO / "etc/bash-completion" / tool
    quoted = " ".join(f"'{w}'" for w in (tool, *words))
    command = (f"source {script}; COMP_WORDS=({quoted}); COMP_CWORD={len(words)}; "
               f"_{tool}; printf '%s\\n' \"${{COMPREPLY[@]}}\"")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_dsr1d_completes_commands_and_profile_names(tmp_path: Path) -> None:
    assert complete(tmp_path, "dsr1d", "ap") == ["apply"]
    assert complete(tmp_path, "dsr1d", "apply", "thr") == ["throughput"]
    assert "--dry-run" in complete(tmp_path, "dsr1d", "apply", "--")


def test_dsr1ctl_completes_commands_and_options(tmp_path: Path) -> None:
    assert complete(tmp_path, "dsr1ctl", "rel") == ["reload"]
    assert complete(tmp_path, "dsr1ctl", "profile", "--re") == ["--reapply"]
    assert "--greedy" in complete(tmp_path, "dsr1ctl", "generate", "--")
