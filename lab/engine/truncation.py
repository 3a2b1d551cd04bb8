"""The two truths of a truncating sampler, exact by enumeration, and what the kept mass predicts without replay.

A sampler with top-p / top-k / min-p (``lab.policies.truncation``) deploys q(y_t | s_t) = pi(y_t) 1[y_t in S_t] /
pi(S_t). Two gradients can be the target (float64, by enumeration):

- full:      grad J(pi) = sum_y pi(y) R(y) grad log pi(y)                    (``lab.engine.exact.policy_gradient``)
- deployed:  grad J(q)  = sum_y q(y) R(y) grad log q(y),  log q(y) = sum_t log pi(y_t) - log pi(S_t)
             with the kept sets S_t held fixed: the gradient almost everywhere (S_t is piecewise constant in theta).

A trainer without mask replay divides pi by the sampler's q: on the sampler's support every token ratio is
pi(y_t) / q(y_t) = pi(S_t) = m_t, the kept mass (``kept_mass``), and the sequence ratio W(y) = prod_t m_t. So
sequence IS without replay has the expectation

    E_q[W R grad log pi] = sum_{y in K} pi(y) R(y) grad log pi(y)      (``kept_path_gradient``)

over the kept paths K (every token in its kept set): grad J(pi) less the paths the sampler never draws, and neither
truth. With replay the trainer scores log q, W = 1 on-policy and q(y)/q_mu(y) in general, and sequence IS is
exactly unbiased for the deployed gradient. No correction recovers the full gradient: tokens outside S_t are never
sampled (DeepSeek-V3.2's keep-sampling-mask; slime PR 2102; TRL PR 7269).
"""
from __future__ import annotations

import torch

from lab.engine.exact import chunks, exact_support, policy_gradient
from lab.engine.gradients import replayed_pullback
from lab.policies import Truncated, masked


def sampler_kept_sets(sampler, theta, prompts, tokens) -> torch.Tensor:
    """The sampler's kept set at every position of the given responses, as it records them: [N, T, V] bool."""
    with torch.no_grad():
        return torch.cat([torch.isfinite(sampler.logits(theta.double(), prompts[c], tokens[c])).cpu()
                          for c in chunks(sampler, prompts.shape[0], tokens.shape[1])])


def kept_mass(policy, theta, prompts, tokens, kept) -> torch.Tensor:
    """m_t = pi(S_t), the trainer's probability of the kept set at every position: [N, T] (float64)."""
    with torch.no_grad():
        logits = policy.logits(theta.double(), prompts, tokens)
        return torch.exp(torch.logsumexp(logits.masked_fill(~kept.to(logits.device), -torch.inf), -1)
                         - torch.logsumexp(logits, -1)).cpu()


def full_gradient(env, policy, theta, enum_limit: int) -> torch.Tensor:
    """grad J(pi), flat (float64)."""
    return policy_gradient(env, policy, theta, exact_support(env, policy, theta, enum_limit)).reshape(-1)


def deployed_gradient(env, sampler: Truncated, theta, enum_limit: int) -> torch.Tensor:
    """grad J(q) with the kept sets held fixed, q = ``sampler`` (pi truncated) at ``theta``: flat (float64)."""
    s = exact_support(env, sampler, theta, enum_limit)
    kept = sampler_kept_sets(sampler, theta, s.prompts, s.tokens)
    coef = (s.weights * env.expected_reward(s.prompts, s.tokens, s.mask))[:, None] * s.mask
    return replayed_pullback(sampler.base, theta, s.prompts, s.tokens, kept, coef).reshape(-1)


def kept_path_gradient(env, policy, theta, sampler: Truncated, enum_limit: int) -> torch.Tensor:
    """sum over the kept paths of pi(y) R(y) grad log pi(y): what sequence IS estimates without mask replay when the
    sampler is pi's own, truncated (module docstring). Computed from pi alone: pi's support, kept paths selected
    by the sampler's kept sets."""
    s = exact_support(env, policy, theta, enum_limit)
    kept = sampler_kept_sets(sampler, theta, s.prompts, s.tokens)
    inside = masked(kept.gather(-1, s.tokens[..., None]).squeeze(-1).double(), s.mask)
    on_path = (inside == s.mask).all(-1)
    sub = type(s)(s.prompts[on_path], s.tokens[on_path], s.mask[on_path], s.weights[on_path], True)
    return policy_gradient(env, policy, theta, sub).reshape(-1)


def kept_mass_log_probs(policy, theta, prompts, tokens, mask, kept) -> torch.Tensor:
    """The sampler's log-probs as the kept mass predicts them: log q(y_t) = log pi(y_t) - log m_t, from pi's
    logits and the kept sets alone (masked, [N, T])."""
    with torch.no_grad():
        logits = policy.logits(theta.double(), prompts, tokens)
        lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None].to(logits.device)).squeeze(-1).cpu()
    return masked(lp - torch.log(kept_mass(policy, theta, prompts, tokens, kept)), mask)
