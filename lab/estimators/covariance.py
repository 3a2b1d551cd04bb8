"""Covariance-selected token updates (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv 2505.22617): Clip-Cov and KL-Cov, as verl 0.9.1 and SkyRL 0.4.0 ship them.

Both rank the batch's tokens by cov_t = (A_t - mean A) (log pi_t - mean log pi) (means over the batch's real tokens,
log pi detached in the mean): the tokens whose probability and advantage move together drive the entropy collapse.

- Clip-Cov (verl ``compute_policy_loss_clip_cov``; SkyRL ``compute_policy_loss_clip_cov``): PPO's clipped loss
  (eps 0.2 / 0.2, no dual clip), and among the tokens PPO did not clip whose cov lies in (1, 5), a random
  floor(0.0002 n) of them (at least one) lose their gradient entirely. The random choice here follows
  ``selection_keys`` (uniform numbers: the tokens with the smallest keys are chosen, as a uniformly random subset
  is); without them the first candidates in row-major order are chosen. verl and SkyRL draw torch.randperm from the
  global generator.
- KL-Cov (verl ``compute_policy_loss_kl_cov``): token IS without clipping, -A rho, and on the floor(0.0002 n) tokens
  (at least one) of largest cov a penalty ppo_kl_coef |log rho| (0.1: verl's PolicyLossConfig default; the
  function's own fallback 1.0 applies only without a config). SkyRL's ``kl_cov`` (``KLCovConfig``) takes a
  FRACTION kl_cov_frac = 0.2 (1000 times verl's ratio) and coefficient 1.0, and because SkyRL normalises by scaling
  the advantages and then sums the per-token loss, its penalty is summed over the selected tokens rather than
  averaged: ``kl_cov_skyrl``.

Sources: verl 0.9.1 ``verl/trainer/ppo/core_algos.py``, ``verl/workers/config/actor.py`` (PolicyLossConfig);
SkyRL 0.4.0 ``skyrl/backends/skyrl_train/utils/ppo_utils.py`` (7fee019), ``skyrl/train/config/config.py``.
"""
from __future__ import annotations

from lab.lazy import torch

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.policy_gradient import token_log_ratio
from lab.estimators.registry import register

VERL_EPS = 1e-8


def _flat(x):
    return x.reshape(*x.shape[:-2], -1)


def covariance(advantages, log_prob, mask, eps: float = 0.0):
    """(A - mean A)(log pi - mean log pi) per token, means over the real tokens (denominator n + eps)."""
    real = mask > 0
    zero = torch.zeros((), dtype=log_prob.dtype)
    n = mask.sum((-2, -1), keepdim=True)
    den = n + eps if eps else n.clamp(min=1.0)
    mean_a = torch.where(real, advantages, zero).sum((-2, -1), keepdim=True) / den
    mean_lp = torch.where(real, log_prob.detach(), zero).sum((-2, -1), keepdim=True) / den
    return (advantages - mean_a) * (log_prob.detach() - mean_lp)


def first_k(candidates, keys, k):
    """A [B, T] bool selecting, among ``candidates``, the ``k`` (a 0-dim tensor) with the smallest ``keys`` (ties: row-
    major order). Sorting only, so it runs under vmap."""
    values = torch.where(_flat(candidates), _flat(keys), torch.full_like(_flat(keys), float("inf")))
    _, order = torch.sort(values, stable=True)
    rank = torch.argsort(order).reshape(candidates.shape)
    return candidates & (rank < k)


def _count(mask, fraction):
    """max(floor(fraction n), 1) with n the batch's real tokens, as a 0-dim tensor."""
    return torch.clamp(torch.floor(fraction * mask.sum((-2, -1))), min=1.0)


def _kl_cov(log_prob, old_log_prob, advantages, response_mask, kl_cov_ratio):
    """(rho, |log rho|, the selected tokens) of KL-Cov."""
    log_ratio = token_log_ratio(log_prob, old_log_prob)
    cov = covariance(advantages, log_prob, response_mask)
    real = response_mask > 0
    order = torch.where(real, -cov, torch.full_like(cov, float("inf")))  # largest covariance first
    chosen = first_k(real, order, _count(response_mask, kl_cov_ratio))
    return torch.exp(log_ratio), log_ratio.abs(), chosen


def clip_cov_coefficient(ratio, advantage, clip_ratio_low=0.2, clip_ratio_high=0.2, **_):
    """Effective coefficient on A grad log pi for a token not chosen by the covariance rule: PPO's (rho where the
    clip passes the gradient); a chosen token's is 0."""
    from lab.estimators.clipping import ppo_clip_coefficient

    return ppo_clip_coefficient(ratio, advantage, clip_ratio_low, clip_ratio_high)


def kl_cov_coefficient(ratio, advantage=None, **_):
    """Effective coefficient on A grad log pi: rho (token IS); a chosen token also gets -coef sign(log rho) grad log pi,
    which does not scale with A."""
    return torch.as_tensor(ratio, dtype=torch.float64)


@register("clip_cov", label="Clip-Cov", paper="Cui et al. 2025, 'The Entropy Mechanism of RL for Reasoning LMs' "
          "(arXiv 2505.22617)", unbiased="never", family="covariance",
          source="verl 0.9.1 verl/trainer/ppo/core_algos.py compute_policy_loss_clip_cov; PolicyLossConfig "
                 "clip_cov_ratio / clip_cov_lb / clip_cov_ub; SkyRL 0.4.0 compute_policy_loss_clip_cov (same defaults)",
          unbiased_for="biased, also on-policy: drops the gradient of covariance-selected tokens; off-policy also "
                       "token ratios with PPO clipping",
          coefficient=clip_cov_coefficient, optional_inputs=("selection_keys",), homogeneous=False,
          domains={"clip_ratio_low": "nonnegative", "clip_ratio_high": "nonnegative", "clip_cov_ratio": "positive",
                   "clip_cov_lb": "finite", "clip_cov_ub": "finite"},
          differences="the log-ratio is clamped to [-20, 20] (verl's clip_cov does not clamp); the random subset "
                      "follows selection_keys instead of torch.randperm on the global generator")
