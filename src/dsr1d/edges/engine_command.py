"""llama-server's command line and environment, as the daemon starts it (pure: no processes).

The daemon's placement and memory handling reach llama-server as flags and environment:
one thread per physical core of one NUMA node, pinned one to a CPU (``--cpu-mask`` with
``--cpu-strict``), the same for prompt batches; the weights read into anonymous memory (no file
mapping) that glibc asks the kernel to back with huge pages; the embedding table left in the
file (``--lazy-mode on``, dsr1d's lazy-embeddings patch); ``parallel`` slots over one KV pool
with continuous batching, each slot allowed the whole context; reasoning split the DeepSeek way
(``reasoning_content``) only where the model's template opens a think block.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

BINARY = "llama-server"
INSTALLED = Path("/usr/lib/dsr1d/bin") / BINARY   # where `make install` puts it
KV_TYPE_BYTES = {"f16": 2.0, "q8_0": 34 / 32}     # per value (q8_0: 32 int8 and an f16 scale)


@dataclass(frozen=True)
class ServerSpec:
    """What one llama-server process serves, and how."""

    gguf: Path
    socket: Path
    threads: int
    context: int                  # tokens a slot may use
    parallel: int = 1
    cpus: list[int] = field(default_factory=list)   # pinned, one thread each; empty: unpinned
    mmap: bool = False
    aliases: tuple[str, ...] = ()
    embeddings: bool = False      # a dedicated embedding model: /v1/embeddings, no generation
    draft: Path | None = None     # speculative decoding with this model (same tokenizer)
    ngram: bool = False           # speculative decoding from the text so far
    draft_max: int = 0            # tokens drafted per step (0: llama-server's default)
    flash_attn: str = ""          # on, off, or "": llama-server's auto
    kv_type: str = "f16"          # the KV cache's type (q8_0 halves its memory)


def find_binary(configured: str = "") -> Path | None:
    """The llama-server to run: the configured path, else the one set-up put next to this
    Python (the virtual environment's ``bin``), else the installed one, else ``$PATH``'s."""
    if configured:
        return Path(configured)
    beside = Path(sys.executable).parent / BINARY
    for candidate in (beside, INSTALLED):
        if os.access(candidate, os.X_OK):
            return candidate
    found = shutil.which(BINARY)
    return Path(found) if found else None


def version(binary: Path) -> str:
    """The first line of ``llama-server --version`` (or why there is none)."""
    import subprocess

    try:
        proc = subprocess.run([str(binary), "--version"], capture_output=True, text=True,
                              timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"does not run: {exc}"
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    return lines[0] if lines else f"exit status {proc.returncode}"


def cpu_mask(cpus: list[int]) -> str:
    """llama.cpp's ``--cpu-mask``: a hex bit mask of the CPUs."""
    return hex(sum(1 << c for c in set(cpus)))


def arguments(spec: ServerSpec) -> list[str]:
    """llama-server's arguments for ``spec`` (the binary not included)."""
    threads = str(max(1, spec.threads))
    args = ["--model", str(spec.gguf), "--host", str(spec.socket), "--port", "1",
            "--threads", threads, "--threads-batch", threads,
            "--parallel", str(spec.parallel), "--ctx-size", str(spec.context * spec.parallel),
            "--kv-unified", "--kv-unified-per-slot", str(spec.context), "--cont-batching",
            "--jinja", "--reasoning-format", "deepseek", "--metrics", "--slots", "--no-webui",
            "--lazy-mode", "on", "--alias", ",".join(spec.aliases) if spec.aliases else
            spec.gguf.stem]
    args += ["--load-mode", "mmap" if spec.mmap else "none"]
    if spec.embeddings:
        args.append("--embeddings")
    if spec.cpus:
        mask = cpu_mask(spec.cpus[:max(1, spec.threads)])
        args += ["--cpu-mask", mask, "--cpu-strict", "1",
                 "--cpu-mask-batch", mask, "--cpu-strict-batch", "1"]
    return args + attention(spec) + speculation(spec)


def kv_types(spec: ServerSpec) -> tuple[str, str]:
    """The types of ``spec``'s KV cache's K and V (`cache_types`)."""
    return cache_types(spec.flash_attn, spec.kv_type)


def cache_types(flash_attn: str, kv_type: str) -> tuple[str, str]:
    """The types of the KV cache's K and V. Without flash attention llama.cpp cannot keep V
    quantised, so a q8_0 cache is then K only."""
    return kv_type, kv_type if flash_attn != "off" else "f16"


def kv_bytes_per_token(spec: ServerSpec, elements: int) -> float:
    """Bytes one token of context keeps in the KV cache, ``elements`` K values and as many V."""
    k, v = kv_types(spec)
    return elements * (KV_TYPE_BYTES[k] + KV_TYPE_BYTES[v])


def attention(spec: ServerSpec) -> list[str]:
    """Flash attention and the KV cache's types (`kv_types`)."""
    args = ["--flash-attn", spec.flash_attn] if spec.flash_attn else []
    k, v = kv_types(spec)
    if k != "f16":
        args += ["--cache-type-k", k]
    if v != "f16":
        args += ["--cache-type-v", v]
    return args


def speculation(spec: ServerSpec) -> list[str]:
    """Speculative decoding's flags: a draft model on the same threads and CPUs as the target
    (they take turns, never run at once), or n-gram drafting from the text so far."""
    if spec.draft is not None:
        threads = str(max(1, spec.threads))
        args = ["--spec-type", "draft-simple", "--model-draft", str(spec.draft),
                "--spec-draft-threads", threads, "--spec-draft-threads-batch", threads]
        if spec.draft_max:
            args += ["--spec-draft-n-max", str(spec.draft_max)]
        if spec.cpus:
            mask = cpu_mask(spec.cpus[:max(1, spec.threads)])
            args += ["--spec-draft-cpu-mask", mask, "--spec-draft-cpu-strict", "1"]
        return args
    if spec.ngram:
        args = ["--spec-type", "ngram-simple"]
        if spec.draft_max:
            args += ["--spec-ngram-simple-size-m", str(spec.draft_max)]
        return args
    return []


def environment(base: dict[str, str] | None = None) -> dict[str, str]:
    """The server's environment: glibc madvises its large allocations for huge pages, so the
    weights (read into anonymous memory, not mapped) get THP in ``madvise`` mode too."""
    env = dict(os.environ if base is None else base)
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.startswith("glibc.malloc.hugetlb=") for t in tunables):
        tunables.append("glibc.malloc.hugetlb=1")
    env["GLIBC_TUNABLES"] = ":".join(tunables)
    return env
