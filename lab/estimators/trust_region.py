"""Divergence trust regions: DPPO's binary masks (verl ``dppo_tv`` / ``dppo_kl``, SkyRL ``dppo``) and prime-rl's
default loss (the DPPO mask plus a squared log-ratio penalty).

DPPO ("Rethinking the Trust Region in LLM Reinforcement Learning", arXiv 2602.04879; verl 0.9.1
``verl/trainer/ppo/core_algos.py`` ``compute_policy_loss_dppo_tv`` / ``compute_policy_loss_dppo_kl``). With
p = pi(y_t|s_t), q = mu(y_t|s_t) and rho = p / q (the log-ratio clamped to [-20, 20]):

    keep_t (TV) = [p - q <= delta_high]                          if A > 0,   [p - q >= -delta_low]            else
    keep_t (KL) = [D_t <= delta_high or p <= q]                  if A > 0,   [D_t <= delta_low or p >= q]      else
                  D_t = q log(q / p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))   (the binary KL of the token)
    loss_t      = -A sg[min(rho, C)] keep_t log pi(y_t|s_t)                       (truncated IS, C = clip_ratio_c)

The mask is a trust region on the token's probability, not on its ratio: a rare token (small q) may move far in
ratio, a likely one only a little. Gradient: min(rho, C) keep A grad log pi. Defaults are the DPPO authors' run in verl
(``examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh``, verl-project/verl 7bc80c00, 2026-08-17): delta 0.15 (TV)
or 0.05 (KL) on both sides, clip_ratio_c = 10000 (no truncation in effect), loss_agg_mode seq-mean-token-sum-norm.
verl reads delta from clip_ratio_low / clip_ratio_high and the cap from clip_ratio_c, so an ActorConfig left at its
defaults runs delta 0.2 and a cap of 3 (the function's own fallback, 20, applies only to a config without the field).
SkyRL 0.4.0 ``dppo`` (``skyrl/backends/skyrl_train/utils/ppo_utils.py``, commit 7fee019) keeps rho in the graph
without truncation (the same gradient below the cap) and defaults to delta 0.2 (TV) / 0.05 (KL).

Which behaviour policy. Two-policy batch: mu = ``old_log_prob``. With ``rollout_log_probs`` the sampler's log-probs
are mu for both the ratio and the mask (the paper's section 5.2 and SkyRL: "use rollout logprobs as behavior policy
for both ratio and mask"); verl's decoupled mode instead keeps pi_old in the loss and multiplies its rollout
correction weights in.

prime-rl's default loss (``src/prime_rl/trainer/rl/loss.py`` ``default_loss_fn``, PrimeIntellect-ai/prime-rl
e48a538, 2026-07-01; defaults ``DefaultLossConfig`` in ``packages/prime-rl-configs/.../trainer.py``, 29e4222):

    loss_t = -keep_t (TV mask, delta 0.2 / 0.2) adv_tau A rho + kl_tau (log rho)^2,   adv_tau = 1, kl_tau = 1e-3

summed over tokens and divided by the global number of loss tokens (token-mean), rho = pi / mu_inference in the
graph (no pi_old: prime-rl trains on the inference engine's log-probs). Gradient:
keep adv_tau A rho grad log pi - 2 kl_tau log(rho) grad log pi: the penalty pulls every token back towards mu,
masked or not.
"""
from __future__ import annotations

from lab.lazy import torch

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.policy_gradient import LOG_RATIO_BOUND, token_log_ratio
from lab.estimators.registry import register

BINARY_KL_EPS = 1e-8  # verl and SkyRL: log((1 - q + 1e-8) / (1 - p + 1e-8))


def _behaviour(old_log_prob, rollout_log_probs):
    return old_log_prob if rollout_log_probs is None else rollout_log_probs


def binary_kl(log_p, log_q):
    """D = q (log q - log p) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8)): the KL of the token's Bernoulli."""
    p, q = torch.exp(log_p), torch.exp(log_q)
    return q * (log_q - log_p) + (1 - q) * torch.log((1 - q + BINARY_KL_EPS) / (1 - p + BINARY_KL_EPS))


def dppo_keep(log_prob, mu_log_prob, advantages, kind: str, delta_low: float, delta_high: float):
    """DPPO's binary mask (TV or KL form) as a float tensor, computed without gradient."""
    log_p, log_q = log_prob.detach(), mu_log_prob.detach()
    p, q = torch.exp(log_p), torch.exp(log_q)
    if kind == "tv":
        keep_pos, keep_neg = (p - q) <= delta_high, (p - q) >= -delta_low
    else:
        d = binary_kl(log_p, log_q)
        keep_pos, keep_neg = (d <= delta_high) | (p <= q), (d <= delta_low) | (p >= q)
    return torch.where(advantages > 0, keep_pos, keep_neg).to(log_prob.dtype)


