"""Synthetic DeepSeek-R1-Distill-Qwen checkpoints: the real architecture, random weights, offline.

No weights can be downloaded here, so tests, the demo and the benchmarks run on model directories
built by this module. Each one is what ``transformers`` expects of a real checkpoint:
``config.json`` in the published (transformers 4.x) format, ``generation_config.json``, safetensors
weights (sharded with ``model.safetensors.index.json`` like the real ones when large) and a fast
tokenizer (``tokenizer.json`` + ``tokenizer_config.json`` with R1's special tokens and chat
template).

The tokenizer is a byte-level BPE (Qwen's pre-tokenizer regex, NFC, ByteLevel) trained in about a
tenth of a second on ``corpus.txt``, which ships next to this module, so ~4000 tokens rather than
Qwen's 151 643; as in the real checkpoints, the model's embedding is larger than the tokenizer.

Weights come from one seeded ``torch.Generator`` per tensor (seeded from the model seed and the
tensor's name), drawn in float32 and rounded to the output dtype, so the same preset and seed give
byte-identical files, and the bfloat16 and float32 variants of a seed are the same model.
Big presets are generated and written one tensor at a time (7B is 15 GB in bf16).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache, partial
from pathlib import Path
from typing import Callable, Iterator

import torch

from dsr1d.engine.errors import ModelError

Progress = Callable[[int, int, str], None]

CORPUS = Path(__file__).with_name("corpus.txt")
TOKENIZER_SIZE = 4000  # trained merges + byte alphabet + the added tokens below
MAX_SHARD_BYTES = 2 * 1024**3
SINGLE_FILE_BYTES = 2 * 1024**3  # below this, one model.safetensors without an index
INIT_STD = 0.02  # initializer_range of the real configs
LOGIT_STD = 2.0  # see _lm_head
DTYPES = {"bfloat16": (torch.bfloat16, "BF16"), "float32": (torch.float32, "F32")}
DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32"}

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
END_THINK = "</think>"
# (content, special) in R1-Distill-Qwen's order: there they are ids 151643..151649, here they are
# appended to the trained vocabulary in the same order. <think> and </think> are not "special" in
# R1's tokenizer (skip_special_tokens keeps them); they are still single added tokens.
ADDED_TOKENS = ((EOS, True), (USER, True), (ASSISTANT, True), (BOS, True), ("<|EOT|>", True),
                (THINK, False), (END_THINK, False))

# Qwen2's pre-tokenizer split (tokenizer.json of Qwen2/2.5 and of the R1-Distill-Qwen models).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
              r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# The chat template of deepseek-ai/DeepSeek-R1-Distill-Qwen-{1.5B,7B} tokenizer_config.json as
# revised in February 2025 (the generation prompt opens the think block). It prepends bos_token.
CHAT_TEMPLATE = (
    r"{% if not add_generation_prompt is defined %}"
    r"{% set add_generation_prompt = false %}{% endif %}"
    r"{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, "
    r"system_prompt='') %}"
    r"{%- for message in messages %}{%- if message['role'] == 'system' %}"
    r"{% set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}"
    r"{{bos_token}}{{ns.system_prompt}}"
    r"{%- for message in messages %}{%- if message['role'] == 'user' %}"
    r"{%- set ns.is_tool = false -%}"
    r"{{'<｜User｜>' + message['content']}}{%- endif %}"
    r"{%- if message['role'] == 'assistant' and message['content'] is none %}"
    r"{%- set ns.is_tool = false -%}"
    r"{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}"
    r"{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>'"
    r" + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n'"
    r" + '```' + '<｜tool▁call▁end｜>'}}{%- set ns.is_first = true -%}{%- else %}"
    r"{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name']"
    r" + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```'"
    r" + '<｜tool▁call▁end｜>'}}{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}"
    r"{%- endfor %}{%- endif %}"
    r"{%- if message['role'] == 'assistant' and message['content'] is not none %}"
    r"{%- if ns.is_tool %}"
    r"{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}"
    r"{%- set ns.is_tool = false -%}{%- else %}{% set content = message['content'] %}"
    r"{% if '</think>' in content %}{% set content = content.split('</think>')[-1] %}{% endif %}"
    r"{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"
    r"{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"
    r"{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content']"
    r" + '<｜tool▁output▁end｜>'}}"
    r"{%- set ns.is_output_first = false %}{%- else %}"
    r"{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}"
    r"{%- endif %}{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"
    r"{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜><think>\n'}}{% endif %}"
)

# Architecture of each preset. 1.5b and 7b are the published config.json of
# deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B and -7B; "vocab_size": None means the tokenizer's
# size rounded up to a multiple of 64 (tiny only).
PRESETS: dict[str, dict] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
             "max_window_layers": 2, "vocab_size": None},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
             "num_attention_heads": 12, "num_key_value_heads": 2, "max_position_embeddings": 131072,
             "max_window_layers": 21, "vocab_size": 151936},
    # A speculative-decoding draft for the 1.5b/7b shapes: their vocabulary, a small network.
    "draft": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 131072, "max_window_layers": 2, "vocab_size": 151936},
    "7b": {"hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
           "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 131072,
           "max_window_layers": 28, "vocab_size": 152064},
}
COMMON = {"attention_dropout": 0.0, "hidden_act": "silu", "initializer_range": INIT_STD,
          "model_type": "qwen2", "rms_norm_eps": 1e-06, "rope_theta": 10000, "sliding_window": 4096,
          "tie_word_embeddings": False, "transformers_version": "4.44.0", "use_cache": True,
          "use_mrope": False, "use_sliding_window": False}


class SynthError(Exception):
    """The model cannot be written; the message says why and what to do."""


@dataclass(frozen=True)
class TensorSpec:
    """One weight: its name, shape and how it is initialised."""

    name: str
    shape: tuple[int, ...]
    init: str  # "normal", "ones" or "lm_head"

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


# --- tokenizer -----------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _tokenizer_json() -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # min_frequency=1: the corpus is small, and the last merges are then whole rare words.
    trainer = trainers.BpeTrainer(vocab_size=TOKENIZER_SIZE - len(ADDED_TOKENS), min_frequency=1,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.read_text(encoding="utf-8").split("\n\n"), trainer)
    for content, special in ADDED_TOKENS:
        token = AddedToken(content, normalized=False, special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    # R1's tokenizer_config has add_bos_token: encoding a text starts with BOS.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return tok.to_str(pretty=True)


def special_ids() -> dict[str, int]:
    """The ids of R1's added tokens in the synthetic tokenizer, by content."""
    vocab = json.loads(_tokenizer_json())["added_tokens"]
    return {t["content"]: t["id"] for t in vocab}


