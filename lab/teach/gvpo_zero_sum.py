"""GVPO's zero-sum trick: why the partition function Z(x) cancels, and the optimum reached from off-policy samples.

GVPO (Zhang et al., arXiv 2504.19599, NeurIPS 2025; lab.estimators.gvpo) targets the KL-constrained optimum

    pi*(y) = pi_ref(y) exp(R(y)/beta) / Z,   Z = sum_y pi_ref(y) exp(R(y)/beta),

whose implied reward beta log(pi*/pi_ref)(y) = R(y) - beta log Z carries the intractable constant beta log Z.
For a group of k responses, GVPO's gradient is -beta/(k-1) sum_i w_i grad log pi(y_i) with

    w_i = (R_i - mean_j R_j) - beta (l_i - mean_j l_j),   l = log pi - log pi_ref,

and sum_i w_i = 0: adding one constant to every reward (or to every l_i) changes no w_i, so beta log Z drops out
and the loss can be zero exactly at pi* without ever computing Z. In expectation over groups drawn i.i.d. from any
sampler mu the loss is

    E[L_group] = 1/2 Var_mu(beta l - R),

zero exactly when beta l - R is constant on mu's support: pi = pi* wherever mu samples (Theorems 1 and 2). A
sampler that never draws some response leaves pi free there. The uncentred regression 1/2 E_mu[(beta l - R)^2]
would need beta l = R exactly, which a normalised pi cannot reach unless Z = 1: its minimiser depends on mu.

Here pi is a softmax over n responses with logits theta (grad_theta l(y) = e_y - pi), so both expected losses have
closed-form gradients: grad 1/2 Var_mu(u) = beta mu (u - E_mu u) and grad 1/2 E_mu[u^2] = beta (b - pi sum b),
b = mu u, u = beta l - R (sum_y mu_y (u_y - E_mu u) = 0 removes the pi term in the first). The notebook also trains
from sampled groups with the lab's own ``gvpo`` loss.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from lab import estimators
from lab.errors import LabError
from lab.estimators.gvpo import gvpo_weights
from lab.teach import hashrng, tokens
from lab.teach.exercises import Exercise
from lab.threads import single_threaded
from dataclasses import dataclass

from lab.configs import SEED_MAX
from lab.typed import knob


@dataclass
class Config:
    """The lesson's settings (its report's parameters)."""

    n: int = knob(8, ge=2, le=100_000)
    """responses to the prompt"""
    beta: float = knob(0.5, gt=0, le=100)
    """KL strength"""
    steps: int = knob(300, ge=1, le=1_000_000)
    """gradient steps on the expected loss"""
    lr: float = knob(1.0, gt=0, le=100)
    """step size in units of 1/beta^2 (stable below 2 / max mu)"""
    sampled_steps: int = knob(150, ge=1, le=1_000_000)
    """SGD steps on sampled groups with the lab's gvpo loss"""
    groups: int = knob(8, ge=1, le=100_000)
    """groups per step"""
    group_size: int = knob(4, ge=2, le=10_000)
    """responses per group (k)"""
    seed: int = knob(0, ge=0, le=SEED_MAX)
    """draw of pi_ref, the rewards and the samples"""
    sharpness: float = knob(1.0, ge=0, le=100)
    """logit scale of pi_ref"""
    live_controls: bool = True
    """build the ipywidgets controls (needs a widget frontend to be seen)"""

SAMPLERS = ("on-policy", "reference", "uniform", "low-reward", "partial")
SAMPLER_TEXT = {"on-policy": "the current policy (stop-gradient)", "reference": "pi_ref",
                "uniform": "uniform over responses", "low-reward": "proportional to exp(-3 R): mostly bad responses",
                "partial": "uniform, but never the best response"}
REWARD_STREAM = 2_000_000


def problem(n: int = 8, seed: int = 0, sharpness: float = 1.0):
    """(log pi_ref [n], R [n]): reference logits sharpness * N(0, 1), rewards uniform in (0, 1) (hashrng streams)."""
    n = tokens.check_vocab(n, largest=4096)
    return tokens.log_softmax(tokens.logits(n, seed, sharpness)), hashrng.uniforms(REWARD_STREAM + int(seed), n)


def optimum(log_ref: np.ndarray, reward: np.ndarray, beta: float) -> np.ndarray:
    """log pi* = log pi_ref + R / beta - log Z."""
    if not beta > 0:
        raise LabError(f"beta must be positive, got {beta}")
    return tokens.log_softmax(log_ref + reward / beta)


def log_partition(log_ref: np.ndarray, reward: np.ndarray, beta: float) -> float:
    """log Z = log sum_y pi_ref(y) exp(R(y)/beta)."""
    x = log_ref + reward / beta
    m = x.max()
    return float(m + np.log(np.exp(x - m).sum()))