def _dppo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode, kind, delta_low, delta_high, cap,
          rollout_log_probs):
    mu = _behaviour(old_log_prob, rollout_log_probs)
    ratio = torch.exp(token_log_ratio(log_prob, mu))
    keep = dppo_keep(log_prob, mu, advantages, kind, delta_low, delta_high)
    weight = torch.clamp(ratio, max=cap).detach()
    loss = agg_loss(-advantages * weight * log_prob * keep, response_mask, loss_agg_mode)
    return loss, {"clipfrac": masked_mean(1 - keep, response_mask).detach(),
                  "is_trunc_frac": masked_mean((ratio > cap).to(ratio.dtype) * keep, response_mask).detach(),
                  "ppo_kl": masked_mean(mu - log_prob, response_mask).detach()}


def dppo_coefficient(ratio, advantage, clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=10000.0,
                     mu_prob=0.5, kind="tv", **_):
    """Effective coefficient on A grad log pi: min(rho, C) keep(rho), for a token whose sampler probability is
    ``mu_prob`` (DPPO's mask is on probabilities: p = mu_prob rho)."""
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    advantage = torch.as_tensor(advantage, dtype=torch.float64)
    q = torch.full_like(ratio, float(mu_prob))
    p = torch.clamp(q * ratio, max=1.0)
    if kind == "tv":
        keep = torch.where(advantage > 0, p - q <= clip_ratio_high, p - q >= -clip_ratio_low)
    else:
        d = binary_kl(torch.log(p), torch.log(q))
        keep = torch.where(advantage > 0, (d <= clip_ratio_high) | (p <= q), (d <= clip_ratio_low) | (p >= q))
    return torch.where(keep, torch.clamp(ratio, max=clip_ratio_c), torch.zeros_like(ratio))


def dppo_kl_coefficient(ratio, advantage, clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=10000.0,
                        mu_prob=0.5, **_):
    """dppo_kl's coefficient: min(rho, C) keep_KL(rho) for a token with sampler probability ``mu_prob``."""
    return dppo_coefficient(ratio, advantage, clip_ratio_low, clip_ratio_high, clip_ratio_c, mu_prob, kind="kl")


def prime_coefficient(ratio, advantage, dppo_mask_low=0.2, dppo_mask_high=0.2, adv_tau=1.0, kl_tau=1e-3,
                      mu_prob=0.5, **_):
    """The advantage part of prime-rl's coefficient: adv_tau rho keep_TV(rho) (the penalty adds -2 kl_tau log rho
    grad log pi, which does not scale with A)."""
    return adv_tau * dppo_coefficient(ratio, advantage, dppo_mask_low, dppo_mask_high, float("inf"), mu_prob)


DPPO_DOMAINS = {"clip_ratio_low": "nonnegative", "clip_ratio_high": "nonnegative", "clip_ratio_c": "positive"}
DPPO_SOURCE = ("DPPO (arXiv 2602.04879); verl 0.9.1 verl/trainer/ppo/core_algos.py compute_policy_loss_dppo_{kind}; "
               "defaults from verl-project/verl examples/dppo_trainer/run_qwen3_30b_a3b_megatron.sh (7bc80c00); SkyRL "
               "0.4.0 dppo (skyrl/backends/skyrl_train/utils/ppo_utils.py, 7fee019)")
DPPO_PAPER = "DPPO, 'Rethinking the Trust Region in LLM RL' (arXiv 2602.04879)"
DPPO_DIFFERENCES = ("with rollout_log_probs the sampler is mu for both the ratio and the mask (the paper's section "
                    "5.2, SkyRL); verl's decoupled mode keeps pi_old and multiplies its rollout-correction weights in. "
                    "verl with ActorConfig defaults runs delta 0.2 and cap 3.0; SkyRL defaults to delta 0.2 (TV) and "
                    "keeps the ratio in the graph without a cap (the same gradient below the cap)")


