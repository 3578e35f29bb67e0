"""Checking a GGUF model file before llama.cpp loads it, and what serving it will cost in memory.

llama.cpp reports a broken file as a C++ exception deep in its loader (or, for tensor data that
runs past the end of a memory-mapped file, as a SIGBUS later), so the worker calls
``inspect_gguf`` first: it parses the header itself, through a read-only memory map that touches
only the header's pages, and turns every problem into a one-line ``ModelError`` that says what to
do. The header layout (GGUF v2/v3, little-endian) is llama.cpp's ``gguf.cpp``: magic, version,
tensor and key-value counts, the key-value pairs, the tensor infos, then the tensor data, each
tensor at an offset that is a multiple of ``general.alignment`` (default 32) from the data start.

Torch-free: this module needs only the ``gguf`` package (for the ggml type sizes and names).
"""

from __future__ import annotations

import mmap
import stat
import struct
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from dsr1d.engine.errors import ModelError

SUPPORTED_ARCHS = ("qwen2", "llama")
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
REQUIRED_KEYS = ("block_count", "embedding_length", "context_length", "feed_forward_length",
                 "attention.head_count")
# general.file_type values with a dsr1d dtype name; other files are labelled by ggml's name.
FILE_TYPE_LABELS = {LlamaFileType.ALL_F32: "fp32", LlamaFileType.MOSTLY_BF16: "bf16",
                    LlamaFileType.MOSTLY_Q8_0: "int8", LlamaFileType.MOSTLY_Q4_0: "int4"}
TENSOR_TYPE_LABELS = {GGMLQuantizationType.F32: "fp32", GGMLQuantizationType.BF16: "bf16",
                      GGMLQuantizationType.Q8_0: "int8", GGMLQuantizationType.Q4_0: "int4"}
FILE_TYPE_GUESSED = 1024  # LLAMA_FTYPE_GUESSED, or-ed in by llama.cpp when it guessed the type

