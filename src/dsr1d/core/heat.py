"""The clock a package would sustain at its thermal limit, learned from its own heat (pure).

A package heats in two stages: the die, seconds behind its power, and the heat sink, minutes
behind. Over blocks of samples longer than the die's lag the die is where its power puts it over
the sink, and the sink is a first-order lag of the power::

    T = S + r_die P                                  (die over sink, settled within a block)
    S[k+1] = alpha S[k] + (1 - alpha) (T_amb + r_sink P[k])

which is linear in its parameters once written in what is measured::

    T[k+1] = alpha T[k] + r_die P[k+1] + g P[k] + c,   g = (1 - alpha) r_sink - alpha r_die,
                                                       c = (1 - alpha) T_amb

Settled, ``T = T_amb + (r_die + r_sink) P``, so the power that settles at the limit is
``P_lim = ((1 - alpha) T_lim - c) / (r_die + g)``. A first-order fit of the temperature alone,
since the last change, sees the die's quick step and not the sink's slow drift: after a cut it
reads the settling temperature too high (on one simulated plant its sustained clock fell from
2914 to 2541 MHz over five cuts while stock averaged 2851). The two-stage fit uses every block
since decode began, across changes, and each change is evidence.

The power a clock draws at the limit comes from the same blocks: ``P = p0 + p1 T + k f^e``
(leakage grows with temperature; ``e`` the best of a few exponents between a flat and a
proportional voltage). The answer is the clock whose power at ``T_lim`` is ``P_lim``.

A sink whose time constant is long against the data is poorly known (its gain trades against
the ambient): there is no answer until the data spans one fitted time constant, ``P_lim`` is
taken ``Z_ONE_SIDED`` standard errors high, so an uncertain sink costs joules, not tokens/s, and
where the denominator's sign is not certain there is no answer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# samples per block: several of a die's time constant at one sample a second (1-2 s per
# MITIGATION-NOTES.md, 1.6 s on the calibrated plant), and far under a heat sink's (>= 100 s)
BLOCK = 10
# blocks before the first answer: two minutes, about one time constant of the calibrated sink
MIN_BLOCKS = 12
# one-sided 90 %: the sustained power is under this bound nine times in ten
Z_ONE_SIDED = 1.2816
# no answer until the data spans the sink's own (fitted) time constant: with less, its gain
# trades against the ambient, and the white-noise standard error above does not show it (on a
# big sink, 8000 J/K, the answer went from 4180 to 3390 MHz over 20 minutes of one decode)
SPAN_TIME_CONSTANTS = 1.0
# the power curve's exponent: dynamic power ~ f V(f)^2 between V flat (1) and V ~ f (3), and
# beyond either side for the curvature leakage adds
EXPONENTS = (1.5, 2.0, 2.5, 3.0, 3.5)
# an answer this far outside the powers seen is an extrapolation the fit cannot carry
POWER_RANGE = (0.5, 1.5)
# the power curve needs clocks a bin apart (a probe, a cut, the free clock before them)
MIN_SPREAD_MHZ = 100.0


def sustained_clock(samples: Sequence[tuple[float, float, float]], t_limit_c: float
                    ) -> float | None:
    """The busy MHz at which the package would settle at ``t_limit_c``, from ``samples`` of one
    decode at the telemetry interval (a second by default), oldest first: (package °C, package
    watts, busy MHz). None until `MIN_BLOCKS` blocks, or where the fit cannot say."""
    n = len(samples) // BLOCK
    if n < MIN_BLOCKS:
        return None
    blocks = np.asarray(samples[len(samples) - n * BLOCK:], dtype=float)
    blocks = blocks.reshape(n, BLOCK, 3).mean(axis=1)
    temp, watts, mhz = blocks[:, 0], blocks[:, 1], blocks[:, 2]
    if float(np.ptp(mhz)) < MIN_SPREAD_MHZ:
        return None
    p_lim = _limit_watts(temp, watts, t_limit_c)
    if p_lim is None or not POWER_RANGE[0] * watts.mean() < p_lim < POWER_RANGE[1] * watts.mean():
        return None
    return _clock_for(temp, watts, mhz, p_lim, t_limit_c)


def _limit_watts(temp: np.ndarray, watts: np.ndarray, t_limit_c: float) -> float | None:
    """``P_lim`` of the two-stage fit, `Z_ONE_SIDED` standard errors high (delta method)."""
    x = np.column_stack([temp[:-1], watts[1:], watts[:-1], np.ones(len(temp) - 1)])
    y = temp[1:]
    theta, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
    if rank < x.shape[1]:
        return None                   # no change in heat or power to learn the response from
    alpha, r_die, g, c = theta
    den = r_die + g
    if not 0.0 < alpha < 1.0 or den <= 0.0 or len(temp) < SPAN_TIME_CONSTANTS / -np.log(alpha):
        return None
    resid = y - x @ theta
    cov = float(resid @ resid) / max(1, len(y) - 4) * np.linalg.pinv(x.T @ x)
    num = (1.0 - alpha) * t_limit_c - c
    grad = np.array([-t_limit_c / den, -num / den ** 2, -num / den ** 2, -1.0 / den])
    grad_den = np.array([0.0, 1.0, 1.0, 0.0])
    if den - Z_ONE_SIDED * float(np.sqrt(grad_den @ cov @ grad_den)) <= 0.0:
        return None
    return float(num / den + Z_ONE_SIDED * np.sqrt(max(0.0, float(grad @ cov @ grad))))


def _clock_for(temp: np.ndarray, watts: np.ndarray, mhz: np.ndarray, p_lim: float,
               t_limit_c: float) -> float | None:
    """The clock drawing ``p_lim`` at ``t_limit_c`` on ``P = p0 + p1 T + k f^e``."""
    ghz = mhz / 1000.0
    best: tuple[float, float, np.ndarray] | None = None
    for e in EXPONENTS:
        x = np.column_stack([np.ones(len(temp)), temp, ghz ** e])
        coef, *_ = np.linalg.lstsq(x, watts, rcond=None)
        err = float(np.sum((x @ coef - watts) ** 2))
        if best is None or err < best[0]:
            best = (err, e, coef)
    assert best is not None
    _, e, (p0, p1, k) = best
    dynamic = p_lim - p0 - p1 * t_limit_c
    if k <= 0.0 or dynamic <= 0.0:
        return None
    return 1000.0 * float((dynamic / k) ** (1.0 / e))
