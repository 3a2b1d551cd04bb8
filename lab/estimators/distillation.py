"""On-policy distillation (OPD) as policy-gradient RL: vanilla OPD, vOPD (full and top-k baselines), and the
full-vocabulary and top-k analytic KL losses.

Notation: student pi_S = pi_theta (``log_prob``, ``logits``: they carry the gradient), frozen teacher pi_T
(``teacher_log_prob``: log pi_T of the sampled token; ``teacher_logits`` [B, T, V]), state s_t = (x, y_<t).
The objective is the reverse KL of the student from the teacher along the student's own rollouts,

    KL(pi_S(y) || pi_T(y)) = E_{y ~ pi_S}[ sum_t KL_t ],   KL_t = sum_v pi_S(v|s_t) (log pi_S(v|s_t) - log pi_T(v|s_t)),

read as RL with the per-token reward r_t = log pi_T(y_t|s_t) - log pi_S(y_t|s_t) (so E[r_t | s_t] = -KL_t).
There are two gradient targets (the lab measures every estimator against both; lab.studies.distillation):

- per-token ("states held fixed"): grad_theta sum_y sg[pi_S(y)] sum_t m_t KL_t(theta): the visitation of states
  is frozen; this is what immediate-reward OPD and the analytic per-token KL losses estimate;
- sequence-level: grad_theta KL(pi_S(y) || pi_T(y)) = the per-token target plus the state-distribution term
  E[sum_t grad log pi_S(y_t|s_t) sum_{t' > t} r_t'] (reward-to-go), estimated by OPD with ``return_to_go=True``.

Estimators (all "-grad loss" are ascent directions on -KL; sg[.] is detach):

- ``opd``        vanilla OPD (Thinking Machines 2025; tinker-cookbook kl_discount_factor = 0, slime, verl
                 ``use_policy_gradient``): loss_t = -sg[r_t] log pi_S(y_t|s_t); with ``return_to_go=True`` the reward
                 is replaced by sum_{t' >= t} m_t' r_t' (tinker's discount factor 1).
- ``vopd``       vOPD (Oh et al. 2026, arXiv 2605.07865): A_t = sg[r_t + KL_t], loss_t = -A_t log pi_S(y_t|s_t).
                 -KL_t is the exact state value V(s_t) = E[r_t | s_t]: a state-only baseline, so no bias.
- ``vopd_topk``  the release's top-k baseline (``kl_top_k = 100``): KL_t replaced by the KL between the student and
                 the teacher renormalised over the student's top-k tokens at s_t. Still a state-only baseline: unbiased
                 for any k (k >= V is ``vopd``).
- ``kl_full``    the full-vocabulary analytic loss (the release's "full-vocab OPD", GKD-style reverse KL):
                 loss_t = KL_t(theta), differentiated through the student's whole distribution: no sampling noise
                 within a state, O(V) per token.
- ``kl_topk``    the top-k restricted loss (the release's ``opd_top_k``): loss_t = KL between the student and the
                 teacher both renormalised over the student's top-k tokens (ids chosen without gradient), gradient
                 through the renormalised student. Biased: it ignores everything outside the top-k.

Conventions and what the reference code does:
- Aggregation is verl's global token-mean by default (tinker, slime, verl and the vOPD release's TRL trainer all
  normalise by the batch's token count); every ``loss_agg_mode`` of lab.estimators.aggregation is accepted.
- The reward uses the current student's log-probs (``log_prob``, detached), as verl's k1 distillation loss does.
  tinker computes it from the sampler's log-probs and trains with its importance-sampling loss; on-policy they agree.
- ``old_log_prob`` (the sampler's log-probs mu) is used only with ``importance_weights=True``: every sampled-token
  coefficient is multiplied by sg[rho_t], rho_t = exp(clamp(log pi_S - log mu, -20, 20)), whose gradient is tinker's
  ``importance_sampling`` loss -rho_t A. It corrects the token, not the state distribution: off-policy every
  estimator here is biased for both targets. The analytic losses ignore ``old_log_prob``.
- ``advantages`` is accepted for the verl signature and unused: to add a task reward (slime, the vOPD release), add
  the task loss; both losses are linear in their advantages, -(A + r) log pi = -A log pi - r log pi.
- No clamps: verl's optional ``loss_max_clamp`` / ``log_prob_min_clamp`` and the release's distillation temperature
  (``kd_temperature``, 1 by default) are not applied; log-softmax keeps extreme logits finite.
"""
from __future__ import annotations

