"""vOPD's baseline: why subtracting V(s) = -KL_t is unbiased, and when it does (and does not) reduce variance.

On-policy distillation (lab.estimators.distillation) treats r(y) = log pi_T(y|s) - log pi_S(y|s) as the reward of
the sampled token y ~ pi_S(.|s); E[r | s] = -KL(pi_S || pi_T) at s. At one state, with student logits z
(grad_z log pi_S(y) = e_y - p, p = pi_S(.|s), q = pi_T(.|s)), the per-token estimators are

    vanilla OPD   g_0(y) = r(y) (e_y - p)                        (Thinking Machines 2025; lab ``opd``)
    vOPD          g_V(y) = (r(y) - V) (e_y - p),  V = -KL(p||q)  (Oh et al. 2026, arXiv 2605.07865; lab ``vopd``)

Unbiased: E_p[b (e_y - p)] = b (p - p) = 0 for any b that does not depend on y. Both have mean
g = p * (r - V) (elementwise; the ascent direction -grad_z KL). Their variance (trace of the covariance) is a
quadratic in the baseline b,

    Var(b) = E_p[(r - b)^2 s] - ||g||^2,   s(y) = ||e_y - p||^2 = 1 - 2 p_y + ||p||^2,

minimised by b* = E_p[r s] / E_p[s] (Weaver & Tao 2001; Greensmith et al. 2004), and Var(b) < Var(0) exactly when b
lies strictly between 0 and 2 b*. V = E_p[r] is b* only when s is constant in y. It is not: unlikely tokens have
larger s and, since r = log q - log p, usually larger r as well, which pulls b* above V, often above 0. Then V sits
on the wrong side of 0 and the "variance-reducing" baseline raises the variance: on a 3-token vocabulary this
happens for most random teachers, while with many tokens V falls inside (0, 2 b*) far more often.

In a network the gradient is J^T (e_y - p) for the Jacobian J of the logits, so the weights differ, but the
mechanism (a constant baseline helps only inside (0, 2 b*)) is the same.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch.func import grad, vmap

from lab import estimators, stats
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

    vocabs: list[int] = knob([2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256], ge=2, le=1_000_000)
    """vocabulary sizes of the random-teacher sweep"""
    draws: int = knob(400, ge=2, le=1_000_000)
    """random (student, teacher) pairs per vocabulary size"""
    settings: list[list[float]] = knob([[1.0, 0.0], [3.0, 0.0], [1.0, 0.9]], ge=0, le=100)
    """(logit scale, teacher closeness to the student)"""
    example_vocabs: list[int] = knob([3, 64], ge=2, le=1_000_000)
    """the two states of Figure 1"""
    mc_samples: int = knob(4000, ge=2, le=10_000_000)
    """sampled tokens for the Monte Carlo check"""
    seed: int = knob(0, ge=0, le=SEED_MAX)
    """draw of the states and the samples"""
    live_controls: bool = True
    """build the ipywidgets controls (needs a widget frontend to be seen)"""

TEACHER_STREAM, STUDENT_STREAM = 3_000_000, 4_000_000
DEFAULT_VOCABS = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)


def state_moments(log_p: np.ndarray, log_q: np.ndarray) -> dict:
    """Exact per-state quantities (vectorised over leading axes): V = -KL, b*, Var(0), Var(V), Var(b*), the helpful
    interval (0, 2 b*) and the variance ratio Var(V) / Var(0)."""
    p = np.exp(log_p)
    r = log_q - log_p
    s = 1.0 - 2.0 * p + (p**2).sum(-1, keepdims=True)
    value = (p * r).sum(-1)
    e_rs, e_s, e_r2s = (p * r * s).sum(-1), (p * s).sum(-1), (p * r * r * s).sum(-1)
    mean = p * (r - value[..., None])
    m2 = (mean**2).sum(-1)
    var0 = e_r2s - m2
    b_star = e_rs / e_s
    var_v = var0 - 2 * value * e_rs + value**2 * e_s
    return {"value": value, "b_star": b_star, "var_opd": var0, "var_vopd": var_v,
            "var_best": var0 - e_rs**2 / e_s, "ratio": var_v / var0, "helps": var_v < var0,
            "mean_norm": np.sqrt(m2)}


def variance_curve(log_p: np.ndarray, log_q: np.ndarray, baselines) -> np.ndarray:
    """Var(b) for each baseline b (the quadratic above)."""
    p = np.exp(log_p)
    r = log_q - log_p
    s = 1.0 - 2.0 * p + (p**2).sum()
    b = np.asarray(baselines, dtype=np.float64)[:, None]
    mean = p * (r - (p * r).sum())
    return (p * (r - b) ** 2 * s).sum(-1) - (mean**2).sum()


def random_pairs(vocab: int, draws: int, sharpness: float = 1.0, closeness: float = 0.0, seed: int = 0):
    """(log p [draws, V], log q [draws, V]): student logits z_S = sharpness N(0, 1); teacher logits
    z_T = closeness z_S + sqrt(1 - closeness^2) sharpness N(0, 1) (closeness 0: a random teacher; 1: the student)."""
    vocab = tokens.check_vocab(vocab)
    if not 0.0 <= closeness <= 1.0:
        raise LabError(f"closeness must lie in [0, 1], got {closeness}")
    n = int(draws) * vocab
    z_s = sharpness * hashrng.normals(STUDENT_STREAM + int(seed), n).reshape(int(draws), vocab)
    noise = sharpness * hashrng.normals(TEACHER_STREAM + int(seed), n).reshape(int(draws), vocab)
    z_t = closeness * z_s + np.sqrt(1.0 - closeness**2) * noise
    return tokens.log_softmax(z_s), tokens.log_softmax(z_t)


def helps_table(vocabs=DEFAULT_VOCABS, draws: int = 400, sharpness: float = 1.0, closeness: float = 0.0,
                seed: int = 0) -> pd.DataFrame:
    """Per vocabulary size: the fraction of random (student, teacher) pairs where vOPD lowers the variance, with a
    Wilson interval (lab.stats), and the median and quartiles of Var(vOPD) / Var(OPD)."""
    rows = []
    for vocab in vocabs:
        m = state_moments(*random_pairs(vocab, draws, sharpness, closeness, seed))
        k = int(m["helps"].sum())
        _, lo, hi = stats.rate_interval(k, int(draws))
        q25, q50, q75 = np.quantile(m["ratio"], [0.25, 0.5, 0.75])
        rows.append({"vocab": int(vocab), "helps_frac": k / draws, "helps_lo": lo, "helps_hi": hi,
                     "ratio_median": q50, "ratio_q25": q25, "ratio_q75": q75,
                     "best_ratio_median": float(np.median(m["var_best"] / m["var_opd"]))})
    return pd.DataFrame(rows)


@single_threaded
def sampled_variances(log_p: np.ndarray, log_q: np.ndarray, samples: int = 4000, seed: int = 0,
                      n_boot: int = 500) -> dict:
    """Monte Carlo check with the lab's own estimators: per-sample ascent directions of ``opd`` and ``vopd`` w.r.t.
    the student logits (torch.func vmap of grad over sampled tokens). Returns, per estimator, {"variance": (value,
    lo, hi)} (trace of the covariance with a percentile bootstrap interval over samples, lab.stats) and
    {"mean_error": |sample mean - exact mean g| / |g|}."""
    opd, vopd = estimators.get("opd"), estimators.get("vopd")
    z = torch.as_tensor(log_p)
    zt = torch.as_tensor(log_q)
    y = np.random.default_rng(seed).choice(len(log_p), size=int(samples), p=np.exp(log_p))
    onehot = torch.as_tensor(np.eye(len(log_p))[y])
    one = torch.ones(1, 1, dtype=torch.float64)

    def loss(logits, tok, which):  # tok: the sampled token as a one-hot row (vmap cannot index by a batched id)
        lp = torch.log_softmax(logits, -1)
        log_prob = (lp * tok).sum().reshape(1, 1)
        teacher = (torch.log_softmax(zt, -1) * tok).sum().reshape(1, 1)
        if which == "opd":
            return opd(log_prob, log_prob.detach(), 0 * one, one, teacher_log_prob=teacher)[0]
        return vopd(log_prob, log_prob.detach(), 0 * one, one, teacher_log_prob=teacher,
                    logits=logits.reshape(1, 1, -1), teacher_logits=zt.reshape(1, 1, -1))[0]

    out = {}
    exact = np.exp(log_p) * (log_q - log_p - state_moments(log_p, log_q)["value"])
    rng = np.random.default_rng(seed + 1)
    counts = stats.bootstrap_counts(int(samples), int(n_boot), rng)
    for which in ("opd", "vopd"):
        g = -vmap(grad(lambda logits, tok: loss(logits, tok, which)), in_dims=(None, 0))(z, onehot).numpy()
        sq = (g**2).sum(-1)
        n = counts.sum(1)
        boot = (counts @ sq) / n - (((counts @ g) / n[:, None]) ** 2).sum(-1)
        var = float(sq.mean() - (g.mean(0) ** 2).sum())
        out[which] = {"variance": (var, *stats.percentile_interval(boot)),
                      "mean_error": float(np.linalg.norm(g.mean(0) - exact) / np.linalg.norm(exact))}
    return out


def page_data(vocab: int, sharpness: float = 1.0, closeness: float = 0.0, seed: int = 0, draws: int = 300,
              vocabs=DEFAULT_VOCABS) -> dict:
    """What the browser page shows (the JavaScript twin computes the same): one pair (draw 0) with its variance
    parabola, and the fraction of pairs that vOPD helps against vocabulary size."""
    log_p, log_q = random_pairs(vocab, 1, sharpness, closeness, seed)
    m = {k: float(v[0]) for k, v in state_moments(log_p, log_q).items()}
    span = max(abs(m["value"]), abs(m["b_star"]), 0.1) * 2.5
    b = np.linspace(-span, span, 101)
    curve = variance_curve(log_p[0], log_q[0], b)
    frac, med = [], []
    for v in vocabs:
        mm = state_moments(*random_pairs(v, draws, sharpness, closeness, seed))
        frac.append(float(mm["helps"].mean()))
        med.append(float(np.median(mm["ratio"])))
    return {"pair": m, "p": np.exp(log_p[0]).tolist(), "q": np.exp(log_q[0]).tolist(), "baselines": b.tolist(),
            "variance": curve.tolist(), "vocabs": list(map(int, vocabs)), "helps_frac": frac, "ratio_median": med}


# ---- exercises ------------------------------------------------------------------------------------------------

SMALL_P, SMALL_Q = np.log([0.7, 0.2, 0.1]), np.log([0.4, 0.3, 0.3])


def _baseline_mean() -> float:
    p = np.exp(SMALL_P)
    b = 0.37  # any constant
    return float(np.abs((p[:, None] * b * (np.eye(3) - p[None, :])).sum(0)).max())


EXERCISES = {ex.key: ex for ex in (
    Exercise("baseline_mean",
             "For any constant b, what is E_{y ~ p}[b (e_y - p)] (give the largest absolute component)?",
             _baseline_mean, atol=1e-9, rtol=0.0,
             hint="sum_y p_y e_y = p",
             explanation="a baseline that does not depend on the sampled token adds nothing in expectation"),
    Exercise("state_value",
             "Student p = (0.7, 0.2, 0.1), teacher q = (0.4, 0.3, 0.3). What is vOPD's baseline V = -KL(p || q)?",
             lambda: float(state_moments(SMALL_P, SMALL_Q)["value"]), rtol=0.005,
             hint="V = sum_y p_y (log q_y - log p_y)",
             explanation="the expected per-token reward at this state"),
    Exercise("upper_end",
             "Same example. A constant baseline b lowers the variance when it lies strictly between 0 and 2 b*. "
             "What is 2 b*?",
             lambda: float(2 * state_moments(SMALL_P, SMALL_Q)["b_star"]), rtol=0.005,
             hint="b* = E_p[r s] / E_p[s] with s(y) = 1 - 2 p_y + ||p||^2",
             explanation="compare it with V: is V inside (0, 2 b*)?"),
    Exercise("does_it_help",
             "Same example. Does vOPD's baseline lower the variance of the per-token gradient?",
             lambda: "a" if bool(state_moments(SMALL_P, SMALL_Q)["helps"]) else "b", kind="choice",
             choices=(("a", "yes"), ("b", "no")),
             hint="V is negative; where is b*?",
             explanation="b* > 0 here while V < 0: V is outside (0, 2 b*), so it adds variance"),
)}
