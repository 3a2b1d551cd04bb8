"""The Batch record: what a trainer holds after a rollout, as tensors with leading dims [..., B], and
``draw_batches``, which draws M replicate batches from a behaviour policy.

Log-probs are per token [..., B, T] and already masked (0 on padding). ``behaviour_log_probs`` are the
sampler's (mu), the ones a trainer receives with the rollout; rewards are per sequence; every group of
``group_size`` consecutive responses shares one prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.errors import LabError
from lab.policies import sample
from lab.policies.truncation import sampler_kept


@dataclass
class Batch:
    prompts: torch.Tensor  # [..., B] long
    tokens: torch.Tensor  # [..., B, T] long
    mask: torch.Tensor  # [..., B, T] float, 1 on real tokens
    behaviour_log_probs: torch.Tensor  # [..., B, T] log mu(y_t | s_t), masked
    rewards: torch.Tensor  # [..., B] sampled rewards
    group_size: int
    kept: torch.Tensor | None = None  # [..., B, T, V] bool: a truncating sampler's kept set at every position

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        for name in ("behaviour_log_probs", "rewards"):
            value = getattr(self, name)
            if not torch.isfinite(value).all():
                raise LabError(f"batch field {name} contains NaN or infinite values; check the policy parameters "
                               f"and the sampler that produced them")
        if (self.behaviour_log_probs > 1e-6).any():
            raise LabError("batch field behaviour_log_probs has positive values; log-probabilities must be <= 0")
        B = self.prompts.shape[-1]
        if B % self.group_size:
            raise LabError(f"batch size {B} is not a multiple of the group size {self.group_size}")


def draw_batches(env, mu: tuple, M: int, B: int, G: int, generator: torch.Generator) -> Batch:
    """M replicate batches [M, B, ...] from mu = (policy, theta), sampled in float32; B/G prompts per batch drawn
    uniformly, G responses each. A truncating sampler (``lab.policies.truncation.Truncated``) records its kept set
    at every position (``Batch.kept``)."""
    policy, theta = mu
    prompts = torch.randint(env.n_prompts, (M, B // G), generator=generator).repeat_interleave(G, dim=-1)
    record = sampler_kept(policy) is not None
    tokens, mask, logp, *kept = sample(policy, theta, env, prompts.reshape(-1), generator, dtype=torch.float32,
                                       record_kept=record)
    rewards = env.sample_reward(prompts.reshape(-1), tokens, mask, generator).float()
    T = env.length
    return Batch(prompts, tokens.reshape(M, B, T), mask.reshape(M, B, T), logp.reshape(M, B, T),
                 rewards.reshape(M, B), G, kept[0].reshape(M, B, T, -1) if record else None)