from lab.lazy import torch

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.policy_gradient import token_log_ratio
from lab.estimators.registry import register

PER_TOKEN = "per-token (states-held-fixed) reverse-KL gradient"
SEQUENCE = "sequence-level reverse-KL gradient"


# ---- building blocks (plain functions of tensors, differentiable where their inputs are) -------------------------

def reverse_kl(logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(pi_S || pi_T) per position over the full vocabulary: [..., V] x [..., V] -> [...]."""
    lp = torch.log_softmax(logits, -1)
    lq = torch.log_softmax(teacher_logits, -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def topk_reverse_kl(logits: torch.Tensor, teacher_logits: torch.Tensor, k: int):
    """KL over the student's top-k tokens, both distributions renormalised there (the vOPD release's form).

    Returns (kl [...], student_mass [...]): the top-k ids are chosen from the detached student logits; the KL is
    differentiable through ``logits`` (the renormalised student), the mass is the student's probability of the top-k.
    """
    k = min(int(k), logits.shape[-1])
    ids = torch.topk(logits.detach(), k, dim=-1).indices
    lp = torch.log_softmax(logits, -1).gather(-1, ids)
    lq = torch.log_softmax(teacher_logits, -1).gather(-1, ids)
    mass_lp = torch.logsumexp(lp, -1, keepdim=True)
    lp_hat, lq_hat = lp - mass_lp, lq - torch.logsumexp(lq, -1, keepdim=True)
    return (lp_hat.exp() * (lp_hat - lq_hat)).sum(-1), mass_lp.squeeze(-1).exp()


def reward_to_go(rewards: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """sum_{t' >= t} m_t' r_t' along the last axis (a reversed cumulative sum)."""
    masked = rewards * response_mask
    return masked.flip(-1).cumsum(-1).flip(-1)


def _weights(log_prob, old_log_prob, importance_weights: bool):
    if not importance_weights:
        return torch.ones_like(log_prob)
    return torch.exp(token_log_ratio(log_prob, old_log_prob)).detach()


def _check_k(k) -> None:
    from lab.errors import LabError

    if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
        raise LabError(f"top-k size k must be a positive whole number, got {k!r}")


# ---- the estimators ---------------------------------------------------------------------------------------------

@register("opd", label="OPD", paper="On-policy distillation (Thinking Machines 2025)", unbiased="other",
          family="distillation",
          source="Thinking Machines on-policy distillation (2025); tinker-cookbook, slime, verl use_policy_gradient",
          unbiased_for=f"on-policy: the {PER_TOKEN} (immediate reward); with return_to_go=True the {SEQUENCE}",
          inputs=("teacher_log_prob",), domains={"return_to_go": "bool", "importance_weights": "bool"},
          differences="REINFORCE with the detached reward; verl's use_policy_gradient feeds the same reward as the "
                      "advantage of its policy loss (vanilla PPO clip by default: the same gradient on-policy)")
def opd(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", *, teacher_log_prob,
        return_to_go=False, importance_weights=False):
    """Vanilla OPD: loss_t = -sg[r_t] log pi_S(y_t|s_t), r_t = log pi_T(y_t|s_t) - log pi_S(y_t|s_t) (discount 0)."""
    reward = (teacher_log_prob - log_prob).detach() * response_mask
    coef = reward_to_go(reward, response_mask) if return_to_go else reward
    weight = _weights(log_prob, old_log_prob, importance_weights)
    loss = agg_loss(-(weight * coef) * log_prob, response_mask, loss_agg_mode)
    return loss, {"reverse_kl_k1": masked_mean(-reward, response_mask),
                  "advantage_sq": masked_mean(coef**2, response_mask)}


@register("vopd", label="vOPD", paper="vOPD (Oh et al. 2026, arXiv 2605.07865)", unbiased="other",
          family="distillation", source="vOPD (Oh et al. 2026, arXiv 2605.07865), full-vocabulary baseline",
          unbiased_for=f"on-policy: the {PER_TOKEN} (the baseline -KL_t depends on the state only)",
          inputs=("teacher_log_prob", "logits", "teacher_logits"), domains={"importance_weights": "bool"})
def vopd(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", *, teacher_log_prob, logits,
         teacher_logits, importance_weights=False):
    """vOPD: loss_t = -sg[r_t + KL_t] log pi_S(y_t|s_t), KL_t the full-vocabulary KL(pi_S || pi_T) at s_t."""
    kl = reverse_kl(logits.detach(), teacher_logits).detach()
    adv = (teacher_log_prob - log_prob + kl).detach() * response_mask
    weight = _weights(log_prob, old_log_prob, importance_weights)
    loss = agg_loss(-(weight * adv) * log_prob, response_mask, loss_agg_mode)
    return loss, {"reverse_kl_full": masked_mean(kl, response_mask), "advantage_sq": masked_mean(adv**2, response_mask)}


@register("vopd_topk", label="vOPD top-k", paper="vOPD (Oh et al. 2026, arXiv 2605.07865)", unbiased="other",
          family="distillation", source="vOPD release (holi-lab/vOPD), kl_top_k = 100",
          unbiased_for=f"on-policy: the {PER_TOKEN}, for any k (the top-k KL is a state-only baseline)",
          inputs=("teacher_log_prob", "logits", "teacher_logits"),
          domains={"k": "positive integer", "importance_weights": "bool"})
def vopd_topk(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", *, teacher_log_prob,
              logits, teacher_logits, k=100, importance_weights=False):
    """vOPD, top-k baseline: loss_t = -sg[r_t + KL^k_t] log pi_S(y_t|s_t), KL^k_t renormalised on the student's
    top-k."""
    _check_k(k)
    kl_k, mass = topk_reverse_kl(logits.detach(), teacher_logits, k)
    adv = (teacher_log_prob - log_prob + kl_k).detach() * response_mask
    weight = _weights(log_prob, old_log_prob, importance_weights)
    loss = agg_loss(-(weight * adv) * log_prob, response_mask, loss_agg_mode)
    return loss, {"reverse_kl_topk": masked_mean(kl_k.detach(), response_mask),
                  "student_topk_mass": masked_mean(mass.detach(), response_mask),
                  "advantage_sq": masked_mean(adv**2, response_mask)}


@register("kl_full", label="Full-vocab KL", unbiased="other",
          paper="vOPD (Oh et al. 2026, arXiv 2605.07865), full-vocabulary reverse KL",
          family="distillation",
          source="full-vocabulary reverse KL (GKD, Agarwal et al. 2024; the vOPD release's full-vocab OPD)",
          unbiased_for=f"on-policy: the {PER_TOKEN} (exact at every sampled state)",
          inputs=("logits", "teacher_logits"))
def kl_full(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", *, logits, teacher_logits):
    """Full-vocabulary KL loss: loss_t = KL(pi_S(.|s_t) || pi_T(.|s_t)), differentiated through every student logit."""
    kl = reverse_kl(logits, teacher_logits)
    return agg_loss(kl, response_mask, loss_agg_mode), {"reverse_kl_full": masked_mean(kl.detach(), response_mask)}


@register("kl_topk", label="Top-k KL", unbiased="other",
          paper="vOPD (Oh et al. 2026, arXiv 2605.07865), top-k reverse KL",
          family="distillation", source="top-k restricted reverse KL (the vOPD release's opd_top_k)",
          unbiased_for="biased for both targets: the renormalised top-k KL ignores the student's mass outside its "
                       "top-k (exact only when k >= V)",
          inputs=("logits", "teacher_logits"), domains={"k": "positive integer"})
def kl_topk(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", *, logits, teacher_logits,
            k=100):
    """Top-k KL loss: loss_t = KL over the student's top-k tokens, student and teacher renormalised there."""
    _check_k(k)
    kl_k, mass = topk_reverse_kl(logits, teacher_logits, k)
    return agg_loss(kl_k, response_mask, loss_agg_mode), {
        "reverse_kl_topk": masked_mean(kl_k.detach(), response_mask),
        "student_topk_mass": masked_mean(mass.detach(), response_mask)}
