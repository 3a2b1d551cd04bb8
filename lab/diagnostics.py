"""Importance-weight diagnostics over the last axis (the B samples of a batch), vectorised over leading axes; each
takes a torch tensor or a numpy array and returns the same kind (torch is imported only for a tensor).

- Kish ESS fraction: (sum w)^2 / (n sum w^2)  (Kish 1965; optimistic under heavy tails)
- max-weight share: max w / sum w
- chi2: mean w^2 - 1 (sequence weights W = pi(y)/mu(y) under mu)
- KL(mu||pi) estimators from samples of mu, r = pi/mu: k1 = -log r, k3 = r - 1 - log r (Schulman 2020)
- PSIS Pareto k-hat (Vehtari et al. 2024): generalised Pareto fit to the largest min(n/5, 3 sqrt n) weights with
  the Zhang & Stephens (2009) estimator and its weak prior; k-hat > 0.7 means the IS estimate is unreliable.
  ``psis_khat`` equals arviz-stats' (arviz_stats.base.array_stats.psislw(-log_w)[1], r_eff = 1) to rounding
  (tests/test_stats.py); the lab keeps its own because it fits every row of an [M, n] array at once, about 10x
  faster than arviz-stats' per-row loop over the M replicates of a study, and returns NaN where arviz-stats raises
  (fewer than 25 weights, a flat tail).
"""
from __future__ import annotations

import numpy as np

from lab.lazy import torch


def kish_ess_fraction(log_w):
    if isinstance(log_w, np.ndarray):
        w = np.exp(log_w - log_w.max(-1, keepdims=True))
        return w.sum(-1) ** 2 / (w.shape[-1] * (w**2).sum(-1))
    w = torch.exp(log_w - log_w.max(-1, keepdim=True).values)
    return w.sum(-1) ** 2 / (w.shape[-1] * (w**2).sum(-1))


def max_weight_share(log_w):
    if isinstance(log_w, np.ndarray):
        w = np.exp(log_w - log_w.max(-1, keepdims=True))
        return (w / w.sum(-1, keepdims=True)).max(-1)
    return torch.softmax(log_w, -1).max(-1).values


def chi2(log_w):
    if isinstance(log_w, np.ndarray):
        with np.errstate(over="ignore"):
            return np.exp(2 * log_w).mean(-1) - 1.0
    return torch.exp(2 * log_w).mean(-1) - 1.0


def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:
    """k1 = -log r per sample (log r = log pi - log mu)."""
    return -log_ratio


def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 = r - 1 - log r per sample; unbiased for KL(mu||pi) and never negative."""
    return torch.expm1(log_ratio) - log_ratio


def psis_khat(log_w: np.ndarray) -> np.ndarray:
    """Pareto k-hat of each row of ``log_w`` ([..., n]); NaN where the tail is degenerate (equal weights) or shorter
    than 5 (n < 25)."""
    log_w = np.asarray(log_w, dtype=np.float64)
    lead, n = log_w.shape[:-1], log_w.shape[-1]
    x = np.sort(log_w.reshape(-1, n), axis=-1)
    x = np.exp(x - x[:, -1:])
    m = int(min(0.2 * n, 3 * np.sqrt(n)))
    if m < 5:
        return np.full(lead, np.nan)
    tail = x[:, -m:] - x[:, -m - 1 : -m]  # exceedances over the threshold, ascending
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        m_est = 30 + int(np.sqrt(m))
        b = 1 - np.sqrt(m_est / (np.arange(1, m_est + 1) - 0.5))  # [m_est]
        b = b[None, :] / (3 * tail[:, int(m / 4 + 0.5) - 1][:, None]) + 1 / tail[:, -1][:, None]  # [R, m_est]
        k = np.log1p(-b[:, :, None] * tail[:, None, :]).mean(-1)  # [R, m_est]
        log_lik = m * (np.log(-b / k) - k - 1)
        weights = 1 / np.exp(log_lik[:, None, :] - log_lik[:, :, None]).sum(-1)
        weights = np.where(weights >= 10 * np.finfo(float).eps, weights, 0.0)
        weights /= weights.sum(-1, keepdims=True)
        b_post = (b * weights).sum(-1)
        k_post = np.log1p(-b_post[:, None] * tail).mean(-1)
        k_post = (m * k_post + 10 * 0.5) / (m + 10)
    k_post = np.where(np.isfinite(k_post) & (tail[:, -1] > 0), k_post, np.nan)
    return k_post.reshape(lead)
