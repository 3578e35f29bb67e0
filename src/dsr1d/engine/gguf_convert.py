"""Converting a Hugging Face R1-Distill directory (Qwen2 or Llama) to a GGUF file for llama.cpp.

``dsr1d model convert SRC_DIR OUT.gguf --dtype bf16|fp32|int8|int4``. Torch-free: safetensors
shards are read here (8-byte header length, JSON header, raw data) through memory maps, and each
tensor is converted in row chunks of ~8M values and appended to the output, so the memory used
is a few chunks plus the page cache of the tensor being read, whatever the model size (the
mapped embedding is most of the peak RSS).

What is written follows llama.cpp's own ``convert_hf_to_gguf.py`` so that the file loads like
one made there: its tensor names (``token_embd``, ``blk.N.attn_q``, ...), the Llama q/k row
permutation (llama.cpp rotates Llama's q/k in interleaved pairs, Hugging Face in halves; Qwen2
uses NEOX rotation in llama.cpp and needs none), llama3 rope scaling as a ``rope_freqs`` tensor,
and the ``tokenizer.ggml.*`` vocabulary, merges, special ids and chat template.

Tensor types: 1-D tensors (norms, biases) and ``rope_freqs`` are F32 in every file. The 2-D
weights are F32 / BF16 / Q8_0 / Q4_0 for fp32 / bf16 / int8 / int4, except that int4 files keep
``token_embd.weight`` at Q8_0 and write ``output.weight`` as IQ4_NL (``engine/iq4nl.py``; when
the embeddings are tied, ``token_embd`` is also the output and stays Q8_0). Measured with
llama.cpp over corpus tokens against the fp32 (tiny) or bf16 (1.5B) file (the choice is the
size of the one before):

    int4 variant                       tiny model, 2500 tokens     1.5B synthetic, 512 tokens
                                       RMS     top-1 same  KL      RMS     top-1 same  KL
    everything Q4_0                    0.135   78.0 %      0.036
    output Q8_0 (the choice before)    0.104   84.2 %      0.021   0.711   10.7 %      0.168
    output IQ4_NL                      0.129   76.8 %      0.033   0.714   10.4 %      0.168
    output IQ4_NL + token_embd Q8_0    0.093   84.4 %      0.017   0.658   13.7 %      0.142
    (this choice)

(RMS: of the logits' error, relative to their spread; the synthetic 1.5B amplifies any error
through its 28 random layers, hence its figures.) The output matrix is read for every token,
the embedding only indexed: IQ4_NL output is 131 MB against Q8_0's 248 MB on R1-Distill-Qwen-1.5B,
fewer bytes for every token, and dsr1d's kernels (and llama.cpp's repack) take IQ4_NL as they
take Q4_0, while llama.cpp runs a Q8_0 output through llamafile's kernels, which redo each
block's scale work for every sequence of a batch. llama.cpp's own Q4_0 mix uses Q6_K for the
output. tests/test_gguf.py checks the choice against the
Q8_0 output and against everything Q4_0.
A weight whose rows are not a multiple of the 32-value quantisation block falls back to BF16.

The pre-tokenizer is recognised by its split regex in tokenizer.json: Qwen2's is written as
``qwen2`` (llama.cpp's name for that regex; ``deepseek-r1-qwen``, what llama.cpp's converter
writes for these checkpoints, selects the same code but only in llama.cpp since January 2025),
Llama 3's as ``llama-bpe``. Any other regex is refused: llama.cpp would silently split text
differently from the tokenizer the model was trained with. Added tokens are CONTROL when
``special`` and USER_DEFINED otherwise (``<think>``), so llama.cpp's detokenizer drops exactly
what ``skip_special_tokens`` drops; ids past the tokenizer up to ``vocab_size`` are UNUSED
``[PAD{i}]`` entries.

The output is written to a hidden temporary file in the same directory, fsynced and renamed, so
an interrupted conversion never leaves a file named OUT.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType
from gguf import GGML_QUANT_VERSION
from gguf.quants import quantize

from dsr1d.engine.backend import model_name
from dsr1d.engine.errors import ModelError
from dsr1d.engine.iq4nl import quantize_iq4_nl
from dsr1d.table import human_size

Progress = Callable[[int, int, str], None]
QT = GGMLQuantizationType

ARCHITECTURES = {"Qwen2ForCausalLM": "qwen2", "LlamaForCausalLM": "llama"}
DTYPES = {"bf16": (QT.BF16, LlamaFileType.MOSTLY_BF16), "fp32": (QT.F32, LlamaFileType.ALL_F32),
          "int8": (QT.Q8_0, LlamaFileType.MOSTLY_Q8_0), "int4": (QT.Q4_0, LlamaFileType.MOSTLY_Q4_0)}
ALIGNMENT = 32  # GGUFWriter's default general.alignment
LAYOUT = 2      # raised when the same source and dtype make a different file (the cache's key)
LAYOUT_KEY = "dsr1d.layout"
CHUNK_VALUES = 1 << 23
DISK_MARGIN = 64 * 1024**2
MAX_ST_HEADER = 100 * 1024**2  # safetensors' own limit on the JSON header
ST_DTYPES = {"BF16": np.uint16, "F16": np.float16, "F32": np.float32}

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {QWEN2_SPLIT: "qwen2", LLAMA3_SPLIT: "llama-bpe"}

GLOBAL_TENSORS = {"model.embed_tokens.weight": "token_embd.weight",
                  "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # a buffer some old checkpoints saved
SAMPLING_KEYS = {"temperature": "general.sampling.temp", "top_p": "general.sampling.top_p",
                 "top_k": "general.sampling.top_k"}


@dataclass(frozen=True)
class _HParams:
    """The architecture numbers of config.json that the GGUF needs."""

    arch: str
    hidden: int
    ff: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    context: int
    rms_eps: float
    rope_theta: float
    rope_freqs: np.ndarray | None   # llama3 rope scaling factors, one per rotated pair
    tied: bool
    attention_bias: bool


@dataclass(frozen=True)
class _Source:
    """One tensor in a safetensors file."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int       # absolute byte offset of its data in the file
    nbytes: int