@register("dppo_tv", label="DPPO-TV", paper=DPPO_PAPER, unbiased="on-policy",
          family="trust-region", source=DPPO_SOURCE.format(kind="tv"),
          unbiased_for="biased off-policy: token ratios (no prefix weight), tokens outside the TV trust region "
                       "masked; exactly REINFORCE on-policy (p = q keeps every token)",
          coefficient=dppo_coefficient, optional_inputs=("rollout_log_probs",), domains=DPPO_DOMAINS,
          differences=DPPO_DIFFERENCES)
def dppo_tv(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-sum-norm",
            clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=10000.0, *, rollout_log_probs=None):
    """DPPO-Binary-TV: loss_t = -A sg[min(rho_t, C)] keep_t log pi, keep = [pi - mu <= 0.15] (A > 0), [>= -0.15] else.

    Source: DPPO (arXiv 2602.04879); verl 0.9.1 compute_policy_loss_dppo_tv; the authors' verl example script.
    """
    return _dppo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode, "tv", clip_ratio_low,
                 clip_ratio_high, clip_ratio_c, rollout_log_probs)


@register("dppo_kl", label="DPPO-KL", paper=DPPO_PAPER, unbiased="on-policy",
          family="trust-region", source=DPPO_SOURCE.format(kind="kl"),
          unbiased_for="biased off-policy: token ratios (no prefix weight), tokens whose binary KL leaves the trust "
                       "region in the advantage's direction masked; exactly REINFORCE on-policy",
          coefficient=dppo_kl_coefficient, optional_inputs=("rollout_log_probs",), domains=DPPO_DOMAINS,
          differences=DPPO_DIFFERENCES.replace("delta 0.2 (TV)", "delta 0.05 (KL)"))
def dppo_kl(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-sum-norm",
            clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=10000.0, *, rollout_log_probs=None):
    """DPPO-Binary-KL: loss_t = -A sg[min(rho_t, C)] keep_t log pi, keep = binary KL <= 0.05 or moving against A.

    Source: DPPO (arXiv 2602.04879); verl 0.9.1 compute_policy_loss_dppo_kl; the authors' verl example script.
    """
    return _dppo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode, "kl", clip_ratio_low,
                 clip_ratio_high, clip_ratio_c, rollout_log_probs)


@register("dppo_prime", label="prime-rl DPPO+KL", paper="prime-rl default loss: DPPO (arXiv 2602.04879) + Kimi-K2.5 "
          "KL (arXiv 2602.02276)", unbiased="on-policy", family="trust-region",
          source="prime-rl src/prime_rl/trainer/rl/loss.py default_loss_fn (PrimeIntellect-ai/prime-rl e48a538); "
                 "DefaultLossConfig (packages/prime-rl-configs/src/prime_rl/configs/trainer.py, 29e4222)",
          unbiased_for="biased off-policy: token ratios, the TV mask and the (log rho)^2 penalty; exactly REINFORCE "
                       "on-policy (the penalty's gradient vanishes at rho = 1)",
          coefficient=prime_coefficient, optional_inputs=("rollout_log_probs",),
          domains={"dppo_mask_low": "nonnegative", "dppo_mask_high": "nonnegative", "adv_tau": "nonnegative",
                   "kl_tau": "nonnegative"},
          differences="the log-ratio inside rho is clamped to [-20, 20] (prime-rl does not clamp; they differ only "
                      "beyond e^20); prime-rl has no pi_old: its mu is the inference engine's log-probs, here "
                      "rollout_log_probs when given, else old_log_prob", homogeneous=False)
def dppo_prime(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", dppo_mask_low=0.2,
               dppo_mask_high=0.2, adv_tau=1.0, kl_tau=1e-3, *, rollout_log_probs=None):
    """prime-rl: loss_t = -keep_t adv_tau A rho_t + kl_tau (log rho_t)^2, keep = DPPO-TV (0.2, 0.2), rho in the graph.

    Source: prime-rl default_loss_fn (src/prime_rl/trainer/rl/loss.py, e48a538).
    """
    mu = _behaviour(old_log_prob, rollout_log_probs)
    log_ratio = log_prob - mu
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    keep = dppo_keep(log_prob, mu, advantages, "tv", dppo_mask_low, dppo_mask_high)
    loss_mat = -keep * adv_tau * advantages * ratio + kl_tau * log_ratio ** 2
    return agg_loss(loss_mat, response_mask, loss_agg_mode), {
        "clipfrac": masked_mean(1 - keep, response_mask).detach(),
        "mismatch_kl": masked_mean((ratio - torch.log(ratio) - 1).detach(), response_mask),
        "ppo_kl": masked_mean(mu - log_prob, response_mask).detach()}
