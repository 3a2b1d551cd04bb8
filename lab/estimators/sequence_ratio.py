"""Length-normalised sequence ratios: GSPO and GMPO (geometric means of the token ratios).

GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv 2507.18071; verl ``compute_policy_loss_gspo``):
    s_i = exp(L_i / |y_i|) = (pi(y_i)/mu(y_i))^(1/|y_i|), the geometric mean of the token ratios;
    per-token trick (GSPO-token): log s_it = log pi_t - sg[log pi_t] + sg[log s_i]  (value s_i, gradient on token t);
    loss_t = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high)), eps_low = 3e-4, eps_high = 4e-4 (GSPO paper v2
    section 5.1, TRL's paper index, verl's GSPO example); aggregated seq-mean-token-mean by default, the paper's
    sequence-level mean. verl's compute_policy_loss_gspo honours loss_agg_mode (its trainer passes the actor's
    loss_agg_mode, token-mean unless set; the GSPO examples set seq-mean-token-mean), and so does this function.
    With seq-mean-token-mean the gradient is exactly the paper's sequence-level GSPO gradient
    (1/B) sum_i s_i A_i (1/|y_i|) sum_t grad log pi(y_it) on unclipped sequences. As in verl, log s_it is clamped
    at 10 from above (a sequence whose geometric-mean ratio exceeds e^10 gets no gradient) and the token
    log-ratios are not clamped before averaging. TRL (importance_sampling_level="sequence", loss_type="grpo") forms
    the same s_i as a [B, 1] ratio, with the same value and gradient, but without the clamp at 10.

GMPO (Zhao et al. 2025, "Geometric-Mean Policy Optimization", arXiv 2507.20673; reference code callsys/GMPO
``train_zero_math_gmpo.py``, critic_type_modify="gmpo"; verl ``compute_policy_loss_geo_mean``):
    delta_t = log pi - log mu; sign-aware clip in log space: with sgn = sign(A),
    delta*_t = sgn * min(sgn delta_t, sgn clip(delta_t, -eps_low, eps_high)), i.e. for A > 0 only the upper side is
    clipped (delta* = min(delta, eps)), for A < 0 only the lower side (delta* = max(delta, -eps)), like PPO's clip
    but per token in log space; eps = 0.4 both sides (the reference scripts' CLIPRANGE=0.4);
    r_i = exp(mean_t delta*_t), loss_i = -A_i r_i (A_i the sequence's mean advantage over its tokens, as verl).
    The reference code runs one sequence per micro-batch and averages -A r over sequences; verl takes
    torch.mean over sequences. Here the sequence loss -A_i r_i is written on every token of sequence i and then
    aggregated with ``loss_agg_mode``: seq-mean-token-mean (the default) reproduces that mean over sequences
    exactly; the other modes weight the sequence as they weight any per-token loss. Per-token gradient (under
    seq-mean-token-sum): -A_i r_i 1[token t not clipped] grad log pi(y_it), so the coefficient is r_i on unclipped
    tokens. verl's compute_policy_loss_geo_mean ignores loss_agg_mode (always the mean over sequences, the lab's
    seq-mean-token-mean). Differences: the reference treats A = 0 as positive and verl uses sign(0) = 0; both give
    zero loss and gradient. The lab clamps delta_t to [-20, 20] before clipping (verl has that clamp commented out):
    with A < 0 the unbounded side would otherwise overflow exp. The clamp changes the loss and the gradient where a
    token's log-ratio lies on the unclipped side beyond 20 (delta_t < -20 with A > 0, delta_t > 20 with A < 0): that
    token gets no gradient and enters r_i as -20 (20) instead of delta_t.
"""
from __future__ import annotations

import math

from lab.lazy import torch

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.clipping import ppo_clip_coefficient
from lab.estimators.policy_gradient import LOG_RATIO_BOUND, token_log_ratio
from lab.estimators.registry import register
from lab.estimators.truncation import _seq_mean

GSPO_LOG_RATIO_MAX = 10.0  # verl clamps log s_it at 10


def gspo_coefficient(ratio, advantage, clip_ratio_low=3e-4, clip_ratio_high=4e-4, **_):
    """Effective coefficient on A grad log pi(y_t) as a function of the sequence ratio s_i (geometric mean):
    s_i where PPO's clip lets the gradient pass (and log s_i <= 10), else 0."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    coef = ppo_clip_coefficient(ratio, advantage, clip_ratio_low, clip_ratio_high)
    return torch.where(ratio <= math.exp(GSPO_LOG_RATIO_MAX), coef, torch.zeros_like(coef))


def gmpo_coefficient(ratio, advantage, clip_ratio_low=0.4, clip_ratio_high=0.4, seq_ratio=None, **_):
    """Effective coefficient on A grad log pi(y_t): r_i 1[token t not clipped], with ``ratio`` the token ratio
    rho_t. ``seq_ratio`` is the sequence's r_i = exp(mean_t delta*_t); by default a sequence whose tokens all have
    ratio rho_t, i.e. r_i = the sign-aware clipped rho_t (so the plotted curve is rho on the passing side, 0 past
    e^0.4 for A > 0 or below e^-0.4 for A < 0)."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    advantage = torch.as_tensor(advantage, dtype=torch.float64)
    log_r = torch.log(ratio)
    passes = torch.where(advantage > 0, log_r <= clip_ratio_high,
                         torch.where(advantage < 0, log_r >= -clip_ratio_low,
                                     torch.zeros_like(log_r, dtype=torch.bool)))
    passes = passes & (log_r.abs() <= LOG_RATIO_BOUND)
    if seq_ratio is None:
        seq_ratio = torch.where(advantage > 0, torch.clamp(ratio, max=math.exp(clip_ratio_high)),
                                torch.clamp(ratio, min=math.exp(-clip_ratio_low)))
    seq_ratio = torch.as_tensor(seq_ratio, dtype=torch.float64)
    return torch.where(passes, seq_ratio * torch.ones_like(ratio), torch.zeros_like(ratio))