@dataclass(frozen=True)
class _Job:
    """One GGUF tensor: where its values come from and how it is stored."""

    name: str
    shape: tuple[int, ...]           # numpy order: the last dimension is a row
    qtype: GGMLQuantizationType
    source: _Source | None = None
    data: np.ndarray | None = None   # generated values (rope_freqs)
    permute_heads: int | None = None  # Llama q/k: heads whose rotary halves are interleaved

    @property
    def nbytes(self) -> int:
        block, type_size = GGML_QUANT_SIZES[self.qtype]
        return math.prod(self.shape) // block * type_size


@dataclass(frozen=True)
class _Vocab:
    """The tokenizer as llama.cpp's ``tokenizer.ggml.*`` keys describe it."""

    tokens: list[str]
    types: list[int]
    merges: list[str]
    pre: str
    bos: int | None
    eos: int | None
    pad: int | None
    add_bos: bool | None
    add_eos: bool | None
    chat_template: str | None


# --- config.json ---------------------------------------------------------------------------------

def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelError(f"{path}: not valid JSON ({exc})") from None


def _config(src: Path) -> dict:
    config_file = src / "config.json"
    if not src.is_dir():
        raise ModelError(f"model directory {src} does not exist")
    if not config_file.is_file():
        raise ModelError(f"{src} is not a Hugging Face model directory (no config.json)")
    config = _read_json(config_file)
    if not isinstance(config, dict):
        raise ModelError(f"{config_file}: not a JSON object")
    return config


def _hparams(config: dict, config_file: Path) -> _HParams:
    archs = config.get("architectures") or [config.get("model_type", "?")]
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
        raise ModelError(f"unsupported architecture {', '.join(map(str, archs))} in {config_file} "
                         f"(supported: {', '.join(ARCHITECTURES)})")
    arch = ARCHITECTURES[known[0]]

    def need(key: str) -> int:
        value = config.get(key)
        if not isinstance(value, int) or value <= 0:
            raise ModelError(f"{config_file}: {key} is missing or not a positive integer")
        return value

    hidden, heads = need("hidden_size"), need("num_attention_heads")
    head_dim = config.get("head_dim") or hidden // heads
    theta, rope = _rope(config, config_file, arch)
    return _HParams(
        arch=arch, hidden=hidden, ff=need("intermediate_size"), layers=need("num_hidden_layers"),
        heads=heads, kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim,
        vocab=need("vocab_size"), context=need("max_position_embeddings"),
        rms_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=theta,
        rope_freqs=_llama3_rope_factors(rope, theta, head_dim) if rope else None,
        tied=bool(config.get("tie_word_embeddings", False)),
        attention_bias=arch == "qwen2" or bool(config.get("attention_bias", False)))


