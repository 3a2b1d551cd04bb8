"""VESPO (Shen et al., arXiv 2602.10693 v3; code github.com/FloyedShen/VESPO, recipe/vespo/code/core_algos.py):
REINFORCE with a detached sequence-level coefficient phi(W) = W^k exp(lambda (1 - W)).

    loss_t = -sg[phi(W)] A log pi(y_t|s_t),  aggregated token-mean;  grad = phi(W) A grad log pi(y)
    W = exp(L) = pi(y)/mu(y),  L = clamp(sum_t m_t clamp(delta_t, -20, 20), -20, 20)   (a plain sum, no length norm)
    (k, lambda) = (k_pos, lambda_pos) = (2, 3) if A >= 0,  (k_neg, lambda_neg) = (3, 2) if A < 0

No PPO clip and no ratio in the graph: the only path of the gradient is log pi.

The kernel. Any sequence reshaping phi(W) defines an implicit proposal Q = mu phi(W) / Z with Z = E_mu[phi(W)];
VESPO's variational problem min_Q KL(Q||mu) - alpha E_Q[log W] s.t. E_Q[W] <= C has the solution
Q* ~ mu W^alpha exp(-lambda W); the deployed kernel is normalised so that phi(1) = 1. Useful facts (derived here and
checked in tests/test_vespo.py):

- maximum at W = k/lambda: phi_max = (k/lambda)^k exp(lambda - k)  (1.208 for (2, 3); 1.242 for (3, 2));
- surrogate f with phi(W) = W f'(W): f'(W) = W^(k-1) e^(lambda(1-W)), so f(W) = int_0^W f' =
  e^lambda lambda^-k gamma_lower(k, lambda W)  (k > 0);
- Proposition 3.1: phi(w) <= K w for every w > 0 with K = sup_w phi(w)/w, hence phi^2 <= K phi W pointwise and
  E_mu[phi(W)^2] <= K E_mu[phi(W) W] = Z K C with C = E_Q[W]. For the NORMALISED kernel, phi(w)/w =
  w^(k-1) e^(lambda(1-w)) peaks at w = (k-1)/lambda, so K = ((k-1)/lambda)^(k-1) exp(lambda - k + 1) for k > 1
  ((2, 3): e^2/3 = 2.463; (3, 2): 1); K = e^lambda for k = 1 (approached as w -> 0, not attained); K = inf for
  k < 1 (phi(w)/w -> inf as w -> 0: no bound). The e^lambda normalisation is inside K; the unnormalised kernel
  W^k e^(-lambda W) would have K e^-lambda.

What the reference code does, and this module does the same:

- delta_t = log pi - log pi_old clamped to [-20, 20]; L = sum_t m_t delta_t; then L is clamped to [-20, 20] once,
  after the sampler correction below is added.
- phi is computed in log space, log phi = lambda + k log W - lambda W, with log W = log(max(W, 1e-8)) (a floor at
  L = log 1e-8 = -18.42 inside the log only: W itself keeps its clamped value in -lambda W), lambda clamped below
  at 1e-4; phi = exp(log phi) with NaN and +-inf set to 0.
- the advantage sign, and so (k, lambda), is read from the first token's advantage (verl broadcasts one
  advantage per sequence; A = 0 takes the A >= 0 kernel).
- sampler/trainer mismatch (three policies: pi, pi_old = ``old_log_prob``, pi_sampler): the per-token
  log(pi_old/pi_sampler) is clamped to [log 1e-8, 20] (the code takes log(max(weight, 1e-8)) then clamps to
  [-20, 20]), masked, summed over tokens and added to L in log space, so that W = pi(y)/pi_sampler(y). Here the
  sampler's own per-token log-probs come in as ``rollout_log_probs``; the code receives verl's
  ``rollout_is_weights`` instead. Those equal exp(old - rollout) only when verl computes them per token and
  does not truncate them (threshold above every ratio): a truncated weight folds in min(rho_t, C), and a
  SEQUENCE-level weight broadcast to every token would be summed T times, raising the correction to the power
  T. Taking per-token log-probs makes that bug impossible here (tests/test_vespo.py shows both).

Where the sources disagree (the code wins): the reference function's docstring lists (k, lambda) defaults
(2, 1.5) / (4, 2.5); its code, the run scripts, the paper and TRL's port use (2, 3) / (3, 2). The run scripts pass
the values under ``policy_loss.gamma_is.*`` while the code reads ``policy_loss.vespo.*``, so the runs use the code's
defaults: the same (2, 3) / (3, 2). The paper writes the kernel with W; the code's floor at W = 1e-8 inside the log
is a numerical detail the paper does not state (it changes phi only for L < -18.42, where phi is below
e^(lambda - 18.42 k); for k = 1 it lifts phi(w)/w above K = e^lambda there, so Proposition 3.1 could only fail
through sequences with L < -18.42: lab.studies.vespo_bound reports their mu-mass as ``floor_mass``). Not in the code:
lambda <= 0 or k < 0 raise LabError here (the code clamps lambda to 1e-4 silently and accepts any k).

Unbiasedness: none. E_mu[phi(W) A grad log pi] = Z E_Q[A grad log pi]: a gradient under the implicit proposal
Q ~ mu phi(W), between mu and pi, not pi's gradient (equal to REINFORCE's only on-policy, where W = phi = 1).
"""
from __future__ import annotations

