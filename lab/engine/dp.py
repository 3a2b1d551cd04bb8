"""Exact references by dynamic programming over positions: any response length, no enumeration (float64).

For a policy whose next-token distribution depends only on (prompt, position, previous token) (the ``markov`` table,
and the ``Tempered`` / ``Perturbed`` behaviours built on it) and a reward that a finite state accumulates along the
response (``RewardChain``: per-position rewards summed, plus a terminal reward of an auxiliary state), every
expectation over the V^T responses is a product of T small transition matrices. Per prompt x, position t, previous
token a (the BOS row at t = 0) and auxiliary state k:

    alpha_{t+1}(y, k') = sum_{a, k} alpha_t(a, k) q_t(y | a) 1[k' = next_t(k, y)]          (mass, forward)

A sequence ends at the end token (token 0, with ``eos``): its mass leaves the recursion with its terminal reward.
The quantities computed this way:

- ``objective``: J = E_x E_pi[sum_t r_t(y_t) + f(k_T)], forward moments of order 0 and 1 of the reward;
- ``token_is_gradient``: E_mu[R sum_t rho_t grad log pi(y_t | s_t)], the expected gradient of token-level IS
  with advantage R (a leave-one-out baseline leaves it unchanged), with alpha_t(a, k) the mu-mass of each state,
  beta_t(a, k) its mu-expected past reward and v_t(y, k) the mu-expected reward still to come (a backward DP):
  the gradient of sum_t sum_{a,y} C_t(a, y) pi'(y | a) at pi' = pi, where
  C_t(a, y) = sum_k beta_t(a, k) + alpha_t(a, k) (r_t(y) + v_t(y, next_t(k, y))); on the logits it is
  pi(y|a) (C_t(a, y) - sum_y' pi(y'|a) C_t(a, y')), pulled back to theta in one backward pass;
- ``expected_token_gradient``: the same with weights 1 instead of rho_t (uncorrected REINFORCE on mu's samples, pulled
  back with mu's probabilities), optionally with the per-prompt baseline E_mu[R | x] that a leave-one-out advantage
  subtracts in expectation;
- ``policy_gradient``: grad J, the token-IS gradient at mu = pi (on-policy, token IS is REINFORCE);
- ``weight_moments``: under mu, with L = sum_t m_t log(pi/mu)(y_t) and W = exp(L): E_mu[W^2] = sum_y pi(y)^2 / mu(y)
  (the recursion with weights pi^2 / mu, renormalised every step so that log E_mu[W^2] stays finite at any T),
  E_mu[L] and E_mu[L^2] (moments of an additive functional: m1' = sum (m1 + d m0) q,
  m2' = sum (m2 + 2 d m1 + d^2 m0) q), and the per-state KL, chi2 and length summed over the state occupancy;
  hence kl_seq, kl_token, chi2_seq, chi2_token, logw_var and mean_len as ``lab.engine.exact.divergence`` defines
  them, plus log_m2 = log E_mu[W^2].

- ``expected_estimate``: an estimator's expected batch estimate, for the estimators and advantages these give
  exactly (``EXACT_ESTIMATORS``, ``EXACT_ADVANTAGES``), the reference ``lab variance --reference dp`` reports its exact
  bias against.

Each is tested equal to enumeration (``lab.engine.exact``, ``lab.engine.gradients.expected_gradient``) to 1e-10.
Time O(T P V^2 K), one pass per position.
Memory: the transition tables [P, T, V, V] of pi and mu and the per-position states [T, P, V, K] (``dp_memory``):
1024 positions of a V = 4 table with 2 prompts take about 4 MB.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lab.errors import LabError
from lab.policies.protocol import Perturbed, Tempered
from lab.policies.tabular import MarkovPolicy

DP_REWARDS = ("target", "parity", "dense")
EXACT_ESTIMATORS = {"token_is": True, "reinforce": False}  # name: weighted by rho_t (token IS) or not (REINFORCE)
EXACT_ADVANTAGES = ("reward", "rloo", "drgrpo")  # linear in R, with a baseline whose expectation is E_mu[R | x]


def is_markov(policy) -> bool:
    """Whether the policy's next-token logits depend only on (prompt, position, previous token)."""
    while isinstance(policy, (Perturbed, Tempered)):
        policy = policy.base
    return isinstance(policy, MarkovPolicy)


