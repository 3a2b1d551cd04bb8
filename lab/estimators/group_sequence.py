"""Sequence ratios rescaled: LUSPO (GSPO's loss times the sequence's length) and GEPO (a sequence ratio whose
denominator is the group's expectation instead of the sequence's own sampler probability).

LUSPO ("Length-Unbiased Sequence Policy Optimization", arXiv 2602.05261; TRL 1.16.0 ``trl/trainer/grpo_trainer.py``
loss_type "luspo"): GSPO's sequence ratio s_i = exp(mean_t log(pi/mu)) and PPO clip, each sequence's loss summed over
its tokens and averaged over sequences ((per_token_loss * mask).sum(-1).mean() in TRL): seq-mean-token-sum of
GSPO's per-token loss. GSPO's mean over tokens shrinks a long sequence's update by 1/|y|; LUSPO undoes it. TRL's
paper index sets epsilon 2e-3 / 2.5e-3 (the paper's section 5.1).

GEPO (Zhang et al. 2025, "Group Expectation Policy Optimization for Heterogeneous Reinforcement Learning", arXiv
2508.17850; authors' code yelurebajrang/HeteroRL_GEPO ``src/open-r1/online_rl.py`` loss_type "gepo", 97000a8): with
p_i = exp(mean_t log pi(y_it)) and q_i = exp(mean_t log mu(y_it)) (geometric-mean token probabilities), the weight is
w_i = p_i / E_q[q] with E_q[q] = sum_j q_j^2 / sum_j q_j over the group; loss_i = -min(w_i A_i, clip(w_i, 1 - eps,
1 + eps) A_i), averaged over sequences. The group expectation in the denominator is shared by the group, so one
sequence's tiny q cannot blow its weight up (the paper's variance argument); but w_i is not 1 at mu = pi.
"""
from __future__ import annotations

from lab.lazy import torch

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.clipping import ppo_clip_coefficient
from lab.estimators.policy_gradient import LOG_RATIO_BOUND
from lab.estimators.registry import register
from lab.estimators.sequence_ratio import sequence_clip_loss
from lab.estimators.truncation import _seq_mean


def luspo_coefficient(ratio, advantage, clip_ratio_low=2e-3, clip_ratio_high=2.5e-3, **_):
    """Effective coefficient on A grad log pi(y_t) as a function of s_i: s_i where PPO's clip passes the gradient."""
    return ppo_clip_coefficient(ratio, advantage, clip_ratio_low, clip_ratio_high)


def gepo_coefficient(ratio, advantage, clip_ratio_low=0.2, clip_ratio_high=0.2, **_):
    """Effective coefficient on A grad log pi(y_t) / |y| as a function of GEPO's weight w_i = p_i / E_q[q]: w_i where
    PPO's clip passes the gradient."""
    return ppo_clip_coefficient(ratio, advantage, clip_ratio_low, clip_ratio_high)


@register("luspo", label="LUSPO", paper="LUSPO, 'Length-Unbiased Sequence Policy Optimization' (arXiv 2602.05261)",
          unbiased="on-policy", family="sequence-ratio",
          source="TRL 1.16.0 trl/trainer/grpo_trainer.py _compute_loss (loss_type='luspo', importance_sampling_level="
                 "'sequence'); epsilon 2e-3 / epsilon_high 2.5e-3 from TRL's paper index (docs/source/paper_index.md)",
          unbiased_for="biased off-policy: the length-normalised ratio with PPO's clip (2e-3, 2.5e-3); exactly "
                       "REINFORCE on-policy, and unbiased for grad J there because it sums over tokens",
          coefficient=luspo_coefficient, ratio="geometric",
          domains={"clip_ratio_low": "nonnegative", "clip_ratio_high": "nonnegative"},
          differences="log s is clamped at 20 (TRL does not clamp; they differ only for a geometric-mean ratio above "
                      "e^20)")