import math
import numbers

import numpy as np
from lab.lazy import torch
from lab.lazy import LazyModule
from lab.errors import LabError
from lab.estimators.aggregation import agg_loss, masked_mean
from lab.estimators.policy_gradient import LOG_RATIO_BOUND, token_log_ratio
from lab.estimators.registry import register

special = LazyModule("scipy.special")  # gamma, gammainc, xlogy: loaded on first use

K_POS, LAMBDA_POS, K_NEG, LAMBDA_NEG = 2.0, 3.0, 3.0, 2.0  # the authors' code and run scripts
W_FLOOR = 1e-8  # the reference takes log(max(W, 1e-8)) and log(max(rollout weight, 1e-8))
LOG_W_FLOOR = math.log(W_FLOOR)
LAMBDA_FLOOR = 1e-4  # the reference clamps lambda below at 1e-4


def check_kernel(k: float, lam: float) -> None:
    """Refuse kernel parameters outside the family (k >= 0, lambda > 0, both finite)."""
    if not (isinstance(k, numbers.Real) and isinstance(lam, numbers.Real)):
        raise LabError(f"VESPO kernel parameters must be numbers, got k={k!r}, lambda={lam!r}")
    if not (math.isfinite(k) and k >= 0):
        raise LabError(f"VESPO's k must be a finite number >= 0, got {k}; the paper's defaults are 2 (A >= 0) and 3")
    if not (math.isfinite(lam) and lam > 0):
        raise LabError(f"VESPO's lambda must be a finite positive number, got {lam}; the defaults are 3 and 2")


def _check_w(W) -> None:
    if np.any(np.asarray(W) < 0) or np.any(np.isnan(np.asarray(W, dtype=float))):
        raise LabError("VESPO's kernel takes importance weights W >= 0; got a negative or NaN weight")


def log_phi(W, k: float, lam: float):
    """log phi(W) = lambda + k log W - lambda W (the normalised kernel; -inf at W = 0 for k > 0).

    Accepts a float, a numpy array or a torch tensor and returns the same kind.
    """
    check_kernel(k, lam)
    if torch.is_tensor(W):
        return lam + torch.special.xlogy(torch.as_tensor(float(k), dtype=W.dtype), W) - lam * W
    _check_w(W)
    out = lam + special.xlogy(k, np.asarray(W, dtype=np.float64)) - lam * np.asarray(W, dtype=np.float64)
    return float(out) if np.ndim(out) == 0 else out


