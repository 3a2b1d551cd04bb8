"""VESPO's kernel as a proposal between mu and pi, and its variance bound (Proposition 3.1).

VESPO (Shen et al., arXiv 2602.10693; code github.com/FloyedShen/VESPO) replaces the sequence weight W = pi(y)/mu(y)
by phi(W) = W^k exp(lambda (1 - W)) (lab.estimators.vespo.phi; (k, lambda) = (2, 3) for A >= 0, (3, 2) for A < 0).
Any reshaping phi defines an implicit proposal

    Q(y) = mu(y) phi(W(y)) / Z,   Z = E_mu[phi(W)],   so   E_mu[phi(W) A grad log pi] = Z E_Q[A grad log pi]:

the update is an on-policy gradient under Q instead of pi. On the log-weight axis mu sits at E_mu[log W] =
-KL(mu||pi) and pi at E_pi[log W] = KL(pi||mu); the tilt W^k pulls Q towards pi and exp(-lambda W) cuts the large
weights that make IS explode, so Q settles near W = k / lambda, where phi peaks.

Proposition 3.1: phi(w) <= K w with K = sup_w phi(w)/w (lab.estimators.vespo.bound_constant; ((k-1)/lambda)^(k-1)
e^(lambda-k+1) for k > 1, e^lambda at k = 1, infinite for k < 1), hence phi^2 <= K W phi and

    E_mu[phi(W)^2] <= K E_mu[phi(W) W] = Z K C,   C = E_Q[W].

Here every response of T tokens over a V-token vocabulary is enumerated (positions drawn independently from one
pi/mu pair of lab.teach.tokens), so Z, C and E_mu[phi^2] are exact sums. The lab's estimator also clamps
log W to [-20, 20] and floors W at 1e-8 inside the log, as the reference code does; the lesson studies the kernel
itself, without those guards.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from lab.errors import LabError
from lab.estimators import vespo
from lab.teach import tokens
from lab.teach.exercises import Exercise
from dataclasses import dataclass

from lab.configs import SEED_MAX
from lab.typed import knob


@dataclass
class Config:
    """The lesson's settings (its report's parameters)."""

    kernels: list[list[float]] = knob([[2.0, 3.0], [3.0, 2.0], [1.0, 1.0], [0.5, 1.0], [1.5, 0.5], [4.0, 1.0]], ge=0,
                                      le=100)
    """(k, lambda) pairs"""
    vocab: int = knob(4, ge=2, le=64)
    """tokens per position (V^T responses are enumerated)"""
    length: int = knob(6, ge=1, le=16)
    """response length T of the detailed look"""
    kl: float = knob(0.1, gt=0, le=10)
    """per-token KL(mu || pi) of the detailed look"""
    kls: list[float] = knob([0.02, 0.05, 0.1, 0.2, 0.3, 0.5], gt=0, le=10)
    """staleness sweep for the bound check"""
    lengths: list[int] = knob([1, 2, 4, 6], ge=1, le=16)
    """lengths for the bound check"""
    seeds: list[int] = knob([0, 1, 2], ge=0, le=SEED_MAX)
    """draws of pi and mu's direction"""
    sharpness: float = knob(1.0, ge=0, le=100)
    """logit scale of pi"""
    live_controls: bool = True
    """build the ipywidgets controls (needs a widget frontend to be seen)"""

ENUM_LIMIT = 1 << 18
KERNELS = ((2.0, 3.0), (3.0, 2.0))  # VESPO's (k, lambda) for A >= 0 and A < 0


def enumerate_log_weights(log_pi: np.ndarray, log_mu: np.ndarray, length: int):
    """(log mu(y), log W(y)) for all V^T responses y of ``length`` independent tokens."""
    vocab = log_pi.shape[-1]
    if not (isinstance(length, (int, np.integer)) and length >= 1) or vocab ** int(length) > ENUM_LIMIT:
        raise LabError(f"cannot enumerate {vocab}^{length} responses (limit {ENUM_LIMIT}); use a shorter length "
                       f"or a smaller vocabulary")
    lm, lw = log_mu, log_pi - log_mu
    seq_mu, seq_w = lm, lw
    for _ in range(int(length) - 1):
        seq_mu = (seq_mu[:, None] + lm[None, :]).ravel()
        seq_w = (seq_w[:, None] + lw[None, :]).ravel()
    return seq_mu, seq_w


