"""Truncated and masked importance sampling (TIS, MIS / IcePop), at token and sequence level.

Weights, with rho_t = pi(y_t|s_t) / mu(y_t|s_t) and W = exp(L) = prod_t rho_t, L = sum_t m_t delta_t (no length
division):

    tis_token   w_t = min(rho_t, C)               C = 2       verl rollout_is="token", rollout_is_threshold=2.0;
                                                              slime TIS (tis_clip = 2)
    tis_seq     w   = min(W, C)                   C = 2       verl rollout_is="sequence" (bypass_pg_is preset)
    mis_token   w_t = rho_t 1[lo <= rho_t <= hi]  [0.5, 5]    IcePop (Ling team, "Every Step Evolves", Ring-1T):
                                                              alpha = 0.5, beta = 5; verl rollout_is_threshold="0.5_5.0"
    mis_seq     w   = W 1[lo <= W <= hi]          [0.5, 2]    verl rollout_is="sequence", rollout_is_threshold="0.5_2.0"
                                                              (the band of verl's Seq-MIS preset decoupled_seq_is_rs)

TRL (GRPOConfig, 1.16) corrects sampler/trainer mismatch with vllm_importance_sampling_mode="sequence_mask" by
default: the sequence weight pi_old(y)/mu(y) is zeroed outside [vllm_importance_sampling_clip_min,
vllm_importance_sampling_clip_max] = [None, 3.0] (the older vllm_importance_sampling_cap is deprecated) and
multiplied into its per-token loss: ``mis_seq`` with lower=0, upper=3 in the three-policy form (without the dual
clip: clip_ratio_c=None). Its "token_truncate" / "sequence_truncate" modes are ``tis_token`` / ``tis_seq`` with
cap=3, "token_mask" is ``mis_token`` with lower=0, upper=3.

How the weight is applied (both modes are what verl ships):

- Two-policy batch (no ``rollout_log_probs``; ``old_log_prob`` is the sampler mu). This is verl's bypass mode with
  loss_type="reinforce" (``compute_policy_loss_bypass_mode`` -> ``compute_policy_loss_reinforce``): the weight is
  computed from the current pi and mu under no_grad, and the loss is REINFORCE with a detached weight,
  loss_t = -sg[w_t] A log pi(y_t|s_t); gradient w_t A grad log pi(y_t|s_t).
- Decoupled three-policy batch (``rollout_log_probs`` = the sampler mu, ``old_log_prob`` = the proximal pi_old that
  the trainer recomputed). verl computes the weight from pi_old / mu (``compute_rollout_correction_and_rejection_mask``
  with old_log_prob vs rollout_log_probs, detached) and multiplies it into the per-token loss of its vanilla PPO
  policy loss on pi / pi_old: loss_t = w_t * max(-A r_t, -A clip(r_t, 1-eps_low, 1+eps_high)), r_t = pi/pi_old,
  with verl's dual clip min(., -A c), c = 3.0, for A < 0; eps = 0.2. slime's TIS / IcePop do the same
  (weight from train old log-probs vs rollout log-probs, multiplied into the PPO loss). The PPO hyper-parameters
  here (clip_ratio_low/high/c) are used only in this mode.

Differences from verl, on purpose: MIS always zeroes the weight but keeps the token in the aggregation denominators
(verl's IcePop thresholds "lo_hi" do the same); verl's rejection sampling (rollout_rs, e.g. the seq_sum_k1 band
"0.5_2.0" of its decoupled_seq_is_rs preset, which gives mis_seq's weights) instead removes rejected tokens from
``response_mask``, which changes the token-mean denominator and, without global batch information, the number of
rows. verl's optional batch normalisation of the weights
(rollout_is_batch_normalize, default off) is not implemented. Log-ratios are clamped to [-20, 20] (token) and the
summed log-weight to [-20, 20] (sequence), verl's SAFETY_BOUND.
"""
from __future__ import annotations

from lab.lazy import torch

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.contract import ordered
from lab.estimators.policy_gradient import sequence_log_weight, token_log_ratio
from lab.estimators.registry import register


