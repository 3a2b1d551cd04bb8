"""Decoupled PPO with a proximal policy (AReaL), its log-linear proximal approximation (A-3PO), and M2PO's second-moment
trust region (AReaL's masking form, and the global clip the M2PO authors' code runs).

Three policies: the sampler mu generated the tokens (``rollout_log_probs``; AReaL's ``old_logprobs``), the proximal
pi_prox is the policy the trainer recomputes at the start of the update (``old_log_prob``; AReaL's
``proximal_logprobs``) and pi is being optimised. AReaL 1.0.4 (``areal/utils/functional/functional.py``
``ppo_actor_loss_fn`` and ``apply_rejection_sampling``, = inclusionAI/AReaL b2fb234; ``areal/trainer/ppo/actor.py``
``grpo_loss_fn``, ``_apply_m2po_masking`` and ``compute_prox_logp_approximations``, = v1.0.4 37d6c64):

    w_t    = pi_prox / mu per token, masked to 0 above ``behave_upper`` (rejection_sampling: level token, metric
             ratio, action mask) or clamped to [0, behave_upper] (action clamp); 1 when ``behave_upper`` is None
    r_t    = pi / pi_prox;  loss_t = w_t max(-A r_t, -A clip(r_t, 1 - eps, 1 + eps_high)), dual clip c for A < 0
    loss   = sum over loss-mask tokens / the number of loss-mask tokens (token-mean)

Defaults are AReaL's example configuration (``examples/math/gsm8k_grpo.yaml``: eps_clip 0.4, decoupled loss,
rejection_sampling metric ratio, upper 5.0); AReaL's PPOActorConfig itself defaults to eps 0.2 and no behaviour
weight (rejection_sampling None).

A-3PO (arXiv 2512.06547; AReaL ``prox_logp_method="loglinear"``): the proximal log-probs are not recomputed but
interpolated, log pi_prox = log mu + alpha (log pi - log mu) with pi detached and alpha = (v_prox - v_mu) /
(v_pi - v_mu) = (lag - 1) / lag for a sequence ``lag`` versions behind pi (AReaL takes v_prox = v_pi - 1), 0 at lag
0. ``proximal="loglinear"`` needs the input ``lag``; ``old_log_prob`` is then not used.

M2PO (Zheng et al. 2025, "Prosperity before Collapse", arXiv 2510.01161):
- ``m2po`` (AReaL ``actor.m2_threshold`` = 0.04, ``examples/math/gsm8k_m2po.yaml``: eps_clip 0.0, behaviour weight
  masked above 5): with M2_t = (log mu - log pi_prox)^2 over the batch's tokens, mask the tokens in decreasing M2_t
  until the mean M2 of the rest is below tau (at least one token stays), removing them from the loss mask and from
  the token count; then the decoupled loss above. ``m2_ratio="current"`` is the paper's form, M2_t = (log pi -
  log mu)^2 with pi detached (the mask then moves with pi during an update; with pi_prox = pi the two agree).
- ``m2po_clip`` (the authors' code, Infini-AI-Lab/M2PO ``verl/trainer/ppo/core_algos.py`` ``kpo_clip_harmful_tokens``
  and ``compute_m2po_policy_loss``, af54a3e; ``M2_budget=0.04`` in its train scripts): no masking. Among the
  "harmful" tokens (A > 0 and r > 1, or A < 0 and r < 1, r = pi/mu, A read from the sequence's first token) it
  finds tau with sum_i min(M2_i, tau^2) <= 0.04 n (the largest M2 breakpoint below the budget; 0 when the smallest
  alone exceeds it) and clips every token's ratio to [e^-tau, e^tau] in PPO's loss (no dual clip, token-mean); with
  M2 already under the budget the window is [0, 1e5] (no clip). The window is global to the batch and recomputed
  from the current pi.
"""
from __future__ import annotations

import math

from lab.lazy import torch

from lab.errors import LabError
from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.policy_gradient import token_log_ratio
from lab.estimators.registry import register
from lab.estimators.truncation import ppo_loss_matrix

M2PO_NO_CLIP = 100000.0  # the authors' "no clipping needed" bound
M2PO_EPS = 1e-12


# ----------------------------------------------------------------------------------------------- pieces
def loglinear_proximal(log_prob, rollout_log_probs, lag):
    """A-3PO: log pi_prox = log mu + alpha (sg[log pi] - log mu), alpha = clamp((lag - 1) / lag, 0, 1) (0 at lag 0)."""
    lag = lag.to(log_prob.dtype)
    alpha = torch.where(lag > 0, (lag - 1) / torch.where(lag > 0, lag, torch.ones_like(lag)), torch.zeros_like(lag))
    alpha = torch.clamp(alpha, 0.0, 1.0)
    return rollout_log_probs + alpha * (log_prob.detach() - rollout_log_probs)


