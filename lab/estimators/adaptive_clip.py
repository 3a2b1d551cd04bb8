"""Clipping that adapts: BAPO (bounds searched per batch), ASPO (flipped ratios for positive advantages, entropy-
dependent bounds, soft dual clip) and CTPO (cumulative prefix ratios with position-scaled log-space bounds). None of
them ships in a trainer; each follows its authors' code.

BAPO (Balanced Policy Optimization with Adaptive Clipping, arXiv 2510.18927; WooooDyy/BAPO
``recipe/bapo/policy_loss.py`` ``compute_policy_loss_bapo``, 7287044;
defaults from ``recipe/bapo/run_bapo_example.sh``): the PPO bounds [c_low, c_high] (explicit ratio bounds) are
searched per batch. Starting from (0.8, 1.2), c_low rises by 0.05 up to 0.95, then c_high by 0.1 up to 2.0, until
the positive contribution sum max(A min(rho, c_high), 0)-part / the negative one (A < 0: A max(rho, c_low)) reaches
0.5; the first bounds that do (or the last) are used in PPO's loss with a dual clip of 3 (verl's default).

ASPO (Wang et al. 2025, "ASPO: Asymmetric Importance Sampling Policy Optimization", arXiv 2510.06062; code
wizard-III/Archer2.0 ``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_archer``, b08d963, and its call in
``verl/workers/actor/dp_actor.py``): for A > 0 the ratio is flipped, loss -A (c/sg[c])/sg[c] with c = min(rho, 1 +
eps_high), whose gradient is A / rho grad log pi (0 where clipped); for A < 0, PPO's -A max(rho, 1 - eps_low). Soft
dual clip: where 1/c (A > 0) or max(rho, 1 - eps_low) (A < 0) exceeds 3, the loss becomes -A 3 log pi (a capped
weight, the gradient kept). The bounds depend on the token's entropy: tokens at or below the 80th percentile of
their response's entropies get 0.2, the rest 0.4 (Archer2.0's call hard-codes these values). The entropy is
computed from ``logits`` (the current policy's, detached).

CTPO (Zhang et al. 2026, "Rethinking Importance Sampling in LLM Policy Optimization: A Cumulative Token
Perspective", arXiv 2605.07331; horizon-llm/CTPO ``verl/trainer/ppo/core_algos.py``
``_compute_policy_loss_cum_token_la_impl`` = ``cum-token-cumprod-la``, acc4021; defaults in ``ctpo.sh``): the
ratio of token t is the cumulative prefix ratio rho_<=t = exp(sum_{s<=t} log rho_s) (each log rho clamped to
[-20, 20], then the sum at 10 from above), with gradient on token t only (log r_t = log pi_t - sg[log pi_t] +
sg[sum]); PPO's clip in log space with position-scaled bounds [-0.025 t^0.5, 0.05 t^0.5] and a dual clip at
exp(0.05 t^0.5) for A < 0; token-mean. ``ratio_mode="geomean"`` is the code's other mode (the running geometric
mean, with la_power -0.5 recommended there).
"""
from __future__ import annotations

from lab.lazy import torch

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.contract import ordered
from lab.estimators.clipping import ppo_clip_coefficient
from lab.estimators.policy_gradient import token_log_ratio
from lab.estimators.registry import register

CUM_LOG_RATIO_MAX = 10.0  # CTPO clamps the cumulative log-ratio at 10 from above


# ----------------------------------------------------------------------------------------------- BAPO
def bapo_candidates(lower_start, lower_max, lower_step, upper_start, upper_max, upper_step) -> list[tuple]:
    """The bounds BAPO's search visits, in order, with the same float arithmetic as its loop."""
    low, high = lower_start, upper_start
    seq = [(low, high)]
    while low < lower_max and lower_step > 0:
        low = min(low + lower_step, lower_max)
        seq.append((low, high))
    while high < upper_max and upper_step > 0:
        high = min(high + upper_step, upper_max)
        seq.append((low, high))
    return seq


