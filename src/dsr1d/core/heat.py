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
the ambient): there is no answer until the data spans most of one fitted time constant
(`SPAN_TIME_CONSTANTS`), ``P_lim`` is taken ``Z_ONE_SIDED`` standard errors high, so an uncertain
sink costs joules, not tokens/s, and where the denominator's sign is not certain there is no
answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# samples per block: several of a die's time constant at one sample a second (1-2 s per
# MITIGATION-NOTES.md, 1.6 s on the calibrated plant), and far under a heat sink's (>= 100 s)
BLOCK = 10
# blocks before the first answer: two minutes, about one time constant of the calibrated sink
MIN_BLOCKS = 12
# one-sided 90 %: the sustained power is under this bound nine times in ten
Z_ONE_SIDED = 1.2816
# no answer until the data spans most of the sink's own (fitted) time constant: with less, its
# gain trades against the ambient, and the white-noise standard error above does not show it (on
# a big sink, 8000 J/K, the answer went from 4180 to 3390 MHz over 20 minutes of one decode; with
# no span at all, tokens/s fell to 0.960x stock on one ensemble plant). Over the bench's 170
# plants, 1.0 -> 0.7 moved J/token regret at delta 2 % from 2.7 / 16.2 % (median / worst) to
# 2.3 / 15.5 %, tokens/s unchanged; 0.5 gained nothing more
SPAN_TIME_CONSTANTS = 0.7
# the power curve's exponent: dynamic power ~ f V(f)^2 between V flat (1) and V ~ f (3), and
# beyond either side for the curvature leakage adds; the middle first, as it is the one kept
# where the clocks seen do not tell them apart (two clocks: every curve passes through both)
EXPONENTS = (2.5, 2.0, 3.0, 1.5, 3.5)
# a fit better than the kept one by less than this (relative) is a tie, rounding's choice
TIE = 1e-9
# an answer this far outside the powers seen is an extrapolation the fit cannot carry
POWER_RANGE = (0.5, 1.5)
# the power curve needs clocks a bin apart (a probe, a cut, the free clock before them)
MIN_SPREAD_MHZ = 100.0
# a column whose part outside the others is this small against its length is no new evidence
# (numpy's rank test is of the same order: machine epsilon times the rows times the norm)
RANK_TOLERANCE = 1e-9


Vector = list[float]


def sustained_clock(samples: Sequence[tuple[float, float, float]], t_limit_c: float
                    ) -> float | None:
    """The busy MHz at which the package would settle at ``t_limit_c``, from ``samples`` of one
    decode at the telemetry interval (a second by default), oldest first: (package °C, package
    watts, busy MHz). None until `MIN_BLOCKS` blocks, or where the fit cannot say."""
    n = len(samples) // BLOCK
    if n < MIN_BLOCKS:
        return None
    rest = samples[len(samples) - n * BLOCK:]
    temp, watts, mhz = ([sum(s[i] for s in rest[b * BLOCK:(b + 1) * BLOCK]) / BLOCK
                         for b in range(n)] for i in range(3))
    if max(mhz) - min(mhz) < MIN_SPREAD_MHZ:
        return None
    mean_w = sum(watts) / n
    p_lim = _limit_watts(temp, watts, t_limit_c)
    if p_lim is None or not POWER_RANGE[0] * mean_w < p_lim < POWER_RANGE[1] * mean_w:
        return None
    return _clock_for(temp, watts, mhz, p_lim, t_limit_c)


