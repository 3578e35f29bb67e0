"""The llama.cpp backend's token sampler: the torch backend's rule (barred padding, greedy or
temperature → top-p → a seeded draw), checked against a plain sort-and-cut reference."""

from __future__ import annotations

import numpy as np
import pytest

from dsr1d.engine.sampling import BLOCK, TokenSampler, first_reaching, nucleus

OPTS = {"greedy": False, "temperature": 0.6, "top_p": 0.95, "seed": 7}


def reference_nucleus(probs: np.ndarray, top_p: float) -> set[int]:
    """Sort by probability, keep up to and including the token where the mass reaches top_p."""
    order = np.argsort(-probs, kind="stable")
    cum = np.cumsum(probs[order].astype(np.float64))
    keep = int(np.searchsorted(cum, top_p, side="left")) + 1
    return set(order[:keep].tolist())


@pytest.mark.parametrize("scale", [0.3, 1.0, 6.0, 20.0])    # flat (wide nucleus) to peaked
@pytest.mark.parametrize("top_p", [0.5, 0.95])
def test_the_nucleus_is_the_most_likely_tokens_reaching_top_p(scale: float, top_p: float) -> None:
    rng = np.random.default_rng(int(scale * 10))
    logits = rng.normal(0, scale, 20_000)
    probs = np.exp(logits - logits.max()).astype(np.float32)
    probs /= probs.sum()
    ids = nucleus(probs, top_p)
    want = reference_nucleus(probs, top_p)
    # float32 probabilities may move the cut by a token or two at the boundary, never more
    assert len(set(ids.tolist()) ^ want) <= 2
    assert probs[ids].sum(dtype=np.float64) >= top_p - 1e-3
    assert list(ids) == sorted(ids)


@pytest.mark.parametrize("top_p", [0.95, 1.0])
def test_a_row_of_mostly_zeros_keeps_only_tokens_that_can_be_drawn(top_p: float) -> None:
    """As the synthetic model's: 148k of its 152k tokens barred, so their probability is 0."""
    rng = np.random.default_rng(5)
    probs = np.zeros(150_000, dtype=np.float32)
    live = rng.choice(len(probs), 4_000, replace=False)
    probs[live] = np.exp(rng.normal(0, 1, len(live)))
    ids = nucleus(probs, top_p)
    assert np.all(probs[ids] > 0)
    if top_p < 1.0:
        assert len(set(ids.tolist()) ^ reference_nucleus(probs / probs.sum(), top_p)) <= 2
    else:
        assert sorted(ids.tolist()) == sorted(live.tolist())


@pytest.mark.parametrize("size", [1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 5])
def test_the_running_sum_reaches_a_fraction_where_a_plain_cumsum_does(size: int) -> None:
    values = np.random.default_rng(size).random(size).astype(np.float32)
    cum = np.cumsum(values.astype(np.float64))
    for fraction in (0.0, 0.3, 0.5, 0.999, 1.0):
        target = fraction * cum[-1]
        for strict, side in ((False, "left"), (True, "right")):
            want = min(int(np.searchsorted(cum, target, side=side)), size - 1)
            assert abs(first_reaching(values, target, strict) - want) <= 1
    assert first_reaching(values, 0.0) == 0               # nothing needed: the first token
    assert first_reaching(values, cum[-1], strict=True) == size - 1
    assert first_reaching(values, 2 * cum[-1]) == size - 1   # never reached: the last one


def test_greedy_takes_the_best_token_that_is_not_barred() -> None:
    logits = np.array([0.0, 5.0, 1.0, 9.0], dtype=np.float32)
    sampler = TokenSampler({**OPTS, "greedy": True}, np.array([3]))
    assert sampler(logits) == 1
    assert TokenSampler({**OPTS, "temperature": 0.0}, np.array([], dtype=np.intp))(logits) == 3


