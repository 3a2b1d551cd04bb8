"""GVPO: Group Variance Policy Optimization (Zhang et al., arXiv 2504.19599, NeurIPS 2025), as the authors run it.

Formula (paper, eq. MSE form; official verl recipe ``compute_policy_loss_gvpo``), per group of k responses
y_1..y_k to one prompt with rewards R_i:

    R_theta,i = beta (log pi(y_i) - log pi_ref'(y_i))            sequence log-probs: sums over real tokens
    L_group   = 1/(k-1) sum_i 1/2 [ (R_theta,i - sg[mean_j R_theta,j]) - (R_i - mean_j R_j) ]^2,   beta = 0.1

pi_ref' is the previous-step (rollout) policy: the official code passes ``old_log_prob``, the log-probs the
trainer recomputes at the start of the update, not a frozen reference model (the authors' run script takes
train_batch_size 1024 / ppo_mini_batch_size 256 = 4 optimiser steps per rollout batch, all against the same
old_log_prob, with use_kl_loss=False). No importance weights, no clipping, no clamp of the log-ratio (the official
code has none).

What the official code does, and what this function does
- The group mean of R_theta is detached (gathered across ranks with ``.detach()``). Because the residuals
  e_i = (R_theta,i - mean R_theta) - (R_i - mean R) are centred in value, sum_i e_i * grad(mean R_theta) = 0,
  so the gradient equals that of the fully differentiable MSE (tests/test_gvpo.py checks both).
- The target is the Dr. GRPO advantage R_i - mean R (``adv_estimator=grpo``, ``norm_adv_by_std_in_grpo=False``),
  read back as the token-mean of the broadcast advantage. Here the rewards come in by name and are centred
  per group, so ``advantages`` is accepted only for the verl signature and ignored.
- Aggregation: the official per-micro-batch loss is the SUM of L_group over the groups in the micro-batch
  (sum over rows, divided by k-1); verl then scales each micro-batch by 1/gradient_accumulation and data
  parallelism averages over ranks, so one optimiser step's gradient is (m/k) * mean over groups of grad L_group,
  with m = ppo_micro_batch_size_per_gpu (16 with k = 4 in the authors' run script: a factor 4). This function
  returns the MEAN over the groups of the batch, i.e. the official loss with one group per micro-batch; multiply
  by m/k to reproduce the authors' exact scale (a constant: invisible to Adam up to its eps, visible to
  gradient-norm clipping). The mean keeps the expected gradient independent of the batch size (``grad_scale``).
- ``loss_agg_mode`` is validated but has no effect: the loss is sequence-level by construction (token log-probs
  summed, groups averaged). Its declared default, seq-mean-token-sum, is the mode whose target matches it: the
  on-policy expectation is beta * grad J, not beta/T * grad J, whatever mode a caller passes.

Gradient-weight form (``gvpo_weights``): with ell_i = log pi(y_i) - log pi_ref'(y_i),

    grad L_group = -beta/(k-1) sum_i w_i grad log pi(y_i),   w_i = (R_i - mean R) - beta (ell_i - mean ell).

The weights sum to zero in each group, which is how the partition function Z(x) cancels. Equivalently,
w_i = r_i - mean r with r = R - beta ell: REINFORCE on the KL-regularised reward with the group mean as baseline and
no importance weights, scaled by beta/(k-1). There is no one-argument coefficient(ratio, advantage) for the
registry (``coefficient=None``): w_i depends on the whole group through mean ell.

On-policy expected gradient (``grad_scale = beta``): sampling y_1..y_k i.i.d. from pi, with r = R - beta ell,
E[(r_i - mean r) grad log pi(y_i)] = (1 - 1/k) E_pi[r grad log pi] because the cross terms j != i vanish
(E_pi[grad log pi] = 0). Summing over i and dividing by k-1,

    E[-grad L_group] = beta E_pi[(R - beta ell) grad log pi] = beta grad_theta (J(pi) - beta KL(pi || pi_ref'))

(with pi_ref' held fixed); at pi = pi_ref' this is exactly beta grad J. The batch loss is a mean over groups whose
prompts are drawn uniformly, so the same holds for the batch. Off-policy, with groups drawn i.i.d. from any mu,
E[L_group] = 1/2 Var_mu(beta ell - R) (the unbiased sample variance in disguise): it is zero exactly when
beta ell - R is constant on mu's support, i.e. pi = pi_ref' exp(R/beta) / Z (Theorems 1 and 2).
"""
from __future__ import annotations

import operator

from lab.lazy import torch

from lab.errors import LabError
from lab.estimators.aggregation import check_mode, masked_mean
from lab.estimators.registry import register

DEFAULT_BETA = 0.1  # gvpo_beta in the authors' run script


