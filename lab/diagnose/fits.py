"""Small estimators with intervals used by the rollout diagnostics.

- ``ols``: least squares y = a + b x with heteroskedasticity-robust (HC1, White 1980 / MacKinnon & White 1985)
  standard errors and a normal 95 % interval for the slope.
- ``ratio_intervals``: sum(num) / sum(den) over sequences with a Poisson bootstrap over sequences (Hanley &
  MacGibbon 2006): tokens of one sequence are not independent, whole sequences are resampled. All ratios of a
  report share the same resamples (one pass of n_boot weight vectors).
- ``median_interval``: median over steps with a percentile bootstrap over steps.
"""
from __future__ import annotations

import numpy as np

from lab.stats import percentile_interval

Z95 = 1.959963984540054
BOOT_BLOCK_VALUES = 1 << 21  # Poisson weights held at once by ratio_intervals (16 MiB): memory flat in the sequences


def ols(x: np.ndarray, y: np.ndarray) -> dict:
    """Intercept, slope, slope's HC1 standard error and 95 % interval (NaN when fewer than 3 points or no spread)."""
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    ok = np.isfinite(x) & np.isfinite(y)
    x, y = x[ok], y[ok]
    n = x.size
    nan = {"intercept": np.nan, "slope": np.nan, "se": np.nan, "lo": np.nan, "hi": np.nan, "n": int(n)}
    if n < 3:
        return nan
    xc = x - x.mean()
    sxx = float(xc @ xc)
    if sxx <= 0:
        return nan
    b = float(xc @ (y - y.mean())) / sxx
    a = float(y.mean() - b * x.mean())
    r = y - a - b * x
    se = float(np.sqrt(n / (n - 2) * np.sum(xc**2 * r**2)) / sxx)
    return {"intercept": a, "slope": b, "se": se, "lo": b - Z95 * se, "hi": b + Z95 * se, "n": int(n)}


def ratio_intervals(requests: dict, n_boot: int = 200, seed: int = 0, ci: float = 0.95) -> dict:
    """{name: (num, den)} with equal-length per-sequence arrays -> {name: (ratio, lo, hi)} of sum(num)/sum(den).

    Rows are resampled with Poisson(1) weights, the same draws for every ratio; non-finite entries count as 0."""
    names = list(requests)
    if not names:
        return {}
    num = np.nan_to_num(np.stack([np.asarray(requests[k][0], np.float64) for k in names]), nan=0.0, posinf=0.0,
                        neginf=0.0)
    den = np.nan_to_num(np.stack([np.asarray(requests[k][1], np.float64) for k in names]), nan=0.0, posinf=0.0,
                        neginf=0.0)
    n = num.shape[1]
    tot_n, tot_d = num.sum(1), den.sum(1)
    rng = np.random.default_rng(seed)
    boots = np.full((n_boot, len(names)), np.nan)
    both = np.concatenate([num, den])
    block = max(1, min(n_boot, BOOT_BLOCK_VALUES // max(n, 1)))  # resamples drawn and summed at once
    for b0 in range(0, n_boot if n else 0, block):
        b1 = min(b0 + block, n_boot)
        w = rng.poisson(1.0, (b1 - b0, n)).astype(np.float64)  # the same draws, in order, as one resample at a time
        s = (both @ w.T).T  # [resamples, 2 ratios]: one matrix product, not one per resample (in this order: the
        # other, w @ both.T, is 10-20x slower with OpenBLAS's threads on a busy machine)
        d = s[:, len(names):]
        with np.errstate(invalid="ignore", divide="ignore"):
            boots[b0:b1] = np.where(d != 0, s[:, :len(names)] / d, np.nan)
    out = {}
    for j, k in enumerate(names):
        value = float(tot_n[j] / tot_d[j]) if tot_d[j] != 0 else np.nan
        lo, hi = percentile_interval(boots[:, j], ci) if np.isfinite(value) else (np.nan, np.nan)
        out[k] = (value, lo, hi)
    return out


def median_interval(x: np.ndarray, n_boot: int = 1000, seed: int = 0, ci: float = 0.95):
    """(median, lo, hi) over the finite entries of x, percentile bootstrap."""
    x = np.asarray(x, np.float64)
    x = x[np.isfinite(x)]
    if x.size == 0:
        return np.nan, np.nan, np.nan
    rng = np.random.default_rng(seed)
    boots = np.median(x[rng.integers(0, x.size, size=(n_boot, x.size))], axis=1)
    lo, hi = percentile_interval(boots, ci)
    return float(np.median(x)), lo, hi
