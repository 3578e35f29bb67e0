"""``python -m dsr1d.engine.prepare``: the model made ready for llama-server, in a process of
its own (the daemon's loop never waits on a conversion or a page fault of the model file).

A ``.gguf`` file is served as it is; a Hugging Face directory (or a hub cache folder) is
converted to GGUF once, into the cache (`gguf_cache`). The file's header is then checked
(`gguf_file.inspect_gguf`: a broken file is one clear line here, not a crash of llama-server)
and the memory it needs at the configured context and slots is compared with what the machine
or the unit's cgroup has. The outcome is one `messages.Prepared` or `messages.Failed` line on
standard output, after any `Progress` and `Note` lines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from dsr1d import engine_messages as messages
from dsr1d.engine.errors import ModelError

if TYPE_CHECKING:
    from dsr1d.engine.gguf_file import GGUFInfo

DEFAULT_CONTEXT = 16384      # tokens a slot may use when engine_context is 0 (at most the model's)
MEMORY_HEADROOM = 0.9


def effective_context(model_context: int, requested: int) -> int:
    """The context a slot serves: the request (0: DEFAULT_CONTEXT), at most the model's."""
    return min(requested or DEFAULT_CONTEXT, model_context or DEFAULT_CONTEXT)


def check_memory(info: GGUFInfo, tokens: int) -> None:
    """Refuse before loading when the weights, KV cache and buffers would not fit."""
    from dsr1d.engine import memory
    from dsr1d.engine.gguf_file import memory_needed

    need = memory_needed(info, tokens)
    free, where = memory.available()
    if need > free * MEMORY_HEADROOM:
        raise ModelError(f"{info.path.name} needs about {need / 1e9:.1f} GB for {tokens} tokens "
                         f"of context but only {free / 1e9:.1f} GB is {where}; use a smaller "
                         f"quantisation (Q4_K_M, Q4_0), a shorter engine_context, fewer "
                         f"engine_parallel slots, or a smaller model")


def gguf_for(model: Path, dtype: str, cache: Path, out: BinaryIO) -> tuple[Path, str]:
    """The GGUF file to serve for ``model`` and why it has its precision."""
    from dsr1d.engine.backend import gguf_dtype, is_gguf, resolve_model

    model = resolve_model(model)
    if is_gguf(model):
        reason = "the GGUF file's precision" if dtype == "auto" else \
            f"the GGUF file's precision (engine_dtype {dtype} applies to Hugging Face directories)"
        return model, reason
    if not model.is_dir():
        raise ModelError(f"{model} is neither a GGUF file nor a Hugging Face model directory")
    from dsr1d.engine.gguf_cache import cached_gguf
    from dsr1d.engine.gguf_convert import convert

    def send(message: messages.Message) -> None:
        out.write(messages.encode(message))
        out.flush()

    target = gguf_dtype(dtype)
    path = cached_gguf(model, target, cache, convert,
                       lambda done, total, name: send(messages.Progress(done, total, name)),
                       lambda line: send(messages.Note(line)))
    reason = "requested" if dtype != "auto" else "auto: the checkpoint's bf16"
    return path, reason


def prepare(model: Path, dtype: str, cache: Path, context: int, parallel: int,
            out: BinaryIO) -> messages.Message:
    """Everything up to the file llama-server loads; the final message."""
    from dsr1d.engine.backend import model_name
    from dsr1d.engine.gguf_file import decode_weight_bytes, inspect_gguf, kv_elements

    try:
        path, reason = gguf_for(model, dtype, cache, out)
        info = inspect_gguf(path)
        if not info.has_vocab:
            raise ModelError(f"{path.name} has no vocabulary (a shapes-only benchmark file): "
                             f"llama-server cannot tokenize for it")
        tokens = effective_context(info.context_length, context)
        check_memory(info, tokens * max(1, parallel))
    except ModelError as exc:
        return messages.Failed(str(exc))
    except OSError as exc:
        return messages.Failed(f"{model}: {exc.strerror or exc}")
    name = model_name(model) if not model.is_file() else model.stem
    thinks = "<think>" in (info.chat_template or "")
    return messages.Prepared(str(path), name, info.file_type, reason, info.parameters, tokens,
                             thinks, decode_weight_bytes(info), kv_elements(info))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsr1d.engine.prepare")
    parser.add_argument("--model", required=True, type=Path)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--cache-dir", default=Path("/var/cache/dsr1d"), type=Path)
    parser.add_argument("--context", type=int, default=0)
    parser.add_argument("--parallel", type=int, default=1)
    args = parser.parse_args(argv)
    out = sys.stdout.buffer
    result = prepare(args.model, args.dtype, args.cache_dir, args.context, args.parallel, out)
    out.write(messages.encode(result))
    out.flush()
    return 0 if isinstance(result, messages.Prepared) else 2


if __name__ == "__main__":
    sys.exit(main())
