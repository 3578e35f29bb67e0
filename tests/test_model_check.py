"""``dsr1d model check``: llama.cpp's logits on dsr1d's conversion against the torch fp32
reference, on the tiny synthetic model. A faithful conversion passes; a conversion whose
weights were damaged on disk is caught."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

pytest_plugins = ["engine_fixtures"]


def check(model: Path, cache: Path, *dtypes: str) -> subprocess.CompletedProcess[str]:
    args = [a for d in dtypes for a in ("--dtype", d)]
    return subprocess.run([sys.executable, "-m", "dsr1d.edges.admin", "model", "check",
                           str(model), "--cache-dir", str(cache), "--threads", "2", "--json",
                           *args], capture_output=True, text=True, timeout=600)


def test_the_engine_agrees_with_the_reference(tiny_model: Path, tmp_path: Path) -> None:
    proc = check(tiny_model, tmp_path / "cache", "bf16", "int4")
    assert proc.returncode == 0, proc.stderr
    rows = {r["label"]: r for r in json.loads(proc.stdout)}
    assert set(rows) == {"llama.cpp bf16", "torch bf16", "llama.cpp int4", "torch int4"}
    assert rows["llama.cpp bf16"]["cosine_min"] > 0.9995 and rows["llama.cpp bf16"]["passed"]
    assert rows["llama.cpp bf16"]["top1"] >= 0.95
    assert rows["llama.cpp int4"]["passed"]


def test_a_damaged_conversion_is_caught(tiny_model: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert check(tiny_model, cache, "bf16").returncode == 0
    (gguf,) = cache.rglob("*.gguf")
    data = bytearray(gguf.read_bytes())
    tail = len(data) // 2                      # tensor data: the second half of the file
    data[tail:] = bytes(b ^ 0x80 if i % 2 else b for i, b in enumerate(data[tail:]))  # signs
    gguf.write_bytes(bytes(data))
    proc = check(tiny_model, cache, "bf16")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = {r["label"]: r for r in json.loads(proc.stdout)}
    damaged = rows["llama.cpp bf16"]
    assert damaged["passed"] is False and damaged["cosine_min"] < 0.9995
    assert rows["torch bf16"]["cosine_min"] > 0.9995      # the reference itself is untouched


def test_a_directory_that_is_not_a_model_is_a_clear_error(tmp_path: Path) -> None:
    proc = check(tmp_path, tmp_path / "cache", "bf16")
    assert proc.returncode == 2 and "no config.json" in proc.stderr
