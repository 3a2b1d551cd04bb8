"""VCPO (Huang et al. 2026, "Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs", arXiv 2602.17616):
sequence-level importance sampling with an off-policy minimum-variance baseline and a step scaled by the effective
sample size. No code is released; this is the lab's restatement of the two mechanisms the paper names.

With W_i = pi(y_i)/mu(y_i) (log W clamped to [-20, 20]) and rewards R_i in groups of k responses to one prompt:

    baseline   b_i = sum_{j != i} W_j^2 R_j / sum_{j != i} W_j^2        (over the other responses of i's group)
    step       rho = (sum_i W_i)^2 / (B sum_i W_i^2)                     (Kish ESS fraction of the batch, detached)
    loss_t     = -rho sg[W_i (R_i - b_i)] log pi(y_it)

Why this baseline: the variance of W (R - b) grad log pi(y) over y ~ mu is minimised by
b* = E[W^2 ||g||^2 R] / E[W^2 ||g||^2] (g = grad log pi(y)); with ||g||^2 taken as constant across a group's
responses this is the W^2-weighted mean reward. On-policy (W = 1) it is the leave-one-out mean (RLOO). It is
computed over the OTHER responses so that it does not depend on y_i: E_mu[W_i b_i grad log pi(y_i)] =
E[b_i] E_pi[grad log pi] = 0, and the estimator without the step scale is unbiased for grad J at any staleness (up
to the clamp). The ESS scale shrinks the step when a few sequences carry the weight (rho -> 1/B) and equals 1
on-policy; because it depends on the batch it biases the estimate off-policy (``ess_scale=False`` removes it).
``advantages`` are not used (the advantage is the baseline-corrected reward above).
"""
from __future__ import annotations

from lab.lazy import torch

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.policy_gradient import sequence_log_weight
from lab.estimators.registry import register


def vcpo_advantages(rewards, log_weight, group_size: int):
    """W_i (R_i - b_i) per response [..., B]: b_i the leave-one-out W^2-weighted mean reward of i's group."""
    w2 = torch.exp(2 * log_weight)
    groups = rewards.shape[-1] // group_size
    r = rewards.reshape(*rewards.shape[:-1], groups, group_size)
    q = w2.reshape(*w2.shape[:-1], groups, group_size)
    others_w = q.sum(-1, keepdim=True) - q
    others_wr = (q * r).sum(-1, keepdim=True) - q * r
    baseline = others_wr / torch.where(others_w > 0, others_w, torch.ones_like(others_w))
    return (torch.exp(log_weight) * (rewards - baseline.reshape(rewards.shape))), baseline.reshape(rewards.shape)


def ess_fraction(log_weight, present):
    """(sum W)^2 / (n sum W^2) over the responses with tokens (``present``), computed stably in log space."""
    neg_inf = torch.full_like(log_weight, float("-inf"))
    lw = torch.where(present, log_weight, neg_inf)
    n = present.sum(-1).clamp(min=1).to(log_weight.dtype)
    log_ess = 2 * torch.logsumexp(lw, -1) - torch.logsumexp(2 * lw, -1) - torch.log(n)
    return torch.where(present.any(-1), torch.exp(log_ess), torch.ones_like(n))


def vcpo_coefficient(ratio, advantage=None, **_):
    """Effective coefficient on (R - b) grad log pi(y): W (times the batch's ESS fraction, 1 on-policy)."""
    return torch.as_tensor(ratio, dtype=torch.float64)


@register("vcpo", label="VCPO", paper="VCPO, 'Stable Asynchrony: Variance-Controlled Off-Policy RL for LLMs' (arXiv "
          "2602.17616)", unbiased="on-policy", family="baseline",
          source="VCPO (Huang et al. 2026, arXiv 2602.17616), restated: no code released",
          unbiased_for="biased off-policy through the batch's ESS step scale (without it, ess_scale=False: unbiased "
                       "for grad J at any staleness, the leave-one-out baseline being independent of the response it "
                       "corrects); exactly grad J on-policy",
          coefficient=vcpo_coefficient, inputs=("rewards", "group_size"), ratio="sequence",
          domains={"ess_scale": "bool"}, homogeneous=False,
          differences="a restatement of the paper's two mechanisms (no released code): the minimum-variance baseline "
                      "with the score norms taken as equal within a group, computed leave-one-out, and the ESS "
                      "fraction as the step scale; check them against the paper's equations before quoting numbers")
def vcpo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-sum", ess_scale=True, *,
         rewards, group_size):
    """VCPO: loss_t = -ESS/B sg[W_i (R_i - b_i)] log pi(y_it), b_i the others' W^2-weighted mean reward in the group.

    ``rewards`` [B], ``group_size`` k >= 2; ``advantages`` unused. Source: arXiv 2602.17616 (restated).
    """
    from lab.estimators.gvpo import check_groups

    k = check_groups(log_prob.shape[-2], group_size, "VCPO", "its baseline averages the other responses of a group")
    log_w = sequence_log_weight(log_prob, old_log_prob, response_mask).detach()[..., 0]  # [..., B]
    coef, baseline = vcpo_advantages(rewards.to(log_prob.dtype), log_w, k)
    present = response_mask.sum(-1) > 0
    scale = ess_fraction(log_w, present) if ess_scale else torch.ones((), dtype=log_prob.dtype)
    loss = agg_loss(-scale * coef.detach()[..., None] * log_prob, response_mask, loss_agg_mode)
    return loss, {"ess_frac": torch.as_tensor(scale, dtype=log_prob.dtype).detach(),
                  "baseline_mean": baseline.mean().detach(),
                  "seq_weight_max": torch.exp(log_w).max().detach(),
                  "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}