def test_a_barred_token_is_never_drawn_and_the_logits_are_left_alone() -> None:
    logits = np.zeros(1000, dtype=np.float32)
    logits[:10] = 3.0
    before = logits.copy()
    sampler = TokenSampler({**OPTS, "top_p": 1.0}, np.arange(0, 5))
    drawn = {sampler(logits) for _ in range(300)}
    assert not drawn & set(range(5))
    assert np.array_equal(logits, before)


def test_the_same_seed_draws_the_same_tokens_and_another_seed_does_not() -> None:
    logits = np.random.default_rng(0).normal(0, 1, 5000).astype(np.float32)

    def draws(seed: int) -> list[int]:
        sampler = TokenSampler({**OPTS, "seed": seed}, np.array([], dtype=np.intp))
        return [sampler(logits) for _ in range(50)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_draws_follow_the_tempered_distribution_inside_the_nucleus() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], dtype=np.float32))
    sampler = TokenSampler({**OPTS, "temperature": 1.0, "top_p": 0.9, "seed": 1},
                           np.array([], dtype=np.intp))
    counts = np.bincount([sampler(logits) for _ in range(20_000)], minlength=4)
    assert counts[3] == 0                                 # outside the 0.9 nucleus
    share = counts[:3] / counts.sum()
    assert np.allclose(share, np.array([0.5, 0.3, 0.15]) / 0.95, atol=0.02)


def test_a_low_temperature_narrows_what_is_drawn() -> None:
    logits = np.random.default_rng(3).normal(0, 1, 3000).astype(np.float32)
    none = np.array([], dtype=np.intp)
    hot = TokenSampler({**OPTS, "temperature": 1.5, "seed": 2}, none)
    cold = TokenSampler({**OPTS, "temperature": 0.05, "seed": 2}, none)
    assert len({cold(logits) for _ in range(200)}) < len({hot(logits) for _ in range(200)}) / 5


def test_nan_logits_are_never_drawn_and_a_row_of_nothing_is_a_clear_error() -> None:
    from dsr1d.engine.errors import ModelError

    logits = np.full(600, np.nan, dtype=np.float32)
    logits[[3, 300]] = [1.0, np.inf]
    sampler = TokenSampler({**OPTS, "top_p": 1.0}, np.array([], dtype=np.intp))
    assert {sampler(logits) for _ in range(50)} <= {3, 300}
    with pytest.raises(ModelError, match="no usable logits"):
        TokenSampler(OPTS, np.array([3, 300]))(logits)


def test_a_mostly_barred_vocabulary_draws_the_same_tokens_from_its_few_allowed_ones() -> None:
    from dsr1d.engine.errors import ModelError
    from dsr1d.engine.sampling import allowed_tokens

    rng = np.random.default_rng(5)
    vocabulary = 20_000
    barred = np.arange(1_500, vocabulary)                 # a tokenizer of 1,500 in a padded table
    allowed = allowed_tokens(barred, vocabulary)
    assert allowed is not None and allowed.tolist() == list(range(1_500))
    assert allowed_tokens(np.arange(10), vocabulary) is None   # a few barred: no gathering
    rows = [rng.normal(0, s, vocabulary).astype(np.float32) for s in (0.3, 1.0, 4.0)]
    for opts in ({**OPTS, "greedy": True}, {**OPTS, "seed": 11},
                 {**OPTS, "seed": 12, "top_p": 1.0, "temperature": 1.3}):
        barring, gathering = TokenSampler(opts, barred), TokenSampler(opts, barred, allowed)
        for row in rows:
            before = row.copy()
            want = [barring(row) for _ in range(40)]
            assert [gathering(row) for _ in range(40)] == want
            assert max(want) < 1_500 and np.array_equal(row, before)
    nothing = np.full(vocabulary, np.nan, dtype=np.float32)
    with pytest.raises(ModelError, match="no usable logits"):
        TokenSampler(OPTS, barred, allowed)(nothing)
