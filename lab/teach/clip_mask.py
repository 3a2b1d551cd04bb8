"""What clipping and masking throw away: the mass and the direction of the gradient they drop.

One state, V next tokens, the current policy pi = softmax(z) and a stale behaviour mu at per-token KL d
(lab.teach.tokens). Token y has advantage A_y = R_y - E_pi[R] and ratio rho_y = pi(y)/mu(y). Every token-level
correction is REINFORCE with an effective coefficient c(rho, A) on A grad log pi (the registry's ``coefficient``
functions: lab.estimators.info(name).coefficient), so its expected update with respect to the logits z is

    g_c = E_mu[c(rho, A) A grad_z log pi(y)] = a - pi sum_y a_y,   a_y = mu_y c(rho_y, A_y) A_y,
    grad_z log pi(y) = e_y - pi,

and the truth is g* = E_pi[A grad_z log pi] (c = rho: importance sampling, unbiased on one token). Measured here:

- zeroed: the mu-probability of tokens whose gradient is dropped entirely (c = 0 where rho > 0);
- mass lost: sum_y mu_y |A_y| (rho_y - c_y)^+ / sum_y mu_y |A_y| rho_y, the share of the IS weight mass removed;
- direction: cos(g_c, g*), and the lost vector g* - g_c split into its part along g* (a shorter step: harmless,
  like a smaller learning rate) and its part orthogonal to g* (a wrong direction: bias no step size undoes).

Coefficients and defaults are the registry's: PPO clip eps 0.2/0.2 (Schulman et al. 2017; verl), TIS cap 2 (Yao et al.
2025; verl, slime), IcePop band [0.5, 5] (Ring-flash-2.0; verl), CISPO cap 5 (MiniMax-M1, arXiv 2506.13585), SAPO
tau 1.0/1.05 (soft gate).
"""
from __future__ import annotations

import inspect

import numpy as np
import pandas as pd
import torch

from lab import estimators
from lab.errors import LabError
from lab.teach import hashrng, tokens
from lab.teach.exercises import Exercise
from lab.threads import single_threaded
from dataclasses import dataclass

from lab.configs import SEED_MAX
from lab.typed import knob


@dataclass
class Config:
    """The lesson's settings (its report's parameters)."""

    vocab: int = knob(64, ge=2, le=100_000)
    """next-token vocabulary size V"""
    kl: float = knob(0.1, gt=0, le=10)
    """per-token KL(mu || pi) of the detailed look"""
    kls: list[float] = knob([0.01, 0.02, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0], gt=0, le=10)
    """staleness sweep"""
    sharpness: float = knob(2.0, ge=0, le=100)
    """logit scale of pi"""
    seed: int = knob(0, ge=0, le=SEED_MAX)
    """draw of pi, mu's direction and the rewards"""
    live_controls: bool = True
    """build the ipywidgets controls (needs a widget frontend to be seen)"""

METHODS = ("token_is", "ppo_clip", "tis_token", "mis_token", "cispo", "sapo")
LABELS = {n: estimators.info(n).label for n in METHODS}  # the registry's display names
REWARD_STREAM = 1_000_000  # rewards use hashrng stream REWARD_STREAM + seed


@single_threaded
def coefficient(name: str, ratio, advantage, **overrides) -> np.ndarray:
    """The registry's effective coefficient of estimator ``name`` on A grad log pi, at its defaults (float64 numpy)."""
    info = estimators.info(name)
    if info.coefficient is None:
        raise LabError(f"estimator {name!r} has no per-token coefficient")
    params = inspect.signature(info.coefficient).parameters
    hyper = {k: v for k, v in {**info.defaults, **overrides}.items() if k in params}
    ratio = torch.as_tensor(np.array(ratio, dtype=np.float64))
    advantage = torch.as_tensor(np.broadcast_to(np.asarray(advantage, dtype=np.float64), ratio.shape).copy())
    return info.coefficient(ratio, advantage, **hyper).numpy()