def bapo_bounds(ratio, advantages, mask, candidates, target, eps):
    """The first candidate bounds whose positive/negative contribution ratio reaches ``target`` (else the last):
    (c_low, c_high, the achieved ratio) as 0-dim tensors."""
    c = torch.tensor(candidates, dtype=ratio.dtype, device=ratio.device)  # [K, 2]
    low, high = c[:, 0].reshape(-1, 1, 1), c[:, 1].reshape(-1, 1, 1)
    effective = torch.where(advantages >= 0, torch.minimum(ratio, high), torch.maximum(ratio, low))
    contribution = torch.where(mask > 0, effective * advantages * mask, torch.zeros((), dtype=ratio.dtype))
    pos = contribution.clamp(min=0).sum((-2, -1))
    neg = (-contribution.clamp(max=0)).sum((-2, -1))
    balance = torch.where(neg <= 0, torch.full_like(pos, float("inf")), pos / (neg + eps))
    ok = balance >= target
    index = torch.where(ok.any(), torch.argmax(ok.to(torch.int64)), torch.full((), len(candidates) - 1))
    pick = index.reshape(1)
    return (torch.gather(c[:, 0], 0, pick)[0], torch.gather(c[:, 1], 0, pick)[0],
            torch.gather(balance, 0, pick)[0])


def bapo_coefficient(ratio, advantage, lower_start=0.8, upper_start=1.2, clip_ratio_c=3.0, **_):
    """Effective coefficient for a batch whose search ended at the starting bounds: PPO's with [0.8, 1.2], dual clip."""
    return ppo_clip_coefficient(ratio, advantage, 1 - lower_start, upper_start - 1, clip_ratio_c)


@register("bapo", label="BAPO", paper="BAPO, balanced policy optimization with adaptive clipping (arXiv 2510.18927)",
          unbiased="on-policy", family="adaptive-clip",
          source="WooooDyy/BAPO recipe/bapo/policy_loss.py compute_policy_loss_bapo (7287044); defaults from "
                 "recipe/bapo/run_bapo_example.sh (target 0.5, lower 0.8 -> 0.95 by 0.05, upper 1.2 -> 2.0 by 0.1)",
          unbiased_for="biased off-policy: token ratios with PPO clipping at bounds chosen from the batch's own "
                       "advantages; exactly REINFORCE on-policy (rho = 1 is inside every bound)",
          coefficient=bapo_coefficient, homogeneous=False, check=ordered("lower_start", "upper_start"),
          domains={"adv_ratio_target": "nonnegative", "lower_start": "positive", "lower_max": "positive",
                   "lower_step": "nonnegative", "upper_start": "positive", "upper_max": "positive",
                   "upper_step": "nonnegative", "clip_ratio_c": "> 1", "eps": "positive"},
          differences="the log-ratio clamp [-20, 20] is the code's; the recipe's config file (bapo_trainer.yaml) has "
                      "other starting points (0.6 / 1.2, target 1); the run script's are the defaults here")
