"""Gated token ratios: CISPO (clipped IS weight as a detached coefficient) and SAPO (smooth sigmoid gate).

CISPO (MiniMax 2025, "MiniMax-M1", arXiv 2506.13585, eqs. 4-5; verl ``compute_policy_loss_cispo``, slime
``compute_cispo_loss``): loss_t = -sg[clip(rho_t, 1 - eps_low, 1 + eps_high)] A log pi(y_t|s_t).
    The gradient never switches off: every token keeps clip(rho) A grad log pi. MiniMax-M1 sets no lower bound
    ("eps_low large") and tunes only the upper one. Defaults here, in verl's delta-from-1 convention:
    clip_ratio_low = 1.0 (lower bound 0, i.e. none) and clip_ratio_high = 4.0 (ratio cap 5.0), which is the cap
    TRL recommends (GRPOConfig epsilon_high = 5.0 for loss_type="cispo", ScaleRL's eps_max). Other shipped caps:
    tinker clip_high_threshold = 4.0; NeMo-RL ratio_clip_max = 5.0 (cap 6); verl's CISPO example
    clip_ratio_low = 10 (no lower bound), clip_ratio_high = 0.2 (cap 1.2); verl's ActorConfig defaults, 0.2 / 0.2,
    give [0.8, 1.2]. Footgun: TRL clamps the ratio at ``epsilon_high`` itself (not 1 + eps) and,
    when epsilon_high is unset, falls back to epsilon = 0.2: every token's coefficient is then at most 0.2, so even
    on-policy the update is 0.2 x REINFORCE. Here that is clip_ratio_high = -0.8.
    Token log-ratios are clamped to [-20, 20] first, as verl does (TRL does not clamp them; the coefficients differ
    only where a token log-ratio lies below -20, by less than 3e-9).

SAPO (Gao et al. 2025, "Soft Adaptive Policy Optimization", arXiv 2511.20347; verl ``compute_policy_loss_sapo``,
TRL loss_type="sapo"): gate_t = sigmoid(tau (rho_t - 1)) * 4 / tau, tau = tau_pos = 1.0 if A > 0 else
tau_neg = 1.05 (A <= 0 gets tau_neg, as in verl); loss_t = -gate_t A with rho in the graph.
    d gate / d log pi = 4 s (1 - s) rho with s = sigmoid(tau (rho - 1)): the gradient is token IS, rho A grad log pi,
    times the bell-shaped weight 4 s (1 - s) (1 at rho = 1, decaying smoothly on both sides, faster for A <= 0).
    The full coefficient 4 s (1 - s) rho is not bounded by 1: it peaks where (2 s - 1) rho = 1, at rho = 2.06 with
    value 1.575 for tau = 1 (rho = 1.99, 1.536 for tau = 1.05), and decays like rho e^(-tau (rho - 1)) beyond.
    This matches the reference: verl/TRL differentiate through the sigmoid gate, so the gradient is sigmoid-shaped.
    On-policy (rho = 1) the weight is exactly 1 for either tau: the gradient is exactly REINFORCE's; only the loss
    value differs (-2A/tau per token instead of -A). verl's compute_policy_loss_sapo aggregates seq-mean-token-mean
    whatever loss_agg_mode says, and TRL's loss_type="sapo" aggregates the same way; here it is the default and
    ``loss_agg_mode`` is honoured. Token log-ratios are clamped to [-20, 20] (verl; TRL does not clamp).
"""
from __future__ import annotations

from lab.lazy import torch

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.policy_gradient import LOG_RATIO_BOUND, token_log_ratio
from lab.estimators.registry import register


def cispo_coefficient(ratio, advantage=None, clip_ratio_low=1.0, clip_ratio_high=4.0, **_):
    """Effective coefficient on A grad log pi: clip(rho, 1 - eps_low, 1 + eps_high) (default: min(rho, 5))."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    ratio = torch.exp(torch.clamp(torch.log(ratio), -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    return torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)


def sapo_coefficient(ratio, advantage, tau_pos=1.0, tau_neg=1.05, **_):
    """Effective coefficient on A grad log pi: 4 s (1 - s) rho, s = sigmoid(tau (rho - 1)), tau by the sign of A."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    advantage = torch.as_tensor(advantage, dtype=torch.float64)
    tau = torch.where(advantage > 0, torch.as_tensor(tau_pos, dtype=torch.float64),
                      torch.as_tensor(tau_neg, dtype=torch.float64))
    s = torch.sigmoid(tau * (ratio - 1))
    coef = 4 * s * (1 - s) * ratio
    inside = torch.log(ratio).abs() <= LOG_RATIO_BOUND  # the [-20, 20] clamp stops the gradient beyond
    return torch.where(inside, coef, torch.zeros_like(coef))


