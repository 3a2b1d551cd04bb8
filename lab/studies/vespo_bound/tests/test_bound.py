"""Proposition 3.1's terms, exact: by hand, on random policies (never violated, and the check is not vacuous), against
the estimator's own phi on sampled batches, and the tidy table's round trip."""
import math

import pandas as pd
import pytest
import torch

import toy_envs
from lab import estimators
from lab.engine.exact import exact_support
from lab.policies import init_params, make_policy, sample, token_log_probs
from lab.studies.vespo_bound.tests.hand import wide_bound
from lab.studies.vespo_bound import bound as vb


def test_bound_terms_by_hand_and_tightness():
    # mu puts all its mass on W = (k-1)/lambda = 1/3 for (2, 3): phi(1/3) = K/3, so E[phi^2] = Z K C exactly
    L = torch.tensor([math.log(1 / 3)], dtype=torch.float64)
    t = vb.bound_terms(L, torch.ones(1, dtype=torch.float64), 2.0, 3.0)
    assert t["ratio"] == pytest.approx(1.0, rel=1e-12) and t["C"] == pytest.approx(1 / 3)
    # two points W = 1, 2 with mu = 1/2 each, (2, 3): phi = 1 and 0.1991
    L = torch.log(torch.tensor([1.0, 2.0], dtype=torch.float64))
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    t = vb.bound_terms(L, w, 2.0, 3.0)
    p2 = 4 * math.exp(-3)
    assert t["Z"] == pytest.approx((1 + p2) / 2)
    assert t["phi2"] == pytest.approx((1 + p2**2) / 2)
    assert t["C"] == pytest.approx((1 + 2 * p2) / (1 + p2))
    assert t["bound"] == pytest.approx(math.e**2 / 3 * (1 + 2 * p2) / 2)  # K E_mu[phi W] = Z K C
    assert t["ratio"] == pytest.approx((1 + p2**2) / (math.e**2 / 3 * (1 + 2 * p2)))
    assert t["w2"] == pytest.approx(2.5)
    t = vb.bound_terms(L, w, 0.5, 1.0)  # k < 1: no bound
    assert t["K"] == math.inf and math.isnan(t["ratio"])


def _random_pairs():
    """(env, policy, theta_pi, theta_mu) over envs, policy sharpness and distances, plus sampler temperatures."""
    for env in (toy_envs.make("tiny_target", length=3), toy_envs.make("small_eos", length=3, n_prompts=2)):
        policy = make_policy("prefix", env)
        for i, scale in enumerate((0.5, 1.5, 3.0)):
            g = torch.Generator().manual_seed(100 + i)
            pi = init_params(policy, scale, g)
            z = torch.randn(pi.shape, generator=g, dtype=torch.float64)
            for s in (0.0, 0.3, 1.0, 3.0):
                yield env, policy, pi, pi + s * z
            for temp in (0.5, 2.0):
                yield env, policy, pi, pi / temp


def test_bound_never_violated_on_random_policies():
    kernels = [(2.0, 3.0), (3.0, 2.0), (1.0, 1.0), (1.0, 3.0), (1.5, 1.0), (4.0, 2.0), (2.0, 0.5), (8.0, 8.0)]
    ratios = {kern: [] for kern in kernels}
    for env, policy, pi, mu in _random_pairs():
        support = exact_support(env, policy, mu, toy_envs.DEFAULT_ENUM_LIMIT)
        L = vb.sequence_log_weights((policy, pi), (policy, mu), support)
        assert support.weights.sum() == pytest.approx(1.0)
        for k, lam in kernels:
            t = vb.bound_terms(L, support.weights, k, lam)
            assert t["phi2"] <= t["bound"] * (1 + vb.TOLERANCE), (env.name, k, lam, t)
            ratios[(k, lam)].append(t["ratio"])
    # on-policy (s = 0): W = 1, the ratio is phi(1)^2 / (K phi(1) 1) = 1/K exactly: tight for (3, 2), 3/e^2 for (2, 3)
    assert ratios[(3.0, 2.0)][0] == pytest.approx(1.0, rel=1e-12)
    assert ratios[(2.0, 3.0)][0] == pytest.approx(3 / math.e**2, rel=1e-12)
    # the check is not vacuous: ratios reach close to 1 and spread widely
    assert max(max(r) for r in ratios.values()) > 0.99 and min(min(r) for r in ratios.values()) < 0.1


def test_sampled_phi_mean_estimates_the_exact_Z():
    # the estimator's phi on sampled batches against Z = E_mu[phi] by enumeration (4 standard errors, fixed seed)
    env = toy_envs.make("tiny_target")
    policy = make_policy("prefix", env)
    g = torch.Generator().manual_seed(7)
    pi = init_params(policy, 1.0, g)
    mu = pi + 0.8 * torch.randn(pi.shape, generator=g, dtype=torch.float64)
    support = exact_support(env, policy, mu, toy_envs.DEFAULT_ENUM_LIMIT)
    t = vb.bound_terms(vb.sequence_log_weights((policy, pi), (policy, mu), support), support.weights, 2.0, 3.0)
    n = 20000
    prompts = torch.randint(env.n_prompts, (n,), generator=g)
    tokens, mask, logp_mu = sample(policy, mu, env, prompts, g)
    logp_pi = token_log_probs(policy, pi, prompts, tokens) * mask
    ones = torch.ones_like(mask)
    coef = torch.autograd.grad(estimators.get("vespo")(logp_pi.requires_grad_(True), logp_mu, ones, mask,
                                                       loss_agg_mode="seq-mean-token-sum")[0], logp_pi)[0]
    phis = -coef[:, 0] * n  # d loss / d log pi = -phi / n
    se = float(phis.std()) / math.sqrt(n)
    assert abs(float(phis.mean()) - t["Z"]) < 4 * se
    assert abs(float((phis**2).mean()) - t["phi2"]) < 4 * float((phis**2).std()) / math.sqrt(n)



def test_bound_rows_undo_the_tidy_table():
    wide = wide_bound()
    other = pd.DataFrame([{"env": "tiny_target", "policy": "prefix", "seed": 0, "staleness_kind": "lag",
                           "staleness": 0.0, "metric": "kl_token", "value": 0.0, "part": "variance", "estimator": "-",
                           "lo": 0.0, "hi": 0.0}])
    tidy = pd.concat([other, vb.tidy_bound(wide), other], ignore_index=True)
    assert vb.bound_rows(tidy).equals(wide)