def check_groups(batch_size: int, group_size, name: str = "GVPO", why: str = "its loss centres each group and "
                 "divides by k - 1") -> int:
    """The group size as an int; LabError unless the batch splits into whole groups of at least 2."""
    try:
        k = operator.index(group_size)
    except TypeError:
        raise LabError(f"{name} needs group_size as a whole number of responses per prompt, got {group_size!r}") \
            from None
    if k < 2:
        raise LabError(f"{name} needs at least 2 responses per prompt (group_size {k}): {why}; sample several "
                       f"responses per prompt (e.g. --group-size 4)")
    if batch_size % k:
        raise LabError(f"{name} needs the batch to split into whole groups: {batch_size} responses is not a multiple "
                       f"of group_size {k}; each run of group_size consecutive responses must share one prompt")
    return k


def _groups(x: torch.Tensor, k: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // k, k)


def gvpo_weights(rewards, seq_log_ratio, group_size: int, beta: float = DEFAULT_BETA) -> torch.Tensor:
    """GVPO's effective coefficient: w_i = (R_i - mean R) - beta (ell_i - mean ell), means within each group.

    ``rewards`` and ``seq_log_ratio`` (ell = log pi(y) - log pi_ref'(y), summed over tokens) have shape [..., B],
    consecutive runs of ``group_size`` sharing a prompt. grad L = -beta/(k-1) sum_i w_i grad log pi(y_i) per
    group (so a batch loss averaged over G groups has coefficient -beta w_i / ((k-1) G) on grad log pi(y_i)).
    """
    rewards = torch.as_tensor(rewards)
    seq_log_ratio = torch.as_tensor(seq_log_ratio, dtype=rewards.dtype if rewards.is_floating_point() else None)
    k = check_groups(rewards.shape[-1], group_size)
    r, ell = _groups(rewards, k), _groups(seq_log_ratio, k)
    w = (r - r.mean(-1, keepdim=True)) - beta * (ell - ell.mean(-1, keepdim=True))
    return w.reshape(rewards.shape)


@register("gvpo", label="GVPO", paper="GVPO (Zhang et al. 2025, arXiv 2504.19599)", unbiased="other",
          family="group-regression",
          source="GVPO (Zhang et al., arXiv 2504.19599, NeurIPS 2025); official verl recipe compute_policy_loss_gvpo",
          unbiased_for="beta * grad [J - beta KL(pi||pi_ref')] on-policy (beta * grad J at pi = pi_ref'); off-policy "
                       "not an estimate of grad J: its expected loss 1/2 Var_mu(beta log(pi/pi_ref') - R) is minimised "
                       "exactly at pi_ref' exp(R/beta)/Z for any mu covering pi_ref' (Theorem 2)",
          inputs=("rewards", "group_size"), grad_scale=lambda hyper: hyper["beta"], ratio="sequence", fixed_agg=True,
          domains={"beta": "positive"},
          differences="the batch loss is the mean over its groups; the official recipe sums the groups of a "
                      "micro-batch (a constant factor m/k, 4 in the authors' run script)")
def gvpo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-sum", beta=DEFAULT_BETA, *,
         rewards, group_size):
    """GVPO: 1/(k-1) sum_i 1/2 [(R_th,i - sg[mean R_th]) - (R_i - mean R)]^2 per group, R_th = beta log(pi/pi_old)(y).

    The batch loss is the mean over its groups (Zhang et al. 2025; official verl recipe, see the module docstring).

    ``rewards`` [B] sequence rewards, ``group_size`` k >= 2 (consecutive groups of k responses share a prompt);
    ``old_log_prob`` is pi_ref' (the rollout / previous-step policy); ``advantages`` is unused (the targets are
    the group-centred rewards); ``loss_agg_mode`` is checked but has no effect (a sequence-level loss).
    """
    check_mode(loss_agg_mode)
    B = log_prob.shape[-2]
    k = check_groups(B, group_size)
    if tuple(rewards.shape) != (B,):
        raise LabError(f"GVPO needs one reward per response: rewards of shape {tuple(rewards.shape)} for a batch of "
                       f"{B} responses; pass sequence rewards of shape [{B}]")
    # ell_i [B]; where() rather than a product alone, so that inf/NaN on padding cannot leak in (0 * inf = NaN)
    seq_log_ratio = torch.where(response_mask > 0, (log_prob - old_log_prob) * response_mask, 0.0).sum(-1)
    r_theta = _groups(beta * seq_log_ratio, k)
    target = _groups(rewards.to(log_prob.dtype), k)
    target = target - target.mean(-1, keepdim=True)
    residual = (r_theta - r_theta.detach().mean(-1, keepdim=True)) - target  # [G, k]
    loss = (0.5 * residual.pow(2).sum(-1) / (k - 1)).mean()
    metrics = {
        "ppo_kl": masked_mean(torch.where(response_mask > 0, old_log_prob - log_prob, 0.0), response_mask).detach(),
        "residual_rms": residual.detach().pow(2).mean().sqrt(),
        "seq_log_ratio_abs_max": seq_log_ratio.detach().abs().max(),
    }
    return loss, metrics