def kernel_log(log_w: np.ndarray, k: float, lam: float) -> np.ndarray:
    """log phi(W) at W = exp(log_w) by lab.estimators.vespo.log_phi (W kept finite: exp of at most 700)."""
    with np.errstate(under="ignore"):
        W = np.exp(np.clip(log_w, -745.0, 700.0))
    return vespo.log_phi(W, k, lam)


def proposal(log_mu_seq: np.ndarray, log_w: np.ndarray, k: float, lam: float) -> dict:
    """Exact summaries of Q = mu phi(W) / Z over enumerated responses (all sums in log space).

    Z, C = E_Q[W], E_mu[phi^2], K, bound = Z K C, ratio = E_mu[phi^2] / (Z K C) (<= 1 by Proposition 3.1; 0 when K is
    infinite), KL(Q||mu), KL(Q||pi), the mean log-weight under mu, Q and pi, Q's position between mu and pi on that
    axis (0 at mu, 1 at pi; NaN on-policy), and the population ESS fractions Z^2 / E_mu[phi^2] (VESPO) and
    1 / E_mu[W^2] (IS).
    """
    log_phi = kernel_log(log_w, k, lam)
    log_z = _logsumexp(log_mu_seq + log_phi)
    log_q = log_mu_seq + log_phi - log_z
    with np.errstate(under="ignore"):
        q, mu, pi = np.exp(log_q), np.exp(log_mu_seq), np.exp(log_mu_seq + log_w)
    log_c = _logsumexp(log_q + log_w)
    log_phi2 = _logsumexp(log_mu_seq + 2 * log_phi)
    K = vespo.bound_constant(k, lam)
    mean_mu, mean_q, mean_pi = float((mu * log_w).sum()), float((q * log_w).sum()), float((pi * log_w).sum())
    kept = q > 0
    gap = mean_pi - mean_mu
    return {"Z": math.exp(log_z), "C": math.exp(log_c), "phi2": math.exp(log_phi2), "K": K,
            "bound": math.exp(log_z + log_c) * K,
            "ratio": math.exp(log_phi2 - log_z - log_c) / K if math.isfinite(K) else 0.0,
            "kl_q_mu": float((q[kept] * (log_q - log_mu_seq)[kept]).sum()),
            "kl_q_pi": float((q[kept] * (log_q - log_mu_seq - log_w)[kept]).sum()),
            "mean_logw_mu": mean_mu, "mean_logw_q": mean_q, "mean_logw_pi": mean_pi,
            "position": (mean_q - mean_mu) / gap if gap > 1e-9 else float("nan"),
            "ess_vespo": math.exp(2 * log_z - log_phi2), "ess_is": math.exp(-_logsumexp(log_mu_seq + 2 * log_w))}


def _logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    return m + math.log(float(np.exp(x - m).sum()))


def setting(vocab: int, length: int, kl: float, seed: int = 0, sharpness: float = 2.0):
    """(log mu(y), log W(y)) of every response of the lesson's stale pair."""
    log_pi, log_mu = tokens.stale_pair(vocab, kl, seed, sharpness)
    return enumerate_log_weights(log_pi, log_mu, length)


def histograms(log_mu_seq, log_w, k: float, lam: float, edges) -> dict:
    """Probability mass of mu, Q and pi in each log-W bin (``edges``, outermost bins open-ended)."""
    log_phi = kernel_log(log_w, k, lam)
    q = np.exp(log_mu_seq + log_phi - _logsumexp(log_mu_seq + log_phi))
    idx = np.clip(np.searchsorted(edges, log_w, side="right") - 1, 0, len(edges) - 2)
    n = len(edges) - 1
    return {"mu": np.bincount(idx, np.exp(log_mu_seq), n), "q": np.bincount(idx, q, n),
            "pi": np.bincount(idx, np.exp(log_mu_seq + log_w), n)}