def check(env, policy) -> None:
    """One line, before any work, when the DP does not apply."""
    if not is_markov(policy):
        raise LabError(f"the dynamic-programming reference needs the markov policy (next token given position and "
                       f"previous token), not {type(policy).__name__}; use --policy markov")
    if not hasattr(env, "_tables"):
        raise LabError(f"the dynamic-programming reference needs a bandit env (its reward tables), not "
                       f"{type(env).__name__} {getattr(env, 'name', '')!r}; use --reference exact or mc")
    if getattr(env, "reward", None) not in DP_REWARDS:
        raise LabError(f"the dynamic-programming reference needs a reward accumulated along the response "
                       f"({', '.join(DP_REWARDS)}), not {getattr(env, 'reward', type(env).__name__)!r}")
    if env.vocab_size != policy.vocab_size or env.length != policy.length:
        raise LabError(f"policy sized V={policy.vocab_size}, T={policy.length} for an env with V={env.vocab_size}, "
                       f"T={env.length}")


def applies(env, policy) -> bool:
    """Whether ``check`` passes: the DP gives this env and policy's expectations."""
    try:
        check(env, policy)
    except LabError:
        return False
    return True


def dp_memory(env, aux: int = 2) -> int:
    """Bytes the DP holds at its peak (float64): about eight [P, T, V, V] tables (both policies' probe logits,
    log-probs, probabilities, the coefficients and the moment matrices, 4 wide) and four [T, P, V, K] state tables
    (alpha, beta, the future reward and its gathered copy)."""
    P, T, V = env.n_prompts, env.length, env.vocab_size
    return 8 * (12 * P * T * V * V + 4 * P * T * V * aux)


def log_transitions(policy, theta, env) -> torch.Tensor:
    """log q_t(y | a): [P, T, V, V] in float64 (differentiable in theta); row a at t = 0 is the BOS row.

    Read through ``policy.logits`` on probe responses y = (a, a, ..., a), whose position t >= 1 sees previous token
    a and position 0 sees BOS, so any Markov policy (wrapped or not) gives its table."""
    check(env, policy)
    P, T, V = env.n_prompts, env.length, env.vocab_size
    prompts = torch.arange(P).repeat_interleave(V)  # [P V]
    tokens = torch.arange(V).repeat(P)[:, None].expand(P * V, T).contiguous()
    logits = policy.logits(theta.double(), prompts, tokens).double().cpu()  # [P V, T, V]
    return torch.log_softmax(logits, -1).reshape(P, V, T, V).permute(0, 2, 1, 3)


@dataclass(frozen=True)
class RewardChain:
    """A reward as a finite-state accumulator: R = sum_t m_t step[x, t, y_t] + final[k_end], with k_0 = start[x]
    and k_{t+1} = next[x, t, y_t, k_t]."""

    start: torch.Tensor  # [P] long, the auxiliary state before the response
    next: torch.Tensor  # [P, T, V, K] long
    step: torch.Tensor  # [P, T, V] float64
    final: torch.Tensor  # [K] float64

    @property
    def K(self) -> int:
        return self.final.shape[0]


def reward_chain(env) -> RewardChain:
    """The env's reward as a ``RewardChain``: dense (sum of per-position scores / T; K = 1), target (k = still
    matching the hidden target; f(k) = k) or parity (k = parity of prompt + running sum; f(k) = 1 - k)."""
    P, T, V = env.n_prompts, env.length, env.vocab_size
    targets, scores = env._tables()
    zeros = torch.zeros(P, T, V, dtype=torch.float64)
    if env.reward == "dense":
        return RewardChain(torch.zeros(P, dtype=torch.long), torch.zeros(P, T, V, 1, dtype=torch.long),
                           scores.double() / T, torch.zeros(1, dtype=torch.float64))
    k = torch.arange(2)
    if env.reward == "target":
        hit = (torch.arange(V)[None, None, :] == targets[:, :, None]).long()  # [P, T, V]
        return RewardChain(torch.ones(P, dtype=torch.long), hit[..., None] * k, zeros,
                           torch.tensor([0.0, 1.0], dtype=torch.float64))
    if env.reward == "parity":
        nxt = (torch.arange(V)[None, None, :, None] + k) % 2
        return RewardChain(torch.arange(P) % 2, nxt.expand(P, T, V, 2).contiguous(), zeros,
                           torch.tensor([1.0, 0.0], dtype=torch.float64))
    raise LabError(f"reward {env.reward!r} is not accumulated along the response; DP rewards: {', '.join(DP_REWARDS)}")


