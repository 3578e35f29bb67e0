"""What the engine's preparation process tells the daemon: one typed message a line.

The daemon runs ``python -m dsr1d.engine.prepare`` before it starts llama-server: that process
turns the configured model into the GGUF file to serve (a Hugging Face directory is converted
once, into the cache), checks it and the memory it needs, and reports through these messages on
its standard output. Both sides use this module, so a field spelt one way is spelt so everywhere.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Union


@dataclass(frozen=True)
class Progress:
    """A conversion step: bytes converted of the total, and the tensor just written."""

    done: int
    total: int
    file: str


@dataclass(frozen=True)
class Note:
    """A line for the daemon's log."""

    message: str


@dataclass(frozen=True)
class Prepared:
    """The file to serve and what the daemon needs to know of it."""

    gguf: str
    name: str               # the model's id: the file's stem (or the directory's name)
    file_type: str
    dtype_reason: str
    parameters: int
    context: int            # tokens each slot may use
    thinks: bool            # the chat template opens a think block (reasoning_content)
    weight_bytes: int       # weights one decoded token reads (`gguf_file.decode_weight_bytes`)
    kv_elements: int        # K values one token of context keeps, and as many V (layers x KV
    #                         heads x head size); the KV cache's type gives their bytes


@dataclass(frozen=True)
class Failed:
    """The model cannot be served; the message says why and what to do."""

    message: str


Message = Union[Progress, Note, Prepared, Failed]
KINDS: dict[str, type] = {cls.__name__.lower(): cls for cls in (Progress, Note, Prepared, Failed)}


def encode(message: Message) -> bytes:
    """One JSON line: ``{"kind": "prepared", ...fields}``."""
    return (json.dumps({"kind": type(message).__name__.lower(), **asdict(message)}) + "\n").encode()


def decode(line: bytes) -> Message:
    """The message of one line; ValueError for anything else."""
    raw = json.loads(line)
    if not isinstance(raw, dict) or raw.get("kind") not in KINDS:
        raise ValueError(f"not a preparation message: {line[:200]!r}")
    cls = KINDS[raw.pop("kind")]
    names = {f.name for f in fields(cls)}
    if set(raw) != names:
        raise ValueError(f"{cls.__name__} needs {sorted(names)}, got {sorted(raw)}")
    return cls(**raw)
