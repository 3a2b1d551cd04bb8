"""Sequence rejection: verl's rollout rejection sampling (geometric-mean, k3 and product bands, composable with token
or sequence TIS as verl's presets compose them), SkyRL's geometric sequence mask, and off-policy sequence masking
(OPSM, DeepSeek-V3.2) as TRL and slime ship it.

verl 0.9.1 rollout correction (``verl/trainer/ppo/rollout_corr_helper.py`` ``compute_rollout_rejection_mask`` and
``compute_rollout_correction_weights``; the loss in ``core_algos.py`` ``compute_policy_loss_bypass_mode`` /
``compute_policy_loss_vanilla``). With r_t = pi(y_t|s_t) / mu(y_t|s_t), log r clamped to [-20, 20] and verl's
k1 = -log r (a KL(mu||pi) estimate, so its "ratio" bands bound mu/pi), a sequence is kept when

    geo_rs   (rollout_rs="seq_mean_k1")   log lower <= mean_t(-log r_t) <= log upper        [0.999, 1.001]
    k3_rs    (rollout_rs="seq_mean_k3")   mean_t(r_t - 1 - log r_t) <= threshold             0.01
    seq_rs   (rollout_rs="seq_sum_k1")    log lower <= sum_t(-log r_t) <= log upper           [0.5, 2.0]

(the means divide by n + 1e-8, as verl's masked_mean). An IS weight may be composed in (``tis``: "token" min(r_t, C)
or "sequence" min(W, C), C = ``cap``), and the loss is verl's:

- two-policy batch (verl's bypass mode, old_log_prob = mu): r is pi/mu from the CURRENT policy (detached), the
  rejection zeroes the sequence's tokens but verl's trainer keeps them in its global token count, and
  ``bypass_loss`` picks verl's loss_type: "reinforce" (-sg[w] A log pi on kept tokens) or "ppo_clip" (verl's
  vanilla PPO on pi/mu, eps 0.2/0.2, dual clip 3; verl applies no IS weight with ppo_clip, so ``tis`` is ignored);
- three-policy batch (verl's decoupled mode, ``rollout_log_probs`` = mu, old_log_prob = pi_old): r = pi_old/mu;
  the rejection removes the sequences from response_mask before the trainer counts tokens (so token-mean divides by
  the kept tokens) and the loss is w x vanilla PPO on pi/pi_old.

verl's presets map onto these (lab.estimators.presets; ``lab estimators --preset verl``).

SkyRL 0.4.0 (``skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py`` ``compute_sequence_mask``, 7f45370,
and ``ppo_utils.py`` ``ppo_policy_loss``): ``sequence_mask_metric="geometric"`` keeps a sequence when
exp(mean_t log(pi_old/mu)) lies in [geo_mask_low, geo_mask_high] = [0.99, 1.01] (the ratio itself, not verl's
inverse, and a band 10 times wider than verl's preset), applied only with rollout log-probs; the loss is its
"regular" PPO (eps 0.2/0.2, no dual clip) on pi/pi_old, and a masked sequence keeps its tokens in the token-mean
denominator (SkyRL scales the advantages by the original token count).

OPSM (DeepSeek-V3.2, arXiv 2512.02556, eq. 9): drop a sequence with negative advantage whose mean token
log(mu/pi) exceeds delta.
- TRL 1.16.0 (``trl/trainer/grpo_trainer.py`` ``get_off_policy_mask`` and ``_compute_loss``): mu = the sampler's
  log-probs when there are any (``rollout_log_probs``), else ``old_log_prob``; pi detached; keep if A >= 0 or
  KL <= delta (``off_policy_mask_threshold``, off by default; TRL's docs suggest 0.5, the default here). The mask
  multiplies TRL's default loss ("dapo": PPO clip 0.2 / 0.28, no dual clip, token-mean) and, with vLLM log-probs,
  TRL's default correction (``vllm_importance_sampling_mode="sequence_mask"``: exp(sum_t log(pi_old/mu)) zeroed
  above ``vllm_importance_sampling_clip_max`` = 3).
- slime (``slime/utils/ppo_utils.py`` ``compute_opsm_mask``, THUDM/slime 2c6323b; ``--opsm-delta`` default 1e-4
  in ``slime/utils/arguments.py``): the KL is against the trainer's old log-probs (pi_old, not the sampler's),
  a sequence is dropped if A < 0 and KL > delta, and the loss is slime's PPO (eps 0.2 / 0.2, no dual clip) averaged
  per sample (seq-mean-token-mean). With delta = 1e-4 nearly every stale negative-advantage sequence is dropped: the
  two defaults differ by a factor of 5000 and the zoo measures both.
"""
from __future__ import annotations

