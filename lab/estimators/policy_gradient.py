"""REINFORCE and importance sampling: the unbiased references and the token-level shortcut.

delta_t = log pi(y_t|s_t) - log mu(y_t|s_t) is clamped to [-20, 20] before exponentiating, as verl's policy losses
do (core_algos.compute_policy_loss_vanilla); the sequence log-weight L = sum_t m_t delta_t (a plain sum of the
unclamped token log-ratios) is clamped to [-20, 20] once, as verl's rollout correction does
(rollout_corr_helper.SAFETY_BOUND). sg[.] is detach.
"""
from __future__ import annotations

from lab.lazy import torch

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.registry import register

LOG_RATIO_BOUND = 20.0


def token_log_ratio(log_prob, old_log_prob):
    return torch.clamp(log_prob - old_log_prob, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def sequence_log_weight(log_prob, old_log_prob, response_mask):
    """L = clamp(sum_t m_t (log pi - log mu), -20, 20), shape [B, 1] (broadcasts over tokens)."""
    delta = log_prob - old_log_prob
    L = torch.where(response_mask > 0, delta * response_mask, torch.zeros((), dtype=delta.dtype)).sum(-1, keepdim=True)
    return torch.clamp(L, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


def unit_coefficient(ratio, advantage=None):
    return torch.ones_like(torch.as_tensor(ratio, dtype=torch.float64))


def identity_coefficient(ratio, advantage=None):
    return torch.as_tensor(ratio, dtype=torch.float64)


@register("reinforce", label="REINFORCE", paper="REINFORCE (Williams 1992)", unbiased="on-policy",
          family="on-policy",
          source="Williams 1992; REINFORCE without correction; verl compute_policy_loss_reinforce (no IS weights)",
          unbiased_for="grad J on-policy only (mu = pi); ignores staleness", coefficient=unit_coefficient)
def reinforce(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean"):
    """REINFORCE, no correction: loss_t = -A log pi(y_t|s_t); grad = A grad log pi(y)."""
    loss = agg_loss(-advantages * log_prob, response_mask, loss_agg_mode)
    return loss, {"ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}


@register("seq_is", label="Seq IS", paper="Sequence-level importance sampling (Precup et al. 2000)", unbiased="always",
          family="importance-sampling",
          source="sequence-level IS (Precup et al. 2000); verl rollout correction rollout_is='sequence' in bypass "
                 "mode with loss_type='reinforce'",
          unbiased_for="grad J at any staleness (up to the |L| <= 20 clamp)", coefficient=identity_coefficient,
          ratio="sequence",
          differences="no truncation: verl's rollout correction always applies rollout_is_threshold (default 2.0, "
                      "which is tis_seq); seq_is is that threshold set to infinity")
def seq_is(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean"):
    """Sequence IS: loss_t = -sg[W] A log pi(y_t|s_t), W = exp(L) = pi(y)/mu(y); grad = W A grad log pi(y)."""
    L = sequence_log_weight(log_prob, old_log_prob, response_mask)
    weight = torch.exp(L).detach()
    loss = agg_loss(-weight * advantages * log_prob, response_mask, loss_agg_mode)
    return loss, {"seq_weight_mean": weight.mean(), "seq_weight_max": weight.max(),
                  "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}


@register("token_is", label="Token IS", unbiased="on-policy",
          paper="PPO surrogate without clipping (Schulman et al. 2017, arXiv 1707.06347)",
          family="importance-sampling", source="PPO surrogate without clipping (Schulman et al. 2017)",
          unbiased_for="biased for sequences: ignores the prefix ratio", coefficient=identity_coefficient)
def token_is(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean"):
    """Token IS: loss_t = -A rho_t, rho_t = pi(y_t|s_t)/mu(y_t|s_t); grad = sum_t rho_t A grad log pi(y_t|s_t)."""
    ratio = torch.exp(token_log_ratio(log_prob, old_log_prob))
    loss = agg_loss(-advantages * ratio, response_mask, loss_agg_mode)
    return loss, {"ratio_mean": masked_mean(ratio, response_mask).detach(),
                  "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}
