"""A token readout's p-value against its Haar null, fine enough to survive a correction over hundreds.

A Monte-Carlo p from K null draws cannot go below 1/(K+1): with ~390 readouts on SmolLM2 (30 layers,
270 heads, 90 groups) Benjamini-Hochberg needs p < 0.05/390 = 1.3e-4 for a lone finding, ~8,000 draws.
The readout's statistic is instead a 1-Lipschitz function of a Haar-random subspace, so concentration
of measure bounds its upper tail without more draws:

- a direction u on the sphere S^(d-1): the statistic max(mean of the top k of W u, mean of the top k
  of -W u) over unit rows w changes by at most max |w . (u - u')| <= ||u - u'||; the sphere's
  log-Sobolev constant 1/(d-1) (Herbst's argument) gives P(s >= E s + t) <= exp(-(d - 2) t^2 / 2);
- a plane Q (d, 2), the first two columns of a Haar rotation: the mean of the top k of ||Q^T w||
  changes by at most ||Q - Q'||_op <= ||Q - Q'||_F; SO(d)'s Ricci curvature (d - 2)/4 in that metric
  (Bakry-Emery) gives P(s >= E s + t) <= exp(-(d - 2) t^2 / 8).

E s is the null draws' mean raised by three standard errors, so the bound holds with the draws' own
uncertainty. The bound is conservative (on SmolLM2 the draws' spread is about a third of what it
allows), never optimistic: ``tests/spectra/test_readout_tail.py`` checks it against 20,000 draws.
"""

from __future__ import annotations

import math


def _rate(d: int, m: int) -> float:
    """The exponent's factor: (d - 2)/2 for a direction (m = 1), (d - 2)/8 for a plane (m = 2)."""
    return (d - 2) / (2.0 if m == 1 else 8.0)


def mean_bound(null_mean: float, null_sd: float, draws: int) -> float:
    """E s from the draws: their mean raised by three standard errors."""
    return null_mean + 3.0 * null_sd / math.sqrt(max(draws, 1))


def tail_p(score: float, null_mean: float, null_sd: float, draws: int, d: int, m: int) -> float:
    """An upper bound on P(a Haar-random m-subspace of R^d scores >= ``score``); NaN without draws.

    Args:
        score: the readout's statistic.
        null_mean, null_sd: mean and standard deviation of the statistic over the null's draws.
        draws: how many draws made them (at least 2).
        d: the dimension of the rows (d_model).
        m: 1 (a direction) or 2 (a plane).
    """
    if draws < 2 or d < 3 or not all(map(math.isfinite, (score, null_mean, null_sd))):
        return float("nan")
    t = score - mean_bound(null_mean, null_sd, draws)
    return 1.0 if t <= 0 else min(1.0, math.exp(-_rate(d, m) * t * t))


def score_needed(p: float, null_mean: float, null_sd: float, draws: int, d: int, m: int) -> float:
    """The smallest score whose ``tail_p`` is at most ``p``: what a readout needs to reach p."""
    if draws < 2 or d < 3 or not (0 < p < 1) or not all(map(math.isfinite, (null_mean, null_sd))):
        return float("nan")
    return mean_bound(null_mean, null_sd, draws) + math.sqrt(math.log(1 / p) / _rate(d, m))