def tokenizer_size() -> int:
    """Tokens the synthetic tokenizer knows (the model's vocab_size may be larger)."""
    return max(special_ids().values()) + 1


def _tokenizer_config() -> dict:
    return {"add_bos_token": True, "add_eos_token": False, "bos_token": BOS,
            "clean_up_tokenization_spaces": False, "eos_token": EOS, "legacy": True,
            "model_max_length": 16384, "pad_token": EOS, "sp_model_kwargs": {}, "unk_token": None,
            # What the real checkpoints say. transformers 5 sees a ByteLevel tokenizer.json and
            # loads the model type's Qwen2Tokenizer instead (a TokenizersBackend, i.e. a
            # PreTrainedTokenizerFast, encoding exactly as tokenizer.json), as for them.
            "tokenizer_class": "LlamaTokenizerFast", "chat_template": CHAT_TEMPLATE}


# --- config and weights --------------------------------------------------------------------------

def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def model_config(preset: str, dtype: str = "bfloat16", seed: int = 0) -> dict:
    """The config.json of a preset, in the published (transformers 4.x) layout."""
    if preset not in PRESETS:
        raise SynthError(f"unknown preset {preset!r} (one of {', '.join(PRESETS)})")
    dtype = _check_dtype(dtype)
    arch = dict(PRESETS[preset])
    arch["vocab_size"] = arch["vocab_size"] or _round_up(tokenizer_size(), 64)
    ids = special_ids()
    # The published configs say bos_token_id = eos_token_id = 151643 (Qwen's <|endoftext|> slot,
    # which R1 renamed to <｜end▁of▁sentence｜>); their generation_config says bos 151646. Here
    # both files carry the synthetic tokenizer's own ids, so that config and tokenizer agree.
    config = {"architectures": ["Qwen2ForCausalLM"], **COMMON, **arch,
              "bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "torch_dtype": dtype,
              "dsr1d_synthetic": {"preset": preset, "seed": seed,
                                  "tokenizer_size": tokenizer_size()}}
    return dict(sorted(config.items()))