def _step(x: torch.Tensor, q: torch.Tensor, nxt: torch.Tensor, K: int) -> torch.Tensor:
    """[P, A, K] state values through one position: sum_{a, k} x(a, k) q(y | a) 1[k' = next(k, y)] -> [P, Y, K']."""
    moved = torch.einsum("pak,pay->pyk", x, q)
    if K == 1:
        return moved
    return torch.zeros_like(moved).scatter_add_(2, nxt, moved)


def _forward(q: torch.Tensor, chain: RewardChain, eos: bool):
    """Under the transitions q [P, T, A, Y]: alpha [T, P, A, K] (mass of each state before position t), beta (its
    expected past reward), and E[R | x] per prompt [P]."""
    P, T, V, K = q.shape[0], q.shape[1], q.shape[2], chain.K
    m0 = torch.zeros(P, V, K, dtype=torch.float64)
    m0[torch.arange(P), 0, chain.start] = 1.0  # before position 0: the BOS row (index 0), the start state
    m1 = torch.zeros_like(m0)
    alpha, beta = torch.empty(T, P, V, K, dtype=torch.float64), torch.empty(T, P, V, K, dtype=torch.float64)
    ended = torch.zeros(P, dtype=torch.float64)
    for t in range(T):
        alpha[t], beta[t] = m0, m1
        nxt = chain.next[:, t]
        n0 = _step(m0, q[:, t], nxt, K)
        n1 = _step(m1, q[:, t], nxt, K) + _step(m0, q[:, t] * chain.step[:, t, None, :], nxt, K)
        if eos:  # token 0 ends the response: its mass leaves with the terminal reward
            ended = ended + (n1[:, 0] + n0[:, 0] * chain.final).sum(-1)
            n0[:, 0] = 0.0
            n1[:, 0] = 0.0
        m0, m1 = n0, n1
    return alpha, beta, (ended + (m1 + m0 * chain.final).sum((1, 2)))


def _after(q: torch.Tensor, chain: RewardChain, eos: bool) -> torch.Tensor:
    """Under q: after [T, P, Y, K], the expected reward still to come (terminal included) once y_t = y has moved the
    auxiliary state to k; an ended response (y = 0 with eos) collects only its terminal reward."""
    P, T, V, K = q.shape[0], q.shape[1], q.shape[2], chain.K
    after = torch.empty(T, P, V, K, dtype=torch.float64)
    v = chain.final.expand(P, V, K).clone()
    for t in reversed(range(T)):
        if eos:
            v[:, 0] = chain.final
        after[t] = v
        if t:  # before position t, at previous token a and state k: sum_y q_t(y|a) (r_t(y) + after_t(y, next(k, y)))
            v = torch.einsum("pay,pyk->pak", q[:, t], chain.step[:, t, :, None] + _gather_after(v, chain, t))
    return after


def _gather_after(after_t: torch.Tensor, chain: RewardChain, t: int) -> torch.Tensor:
    """after_t(y, next_t(k, y)) as [P, Y, K]."""
    return after_t if chain.K == 1 else torch.gather(after_t, 2, chain.next[:, t])


def _coefficients(alpha, beta, after, chain: RewardChain) -> torch.Tensor:
    """C [P, T, A, Y] = sum_k beta_t(a, k) + alpha_t(a, k) (r_t(y) + after_t(y, next_t(k, y))): the expected reward
    of a response through (position t, previous token a, token y), times the mass of reaching that state."""
    T = alpha.shape[0]
    future = torch.stack([_gather_after(after[t], chain, t) for t in range(T)])  # [T, P, Y, K]
    value = chain.step.permute(1, 0, 2)[..., None] + future  # [T, P, Y, K]
    C = beta.sum(-1)[..., None] + torch.einsum("tpak,tpyk->tpay", alpha, value)
    return C.permute(1, 0, 2, 3)