def advantages(log_pi: np.ndarray, seed: int = 0) -> np.ndarray:
    """A_y = R_y - E_pi[R] with R_y standard normal (hashrng stream REWARD_STREAM + seed)."""
    reward = hashrng.normals(REWARD_STREAM + int(seed), log_pi.shape[-1])
    return reward - (np.exp(log_pi) * reward).sum(-1, keepdims=True)


def ratios(log_pi, log_mu) -> np.ndarray:
    """rho = pi / mu, with the log-ratio capped at 700 so that tokens mu almost never draws stay finite."""
    return np.exp(np.minimum(log_pi - log_mu, 700.0))


def expected_gradient(log_pi, log_mu, adv, coef) -> np.ndarray:
    """g_c = a - pi sum(a), a = mu c A (vectorised over leading axes)."""
    a = np.exp(log_mu) * coef * adv
    return a - np.exp(log_pi) * a.sum(-1, keepdims=True)


def losses(log_pi, log_mu, adv, coef) -> dict:
    """Mass and direction lost by coefficient ``coef`` against importance sampling (vectorised over leading axes)."""
    mu, ratio = np.exp(log_mu), ratios(log_pi, log_mu)
    g_true = expected_gradient(log_pi, log_mu, adv, ratio)
    g = expected_gradient(log_pi, log_mu, adv, coef)
    norm_true = np.linalg.norm(g_true, axis=-1)
    norm = np.linalg.norm(g, axis=-1)
    unit = g_true / np.maximum(norm_true, 1e-300)[..., None]
    lost = g_true - g
    along = (lost * unit).sum(-1)
    across = np.linalg.norm(lost - along[..., None] * unit, axis=-1)
    dropped = (coef == 0) & (ratio > 0)
    return {"zeroed": (mu * dropped).sum(-1),
            "mass_lost": (mu * np.abs(adv) * np.maximum(ratio - coef, 0)).sum(-1)
            / (mu * np.abs(adv) * ratio).sum(-1),
            "cos": np.where(norm > 0, (g * g_true).sum(-1) / np.maximum(norm * norm_true, 1e-300), 0.0),
            "norm_ratio": norm / norm_true, "lost_along": along / norm_true, "lost_across": across / norm_true,
            "rel_bias": np.linalg.norm(lost, axis=-1) / norm_true}


def setting(vocab: int, kl, seed: int = 0, sharpness: float = 2.0):
    """(log pi [V], log mu [..., V], A [V]) of the lesson's state."""
    log_pi, log_mu = tokens.stale_pair(vocab, kl, seed, sharpness)
    return log_pi, log_mu, advantages(log_pi, seed)[..., :]


def compare(vocab: int, kl, seed: int = 0, sharpness: float = 2.0, methods=METHODS, **overrides) -> pd.DataFrame:
    """Tidy table (method, kl_target, metric, value) for each per-token KL in ``kl`` (vectorised over it).

    ``overrides`` maps a method to its hyper-parameters, e.g. ppo_clip={"clip_ratio_high": 0.28}.
    """
    kls = np.atleast_1d(tokens.check_kl(kl))
    log_pi, log_mu, adv = setting(vocab, kls, seed, sharpness)
    ratio = ratios(log_pi, log_mu)
    rows = []
    for name in methods:
        coef = coefficient(name, ratio, np.broadcast_to(adv, ratio.shape), **overrides.get(name, {}))
        for metric, values in losses(log_pi, log_mu, adv, coef).items():
            rows += [(name, float(d), metric, float(v)) for d, v in zip(kls, np.atleast_1d(values))]
    return pd.DataFrame(rows, columns=["method", "kl_target", "metric", "value"])


def token_table(vocab: int, kl: float, seed: int = 0, sharpness: float = 2.0, methods=METHODS) -> pd.DataFrame:
    """One row per token: mu, pi, rho, A and each method's coefficient (for the scatter of what is dropped)."""
    log_pi, log_mu, adv = setting(vocab, kl, seed, sharpness)
    ratio = ratios(log_pi, log_mu)
    out = pd.DataFrame({"token": np.arange(vocab), "pi": np.exp(log_pi), "mu": np.exp(log_mu), "rho": ratio,
                        "advantage": adv})
    for name in methods:
        out[name] = coefficient(name, ratio, adv)
    return out