def generation_config(config: dict) -> dict:
    """R1's recommended sampling (temperature 0.6, top-p 0.95), as in the published file."""
    return {"_from_model_config": True, "bos_token_id": config["bos_token_id"],
            "eos_token_id": config["eos_token_id"], "do_sample": True, "temperature": 0.6,
            "top_p": 0.95, "transformers_version": "4.39.3"}


def tensor_specs(config: dict) -> list[TensorSpec]:
    """Every weight of Qwen2ForCausalLM for this config, in checkpoint order."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    specs = [TensorSpec("model.embed_tokens.weight", (config["vocab_size"], h), "normal")]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            TensorSpec(p + "input_layernorm.weight", (h,), "ones"),
            TensorSpec(p + "self_attn.q_proj.weight", (heads * hd, h), "normal"),
            TensorSpec(p + "self_attn.q_proj.bias", (heads * hd,), "normal"),
            TensorSpec(p + "self_attn.k_proj.weight", (kv * hd, h), "normal"),
            TensorSpec(p + "self_attn.k_proj.bias", (kv * hd,), "normal"),
            TensorSpec(p + "self_attn.v_proj.weight", (kv * hd, h), "normal"),
            TensorSpec(p + "self_attn.v_proj.bias", (kv * hd,), "normal"),
            TensorSpec(p + "self_attn.o_proj.weight", (h, heads * hd), "normal"),
            TensorSpec(p + "post_attention_layernorm.weight", (h,), "ones"),
            TensorSpec(p + "mlp.gate_proj.weight", (inter, h), "normal"),
            TensorSpec(p + "mlp.up_proj.weight", (inter, h), "normal"),
            TensorSpec(p + "mlp.down_proj.weight", (h, inter), "normal"),
        ]
    specs.append(TensorSpec("model.norm.weight", (h,), "ones"))
    if not config.get("tie_word_embeddings"):
        specs.append(TensorSpec("lm_head.weight", (config["vocab_size"], h), "lm_head"))
    return specs


def parameter_count(config: dict) -> int:
    return sum(s.numel for s in tensor_specs(config))


def _tensor_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"dsr1d-synth:{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _make_tensor(spec: TensorSpec, seed: int, dtype: torch.dtype, tok_size: int) -> torch.Tensor:
    if spec.init == "ones":
        return torch.ones(spec.shape, dtype=dtype)
    gen = torch.Generator().manual_seed(_tensor_seed(seed, spec.name))
    if spec.init == "lm_head":
        return _lm_head(spec, gen, tok_size).to(dtype)
    weight = torch.empty(spec.shape, dtype=torch.float32)
    return weight.normal_(0.0, INIT_STD, generator=gen).to(dtype)


def _lm_head(spec: TensorSpec, gen: torch.Generator, tok_size: int) -> torch.Tensor:
    """Rows of real tokens give logits of std LOGIT_STD; rows past the tokenizer are zero.

    The final RMSNorm makes the hidden state's per-dimension RMS 1, so a row of std s gives logits
    of std s * sqrt(hidden). With std 0.02 (~0.8 logits at 1.5B) and 148 000 padding rows, plain
    sampling would mostly pick ids the tokenizer cannot decode; zero rows (logit 0) and livelier
    real rows keep greedy decoding and R1's default sampling on real tokens.
    """
    vocab, hidden = spec.shape
    weight = torch.empty(spec.shape, dtype=torch.float32)
    weight.normal_(0.0, LOGIT_STD / hidden ** 0.5, generator=gen)
    weight[min(tok_size, vocab):] = 0.0
    return weight


# --- safetensors, written tensor by tensor --------------------------------------------------------

def _plan_files(specs: list[TensorSpec], itemsize: int) -> list[tuple[str, list[TensorSpec]]]:
    total = sum(s.numel for s in specs) * itemsize
    if total <= SINGLE_FILE_BYTES:
        return [("model.safetensors", specs)]
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        nbytes = spec.numel * itemsize
        if shards[-1] and size + nbytes > MAX_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    n = len(shards)
    return [(f"model-{i + 1:05d}-of-{n:05d}.safetensors", shard) for i, shard in enumerate(shards)]


def _header(specs: list[TensorSpec], st_dtype: str, itemsize: int) -> bytes:
    entries: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        end = offset + spec.numel * itemsize
        entries[spec.name] = {"dtype": st_dtype, "shape": list(spec.shape),
                              "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(entries, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, like safetensors' own writer
    return len(raw).to_bytes(8, "little") + raw


def _tensors(specs: list[TensorSpec], make: Callable[[TensorSpec], torch.Tensor],
             workers: int) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """The tensors in order, drawn by a few threads ahead of the writer (normal_ drops the GIL)."""
    if workers <= 1:
        for spec in specs:
            yield spec, make(spec)
        return
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="synth") as pool:
        pending: deque = deque()
        todo = iter(specs)
        for spec in todo:
            pending.append((spec, pool.submit(make, spec)))
            if len(pending) >= workers:
                break
        while pending:
            spec, future = pending.popleft()
            nxt = next(todo, None)
            if nxt is not None:
                pending.append((nxt, pool.submit(make, nxt)))
            yield spec, future.result()


def _write_weights(out_dir: Path, config: dict, seed: int, dtype: str, progress: Progress | None,
                   workers: int) -> list[str]:
    torch_dtype, st_dtype = DTYPES[dtype]
    itemsize = torch.empty((), dtype=torch_dtype).element_size()
    specs = tensor_specs(config)
    total = sum(s.numel for s in specs) * itemsize
    files = _plan_files(specs, itemsize)
    tok_size = config["dsr1d_synthetic"]["tokenizer_size"]
    done = 0
    for fname, shard in files:
        part_path = out_dir / (fname + ".partial")
        with open(part_path, "wb") as f:
            f.write(_header(shard, st_dtype, itemsize))
            make = partial(_make_tensor, seed=seed, dtype=torch_dtype, tok_size=tok_size)
            for spec, tensor in _tensors(shard, make, workers):
                f.write(memoryview(tensor.contiguous().view(torch.uint8).numpy()))
                done += spec.numel * itemsize
                if progress:
                    progress(done, total, spec.name)
        os.replace(part_path, out_dir / fname)
    if len(files) > 1:
        weight_map = {s.name: fname for fname, shard in files for s in shard}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out_dir / "model.safetensors.index.json", index)
    return [fname for fname, _ in files]


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --- entry points --------------------------------------------------------------------------------

def _check_dtype(dtype: str) -> str:
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype not in DTYPES:
        raise SynthError(f"unknown dtype {dtype!r} (one of {', '.join(DTYPES)})")
    return dtype


def weight_bytes(preset: str, dtype: str = "bfloat16") -> int:
    """Bytes of weights the preset writes in this dtype."""
    config = model_config(preset, dtype)
    itemsize = torch.empty((), dtype=DTYPES[config["torch_dtype"]][0]).element_size()
    return parameter_count(config) * itemsize


def _stale_outputs(out_dir: Path) -> list[Path]:
    """Weight files of an earlier model here: a left-over index or shard would corrupt this one,
    and a left-over GGUF would no longer match it."""
    if not out_dir.is_dir():
        return []
    return sorted(p for p in out_dir.iterdir() if p.is_file() and p.name.startswith("model")
                  and (".safetensors" in p.name or p.suffix == ".gguf"))


def _check_space(out_dir: Path, need: int, reclaimable: int) -> None:
    probe = out_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    margin = 64 * 1024**2
    if free + reclaimable < need + margin:
        raise SynthError(f"not enough free disk space in {probe}: the model needs "
                         f"{_gb(need)} and {_gb(free + reclaimable)} is available "
                         f"(free space elsewhere, or pick another directory)")


def synthesize(preset: str, out_dir: Path, seed: int = 0, dtype: str = "bfloat16",
               progress: Progress | None = None, workers: int | None = None) -> Path:
    """Write a loadable R1-Distill-Qwen model directory with random weights; returns its path.

    Files this function owns (config, tokenizer, weights) are overwritten; weight files of an
    earlier model in ``out_dir`` are removed. ``progress(done_bytes, total_bytes, tensor_name)`` is
    called after each tensor. Raises SynthError for a bad preset or dtype, or too little disk.
    """
    out_dir = Path(out_dir)
    config = model_config(preset, dtype, seed)
    need = weight_bytes(preset, config["torch_dtype"])
    stale = _stale_outputs(out_dir)
    _check_space(out_dir, need, sum(p.stat().st_size for p in stale))
    out_dir.mkdir(parents=True, exist_ok=True)
    # config.json goes last, so that an interrupted run never looks like a complete model.
    for path in stale + [out_dir / "config.json"]:
        path.unlink(missing_ok=True)
    if workers is None:
        workers = min(4, len(os.sched_getaffinity(0)))
    _write_weights(out_dir, config, seed, config["torch_dtype"], progress, workers)
    (out_dir / "tokenizer.json").write_text(_tokenizer_json(), encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    _write_json(out_dir / "generation_config.json", generation_config(config))
    _write_json(out_dir / "config.json", config)
    return out_dir


# --- command line --------------------------------------------------------------------------------

def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def _progress_groups(specs: list[TensorSpec]) -> dict[str, tuple[int, str]]:
    """Last tensor of each progress step (embedding, each layer, norm + head) -> (step, label)."""
    last: dict[str, str] = {}
    for spec in specs:
        parts = spec.name.split(".")
        if parts[1:2] == ["layers"]:
            label = ".".join(parts[:3])
        else:
            label = "model.embed_tokens" if "embed_tokens" in spec.name else "model.norm, lm_head"
        last[label] = spec.name
    return {name: (i + 1, label) for i, (label, name) in enumerate(last.items())}


def _cli_progress(config: dict) -> Progress:
    steps = _progress_groups(tensor_specs(config))
    width = len(str(len(steps)))

    def report(done: int, total: int, name: str) -> None:
        if name in steps:
            step, label = steps[name]
            print(f"[{step:{width}d}/{len(steps)}] {done / 1e9:.1f}/{total / 1e9:.1f} GB {label}",
                  file=sys.stderr, flush=True)
    return report


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dsr1d model synth",
        description="Write a DeepSeek-R1-Distill-Qwen model directory with random weights "
                    "(the real architecture and chat template, a small synthetic tokenizer).")
    p.add_argument("--preset", choices=list(PRESETS), default="tiny",
                   help="tiny (tests, ~1 MB), 1.5b (3.6 GB in bf16) or 7b (15 GB in bf16)")
    p.add_argument("--seed", type=int, default=0, help="weights seed (default 0)")
    p.add_argument("--dtype", default="bfloat16", choices=[*DTYPES, *DTYPE_ALIASES],
                   help="weights dtype (default bfloat16)")
    p.add_argument("--gguf", action="append", default=[], metavar="DTYPE",
                   choices=("bf16", "fp32", "int8", "int4"),
                   help="also write DIR/model-DTYPE.gguf for llama.cpp (repeatable)")
    p.add_argument("--force", action="store_true", help="write into a non-empty DIR")
    p.add_argument("dir", metavar="DIR", type=Path, help="output directory")
    return p


def synth_main(argv: list[str] | None = None) -> int:
    """``dsr1d model synth --preset tiny|1.5b|7b [--seed N] [--dtype D] [--force] DIR``."""
    args = _parser().parse_args(argv)
    out: Path = args.dir
    try:
        if out.exists() and not out.is_dir():
            raise SynthError(f"{out} exists and is not a directory")
        if out.is_dir() and any(out.iterdir()) and not args.force:
            raise SynthError(f"{out} is not empty (use --force to write into it anyway)")
        config = model_config(args.preset, args.dtype, args.seed)
        progress = _cli_progress(config) if args.preset != "tiny" else None
        start = time.monotonic()
        synthesize(args.preset, out, seed=args.seed, dtype=args.dtype, progress=progress)
        ggufs = [write_gguf(out, dtype) for dtype in args.gguf]
    except (SynthError, ModelError, OSError) as exc:
        print(f"dsr1d model synth: error: {exc}", file=sys.stderr)
        return 1
    params = parameter_count(config)
    size = sum(p.stat().st_size for p in out.glob("model*.safetensors"))
    shards = len(list(out.glob("model*.safetensors")))
    print(f"{out}: DeepSeek-R1-Distill-Qwen {args.preset} (Qwen2ForCausalLM, random weights, "
          f"seed {args.seed}): {params:,} parameters, {_gb(size)} {config['torch_dtype']} in "
          f"{shards} file{'s' if shards > 1 else ''}, tokenizer {tokenizer_size()} tokens, "
          f"{time.monotonic() - start:.1f} s")
    for path in ggufs:
        print(f"{path}: {_gb(path.stat().st_size)} GGUF for llama.cpp")
    return 0


def write_gguf(model_dir: Path, dtype: str) -> Path:
    """``model_dir/model-<dtype>.gguf``: the synthetic model converted for llama.cpp."""
    from dsr1d.engine.gguf_convert import convert

    return convert(model_dir, model_dir / f"model-{dtype}.gguf", dtype)


if __name__ == "__main__":
    sys.exit(synth_main())
