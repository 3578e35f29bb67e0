"""How close the llama.cpp backend's logits are to the torch fp32 reference, per precision, on
the synthetic DeepSeek-R1-Distill-Qwen-1.5B (the tests check the tiny model; this is the real
shape). Prints, for F32 / BF16 / Q8_0 / Q4_0 conversions of the same checkpoint, the cosine of
the logits at every position of a ~64-token sequence (min and mean), the top-1 agreement, and
the mean KL divergence of the softmax from the reference. Never passes or fails.

    .venv/bin/python bench/numerics.py [--model DIR] [--tokens 64] [--write docs/benchmarks.md]

The model is the one bench/inference.py synthesises (default
/var/tmp/dsr1d-bench/r1-distill-qwen-1.5b); conversions are cached beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from results import add_write_option, markdown_table, write

os.environ.setdefault("HF_HUB_OFFLINE", "1")
DEFAULT_MODEL = Path("/var/tmp/dsr1d-bench/r1-distill-qwen-1.5b")
DTYPES = ("fp32", "bf16", "int8", "int4")
TEXT = ("Memory bandwidth bounds the speed of decoding on a CPU: every generated token reads "
        "every weight of the model once, so fewer bytes per weight means more tokens per second.")


def ensure_gguf(model: Path, dtype: str) -> Path:
    """The model converted to ``dtype``, reused while newer than its config and of the
    converter's current layout."""
    from dsr1d.engine.gguf_convert import convert, is_current

    out = model / f"numerics-{dtype}.gguf"
    if not is_current(out, model):
        print(f"converting to {dtype}…", file=sys.stderr, flush=True)
        convert(model, out, dtype)
    return out


def torch_logits(model: Path, ids: list[int], dtype: str = "fp32"):
    """Logits of the torch backend loaded as ``dtype`` (fp32: the reference)."""
    import torch

    from dsr1d.engine.model import load

    loaded = load(model, dtype)
    with torch.inference_mode():
        logits = loaded.model(input_ids=torch.tensor([ids])).logits[0].float()
    del loaded
    return logits


def compare(want, got) -> dict[str, float]:
    import torch

    got = got[:, : want.shape[1]]
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=1)
    logp, logq = torch.log_softmax(want, 1), torch.log_softmax(got, 1)
    kl = (logp.exp() * (logp - logq)).sum(1)
    return {"cosine_min": cosine.min().item(), "cosine_mean": cosine.mean().item(),
            "top1_agreement": (got.argmax(1) == want.argmax(1)).float().mean().item(),
            "kl_mean": kl.mean().item()}


def report(label: str, source: str, r: dict[str, float], positions: int) -> None:
    print(f"{label:10} ({source}): cosine min {r['cosine_min']:.5f} mean "
          f"{r['cosine_mean']:.5f}, top-1 agreement {r['top1_agreement']:.3f}, "
          f"KL {r['kl_mean']:.5f} over {positions} positions", flush=True)


def _llama(path: Path, context: int) -> "Llama":  # noqa: F821
    """The same patched llama.cpp through llama-cpp-python, every position's logits kept."""
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=context, n_threads=2, logits_all=True,
                 verbose=False)


# The rows as the results page lists them: llama.cpp's precision next to the torch backend's.
LABELS = {"fp32": "llama.cpp F32", "bf16": "llama.cpp BF16", "int8": "llama.cpp Q8_0",
          "torch-int8": "torch int8 (per channel)", "int4": "llama.cpp Q4_0",
          "torch-int4": "torch int4 (group 32)"}


def table(rows: dict[str, dict[str, float]]) -> str:
    return markdown_table(["precision", "cosine min / mean", "top-1 agreement", "KL"], [
        (label, f"{r['cosine_min']:.5f} / {r['cosine_mean']:.5f}", f"{r['top1_agreement']:.3f}",
         f"{r['kl_mean']:.5f}") for key, label in LABELS.items() if (r := rows.get(key))])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--tokens", type=int, default=64)
    add_write_option(parser)
    args = parser.parse_args()
    import torch

    from dsr1d.engine.synth import synthesize

    if not (args.model / "config.json").exists():
        synthesize("1.5b", args.model)
    ggufs = {dtype: ensure_gguf(args.model, dtype) for dtype in DTYPES}
    first = _llama(ggufs["int4"], args.tokens + 64)
    ids = (first.tokenize(TEXT.encode(), add_bos=True) +
           first.tokenize((" " + TEXT).encode(), add_bos=False) * 4)[: args.tokens]
    del first
    want = torch_logits(args.model, ids)
    rows = {}
    # The torch backend's own int8/int4 on the same checkpoint: how much of a row's error is the
    # precision itself (a random 28-layer network amplifies weight noise) and how much llama.cpp.
    for dtype in ("int8", "int4"):
        rows[f"torch-{dtype}"] = compare(want, torch_logits(args.model, ids, dtype))
        report(f"torch-{dtype}", "the torch backend", rows[f"torch-{dtype}"], len(ids))
    for dtype, path in ggufs.items():
        llm = _llama(path, args.tokens + 64)
        llm.eval(ids)
        rows[dtype] = compare(want, torch.tensor(llm.scores[:len(ids)]))
        del llm
        report(dtype, path.name, rows[dtype], len(ids))
    print(json.dumps({"model": str(args.model), "positions": len(ids), "rows": rows}))
    write(args.write, "numerics", f"{len(ids)} positions, logits against torch fp32 on "
          f"{args.model}:\n\n{table(rows)}")


if __name__ == "__main__":
    main()
