"""Policies: tabular softmax policies (prefix tree, Markov) and the functions every policy shares."""
from __future__ import annotations

import torch

from lab.errors import LabError
from lab.policies.tabular import POLICIES, MarkovPolicy, PrefixTreePolicy

__all__ = ["POLICIES", "MarkovPolicy", "PrefixTreePolicy", "make_policy", "init_params", "token_log_probs",
           "sequence_log_probs", "sample"]


def make_policy(kind: str, env):
    """The tabular policy ``kind`` ('prefix' or 'markov') sized for ``env``."""
    if kind not in POLICIES:
        raise LabError(f"unknown policy {kind!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[kind](env.n_prompts, env.vocab_size, env.length)


def init_params(policy, scale: float, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """Random logits ~ N(0, scale^2)."""
    return scale * torch.randn(policy.shape, generator=generator, dtype=dtype)


def token_log_probs(policy, theta, prompts, tokens) -> torch.Tensor:
    """log pi(y_t | x, y_<t) for every position: [..., T] (padding positions included; mask them)."""
    logp = torch.log_softmax(policy.logits(theta, prompts, tokens), dim=-1)
    return logp.gather(-1, tokens[..., None]).squeeze(-1)


def sequence_log_probs(policy, theta, prompts, tokens, mask) -> torch.Tensor:
    """log pi(y | x) = sum_t m_t log pi(y_t | s_t): [...]."""
    return (token_log_probs(policy, theta, prompts, tokens) * mask).sum(-1)


@torch.no_grad()
def sample(policy, theta, env, prompts: torch.Tensor, generator: torch.Generator):
    """Draw one response per prompt. Returns tokens [B, T] (long), mask [B, T], token log-probs [B, T]."""
    B, T = prompts.shape[0], env.length
    tokens = torch.zeros(B, T, dtype=torch.long)
    for t in range(T):  # autoregressive: position t needs the tokens before it (T is small)
        logits_t = policy.logits(theta, prompts, tokens)[:, t]
        tokens[:, t] = torch.multinomial(torch.softmax(logits_t.double(), -1), 1, generator=generator)[:, 0]
    mask = env.mask_of(tokens).to(theta.dtype)
    tokens = tokens * mask.long()  # after the end token: padding 0
    return tokens, mask, token_log_probs(policy, theta, prompts, tokens) * mask