def phi(W, k: float = K_POS, lam: float = LAMBDA_POS):
    """VESPO's kernel phi(W) = W^k exp(lambda (1 - W)), phi(1) = 1 (float, numpy array or torch tensor)."""
    lp = log_phi(W, k, lam)
    return torch.exp(lp) if torch.is_tensor(lp) else (float(np.exp(lp)) if np.ndim(lp) == 0 else np.exp(lp))


def argmax_phi(k: float, lam: float) -> float:
    """Where phi peaks: W = k / lambda."""
    check_kernel(k, lam)
    return k / lam


def phi_max(k: float, lam: float) -> float:
    """max_W phi(W) = (k/lambda)^k exp(lambda - k), at W = k/lambda (k = 0: e^lambda, approached as W -> 0)."""
    check_kernel(k, lam)
    return float(math.exp(special.xlogy(k, k / lam) + lam - k))


def bound_constant(k: float, lam: float) -> float:
    """K = sup_{w > 0} phi(w)/w for the normalised kernel: Proposition 3.1's constant.

    phi(w)/w = w^(k-1) e^(lambda(1-w)): for k > 1 it peaks at w = (k-1)/lambda, K = ((k-1)/lambda)^(k-1)
    e^(lambda-k+1); for k = 1 it decreases from e^lambda at w -> 0, K = e^lambda; for k < 1 it is unbounded, K = inf.
    """
    check_kernel(k, lam)
    if k < 1:
        return math.inf
    if k == 1:
        return math.exp(lam)
    return float(math.exp((k - 1) * math.log((k - 1) / lam) + lam - k + 1))


def argmax_bound(k: float, lam: float) -> float:
    """Where phi(w)/w peaks: w = (k-1)/lambda for k > 1 (0 for k <= 1, where the supremum is approached at 0)."""
    check_kernel(k, lam)
    return max(k - 1, 0.0) / lam


def surrogate(W, k: float = K_POS, lam: float = LAMBDA_POS):
    """f(W) = e^lambda lambda^-k gamma_lower(k, lambda W), the objective whose W f'(W) is phi(W) (k > 0)."""
    check_kernel(k, lam)
    if k <= 0:
        raise LabError("VESPO's surrogate f(W) = int_0^W phi(u)/u du diverges for k = 0; use k > 0")
    _check_w(W)
    W = np.asarray(W, dtype=np.float64)
    out = math.exp(lam) * lam ** (-k) * special.gammainc(k, lam * W) * special.gamma(k)
    return float(out) if np.ndim(out) == 0 else out


def sequence_coefficient(L, k, lam):
    """The reference's phi on a (clamped) sequence log-weight L: exp(lambda + k max(L, log 1e-8) - lambda e^L).

    ``k`` and ``lam`` may be tensors broadcasting with ``L`` (sign-dependent parameters); non-finite -> 0.
    """
    W = torch.exp(L)
    lam = torch.clamp(torch.as_tensor(lam, dtype=L.dtype), min=LAMBDA_FLOOR)
    out = torch.exp(lam + k * torch.clamp(L, min=LOG_W_FLOOR) - lam * W)
    return torch.nan_to_num(out, nan=0.0, posinf=0.0, neginf=0.0)


