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

from dsr1d.constants import ENGINE_BACKENDS
from dsr1d.engine.errors import ModelError

BACKENDS = ENGINE_BACKENDS
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


HF_CACHE_PREFIX = "models--"


def resolve_model(model: Path) -> Path:
    """The directory to load for ``model``: a Hugging Face hub cache folder
    (``…/models--ORG--NAME``) is pointed at its snapshot — the one ``refs/main`` names, or the
    only one — and anything else is itself. ModelError when a cache folder has no usable
    snapshot."""
    if not (model.is_dir() and model.name.startswith(HF_CACHE_PREFIX)):
        return model
    snapshots = model / "snapshots"
    ref = model / "refs" / "main"
    if ref.is_file():
        chosen = snapshots / ref.read_text().strip()
        if chosen.is_dir():
            return chosen
    found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
    if len(found) == 1:
        return found[0]
    listed = ", ".join(p.name for p in found) or "none"
    raise ModelError(f"{model} is a Hugging Face cache folder: point model= at one of its "
                     f"snapshots (found: {listed}), or give it a refs/main")


def model_name(path: Path) -> str:
    """What to call a model: a hub cache snapshot by its repository (``…/models--ORG--NAME/
    snapshots/HASH`` is NAME), anything else by its file or directory name."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith(HF_CACHE_PREFIX):
        return path.parent.parent.name.split("--")[-1]
    return path.stem if path.suffix.lower() == ".gguf" else path.name


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
