"""Loading a local Hugging Face model directory, offline, with progress and clear errors."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

from dsr1d.constants import ENGINE_DTYPES  # noqa: E402
from dsr1d.cpu import cpu_flags  # noqa: E402
from dsr1d.engine import memory  # noqa: E402
from dsr1d.engine.backend import model_name  # noqa: E402
from dsr1d.engine.errors import ModelError  # noqa: E402,F401  (re-exported)

SUPPORTED = {"Qwen2ForCausalLM": "R1-Distill-Qwen", "LlamaForCausalLM": "R1-Distill-Llama"}
DTYPES = ENGINE_DTYPES
BYTES_PER_PARAM = {"bf16": 2.0, "fp32": 4.0, "int8": 1.0 + 0.02, "int4": 0.5 + 0.13}
MEMORY_HEADROOM = 0.9
Progress = Callable[[int, int, str], None]


@dataclass
class Loaded:
    """A model ready to generate, and how it was loaded."""

    model: torch.nn.Module
    tokenizer: object
    path: Path
    name: str
    dtype: str
    dtype_reason: str
    parameters: int
    context: int


def native_bf16(flags: set[str] | None = None) -> bool:
    """Whether the CPU computes bf16 natively (AVX512-BF16 or AMX)."""
    if flags is None:
        flags = cpu_flags()
    return bool({"avx512_bf16", "amx_bf16"} & flags)


def choose_dtype(requested: str, flags: set[str] | None = None) -> tuple[str, str]:
    """The dtype to load and the reason, for ``auto`` and explicit requests alike."""
    if requested not in DTYPES:
        raise ModelError(f"unknown dtype {requested!r} (one of {', '.join(DTYPES)})")
    if requested != "auto":
        return requested, "requested"
    if native_bf16(flags):
        return "bf16", "auto: the CPU has native bf16 (avx512_bf16/amx)"
    return "fp32", "auto: no native bf16 on this CPU (no avx512_bf16/amx_bf16), so fp32"


def inspect_dir(path: Path) -> tuple[dict, list[Path], int]:
    """Config, weight shards and parameter count of a model directory; ModelError if unusable."""
    if not path.is_dir():
        raise ModelError(f"model directory {path} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelError(f"{path} is not a Hugging Face model directory (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ModelError(f"{config_file}: not valid JSON ({exc})") from None
    archs = config.get("architectures") or [config.get("model_type", "?")]
    if not any(a in SUPPORTED for a in archs):
        raise ModelError(f"unsupported architecture {', '.join(archs)} in {config_file} "
                         f"(supported: {', '.join(SUPPORTED)})")
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ModelError(f"no *.safetensors weights in {path}")
    if not (path / "tokenizer.json").is_file():
        raise ModelError(f"no tokenizer.json in {path}: a fast tokenizer is required")
    parameters = 0
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    parameters += _numel(f.get_slice(name).get_shape())
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise ModelError(f"{shard}: not a readable safetensors file ({exc})") from None
    return config, shards, parameters


def check_memory(parameters: int, dtype: str) -> None:
    """Refuse before loading when the weights would not fit in available memory."""
    available, where = memory.available()
    peak = _peak_bytes(parameters, dtype)
    if peak <= available * MEMORY_HEADROOM:
        return
    fits = [d for d in ("bf16", "int8", "int4")
            if d != dtype and _peak_bytes(parameters, d) <= available * MEMORY_HEADROOM]
    advice = f"try dtype={' or '.join(fits)}" if fits else "use a smaller model"
    raise ModelError(f"the model needs about {peak / 1e9:.1f} GB to load as {dtype} but only "
                     f"{available / 1e9:.1f} GB is {where}; {advice}")


def _peak_bytes(parameters: int, dtype: str) -> float:
    # Quantising passes through bf16 one linear at a time; the peak is the bf16 model.
    return parameters * (2.0 if dtype in ("int8", "int4") else BYTES_PER_PARAM[dtype])


def load(path: Path, dtype: str = "auto", progress: Progress | None = None) -> Loaded:
    """Load ``path`` (offline) as ``dtype``; ``progress(done_bytes, total_bytes, shard)``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dsr1d.engine.quant import quantize

    config_json, shards, parameters = inspect_dir(path)
    chosen, reason = choose_dtype(dtype)
    check_memory(parameters, chosen)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    if not getattr(tokenizer, "is_fast", False):
        raise ModelError(f"{path}: the tokenizer is not a fast (Rust) tokenizer")
    load_dtype = torch.float32 if chosen == "fp32" else torch.bfloat16
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=load_dtype,
                                                 attn_implementation="sdpa")
    _load_weights(model, shards, load_dtype, progress)
    _materialise_buffers(model, config)
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    if chosen in ("int8", "int4"):
        quantize(model, chosen)
    context = int(config_json.get("max_position_embeddings", 4096))
    return Loaded(model, tokenizer, path, model_name(path), chosen, reason, parameters, context)


def _load_weights(model: torch.nn.Module, shards: list[Path], dtype: torch.dtype,
                  progress: Progress | None) -> None:
    total = sum(s.stat().st_size for s in shards)
    done = 0
    expected = set(model.state_dict())
    seen: set[str] = set()
    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name).to(dtype)
                    model.load_state_dict({name: tensor}, strict=False, assign=True)
                    seen.add(name)
        except (RuntimeError, ValueError) as exc:
            raise ModelError(f"{shard}: cannot load weights ({str(exc).splitlines()[0]})") from None
        except Exception as exc:  # SafetensorError
            raise ModelError(f"{shard}: not a readable safetensors file ({exc})") from None
        done += shard.stat().st_size
        if progress:
            progress(done, total, shard.name)
    missing = expected - seen
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    if missing - tied:
        raise ModelError(f"weights missing from the checkpoint: {sorted(missing - tied)[:5]}")


def _materialise_buffers(model: torch.nn.Module, config: object) -> None:
    """Rebuild non-persistent buffers (rotary inv_freq) that stayed on the meta device."""
    for name, module in model.named_modules():
        if any(b.is_meta for b in module.buffers(recurse=False)) and hasattr(module, "inv_freq"):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            with torch.device("cpu"):
                setattr(parent, child, type(module)(config=config))
    left = [n for n, b in model.named_buffers() if b.is_meta]
    left += [n for n, p in model.named_parameters() if p.is_meta]
    if left:
        raise ModelError(f"could not materialise {left[:5]}")


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count

