"""Streaming summaries of a signed quantity (token log-ratios): a fixed symmetric log-spaced histogram.

Bins: |x| < 1e-6 is one central bin; beyond it, 40 bins per decade from 1e-6 to 1e2 on each side (the last bin
on each side also takes everything larger, +-inf included). Counts add across chunks, steps and files, so the
distribution of any number of tokens fits in NBINS integers. Quantiles are read off the cumulative counts and
interpolated log-linearly inside a bin: relative error at most one bin width, 10^(1/40) - 1 = 5.9 %.
"""
from __future__ import annotations

import numpy as np

LO_DECADE, HI_DECADE, PER_DECADE = -6, 2, 40
SIDE = (HI_DECADE - LO_DECADE) * PER_DECADE  # bins per sign
NBINS = 2 * SIDE + 1
ZERO = SIDE  # index of the central bin
_EDGES = 10.0 ** (LO_DECADE + np.arange(SIDE + 1) / PER_DECADE)  # |x| edges of one side, 1e-6 .. 1e2


def bin_index(x: np.ndarray) -> np.ndarray:
    """Histogram bin of each finite or infinite x (NaN is not allowed: filter it first): ZERO + sign(x) (k + 1),
    k = floor((log10|x| - LO_DECADE) PER_DECADE) clipped to -1 .. SIDE - 1 (-1: the central bin)."""
    k = np.abs(x)
    with np.errstate(divide="ignore"):
        np.log10(k, out=k)
    k -= LO_DECADE
    k *= PER_DECADE
    np.floor(k, out=k)
    np.clip(k, -1, SIDE - 1, out=k)
    k += 1
    np.copysign(k, x, out=k)
    k += ZERO
    return k.astype(np.intp)


def bin_edges() -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) of every bin, in index order; the outer bins are open to +-inf."""
    lo = np.empty(NBINS)
    hi = np.empty(NBINS)
    lo[ZERO], hi[ZERO] = -_EDGES[0], _EDGES[0]
    lo[ZERO + 1:], hi[ZERO + 1:] = _EDGES[:-1], _EDGES[1:]
    lo[:ZERO], hi[:ZERO] = -_EDGES[1:][::-1], -_EDGES[:-1][::-1]
    hi[-1], lo[0] = np.inf, -np.inf
    return lo, hi


def quantiles(counts: np.ndarray, qs) -> np.ndarray:
    """Quantiles of the histogram ``counts`` [..., NBINS] (NaN where empty), log-linear inside a bin."""
    counts = np.asarray(counts, dtype=np.float64)
    qs = np.atleast_1d(np.asarray(qs, dtype=np.float64))
    flat = counts.reshape(-1, NBINS)
    lo, hi = bin_edges()
    hi_f, lo_f = np.where(np.isfinite(hi), hi, 10.0 ** HI_DECADE), np.where(np.isfinite(lo), lo, -10.0 ** HI_DECADE)
    out = np.full((flat.shape[0], qs.size), np.nan)
    for r, c in enumerate(flat):
        total = c.sum()
        if total <= 0:
            continue
        cum = np.cumsum(c)
        for j, q in enumerate(qs):
            target = q * total
            b = int(np.searchsorted(cum, target, side="left"))
            b = min(b, NBINS - 1)
            prev = cum[b - 1] if b > 0 else 0.0
            frac = 0.0 if c[b] == 0 else np.clip((target - prev) / c[b], 0.0, 1.0)
            if b == ZERO:
                out[r, j] = lo_f[b] + frac * (hi_f[b] - lo_f[b])
            elif b > ZERO:  # positive side: interpolate log|x| upward
                out[r, j] = np.exp(np.log(lo_f[b]) + frac * (np.log(hi_f[b]) - np.log(lo_f[b])))
            else:  # negative side: |x| shrinks as the quantile grows
                out[r, j] = -np.exp(np.log(-lo_f[b]) + frac * (np.log(-hi_f[b]) - np.log(-lo_f[b])))
    return out.reshape(counts.shape[:-1] + (qs.size,))


def abs_quantiles(counts: np.ndarray, qs) -> np.ndarray:
    """Quantiles of |x| from the signed histogram (folds the two sides)."""
    counts = np.asarray(counts, dtype=np.float64)
    folded = np.zeros(counts.shape[:-1] + (NBINS,))
    folded[..., ZERO] = counts[..., ZERO]
    folded[..., ZERO + 1:] = counts[..., ZERO + 1:] + counts[..., :ZERO][..., ::-1]
    return quantiles(folded, qs)
