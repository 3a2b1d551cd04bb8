"""Exact objectives, gradients and divergences by enumeration (float64), or their Monte Carlo stand-ins.

A ``Support`` is a set of (prompt, response) pairs with weights such that sum_y w(y) f(y) = E[f]:
either every pair with w = p(y|x)/P (exact), or n samples with w = 1/n (Monte Carlo mode, for spaces too
large to enumerate). Every expectation in the lab is a weighted sum over a support, so both modes share code.

- J(theta) = E_x E_{y~pi}[R(x, y)]
- grad J = E_pi[R grad log pi(y)] = sum_y w_pi(y) R(y) grad log pi(y)   (score form, weights detached)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.errors import LabError
from lab.policies import sample, sequence_log_probs


@dataclass
class Support:
    prompts: torch.Tensor  # [N]
    tokens: torch.Tensor  # [N, T]
    mask: torch.Tensor  # [N, T] float64
    weights: torch.Tensor  # [N] float64, summing to 1
    exact: bool


def exact_support(env, policy, theta, enum_limit: int) -> Support:
    prompts, tokens, mask = env.enumerate(enum_limit)
    with torch.no_grad():
        logp = sequence_log_probs(policy, theta.double(), prompts, tokens, mask)
    return Support(prompts, tokens, mask, torch.exp(logp) / env.n_prompts, True)


def mc_support(env, policy, theta, n: int, generator: torch.Generator) -> Support:
    prompts = torch.randint(env.n_prompts, (n,), generator=generator)
    tokens, mask, _ = sample(policy, theta.double(), env, prompts, generator)
    return Support(prompts, tokens, mask.double(), torch.full((n,), 1.0 / n, dtype=torch.float64), False)


def make_support(env, policy, theta, reference: str, enum_limit: int, mc_samples: int, generator) -> Support:
    """The distribution of ``theta`` over (prompt, response) pairs, exact or sampled."""
    if reference == "exact":
        return exact_support(env, policy, theta, enum_limit)
    if reference == "mc":
        return mc_support(env, policy, theta, mc_samples, generator)
    raise LabError(f"unknown reference {reference!r}; choose exact or mc")


def objective(env, support: Support) -> float:
    """J = sum_y w(y) E[R | x, y]."""
    return float((support.weights * env.expected_reward(support.prompts, support.tokens, support.mask)).sum())


def policy_gradient(env, policy, theta, support: Support) -> torch.Tensor:
    """grad J = sum_y w(y) R(y) grad log pi(y) in float64, where ``support`` is pi's own distribution."""
    theta = theta.detach().double().requires_grad_(True)
    reward = env.expected_reward(support.prompts, support.tokens, support.mask)
    logp = sequence_log_probs(policy, theta, support.prompts, support.tokens, support.mask)
    (grad,) = torch.autograd.grad((support.weights * reward * logp).sum(), theta)
    return grad


def divergence(policy, theta_pi, theta_mu, support_mu: Support) -> dict:
    """Exact (or MC) divergence of the behaviour mu from pi, with ``support_mu`` mu's distribution.

    kl_seq = KL(mu||pi) = E_mu[-L]; kl_token = kl_seq / E_mu[|y|] (per real token, by the chain rule);
    chi2_seq = E_mu[W^2] - 1; chi2_token = E_mu[sum_t m_t (sum_a pi_t(a)^2/mu_t(a) - 1)] / E_mu[|y|];
    logw_var = Var_mu(L), with L = log pi(y) - log mu(y) and W = exp(L).
    """
    s = support_mu
    with torch.no_grad():
        logits_pi = policy.logits(theta_pi.double(), s.prompts, s.tokens)
        logits_mu = policy.logits(theta_mu.double(), s.prompts, s.tokens)
        lp_pi, lp_mu = torch.log_softmax(logits_pi, -1), torch.log_softmax(logits_mu, -1)
        tok = s.tokens[..., None]
        L = ((lp_pi.gather(-1, tok) - lp_mu.gather(-1, tok)).squeeze(-1) * s.mask).sum(-1)
        chi2_t = (torch.exp(2 * lp_pi - lp_mu).sum(-1) - 1.0) * s.mask
        w = s.weights
        mean_len = float((w * s.mask.sum(-1)).sum())
        kl_seq = float((w * -L).sum())
        mean_L = float((w * L).sum())
        return {
            "kl_seq": kl_seq,
            "kl_token": kl_seq / mean_len,
            "chi2_seq": float((w * torch.exp(2 * L)).sum()) - 1.0,
            "chi2_token": float((w * chi2_t.sum(-1)).sum()) / mean_len,
            "logw_var": float((w * L**2).sum()) - mean_L**2,
            "mean_len": mean_len,
        }