# ----------------------------------------------------------------------------------------------- shared pieces
def _seq_mean(x: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Mean of a per-sequence quantity [B] or [B, 1] over the sequences that have at least one token."""
    valid = (response_mask.sum(-1) > 0).to(response_mask.dtype)
    return (x.reshape(valid.shape) * valid).sum() / valid.sum().clamp(min=1.0)


def _masked_max(x: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Max of a non-negative quantity over real tokens; 0 when there are none (finite, vmap-safe)."""
    return torch.where(response_mask > 0, x, torch.zeros_like(x)).max()


def ppo_loss_matrix(log_prob, old_log_prob, advantages, clip_ratio_low, clip_ratio_high, clip_ratio_c):
    """verl's vanilla PPO per-token loss on r = pi / pi_old, with the dual clip for A < 0 when c is not None.

    Returns (loss_mat, clipped, dual_clipped) with the two indicator matrices as floats.
    """
    ratio = torch.exp(token_log_ratio(log_prob, old_log_prob))
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1 - clip_ratio_low, 1 + clip_ratio_high)
    loss_mat = torch.maximum(unclipped, clipped_loss)
    clipped = (clipped_loss > unclipped).to(log_prob.dtype)
    if clip_ratio_c is None:
        return loss_mat, clipped, torch.zeros_like(clipped)
    dual = -advantages * clip_ratio_c
    dual_clipped = ((loss_mat > dual) & (advantages < 0)).to(log_prob.dtype)
    loss_mat = torch.where(advantages < 0, torch.minimum(loss_mat, dual), loss_mat)
    return loss_mat, clipped, dual_clipped