def _pullback(policy, theta, env, coef: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """grad_theta of sum_{p,t,a,y} coef w(y | a) log pi_theta(y | a) / P with w = pi (``weights`` None: the gradient
    of sum coef pi_theta) or given weights (mu): on the logits, w coef - pi sum_y w coef; then through the probe
    logits to theta (one backward pass)."""
    theta = theta.detach().double().requires_grad_(True)
    logq = log_transitions(policy, theta, env)
    pi = logq.detach().exp()
    wc = (pi if weights is None else weights) * coef
    g_logits = (wc - pi * wc.sum(-1, keepdim=True)) / env.n_prompts
    # g_logits sums to 0 over y, so pulling it back through the log-softmax is pulling it back through the logits
    (g,) = torch.autograd.grad((g_logits * logq).sum(), theta)
    return g


def objective(env, policy, theta) -> float:
    """J(theta) = E_x E_pi[R] (float64)."""
    with torch.no_grad():
        q = log_transitions(policy, theta, env).exp()
    return float(_forward(q, reward_chain(env), env.eos)[2].mean())


def policy_gradient(env, policy, theta) -> torch.Tensor:
    """grad J (shape of theta), float64: the token-IS gradient at mu = pi (``token_is_gradient``), i.e.
    dJ/dl_t(y | a) = pi(y|a) (C_t(a, y) - sum_y' pi(y'|a) C_t(a, y')) on each logit, pulled back to theta."""
    return token_is_gradient(env, policy, theta, (policy, theta))


def weight_moments(pi: tuple, mu: tuple, env) -> dict:
    """Exact divergences of mu from pi (each a (policy, theta) pair) under mu, by the forward DP (module docstring):
    the keys of ``lab.engine.exact.divergence`` plus log_m2 = log E_mu[W^2] (finite where chi2_seq overflows)."""
    with torch.no_grad():
        lp = log_transitions(pi[0], pi[1], env)
        lm = log_transitions(mu[0], mu[1], env)
    P, T, V = lp.shape[0], lp.shape[1], lp.shape[2]
    q, d = lm.exp(), lp - lm  # mu's transitions and the token log-ratio, [P, T, A, Y]
    tilt = torch.exp(2 * lp - lm)  # pi^2 / mu: E_mu[W^2] is the total mass of this recursion
    kl_state = (q * -d).sum(-1)  # KL(mu || pi) of each state's next-token distribution [P, T, A]
    chi2_state = tilt.sum(-1) - 1.0
    mats = torch.cat([q, q * d, q * d**2, tilt], -1)  # [P, T, A, 4Y]: one product per position moves every moment
    state = torch.zeros(P, 4, V, dtype=torch.float64)  # rows: m0, m1, m2 (moments of L) and the W^2 mass
    state[:, 0, 0] = state[:, 3, 0] = 1.0  # before position 0: the BOS row (index 0)
    occupancy = torch.empty(T, P, V, dtype=torch.float64)
    log_scale = torch.zeros(P, dtype=torch.float64)
    ends = torch.zeros(P, 4, dtype=torch.float64)  # ended mass: its moments of L, and its W^2 mass in units of
    keep = torch.ones(V, dtype=torch.float64)      # exp(log_scale) like the alive W^2 row
    keep[0] = 0.0 if env.eos else 1.0
    for t in range(T):
        occupancy[t] = state[:, 0]
        prod = torch.bmm(state, mats[:, t]).reshape(P, 4, 4, V)  # prod[:, i, j] = row i through matrix j
        new = torch.stack([prod[:, 0, 0], prod[:, 1, 0] + prod[:, 0, 1],
                           prod[:, 2, 0] + 2 * prod[:, 1, 1] + prod[:, 0, 2], prod[:, 3, 3]], 1)
        if env.eos:
            ends += new[:, :, 0]
        new = new * keep
        scale = (new[:, 3].sum(-1) + ends[:, 3]).clamp(min=1e-300)  # renormalise alive and ended W^2 mass together
        new[:, 3] /= scale[:, None]
        ends[:, 3] /= scale
        log_scale += torch.log(scale)
        state = new
    kl = float(torch.einsum("tpa,pta->", occupancy, kl_state))
    chi2 = float(torch.einsum("tpa,pta->", occupancy, chi2_state))
    length = float(occupancy.sum())
    m0, m1, m2, w2 = state.unbind(1)
    w2_end = ends[:, 3]
    ends = ends[:, :3].T
    mean_L = float((m1.sum(-1) + ends[1]).sum()) / P
    second_L = float((m2.sum(-1) + ends[2]).sum()) / P
    # log E_mu[W^2] = log mean_x exp(log_scale_x) (alive mass w2 sums to 1 per prompt after renormalising)
    per_prompt = log_scale + torch.log(w2.sum(-1) + w2_end)
    log_m2 = float(torch.logsumexp(per_prompt, 0)) - math.log(P)
    mean_len = float(length) / P
    kl_seq = float(kl) / P
    return {
        "kl_seq": kl_seq,
        "kl_token": kl_seq / mean_len,
        "chi2_seq": math.expm1(log_m2) if log_m2 < 700 else math.inf,
        "chi2_token": float(chi2) / P / mean_len,
        "logw_var": second_L - mean_L**2,
        "mean_len": mean_len,
        "log_m2": log_m2,
    }


def token_is_gradient(env, policy, theta_pi, mu: tuple) -> torch.Tensor:
    """E_mu[R sum_t rho_t grad log pi(y_t | s_t)] (shape of theta), float64: the expected token-IS gradient with
    advantage R, averaged over prompts (module docstring)."""
    return expected_token_gradient(env, policy, theta_pi, mu, weighted=True)


def expected_token_gradient(env, policy, theta_pi, mu: tuple, weighted: bool = True,
                            baseline: bool = False) -> torch.Tensor:
    """E_mu[A sum_t w_t grad log pi(y_t | s_t)] with w_t = rho_t (``weighted``: token-level IS) or 1 (uncorrected
    REINFORCE on mu's samples), A = R, or with ``baseline`` A = R - E_mu[R | x] (what a leave-one-out baseline
    gives in expectation: the other responses of the group are independent of this one), averaged over prompts:
    alpha, beta and the future reward under mu (module docstring), then C pulled back with weights pi (token IS: the
    gradient of sum C pi') or mu. A baseline b_x shifts C_t(a, y) by -b_x sum_k alpha_t(a, k); token IS is blind to
    it (sum_y grad pi = 0)."""
    chain = reward_chain(env)
    with torch.no_grad():
        qm = log_transitions(mu[0], mu[1], env).exp()
        alpha, beta, value = _forward(qm, chain, env.eos)
        coef = _coefficients(alpha, beta, _after(qm, chain, env.eos), chain)
        if baseline:
            coef = coef - value[:, None, None, None] * alpha.sum(-1).permute(1, 0, 2)[..., None]
    return _pullback(policy, theta_pi, env, coef, None if weighted else qm)


def expected_estimate(env, policy, theta_pi, mu: tuple, est, advantage: str, group_size: int):
    """E_mu[estimate] of one batch (flat, float64), or None where the DP does not give it exactly.

    Given for ``EXACT_ESTIMATORS`` (``est``: a ``lab.engine.estimator.Estimator``) with advantages
    ``EXACT_ADVANTAGES``: a batch estimate averages per-sequence terms A_i sum_t w_t grad log pi(y_t) with a constant
    weight, c = ``target_scale`` (1 for seq-mean-token-sum, 1 / T for seq-mean-token-sum-norm, and for token-mean and
    seq-mean-token-mean when every response has length T, i.e. without eos). A = R gives
    ``expected_token_gradient``; a leave-one-out advantage R_i - mean_{j != i} R_j over independent draws of the same
    prompt has the expectation of R_i - E_mu[R | x] (``baseline``), Dr. GRPO's R_i - mean_j R_j (G - 1) / G times
    that. Token IS clamps log rho_t to +-LOG_RATIO_BOUND (as verl does): exact only where no state's log-ratio
    reaches it (checked on the whole table, so conservatively). Mask replay needs a truncating sampler, which the
    DP does not cover."""
    from lab.estimators.aggregation import target_scale
    from lab.estimators.policy_gradient import LOG_RATIO_BOUND

    if est.name not in EXACT_ESTIMATORS or advantage not in EXACT_ADVANTAGES or est.mask_replay:
        return None
    if env.eos and est.loss_agg_mode not in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        return None  # 1 / |y| or 1 / (tokens in the batch) varies with the responses
    weighted = EXACT_ESTIMATORS[est.name]
    if weighted:
        with torch.no_grad():
            gap = log_transitions(policy, theta_pi, env) - log_transitions(mu[0], mu[1], env)
        if not bool((gap.abs() < LOG_RATIO_BOUND).all()):
            return None
    g = expected_token_gradient(env, policy, theta_pi, mu, weighted, baseline=advantage != "reward")
    scale = target_scale(est.loss_agg_mode, env.length)
    if advantage == "drgrpo":
        scale *= (group_size - 1) / group_size
    return scale * g.reshape(-1)