def group_weights(reward, log_ratio, beta: float) -> np.ndarray:
    """w_i = (R_i - mean R) - beta (l_i - mean l) over the last axis (one group per row)."""
    reward, log_ratio = np.asarray(reward, dtype=np.float64), np.asarray(log_ratio, dtype=np.float64)
    return (reward - reward.mean(-1, keepdims=True)) - beta * (log_ratio - log_ratio.mean(-1, keepdims=True))


@single_threaded
def lab_group_weights(reward, log_ratio, beta: float) -> np.ndarray:
    """The same weights from the lab's estimator module (lab.estimators.gvpo.gvpo_weights), for one group."""
    r = torch.as_tensor(np.asarray(reward, dtype=np.float64))
    ell = torch.as_tensor(np.asarray(log_ratio, dtype=np.float64))
    return gvpo_weights(r, ell, r.shape[-1], beta).numpy()


def sampler(name: str, log_ref: np.ndarray, reward: np.ndarray, log_pi: np.ndarray | None = None) -> np.ndarray:
    """The sampling distribution mu over responses (``log_pi``: the current policy, for on-policy)."""
    n = log_ref.shape[-1]
    if name == "on-policy":
        return np.exp(log_ref if log_pi is None else log_pi)
    if name == "reference":
        return np.exp(log_ref)
    if name == "uniform":
        return np.full(n, 1.0 / n)
    if name == "low-reward":
        return np.exp(tokens.log_softmax(-3.0 * reward))
    if name == "partial":
        mu = np.ones(n)
        mu[np.argmax(reward)] = 0.0
        return mu / mu.sum()
    raise LabError(f"unknown sampler {name!r}; choose one of {', '.join(SAMPLERS)}")


def loss_gradient(theta, log_ref, reward, mu, beta: float, centred: bool = True):
    """(loss, gradient w.r.t. theta) of 1/2 Var_mu(beta l - R) (centred, GVPO) or 1/2 E_mu[(beta l - R)^2]."""
    log_pi = tokens.log_softmax(theta)
    u = beta * (log_pi - log_ref) - reward
    if centred:
        dev = u - (mu * u).sum(-1, keepdims=True)
        return 0.5 * (mu * dev**2).sum(-1), beta * mu * dev
    b = mu * u
    return 0.5 * (mu * u**2).sum(-1), beta * (b - np.exp(log_pi) * b.sum(-1, keepdims=True))


