"""numpy versions of the registry's coefficient functions for the corrections ``lab diagnose`` evaluates, so that the
command needs no torch: c(w, A) on float64 arrays, the same formulas, defaults and hyper-parameters as
lab.estimators (truncation: tis_token, tis_seq, mis_token, mis_seq; clipping: ppo_clip; gated: cispo, sapo;
sequence_ratio: gspo; vespo: vespo). tests/test_diagnose_stats.py holds each equal to the registry's torch function
to 1e-12 on random ratios and advantages, at the defaults and at other hyper-parameters.
"""
from __future__ import annotations

import math

import numpy as np

LOG_RATIO_BOUND = 20.0  # lab.estimators.policy_gradient.LOG_RATIO_BOUND
GSPO_LOG_RATIO_MAX = 10.0  # lab.estimators.sequence_ratio.GSPO_LOG_RATIO_MAX
LOG_W_FLOOR, LAMBDA_FLOOR = math.log(1e-8), 1e-4  # lab.estimators.vespo


def truncated(ratio, advantage=None, cap=2.0, **_):
    """min(ratio, cap) (tis_token, tis_seq)."""
    return np.minimum(ratio, cap)


def masked(ratio, advantage=None, lower=0.5, upper=5.0, **_):
    """ratio 1[lower <= ratio <= upper] (mis_token)."""
    return np.where((ratio >= lower) & (ratio <= upper), ratio, 0.0)


def masked_seq(ratio, advantage=None, lower=0.5, upper=2.0, **_):
    """W 1[lower <= W <= upper] (mis_seq)."""
    return masked(ratio, advantage, lower, upper)


def ppo_clip(ratio, advantage, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None):
    """ratio where PPO's clip passes the gradient (by the sign of A; dual clip c for A < 0), else 0."""
    passes = np.where(advantage >= 0, ratio < 1 + clip_ratio_high, ratio > 1 - clip_ratio_low)
    if clip_ratio_c is not None:
        passes &= ~((advantage < 0) & (ratio > clip_ratio_c))
    return np.where(passes, ratio, 0.0)


def gspo(ratio, advantage, clip_ratio_low=3e-4, clip_ratio_high=4e-4, **_):
    """PPO's clip on the geometric-mean ratio s, and 0 where log s > 10."""
    coef = ppo_clip(ratio, advantage, clip_ratio_low, clip_ratio_high)
    return np.where(ratio <= math.exp(GSPO_LOG_RATIO_MAX), coef, 0.0)


def cispo(ratio, advantage=None, clip_ratio_low=1.0, clip_ratio_high=4.0, **_):
    """clip(rho, 1 - eps_low, 1 + eps_high), rho's log clamped to +-20 first."""
    with np.errstate(divide="ignore"):
        r = np.exp(np.clip(np.log(ratio), -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return np.clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)


def sapo(ratio, advantage, tau_pos=1.0, tau_neg=1.05, **_):
    """4 s (1 - s) rho, s = sigmoid(tau (rho - 1)), tau = tau_pos if A > 0 else tau_neg; 0 where |log rho| > 20."""
    tau = np.where(advantage > 0, float(tau_pos), float(tau_neg))
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-(tau * (ratio - 1))))
    coef = 4 * s * (1 - s) * ratio
    with np.errstate(divide="ignore"):
        inside = np.abs(np.log(ratio)) <= LOG_RATIO_BOUND
    return np.where(inside, coef, 0.0)


def vespo(ratio, advantage=None, k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0):
    """phi(W) = exp(lambda + k max(L, log 1e-8) - lambda e^L), L = clamp(log W, +-20), (k, lambda) by the sign of A
    (None: A >= 0); non-finite -> 0. The kernel parameters are checked by the registry (lab.estimators.check_hyper)."""
    with np.errstate(divide="ignore"):
        L = np.clip(np.log(ratio), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    pos = np.ones(np.shape(L), bool) if advantage is None else np.asarray(advantage) >= 0
    k = np.where(pos, float(k_pos), float(k_neg))
    lam = np.maximum(np.where(pos, float(lambda_pos), float(lambda_neg)), LAMBDA_FLOOR)
    with np.errstate(over="ignore", invalid="ignore"):
        out = np.exp(lam + k * np.maximum(L, LOG_W_FLOOR) - lam * np.exp(L))
    return np.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0)


NUMPY = {"tis_token": truncated, "tis_seq": truncated, "mis_token": masked, "mis_seq": masked_seq,
         "ppo_clip": ppo_clip, "gspo": gspo, "cispo": cispo, "sapo": sapo, "vespo": vespo}
