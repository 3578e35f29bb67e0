"""Which backend serves a model, and in which precision (pure rules, no torch, no llama.cpp).

- A ``.gguf`` file can only be served by llama.cpp.
- A Hugging Face directory is served by torch as it is, or by llama.cpp after a one-time
  conversion into the cache.
- ``auto`` takes llama.cpp wherever llama-cpp-python is installed: it decodes 2-2.5x faster than
  the torch backend on the same machine (README, Benchmarks); torch stays the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import ModelError

BACKENDS = ("auto", "llamacpp", "torch")
GGUF_MAGIC = b"GGUF"
INSTALL_HINT = ("install it with the engine (`make install`, or pip install "
                "llama-cpp-python built for this CPU: tools/llama-wheel.sh)")


@dataclass(frozen=True)
class Choice:
    """The backend for a model, whether an HF directory must be converted first, and why."""

    backend: str
    convert: bool
    reason: str


def is_gguf(model: Path) -> bool:
    """A GGUF file by name, or by its magic for a regular file named otherwise."""
    if model.suffix.lower() == ".gguf":
        return True
    try:
        with model.open("rb") as f:
            return model.is_file() and f.read(4) == GGUF_MAGIC
    except OSError:
        return False


def choose(requested: str, model: Path, llama_installed: bool) -> Choice:
    """The backend for ``model``; ModelError when the request cannot be met, saying what to do."""
    if requested not in BACKENDS:
        raise ModelError(f"unknown backend {requested!r} (one of {', '.join(BACKENDS)})")
    if is_gguf(model):
        if requested == "torch":
            raise ModelError(f"{model} is a GGUF file, which only the llama.cpp backend serves "
                             f"(set backend = llamacpp or auto, or point model= at a Hugging "
                             f"Face directory)")
        if not llama_installed:
            raise ModelError(f"{model} is a GGUF file and needs llama-cpp-python, which is not "
                             f"installed: {INSTALL_HINT}")
        return Choice("llamacpp", False, f"{requested}: a GGUF file")
    if requested == "torch":
        return Choice("torch", False, "requested")
    if requested == "llamacpp":
        if not llama_installed:
            raise ModelError(f"backend = llamacpp, but llama-cpp-python is not installed: "
                             f"{INSTALL_HINT}")
        return Choice("llamacpp", True, "requested; the Hugging Face directory is converted "
                      "to GGUF once, into the cache")
    if llama_installed:
        return Choice("llamacpp", True, "auto: llama.cpp is installed (the Hugging Face "
                      "directory is converted to GGUF once, into the cache)")
    return Choice("torch", False, "auto: llama-cpp-python is not installed, so torch")


def gguf_dtype(requested: str) -> str:
    """The precision an HF directory is converted to for llama.cpp.

    ``auto`` keeps the checkpoint's bf16: llama.cpp computes bf16 on every AVX2 CPU at memory
    speed (no emulation penalty as in torch), and fp32 would double the bytes read per token.
    """
    return "bf16" if requested == "auto" else requested