def vespo_coefficient(ratio, advantage=None, k_pos=K_POS, lambda_pos=LAMBDA_POS, k_neg=K_NEG, lambda_neg=LAMBDA_NEG):
    """Effective coefficient on A grad log pi(y): phi(W) with (k, lambda) by the sign of A (None: A >= 0).

    ``ratio`` is the SEQUENCE weight W = pi(y)/mu(y); log W is clamped to [-20, 20] as in the estimator.
    """
    for k, lam in ((k_pos, lambda_pos), (k_neg, lambda_neg)):
        check_kernel(k, lam)
    ratio = torch.as_tensor(ratio, dtype=torch.float64)
    L = torch.clamp(torch.log(ratio), -LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    pos = torch.ones_like(ratio, dtype=torch.bool) if advantage is None else \
        torch.as_tensor(advantage, dtype=torch.float64) >= 0
    k = torch.where(pos, L.new_tensor(float(k_pos)), L.new_tensor(float(k_neg)))
    lam = torch.where(pos, L.new_tensor(float(lambda_pos)), L.new_tensor(float(lambda_neg)))
    return sequence_coefficient(L, k, lam)


def sequence_log_weight(log_prob, old_log_prob, response_mask, rollout_log_probs=None):
    """The reference's L: clamp(sum_t m_t clamp(delta_t, -20, 20) [+ sum_t m_t clamp(log pi_old/pi_sampler)], -20, 20).

    Returns (L [..., B, 1], the summed sampler correction [..., B, 1] or None).
    """
    L = (token_log_ratio(log_prob, old_log_prob) * response_mask).sum(-1, keepdim=True)
    correction = None
    if rollout_log_probs is not None:
        log_tis = torch.clamp(old_log_prob - rollout_log_probs, LOG_W_FLOOR, LOG_RATIO_BOUND)
        correction = (log_tis * response_mask).sum(-1, keepdim=True)
        L = L + correction
    return torch.clamp(L, -LOG_RATIO_BOUND, LOG_RATIO_BOUND), correction


@register("vespo", label="VESPO", paper="VESPO (Shen et al. 2026, arXiv 2602.10693)", unbiased="on-policy",
          family="sequence-reshaping",
          source="VESPO (Shen et al., arXiv 2602.10693); FloyedShen/VESPO recipe/vespo/code/core_algos.py",
          unbiased_for="biased: E[phi(W) A grad log pi] is Z times the gradient under the implicit proposal "
                       "Q ~ mu phi(W), not grad J (equal to REINFORCE on-policy, where W = phi = 1)",
          coefficient=vespo_coefficient, optional_inputs=("rollout_log_probs",), ratio="sequence",
          domains={"k_pos": "nonnegative", "lambda_pos": "positive", "k_neg": "nonnegative",
                   "lambda_neg": "positive"},
          differences="takes the sampler's per-token log-probs (rollout_log_probs) where the reference code takes "
                      "verl's rollout_is_weights (the same when those are untruncated per-token ratios; to_verl "
                      "converts them); lambda <= 0 and k < 0 are refused (the reference clamps lambda at 1e-4). "
                      "TRL's port also floors W at 1e-8 inside -lambda W (a relative difference below 3e-8)")
def vespo(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", k_pos=K_POS,
          lambda_pos=LAMBDA_POS, k_neg=K_NEG, lambda_neg=LAMBDA_NEG, *, rollout_log_probs=None):
    """VESPO: loss_t = -sg[phi(W)] A log pi(y_t), phi = W^k e^(lambda(1-W)), (k, lambda) = (2,3) if A >= 0 else (3,2).

    ``rollout_log_probs`` (optional, [B, T]): the sampler's per-token log-probs; log(pi_old/pi_sampler) is folded into
    L so that W = pi(y)/pi_sampler(y).
    """
    for k, lam in ((k_pos, lambda_pos), (k_neg, lambda_neg)):
        check_kernel(k, lam)
    L, correction = sequence_log_weight(log_prob, old_log_prob, response_mask, rollout_log_probs)
    L = L.detach()
    pos = advantages[..., :1] >= 0  # the reference reads the sign from the first token's advantage
    k = torch.where(pos, L.new_tensor(float(k_pos)), L.new_tensor(float(k_neg)))
    lam = torch.where(pos, L.new_tensor(float(lambda_pos)), L.new_tensor(float(lambda_neg)))
    coef = sequence_coefficient(L, k, lam).detach()  # [..., B, 1]
    loss = agg_loss(-coef * advantages * log_prob, response_mask, loss_agg_mode)
    W = torch.exp(L)
    metrics = {"phi_mean": coef.mean(), "phi_max": coef.max(), "phi_min": coef.min(),
               "seq_weight_mean": W.mean(), "seq_weight_max": W.max(), "log_seq_weight_mean": L.mean(),
               "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).detach()}
    if correction is not None:
        metrics["seq_log_tis_mean"] = correction.detach().mean()
    return loss, metrics