def _rope(config: dict, config_file: Path, arch: str) -> tuple[float, dict | None]:
    """rope_theta and the llama3 scaling parameters (None without scaling).

    transformers 4 writes ``rope_theta`` and ``rope_scaling``; transformers 5 one
    ``rope_parameters`` holding both.
    """
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    params = params.get("full_attention", params)
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3" and arch == "llama":
        return theta, params
    raise ModelError(f"{config_file}: rope scaling {kind!r} is not supported by the converter "
                     f"(R1-Distill checkpoints use none, or llama3 for Llama)")


def _llama3_rope_factors(rope: dict, theta: float, head_dim: int) -> np.ndarray:
    """Llama 3.1's frequency divisors per rotated pair, as llama.cpp reads them (rope_freqs)."""
    factor = float(rope.get("factor", 8.0))
    low, high = float(rope.get("low_freq_factor", 1.0)), float(rope.get("high_freq_factor", 4.0))
    old_context = float(rope.get("original_max_position_embeddings", 8192))
    freqs = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    smooth = (old_context / wavelen - low) / (high - low)
    factors = np.where(wavelen < old_context / high, 1.0,
                       np.where(wavelen > old_context / low, factor,
                                1.0 / ((1 - smooth) / factor + smooth)))
    return factors.astype(np.float32)


# --- tokenizer -----------------------------------------------------------------------------------