def _cispo_range(hyper: dict) -> str | None:
    if 1 - hyper["clip_ratio_low"] > 1 + hyper["clip_ratio_high"]:
        return (f"the clip range [1 - clip_ratio_low, 1 + clip_ratio_high] = [{1 - hyper['clip_ratio_low']:g}, "
                f"{1 + hyper['clip_ratio_high']:g}] is empty")
    return None


@register("cispo", label="CISPO", paper="CISPO (MiniMax-M1, arXiv 2506.13585)", unbiased="on-policy",
          family="gated",
          source="CISPO (MiniMax-M1, arXiv 2506.13585); verl compute_policy_loss_cispo; TRL loss_type='cispo'",
          unbiased_for="biased off-policy: token ratios (no prefix weight) truncated at 1 + eps_high = 5; exactly "
                       "REINFORCE on-policy (not with TRL's 0.2 fallback cap)",
          coefficient=cispo_coefficient,
          domains={"clip_ratio_low": "nonnegative", "clip_ratio_high": "> -1"}, check=_cispo_range,
          differences="defaults (clip_ratio_low, clip_ratio_high) = (1.0, 4.0), a cap of 5, where verl's ActorConfig "
                      "defaults (0.2, 0.2) give [0.8, 1.2]; TRL's cap is epsilon_high itself: its cispo is "
                      "clip_ratio_low=1, clip_ratio_high=epsilon_high - 1")
def cispo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", clip_ratio_low=1.0,
          clip_ratio_high=4.0):
    """CISPO: loss_t = -sg[clip(rho_t, 1-eps_low, 1+eps_high)] A log pi(y_t|s_t); no lower bound, cap 1 + 4 = 5.

    Source: MiniMax-M1 (arXiv 2506.13585) eqs. 4-5; verl compute_policy_loss_cispo; TRL/ScaleRL cap 5.0.
    """
    ratio = torch.exp(token_log_ratio(log_prob, old_log_prob))
    clipped = torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss = agg_loss(-clipped.detach() * advantages * log_prob, response_mask, loss_agg_mode)
    return loss, {"clipfrac": masked_mean((clipped != ratio).to(ratio.dtype), response_mask).detach(),
                  "is_weight_mean": masked_mean(clipped, response_mask).detach(),
                  "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}


@register("sapo", label="SAPO", paper="SAPO (Gao et al. 2025, arXiv 2511.20347)", unbiased="on-policy",
          family="gated",
          source="SAPO (Gao et al. 2025, arXiv 2511.20347); verl compute_policy_loss_sapo; TRL loss_type='sapo'",
          unbiased_for="biased off-policy: token ratios with a smooth gate 4 s(1-s) rho; exactly REINFORCE on-policy "
                       "(the gate's slope at rho = 1 is 1 for any tau)",
          coefficient=sapo_coefficient, domains={"tau_pos": "positive", "tau_neg": "positive"},
          differences="honours loss_agg_mode; verl's compute_policy_loss_sapo always aggregates seq-mean-token-mean "
                      "(the default here, so the two agree unless another mode is asked for)")
def sapo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean", tau_pos=1.0,
         tau_neg=1.05):
    """SAPO: loss_t = -A sigmoid(tau (rho_t - 1)) 4/tau, tau = 1.0 if A > 0 else 1.05; rho in the graph.

    Source: SAPO (Gao et al. 2025, arXiv 2511.20347); verl compute_policy_loss_sapo; TRL sapo_temperature_pos/neg.
    """
    ratio = torch.exp(token_log_ratio(log_prob, old_log_prob))
    tau = torch.where(advantages > 0, torch.as_tensor(tau_pos, dtype=ratio.dtype),
                      torch.as_tensor(tau_neg, dtype=ratio.dtype))
    s = torch.sigmoid(tau * (ratio - 1))
    gate = s * 4 / tau
    loss = agg_loss(-gate * advantages, response_mask, loss_agg_mode)
    weight = (4 * s * (1 - s)).detach()
    return loss, {"gate_weight_mean": masked_mean(weight, response_mask),
                  "gate_weight_min": torch.where(response_mask > 0, weight, torch.ones_like(weight)).min(),
                  "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}
