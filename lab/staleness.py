"""Behaviour policies mu for a current policy pi: each staleness knob is a number a user sets and reads back
as a measured divergence (see ``lab.exact.divergence``).

- lag k:          mu = the snapshot k optimiser steps behind pi on a real optimisation trajectory of the
                  same policy (Adam on the exact, or Monte Carlo, policy gradient of the env's objective);
                  pi is the trajectory's last snapshot. Stale rollouts in synchronous mini-batching are this.
- kl target d:    mu = softmax(logits_pi + s z) with fixed noise z ~ N(0, 1); s is found by bisection so that
                  the per-token KL(mu||pi) = KL_seq / E_mu[|y|] equals d (Brent's method on s).
- temperature t:  mu = softmax(logits_pi / t), the sampler's temperature.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from scipy.optimize import brentq

from lab.errors import LabError
from lab.exact import divergence, make_support, policy_gradient

KINDS = ("lag", "kl", "temperature")


@dataclass
class Trajectory:
    """Snapshots theta_0 .. theta_K (float64) of Adam ascent on J; pi = theta_K."""

    snapshots: torch.Tensor  # [K + 1, *shape]
    objective_grad_norms: list[float]

    @property
    def current(self) -> torch.Tensor:
        return self.snapshots[-1]


def optimisation_trajectory(env, policy, theta0, steps: int, lr: float, reference: str, enum_limit: int,
                            mc_samples: int, generator: torch.Generator) -> Trajectory:
    """Adam (beta 0.9/0.999) ascent on J from theta0 for ``steps`` steps, keeping every snapshot."""
    theta = theta0.detach().double().clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=lr)
    snaps, norms = [theta.detach().clone()], []
    for _ in range(steps):
        support = make_support(env, policy, theta.detach(), reference, enum_limit, mc_samples, generator)
        grad = policy_gradient(env, policy, theta.detach(), support)
        norms.append(float(grad.norm()))
        theta.grad = -grad
        opt.step()
        snaps.append(theta.detach().clone())
    return Trajectory(torch.stack(snaps), norms)


def check_value(kind: str, value: float, max_lag: int) -> None:
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
    elif kind == "temperature" and value <= 0:
        raise LabError(f"temperature must be positive, got {value}")


def kl_target_params(env, policy, theta_pi, target: float, generator: torch.Generator, reference: str,
                     enum_limit: int, mc_samples: int) -> torch.Tensor:
    """Perturb pi's logits along fixed noise z until the per-token KL(mu||pi) equals ``target``."""
    z = torch.randn(theta_pi.shape, generator=generator, dtype=torch.float64)
    if target == 0:
        return theta_pi.clone()
    # Common random numbers in MC mode: one generator state for every evaluation of the bisection.
    state = generator.get_state()

    def kl_at(scale):
        theta_mu = theta_pi + scale * z
        generator.set_state(state)
        support = make_support(env, policy, theta_mu, reference, enum_limit, mc_samples, generator)
        return divergence(policy, theta_pi, theta_mu, support)["kl_token"]

    lo, hi = 0.0, 1.0
    while kl_at(hi) < target:
        lo, hi = hi, hi * 2
        if hi > 2**12:
            raise LabError(f"KL target {target} is out of reach of logit perturbations; use a smaller value")
    scale = brentq(lambda s: kl_at(s) / target - 1.0, lo, hi, rtol=1e-10, xtol=1e-12 * hi, maxiter=200)
    return theta_pi + scale * z


def behaviour_params(kind: str, value: float, trajectory: Trajectory, env, policy, generator, reference: str,
                     enum_limit: int, mc_samples: int) -> torch.Tensor:
    """Parameters of mu for one staleness setting (float64)."""
    K = trajectory.snapshots.shape[0] - 1
    check_value(kind, value, K)
    pi = trajectory.current
    if kind == "lag":
        return trajectory.snapshots[K - int(value)].clone()
    if kind == "temperature":
        return pi / value
    return kl_target_params(env, policy, pi, value, generator, reference, enum_limit, mc_samples)