def bapo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", adv_ratio_target=0.5,
         lower_start=0.8, lower_max=0.95, lower_step=0.05, upper_start=1.2, upper_max=2.0, upper_step=0.1,
         clip_ratio_c=3.0, eps=1e-8):
    """BAPO: PPO with bounds [c_low, c_high] raised from (0.8, 1.2) until positive/negative contributions reach 0.5.

    Source: WooooDyy/BAPO compute_policy_loss_bapo and run_bapo_example.sh.
    """
    ratio = torch.exp(token_log_ratio(log_prob, old_log_prob))
    candidates = bapo_candidates(lower_start, lower_max, lower_step, upper_start, upper_max, upper_step)
    low, high, balance = bapo_bounds(ratio.detach(), advantages, response_mask, candidates, adv_ratio_target, eps)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.minimum(torch.maximum(ratio, low), high)
    loss_mat = torch.maximum(unclipped, clipped)
    dual = -advantages * clip_ratio_c
    loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, dual), loss_mat)
    return agg_loss(loss_mat, response_mask, loss_agg_mode), {
        "clip_low": low.detach(), "clip_high": high.detach(), "pos_neg_ratio": torch.clamp(balance, max=1e30).detach(),
        "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), response_mask).detach(),
        "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}


# ----------------------------------------------------------------------------------------------- ASPO
def token_entropy(logits):
    """H = logsumexp(z) - sum_v softmax(z)_v z_v per position (verl's entropy_from_logits), detached."""
    z = logits.detach()
    return torch.logsumexp(z, -1) - (torch.softmax(z, -1) * z).sum(-1)


def row_quantile(values, mask, q: float):
    """torch.nanquantile(values with padding as NaN, q, dim=-1) (linear interpolation) by sorting; rows without a
    real position give +inf (no token lies at or below it)."""
    real = mask > 0
    ordered, _ = torch.sort(torch.where(real, values, torch.full_like(values, float("inf"))), dim=-1)
    n = real.sum(-1, keepdim=True)
    pos = q * (n - 1).clamp(min=0).to(values.dtype)
    lo = torch.floor(pos).to(torch.int64)
    hi = torch.clamp(lo + 1, max=(n - 1).clamp(min=0))
    v_lo, v_hi = torch.gather(ordered, -1, lo), torch.gather(ordered, -1, hi)
    out = v_lo + (pos - lo.to(values.dtype)) * torch.where(hi > lo, v_hi - v_lo, torch.zeros_like(v_lo))
    return torch.where(n > 0, out, torch.full_like(out, float("inf")))


def aspo_coefficient(ratio, advantage, eps_low=0.2, eps_high=0.2, dual_clip_c=3.0, **_):
    """Effective coefficient on A grad log pi (one entropy class): A > 0: 1/rho below 1 + eps_high, else 0, capped at
    c (the soft dual clip keeps c); A < 0: rho above 1 - eps_low (0 below), capped at c."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    advantage = torch.as_tensor(advantage, dtype=torch.float64)
    pos = torch.where(ratio > 1 + eps_high, torch.zeros_like(ratio), torch.clamp(1 / ratio, max=dual_clip_c))
    neg = torch.where(ratio < 1 - eps_low, torch.zeros_like(ratio), torch.clamp(ratio, max=dual_clip_c))
    return torch.where(advantage < 0, neg, pos)


@register("aspo", label="ASPO", paper="ASPO (Wang et al. 2025, arXiv 2510.06062)", unbiased="on-policy",
          family="adaptive-clip",
          source="wizard-III/Archer2.0 verl/trainer/ppo/core_algos.py compute_policy_loss_archer and "
                 "verl/workers/actor/dp_actor.py (token_entropy_quantile 0.8, bounds 0.2 / 0.4, dual clip 3; b08d963)",
          unbiased_for="biased off-policy and by design: positive-advantage tokens are weighted 1/rho (the flipped "
                       "ratio), clipped and capped; exactly REINFORCE on-policy (rho = 1)",
          coefficient=aspo_coefficient, inputs=("logits",),
          domains={"low_entropy_clip": "nonnegative", "high_entropy_clip": "nonnegative",
                   "entropy_quantile": "nonnegative", "dual_clip_c": "> 1"},
          differences="Archer2.0 computes the entropy in its forward pass (the same logits)")
def aspo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", low_entropy_clip=0.2,
         high_entropy_clip=0.4, entropy_quantile=0.8, dual_clip_c=3.0, *, logits):
    """ASPO: A > 0: loss -A (c/sg[c])/sg[c], c = min(rho, 1 + eps) (gradient A/rho); A < 0: -A max(rho, 1 - eps).

    eps = 0.2 for tokens at or below their response's 80th entropy percentile, 0.4 above; soft dual clip at 3.
    Source: Archer2.0 compute_policy_loss_archer (the ASPO code release).
    """
    entropy = token_entropy(logits)
    below = (entropy <= row_quantile(entropy, response_mask, entropy_quantile)) & (response_mask > 0)
    eps = torch.where(below, torch.as_tensor(low_entropy_clip, dtype=log_prob.dtype),
                      torch.as_tensor(high_entropy_clip, dtype=log_prob.dtype))
    ratio = torch.exp(token_log_ratio(log_prob, old_log_prob))
    neg_ratio = torch.maximum(ratio, 1 - eps)
    pos_ratio = torch.minimum(ratio, 1 + eps)
    neg_loss = -advantages * neg_ratio
    pos_loss = -advantages * (pos_ratio / pos_ratio.detach()) / pos_ratio.detach()
    neg_capped = neg_ratio > dual_clip_c
    neg_loss = torch.where(neg_capped, -advantages * dual_clip_c * log_prob, neg_loss)
    pos_capped = 1 / pos_ratio > dual_clip_c
    pos_loss = torch.where(pos_capped, -advantages * dual_clip_c * log_prob, pos_loss)
    loss_mat = torch.where(advantages < 0, neg_loss, pos_loss)
    return agg_loss(loss_mat, response_mask, loss_agg_mode), {
        "clipfrac_upper": masked_mean((ratio > pos_ratio).to(ratio.dtype) * (advantages >= 0), response_mask).detach(),
        "clipfrac_lower": masked_mean((ratio < neg_ratio).to(ratio.dtype) * (advantages < 0), response_mask).detach(),
        "dual_clip_frac": masked_mean(torch.where(advantages < 0, neg_capped, pos_capped).to(ratio.dtype),
                                      response_mask).detach(),
        "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}


# ----------------------------------------------------------------------------------------------- CTPO
def cumulative_log_ratio(log_prob, old_log_prob, mask, ratio_mode: str):
    """sum_{s<=t} m_s clamp(log rho_s, -20, 20) ("cumprod") or its running mean ("geomean"); 0 on padding."""
    delta = token_log_ratio(log_prob, old_log_prob).detach()
    zero = torch.zeros((), dtype=delta.dtype)
    cum = torch.where(mask > 0, delta * mask, zero).cumsum(-1)
    if ratio_mode == "geomean":
        cum = cum / mask.cumsum(-1).clamp(min=1.0)
    return torch.where(mask > 0, cum, zero)


def ctpo_coefficient(ratio, advantage, la_clip_low=0.025, la_clip_high=0.05, la_clip_c=0.05, la_power=0.5,
                     position=1, **_):
    """Effective coefficient on A grad log pi(y_t) as a function of the cumulative ratio rho_<=t at ``position`` t:
    rho_<=t where the log-space clip passes the gradient (and, for A < 0, below the dual clip), else 0."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    advantage = torch.as_tensor(advantage, dtype=torch.float64)
    scale = float(max(position, 1)) ** la_power
    log_r = torch.log(ratio)
    passes = torch.where(advantage >= 0, log_r < la_clip_high * scale, log_r > -la_clip_low * scale)
    passes = passes & ~((advantage < 0) & (ratio > torch.exp(torch.tensor(la_clip_c * scale))))
    return torch.where(passes & (log_r <= CUM_LOG_RATIO_MAX), ratio, torch.zeros_like(ratio))


@register("ctpo", label="CTPO", paper="CTPO (Zhang et al. 2026, arXiv 2605.07331)", unbiased="on-policy",
          family="adaptive-clip",
          source="horizon-llm/CTPO verl/trainer/ppo/core_algos.py _compute_policy_loss_cum_token_la_impl "
                 "(cum-token-cumprod-la, acc4021); defaults in ctpo.sh (LA_CLIP_LOW 0.025, LA_CLIP_HIGH 0.05, "
                 "LA_CLIP_C 0.05, CLIP_RATIO_LA_POWER 0.5)",
          unbiased_for="biased off-policy: the prefix ratio corrects the state distribution of token t, but the "
                       "sequence reward also depends on the tokens after t (sampled from mu), and the bounds clip; "
                       "exactly REINFORCE on-policy",
          coefficient=ctpo_coefficient, ratio="sequence",
          domains={"la_clip_low": "positive", "la_clip_high": "positive", "la_clip_c": "positive",
                   "la_power": "finite", "ratio_mode": "one of cumprod|geomean"},
          differences="CTPO's script also applies verl's rollout correction (sequence IS, threshold 5) in decoupled "
                      "mode; here only the loss")
def ctpo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", la_clip_low=0.025,
         la_clip_high=0.05, la_clip_c=0.05, la_power=0.5, ratio_mode="cumprod"):
    """CTPO-LA: PPO on the cumulative prefix ratio rho_<=t, log-space bounds [-0.025, 0.05] x t^0.5, dual clip.

    Source: horizon-llm/CTPO cum-token-cumprod-la.
    """
    cum = cumulative_log_ratio(log_prob, old_log_prob, response_mask, ratio_mode)
    log_r = torch.clamp(cum + log_prob - log_prob.detach(), max=CUM_LOG_RATIO_MAX)
    zero = torch.zeros((), dtype=log_prob.dtype)
    real = response_mask > 0
    ratio = torch.where(real, torch.exp(log_r), zero)
    position = response_mask.cumsum(-1)
    scale = position.clamp(min=1.0) ** la_power
    clipped_ratio = torch.where(real, torch.exp(torch.clamp(log_r, -la_clip_low * scale, la_clip_high * scale)), zero)
    threshold = torch.where(real, torch.exp(la_clip_c * scale), torch.ones_like(scale))
    unclipped = -advantages * ratio
    clipped = -advantages * clipped_ratio
    loss_mat = torch.maximum(unclipped, clipped)
    dual = -advantages * threshold
    loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, dual), loss_mat)
    return agg_loss(loss_mat, response_mask, loss_agg_mode), {
        "clipfrac": masked_mean((clipped > unclipped).to(ratio.dtype), response_mask).detach(),
        "clipfrac_lower": masked_mean(((loss_mat < torch.maximum(unclipped, clipped)) & (advantages < 0)).to(
            ratio.dtype), response_mask).detach(),
        "prefix_ratio_mean": masked_mean(ratio.detach(), response_mask),
        "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}