def tv(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    return 0.5 * np.abs(np.exp(log_p) - np.exp(log_q)).sum(-1)


def train_expected(log_ref, reward, beta: float, samplers=SAMPLERS, steps: int = 300, lr: float = 1.0,
                   centred: bool = True) -> dict:
    """Gradient descent on the expected loss from pi = pi_ref, one run per sampler (vectorised across them).

    The step is theta -= (lr / beta^2) grad: the loss's curvature in theta is about beta^2 mu_y, so ``lr`` is in
    units that do not depend on beta (stable for lr < 2 / max_y mu_y).

    Returns {"tv": [steps + 1, S] total variation to pi*, "log_pi": [S, n] final policies}.
    """
    target = optimum(log_ref, reward, beta)
    theta = np.tile(log_ref, (len(samplers), 1))
    fixed = {s: sampler(s, log_ref, reward) for s in samplers if s != "on-policy"}
    trace = [tv(tokens.log_softmax(theta), target)]
    for _ in range(int(steps)):
        log_pi = tokens.log_softmax(theta)
        mu = np.stack([fixed[s] if s != "on-policy" else np.exp(log_pi[i]) for i, s in enumerate(samplers)])
        theta = theta - (lr / beta**2) * loss_gradient(theta, log_ref, reward, mu, beta, centred)[1]
        trace.append(tv(tokens.log_softmax(theta), target))
    return {"tv": np.array(trace), "log_pi": tokens.log_softmax(theta)}


@single_threaded
def train_sampled(log_ref, reward, beta: float, sampler_name: str, steps: int = 300, groups: int = 8,
                  group_size: int = 4, lr: float = 1.0, seed: int = 0) -> np.ndarray:
    """SGD with the lab's ``gvpo`` loss on sampled groups (k responses each, i.i.d. from the sampler).

    Each step draws ``groups`` x ``group_size`` responses, evaluates lab.estimators.get("gvpo") on them as one-token
    responses (log_prob = log pi(y), old_log_prob = log pi_ref(y), rewards R(y)) and takes one SGD step on the logits
    (step lr / beta^2, as in ``train_expected``).
    Returns the TV distance to pi* after each step, [steps + 1].
    """
    gvpo = estimators.get("gvpo")
    rng = np.random.default_rng(seed)
    target = optimum(log_ref, reward, beta)
    theta = torch.tensor(log_ref, dtype=torch.float64, requires_grad=True)
    ref, rew = torch.as_tensor(log_ref), torch.as_tensor(reward)
    batch = int(groups) * int(group_size)
    ones = torch.ones(batch, 1, dtype=torch.float64)
    trace = [float(tv(log_ref, target))]
    for _ in range(int(steps)):
        log_pi = torch.log_softmax(theta, -1)
        mu = sampler(sampler_name, log_ref, reward, log_pi.detach().numpy())
        y = torch.as_tensor(rng.choice(len(mu), size=batch, p=mu))
        loss, _ = gvpo(log_pi[y][:, None], ref[y][:, None], torch.zeros_like(ones), ones, beta=beta,
                       rewards=rew[y], group_size=int(group_size))
        (grad,) = torch.autograd.grad(loss, theta)
        with torch.no_grad():
            theta -= (lr / beta**2) * grad
        trace.append(float(tv(torch.log_softmax(theta, -1).detach().numpy(), target)))
    return np.array(trace)


def trajectories_table(log_ref, reward, beta: float, steps: int, lr: float) -> pd.DataFrame:
    """Tidy (sampler, loss, step, metric="tv", value) for the centred (GVPO) and uncentred losses."""
    frames = []
    for centred, loss in ((True, "gvpo"), (False, "uncentred")):
        trace = train_expected(log_ref, reward, beta, SAMPLERS, steps, lr, centred)["tv"]
        for i, s in enumerate(SAMPLERS):
            frames.append(pd.DataFrame({"sampler": s, "loss": loss, "step": np.arange(steps + 1), "metric": "tv",
                                        "value": trace[:, i]}))
    return pd.concat(frames, ignore_index=True)


def page_data(beta: float, lr: float = 1.0, steps: int = 300, n: int = 8, seed: int = 0,
              sharpness: float = 1.0) -> dict:
    """What the browser page shows (the JavaScript twin computes the same)."""
    log_ref, reward = problem(n, seed, sharpness)
    gv = train_expected(log_ref, reward, beta, SAMPLERS, steps, lr, True)
    naive = train_expected(log_ref, reward, beta, SAMPLERS, steps, lr, False)
    return {"reward": reward.tolist(), "ref": np.exp(log_ref).tolist(),
            "optimum": np.exp(optimum(log_ref, reward, beta)).tolist(), "log_z": log_partition(log_ref, reward, beta),
            "tv": {s: gv["tv"][:, i].tolist() for i, s in enumerate(SAMPLERS)},
            "tv_uncentred": {s: naive["tv"][:, i].tolist() for i, s in enumerate(SAMPLERS)},
            "final": {s: np.exp(gv["log_pi"][i]).tolist() for i, s in enumerate(SAMPLERS)},
            "final_uncentred": {s: np.exp(naive["log_pi"][i]).tolist() for i, s in enumerate(SAMPLERS)}}


# ---- exercises ------------------------------------------------------------------------------------------------

SMALL_REF, SMALL_REWARD, SMALL_BETA = np.log([0.5, 0.3, 0.2]), np.array([1.0, 0.0, 0.0]), 0.5


def _weight_sum() -> float:
    rng = np.random.default_rng(0)
    return float(lab_group_weights(rng.normal(size=6), rng.normal(size=6), 0.1).sum())


EXERCISES = {ex.key: ex for ex in (
    Exercise("weight_sum",
             "Take any group of k responses with any rewards and any log-ratios. What is the sum of GVPO's weights "
             "w_i over the group?",
             _weight_sum, atol=1e-9, rtol=0.0,
             hint="each w_i is a centred reward minus beta times a centred log-ratio",
             explanation="centred quantities sum to zero, so any constant added to every reward (beta log Z) "
                         "leaves every w_i unchanged"),
    Exercise("optimum_prob",
             "pi_ref = (0.5, 0.3, 0.2), R = (1, 0, 0), beta = 0.5. What is pi*(y_1)?",
             lambda: float(np.exp(optimum(SMALL_REF, SMALL_REWARD, SMALL_BETA))[0]), rtol=0.005,
             hint="pi* is proportional to pi_ref exp(R / beta): do not forget pi_ref",
             explanation="0.5 e^2 / (0.5 e^2 + 0.3 + 0.2)"),
    Exercise("implied_offset",
             "Same example. At the optimum, beta log(pi*/pi_ref)(y) - R(y) is the same for every y. What is it?",
             lambda: -SMALL_BETA * log_partition(SMALL_REF, SMALL_REWARD, SMALL_BETA), rtol=0.005,
             hint="take beta log of pi* = pi_ref exp(R/beta) / Z",
             explanation="-beta log Z: the constant GVPO never has to compute"),
    Exercise("which_sampler",
             "Groups are drawn from each sampler below and GVPO is trained to its minimum. Which one does NOT end "
             "at pi*?",
             lambda: "c", kind="choice",
             choices=(("a", "uniform over all responses"), ("b", "mostly low-reward responses, but every one possible"),
                      ("c", "uniform, but never the best response"), ("d", "the current policy")),
             hint="Var_mu(beta l - R) = 0 constrains pi only where mu puts mass",
             explanation="Theorem 2 needs mu to cover pi_ref's support; elsewhere the loss cannot see pi"),
)}