def page_data(vocab: int, kl: float, seed: int = 0, sharpness: float = 2.0, kl_grid=None) -> dict:
    """What the browser page shows (the JavaScript twin computes the same): per-token rho, A and coefficients, and
    per method the losses at ``kl`` and cos / mass lost along a grid of KLs."""
    kl_grid = np.linspace(0.0, 1.0, 41)[1:] if kl_grid is None else np.asarray(kl_grid, dtype=np.float64)
    table = token_table(vocab, kl, seed, sharpness)
    at = compare(vocab, kl, seed, sharpness)
    grid = compare(vocab, kl_grid, seed, sharpness)
    return {"rho": table["rho"].tolist(), "advantage": table["advantage"].tolist(), "mu": table["mu"].tolist(),
            "coef": {m: table[m].tolist() for m in METHODS},
            "at": {m: dict(zip(g["metric"], g["value"])) for m, g in at.groupby("method", sort=False)},
            "kl_grid": kl_grid.tolist(),
            "grid": {m: {k: g.loc[g["metric"] == k, "value"].tolist() for k in ("cos", "mass_lost", "zeroed")}
                     for m, g in grid.groupby("method", sort=False)}}


# ---- exercises ------------------------------------------------------------------------------------------------

def _coef(name: str, ratio: float, advantage: float) -> float:
    return float(coefficient(name, np.array([ratio]), np.array([advantage]))[0])


def _zeroed_by_ppo() -> float:
    table = compare(64, 0.1, seed=0, methods=("ppo_clip",))
    return float(table.loc[table["metric"] == "zeroed", "value"].iloc[0])


EXERCISES = {ex.key: ex for ex in (
    Exercise("ppo_positive",
             "PPO clip with eps = 0.2. A token has advantage A > 0 and ratio rho = 1.5. What is its effective "
             "coefficient on A grad log pi?",
             lambda: _coef("ppo_clip", 1.5, 1.0), atol=1e-9, rtol=0.0,
             hint="the clipped branch is a constant: what is the gradient of a constant?",
             explanation="max(-A rho, -A clip(rho)) picks the clipped constant -1.2 A, whose gradient is 0: the token "
                         "is dropped, not shrunk to 1.2"),
    Exercise("ppo_negative",
             "Same clip, but A < 0 and rho = 1.5. What is the coefficient now?",
             lambda: _coef("ppo_clip", 1.5, -1.0), rtol=1e-9,
             hint="for A < 0 the clip bites only when rho falls below 1 - eps",
             explanation="the unclipped branch wins, so the gradient passes with the full ratio (the dual clip, "
                         "off by default here, would cap it at c = 3)"),
    Exercise("cispo_cap",
             "CISPO (cap 1 + eps_high = 5) sees a token with rho = 8. What is its coefficient?",
             lambda: _coef("cispo", 8.0, 1.0), rtol=1e-9,
             hint="CISPO clips a detached weight; the log-prob keeps its gradient",
             explanation="the weight is truncated to 5 and the token still contributes: CISPO shrinks, masking "
                         "(IcePop) would drop it"),
    Exercise("one_token_unbiased",
             "The response is ONE token long. Which correction is unbiased for grad J at any staleness?",
             lambda: "e", kind="choice",
             choices=(("a", "PPO clip"), ("b", "TIS with cap 2"), ("c", "IcePop masking"), ("d", "CISPO"),
                      ("e", "token-level importance sampling")),
             hint="on one token, which coefficient equals the sequence weight W at every ratio?",
             explanation="with T = 1 the token ratio IS the sequence weight; every clip, cap or mask changes "
                         "E_mu[c A grad log pi] away from E_pi[A grad log pi]"),
    Exercise("zeroed_by_ppo",
             "V = 64 tokens, per-token KL 0.1, seed 0, sharpness 2 (the defaults of ``compare``). What mu-probability "
             "of tokens does PPO clip drop entirely? Use lab.teach.clip_mask.compare.",
             _zeroed_by_ppo, rtol=0.01,
             hint="read the 'zeroed' metric of ppo_clip",
             explanation="each dropped token is a sample whose information the update ignores"),
)}