def _limit_watts(temp: Vector, watts: Vector, t_limit_c: float) -> float | None:
    """``P_lim`` of the two-stage fit, `Z_ONE_SIDED` standard errors high (delta method)."""
    cols = [temp[:-1], watts[1:], watts[:-1], [1.0] * (len(temp) - 1)]
    y = temp[1:]
    fit = _least_squares(cols, y)
    if fit is None:
        return None                   # no change in heat or power to learn the response from
    theta, inv = fit
    alpha, r_die, g, c = theta
    den = r_die + g
    if not 0.0 < alpha < 1.0 or den <= 0.0 or len(temp) < SPAN_TIME_CONSTANTS / -math.log(alpha):
        return None
    resid = [yi - sum(t * col[i] for t, col in zip(theta, cols)) for i, yi in enumerate(y)]
    sigma2 = sum(r * r for r in resid) / max(1, len(y) - 4)
    num = (1.0 - alpha) * t_limit_c - c
    grad = [-t_limit_c / den, -num / den ** 2, -num / den ** 2, -1.0 / den]
    if den - Z_ONE_SIDED * math.sqrt(max(0.0, sigma2 * _quad(inv, [0.0, 1.0, 1.0, 0.0]))) <= 0.0:
        return None
    return num / den + Z_ONE_SIDED * math.sqrt(max(0.0, sigma2 * _quad(inv, grad)))


def _clock_for(temp: Vector, watts: Vector, mhz: Vector, p_lim: float, t_limit_c: float
               ) -> float | None:
    """The clock drawing ``p_lim`` at ``t_limit_c`` on ``P = p0 + p1 T + k f^e``."""
    best: tuple[float, float, Vector] | None = None
    for e in EXPONENTS:
        cols = [[1.0] * len(temp), temp, [(f / 1000.0) ** e for f in mhz]]
        fit = _least_squares(cols, watts)
        if fit is None:
            continue
        coef = fit[0]
        err = sum((w - sum(c * col[i] for c, col in zip(coef, cols))) ** 2
                  for i, w in enumerate(watts))
        if best is None or err < best[0] * (1.0 - TIE):
            best = (err, e, coef)
    if best is None:
        return None
    _, e, (p0, p1, k) = best
    dynamic = p_lim - p0 - p1 * t_limit_c
    if k <= 0.0 or dynamic <= 0.0:
        return None
    return 1000.0 * float((dynamic / k) ** (1.0 / e))


def _least_squares(cols: list[Vector], y: Vector) -> tuple[Vector, list[Vector]] | None:
    """The coefficients minimising ``|sum(theta_j cols[j]) - y|`` and ``(X'X)^-1``, by
    modified Gram-Schmidt (X = QR); None where a column is (nearly) a combination of the
    others. A few columns of a few hundred rows: no array library needed in the pure core."""
    m = len(cols)
    q = [list(c) for c in cols]
    r = [[0.0] * m for _ in range(m)]
    for j in range(m):
        norm0 = math.sqrt(sum(v * v for v in cols[j]))
        for i in range(j):
            r[i][j] = _dot(q[i], q[j])
            q[j] = [a - r[i][j] * b for a, b in zip(q[j], q[i])]
        r[j][j] = math.sqrt(_dot(q[j], q[j]))
        if r[j][j] <= RANK_TOLERANCE * norm0:
            return None
        q[j] = [a / r[j][j] for a in q[j]]
    rinv = [[0.0] * m for _ in range(m)]           # R^-1, upper triangular
    for j in range(m):
        rinv[j][j] = 1.0 / r[j][j]
        for i in range(j - 1, -1, -1):
            rinv[i][j] = -sum(r[i][k] * rinv[k][j] for k in range(i + 1, j + 1)) / r[i][i]
    qty = [_dot(qj, y) for qj in q]
    theta = [sum(rinv[i][k] * qty[k] for k in range(m)) for i in range(m)]
    inv = [[sum(rinv[i][k] * rinv[j][k] for k in range(m)) for j in range(m)] for i in range(m)]
    return theta, inv


def _dot(a: Vector, b: Vector) -> float:
    return sum(x * y for x, y in zip(a, b))


def _quad(mat: list[Vector], v: Vector) -> float:
    """``v' mat v``."""
    return sum(v[i] * mat[i][j] * v[j] for i in range(len(v)) for j in range(len(v)))