# memory_needed: llama.cpp's defaults for the batch, and the context the estimate assumes.
MEMORY_CONTEXT = 4096
MEMORY_UBATCH = 512
MEMORY_FIXED = 128 * 1024**2

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file holds, read from its header."""

    path: Path
    architecture: str
    name: str
    file_type: str          # "bf16", "fp32", "int8" (Q8_0), "int4" (Q4_0) or ggml's name
    parameters: int
    tensor_bytes: int
    context_length: int
    block_count: int
    embedding_length: int
    feed_forward_length: int
    head_count: int
    head_count_kv: int
    head_dim: int
    vocab_size: int         # 0 when the file has no vocabulary
    chat_template: str | None
    bos_id: int | None
    eos_id: int | None
    has_vocab: bool
    sampling: dict = field(default_factory=dict)   # general.sampling.temp / top_p, as given
    embedding_bytes: int = 0  # token_embd.weight: a decoded token reads one row of it
    tied_output: bool = False  # no output.weight: the embedding table is the output too


@dataclass(frozen=True)
class _Array:
    """A metadata array, not decoded: only its element type and length are needed."""

    type: int
    count: int


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]   # ggml order: shape[0] is the contiguous dimension
    type: GGMLQuantizationType
    offset: int
    nbytes: int


class _Truncated(Exception):
    """The header ends before a field it declares."""


class _Corrupt(Exception):
    """A header field has an impossible value; the message says which."""


class _Cursor:
    """Reads little-endian GGUF fields from a buffer, never past its end."""

    def __init__(self, buf: Any, size: int) -> None:
        self.buf = buf
        self.size = size
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise _Truncated
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += n
        return value

    def skip(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise _Truncated
        self.pos += n

    def string(self) -> str:
        n = self.unpack("<Q")
        start = self.pos
        self.skip(n)
        try:
            return bytes(self.buf[start:self.pos]).decode("utf-8")
        except UnicodeDecodeError:
            raise _Corrupt(f"a string at byte {start} is not UTF-8") from None

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("<I"), self.unpack("<Q")
            self._skip_array(etype, count)
            return _Array(etype, count)
        raise _Corrupt(f"unknown metadata value type {vtype} at byte {self.pos - 4}")

    def _skip_array(self, etype: int, count: int) -> None:
        if etype in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[etype]))
        elif etype == _STRING:
            for _ in range(count):
                self.skip(self.unpack("<Q"))
        elif etype == _ARRAY:
            for _ in range(count):
                self._skip_array(self.unpack("<I"), self.unpack("<Q"))
        else:
            raise _Corrupt(f"unknown array element type {etype} at byte {self.pos}")


def inspect_gguf(path: Path) -> GGUFInfo:
    """Check that ``path`` is a complete GGUF model llama.cpp can serve here, and describe it.

    Raises ModelError (one line, saying what to do) for a missing or non-regular file, a file
    that is not GGUF, an unsupported GGUF version or architecture, a header or tensor data cut
    short, a corrupt header, or missing required metadata. Reads only the header.
    """
    path = Path(path)
    size = _regular_file_size(path)
    if size == 0:
        raise ModelError(f"{path} is empty (0 bytes), not a GGUF model: download or convert it "
                         f"again")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _inspect(path, buf, size)
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc.strerror or exc}") from None


def _regular_file_size(path: Path) -> int:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ModelError(f"model file {path} does not exist") from None
    except OSError as exc:
        raise ModelError(f"cannot read {path}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(st.st_mode):
        raise ModelError(f"{path} is a directory, not a GGUF file (a Hugging Face directory "
                         f"can be converted with `dsr1d model convert`)")
    if not stat.S_ISREG(st.st_mode):
        raise ModelError(f"{path} is not a regular file (give the path of a .gguf file)")
    return st.st_size


def _inspect(path: Path, buf: Any, size: int) -> GGUFInfo:
    cur = _Cursor(buf, size)
    try:
        _check_preamble(path, buf, size)
        cur.skip(8)
        n_tensors, n_kv = cur.unpack("<Q"), cur.unpack("<Q")
        # Every key-value pair and tensor info takes at least 8 bytes: larger counts are garbage.
        if n_tensors > size // 8 or n_kv > size // 8:
            raise _Corrupt(f"it declares {n_tensors} tensors and {n_kv} metadata keys")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            meta[key] = cur.value(cur.unpack("<I"))
        alignment = _alignment(meta)
        tensors = [_tensor_info(cur) for _ in range(n_tensors)]
    except _Truncated:
        raise ModelError(f"{path} is truncated: the file ({size} bytes) ends inside its GGUF "
                         f"header; the download or conversion did not finish, fetch or convert "
                         f"it again") from None
    except _Corrupt as exc:
        raise ModelError(f"{path} is not a valid GGUF file ({exc}); download or convert it "
                         f"again") from None
    data_start = _pad(cur.pos, alignment)
    _check_tensor_data(path, tensors, data_start, alignment, size)
    return _describe(path, meta, tensors)


def _check_preamble(path: Path, buf: Any, size: int) -> None:
    magic = bytes(buf[:4])
    if magic != GGUF_MAGIC:
        raise ModelError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF'); "
                         f"a Hugging Face directory can be converted with `dsr1d model convert`")
    if size < 8:
        raise _Truncated
    (version,) = struct.unpack_from("<I", buf, 4)
    if version not in GGUF_VERSIONS and struct.unpack_from(">I", buf, 4)[0] in GGUF_VERSIONS:
        raise ModelError(f"{path} is a big-endian GGUF file, which this machine cannot load; "
                         f"convert the model again here")
    if version not in GGUF_VERSIONS:
        raise ModelError(f"{path}: GGUF version {version} is not supported (llama.cpp reads "
                         f"versions {' and '.join(map(str, GGUF_VERSIONS))}); convert the model "
                         f"again with a current converter")


def _alignment(meta: dict[str, Any]) -> int:
    alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment <= 0 \
            or alignment & (alignment - 1):
        raise _Corrupt(f"general.alignment is {alignment!r}, not a power of two")
    return alignment


def _tensor_info(cur: _Cursor) -> _Tensor:
    name = cur.string()
    n_dims = cur.unpack("<I")
    if not 1 <= n_dims <= MAX_DIMS:
        raise _Corrupt(f"tensor {name!r} has {n_dims} dimensions")
    shape = tuple(cur.unpack("<Q") for _ in range(n_dims))
    raw_type, offset = cur.unpack("<I"), cur.unpack("<Q")
    try:
        ttype = GGMLQuantizationType(raw_type)
        block, type_size = GGML_QUANT_SIZES[ttype]
    except (ValueError, KeyError):
        raise _Corrupt(f"tensor {name!r} has unknown type {raw_type}") from None
    if shape[0] % block:
        raise _Corrupt(f"tensor {name!r} has a row of {shape[0]}, not a multiple of {ttype.name}'s "
                       f"block of {block}")
    return _Tensor(name, shape, ttype, offset, _numel(shape) // block * type_size)


def _check_tensor_data(path: Path, tensors: list[_Tensor], data_start: int, alignment: int,
                       size: int) -> None:
    end = data_start
    for t in tensors:
        if t.offset % alignment:
            raise ModelError(f"{path} is not a valid GGUF file (tensor {t.name!r} is at offset "
                             f"{t.offset}, not a multiple of {alignment}); convert it again")
        end = max(end, data_start + t.offset + t.nbytes)
    if end > size:
        raise ModelError(f"{path} is truncated: its tensors need {end:,} bytes but the file has "
                         f"{size:,}; the download or conversion did not finish, fetch or convert "
                         f"it again")


def _describe(path: Path, meta: dict[str, Any], tensors: list[_Tensor]) -> GGUFInfo:
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise ModelError(f"{path}: required metadata general.architecture is missing; this is "
                         f"not a llama.cpp model file")
    if arch not in SUPPORTED_ARCHS:
        raise ModelError(f"{path}: architecture {arch!r} is not supported (supported: "
                         f"{', '.join(SUPPORTED_ARCHS)}, i.e. DeepSeek-R1-Distill-Qwen and "
                         f"-Llama)")
    values = {key: _int_key(path, meta, f"{arch}.{key}") for key in REQUIRED_KEYS}
    tokenizer = meta.get("tokenizer.ggml.model")
    if not isinstance(tokenizer, str):
        raise ModelError(f"{path}: required metadata tokenizer.ggml.model is missing; llama.cpp "
                         f"cannot load a file without a tokenizer, convert the model again")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = tokens.count if isinstance(tokens, _Array) and tokens.type == _STRING else 0
    has_vocab = tokenizer not in ("none", "no_vocab") and vocab > 0
    if tokenizer not in ("none", "no_vocab") and not has_vocab:
        raise ModelError(f"{path}: required metadata tokenizer.ggml.tokens is missing; convert "
                         f"the model again")
    heads = values["attention.head_count"]
    head_kv = _optional_int(meta, f"{arch}.attention.head_count_kv") or heads
    head_dim = _optional_int(meta, f"{arch}.attention.key_length") or \
        values["embedding_length"] // max(heads, 1)
    template = meta.get("tokenizer.chat_template")
    name = meta.get("general.name")
    return GGUFInfo(
        path=path, architecture=arch, name=name if isinstance(name, str) and name else path.stem,
        file_type=_file_type(meta, tensors), parameters=sum(_numel(t.shape) for t in tensors),
        tensor_bytes=sum(t.nbytes for t in tensors), context_length=values["context_length"],
        block_count=values["block_count"], embedding_length=values["embedding_length"],
        feed_forward_length=values["feed_forward_length"], head_count=heads,
        head_count_kv=head_kv, head_dim=head_dim, vocab_size=vocab,
        chat_template=template if isinstance(template, str) else None,
        bos_id=_optional_int(meta, "tokenizer.ggml.bos_token_id"),
        eos_id=_optional_int(meta, "tokenizer.ggml.eos_token_id"), has_vocab=has_vocab,
        sampling={k: meta[g] for k, g in (("temperature", "general.sampling.temp"),
                                          ("top_p", "general.sampling.top_p")) if g in meta},
        embedding_bytes=sum(t.nbytes for t in tensors if t.name == "token_embd.weight"),
        tied_output=not any(t.name == "output.weight" for t in tensors))


def _int_key(path: Path, meta: dict[str, Any], key: str) -> int:
    value = _optional_int(meta, key)
    if value is None:
        raise ModelError(f"{path}: required metadata {key} is missing; this file is incomplete, "
                         f"convert the model again")
    return value


def _optional_int(meta: dict[str, Any], key: str) -> int | None:
    value = meta.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _file_type(meta: dict[str, Any], tensors: list[_Tensor]) -> str:
    """The dtype label: from general.file_type, else the type holding most 2-D weights."""
    ftype = _optional_int(meta, "general.file_type")
    if ftype is not None:
        try:
            ftype_enum = LlamaFileType(ftype & ~FILE_TYPE_GUESSED)
        except ValueError:
            return f"file type {ftype}"
        return FILE_TYPE_LABELS.get(ftype_enum, ftype_enum.name.removeprefix("MOSTLY_"))
    weights: Counter[GGMLQuantizationType] = Counter()
    for t in tensors:
        if len(t.shape) == 2:
            weights[t.type] += _numel(t.shape)
    if not weights:
        return "unknown"
    most = weights.most_common(1)[0][0]
    return TENSOR_TYPE_LABELS.get(most, most.name)


def memory_needed(info: GGUFInfo, context: int | None = None) -> int:
    """Bytes llama.cpp needs to serve ``info`` at ``context`` tokens (default: up to 4096).

    The weights (memory-mapped, but every page is touched per token), the KV cache in f16
    (2 x layers x context x kv_heads x head_dim x 2 bytes), and a compute-buffer margin for one
    micro-batch of 512 tokens: its logits (vocab floats per token), the attention scores
    (heads x context floats per token) and the FFN activations (3 x feed_forward floats per
    token), plus 128 MiB for the graph and the runtime. It errs on the high side.
    """
    if context is None:
        context = min(info.context_length, MEMORY_CONTEXT)
    kv_cache = 2 * info.block_count * context * info.head_count_kv * info.head_dim * 2
    per_token = 4 * (info.vocab_size + info.head_count * context + 3 * info.feed_forward_length)
    return info.tensor_bytes + kv_cache + MEMORY_UBATCH * per_token + MEMORY_FIXED


def decode_weight_bytes(info: GGUFInfo) -> int:
    """Bytes of weights one decoded token reads: every tensor's data, but of the embedding
    table only its row (left out here: a few KiB) unless the table is the output layer too."""
    return info.tensor_bytes - (0 if info.tied_output else info.embedding_bytes)


def kv_elements(info: GGUFInfo) -> int:
    """K values one token of context keeps in the cache (and as many V): layers x KV heads x
    head size."""
    return info.block_count * info.head_count_kv * info.head_dim


def _pad(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

