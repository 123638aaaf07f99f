"""Intervals over seeds: what every experiment reports beside a mean.

Experiments here run a handful of seeds (3–5), so the interval is Student's t on the seed
means, not a normal approximation: with n = 3 the half-width is 4.30 standard errors,
not 1.96. That width is the honest statement of what three seeds can separate.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
from scipy import stats as _scipy_stats  # a dependency of jax itself


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, low, high): Student-t interval for the mean of `values` (one value per seed).

    A single value has no spread to estimate: its interval is (v, v, v) and callers that
    print it should say n = 1."""
    x = np.asarray(values, dtype=float)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"t_interval needs a non-empty 1-D sequence, got shape {x.shape}")
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be in (0, 1), got {level}")
    mean = float(x.mean())
    if x.size == 1:
        return mean, mean, mean
    half = float(_scipy_stats.t.ppf(0.5 + level / 2, df=x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return mean, mean - half, mean + half


def t_band(runs, level: float = 0.95) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pointwise `t_interval` over seeds: runs [seeds, points] -> (mean, low, high), each [points]."""
    arr = np.asarray(runs, dtype=float)
    if arr.ndim != 2:
        raise ValueError(f"t_band needs [seeds, points], got shape {arr.shape}")
    cols = [t_interval(arr[:, j], level) for j in range(arr.shape[1])]
    mean, low, high = (np.array(c) for c in zip(*cols))
    return mean, low, high


def format_interval(values: Sequence[float], level: float = 0.95, digits: int = 3) -> str:
    """'0.742 [0.701, 0.783] (n=3)': the one-line form experiment summaries print."""
    mean, low, high = t_interval(values, level)
    return f"{mean:.{digits}f} [{low:.{digits}f}, {high:.{digits}f}] (n={len(values)})"


def paired_verdict(gaps: Sequence[float], level: float = 0.95) -> tuple[float, float, float, str]:
    """(mean, low, high, verdict) for a claim "A beats B" from its paired gaps A − B, one per
    seed: 'reproduces' when the t-interval lies above 0, 'contradicts' when below, else
    'not resolved' (always so for one seed, whose interval has no width)."""
    mean, low, high = t_interval(gaps, level)
    if len(gaps) > 1 and low > 0:
        return mean, low, high, "reproduces"
    if len(gaps) > 1 and high < 0:
        return mean, low, high, "contradicts"
    return mean, low, high, "not resolved"