@register("gspo", label="GSPO", paper="GSPO (Zheng et al. 2025, arXiv 2507.18071)", unbiased="on-policy",
          family="sequence-ratio",
          source="GSPO (Zheng et al. 2025, arXiv 2507.18071), GSPO-token trick; verl compute_policy_loss_gspo",
          unbiased_for="biased off-policy: the length-normalised ratio s = W^(1/|y|) is not an IS weight, and the "
                       "1 +/- (3e-4, 4e-4) clip removes most off-policy sequences; exactly REINFORCE on-policy under "
                       "the same aggregation",
          coefficient=gspo_coefficient, ratio="geometric",
          domains={"clip_ratio_low": "nonnegative", "clip_ratio_high": "nonnegative"},
          differences="none from verl; TRL's sequence-level ratio has no clamp of log s at 10 (they differ only for a "
                      "geometric-mean ratio above e^10)")
def gspo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
         clip_ratio_low=3e-4, clip_ratio_high=4e-4):
    """GSPO: loss_t = max(-A s_it, -A clip(s_it, 1-3e-4, 1+4e-4)), s_it = s_i = exp(L_i/|y_i|) by value, grad on t.

    Per-token trick: log s_it = log pi_t - sg[log pi_t] + sg[log s_i].

    Source: GSPO (Zheng et al. 2025, arXiv 2507.18071, section 5.1 clip range); verl compute_policy_loss_gspo.
    """
    return sequence_clip_loss(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode, clip_ratio_low,
                              clip_ratio_high, GSPO_LOG_RATIO_MAX)


def sequence_clip_loss(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode, clip_ratio_low,
                       clip_ratio_high, log_ratio_max):
    """PPO's clip on the GSPO-token ratio s_it (value s_i = exp(L_i/|y_i|), log s_it clamped at ``log_ratio_max``)."""
    length = response_mask.sum(-1, keepdim=True).clamp(min=1.0)
    zero = torch.zeros((), dtype=log_prob.dtype)
    delta = torch.where(response_mask > 0, (log_prob - old_log_prob) * response_mask, zero)
    log_s = (delta.sum(-1, keepdim=True) / length).detach()  # [B, 1]
    log_s_t = torch.clamp(log_prob - log_prob.detach() + log_s, max=log_ratio_max)
    s_t = torch.exp(log_s_t)
    unclipped = -advantages * s_t
    clipped = -advantages * torch.clamp(s_t, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = agg_loss(torch.maximum(unclipped, clipped), response_mask, loss_agg_mode)
    return loss, {"clipfrac": masked_mean((clipped > unclipped).to(s_t.dtype), response_mask).detach(),
                  "seq_ratio_mean": _seq_mean(torch.exp(torch.clamp(log_s, max=log_ratio_max)),
                                              response_mask).detach(),
                  "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}


@register("gmpo", label="GMPO", paper="GMPO (Zhao et al. 2025, arXiv 2507.20673)", unbiased="on-policy",
          family="sequence-ratio",
          source="GMPO (Zhao et al. 2025, arXiv 2507.20673); reference code callsys/GMPO; "
                 "verl compute_policy_loss_geo_mean",
          unbiased_for="biased off-policy: geometric-mean ratio of sign-aware log-clipped token ratios (eps = 0.4) is "
                       "not an IS weight; exactly REINFORCE on-policy under the same aggregation",
          coefficient=gmpo_coefficient,
          domains={"clip_ratio_low": "nonnegative", "clip_ratio_high": "nonnegative"},
          differences="token log-ratios clamped to [-20, 20] before the sign-aware clip (verl's geo_mean has the "
                      "clamp commented out): loss and gradient differ where a token log-ratio lies beyond 20 on the "
                      "unclipped side (below -20 with A > 0, above 20 with A < 0); honours loss_agg_mode, where verl "
                      "always takes the mean over sequences (the lab's seq-mean-token-mean, its default)")
def gmpo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
         clip_ratio_low=0.4, clip_ratio_high=0.4):
    """GMPO: loss_i = -A_i exp(mean_t delta*_t), delta*_t = sign-aware clip of log pi - log mu to [-0.4, 0.4].

    Source: GMPO (Zhao et al. 2025, arXiv 2507.20673); callsys/GMPO train_zero_math_gmpo.py; verl geo_mean loss.
    """
    delta = token_log_ratio(log_prob, old_log_prob)  # clamped to [-20, 20] (lab addition, see module docstring)
    sgn = torch.sign(advantages)
    delta_clamped = torch.clamp(delta, -clip_ratio_low, clip_ratio_high)
    delta_star = sgn * torch.minimum(sgn * delta, sgn * delta_clamped)
    length = response_mask.sum(-1, keepdim=True).clamp(min=1.0)
    r = torch.exp((delta_star * response_mask).sum(-1, keepdim=True) / length)  # [B, 1]
    adv_seq = (advantages * response_mask).sum(-1, keepdim=True) / length
    loss_mat = (-adv_seq * r).expand_as(log_prob)
    clipped = ((delta_star != delta) & (advantages != 0)).to(log_prob.dtype)
    return agg_loss(loss_mat, response_mask, loss_agg_mode), {
        "clipfrac": masked_mean(clipped, response_mask).detach(),
        "seq_ratio_mean": _seq_mean(r, response_mask).detach(),
        "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}

