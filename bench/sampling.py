"""Drawing one token from a 152k-token row of logits: dsr1d's sampler (``engine/sampling.py``)
against llama.cpp's sampler chain (temperature → top-p → dist), the same rows, the same options.

Rows: a flat one (the synthetic model's kind: most of the vocabulary inside top-p 0.95) and a
peaked one (a trained model's kind). Printed: milliseconds a draw, median of ``--runs`` rounds
of ``--draws`` draws, and the ratio. llama.cpp's figure includes copying the logits into its
candidates array, as ``llama_sampler_sample`` does. Never passes or fails.

Usage: .venv/bin/python bench/sampling.py [--vocab 151936] [--draws 100] [--runs 5]
                                          [--write docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from typing import Any, Callable

import numpy as np

from dsr1d.engine.sampling import NOTHING_BARRED, TokenSampler
from results import add_write_option, markdown_table, write

OPTS = {"greedy": False, "temperature": 0.6, "top_p": 0.95, "seed": 1}


def timed(draw: Callable[[], Any], draws: int, runs: int) -> float:
    """Median milliseconds a draw."""
    draw()
    rounds = []
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(draws):
            draw()
        rounds.append((time.perf_counter() - start) / draws * 1e3)
    return statistics.median(rounds)


def llama_cpp_draw(logits: np.ndarray) -> Callable[[], int]:
    import llama_cpp as lib
    from llama_cpp._internals import LlamaTokenDataArray

    chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_temp(OPTS["temperature"]))
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_top_p(OPTS["top_p"], 1))
    lib.llama_sampler_chain_add(chain, lib.llama_sampler_init_dist(OPTS["seed"]))
    cur = LlamaTokenDataArray(n_vocab=len(logits))

    def draw() -> int:
        cur.copy_logits(logits)
        cur.candidates.selected = -1
        lib.llama_sampler_apply(chain, ctypes.byref(cur.candidates))
        return int(cur.candidates.data[cur.candidates.selected].id)
    return draw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--runs", type=int, default=5)
    add_write_option(ap)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'row':8} {'nucleus':>8} {'dsr1d ms':>9} {'llama.cpp ms':>13} {'ratio':>6}")
    table = []
    for name, scale in (("flat", 1.0), ("peaked", 6.0)):
        logits = (rng.normal(0, 1, args.vocab) * scale).astype(np.float32)
        z = logits / OPTS["temperature"]
        probs = np.sort(np.exp(z - z.max()))[::-1]
        inside = int(np.searchsorted(np.cumsum(probs / probs.sum()), OPTS["top_p"])) + 1
        ours = TokenSampler(OPTS, NOTHING_BARRED)
        mine = timed(lambda: ours(logits), args.draws, args.runs)
        try:
            theirs = timed(llama_cpp_draw(logits), args.draws, args.runs)
        except ImportError:
            theirs = float("nan")
        print(f"{name:8} {inside:8d} {mine:9.3f} {theirs:13.3f} {theirs / mine:5.1f}x")
        table.append((name, inside, f"{mine:.3f}", f"{theirs:.3f}", f"{theirs / mine:.1f}×"))
    write(args.write, "sampling", markdown_table(
        ["row", "tokens in the nucleus", "dsr1d ms a draw", "llama.cpp ms a draw", "ratio"],
        table))


if __name__ == "__main__":
    main()