import math

from lab.lazy import torch

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.contract import ordered
from lab.estimators.policy_gradient import LOG_RATIO_BOUND, sequence_log_weight, token_log_ratio
from lab.estimators.registry import register
from lab.estimators.truncation import PPO, _band, _seq_mean, ppo_loss_matrix

VERL_EPS = 1e-8  # verl_F.masked_mean divides by mask.sum() + 1e-8


# ----------------------------------------------------------------------------------------------- statistics
def _seq_sum(x, mask):
    return torch.where(mask > 0, x * mask, torch.zeros((), dtype=x.dtype)).sum(-1, keepdim=True)


def _seq_mean_verl(x, mask):
    return _seq_sum(x, mask) / (mask.sum(-1, keepdim=True) + VERL_EPS)


def rejection_keep(log_ratio, mask, rule: str, lower: float, upper: float):
    """verl's sequence rejection: a [B, 1] bool, True where the sequence is kept (``log_ratio`` = log r per token)."""
    lr = torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if rule == "seq_mean_k3":
        return _seq_mean_verl(torch.exp(lr) - 1.0 - lr, mask) <= upper
    stat = _seq_mean_verl(-lr, mask) if rule == "seq_mean_k1" else _seq_sum(-lr, mask)
    return (stat >= math.log(lower)) & (stat <= math.log(upper))


def is_weight(log_ratio, mask, tis: str, cap: float):
    """verl's truncated IS weight from log r: per token min(r_t, C), per sequence min(W, C), or 1 ("none")."""
    if tis == "token":
        return torch.clamp(torch.exp(token_log_ratio(log_ratio, torch.zeros_like(log_ratio))), max=cap)
    if tis == "sequence":
        return torch.clamp(torch.exp(sequence_log_weight(log_ratio, torch.zeros_like(log_ratio), mask)), max=cap)
    return torch.ones_like(log_ratio)


