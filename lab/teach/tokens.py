"""One next-token distribution pi and a stale behaviour mu at a chosen per-token KL: the lessons' common toy.

pi = softmax(z) with logits z = sharpness * N(0, 1) draws (lab.teach.hashrng, so that the browser pages draw the same
ones); the behaviour policy moves the logits along a fixed direction e (standardised N(0, 1) draws of the next stream),

    mu_s = softmax(z + s e),   s >= 0 chosen so that KL(mu_s || pi) = d,

the lab's ``kl`` staleness knob on one state. KL(mu_s || pi) = s E_s[e] - A(s) + A(0) with A = logsumexp, so
d/ds KL = s Var_{mu_s}(e) >= 0: the KL grows monotonically with s and bisection finds s. It is bounded by
-log pi(argmax e) as s -> infinity; a larger target gets that supremum's closest approach (``achieved_kl`` says which).
Bisection runs a fixed number of halvings so that the JavaScript twin (lab.teach.jscore) reproduces it step by step.
"""
from __future__ import annotations

import numpy as np

from lab.errors import LabError
from lab.teach import hashrng

BISECTION_STEPS = 100
SCALE_CAP = 1e4  # the search for an upper bracket stops here (KL is then within float error of its supremum)


def check_vocab(vocab: int, largest: int = 1 << 16) -> int:
    if not (isinstance(vocab, (int, np.integer)) and 2 <= vocab <= largest):
        raise LabError(f"vocabulary size must be a whole number from 2 to {largest}, got {vocab!r}")
    return int(vocab)


def check_kl(kl) -> np.ndarray:
    kl = np.asarray(kl, dtype=np.float64)
    if not np.all(np.isfinite(kl)) or np.any(kl < 0):
        raise LabError(f"per-token KL targets must be finite and >= 0, got {kl}")
    return kl


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def kl(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    """KL(p || q) = sum_v p_v (log p_v - log q_v) over the last axis (0 log 0 = 0)."""
    p = np.exp(log_p)
    return np.where(p > 0, p * (log_p - log_q), 0.0).sum(-1)


def logits(vocab: int, seed: int = 0, sharpness: float = 2.0) -> np.ndarray:
    """pi's logits: sharpness * N(0, 1) draws of stream 2 * seed (larger sharpness: a more peaked pi)."""
    return float(sharpness) * hashrng.normals(2 * int(seed), check_vocab(vocab))


def direction(vocab: int, seed: int = 0) -> np.ndarray:
    """The staleness direction e: N(0, 1) draws of stream 2 * seed + 1, centred and scaled to unit RMS."""
    e = hashrng.normals(2 * int(seed) + 1, check_vocab(vocab))
    e = e - e.mean()
    return e / np.sqrt(np.mean(e**2))


def behaviour_scale(z: np.ndarray, e: np.ndarray, target) -> np.ndarray:
    """The perturbation s >= 0 with KL(softmax(z + s e) || softmax(z)) = target, vectorised over ``target``."""
    target = check_kl(target)
    log_pi = log_softmax(z)

    def kl_at(s):
        return kl(log_softmax(z + s[..., None] * e), log_pi)

    hi = np.ones_like(target)
    for _ in range(64):  # bracket: double until KL(hi) >= target (or the cap)
        grow = (kl_at(hi) < target) & (hi < SCALE_CAP)
        if not grow.any():
            break
        hi = np.where(grow, hi * 2, hi)
    lo = np.zeros_like(target)
    for _ in range(BISECTION_STEPS):
        mid = 0.5 * (lo + hi)
        below = kl_at(mid) < target
        lo, hi = np.where(below, mid, lo), np.where(below, hi, mid)
    return 0.5 * (lo + hi)


def stale_pair(vocab: int, kl_target, seed: int = 0, sharpness: float = 2.0):
    """(log pi [V], log mu [..., V]) with KL(mu || pi) = kl_target per token (vectorised over kl_target)."""
    z, e = logits(vocab, seed, sharpness), direction(vocab, seed)
    s = behaviour_scale(z, e, kl_target)
    return log_softmax(z), log_softmax(z + s[..., None] * e)


def achieved_kl(log_pi: np.ndarray, log_mu: np.ndarray) -> np.ndarray:
    """KL(mu || pi) per token, as reached (equal to the target unless the target exceeds the supremum)."""
    return kl(log_mu, log_pi)
