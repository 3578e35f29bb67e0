"""IQ4_NL quantisation for GGUF files (``gguf`` can read it, not write it).

IQ4_NL stores a block of 32 weights as an f16 scale ``d`` and 32 four-bit indices into a fixed,
non-uniform grid (``GRID``, denser near zero, where most weights are): a weight is
``d * GRID[index]``. It is the size of Q4_0 (18 bytes a block, 4.5 bits a weight), closer to the
weights than Q4_0's uniform grid, and llama.cpp repacks it for AVX2 / AVX-512 like Q4_0, so a
batch of rows is one pass over the weights rather than one per row (Q8_0 is not repacked on
x86: llamafile's kernels then redo each block's scale work for every row).

The search follows llama.cpp's ``quantize_row_iq4_nl_impl`` without an importance matrix
(weights ``x²``): the scale that maps the block's largest magnitude to the grid's end, then 15
nearby scales of either sign (the grid is not symmetric), keeping the one that maximises
``(Σ w·q·x)² / Σ w·q²``; ``d`` is then the least-squares scale for the chosen indices.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

GRID = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                dtype=np.float32)
BLOCK = 32
TRIES = 7                     # scales tried either side of the first guess, as llama.cpp does
TINY = 1e-15                  # a block this small is all zeros
PER_THREAD = 1 << 20          # values worth a thread of their own
SLAB = 2048                   # blocks quantised together
# Every midpoint between neighbouring grid values is a multiple of 0.5, so the nearest grid
# index of y follows from floor(2y) alone (ties go up, as in llama.cpp's best_index_int8).
_HALF_STEPS = 600
_NEAREST = np.searchsorted(GRID[1:] + GRID[:-1], np.arange(-_HALF_STEPS, _HALF_STEPS + 1),
                           side="right").astype(np.uint8)


def nearest(y: np.ndarray) -> np.ndarray:
    """The index of the grid value nearest to each of ``y``."""
    steps = np.floor(y * 2, out=np.empty_like(y))
    np.clip(steps, -_HALF_STEPS, _HALF_STEPS, out=steps)
    return _NEAREST[steps.astype(np.intp) + _HALF_STEPS]


def quantize_iq4_nl(values: np.ndarray) -> np.ndarray:
    """``values`` (rows × a multiple of 32, float32) as IQ4_NL bytes, rows × (cols / 32 × 18);
    a large array is split across the CPUs (numpy releases the GIL)."""
    rows, cols = values.shape
    parts = min(os.cpu_count() or 1, max(1, rows * cols // PER_THREAD), rows)
    if parts == 1:
        return _quantize(values)
    with ThreadPoolExecutor(parts) as pool:
        return np.concatenate(list(pool.map(_quantize, np.array_split(values, parts))))


def _quantize(values: np.ndarray) -> np.ndarray:
    rows, cols = values.shape
    blocks = np.ascontiguousarray(values, dtype=np.float32).reshape(-1, BLOCK)
    # a slab at a time, small enough that the 16 passes over it stay in the CPU's cache
    out = np.concatenate([_quantize_blocks(blocks[i:i + SLAB])
                          for i in range(0, len(blocks), SLAB)])
    return out.reshape(rows, cols // BLOCK * 18)


def _quantize_blocks(x: np.ndarray) -> np.ndarray:
    weight = x * x
    top = np.take_along_axis(x, np.abs(x).argmax(axis=1)[:, None], axis=1)[:, 0]
    live = np.abs(top) >= TINY
    top = np.where(live, top, 1.0).astype(np.float32)
    # the first guess, then inverse scales (t - 127) / top for t in -TRIES..TRIES
    guesses = [-GRID[0] / top] + [(t + GRID[0]) / top for t in range(-TRIES, TRIES + 1)]
    best_score = np.full(len(x), -np.inf, dtype=np.float32)
    best_d = np.zeros(len(x), dtype=np.float32)
    for inv in guesses:
        q = GRID[nearest(x * inv[:, None])]
        wq = weight * q
        sumqx = np.einsum("ij,ij->i", wq, x)
        sumq2 = np.einsum("ij,ij->i", wq, q)
        with np.errstate(divide="ignore", invalid="ignore"):
            score = np.where(sumq2 > 0, sumqx * sumqx / sumq2, -np.inf)
            better = score > best_score
            best_d = np.where(better, sumqx / sumq2, best_d)
        best_score = np.maximum(best_score, score)
    best_d = np.where(live, best_d, 0.0).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(best_d != 0, 1.0 / best_d, 0.0).astype(np.float32)
    index = nearest(x * inv[:, None])
    packed = index[:, :16] | (index[:, 16:] << 4)
    scale = best_d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    return np.concatenate([scale, packed], axis=1)