def rollout_correction(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode, rule, lower, upper, tis,
                       cap, bypass_loss, clip_ratio_low, clip_ratio_high, clip_ratio_c, rollout_log_probs):
    """verl's rollout correction (IS weight x rejection) in bypass or decoupled mode; see the module docstring."""
    if rollout_log_probs is None:  # bypass mode: pi (current, detached) against mu = old_log_prob
        log_ratio = (log_prob - old_log_prob).detach()
        keep = rejection_keep(log_ratio, response_mask, rule, lower, upper).to(log_prob.dtype)
        if bypass_loss == "reinforce":
            loss_mat = -is_weight(log_ratio, response_mask, tis, cap).detach() * advantages * log_prob
        else:
            loss_mat, _, _ = ppo_loss_matrix(log_prob, old_log_prob, advantages, clip_ratio_low, clip_ratio_high,
                                             clip_ratio_c)
        loss = agg_loss(loss_mat * keep, response_mask, loss_agg_mode)  # rejected tokens stay in the counts
    else:  # decoupled mode: pi_old / mu decides; the rejected sequences leave response_mask
        log_ratio = (old_log_prob - rollout_log_probs).detach()
        keep = rejection_keep(log_ratio, response_mask, rule, lower, upper).to(log_prob.dtype)
        loss_mat, _, _ = ppo_loss_matrix(log_prob, old_log_prob, advantages, clip_ratio_low, clip_ratio_high,
                                         clip_ratio_c)
        loss = agg_loss(is_weight(log_ratio, response_mask, tis, cap).detach() * loss_mat, response_mask * keep,
                        loss_agg_mode)
    return loss, {"rs_masked_frac": _seq_mean(1 - keep, response_mask).detach(),
                  "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}


# ----------------------------------------------------------------------------------------------- coefficients
def geometric_band_coefficient(ratio, advantage=None, lower=0.999, upper=1.001, **_):
    """Effective coefficient on A grad log pi as a function of the geometric-mean ratio g = exp(mean log r): 1 where
    verl keeps the sequence (1/g in [lower, upper]), else 0 (REINFORCE loss, no IS weight)."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    inverse = 1.0 / ratio
    return ((inverse >= lower) & (inverse <= upper)).to(torch.float64)


def k3_band_coefficient(ratio, advantage=None, threshold=0.01, **_):
    """Effective coefficient for a sequence whose tokens all have ratio r: 1 where r - 1 - log r <= threshold."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    return ((ratio - 1 - torch.log(ratio)) <= threshold).to(torch.float64)


def product_band_coefficient(ratio, advantage=None, lower=0.5, upper=2.0, cap=2.0, **_):
    """Effective coefficient as a function of W = pi(y)/mu(y): min(W, C) where 1/W lies in [lower, upper], else 0."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    inside = (1.0 / ratio >= lower) & (1.0 / ratio <= upper)
    return torch.where(inside, torch.clamp(ratio, max=cap), torch.zeros_like(ratio))


def skyrl_band_coefficient(ratio, advantage=None, geo_mask_low=0.99, geo_mask_high=1.01, **_):
    """SkyRL's geometric mask as a function of g = exp(mean log(pi_old/mu)): 1 inside [low, high], else 0."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    return ((ratio >= geo_mask_low) & (ratio <= geo_mask_high)).to(torch.float64)


def opsm_coefficient(ratio, advantage, delta=0.5, clip_ratio_low=0.2, clip_ratio_high=0.28, **_):
    """Effective coefficient on A grad log pi for a sequence whose tokens all have ratio rho = pi/mu: PPO's (rho where
    the clip lets the gradient pass), zeroed when A < 0 and mean log(mu/pi) = -log rho exceeds delta."""
    from lab.estimators.clipping import ppo_clip_coefficient

    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    advantage = torch.as_tensor(advantage, dtype=torch.float64)
    coef = ppo_clip_coefficient(ratio, advantage, clip_ratio_low, clip_ratio_high)
    dropped = (advantage < 0) & (-torch.log(ratio) > delta)
    return torch.where(dropped, torch.zeros_like(coef), coef)


def slime_opsm_coefficient(ratio, advantage, delta=1e-4, clip_ratio_low=0.2, clip_ratio_high=0.2, **_):
    """opsm_slime's coefficient: OPSM's with slime's defaults (delta 1e-4, eps 0.2 / 0.2)."""
    return opsm_coefficient(ratio, advantage, delta, clip_ratio_low, clip_ratio_high)


# ----------------------------------------------------------------------------------------------- registration
COMPOSE = {"tis": "one of none|token|sequence", "cap": "positive", "bypass_loss": "one of ppo_clip|reinforce", **PPO}
VERL_RS_SOURCE = ("verl 0.9.1 verl/trainer/ppo/rollout_corr_helper.py compute_rollout_rejection_mask (rollout_rs="
                  "{rule}) and compute_rollout_correction_weights; loss: core_algos.py compute_policy_loss_bypass_mode "
                  "/ compute_policy_loss_vanilla; presets in verl/trainer/config/algorithm.py RolloutCorrectionConfig")
VERL_RS_DIFFERENCES = ("rollout_is_batch_normalize is not implemented; IcePop ('lower_upper') IS thresholds are not "
                       "composed here (mis_token is verl's token IcePop); verl computes its weights and masks once per "
                       "batch outside the loss in decoupled mode, the lab inside it from the same log-probs")


@register("geo_rs", label="Geo-RS", paper="verl rollout correction ('When Speed Kills Stability', Liu et al. 2025)",
          unbiased="on-policy", family="rejection", source=VERL_RS_SOURCE.format(rule="seq_mean_k1"),
          unbiased_for="biased off-policy: drops every sequence whose geometric-mean ratio leaves [0.999, 1.001] "
                       "(token ratios and PPO clipping, or REINFORCE without weights, on the rest); exactly REINFORCE "
                       "on-policy",
          coefficient=geometric_band_coefficient, optional_inputs=("rollout_log_probs",), ratio="geometric",
          domains={"lower": "positive", "upper": "positive", **COMPOSE}, check=_band, differences=VERL_RS_DIFFERENCES)
def geo_rs(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", lower=0.999, upper=1.001,
           tis="none", cap=2.0, bypass_loss="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, *,
           rollout_log_probs=None):
    """Geo-RS: keep a sequence when exp(mean_t log(mu/pi)) lies in [0.999, 1.001]; verl's PPO or REINFORCE on the rest.

    Source: verl rollout_rs="seq_mean_k1", rollout_rs_threshold="0.999_1.001" (decoupled_geo_rs and bypass presets).
    """
    return rollout_correction(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode, "seq_mean_k1", lower,
                              upper, tis, cap, bypass_loss, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                              rollout_log_probs)


@register("k3_rs", label="K3-RS", paper="verl rollout correction ('When Speed Kills Stability', Liu et al. 2025)",
          unbiased="on-policy", family="rejection", source=VERL_RS_SOURCE.format(rule="seq_mean_k3"),
          unbiased_for="biased off-policy: drops every sequence whose mean token k3 divergence exceeds 0.01; exactly "
                       "REINFORCE on-policy",
          coefficient=k3_band_coefficient, optional_inputs=("rollout_log_probs",), ratio="geometric",
          domains={"threshold": "positive", **COMPOSE}, differences=VERL_RS_DIFFERENCES)
def k3_rs(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", threshold=0.01, tis="none",
          cap=2.0, bypass_loss="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, *,
          rollout_log_probs=None):
    """K3-RS: keep a sequence when mean_t(r_t - 1 - log r_t) <= 0.01; verl's PPO or REINFORCE on the rest.

    Source: verl rollout_rs="seq_mean_k3", rollout_rs_threshold=0.01 (decoupled_k3_rs, bypass_ppo_clip_k3_rs).
    """
    return rollout_correction(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode, "seq_mean_k3", 0.0,
                              threshold, tis, cap, bypass_loss, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                              rollout_log_probs)


@register("seq_rs", label="Seq-RS", paper="verl rollout correction ('When Speed Kills Stability', Liu et al. 2025)",
          unbiased="on-policy", family="rejection", source=VERL_RS_SOURCE.format(rule="seq_sum_k1"),
          unbiased_for="biased off-policy: drops every sequence whose weight leaves [0.5, 2] and truncates the rest "
                       "at C = 2; exactly REINFORCE on-policy",
          coefficient=product_band_coefficient, optional_inputs=("rollout_log_probs",), ratio="sequence",
          domains={"lower": "positive", "upper": "positive", **COMPOSE}, check=_band,
          differences=VERL_RS_DIFFERENCES + "; mis_seq zeroes the same sequences but keeps them in the counts")
def seq_rs(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", lower=0.5, upper=2.0,
           tis="sequence", cap=2.0, bypass_loss="reinforce", clip_ratio_low=0.2, clip_ratio_high=0.2,
           clip_ratio_c=3.0, *, rollout_log_probs=None):
    """Seq-MIS: keep a sequence when mu(y)/pi(y) lies in [0.5, 2]; sequence TIS (C = 2) on the rest.

    Source: verl rollout_rs="seq_sum_k1", rollout_rs_threshold="0.5_2.0" (decoupled_seq_is_rs).
    """
    return rollout_correction(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode, "seq_sum_k1", lower,
                              upper, tis, cap, bypass_loss, clip_ratio_low, clip_ratio_high, clip_ratio_c,
                              rollout_log_probs)


@register("geo_rs_skyrl", label="Geo mask (SkyRL)", paper="SkyRL off-policy correction, geometric sequence mask",
          unbiased="on-policy", family="rejection",
          source="SkyRL 0.4.0 skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py compute_sequence_mask "
                 "(7f45370), ppo_utils.py ppo_policy_loss (7fee019); OffPolicyCorrectionConfig geo_mask_low/high",
          unbiased_for="biased off-policy: PPO clipping on pi/pi_old, and sequences whose geometric-mean "
                       "pi_old/mu leaves [0.99, 1.01] dropped; exactly REINFORCE when pi = pi_old = mu",
          coefficient=skyrl_band_coefficient, inputs=("rollout_log_probs",), ratio="geometric",
          domains={"geo_mask_low": "positive", "geo_mask_high": "positive", "clip_ratio_low": "nonnegative",
                   "clip_ratio_high": "nonnegative"}, check=ordered("geo_mask_low", "geo_mask_high"),
          differences="SkyRL exponentiates in float32 (safe_exp_delta); here the inputs' precision (float32 or "
                      "float64)")
def geo_rs_skyrl(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", geo_mask_low=0.99,
                 geo_mask_high=1.01, clip_ratio_low=0.2, clip_ratio_high=0.2, *, rollout_log_probs):
    """SkyRL geometric mask: drop a sequence when exp(mean_t log(pi_old/mu)) leaves [0.99, 1.01]; PPO on pi/pi_old.

    Source: SkyRL 0.4.0 compute_sequence_mask (sequence_mask_metric="geometric") and ppo_policy_loss ("regular").
    """
    n = response_mask.sum(-1, keepdim=True).clamp(min=1.0)
    log_geo = _seq_sum(old_log_prob - rollout_log_probs, response_mask) / n
    geo = torch.exp(torch.clamp(log_geo, -LOG_RATIO_BOUND, LOG_RATIO_BOUND)).detach()
    keep = ((geo >= geo_mask_low) & (geo <= geo_mask_high)).to(log_prob.dtype)
    loss_mat, clipped, _ = ppo_loss_matrix(log_prob, old_log_prob, advantages, clip_ratio_low, clip_ratio_high, None)
    return agg_loss(loss_mat * keep, response_mask, loss_agg_mode), {
        "rs_masked_frac": _seq_mean(1 - keep, response_mask).detach(),
        "clipfrac": masked_mean(clipped, response_mask).detach(),
        "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}


def _opsm_keep(log_prob, mu_log_prob, advantages, mask, delta):
    """Keep unless A < 0 and the mean token log(mu/pi) exceeds delta (pi detached); [B, T] (per-token sign of A)."""
    n = mask.sum(-1, keepdim=True).clamp(min=1.0)
    kl = _seq_sum(mu_log_prob - log_prob.detach(), mask) / n
    return ~((advantages < 0) & (kl > delta)), kl


@register("opsm", label="OPSM", paper="DeepSeek-V3.2 off-policy sequence masking (arXiv 2512.02556)",
          unbiased="on-policy", family="rejection",
          source="TRL 1.16.0 trl/trainer/grpo_trainer.py GRPOTrainer.get_off_policy_mask and _compute_loss (loss_type "
                 "dapo, off_policy_mask_threshold); delta 0.5 from TRL's docs (docs/source/paper_index.md)",
          unbiased_for="biased off-policy: PPO clipping, and negative-advantage sequences with mean log(mu/pi) > 0.5 "
                       "dropped; exactly REINFORCE on-policy",
          coefficient=opsm_coefficient, optional_inputs=("rollout_log_probs",), ratio="geometric",
          domains={"delta": "nonnegative", "clip_ratio_low": "nonnegative", "clip_ratio_high": "nonnegative",
                   "vllm_cap": "positive or None"},
          differences="TRL does not clamp the token log-ratio (here [-20, 20]); TRL leaves OPSM off by default and its "
                      "docs suggest delta = 0.5; slime's opsm_slime uses 1e-4 and pi_old")
def opsm(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", delta=0.5,
         clip_ratio_low=0.2, clip_ratio_high=0.28, vllm_cap=3.0, *, rollout_log_probs=None):
    """OPSM (TRL): drop sequences with A < 0 and mean log(mu/pi) > 0.5; TRL's dapo loss (PPO 0.2 / 0.28) on the rest.

    Three-policy (``rollout_log_probs``): mu is the sampler, and TRL's default vLLM correction multiplies the loss
    (pi_old(y)/mu(y) zeroed above ``vllm_cap``; None: no correction). Source: TRL 1.16.0 GRPOTrainer.
    """
    mu = old_log_prob if rollout_log_probs is None else rollout_log_probs
    keep, kl = _opsm_keep(log_prob, mu, advantages, response_mask, delta)
    keep = keep.to(log_prob.dtype)
    loss_mat, clipped, _ = ppo_loss_matrix(log_prob, old_log_prob, advantages, clip_ratio_low, clip_ratio_high, None)
    if rollout_log_probs is not None and vllm_cap is not None:
        w = torch.exp(sequence_log_weight(old_log_prob, rollout_log_probs, response_mask)).detach()
        loss_mat = loss_mat * torch.where(w > vllm_cap, torch.zeros_like(w), w)
    return agg_loss(loss_mat * keep, response_mask, loss_agg_mode), {
        "opsm_masked_frac": masked_mean(1 - keep, response_mask).detach(),
        "clipfrac": masked_mean(clipped, response_mask).detach(),
        "seq_kl_mean": _seq_mean(kl, response_mask).detach(),
        "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}


@register("opsm_slime", label="OPSM (slime)", paper="DeepSeek-V3.2 off-policy sequence masking (arXiv 2512.02556)",
          unbiased="on-policy", family="rejection",
          source="slime slime/utils/ppo_utils.py compute_opsm_mask and compute_policy_loss (THUDM/slime 2c6323b); "
                 "slime/backends/megatron_utils/loss.py; --opsm-delta 1e-4 (slime/utils/arguments.py)",
          unbiased_for="biased off-policy: PPO clipping, and negative-advantage sequences with mean log(pi_old/pi) > "
                       "1e-4 dropped; exactly REINFORCE on-policy",
          coefficient=slime_opsm_coefficient, ratio="geometric",
          domains={"delta": "nonnegative", "clip_ratio_low": "nonnegative", "clip_ratio_high": "nonnegative"},
          differences="the token log-ratio is clamped to [-20, 20] (slime does not clamp); slime's KL is against its "
                      "trainer's pi_old (old_log_prob), never the sampler's")
def opsm_slime(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean", delta=1e-4,
               clip_ratio_low=0.2, clip_ratio_high=0.2):
    """OPSM (slime): drop sequences with A < 0 and mean log(pi_old/pi) > 1e-4; slime's PPO (0.2 / 0.2) on the rest.

    Source: slime compute_opsm_mask (slime/utils/ppo_utils.py) and its per-sample mean.
    """
    keep, kl = _opsm_keep(log_prob, old_log_prob, advantages, response_mask, delta)
    keep = keep.to(log_prob.dtype)
    loss_mat, clipped, _ = ppo_loss_matrix(log_prob, old_log_prob, advantages, clip_ratio_low, clip_ratio_high, None)
    return agg_loss(loss_mat * keep, response_mask, loss_agg_mode), {
        "opsm_masked_frac": masked_mean(1 - keep, response_mask).detach(),
        "clipfrac": masked_mean(clipped, response_mask).detach(),
        "seq_kl_mean": _seq_mean(kl, response_mask).detach(),
        "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}