def behaviour_weight(proximal, rollout_log_probs, upper, mode: str):
    """AReaL's token-level behaviour weight pi_prox / mu: masked to 0 above ``upper`` or clamped to [0, upper]."""
    w = torch.exp(token_log_ratio(proximal, rollout_log_probs)).detach()
    if upper is None:
        return torch.ones_like(w)
    if mode == "mask":
        return torch.where(w <= upper, w, torch.zeros_like(w))
    return torch.clamp(w, 0.0, upper)


def _flat(x):
    return x.reshape(*x.shape[:-2], -1)


def m2_keep(m2, mask, threshold: float):
    """AReaL's M2PO mask: drop tokens in decreasing ``m2`` until the mean of the rest is below ``threshold`` (at least
    one stays). Batch-level, computed with sorts only (vmap-safe); returns a [B, T] float mask of kept tokens."""
    real = _flat(mask) > 0
    values = torch.where(real, _flat(m2), torch.full_like(_flat(m2), -1.0))  # padding sorts last
    ordered, order = torch.sort(values, descending=True, stable=True)
    ordered = torch.clamp(ordered, min=0.0)
    suffix = ordered.flip(-1).cumsum(-1).flip(-1)  # sum of ordered[i:]
    n = real.sum(-1, keepdim=True)
    position = torch.arange(ordered.shape[-1], device=m2.device)
    counts = (n - position).clamp(min=1).to(m2.dtype)
    below = (position < n) & (suffix / counts < threshold)
    first_below = torch.argmax(below.to(torch.int64), dim=-1, keepdim=True)
    n_mask = torch.where(below.any(-1, keepdim=True), first_below, n - 1)
    rank = torch.argsort(order, dim=-1)
    dropped = real & (rank < n_mask)
    return (~dropped).to(mask.dtype).reshape(mask.shape) * mask


def m2_budget_bound(delta_sq, harmful, budget: float):
    """The authors' tau^2 for ``kpo_clip_harmful_tokens`` (a 0-dim tensor) and whether to clip at all."""
    h = _flat(harmful)
    v = torch.where(h, _flat(delta_sq), torch.full_like(_flat(delta_sq), float("inf")))
    n = h.sum(-1)
    v_real = torch.where(h, v, torch.zeros_like(v))
    m2_now = v_real.sum(-1) / n.clamp(min=1).to(v.dtype)
    clip = (n > 0) & (m2_now > budget + M2PO_EPS)
    ordered, _ = torch.sort(v, dim=-1)
    finite = torch.where(torch.isinf(ordered), torch.zeros_like(ordered), ordered)
    csum = finite.cumsum(-1)
    k = torch.arange(ordered.shape[-1], device=v.device)
    rest = (n[..., None] - k - 1).to(v.dtype)
    reach = (k < n[..., None]) & ((finite - M2PO_EPS) * rest + csum >= budget * n[..., None].to(v.dtype) - M2PO_EPS)
    first = torch.argmax(reach.to(torch.int64), dim=-1)
    previous = torch.gather(finite, -1, (first - 1).clamp(min=0)[..., None])[..., 0]
    tau_sq = torch.where(first > 0, (previous - M2PO_EPS).clamp(min=0.0), torch.zeros_like(previous))
    return tau_sq, clip


def _decoupled(log_prob, proximal, advantages, response_mask, loss_agg_mode, eps_clip, eps_clip_higher, c_clip,
               behave_upper, behave_mode, rollout_log_probs, loss_mask):
    w = behaviour_weight(proximal, rollout_log_probs, behave_upper, behave_mode)
    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    loss_mat, clipped, dual = ppo_loss_matrix(log_prob, proximal, advantages, eps_clip, high, c_clip)
    loss = agg_loss(loss_mat * w, loss_mask, loss_agg_mode)
    return loss, {"clipfrac": masked_mean(clipped, loss_mask).detach(),
                  "clipfrac_lower": masked_mean(dual, loss_mask).detach(),
                  "behave_weight_mean": masked_mean(w, loss_mask).detach(),
                  "behave_mask_frac": masked_mean((w == 0).to(w.dtype), loss_mask).detach(),
                  "rollout_kl": masked_mean(rollout_log_probs - proximal, response_mask).detach(),
                  "ppo_kl": masked_mean(proximal - log_prob, response_mask).detach()}


def _proximal(log_prob, old_log_prob, rollout_log_probs, proximal, lag, name):
    if proximal == "recompute":
        return old_log_prob
    if lag is None:
        raise LabError(f"estimator {name!r}: proximal='loglinear' (A-3PO) interpolates by the version lag; pass "
                       f"lag (per token), or use proximal='recompute'")
    return loglinear_proximal(log_prob, rollout_log_probs, lag)


