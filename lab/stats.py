"""Interval estimates: percentile bootstrap over replicates (or seeds)."""
from __future__ import annotations

import numpy as np


def bootstrap_counts(n: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """[n_boot, n] resampling counts: row b says how often each of the n items is drawn in resample b."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)


def percentile_interval(samples: np.ndarray, ci: float = 0.95) -> tuple[float, float]:
    samples = np.asarray(samples, dtype=np.float64)
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return float("nan"), float("nan")
    alpha = (1.0 - ci) / 2
    lo, hi = np.quantile(samples, [alpha, 1 - alpha])
    return float(lo), float(hi)


def mean_interval(x: np.ndarray, counts: np.ndarray, ci: float = 0.95) -> tuple[float, float, float]:
    """Mean of x over replicates and its bootstrap interval; non-finite entries are left out."""
    x = np.asarray(x, dtype=np.float64)
    ok = np.isfinite(x)
    if not ok.any():
        return float("nan"), float("nan"), float("nan")
    w = counts * ok
    n = w.sum(1)
    boot = np.where(n > 0, (w @ np.where(ok, x, 0.0)) / np.maximum(n, 1), np.nan)
    return (float(x[ok].mean()), *percentile_interval(boot, ci))