def _vocab(src: Path, config: dict, vocab_size: int) -> _Vocab:
    path = src / "tokenizer.json"
    if not path.is_file():
        raise ModelError(f"no tokenizer.json in {src}: a fast (Hugging Face tokenizers) "
                         f"tokenizer is required")
    tok = _read_json(path)
    model = tok.get("model") or {}
    if model.get("type") != "BPE" or (tok.get("decoder") or {}).get("type") != "ByteLevel":
        raise ModelError(f"{path}: not a byte-level BPE tokenizer (the R1-Distill Qwen2 and "
                         f"Llama 3 tokenizers are)")
    pre = _pre_tokenizer(path, tok)
    id_to_token = {i: t for t, i in model.get("vocab", {}).items()}
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    id_to_token.update((i, a["content"]) for i, a in added.items())
    if max(id_to_token, default=0) >= vocab_size:
        raise ModelError(f"{path}: token id {max(id_to_token)} does not fit the model's "
                         f"vocab_size {vocab_size} in config.json")
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in id_to_token:
            tokens.append(f"[PAD{i}]")
            types.append(TokenType.UNUSED)
        else:
            tokens.append(id_to_token[i])
            types.append(TokenType.NORMAL if i not in added else
                         TokenType.CONTROL if added[i].get("special") else TokenType.USER_DEFINED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    token_ids = {t: i for i, t in id_to_token.items()}
    tok_config = _read_json(src / "tokenizer_config.json") \
        if (src / "tokenizer_config.json").is_file() else {}

    def special(name: str) -> int | None:
        content = tok_config.get(f"{name}_token")
        if isinstance(content, dict):
            content = content.get("content")
        if content in token_ids:
            return token_ids[content]
        fallback = config.get(f"{name}_token_id")
        return fallback[0] if isinstance(fallback, list) and fallback else \
            fallback if isinstance(fallback, int) else None

    return _Vocab(tokens, [int(t) for t in types], merges, pre, special("bos"), special("eos"),
                  special("pad"), tok_config.get("add_bos_token"), tok_config.get("add_eos_token"),
                  _chat_template(src, tok_config))


def _pre_tokenizer(path: Path, tok: dict) -> str:
    """llama.cpp's name for the tokenizer's pre-tokenizer; ModelError when it has none."""
    pre = tok.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    regex = None
    if len(steps) == 2 and steps[0].get("type") == "Split" and steps[1].get("type") == "ByteLevel" \
            and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert") \
            and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
    normalizer = (tok.get("normalizer") or {}).get("type")
    # llama.cpp does not normalise; NFC only matters for text that is not NFC already.
    if regex in PRE_TOKENIZERS and normalizer in (None, "NFC"):
        return PRE_TOKENIZERS[regex]
    described = f"split regex {regex!r}" if regex else \
        "pre-tokenizer " + "+".join(str(s.get("type")) for s in steps)
    raise ModelError(f"{path}: unknown {described}: llama.cpp would split text differently from "
                     f"this tokenizer, so it cannot be converted (known: the Qwen2 and Llama 3 "
                     f"byte-level BPE tokenizers)")


def _chat_template(src: Path, tok_config: dict) -> str | None:
    jinja = src / "chat_template.jinja"  # where transformers >= 4.43 may save it instead
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # named templates: llama.cpp serves the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


# --- safetensors ---------------------------------------------------------------------------------

def _safetensors_header(path: Path) -> dict[str, _Source]:
    """The tensors of one safetensors file, validated against the file's size."""
    def corrupt(why: str) -> ModelError:
        return ModelError(f"{path} is not a valid safetensors file ({why}); download or copy "
                          f"the model again")

    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise corrupt(f"only {size} bytes")
        n = int.from_bytes(prefix, "little")
        if n > min(size - 8, MAX_ST_HEADER):
            raise corrupt(f"header length {n} with a file of {size} bytes")
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise corrupt("its header is not JSON") from None
    if not isinstance(header, dict):
        raise corrupt("its header is not a JSON object")
    data_start = 8 + n
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise corrupt(f"bad entry for {name}") from None
        if dtype not in ST_DTYPES:
            raise ModelError(f"{path}: tensor {name} is {dtype}; only BF16, F16 and F32 "
                             f"checkpoints can be converted")
        if not all(isinstance(d, int) and d >= 0 for d in shape) or \
                not isinstance(begin, int) or not isinstance(end, int) or \
                not 0 <= begin <= end or end - begin != math.prod(shape) * np.dtype(
                    ST_DTYPES[dtype]).itemsize:
            raise corrupt(f"bad shape or offsets for {name}")
        if data_start + end > size:
            raise corrupt(f"it is truncated: {name} ends at byte {data_start + end:,} of "
                          f"{size:,}")
        tensors[name] = _Source(path, dtype, shape, data_start + begin, end - begin)
    return tensors


def _sources(src: Path) -> dict[str, _Source]:
    """Every tensor of the checkpoint, single-file or sharded (model.safetensors.index.json)."""
    index_file = src / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelError(f"{index_file}: no weight_map")
        files = sorted(set(weight_map.values()))
        for name in files:
            if not (src / name).is_file():
                raise ModelError(f"{src / name} is missing (listed in {index_file.name}); "
                                 f"download the model again")
    else:
        files = sorted(p.name for p in src.glob("*.safetensors"))
        if not files:
            raise ModelError(f"no *.safetensors weights in {src}")
    sources: dict[str, _Source] = {}
    for name in files:
        for tensor, source in _safetensors_header(src / name).items():
            if tensor in sources:
                raise ModelError(f"tensor {tensor} is in both {sources[tensor].file.name} and "
                                 f"{name}")
            sources[tensor] = source
    return sources


def _load(source: _Source) -> np.ndarray:
    data = np.memmap(source.file, dtype=np.uint8, mode="r", offset=source.start,
                     shape=(source.nbytes,))
    return data.view(ST_DTYPES[source.dtype]).reshape(source.shape)


def _to_f32(values: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "BF16":
        return (values.astype(np.uint32) << 16).view(np.float32)
    return values.astype(np.float32, copy=False)


# --- the plan: which tensors, in which types -------------------------------------------------------

def _gguf_name(name: str) -> str | None:
    """llama.cpp's name for a checkpoint tensor; None for one to skip; ModelError if unknown."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        if parts[3] in LAYER_TENSORS:
            return f"blk.{int(parts[2])}.{LAYER_TENSORS[parts[3]]}"
        if parts[3].endswith(IGNORED_SUFFIXES):
            return None
    raise ModelError(f"tensor {name} is not part of a plain Qwen2/Llama causal LM; this "
                     f"checkpoint cannot be converted")


def _expected_shapes(hp: _HParams) -> tuple[dict[str, tuple[int, ...]], set[str]]:
    """GGUF name -> shape (numpy order) of every tensor, and the names that may be absent.

    In llama.cpp's converter's order: the embedding, the layers, the output norm and matrix.
    """
    q, kv = hp.heads * hp.head_dim, hp.kv_heads * hp.head_dim
    shapes = {"token_embd.weight": (hp.vocab, hp.hidden)}
    optional = set()
    for i in range(hp.layers):
        layer = {"attn_norm.weight": (hp.hidden,), "attn_q.weight": (q, hp.hidden),
                 "attn_q.bias": (q,), "attn_k.weight": (kv, hp.hidden), "attn_k.bias": (kv,),
                 "attn_v.weight": (kv, hp.hidden), "attn_v.bias": (kv,),
                 "attn_output.weight": (hp.hidden, q), "attn_output.bias": (hp.hidden,),
                 "ffn_norm.weight": (hp.hidden,), "ffn_gate.weight": (hp.ff, hp.hidden),
                 "ffn_up.weight": (hp.ff, hp.hidden), "ffn_down.weight": (hp.hidden, hp.ff)}
        for key, shape in layer.items():
            shapes[f"blk.{i}.{key}"] = shape
        # Qwen2 has q/k/v biases and no o bias; Llama biases follow attention_bias.
        optional.add(f"blk.{i}.attn_output.bias")
        if not hp.attention_bias:
            optional |= {f"blk.{i}.attn_{x}.bias" for x in "qkv"}
    shapes["output_norm.weight"] = (hp.hidden,)
    if not hp.tied:
        shapes["output.weight"] = (hp.vocab, hp.hidden)
    return shapes, optional


def _tensor_type(name: str, shape: tuple[int, ...], dtype: str) -> QT:
    if len(shape) == 1:
        return QT.F32
    qtype = DTYPES[dtype][0]
    if dtype == "int4" and name == "token_embd.weight":
        qtype = QT.Q8_0
    elif dtype == "int4" and name == "output.weight":
        qtype = QT.IQ4_NL
    if shape[-1] % GGML_QUANT_SIZES[qtype][0]:
        return QT.BF16
    return qtype


def _plan(hp: _HParams, sources: dict[str, _Source], dtype: str) -> list[_Job]:
    shapes, optional = _expected_shapes(hp)
    found: dict[str, _Source] = {}
    for name, source in sources.items():
        gguf_name = _gguf_name(name)
        if gguf_name is None or (hp.tied and gguf_name == "output.weight"):
            continue
        if gguf_name not in shapes:
            raise ModelError(f"tensor {name} does not belong in this model (config.json says "
                             f"{hp.layers} layers, attention_bias {hp.attention_bias})")
        if source.shape != shapes[gguf_name]:
            raise ModelError(f"tensor {name} has shape {list(source.shape)} but config.json "
                             f"implies {list(shapes[gguf_name])}")
        found[gguf_name] = source
    missing = [n for n in shapes if n not in found and n not in optional]
    if missing:
        raise ModelError(f"weights missing from the checkpoint: {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    jobs = []
    if hp.rope_freqs is not None:
        jobs.append(_Job("rope_freqs.weight", hp.rope_freqs.shape, QT.F32, data=hp.rope_freqs))
    for name in shapes:
        if name in found:
            permute = None
            if hp.arch == "llama" and ".attn_q." in name:
                permute = hp.heads
            elif hp.arch == "llama" and ".attn_k." in name:
                permute = hp.kv_heads
            jobs.append(_Job(name, shapes[name], _tensor_type(name, shapes[name], dtype),
                             source=found[name], permute_heads=permute))
    return jobs


def _permute(values: np.ndarray, heads: int) -> np.ndarray:
    """Each head's rows from [first halves; second halves] to interleaved pairs (llama.cpp)."""
    rows = values.shape[0]
    return (values.reshape(heads, 2, rows // heads // 2, *values.shape[1:])
            .swapaxes(1, 2).reshape(values.shape))


def _encoded_chunks(job: _Job) -> Iterator[np.ndarray]:
    """The tensor's bytes in the GGUF, a few million values at a time."""
    if job.data is not None:
        yield job.data.astype(np.float32)
        return
    assert job.source is not None
    values = _load(job.source)
    if job.permute_heads:
        values = _permute(values, job.permute_heads)
    rows = values.reshape(-1, job.shape[-1])
    step = max(1, CHUNK_VALUES // job.shape[-1])
    for start in range(0, rows.shape[0], step):
        chunk = rows[start:start + step]
        if job.qtype == QT.BF16 and job.source.dtype == "BF16":
            yield np.ascontiguousarray(chunk)
        else:
            f32 = _to_f32(chunk, job.source.dtype)
            yield f32 if job.qtype == QT.F32 else _quantize(f32, job.qtype)


# --- writing -------------------------------------------------------------------------------------

def layout_of(path: Path) -> int | None:
    """The ``LAYOUT`` a file was converted with (None: not written here, or before layouts)."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get(LAYOUT_KEY)
    return int(field.parts[field.data[0]][0]) if field else None


def is_current(out: Path, src: Path) -> bool:
    """Whether ``out`` is a conversion of ``src`` that converting again would not change: newer
    than its config.json and of this converter's ``LAYOUT`` (the benches' reuse rule)."""
    return out.exists() and out.stat().st_mtime > (src / "config.json").stat().st_mtime \
        and layout_of(out) == LAYOUT


def _quantize(values: np.ndarray, qtype: QT) -> np.ndarray:
    return quantize_iq4_nl(values) if qtype == QT.IQ4_NL else quantize(values, qtype)


def _pad(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def _metadata(writer: GGUFWriter, name: str, hp: _HParams, vocab: _Vocab, dtype: str,
              generation: dict) -> None:
    writer.add_name(name)
    writer.add_uint32(LAYOUT_KEY, LAYOUT)
    writer.add_file_type(DTYPES[dtype][1])
    writer.add_quantization_version(GGML_QUANT_VERSION)
    writer.add_context_length(hp.context)
    writer.add_embedding_length(hp.hidden)
    writer.add_block_count(hp.layers)
    writer.add_feed_forward_length(hp.ff)
    writer.add_head_count(hp.heads)
    writer.add_head_count_kv(hp.kv_heads)
    writer.add_key_length(hp.head_dim)
    writer.add_value_length(hp.head_dim)
    writer.add_layer_norm_rms_eps(hp.rms_eps)
    writer.add_rope_freq_base(hp.rope_theta)
    if hp.arch == "llama":
        writer.add_rope_dimension_count(hp.head_dim)
        writer.add_vocab_size(hp.vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    writer.add_token_types(vocab.types)
    writer.add_token_merges(vocab.merges)
    for value, add in ((vocab.bos, writer.add_bos_token_id), (vocab.eos, writer.add_eos_token_id),
                       (vocab.pad, writer.add_pad_token_id)):
        if value is not None:
            add(value)
    if vocab.add_bos is not None:
        writer.add_add_bos_token(bool(vocab.add_bos))
    if vocab.add_eos is not None:
        writer.add_add_eos_token(bool(vocab.add_eos))
    if vocab.chat_template is not None:
        writer.add_chat_template(vocab.chat_template)
    for key, gguf_key in SAMPLING_KEYS.items():
        value = generation.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if key == "top_k":
                writer.add_int32(gguf_key, int(value))
            else:
                writer.add_float32(gguf_key, float(value))


def _header_estimate(vocab: _Vocab) -> int:
    strings = vocab.tokens + vocab.merges + [vocab.chat_template or ""]
    return sum(len(s.encode()) + 8 for s in strings) + 4 * len(vocab.types) + 1024**2


def _check_space(out: Path, need: int) -> None:
    free = shutil.disk_usage(out.parent).free
    if free < need + DISK_MARGIN:
        raise ModelError(f"not enough free disk space in {out.parent}: the GGUF file needs "
                         f"{human_size(need)} and {human_size(free)} is free (free some space, "
                         f"pick another directory, or a smaller --dtype)")


def _write_header(path: Path, arch: str, jobs: list[_Job],
                  metadata: Callable[[GGUFWriter], None]) -> None:
    """The GGUF header (metadata and tensor infos); the data is appended by _write_data."""
    writer = GGUFWriter(path, arch)
    try:
        metadata(writer)
        for job in jobs:
            writer.add_tensor_info(job.name, job.shape, np.dtype(np.float32), job.nbytes,
                                   raw_dtype=job.qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
    finally:
        writer.close()


def _write_data(f: BinaryIO, jobs: list[_Job], progress: Progress | None) -> None:
    total = sum(j.nbytes for j in jobs)
    done = 0
    f.write(b"\0" * (_pad(f.tell()) - f.tell()))
    for job in jobs:
        written = 0
        for chunk in _encoded_chunks(job):
            written += f.write(memoryview(np.ascontiguousarray(chunk)).cast("B"))
        if written != job.nbytes:
            raise ModelError(f"internal error: {job.name} wrote {written} bytes, not {job.nbytes}")
        f.write(b"\0" * (_pad(written) - written))
        done += job.nbytes
        if progress:
            progress(done, total, job.name)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert(src: Path, out: Path, dtype: str, progress: Progress | None = None) -> Path:
    """Write the GGUF of the Hugging Face directory ``src`` to ``out`` atomically; returns ``out``.

    ``dtype`` is bf16, fp32, int8 (Q8_0) or int4 (Q4_0; the output IQ4_NL, the embedding Q8_0).
    ``progress(done_bytes, total_bytes, tensor_name)`` is called after each tensor. Raises
    ModelError for an unusable directory (no config.json, an unsupported architecture, no
    tokenizer.json, an unknown pre-tokenizer, corrupt or missing weights) or too little disk.
    """
    src, out = Path(src), Path(out)
    if dtype not in DTYPES:
        raise ModelError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    config = _config(src)
    hp = _hparams(config, src / "config.json")
    vocab = _vocab(src, config, hp.vocab)
    jobs = _plan(hp, _sources(src), dtype)
    if out.is_dir():
        raise ModelError(f"{out} is a directory; give the path of the .gguf file to write")
    if not out.parent.is_dir():
        raise ModelError(f"directory {out.parent} does not exist")
    _check_space(out, _header_estimate(vocab) + sum(_pad(j.nbytes) for j in jobs))
    generation = _read_json(src / "generation_config.json") \
        if (src / "generation_config.json").is_file() else {}

    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        _write_header(tmp, hp.arch, jobs,
                      lambda w: _metadata(w, model_name(src.resolve()), hp, vocab, dtype,
                                          generation))
        with open(tmp, "r+b") as f:
            f.seek(0, os.SEEK_END)
            _write_data(f, jobs, progress)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(out.parent)
    return out


# --- command line --------------------------------------------------------------------------------

class _LayerProgress:
    """Prints one stderr line per finished layer (and for the embedding and the output)."""

    def __init__(self) -> None:
        self.group: str | None = None
        self.done = 0

    @staticmethod
    def _group(name: str) -> str:
        if name.startswith("blk."):
            return ".".join(name.split(".")[:2])
        return "output" if name.startswith("output") else "token_embd"

    def _print(self, total: int) -> None:
        print(f"{self.done / total:4.0%} {human_size(self.done)}/{human_size(total)} {self.group}",
              file=sys.stderr, flush=True)

    def __call__(self, done: int, total: int, name: str) -> None:
        group = self._group(name)
        if self.group not in (None, group):
            self._print(total)
        self.group, self.done = group, done
        if done == total:
            self._print(total)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsr1d model convert",
        description="Convert a Hugging Face DeepSeek-R1-Distill (Qwen2 or Llama) directory to a "
                    "GGUF file for the llama.cpp engine.")
    p.add_argument("src", metavar="SRC_DIR", type=Path, help="the Hugging Face model directory")
    p.add_argument("out", metavar="OUT.gguf", type=Path, help="the GGUF file to write")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16",
                   help="weights: bf16 (default), fp32, int8 (Q8_0) or int4 (Q4_0; the output "
                        "IQ4_NL, the embedding Q8_0)")
    return p


def convert_main(argv: list[str] | None = None) -> int:
    """``dsr1d model convert SRC_DIR OUT.gguf [--dtype bf16|fp32|int8|int4]``."""
    from dsr1d.engine.gguf_file import inspect_gguf

    args = _parser().parse_args(argv)
    start = time.monotonic()
    try:
        path = convert(args.src, args.out, args.dtype, progress=_LayerProgress())
        info = inspect_gguf(path)
    except (ModelError, OSError) as exc:
        print(f"dsr1d model convert: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"dsr1d model convert: interrupted; {args.out} was not written", file=sys.stderr)
        return 130
    print(f"{path}: {info.name} ({info.architecture}), {info.parameters:,} parameters, "
          f"{human_size(path.stat().st_size)} {info.file_type}, {time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(convert_main())