# ----------------------------------------------------------------------------------------------- coefficients
def decoupled_coefficient(ratio, advantage, eps_clip=0.4, eps_clip_higher=None, c_clip=None, behave_upper=5.0,
                          behave_weight=1.0, **_):
    """Effective coefficient on A grad log pi with ratio r = pi/pi_prox: w r where PPO's clip passes the gradient, w
    the behaviour weight pi_prox/mu (``behave_weight``, 0 above ``behave_upper``)."""
    from lab.estimators.clipping import ppo_clip_coefficient

    high = eps_clip if eps_clip_higher is None else eps_clip_higher
    w = 0.0 if behave_upper is not None and behave_weight > behave_upper else behave_weight
    return w * ppo_clip_coefficient(ratio, advantage, eps_clip, high, c_clip)


def m2po_clip_coefficient(ratio, advantage, tau=0.2, **_):
    """Effective coefficient for a batch whose M2 budget gave the window [e^-tau, e^tau] (``tau``): PPO's."""
    from lab.estimators.clipping import ppo_clip_coefficient

    return ppo_clip_coefficient(ratio, advantage, 1 - math.exp(-tau), math.exp(tau) - 1)


# ----------------------------------------------------------------------------------------------- estimators
AREAL = {"eps_clip": "nonnegative", "eps_clip_higher": "nonnegative or None", "c_clip": "> 1 or None",
         "behave_upper": "positive or None", "behave_mode": "one of mask|clamp",
         "proximal": "one of recompute|loglinear"}
AREAL_SOURCE = ("AReaL 1.0.4 areal/utils/functional/functional.py ppo_actor_loss_fn, apply_rejection_sampling "
                "(inclusionAI/AReaL b2fb234); areal/trainer/ppo/actor.py grpo_loss_fn, "
                "compute_prox_logp_approximations "
                "(v1.0.4, 37d6c64); defaults from examples/math/{example}.yaml")
AREAL_DIFFERENCES = ("log-ratios clamped to [-20, 20] (AReaL exponentiates them unclamped); the lab takes the "
                     "proximal policy as old_log_prob and the sampler as rollout_log_probs (AReaL: proximal_logprobs "
                     "and old_logprobs); AReaL's sequence-level and KL-metric rejection modes are not implemented")


@register("decoupled_ppo", label="Decoupled PPO", paper="AReaL decoupled PPO (Fu et al. 2025, arXiv 2505.24298); "
          "A-3PO (arXiv 2512.06547)", unbiased="on-policy", family="decoupled",
          source=AREAL_SOURCE.format(example="gsm8k_grpo"),
          unbiased_for="biased off-policy: token weights pi_prox/mu (no prefix weight) masked above 5, PPO clipping "
                       "on pi/pi_prox; exactly REINFORCE when pi = pi_prox = mu",
          coefficient=decoupled_coefficient, inputs=("rollout_log_probs",), optional_inputs=("lag",),
          domains=AREAL, differences=AREAL_DIFFERENCES)
def decoupled_ppo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", eps_clip=0.4,
                  eps_clip_higher=None, c_clip=None, behave_upper=5.0, behave_mode="mask", proximal="recompute", *,
                  rollout_log_probs, lag=None):
    """Decoupled PPO: loss_t = w_t max(-A r_t, -A clip(r_t, 0.6, 1.4)), r = pi/pi_prox, w = pi_prox/mu masked above 5.

    ``old_log_prob``: pi_prox (recomputed); ``rollout_log_probs``: the sampler mu; ``proximal="loglinear"``: A-3PO's
    interpolated pi_prox from ``lag``. Source: AReaL 1.0.4 ppo_actor_loss_fn.
    """
    prox = _proximal(log_prob, old_log_prob, rollout_log_probs, proximal, lag, "decoupled_ppo")
    return _decoupled(log_prob, prox, advantages, response_mask, loss_agg_mode, eps_clip, eps_clip_higher, c_clip,
                      behave_upper, behave_mode, rollout_log_probs, response_mask)


@register("m2po", label="M2PO", paper="M2PO (Zheng et al. 2025, arXiv 2510.01161)", unbiased="on-policy",
          family="decoupled", source=AREAL_SOURCE.format(example="gsm8k_m2po") + "; actor.m2_threshold",
          unbiased_for="biased off-policy: the tokens of largest (log mu - log pi_prox)^2 dropped until their mean is "
                       "below 0.04, token weights pi_prox/mu masked above 5, PPO (eps 0) on pi/pi_prox; exactly "
                       "REINFORCE when pi = pi_prox = mu",
          coefficient=decoupled_coefficient, inputs=("rollout_log_probs",), optional_inputs=("lag",),
          domains={**AREAL, "m2_threshold": "positive", "m2_ratio": "one of proximal|current"},
          differences=AREAL_DIFFERENCES + "; m2_ratio='current' is the paper's M2 on log(pi/mu), AReaL's on "
                      "log(pi_prox/mu); the authors' own code clips instead of masking (m2po_clip)")