def clip_cov(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", clip_ratio_low=0.2,
             clip_ratio_high=0.2, clip_cov_ratio=0.0002, clip_cov_lb=1.0, clip_cov_ub=5.0, *, selection_keys=None):
    """Clip-Cov: PPO clip, and a random floor(0.0002 n) of the unclipped tokens with cov in (1, 5) get no gradient.

    Source: verl 0.9.1 compute_policy_loss_clip_cov (adapted from PRIME-RL/Entropy-Mechanism-of-RL).
    """
    ratio = torch.exp(token_log_ratio(log_prob, old_log_prob))
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    real = response_mask > 0
    by_origin = (clipped_loss > unclipped) & real
    cov = covariance(advantages, log_prob, response_mask, eps=VERL_EPS)
    candidates = real & ~by_origin & (cov > clip_cov_lb) & (cov < clip_cov_ub)
    keys = torch.zeros_like(log_prob) if selection_keys is None else selection_keys
    chosen = first_k(candidates, keys.detach(), _count(response_mask, clip_cov_ratio))
    corr = (~chosen).to(log_prob.dtype)
    loss = agg_loss(torch.maximum(unclipped, clipped_loss) * corr, response_mask, loss_agg_mode)
    return loss, {"clipfrac": masked_mean(1 - corr, response_mask).detach(),
                  "ppo_clipfrac": masked_mean(by_origin.to(ratio.dtype), response_mask).detach(),
                  "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}


@register("kl_cov", label="KL-Cov", paper="Cui et al. 2025, 'The Entropy Mechanism of RL for Reasoning LMs' "
          "(arXiv 2505.22617)", unbiased="on-policy", family="covariance",
          source="verl 0.9.1 verl/trainer/ppo/core_algos.py compute_policy_loss_kl_cov; PolicyLossConfig kl_cov_ratio "
                 "0.0002, ppo_kl_coef 0.1 (verl/workers/config/actor.py)",
          unbiased_for="biased off-policy: token ratios (no prefix weight, no clip) and a |log rho| penalty on the "
                       "tokens of largest covariance; exactly REINFORCE on-policy (the penalty's gradient is 0 at "
                       "rho = 1)",
          coefficient=kl_cov_coefficient, homogeneous=False,
          domains={"kl_cov_ratio": "positive", "ppo_kl_coef": "nonnegative"},
          differences="the log-ratio is clamped to [-20, 20] (verl's kl_cov does not clamp); ties in the covariance "
                      "are broken in row-major order (torch.topk's order is unspecified)")
def kl_cov(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", kl_cov_ratio=0.0002,
           ppo_kl_coef=0.1):
    """KL-Cov: loss_t = -A rho_t, plus 0.1 |log rho_t| on the floor(0.0002 n) tokens of largest covariance.

    Source: verl 0.9.1 compute_policy_loss_kl_cov.
    """
    ratio, abs_kl, chosen = _kl_cov(log_prob, old_log_prob, advantages, response_mask, kl_cov_ratio)
    loss_mat = -advantages * ratio + ppo_kl_coef * abs_kl * chosen.to(ratio.dtype)
    return agg_loss(loss_mat, response_mask, loss_agg_mode), {
        "kl_cov_frac": masked_mean(chosen.to(ratio.dtype), response_mask).detach(),
        "ppo_kl": masked_mean(abs_kl, response_mask).detach()}


@register("kl_cov_skyrl", label="KL-Cov (SkyRL)", paper="Cui et al. 2025, 'The Entropy Mechanism of RL for "
          "Reasoning LMs' (arXiv 2505.22617)", unbiased="on-policy", family="covariance",
          source="SkyRL 0.4.0 skyrl/backends/skyrl_train/utils/ppo_utils.py compute_policy_loss_kl_cov and reduce_loss "
                 "(7fee019); KLCovConfig kl_cov_frac 0.2, ppo_kl_coef 1.0 (skyrl/train/config/config.py)",
          unbiased_for="biased off-policy: token ratios (no clip) and a summed |log rho| penalty on the 20 % of tokens "
                       "of largest covariance; exactly REINFORCE on-policy",
          coefficient=kl_cov_coefficient, homogeneous=False,
          domains={"kl_cov_frac": "positive", "ppo_kl_coef": "nonnegative"},
          differences="the log-ratio is clamped to [-20, 20]; SkyRL ranks the covariance of its length-normalised "
                      "advantages (the same order under token-mean)")
def kl_cov_skyrl(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", kl_cov_frac=0.2,
                 ppo_kl_coef=1.0):
    """KL-Cov (SkyRL): agg(-A rho) + 1.0 x sum of |log rho_t| over the 20 % of tokens of largest covariance.

    Source: SkyRL 0.4.0 compute_policy_loss_kl_cov (the penalty is summed, not averaged, by its reduce_loss).
    """
    ratio, abs_kl, chosen = _kl_cov(log_prob, old_log_prob, advantages, response_mask, kl_cov_frac)
    penalty = torch.where(chosen, abs_kl, torch.zeros((), dtype=ratio.dtype)).sum((-2, -1))
    return agg_loss(-advantages * ratio, response_mask, loss_agg_mode) + ppo_kl_coef * penalty, {
        "kl_cov_frac": masked_mean(chosen.to(ratio.dtype), response_mask).detach(),
        "ppo_kl": masked_mean(abs_kl, response_mask).detach()}
