"""Proposition 3.1 of VESPO (Shen et al., arXiv 2602.10693; code github.com/FloyedShen/VESPO), term by term, exact.

For a reshaping kernel phi with K = sup_w phi(w)/w < inf and the implicit proposal Q = mu phi(W) / Z,
Z = E_mu[phi(W)]:

    E_mu[phi(W)^2] <= Z K C,   C = E_Q[W] = E_mu[phi(W) W] / Z,   so  Z K C = K E_mu[phi(W) W].

Proof in one line: phi(w) <= K w pointwise; multiply by phi(w) >= 0 and take E_mu. It holds for ANY mu and pi, so a
violation can only come from an implementation that does not evaluate phi and W consistently. The ratio
E_mu[phi^2] / (Z K C) in (0, 1] measures tightness: 1 when mu puts all its mass where phi(w)/w peaks,
w = (k-1)/lambda; on-policy (W = 1) it is 1/K.

W uses the estimator's own numerics (``lab.estimators.vespo.sequence_log_weight``: token log-ratios clamped to
[-20, 20], summed, L clamped to [-20, 20]; ``sequence_coefficient``: the authors' log-space phi). The estimator's phi
can leave the bound only through the authors' floor log W >= log 1e-8 with k = 1 (phi(w)/w > e^lambda for
L < -18.42): ``floor_mass`` = mu(L < -18.42) is reported with every setting. Kernels with k < 1 have no K
(phi(w)/w -> inf as w -> 0): K = inf and no ratio.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from lab.estimators import vespo
from lab.policies import token_log_probs

TOLERANCE = 1e-9  # float64 rounding: a ratio above 1 + TOLERANCE counts as a violation
BOUND_METRICS = ("Z", "C", "K", "phi2", "bound", "ratio", "w2", "floor_mass", "kl_token", "chi2_seq")
BOUND_KEYS = ("env", "policy", "seed", "staleness_kind", "staleness", "k", "lam", "kernel")


def kernel_label(k: float, lam: float) -> str:
    return f"k={k:g}, λ={lam:g}"


def sequence_log_weights(pi: tuple, mu: tuple, support_mu) -> torch.Tensor:
    """L(y) = log pi(y)/mu(y) for every pair of mu's support, with the estimator's clamps (float64, [N]).

    ``pi`` and ``mu`` are (policy, theta) pairs, as everywhere in the engine."""
    s = support_mu
    with torch.no_grad():
        lp_pi = token_log_probs(pi[0], pi[1].double(), s.prompts, s.tokens) * s.mask
        lp_mu = token_log_probs(mu[0], mu[1].double(), s.prompts, s.tokens) * s.mask
        L, _ = vespo.sequence_log_weight(lp_pi, lp_mu, s.mask)
    return L[:, 0]


def bound_terms(L: torch.Tensor, weights: torch.Tensor, k: float, lam: float) -> dict:
    """Proposition 3.1's terms for sequence log-weights ``L`` with probabilities ``weights`` under mu (exact).

    Z = E_mu[phi], C = E_Q[W], K, phi2 = E_mu[phi^2], bound = Z K C, ratio = phi2 / bound (NaN where K = inf),
    w2 = E_mu[W^2] (sequence IS's second moment, for scale) and floor_mass = mu(L < log 1e-8), the mass where the
    authors' floor inside log W is active.
    """
    vespo.check_kernel(k, lam)
    L, w = L.double(), weights.double()
    W = torch.exp(L)
    ph = vespo.sequence_coefficient(L, k, lam)
    Z = float((w * ph).sum())
    phiW = float((w * ph * W).sum())
    phi2 = float((w * ph**2).sum())
    K = vespo.bound_constant(k, lam)
    bound = K * phiW if math.isfinite(K) else math.inf
    return {"Z": Z, "C": phiW / Z if Z > 0 else math.nan, "K": K, "phi2": phi2, "bound": bound,
            "ratio": phi2 / bound if math.isfinite(bound) and bound > 0 else math.nan,
            "w2": float((w * W**2).sum()), "floor_mass": float(w[L < vespo.LOG_W_FLOOR].sum())}


def _kernel_facts(k: float, lam: float, K: float) -> dict:
    """K, where phi(w)/w peaks ((k-1)/lambda; 0 for k <= 1, approached) and the on-policy ratio 1/K (W = 1 everywhere:
    phi^2 / (K phi W) = 1/K); None for both where K = inf."""
    finite = math.isfinite(K)
    return {"k": k, "lam": lam, "K": K, "peak_w": vespo.argmax_bound(k, lam) if finite else None,
            "on_policy_ratio": 1.0 / K if finite else None}


def bound_summary(bound: pd.DataFrame) -> dict:
    """Largest ratio over every setting with a finite K, the violation count, the tightest setting, per kernel its
    K, where phi(w)/w peaks, its on-policy ratio 1/K and its largest / median / smallest measured ratio."""
    finite = bound[np.isfinite(bound["ratio"])]
    worst = finite.loc[finite["ratio"].idxmax()]
    per_kernel = {}
    for label, g in bound.groupby("kernel", sort=False):
        ok = g[np.isfinite(g["ratio"])]
        per_kernel[label] = {**_kernel_facts(float(g["k"].iloc[0]), float(g["lam"].iloc[0]), float(g["K"].iloc[0])),
                             "max_ratio": float(ok["ratio"].max()) if len(ok) else None,
                             "median_ratio": float(ok["ratio"].median()) if len(ok) else None,
                             "min_ratio": float(ok["ratio"].min()) if len(ok) else None}
    off = finite[finite["kl_token"] > 0]
    return {
        "max_bound_ratio": float(finite["ratio"].max()),
        "max_bound_ratio_off_policy": float(off["ratio"].max()) if len(off) else None,
        "violations": int((finite["ratio"] > 1 + TOLERANCE).sum()),
        "settings_checked": int(len(finite)),
        "settings_without_bound": int((~np.isfinite(bound["K"])).sum()),
        "tightest": {"kernel": worst["kernel"], "staleness_kind": worst["staleness_kind"],
                     "staleness": float(worst["staleness"]), "seed": int(worst["seed"]),
                     "ratio": float(worst["ratio"])},
        "per_kernel": per_kernel,
        "max_floor_mass": float(bound["floor_mass"].max()),
        "staleness_kinds": sorted(bound["staleness_kind"].unique()),
        "bound_seeds": int(bound["seed"].nunique()),
    }


def tidy_bound(bound: pd.DataFrame) -> pd.DataFrame:
    """The wide bound table as tidy rows (one per setting x kernel x metric), keyed like the variance results."""
    long = bound.melt(id_vars=list(BOUND_KEYS), value_vars=list(BOUND_METRICS), var_name="metric", value_name="value")
    return long.assign(part="bound", estimator="vespo", lo=long["value"], hi=long["value"])


def bound_rows(results: pd.DataFrame) -> pd.DataFrame:
    """The wide bound table back from the study's tidy results (rows in the order the study computed them)."""
    tidy = results[results["part"] == "bound"]
    keys = list(BOUND_KEYS)
    wide = tidy.set_index([*keys, "metric"])["value"].unstack("metric").reset_index()
    out = tidy.drop_duplicates(keys)[keys].merge(wide, on=keys, how="left")
    return out[[*keys, *[m for m in BOUND_METRICS if m in out]]]
