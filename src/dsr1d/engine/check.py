"""``dsr1d model check DIR``: does the engine compute what the checkpoint means?

The torch backend is the numerical reference: the Hugging Face directory loaded by
transformers in fp32. The engine is llama.cpp — the same patched tree llama-server is built
from, reached through its Python binding so that every position's logits can be read — on the
GGUF dsr1d converts the directory to (cached, like the daemon's). For each precision asked, one
row for llama.cpp and one for torch at the same precision (what the precision alone costs):
the cosine of the logits to the reference at every position (min and mean), the share of
positions whose top token agrees, and the mean KL divergence.

A row passes when its worst cosine reaches the precision's floor (a trained model clears these;
fp32 0.9999, bf16 0.9995, int8 0.999, int4 0.98) or, for models where the precision itself
costs more (a random network amplifies weight noise layer by layer), comes within ``MARGIN`` of
torch's own row at that precision. Exit 0 when every llama.cpp row passes, 1 when one does not,
2 when the check cannot run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from dsr1d.engine.errors import ModelError

FLOORS = {"fp32": 0.9999, "bf16": 0.9995, "int8": 0.999, "int4": 0.98}
MARGIN = 0.02
TEXT = ("Memory bandwidth bounds the speed of decoding on a CPU: every generated token reads "
        "every weight of the model once, so fewer bytes per weight means more tokens per second.")


@dataclass
class Row:
    """How close one computation's logits are to the reference."""

    label: str
    cosine_min: float
    cosine_mean: float
    top1: float
    kl: float
    passed: bool | None = None       # llama.cpp rows only


def compare(label: str, want, got) -> Row:
    """``got`` against ``want`` (positions × vocabulary; extra padded columns dropped)."""
    import torch

    got = got[:, : want.shape[1]].float()
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=1)
    logp, logq = torch.log_softmax(want, 1), torch.log_softmax(got, 1)
    kl = (logp.exp() * (logp - logq)).sum(1)
    return Row(label, cosine.min().item(), cosine.mean().item(),
               (got.argmax(1) == want.argmax(1)).float().mean().item(), kl.mean().item())


def passes(engine: Row, torch_same: Row, dtype: str) -> bool:
    """The rule in the module's docstring."""
    return engine.cosine_min >= min(FLOORS[dtype], torch_same.cosine_min - MARGIN)


def torch_logits(model: Path, ids: list[int], dtype: str):
    import torch

    from dsr1d.engine.model import load

    loaded = load(model, dtype)
    with torch.inference_mode():
        return loaded.model(input_ids=torch.tensor([ids])).logits[0].float()


def llama_logits(gguf: Path, ids: list[int], threads: int):
    import torch

    try:
        from llama_cpp import Llama
    except ImportError:
        raise ModelError("the check reads llama.cpp's logits through llama-cpp-python built "
                         "from dsr1d's tree; install it with tools/llama-wheel.sh (make "
                         "setup does)") from None
    llm = Llama(model_path=str(gguf), n_ctx=len(ids) + 16, n_threads=threads, logits_all=True,
                verbose=False)
    llm.eval(ids)
    logits = torch.tensor(llm.scores[: len(ids)])
    llm.close()
    return logits


def check(model: Path, dtypes: list[str], cache: Path, tokens: int, threads: int,
          say=lambda line: None) -> list[Row]:
    """Rows for every precision in ``dtypes``: llama.cpp's, then torch's at the same one."""
    from transformers import AutoTokenizer

    from dsr1d.engine.gguf_cache import cached_gguf
    from dsr1d.engine.gguf_convert import convert
    from dsr1d.engine.model import inspect_dir

    inspect_dir(model)
    tokenizer = AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    ids = tokenizer(TEXT)["input_ids"]
    ids = (ids * (tokens // max(1, len(ids)) + 1))[:tokens]
    say(f"reference: torch fp32 on {len(ids)} positions")
    want = torch_logits(model, ids, "fp32")
    rows = []
    for dtype in dtypes:
        gguf = cached_gguf(model, dtype, cache, convert, log=say)
        engine = compare(f"llama.cpp {dtype}", want, llama_logits(gguf, ids, threads))
        same = engine if dtype == "fp32" else compare(f"torch {dtype}", want,
                                                      torch_logits(model, ids, dtype))
        engine.passed = passes(engine, same, dtype)
        rows += [engine] if same is engine else [engine, same]
    return rows


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsr1d model check",
                                description="llama.cpp's logits on dsr1d's conversion of DIR "
                                            "against the torch fp32 reference")
    p.add_argument("dir", metavar="DIR", type=Path, help="a Hugging Face model directory")
    p.add_argument("--dtype", action="append", choices=list(FLOORS), default=[],
                   help="precision(s) to check (default: bf16, int8 and int4)")
    p.add_argument("--tokens", type=int, default=64, help="positions compared (default 64)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="where conversions are kept (default /var/cache/dsr1d as root, else "
                        "~/.cache/dsr1d)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def check_main(argv: list[str] | None = None) -> int:
    """Entry point of ``dsr1d model check``."""
    args = _parser().parse_args(argv)
    cache = args.cache_dir or (Path("/var/cache/dsr1d") if os.geteuid() == 0
                               else Path.home() / ".cache/dsr1d")
    try:
        rows = check(args.dir, args.dtype or ["bf16", "int8", "int4"], cache, args.tokens,
                     args.threads, lambda line: print(line, file=sys.stderr, flush=True))
    except ModelError as exc:
        print(f"dsr1d: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
    else:
        print(f"{'':16} {'cosine min':>10} {'mean':>8} {'top-1':>6} {'KL':>8}")
        for r in rows:
            verdict = "" if r.passed is None else ("  ok" if r.passed else "  FAILED")
            print(f"{r.label:16} {r.cosine_min:10.5f} {r.cosine_mean:8.5f} {r.top1:6.3f} "
                  f"{r.kl:8.5f}{verdict}")
    return 0 if all(r.passed is not False for r in rows) else 1
