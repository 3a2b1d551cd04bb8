"""REINFORCE-form losses without ratios: DRO's quadratic log-ratio penalty and GPG (verl 0.9.1).

- DRO (verl ``compute_policy_loss_dro``, added in verl-project/verl ddfbf4e, 2026-08-04, ``docs/algo/dro.md``):
  loss_t = -(A log pi(y_t|s_t) - beta/2 (log pi - log pi_old)^2). Gradient (-A + beta (log pi - log pi_old))
  grad log pi: REINFORCE pulled back towards pi_old by a proximal term, no ratio and no clip. verl ships no default
  (``policy_loss.dro_beta`` must be set); beta = 0.05 here is the value of verl's own test of the loss
  (``tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py``).
- GPG (Chu et al. 2025, "GPG: A Simple and Strong Reinforcement Learning Baseline", arXiv 2504.02546; verl
  ``compute_policy_loss_gpg``): loss_t = -A log pi(y_t|s_t), the REINFORCE loss; GPG's difference is its advantage
  (verl ``compute_gpg_outcome_advantage``: alpha (R - group mean) with alpha = B / (responses with a non-zero
  reward)), which is ``--advantage gpg`` (lab.advantages).
"""
from __future__ import annotations

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.policy_gradient import unit_coefficient
from lab.estimators.registry import register


def dro_coefficient(ratio, advantage, beta=0.05, **_):
    """Effective coefficient on A grad log pi: 1 - beta log(rho) / A (the penalty does not scale with A)."""
    import torch

    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    advantage = torch.as_tensor(advantage, dtype=torch.float64)
    safe = torch.where(advantage != 0, advantage, torch.ones_like(advantage))
    return torch.where(advantage != 0, 1 - beta * torch.log(ratio) / safe, torch.ones_like(safe))


@register("dro", label="DRO", paper="DRO: REINFORCE with a quadratic log-ratio penalty (verl docs/algo/dro.md)",
          unbiased="on-policy", family="regularized",
          source="verl 0.9.1 verl/trainer/ppo/core_algos.py compute_policy_loss_dro (verl-project/verl ddfbf4e); beta "
                 "0.05 from verl's tests/trainer/ppo/test_dynamic_policy_losses_on_cpu.py",
          unbiased_for="biased off-policy: no importance weight, and a pull towards pi_old; exactly REINFORCE "
                       "on-policy (the penalty's gradient vanishes at pi = pi_old)",
          coefficient=dro_coefficient, domains={"beta": "positive"}, homogeneous=False,
          differences="verl has no default beta (it must be set); 0.05 is the value its own test uses")
def dro(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", beta=0.05):
    """DRO: loss_t = -(A log pi_t - beta/2 (log pi_t - log pi_old_t)^2), beta = 0.05.

    Source: verl 0.9.1 compute_policy_loss_dro.
    """
    log_ratio = log_prob - old_log_prob
    loss = agg_loss(-(log_prob * advantages - 0.5 * beta * log_ratio ** 2), response_mask, loss_agg_mode)
    return loss, {"ppo_kl": masked_mean(-log_ratio, response_mask).detach()}


@register("gpg", label="GPG", paper="GPG (Chu et al. 2025, arXiv 2504.02546)", unbiased="on-policy",
          family="on-policy",
          source="verl 0.9.1 verl/trainer/ppo/core_algos.py compute_policy_loss_gpg and compute_gpg_outcome_advantage",
          unbiased_for="grad J on-policy only, as REINFORCE (with --advantage gpg: alpha grad J, alpha = B / the "
                       "responses with a non-zero reward)",
          coefficient=unit_coefficient,
          differences="the loss is REINFORCE's; GPG's advantage is --advantage gpg")
def gpg(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean"):
    """GPG: loss_t = -A log pi(y_t|s_t) (REINFORCE; GPG's advantage is --advantage gpg).

    Source: verl 0.9.1 compute_policy_loss_gpg.
    """
    loss = agg_loss(-log_prob * advantages, response_mask, loss_agg_mode)
    return loss, {"ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}
