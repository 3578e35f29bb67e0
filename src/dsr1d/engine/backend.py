"""What a configured model is, and the precision a conversion gets (pure rules, no torch, no
llama.cpp): a ``.gguf`` file is served as it is; a Hugging Face directory (or a hub cache
folder's snapshot) is converted to GGUF once, into the cache, for llama-server."""

from __future__ import annotations

from pathlib import Path

from dsr1d.engine.errors import ModelError

GGUF_MAGIC = b"GGUF"


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


def gguf_dtype(requested: str) -> str:
    """The precision an HF directory is converted to for llama.cpp.

    ``auto`` keeps the checkpoint's bf16: llama.cpp computes bf16 on every AVX2 CPU at memory
    speed (no emulation penalty as in torch), and fp32 would double the bytes read per token.
    """
    return "bf16" if requested == "auto" else requested
