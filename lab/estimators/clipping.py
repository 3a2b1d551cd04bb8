"""PPO / GRPO token clipping (Schulman et al. 2017; Shao et al. 2024), with an optional dual clip.

loss_t = max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high)); eps = 0.2 (DAPO raises eps_high to 0.28).
Dual clip (Ye et al. 2020; verl's compute_policy_loss_vanilla applies it to A < 0, always, with c = 3.0):
loss_t = min(loss_t, -A c); off here by default (clip_ratio_c=None), as in TRL's GRPO loss.
The log-ratio is clamped to [-20, 20] before exponentiating, as in verl (TRL does not clamp it).
"""
from __future__ import annotations

from lab.lazy import torch

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.policy_gradient import token_log_ratio
from lab.estimators.registry import register


def ppo_clip_coefficient(ratio, advantage, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None):
    """Effective coefficient on A grad log pi(y_t|s_t): rho_t where the gradient passes, 0 where clipped."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    advantage = torch.as_tensor(advantage, dtype=torch.float64)
    passes = torch.where(advantage >= 0, ratio < 1 + clip_ratio_high, ratio > 1 - clip_ratio_low)
    if clip_ratio_c is not None:
        passes = passes & ~((advantage < 0) & (ratio > clip_ratio_c))
    return torch.where(passes, ratio, torch.zeros_like(ratio))


PPO_DOMAINS = {"clip_ratio_low": "nonnegative", "clip_ratio_high": "nonnegative", "clip_ratio_c": "> 1 or None"}


@register("ppo_clip", label="PPO clip", unbiased="on-policy",
          paper="PPO (Schulman et al. 2017, arXiv 1707.06347); GRPO (Shao et al. 2024, arXiv 2402.03300)",
          family="clipping",
          source="PPO (Schulman et al. 2017) / GRPO (Shao et al. 2024); verl compute_policy_loss_vanilla",
          unbiased_for="biased off-policy: token ratios, clipped gradients", coefficient=ppo_clip_coefficient,
          domains=PPO_DOMAINS,
          differences="dual clip off by default (clip_ratio_c=None): verl's vanilla loss always applies it, with "
                      "clip_ratio_c = 3.0 (> 1 required); TRL's GRPO loss never does")
def ppo_clip(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean",
             clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=None):
    """PPO clip: loss_t = max(-A rho_t, -A clip(rho_t, 1-eps_low, 1+eps_high)); dual clip min(., -A c) for A < 0."""
    ratio = torch.exp(token_log_ratio(log_prob, old_log_prob))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped)
    metrics = {"clipfrac": masked_mean((clipped > unclipped).float(), response_mask).detach(),
               "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}
    if clip_ratio_c is not None:
        dual = -advantages * clip_ratio_c
        metrics["clipfrac_lower"] = masked_mean(((loss_mat > dual) & (advantages < 0)).float(), response_mask).detach()
        loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, dual), loss_mat)
    return agg_loss(loss_mat, response_mask, loss_agg_mode), metrics
