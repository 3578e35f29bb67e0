"""Drawing the next token from a row of logits, for both backends.

The rule: padding tokens barred, then greedy, or temperature → top-p over the tempered
distribution → a seeded draw (the same seed, the same tokens). llama.cpp's own top-p
sorts the whole vocabulary by probability whenever the nucleus is wide — for a 152k
vocabulary a tenth of a decode step on a small machine, paid once per sequence in a batch.
Here only the values are sorted (SIMD) to find the probability the nucleus ends at; the
tokens at or above it are then drawn from in id order. Running sums are taken a block at a
time (the block totals, then one block's own sum), not over the whole row: numpy's ``cumsum``
is sequential. Where most of the vocabulary is barred (a table padded far beyond its
tokenizer, as the synthetic models' 152k rows over 4k tokens), the allowed ids are gathered
first and every pass is over them. (Its timings: ``bench/sampling.py``.)
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from dsr1d.engine.errors import ModelError

BLOCK = 1024        # values per block of a running sum
FIRST_LOOK = 256    # most likely tokens tried first: a peaked distribution needs no more
NOTHING_BARRED = np.array([], dtype=np.intp)


class TokenSampler:
    """One request's sampler: ``sampler(logits) -> token id``; deterministic for a seed."""

    def __init__(self, opts: dict[str, Any], barred: np.ndarray,
                 allowed: np.ndarray | None = None) -> None:
        self.greedy = bool(opts["greedy"]) or float(opts["temperature"]) == 0.0
        self.inv_temp = 0.0 if self.greedy else 1.0 / float(opts["temperature"])
        self.top_p = float(opts["top_p"])
        self.barred = barred
        self.allowed = allowed      # given (`allowed_tokens`): the only ids ever drawn
        seed = int(opts["seed"])
        if seed < 0:
            seed = random.SystemRandom().randrange(2**31)
        self.rng = np.random.Generator(np.random.PCG64(seed))

    def __call__(self, logits: np.ndarray) -> int:
        if self.allowed is not None:
            # the few ids that can be drawn, gathered first: every pass below is over them
            row = np.asarray(logits)[self.allowed].astype(np.float32, copy=False)
            return int(self.allowed[self._draw(_usable(row))])
        row = _usable(np.array(logits, dtype=np.float32))   # a copy: llama.cpp's stays as is
        if self.barred.size:
            row[self.barred] = -np.inf
        return self._draw(row)

    def _draw(self, row: np.ndarray) -> int:
        """The index drawn from ``row`` (a copy, changed in place)."""
        best = int(np.argmax(row))
        if row[best] == -np.inf:
            raise ModelError("the model gave no usable logits (all NaN or barred)")
        if self.greedy:
            return best
        row -= row[best]   # shifted before tempering: an overflow then only sends a token to -inf
        with np.errstate(over="ignore"):
            row *= self.inv_temp
        probs = np.exp(row, out=row)
        ids = nucleus(probs, self.top_p)
        weights = probs if len(ids) == len(probs) else probs[ids]
        target = self.rng.random() * float(weights.sum(dtype=np.float64))
        return int(ids[first_reaching(weights, target, strict=True)])


def _usable(row: np.ndarray) -> np.ndarray:
    """``row`` with NaN never drawn and +inf the best finite value, in place."""
    return np.nan_to_num(row, copy=False, nan=-np.inf, posinf=np.finfo(np.float32).max)


def allowed_tokens(barred: np.ndarray, vocabulary: int) -> np.ndarray | None:
    """The ids not ``barred``, in order, where they are fewer than half the vocabulary (a
    vocabulary padded far beyond its tokenizer: the synthetic models bar 148k of 152k ids);
    else None, and barring costs less than gathering."""
    if barred.size <= vocabulary // 2:
        return None
    keep = np.ones(vocabulary, dtype=bool)
    keep[barred] = False
    return np.flatnonzero(keep)


def nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The ids, in id order, of the most likely tokens whose mass first reaches ``top_p`` of
    the total (the token crossing it included, and every token tied with that one); never a
    token of probability 0."""
    if top_p >= 1.0:    # the whole distribution: no order needed to draw from it
        return np.flatnonzero(probs > 0)
    target = top_p * float(probs.sum(dtype=np.float64))
    # The probability the cut falls at, from the values sorted (5x faster than an argsort,
    # whose order is not needed: a draw by cumulative mass works in any order), the few most
    # likely first, partitioned out: a peaked row ends among them. Not when most of the row is
    # 0 (a vocabulary's barred tokens, underflow): numpy's partition slows to 2-3 ms there,
    # while its sort speeds up.
    desc = None
    if len(probs) > FIRST_LOOK and np.count_nonzero(probs) > len(probs) // 2:
        head = np.sort(np.partition(probs, len(probs) - FIRST_LOOK)[-FIRST_LOOK:])[::-1]
        desc = head if head.sum(dtype=np.float64) >= target else None
    if desc is None:
        desc = np.sort(probs)[::-1]
    cut = max(desc[first_reaching(desc, target)], np.finfo(probs.dtype).tiny)
    return np.flatnonzero(probs >= cut)


def first_reaching(values: np.ndarray, target: float, strict: bool = False) -> int:
    """The index at which the running sum of ``values`` first reaches (``strict``: passes)
    ``target``; the last index if it never does (rounding)."""
    whole = len(values) // BLOCK * BLOCK
    totals = np.cumsum(values[:whole].reshape(-1, BLOCK).sum(axis=1, dtype=np.float64))
    side = "right" if strict else "left"
    block = int(np.searchsorted(totals, target, side=side))
    start = block * BLOCK
    base = totals[block - 1] if block else 0.0
    inner = np.cumsum(values[start:start + BLOCK], dtype=np.float64) + base
    return min(start + int(np.searchsorted(inner, target, side=side)), len(values) - 1)