def m2po(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", eps_clip=0.0,
         eps_clip_higher=None, c_clip=None, behave_upper=5.0, behave_mode="mask", proximal="recompute",
         m2_threshold=0.04, m2_ratio="proximal", *, rollout_log_probs, lag=None):
    """M2PO (AReaL): drop the tokens of largest (log mu - log pi_prox)^2 until their batch mean is below 0.04.

    Then decoupled PPO (eps 0, behaviour weight masked above 5).

    Source: AReaL 1.0.4 _apply_m2po_masking (areal/trainer/ppo/actor.py) and examples/math/gsm8k_m2po.yaml.
    """
    prox = _proximal(log_prob, old_log_prob, rollout_log_probs, proximal, lag, "m2po")
    reference = prox if m2_ratio == "proximal" else log_prob.detach()
    delta = (rollout_log_probs - reference).detach()
    keep = m2_keep(delta * delta, response_mask, m2_threshold)
    loss, metrics = _decoupled(log_prob, prox, advantages, response_mask, loss_agg_mode, eps_clip, eps_clip_higher,
                               c_clip, behave_upper, behave_mode, rollout_log_probs, keep)
    metrics["m2_masked_frac"] = masked_mean(1 - keep, response_mask).detach()
    metrics["m2_before"] = masked_mean(delta * delta, response_mask).detach()
    return loss, metrics


@register("m2po_clip", label="M2PO (global clip)", paper="M2PO (Zheng et al. 2025, arXiv 2510.01161)",
          unbiased="on-policy", family="decoupled",
          source="Infini-AI-Lab/M2PO verl/trainer/ppo/core_algos.py kpo_clip_harmful_tokens, "
                 "_solve_tau_from_sorted_delta2, compute_m2po_policy_loss (af54a3e); M2_budget=0.04 in "
                 "train-scripts/m2po-qwen-math-7b-s256.sh",
          unbiased_for="biased off-policy: token ratios, clipped to a batch-wide window [e^-tau, e^tau] chosen so "
                       "that the harmful tokens' capped M2 fits 0.04; exactly REINFORCE on-policy (no harmful token)",
          coefficient=m2po_clip_coefficient, domains={"m2_budget": "positive"}, homogeneous=False,
          differences="the token log-ratio is clamped to [-20, 20] (the authors' code does not clamp); the window's "
                      "bounds are computed as the code does (exp in float32) but without its Python loop")
def m2po_clip(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", m2_budget=0.04):
    """M2PO (authors' code): PPO with one batch-wide clip [e^-tau, e^tau], tau from the harmful tokens' M2 budget 0.04.

    Source: Infini-AI-Lab/M2PO compute_m2po_policy_loss (af54a3e).
    """
    delta = (old_log_prob - log_prob).detach()
    ratio = torch.exp(-delta)
    adv_row = advantages[..., :1]
    harmful = (response_mask > 0) & (((adv_row > M2PO_EPS) & (ratio > 1 + M2PO_EPS))
                                     | ((adv_row < -M2PO_EPS) & (ratio < 1 - M2PO_EPS)))
    tau_sq, clip = m2_budget_bound(delta * delta, harmful, m2_budget)
    tau = torch.sqrt(tau_sq).to(torch.float32)  # the authors map tau to bounds with float32 tensors
    low_eps = 1.0 - torch.exp(-tau).to(log_prob.dtype)
    high_eps = torch.exp(tau).to(log_prob.dtype) - 1.0
    low_eps = torch.where(clip, low_eps, torch.ones_like(low_eps))
    high_eps = torch.where(clip, high_eps, torch.full_like(high_eps, M2PO_NO_CLIP - 1.0))
    r = torch.exp(token_log_ratio(log_prob, old_log_prob))
    unclipped = -advantages * r
    clipped_loss = -advantages * torch.minimum(torch.maximum(r, 1 - low_eps), 1 + high_eps)
    loss_mat = torch.maximum(unclipped, clipped_loss)
    return agg_loss(loss_mat, response_mask, loss_agg_mode), {
        "clipfrac": masked_mean((clipped_loss > unclipped).to(r.dtype), response_mask).detach(),
        "m2_tau": torch.sqrt(tau_sq).detach(),
        "m2_harmful_frac": masked_mean(harmful.to(r.dtype), response_mask).detach(),
        "ppo_kl": masked_mean(delta, response_mask).detach()}


__all__ = ["decoupled_ppo", "loglinear_proximal", "m2_budget_bound", "m2_keep", "m2po", "m2po_clip"]
