"""Behaviour policies mu for a current policy pi: each staleness knob is a number a user sets and reads back as a
measured divergence (``lab.engine.exact.divergence``). A behaviour is a (policy, theta) pair.

- lag k:          mu = the snapshot k optimiser steps behind pi on a real optimisation trajectory of the same
                  policy (Adam on the exact, by enumeration or DP, or Monte Carlo policy gradient of the env's
                  objective); pi is the trajectory's last snapshot. Stale rollouts in synchronous mini-batching
                  are this.
- kl target d:    mu's logits = pi's logits + s z(state) with a fixed noise z ~ N(0, 1) per (state, token)
                  (``Perturbed``); s is found by Brent's method so that the per-token KL(mu||pi) =
                  KL_seq / E_mu[|y|] equals d.
- temperature t:  mu's logits = pi's logits / t, the sampler's temperature (``Tempered``).
- top_p p, top_k k, min_p m: mu = pi's sampler truncated to its kept set and renormalised (``Truncated``, the
                  engines' semantics: ``lab.policies.truncation``); p = 1, k = V and m = 0 are pi itself.

Truncation also goes on top of any kind (``truncate``): mu = Truncated(mu, top_p, top_k, min_p), the lagged,
perturbed or tempered sampler with top-p / top-k / min-p after its temperature, as an engine applies them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy.optimize import brentq

from lab.engine.exact import Problem
from lab.errors import LabError
from lab.policies import Perturbed, Tempered, Truncated
from lab.policies.truncation import KNOBS as TRUNCATION_KINDS
from lab.policies.truncation import active, check_truncation

KINDS = ("lag", "kl", "temperature", *TRUNCATION_KINDS)


class Behaviour(tuple):
    """mu as a (policy, theta) pair that also carries its version lag behind pi (``lag``: k for the "lag" knob, None
    for the others, which have no versions)."""

    def __new__(cls, policy, theta, lag: int | None = None):
        self = super().__new__(cls, (policy, theta))
        self.lag = lag
        return self
TEMPERATURES = (1e-2, 1e2)  # sampler temperatures outside this range make float logits overflow or vanish


@dataclass
class Trajectory:
    """Snapshots theta_0 .. theta_K (float64) of Adam ascent on J; pi = theta_K."""

    snapshots: torch.Tensor  # [K + 1, *shape]

    @property
    def current(self) -> torch.Tensor:
        return self.snapshots[-1]

    @property
    def steps(self) -> int:
        return self.snapshots.shape[0] - 1


def optimisation_trajectory(problem: Problem, theta0, steps: int, lr: float, generator: torch.Generator) -> Trajectory:
    """Adam (beta 0.9/0.999) ascent on J from theta0 for ``steps`` steps, keeping every snapshot."""
    theta = theta0.detach().double().clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=lr)
    snaps = [theta.detach().clone()]
    for _ in range(steps):
        theta.grad = -problem.gradient(theta.detach(), generator)
        opt.step()
        snaps.append(theta.detach().clone())
    return Trajectory(torch.stack(snaps))


def check_value(kind: str, value: float, max_lag: int, vocab_size: int | None = None) -> None:
    if kind not in KINDS:
        raise LabError(f"unknown staleness kind {kind!r}; choose one of {', '.join(KINDS)}")
    if not math.isfinite(value):
        raise LabError(f"staleness value must be a finite number, got {value}")
    if kind == "lag":
        if value < 0 or value != int(value):
            raise LabError(f"lag must be a non-negative whole number of optimiser steps, got {value}")
        if value > max_lag:
            raise LabError(f"lag {int(value)} exceeds the trajectory length {max_lag}; raise --trajectory-steps")
    elif kind == "kl" and value < 0:
        raise LabError(f"KL target must be non-negative, got {value}")
    elif kind == "temperature" and not TEMPERATURES[0] <= value <= TEMPERATURES[1]:
        raise LabError(f"temperature must lie in [{TEMPERATURES[0]:g}, {TEMPERATURES[1]:g}] (positive, and finite "
                       f"logits once divided by it), got {value:g}")
    elif kind in TRUNCATION_KINDS:
        check_truncation(**{kind: int(value) if kind == "top_k" and value == int(value) else value},
                         vocab_size=vocab_size)


def kl_target(problem: Problem, theta_pi, target: float, generator: torch.Generator) -> tuple:
    """(Perturbed policy, theta_pi) whose per-token KL(mu||pi) equals ``target``."""
    policy = problem.policy
    z = policy.noise_table(generator)
    if target == 0:
        return policy, theta_pi.clone()
    # Common random numbers in MC mode: one generator state for every evaluation of the bisection.
    state = generator.get_state()

    def kl_at(scale):
        mu = Perturbed(policy, z, scale)
        generator.set_state(state)
        return problem.divergence((policy, theta_pi), (mu, theta_pi), generator)["kl_token"]

    lo, hi = 0.0, 1.0
    while kl_at(hi) < target:
        lo, hi = hi, hi * 2
        if hi > 2**12:
            raise LabError(f"KL target {target} is out of reach of logit perturbations; use a smaller value")
    scale = brentq(lambda s: kl_at(s) / target - 1.0, lo, hi, rtol=1e-10, xtol=1e-12 * hi, maxiter=200)
    return Perturbed(policy, z, scale), theta_pi


def behaviour(problem: Problem, kind: str, value: float, trajectory: Trajectory, generator) -> tuple:
    """mu = (policy, theta) for one staleness setting; pi = (problem.policy, trajectory.current)."""
    K = trajectory.steps
    check_value(kind, value, K, problem.policy.vocab_size)
    pi = trajectory.current
    if kind == "lag":
        return Behaviour(problem.policy, trajectory.snapshots[K - int(value)].clone(), int(value))
    if kind == "temperature":
        return Tempered(problem.policy, value), pi
    if kind in TRUNCATION_KINDS:
        return Truncated(problem.policy, **{kind: int(value) if kind == "top_k" else value}), pi
    return kl_target(problem, pi, value, generator)


def truncate(mu: tuple, top_p: float = 1.0, top_k: int | None = None, min_p: float = 0.0) -> tuple:
    """mu with top-p / top-k / min-p on top of its logits (after its temperature), or mu itself when they cut
    nothing (top_p = 1, top_k = V or None, min_p = 0: bit-identical). The version lag is kept."""
    policy, theta = mu
    check_truncation(top_p, top_k, min_p, policy.vocab_size)
    if not active(top_p, top_k, min_p, policy.vocab_size):
        return mu
    return Behaviour(Truncated(policy, top_p=top_p, top_k=top_k, min_p=min_p), theta, getattr(mu, "lag", None))
