"""KL-to-reference penalties on the sampled token (Schulman 2020, "Approximating KL divergence"; verl kl_penalty).

With d = log pi(y_t|s_t) - log pi_ref(y_t|s_t) on a token sampled from pi, and r = pi/pi_ref = e^d:

    k1 = d                      E_pi[k1] = KL(pi || pi_ref)   (unbiased, high variance, can be negative)
    k2 = d^2 / 2                E_pi[k2] ~ KL for small d     (biased value, always >= 0)
    k3 = e^(-d) - 1 + d         E_pi[k3] = KL(pi || pi_ref)   (unbiased, >= 0: verl "low_var_kl")

These are penalty LOSSES (verl use_kl_loss: loss = agg(k(d)), kl_loss_type = k1 | k2 | k3/low_var_kl), not
policy-gradient estimators: they take no advantage. What matters is what their GRADIENT estimates when the token is
sampled from pi and the sample is held fixed (the autograd gradient), per state s:

    grad k1 = grad log pi(a)                  E_pi = sum_a grad pi(a) = 0.
        The k1 loss has zero expected gradient on-policy: it adds only noise. (k1 works as a REWARD, as in verl's
        in-reward KL: -beta d enters the advantage and the score-function gradient then carries it.)
    grad k2 = d grad log pi(a)                E_pi = sum_a grad pi(a) (log pi(a) - log pi_ref(a))
                                                   = grad KL(pi || pi_ref)    (the term sum_a pi grad log pi is 0).
        The k2 loss is the unbiased gradient of the per-token reverse KL, even though its value is biased.
    grad k3 = (1 - pi_ref(a)/pi(a)) grad log pi(a)
                                              E_pi = sum_a (pi(a) - pi_ref(a)) grad log pi(a)
                                                   = -sum_a pi_ref(a) grad log pi(a) = grad KL(pi_ref || pi).
        The k3 loss, the popular "low-variance" choice (GRPO, verl low_var_kl), has the gradient of the FORWARD KL
        KL(pi_ref || pi), not of the reverse KL whose value it estimates. Inside verl's clamp only (below).

Numerics as verl: k3 is computed as exp(kl) - kl - 1 with kl = -d clamped to [-20, 20] and the result clamped to
[-10, 10]. Since k3 >= 0, the clamp is a cap at 10 that also zeroes the gradient: for d > ~11 (pi/pi_ref > 6e4) and
for d < ~-2.6 (pi/pi_ref < ~0.073) the k3 loss gives no gradient, so tokens that pi has nearly abandoned relative
to pi_ref are not pushed back. k1 and k2 are not clamped (neither is verl's). verl also ships "k3+" (value k3,
gradient k2 by a straight-through trick); use kl_k2 here for its gradient.

The registry ``coefficient`` of a penalty is d k / d log pi(y_t) as a function of r = pi/pi_ref (a descent
coefficient; the advantage is ignored): 1 (k1), log r (k2), 1 - 1/r (k3, 0 where k3 > 10).
"""
from __future__ import annotations

from lab.lazy import torch

from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.registry import register

K3_LOG_RATIO_BOUND = 20.0  # verl clamps kl = -d to [-20, 20] before exponentiating
K3_VALUE_BOUND = 10.0  # and the k3 value to [-10, 10]


def k1_value(d):
    return d


def k2_value(d):
    return 0.5 * d**2


def k3_value(d):
    """verl low_var_kl: kl = clamp(-d, -20, 20); clamp(exp(kl) - kl - 1, -10, 10)."""
    kl = torch.clamp(-d, -K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    return torch.clamp(torch.exp(kl) - kl - 1, -K3_VALUE_BOUND, K3_VALUE_BOUND)


def k1_coefficient(ratio, advantage=None, **_):
    """d k1 / d log pi = 1."""
    return torch.ones_like(torch.as_tensor(ratio, dtype=torch.float64))


def k2_coefficient(ratio, advantage=None, **_):
    """d k2 / d log pi = d = log(pi/pi_ref)."""
    return torch.log(torch.as_tensor(ratio, dtype=torch.float64))


def k3_coefficient(ratio, advantage=None, **_):
    """d k3 / d log pi = 1 - pi_ref/pi = 1 - 1/r, and 0 where verl's clamp k3 <= 10 is active."""
    d = torch.log(torch.as_tensor(ratio, dtype=torch.float64))
    inside = (torch.exp(-d) - 1 + d) <= K3_VALUE_BOUND
    return torch.where(inside, 1 - torch.exp(-d), torch.zeros_like(d))


def _penalty(k, log_prob, ref_log_prob, response_mask, loss_agg_mode):
    values = k(log_prob - ref_log_prob)
    return agg_loss(values, response_mask, loss_agg_mode), {"kl_mean": masked_mean(values, response_mask).detach()}


@register("kl_k1", label="KL k1", paper="Schulman 2020, 'Approximating KL divergence'", unbiased="other",
          family="kl-penalty", source="Schulman 2020 'Approximating KL divergence' (k1); verl kl_loss_type=k1",
          unbiased_for="value: KL(pi||pi_ref) per token on-policy; gradient: E_pi[grad k1] = 0 (not a KL gradient; "
                       "pure noise as a loss)",
          coefficient=k1_coefficient, inputs=("ref_log_prob",))
def kl_k1(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", *, ref_log_prob):
    """KL penalty k1 = d = log pi - log pi_ref; its gradient has expectation 0 under pi.

    Source: Schulman 2020, "Approximating KL divergence"; verl kl_loss_type="k1".
    """
    return _penalty(k1_value, log_prob, ref_log_prob, response_mask, loss_agg_mode)


@register("kl_k2", label="KL k2", paper="Schulman 2020, 'Approximating KL divergence'", unbiased="other",
          family="kl-penalty", source="Schulman 2020 'Approximating KL divergence' (k2); verl kl_loss_type=k2",
          unbiased_for="gradient: E_pi[grad k2] = grad KL(pi||pi_ref) per state, exactly (its value is biased)",
          coefficient=k2_coefficient, inputs=("ref_log_prob",))
def kl_k2(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", *, ref_log_prob):
    """KL penalty k2 = d^2 / 2; E_pi[grad k2] = grad of the reverse KL(pi || pi_ref).

    Source: Schulman 2020, "Approximating KL divergence"; verl kl_loss_type="k2" / "mse".
    """
    return _penalty(k2_value, log_prob, ref_log_prob, response_mask, loss_agg_mode)


@register("kl_k3", label="KL k3", unbiased="other",
          paper="Schulman 2020, 'Approximating KL divergence'; GRPO (arXiv 2402.03300)",
          family="kl-penalty",
          source="Schulman 2020 'Approximating KL divergence' (k3); verl low_var_kl (clamped to [-10, 10]); GRPO",
          unbiased_for="value: KL(pi||pi_ref) per token on-policy; gradient: E_pi[grad k3] = grad KL(pi_ref||pi), the "
                       "FORWARD KL (inside the k3 <= 10 clamp)",
          coefficient=k3_coefficient, inputs=("ref_log_prob",))
def kl_k3(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", *, ref_log_prob):
    """KL penalty k3 = exp(-d) - 1 + d (verl low_var_kl); E_pi[grad k3] = grad of the forward KL(pi_ref || pi).

    Source: Schulman 2020, "Approximating KL divergence"; verl kl_loss_type="low_var_kl" / "k3" (value clamped to
    [-10, 10]); GRPO (Shao et al. 2024) KL term.
    """
    return _penalty(k3_value, log_prob, ref_log_prob, response_mask, loss_agg_mode)
