"""Exact objectives, gradients and divergences by enumeration (float64), or their Monte Carlo stand-ins.

A ``Problem`` carries what travels together: the environment, the policy and how expectations are taken
(``reference``: "exact" enumerates every (prompt, response) pair up to ``enum_limit``; "dp" computes the same
expectations by dynamic programming over positions (``lab.engine.dp``: Markov policies, any length; no support);
"mc" draws ``mc_samples`` on-policy samples). A ``Support`` is a set of (prompt, response) pairs with weights
such that sum_y w(y) f(y) = E[f]: every pair with w = p(y|x)/P (exact), or n samples with w = 1/n (Monte Carlo).
Every expectation outside the DP is a weighted sum over a support, so both modes share code.

- J(theta) = E_x E_{y~pi}[R(x, y)]
- grad J = E_pi[R grad log pi(y)] = sum_y w_pi(y) R(y) grad log pi(y)   (score form, weights detached)

A Monte Carlo reference is stated with its own error: ``reference_gradient`` returns grad J with the trace of its
estimate's covariance (batch means), ``divergence_intervals`` the divergences with normal (CLT, delta-method)
intervals. An exact reference has no error: its intervals are points.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from scipy.special import erfinv

import toy_envs
from lab.engine import dp
from lab.errors import LabError
from lab.policies import Policy, masked, sample, sequence_log_probs, token_log_probs

REFERENCES = ("exact", "dp", "mc")
NETWORK_CHUNK = 2048  # (prompt, response) pairs per forward / backward pass of a network policy
LOGITS_BUDGET = 1 << 30  # bytes of logits (and their log-softmax and gradient) in one enumeration pass
DIVERGENCES = ("kl_seq", "kl_token", "chi2_seq", "chi2_token", "logw_var", "mean_len")  # ``divergence``'s keys
MC_GROUPS = 32  # batches of a Monte Carlo reference sample behind the standard error of its grad J


@dataclass(frozen=True)
class Support:
    prompts: torch.Tensor  # [N]
    tokens: torch.Tensor  # [N, T]
    mask: torch.Tensor  # [N, T] float64
    weights: torch.Tensor  # [N] float64, summing to 1
    exact: bool


@dataclass(frozen=True)
class Problem:
    """An environment, a policy for it, and how its expectations are computed."""

    env: object  # a toy_envs environment
    policy: Policy
    reference: str = "exact"  # exact (enumeration) | dp (dynamic programming, Markov) | mc (on-policy sample)
    enum_limit: int = toy_envs.DEFAULT_ENUM_LIMIT
    mc_samples: int = 65536

    def check(self) -> None:
        if self.reference not in REFERENCES:
            raise LabError(f"unknown reference {self.reference!r}; choose {', '.join(REFERENCES)}")
        if self.reference == "exact":
            self.env.check_enumerable(self.enum_limit)
        elif self.reference == "dp":
            dp.check(self.env, self.policy)
        elif self.mc_samples < 1:
            raise LabError(f"the Monte Carlo reference needs at least one sample, got mc_samples={self.mc_samples}")

    def support(self, theta, generator: torch.Generator | None = None, policy: Policy | None = None) -> Support:
        """The distribution of ``policy`` (default: the problem's) at ``theta`` over (prompt, response) pairs."""
        policy = policy or self.policy
        if self.reference == "exact":
            return exact_support(self.env, policy, theta, self.enum_limit)
        if self.reference == "mc":
            return mc_support(self.env, policy, theta, self.mc_samples, generator)
        if self.reference == "dp":
            raise LabError("the dynamic-programming reference has no support of pairs; use Problem.gradient and "
                           "Problem.divergence")
        raise LabError(f"unknown reference {self.reference!r}; choose {', '.join(REFERENCES)}")

    def gradient(self, theta, generator: torch.Generator | None = None) -> torch.Tensor:
        """grad J at ``theta`` (shape of theta, float64): by dynamic programming, or on the problem's support."""
        if self.reference == "dp":
            return dp.policy_gradient(self.env, self.policy, theta)
        return policy_gradient(self.env, self.policy, theta, self.support(theta, generator))

    def divergence(self, pi: tuple, mu: tuple, generator: torch.Generator | None = None) -> dict:
        """``divergence`` of mu from pi (each a (policy, theta) pair): by dynamic programming, or on mu's support."""
        if self.reference == "dp":
            moments = dp.weight_moments(pi, mu, self.env)
            return {k: moments[k] for k in DIVERGENCES}
        return divergence(pi, mu, self.support(mu[1], generator, policy=mu[0]))


def chunks(policy: Policy, n: int, length: int = 1) -> list[slice]:
    """Slices of n pairs for one pass each: all at once for tabular policies, NETWORK_CHUNK for networks (their
    activations over every enumerated pair would not fit in memory), and never more pairs than keep a pass's float64
    logits, log-softmax and gradient (3 x length x V per pair) within LOGITS_BUDGET."""
    size = n if policy.gradient_backend == "rows" else NETWORK_CHUNK
    size = max(1, min(size, LOGITS_BUDGET // (24 * max(length, 1) * policy.vocab_size)))
    return [slice(s, min(s + size, n)) for s in range(0, max(n, 1), size)]


def exact_support(env, policy: Policy, theta, enum_limit: int) -> Support:
    prompts, tokens, mask = env.enumerate(enum_limit)
    with torch.no_grad():
        logp = torch.cat([sequence_log_probs(policy, theta.double(), prompts[c], tokens[c], mask[c])
                          for c in chunks(policy, prompts.shape[0], tokens.shape[1])])
    possible = logp > -torch.inf  # a truncated sampler never draws a response with a token outside its kept set
    if not bool(possible.all()):
        prompts, tokens, mask, logp = prompts[possible], tokens[possible], mask[possible], logp[possible]
    return Support(prompts, tokens, mask, torch.exp(logp) / env.n_prompts, True)


def pullback(policy: Policy, theta, prompts, tokens, coef: torch.Tensor) -> torch.Tensor:
    """grad_theta sum_{n, t} coef[n, t] log pi(y_t | s_t) for given (detached) coefficients [N, T], float64,
    in chunks of pairs (one backward pass each)."""
    theta = theta.detach().double().requires_grad_(True)
    total = torch.zeros_like(theta)
    for c in chunks(policy, prompts.shape[0], tokens.shape[1]):
        lp = token_log_probs(policy, theta, prompts[c], tokens[c])
        (g,) = torch.autograd.grad((coef[c] * lp).sum(), theta)
        total += g
    return total


def mc_support(env, policy: Policy, theta, n: int, generator: torch.Generator) -> Support:
    prompts = torch.randint(env.n_prompts, (n,), generator=generator)
    tokens, mask, _ = sample(policy, theta.double(), env, prompts, generator)
    return Support(prompts, tokens, mask.double(), torch.full((n,), 1.0 / n, dtype=torch.float64), False)


def objective(env, support: Support) -> float:
    """J = sum_y w(y) E[R | x, y]."""
    return float((support.weights * env.expected_reward(support.prompts, support.tokens, support.mask)).sum())


def policy_gradient(env, policy: Policy, theta, support: Support) -> torch.Tensor:
    """grad J = sum_y w(y) R(y) grad log pi(y) in float64, where ``support`` is pi's own distribution."""
    reward = env.expected_reward(support.prompts, support.tokens, support.mask)
    if policy.gradient_backend == "rows":  # one pass: the tabular numbers exactly as they always were
        theta = theta.detach().double().requires_grad_(True)
        logp = sequence_log_probs(policy, theta, support.prompts, support.tokens, support.mask)
        (grad,) = torch.autograd.grad((support.weights * reward * logp).sum(), theta)
        return grad
    coef = (support.weights * reward)[:, None] * support.mask
    return pullback(policy, theta, support.prompts, support.tokens, coef)


def reference_gradient(env, policy: Policy, theta, support: Support, groups: int = MC_GROUPS):
    """(grad J, tr Cov of that estimate) on ``support``, pi's own distribution.

    Exact support: (``policy_gradient``, 0.0). Monte Carlo support of n samples with x_i = R_i grad log pi(y_i)
    and grad J ~ mean_i x_i: the samples are split into K contiguous groups (``groups``) of n_k samples, one
    ``policy_gradient`` pass each giving P_k = (1/n) sum_{i in k} x_i, and (batch means, unbiased for any n_k)

        grad J = sum_k P_k,    tr Cov(grad J) = (sum_k (n / n_k) ||P_k||^2 - ||grad J||^2) / (K - 1),

    i.e. tr Cov(x) / n. The passes cost one pass over the sample; memory is O(D) (two running sums). NaN for
    fewer than two samples.
    """
    if support.exact:
        return policy_gradient(env, policy, theta, support), 0.0
    n = support.prompts.shape[0]
    size = -(-n // max(1, min(groups, n)))  # ceil(n / K)
    parts = [slice(start, min(start + size, n)) for start in range(0, n, size)]
    total, weighted = 0, 0.0
    for part in parts:
        sub = Support(support.prompts[part], support.tokens[part], support.mask[part], support.weights[part], False)
        P = policy_gradient(env, policy, theta, sub)
        total = total + P
        weighted += n / (part.stop - part.start) * float((P.double() ** 2).sum())
    if len(parts) < 2:
        return total, float("nan")
    return total, max((weighted - float((total.double() ** 2).sum())) / (len(parts) - 1), 0.0)


def _log_weights(pi: tuple, mu: tuple, prompts, tokens, mask):
    """Per pair: L = sum_t m_t log(pi/mu)(y_t) and the per-token chi2 sum_a pi_t(a)^2/mu_t(a) - 1 (masked), on CPU."""
    lp_pi = torch.log_softmax(pi[0].logits(pi[1].double(), prompts, tokens), -1)
    lp_mu = torch.log_softmax(mu[0].logits(mu[1].double(), prompts, tokens), -1).to(lp_pi.device)
    dev = lp_pi.device
    tok, m = tokens.to(dev)[..., None], mask.to(dev)
    L = masked((lp_pi.gather(-1, tok) - lp_mu.gather(-1, tok)).squeeze(-1), m).sum(-1)
    chi2_t = masked(torch.exp(2 * lp_pi - lp_mu).sum(-1) - 1.0, m)  # inf where mu truncates tokens pi can draw
    return L.cpu(), chi2_t.cpu()


def _pair_terms(pi: tuple, mu: tuple, s: Support):
    """Per pair of the support: L, the per-token chi2 summed over the response, and the length |y|."""
    with torch.no_grad():
        L, chi2_t = map(torch.cat, zip(*[_log_weights(pi, mu, s.prompts[c], s.tokens[c], s.mask[c])
                                         for c in chunks(pi[0], s.prompts.shape[0], s.tokens.shape[1])]))
    return L, chi2_t.sum(-1), s.mask.sum(-1)


def _divergences(L, chi2, length, w) -> dict:
    mean_len = float((w * length).sum())
    kl_seq = float((w * -L).sum())
    mean_L = float((w * L).sum())
    return {
        "kl_seq": kl_seq,
        "kl_token": kl_seq / mean_len,
        "chi2_seq": float((w * torch.exp(2 * L)).sum()) - 1.0,
        "chi2_token": float((w * chi2).sum()) / mean_len,
        "logw_var": float((w * L**2).sum()) - mean_L**2,
        "mean_len": mean_len,
    }


def divergence(pi: tuple, mu: tuple, support_mu: Support) -> dict:
    """Exact (or MC) divergence of the behaviour mu from pi, each a (policy, theta) pair, with ``support_mu`` mu's
    distribution.

    kl_seq = KL(mu||pi) = E_mu[-L]; kl_token = kl_seq / E_mu[|y|] (per real token, by the chain rule);
    chi2_seq = E_mu[W^2] - 1; chi2_token = E_mu[sum_t m_t (sum_a pi_t(a)^2/mu_t(a) - 1)] / E_mu[|y|];
    logw_var = Var_mu(L), with L = log pi(y) - log mu(y) and W = exp(L).
    """
    return _divergences(*_pair_terms(pi, mu, support_mu), support_mu.weights)


def divergence_intervals(pi: tuple, mu: tuple, support_mu: Support, ci: float = 0.95) -> dict:
    """{metric: (value, lo, hi)}: ``divergence``'s values (the same numbers) with intervals of coverage ``ci``.

    Exact support: lo = hi = value. Monte Carlo support of n samples from mu: normal intervals value -/+ z sd(psi)
    / sqrt(n) from each statistic's influence values psi_i (CLT; delta method for ratios and the variance):
    a mean E[a] has psi = a (kl_seq: a = -L; chi2_seq: a = W^2; mean_len: a = |y|); a ratio r = E[a] / E[|y|]
    (kl_token, chi2_token) has psi = (a - r |y|) / E[|y|]; logw_var has psi = (L - mean L)^2. W^2 is heavy-tailed
    when mu is far from pi (PSIS khat > 0.5): chi2_seq's interval is then optimistic.
    """
    L, chi2, length = _pair_terms(pi, mu, support_mu)
    values = _divergences(L, chi2, length, support_mu.weights)
    if support_mu.exact:
        return {k: (v, v, v) for k, v in values.items()}
    L, chi2, length = L.double().numpy(), chi2.double().numpy(), length.double().numpy()
    mean_len = length.mean()
    influence = {
        "kl_seq": -L,
        "kl_token": (-L - values["kl_token"] * length) / mean_len,
        "chi2_seq": np.exp(2 * L),
        "chi2_token": (chi2 - values["chi2_token"] * length) / mean_len,
        "logw_var": (L - L.mean()) ** 2,
        "mean_len": length,
    }
    z = float(np.sqrt(2.0) * erfinv(ci))
    n = L.shape[0]
    out = {}
    for k, v in values.items():
        se = float(np.std(influence[k], ddof=1)) / np.sqrt(n) if n > 1 else float("nan")
        out[k] = (v, v - z * se, v + z * se)
    return out