def _apply(weight, log_prob, old_log_prob, advantages, response_mask, loss_agg_mode, rollout_log_probs,
           clip_ratio_low, clip_ratio_high, clip_ratio_c):
    """Two-policy: -sg[w] A log pi. Three-policy: w * PPO-clip loss on pi / pi_old. Returns (loss, metrics)."""
    weight = weight.detach()
    if rollout_log_probs is None:
        loss = agg_loss(-weight * advantages * log_prob, response_mask, loss_agg_mode)
        return loss, {"ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}
    loss_mat, clipped, dual = ppo_loss_matrix(log_prob, old_log_prob, advantages, clip_ratio_low, clip_ratio_high,
                                              clip_ratio_c)
    loss = agg_loss(weight * loss_mat, response_mask, loss_agg_mode)
    return loss, {"ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach(),
                  "clipfrac": masked_mean(clipped, response_mask).detach(),
                  "clipfrac_lower": masked_mean(dual, response_mask).detach(),
                  "rollout_kl": masked_mean(rollout_log_probs - old_log_prob, response_mask).detach()}


def _behaviour(log_prob, old_log_prob, rollout_log_probs):
    """(numerator, denominator) log-probs of the IS weight: (pi, mu) two-policy, (pi_old, mu) three-policy."""
    if rollout_log_probs is None:
        return log_prob.detach(), old_log_prob
    return old_log_prob, rollout_log_probs


# ----------------------------------------------------------------------------------------------- coefficients
def truncated_coefficient(ratio, advantage=None, cap=2.0, **_):
    """Effective coefficient on A grad log pi: min(ratio, C) (token ratio for tis_token, W for tis_seq)."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    return torch.clamp(ratio, max=cap)


def masked_coefficient(ratio, advantage=None, lower=0.5, upper=5.0, **_):
    """Effective coefficient on A grad log pi: rho_t 1[lower <= rho_t <= upper] (mis_token's band [0.5, 5])."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    return torch.where((ratio >= lower) & (ratio <= upper), ratio, torch.zeros_like(ratio))


def masked_seq_coefficient(ratio, advantage=None, lower=0.5, upper=2.0, **_):
    """Effective coefficient on A grad log pi: W 1[lower <= W <= upper] (mis_seq's band [0.5, 2])."""
    return masked_coefficient(ratio, advantage, lower, upper)


# ----------------------------------------------------------------------------------------------- domains
PPO = {"clip_ratio_low": "nonnegative", "clip_ratio_high": "nonnegative", "clip_ratio_c": "> 1 or None"}
TRUNCATED = {"cap": "positive", **PPO}
MASKED = {"lower": "nonnegative", "upper": "positive", **PPO}
ROLLOUT_RS = ("verl's rejection sampling (rollout_rs) and rollout_is_batch_normalize are not implemented; in the "
              "three-policy form the lab takes the sampler's log-probs (rollout_log_probs) and computes the weight "
              "itself, where verl passes precomputed rollout_is_weights")


_band = ordered("lower", "upper")


# ----------------------------------------------------------------------------------------------- estimators
@register("tis_token", label="Token TIS", unbiased="on-policy",
          paper="TIS (Yao et al. 2025, 'Your efficient RL framework secretly brings you off-policy RL training')",
          family="truncated-IS",
          source="truncated IS (Ionides 2008); Yao et al. 2025 'Your efficient RL framework secretly brings you "
                 "off-policy RL training'; verl rollout_is='token' threshold 2.0; slime TIS tis_clip 2",
          unbiased_for="biased: token ratios ignore the prefix weight (token IS) and truncation drops the mass "
                       "above C; exactly REINFORCE on-policy",
          coefficient=truncated_coefficient, optional_inputs=("rollout_log_probs",), domains=TRUNCATED,
          differences=ROLLOUT_RS)
def tis_token(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", cap=2.0,
              clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, *, rollout_log_probs=None):
    """Token TIS: loss_t = -sg[min(rho_t, C)] A log pi(y_t|s_t), C = 2 (three-policy: min(pi_old/mu, C) x PPO-clip).

    Source: verl rollout correction, rollout_is="token", rollout_is_threshold=2.0 (bypass loss_type="reinforce" for
    the two-policy form, decoupled_token_is for the three-policy form); slime TIS (tis_clip = 2).
    """
    num, den = _behaviour(log_prob, old_log_prob, rollout_log_probs)
    raw = torch.exp(token_log_ratio(num, den))
    weight = torch.clamp(raw, max=cap)
    loss, metrics = _apply(weight, log_prob, old_log_prob, advantages, response_mask, loss_agg_mode,
                           rollout_log_probs, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    metrics.update({"is_weight_mean": masked_mean(weight, response_mask).detach(),
                    "is_ratio_max": _masked_max(raw, response_mask).detach(),
                    "is_trunc_frac": masked_mean((raw > cap).to(raw.dtype), response_mask).detach()})
    return loss, metrics


@register("tis_seq", label="Seq TIS", unbiased="on-policy",
          paper="Truncated sequence IS (Ionides 2008); verl rollout correction",
          family="truncated-IS",
          source="truncated sequence IS (Ionides 2008); verl rollout_is='sequence' threshold 2.0 (bypass_pg_is, "
                 "decoupled_seq_is presets); TRL vllm_importance_sampling_mode='sequence_truncate'",
          unbiased_for="biased downward where W > C: E_mu[min(W, C) A grad log pi] = grad J - E_mu[(W - C)+ A grad "
                       "log pi]; unbiased if W <= C surely; exactly REINFORCE on-policy",
          coefficient=truncated_coefficient, optional_inputs=("rollout_log_probs",), ratio="sequence",
          domains=TRUNCATED, differences=ROLLOUT_RS)
def tis_seq(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", cap=2.0,
            clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, *, rollout_log_probs=None):
    """Sequence TIS: loss_t = -sg[min(W, C)] A log pi(y_t|s_t), W = pi(y)/mu(y), C = 2 (three-policy: W from pi_old/mu).

    Source: verl rollout correction, rollout_is="sequence", rollout_is_threshold=2.0 (bypass_pg_is, decoupled_seq_is).
    """
    num, den = _behaviour(log_prob, old_log_prob, rollout_log_probs)
    L = sequence_log_weight(num, den, response_mask)  # [B, 1], clamped to [-20, 20]
    raw = torch.exp(L)
    weight = torch.clamp(raw, max=cap)
    loss, metrics = _apply(weight, log_prob, old_log_prob, advantages, response_mask, loss_agg_mode,
                           rollout_log_probs, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    metrics.update({"is_weight_mean": _seq_mean(weight, response_mask).detach(),
                    "is_ratio_max": _masked_max(raw.squeeze(-1), response_mask.sum(-1)).detach(),
                    "is_trunc_frac": _seq_mean((raw > cap).to(raw.dtype), response_mask).detach()})
    return loss, metrics


@register("mis_token", label="IcePop", unbiased="on-policy",
          paper="IcePop (Ling team 2025, Ring-1T 'Every Step Evolves')",
          family="masked-IS",
          source="IcePop (Ling team 2025, 'Every Step Evolves', Ring-1T): mask [0.5, 5]; verl rollout_is_threshold="
                 "'0.5_5.0'; slime IcePop",
          unbiased_for="biased: token ratios ignore the prefix weight, and masked tokens (rho outside [lo, hi]) "
                       "contribute nothing; exactly REINFORCE on-policy",
          coefficient=masked_coefficient, optional_inputs=("rollout_log_probs",), domains=MASKED, check=_band,
          differences="masked tokens keep their place in the denominators (verl's IcePop threshold '0.5_5.0' does "
                      "the same; its rollout_rs rejection removes them from response_mask); " + ROLLOUT_RS)
def mis_token(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", lower=0.5, upper=5.0,
              clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, *, rollout_log_probs=None):
    """Token MIS / IcePop: loss_t = -sg[rho_t 1[lo <= rho_t <= hi]] A log pi(y_t|s_t), [lo, hi] = [0.5, 5].

    Source: IcePop (Ling team 2025, Ring-1T) alpha = 0.5, beta = 5; verl rollout_is_threshold="0.5_5.0";
    slime IcePop.
    """
    num, den = _behaviour(log_prob, old_log_prob, rollout_log_probs)
    raw = torch.exp(token_log_ratio(num, den))
    keep = (raw >= lower) & (raw <= upper)
    weight = torch.where(keep, raw, torch.zeros_like(raw))
    loss, metrics = _apply(weight, log_prob, old_log_prob, advantages, response_mask, loss_agg_mode,
                           rollout_log_probs, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    metrics.update({"is_weight_mean": masked_mean(weight, response_mask).detach(),
                    "is_ratio_max": _masked_max(raw, response_mask).detach(),
                    "is_mask_frac": masked_mean((~keep).to(raw.dtype), response_mask).detach()})
    return loss, metrics


@register("mis_seq", label="Seq MIS", unbiased="on-policy",
          paper="Sequence masked IS (verl rollout correction; TRL sequence_mask)",
          family="masked-IS",
          source="sequence masked IS: verl rollout_is='sequence', rollout_is_threshold='0.5_2.0' (the band of its "
                 "Seq-MIS preset); TRL vllm_importance_sampling_mode='sequence_mask' (lower=0, upper=3)",
          unbiased_for="biased: drops whole sequences with W outside [lo, hi]: E = grad J - E_pi[1[W not in "
                       "[lo, hi]] A grad log pi(y)]; exactly REINFORCE on-policy",
          coefficient=masked_seq_coefficient, optional_inputs=("rollout_log_probs",), ratio="sequence",
          domains=MASKED, check=_band,
          differences="masked sequences keep their place in the denominators, as verl's rollout_is_threshold "
                      "'0.5_2.0' does; verl's Seq-MIS preset (decoupled_seq_is_rs) gives the same weights but its "
                      "seq_sum_k1 rejection removes the sequences from response_mask; " + ROLLOUT_RS)
def mis_seq(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", lower=0.5, upper=2.0,
            clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, *, rollout_log_probs=None):
    """Sequence MIS: loss_t = -sg[W 1[lo <= W <= hi]] A log pi(y_t|s_t), W = pi(y)/mu(y), [lo, hi] = [0.5, 2].

    Source: verl rollout_is="sequence", rollout_is_threshold="0.5_2.0" (the band of its Seq-MIS preset
    decoupled_seq_is_rs); TRL's default sequence_mask is lower=0, upper=3.
    """
    num, den = _behaviour(log_prob, old_log_prob, rollout_log_probs)
    raw = torch.exp(sequence_log_weight(num, den, response_mask))  # [B, 1]
    keep = (raw >= lower) & (raw <= upper)
    weight = torch.where(keep, raw, torch.zeros_like(raw))
    loss, metrics = _apply(weight, log_prob, old_log_prob, advantages, response_mask, loss_agg_mode,
                           rollout_log_probs, clip_ratio_low, clip_ratio_high, clip_ratio_c)
    metrics.update({"is_weight_mean": _seq_mean(weight, response_mask).detach(),
                    "is_ratio_max": _masked_max(raw.squeeze(-1), response_mask.sum(-1)).detach(),
                    "is_mask_frac": _seq_mean((~keep).to(raw.dtype), response_mask).detach()})
    return loss, metrics


__all__ = ["masked_coefficient", "masked_seq_coefficient", "ppo_loss_matrix", "tis_seq", "tis_token", "mis_seq",
           "mis_token", "truncated_coefficient"]
