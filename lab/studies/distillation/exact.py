"""Exact quantities of on-policy distillation by enumerating every response (float64): the per-token KL, the
sequence KL, the two gradient targets, an estimator's exact expectation, the student's top-k mass, and coordinates
that keep every inner product of a set of gradients.

    per-token   g_tok = grad_theta sum_y sg[pi_S(y)] sum_t m_t KL_t(theta)        (visitation held fixed)
    sequence    g_seq = grad_theta KL(pi_S(y) || pi_T(y)) = grad_theta E_{pi_S}[sum_t KL_t]   (adds the state term)

with KL_t = KL(pi_S(.|s_t) || pi_T(.|s_t)) (``lab.estimators.distillation``), averaged over prompts.
"""
from __future__ import annotations

import torch
from torch.func import vmap

from lab.engine.estimator import Estimator
from lab.engine.exact import Support
from lab.estimators.distillation import reverse_kl, topk_reverse_kl
from lab.policies import log_probs_of, sequence_log_probs, token_log_probs


def kl_per_token(policy, theta_s, theta_t, prompts, tokens) -> torch.Tensor:
    """KL_t = KL(pi_S(.|s_t) || pi_T(.|s_t)) at every position of every response: [..., T] (mask it)."""
    return reverse_kl(policy.logits(theta_s, prompts, tokens), policy.logits(theta_t, prompts, tokens))


def sequence_kl(policy, theta_s, theta_t, support: Support) -> float:
    """KL(pi_S(y|x) || pi_T(y|x)) averaged over prompts, with ``support`` the student's exact distribution."""
    with torch.no_grad():
        ls = sequence_log_probs(policy, theta_s.double(), support.prompts, support.tokens, support.mask)
        lt = sequence_log_probs(policy, theta_t.double(), support.prompts, support.tokens, support.mask)
    return float((support.weights * (ls - lt)).sum())


def per_token_target(policy, theta_s, theta_t, support: Support) -> torch.Tensor:
    """(a) grad_theta sum_y sg[w(y)] sum_t m_t KL_t(theta): the visitation weights w held fixed. Float64, flat."""
    theta = theta_s.detach().double().requires_grad_(True)
    kl = kl_per_token(policy, theta, theta_t.detach().double(), support.prompts, support.tokens)
    objective = (support.weights.detach() * (kl * support.mask).sum(-1)).sum()
    (g,) = torch.autograd.grad(objective, theta)
    return g.reshape(-1)


def sequence_target(policy, theta_s, theta_t, support: Support) -> torch.Tensor:
    """(b) grad_theta KL(pi_S(y) || pi_T(y)) = grad sum_y pi_S(y) (log pi_S(y) - log pi_T(y)) / P, differentiating
    the probabilities too (the state-distribution term included). ``support`` only supplies the responses."""
    theta = theta_s.detach().double().requires_grad_(True)
    ls = sequence_log_probs(policy, theta, support.prompts, support.tokens, support.mask)
    with torch.no_grad():
        lt = sequence_log_probs(policy, theta_t.double(), support.prompts, support.tokens, support.mask)
    n_prompts = int(support.prompts.max()) + 1 if support.prompts.numel() else 1
    objective = (torch.exp(ls) * (ls - lt)).sum() / n_prompts
    (g,) = torch.autograd.grad(objective, theta)
    return g.reshape(-1)


def expected_estimate(policy, theta_s, theta_t, support_mu: Support, est: Estimator, theta_mu=None) -> torch.Tensor:
    """E_mu[-grad loss] of the resolved estimator ``est`` for one response per batch, exactly (float64, flat).

    Every response of ``support_mu`` (mu's exact distribution) is its own batch of one; the per-response losses
    (vmap over responses) are weighted by mu(y) and differentiated once. For fixed-length responses every
    aggregation mode averages per-response terms, so this is also the mean of the B-response batch estimate.
    ``theta_mu`` gives the behaviour log-probs passed as ``old_log_prob`` (default: the student's own).
    """
    s = support_mu
    theta = theta_s.detach().double().requires_grad_(True)
    prompts, tokens, mask = s.prompts[:, None], s.tokens[:, None], s.mask[:, None]
    logits = policy.logits(theta, prompts, tokens)
    log_prob = log_probs_of(logits, tokens) * mask
    with torch.no_grad():
        t_logits = policy.logits(theta_t.detach().double(), prompts, tokens)
        old = (log_prob.detach() if theta_mu is None
               else token_log_probs(policy, theta_mu.double(), prompts, tokens) * mask)
    extras = {"teacher_log_prob": log_probs_of(t_logits, tokens) * mask, "logits": logits, "teacher_logits": t_logits}
    wanted = set(est.info.inputs) | set(est.info.optional_inputs)
    named = {k: v for k, v in extras.items() if k in wanted}

    def one(lp, old_lp, m, kw):
        return est.loss_on_log_probs(lp, old_lp, torch.zeros_like(lp), m, **kw)[0]

    losses = vmap(one)(log_prob, old, mask, named)
    (g,) = torch.autograd.grad((s.weights * losses).sum(), theta)
    return -g.reshape(-1)


def topk_mass(policy, theta_s, support: Support, k: int) -> float:
    """E over the student's visited states (per real token) of the student's probability mass in its top-k."""
    with torch.no_grad():
        logits = policy.logits(theta_s.double(), support.prompts, support.tokens)
        _, mass = topk_reverse_kl(logits, logits, k)
    per_seq = (mass * support.mask).sum(-1)
    return float((support.weights * per_seq).sum() / (support.weights * support.mask.sum(-1)).sum())


def isometric_coordinates(grads: torch.Tensor, *targets: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Coordinates [M, r] and [r] with the same inner products as ``grads`` [M, D] and each target [D] (float64)."""
    X = torch.cat([grads.double(), torch.stack([t.double() for t in targets])])
    gram = X @ X.T
    evals, evecs = torch.linalg.eigh(gram)
    keep = evals > evals.max().clamp(min=1e-300) * 1e-13
    Y = evecs[:, keep] * evals[keep].sqrt()
    M = grads.shape[0]
    return Y[:M], [Y[M + i] for i in range(len(targets))]