def bound_table(kernels, kls, lengths, vocab: int = 4, seeds=(0,), sharpness: float = 2.0) -> pd.DataFrame:
    """Proposition 3.1 checked exactly over a grid: one row per (k, lambda, kl, length, seed) with every summary."""
    rows = []
    for seed in seeds:
        for d in kls:
            log_pi, log_mu = tokens.stale_pair(vocab, d, seed, sharpness)
            for T in lengths:
                log_mu_seq, log_w = enumerate_log_weights(log_pi, log_mu, int(T))
                for k, lam in kernels:
                    rows.append({"k": float(k), "lam": float(lam), "kl_target": float(d), "length": int(T),
                                 "seed": int(seed), **proposal(log_mu_seq, log_w, k, lam)})
    return pd.DataFrame(rows)


def page_data(k: float, lam: float, kl: float, length: int, vocab: int = 4, seed: int = 0, sharpness: float = 2.0,
              edges=np.linspace(-8.0, 8.0, 33)) -> dict:
    """What the browser page shows (the JavaScript twin computes the same): summaries, histograms, kernel curve."""
    log_mu_seq, log_w = setting(vocab, length, kl, seed, sharpness)
    log_w_grid = np.linspace(-4.0, 3.0, 141)
    K = vespo.bound_constant(k, lam)
    return {"summary": proposal(log_mu_seq, log_w, k, lam),
            "edges": np.asarray(edges).tolist(),
            "hist": {key: v.tolist() for key, v in histograms(log_mu_seq, log_w, k, lam, np.asarray(edges)).items()},
            "log_w_grid": log_w_grid.tolist(), "phi": vespo.phi(np.exp(log_w_grid), k, lam).tolist(),
            "k_w": (K * np.exp(log_w_grid)).tolist() if math.isfinite(K) else None}


# ---- exercises ------------------------------------------------------------------------------------------------

def _on_policy_ratio(k: float, lam: float) -> float:
    log_mu_seq, log_w = setting(4, 3, 0.0)
    return proposal(log_mu_seq, log_w, k, lam)["ratio"]


EXERCISES = {ex.key: ex for ex in (
    Exercise("peak_neg",
             "Where does the kernel for negative advantages, (k, lambda) = (3, 2), peak? Give W.",
             lambda: vespo.argmax_phi(3.0, 2.0), rtol=1e-6,
             hint="set the derivative of log phi = lambda + k log W - lambda W to zero",
             explanation="W = k / lambda"),
    Exercise("bound_constant",
             "Compute Proposition 3.1's constant K = sup_w phi(w)/w for (k, lambda) = (2, 3).",
             lambda: vespo.bound_constant(2.0, 3.0), rtol=0.005,
             hint="phi(w)/w = w^(k-1) e^(lambda(1-w)) peaks at w = (k-1)/lambda; this is not the maximum of phi itself",
             explanation="K = ((k-1)/lambda)^(k-1) e^(lambda-k+1) = e^2 / 3"),
    Exercise("on_policy_ratio",
             "On-policy (mu = pi, so W = 1 for every response), what is E_mu[phi^2] / (Z K C) for (k, lambda) = "
             "(2, 3)?",
             lambda: _on_policy_ratio(2.0, 3.0), rtol=0.005,
             hint="with W = 1: phi = 1, Z = 1, C = 1",
             explanation="1/K: the bound is loose by K on-policy for (2, 3) and tight for (3, 2), where K = 1"),
    Exercise("no_bound",
             "For which kernels does Proposition 3.1 give no finite bound?",
             lambda: "b", kind="choice",
             choices=(("a", "k > lambda"), ("b", "k < 1"), ("c", "lambda < 1"), ("d", "none: K is always finite")),
             hint="look at phi(w)/w = w^(k-1) e^(lambda(1-w)) as w -> 0",
             explanation="for k < 1, phi(w)/w -> infinity as w -> 0: K is infinite"),
)}
