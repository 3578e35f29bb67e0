"""Random GGUFs of the R1-Distill-Qwen shapes in the file types people download, in seconds.

A speed test needs the published tensor mix, not trained weights. This writes a GGUF whose
metadata is dsr1d's converter's (the synthetic R1 tokenizer and chat template, the preset's
architecture) and whose tensors have the types ``llama-quantize`` gives each one for the file
type (its rules for qwen2, transcribed below), filled with random blocks whose scales are small
finite fp16 numbers: no float pass, no quantizer. A 7B Q4_K_M takes seconds, where synthesizing
bf16 weights and running llama-quantize takes minutes; never run it while timing something.

    .venv/bin/python bench/random_gguf.py --preset 1.5b --type Q4_K_M --out FILE [--seed 0]

File types: Q4_K_M, Q4_K_S, Q5_K_M, Q6_K, Q8_0, IQ4_XS, Q4_0, BF16, and int4 (dsr1d's own
conversion: Q4_0 matrices, the output IQ4_NL, the embedding Q8_0).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFWriter
from gguf.constants import GGML_QUANT_SIZES, LlamaFileType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dsr1d.engine import gguf_convert as conv  # noqa: E402
from dsr1d.engine import synth  # noqa: E402

# file type: (the type of most matrices, llama's file-type code)
FILE_TYPES = {
    "Q4_K_M": (QT.Q4_K, LlamaFileType.MOSTLY_Q4_K_M), "Q4_K_S": (QT.Q4_K, LlamaFileType.MOSTLY_Q4_K_S),
    "Q5_K_M": (QT.Q5_K, LlamaFileType.MOSTLY_Q5_K_M), "Q6_K": (QT.Q6_K, LlamaFileType.MOSTLY_Q6_K),
    "Q8_0": (QT.Q8_0, LlamaFileType.MOSTLY_Q8_0), "IQ4_XS": (QT.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS),
    "Q4_0": (QT.Q4_0, LlamaFileType.MOSTLY_Q4_0), "BF16": (QT.BF16, LlamaFileType.MOSTLY_BF16),
    "int4": (QT.Q4_0, LlamaFileType.MOSTLY_Q4_0),
}
# byte offsets of the fp16 scales inside each block (the rest may be any bytes)
SCALE_OFFSETS = {QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.Q8_0: (0,), QT.Q4_0: (0,),
                 QT.IQ4_XS: (0,), QT.IQ4_NL: (0,)}


def _more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's use_more_bits: the first and last eighth, and every third between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(name: str, ftype: str, layers: int, n_gqa: int) -> QT:
    """The type llama-quantize gives a qwen2 matrix for this file type (no importance matrix)."""
    base = FILE_TYPES[ftype][0]
    if base == QT.BF16:
        return base
    if ftype == "int4" and name in ("output.weight", "token_embd.weight"):
        return QT.IQ4_NL if name == "output.weight" else QT.Q8_0
    if name == "output.weight":
        return QT.Q8_0 if base == QT.Q8_0 else QT.Q6_K
    if name == "token_embd.weight":
        return base
    layer = int(name.split(".")[1])
    if name.endswith("attn_v.weight"):
        if ftype == "IQ4_XS" and n_gqa >= 4:
            return QT.Q5_K
        if ftype in ("Q4_K_M", "Q5_K_M") and _more_bits(layer, layers):
            return QT.Q6_K
        if ftype == "Q4_K_S" and layer < 4:
            return QT.Q5_K
    if name.endswith("ffn_down.weight"):
        if ftype in ("Q4_K_M", "Q5_K_M") and _more_bits(layer, layers):
            return QT.Q6_K
        if ftype in ("IQ4_XS", "Q4_K_S") and layer < layers // 8:
            return QT.Q5_K
    return base


def _blocks(qtype: QT, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """rows x cols weights of qtype: random bytes, each block's fp16 scales set to small values."""
    block, size = GGML_QUANT_SIZES[qtype]
    n = rows * cols // block
    if qtype == QT.BF16:
        # sign, an exponent of 2^-8..2^-5, random mantissa
        bits = rng.integers(0, 1 << 16, size=rows * cols, dtype=np.uint16)
        exp = rng.integers(0x77, 0x7B, size=rows * cols, dtype=np.uint16)
        return ((bits & 0x807F) | (exp << 7)).view(np.uint8).reshape(rows, cols * 2)
    data = np.frombuffer(rng.bytes(n * size), dtype=np.uint8).reshape(n, size).copy()
    scales = rng.uniform(1e-4, 3e-4, size=n).astype(np.float16).view(np.uint8).reshape(n, 2)
    for off in SCALE_OFFSETS[qtype]:
        data[:, off:off + 2] = scales
    return data.reshape(rows, cols // block * size)


def _hparams(preset: str, tok_dir: Path) -> conv._HParams:
    config = synth.model_config(preset)
    (tok_dir / "config.json").write_text("{}")
    return conv._hparams(config, tok_dir / "config.json")


def write(preset: str, ftype: str, out: Path, seed: int = 0) -> dict[str, int]:
    """Write the file; returns the count of matrices of each type."""
    if ftype not in FILE_TYPES:
        raise SystemExit(f"random_gguf: unknown file type {ftype} (one of {', '.join(FILE_TYPES)})")
    config = synth.model_config(preset)
    with tempfile.TemporaryDirectory() as tmp:
        tok_dir = Path(tmp)
        (tok_dir / "tokenizer.json").write_text(synth._tokenizer_json(), encoding="utf-8")
        synth._write_json(tok_dir / "tokenizer_config.json", synth._tokenizer_config())
        hp = _hparams(preset, tok_dir)
        vocab = conv._vocab(tok_dir, config, hp.vocab)
    shapes, _ = conv._expected_shapes(hp)
    shapes = {k: v for k, v in shapes.items() if not k.endswith("attn_output.bias")}
    writer = GGUFWriter(str(out) + ".tmp", hp.arch)
    conv._metadata(writer, f"random {preset} {ftype}", hp, vocab, "bf16", {})
    # _metadata wrote BF16's file type, and the writer refuses a key twice: set it in place
    writer.kv_data[0]["general.file_type"].value = int(FILE_TYPES[ftype][1])
    rng = np.random.default_rng(seed)
    counts: dict[str, int] = {}
    types = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            types[name] = QT.F32
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
            continue
        qtype = tensor_type(name, ftype, hp.layers, hp.heads // hp.kv_heads)
        if shape[1] % GGML_QUANT_SIZES[qtype][0]:
            qtype = QT.Q8_0   # llama-quantize's fallback for rows that do not fill a block
        types[name] = qtype
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
        block, size = GGML_QUANT_SIZES[qtype]
        nbytes = shape[0] * shape[1] // block * size
        writer.add_tensor_info(name, (shape[0], shape[1] // block * size), np.dtype(np.uint8), nbytes, qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, shape in shapes.items():
        if types[name] == QT.F32:
            values = np.zeros(shape, np.float32) if name.endswith("bias") else np.ones(shape, np.float32)
            writer.write_tensor_data(values)
        else:
            writer.write_tensor_data(_blocks(types[name], shape[0], shape[1], rng))
    writer.close()
    os.replace(str(out) + ".tmp", out)
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=[k for k in synth.PRESETS if k != "tiny"], default="1.5b")
    p.add_argument("--type", dest="ftype", choices=list(FILE_TYPES), default="Q4_K_M")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    start = time.monotonic()
    counts = write(args.preset, args.ftype, args.out, args.seed)
    print(f"{args.out}: {args.preset} {args.ftype}, {args.out.stat().st_size / 1e9:.2f} GB, "
          f"matrices {', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}, "
          f"{time.monotonic() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