def luspo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-sum", clip_ratio_low=2e-3,
          clip_ratio_high=2.5e-3):
    """LUSPO: GSPO's sequence ratio and clip (2e-3, 2.5e-3), each sequence's loss times its length (seq-mean-token-sum).

    Source: TRL 1.16.0 loss_type="luspo": (per_token_loss * mask).sum(-1).mean().
    """
    return sequence_clip_loss(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode, clip_ratio_low,
                              clip_ratio_high, LOG_RATIO_BOUND)


def gepo_weights(log_prob, old_log_prob, response_mask, group_size: int):
    """GEPO's log coefficient per sequence [..., B, 1]: log p_i - log E_q[q], p_i = exp(mean_t log pi), q_i = exp(mean_t
    log mu), E_q[q] = sum_j q_j^2 / sum_j q_j over the group's non-empty responses (detached)."""
    length = response_mask.sum(-1, keepdim=True)
    zero = torch.zeros((), dtype=log_prob.dtype)
    log_p = torch.where(response_mask > 0, log_prob, zero).sum(-1, keepdim=True) / length.clamp(min=1.0)
    log_q = (torch.where(response_mask > 0, old_log_prob, zero).sum(-1, keepdim=True) / length.clamp(min=1.0)).detach()
    present = length > 0
    neg_inf = torch.full_like(log_q, float("-inf"))
    groups = log_q.shape[-2] // group_size
    lq = torch.where(present, log_q, neg_inf).reshape(*log_q.shape[:-2], groups, group_size)
    log_e = torch.logsumexp(2 * lq, -1, keepdim=True) - torch.logsumexp(lq, -1, keepdim=True)
    log_e = torch.where(torch.isfinite(log_e), log_e, torch.zeros_like(log_e))  # a group without tokens: no weight
    log_e = log_e.expand(*lq.shape).reshape(log_q.shape)
    return torch.clamp(log_p - log_e, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)


@register("gepo", label="GEPO", paper="GEPO, 'Group Expectation Policy Optimization' (arXiv 2508.17850)",
          unbiased="never", family="sequence-ratio",
          source="GEPO (arXiv 2508.17850); authors' code yelurebajrang/HeteroRL_GEPO src/open-r1/online_rl.py "
                 "(loss_type 'gepo', 97000a8); TRL's epsilon 0.2 / 0.2",
          unbiased_for="biased, also on-policy: the weight p_i / E_q[q] is not 1 at mu = pi (it favours sequences "
                       "likelier than the group's q-weighted mean) and is clipped",
          coefficient=gepo_coefficient, inputs=("group_size",), ratio="geometric",
          domains={"clip_ratio_low": "nonnegative", "clip_ratio_high": "nonnegative"},
          differences="the group expectation runs over each prompt's group of responses (the paper's definition); the "
                      "authors' code takes it over the micro-batch; responses without tokens are left out of it (the "
                      "code counts them with q = 1) and give no loss; log p_i - log E is clamped to [-20, 20]")
def gepo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.2,
         clip_ratio_high=0.2, *, group_size):
    """GEPO: loss_i = -min(w_i A_i, clip(w_i, 0.8, 1.2) A_i), w_i = p_i / (sum_j q_j^2 / sum_j q_j) over the group.

    p_i, q_i: geometric-mean token probabilities under pi and mu. Source: GEPO (arXiv 2508.17850), the authors' code.
    """
    from lab.estimators.gvpo import check_groups

    k = check_groups(log_prob.shape[-2], group_size, "GEPO", "its weight is a group expectation")
    coef = torch.exp(gepo_weights(log_prob, old_log_prob, response_mask, k))  # [..., B, 1], p_i in the graph
    length = response_mask.sum(-1, keepdim=True).clamp(min=1.0)
    adv_seq = (advantages * response_mask).sum(-1, keepdim=True) / length
    unclipped = -adv_seq * coef
    clipped = -adv_seq * torch.clamp(coef, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped).expand_as(log_prob)
    return agg_loss(loss_mat, response_mask, loss_agg_mode), {
        "clipfrac": _seq_mean((clipped > unclipped).to(coef.dtype), response_mask).detach(),
        "gepo_weight_mean": _seq_mean(coef, response_mask).detach(),
        "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}
