"""A Monte Carlo reference states its own error: grad J with its standard error (batch means), the divergences with
CLT intervals, and statistics against a sampled target that remove its error instead of counting it as bias."""
import numpy as np
import pytest
import torch

import toy_envs
from lab import stats
from lab.engine.exact import (Problem, divergence, divergence_intervals, exact_support, mc_support, policy_gradient,
                              reference_gradient)
from lab.engine.metrics import gram_metrics
from lab.engine.staleness import behaviour, optimisation_trajectory
from lab.policies import init_params, make_policy
from lab.studies.variance import study as variance

METRICS = ("kl_seq", "kl_token", "chi2_seq", "chi2_token", "logw_var", "mean_len")


@pytest.fixture(scope="module")
def world():
    env = toy_envs.make("tiny_parity")
    policy = make_policy("prefix", env)
    g = torch.Generator().manual_seed(0)
    problem = Problem(env, policy)
    traj = optimisation_trajectory(problem, init_params(policy, 1.0, g), 8, 0.1, g)
    return problem, traj


def test_an_exact_reference_has_no_error(world):
    problem, traj = world
    env, policy, pi = problem.env, problem.policy, traj.current
    support = exact_support(env, policy, pi, 10**6)
    grad, var = reference_gradient(env, policy, pi, support)
    assert torch.equal(grad, policy_gradient(env, policy, pi, support)) and var == 0.0
    mu = behaviour(problem, "lag", 4, traj, None)
    s_mu = exact_support(env, *mu, 10**6)
    div = divergence((policy, pi), mu, s_mu)
    assert divergence_intervals((policy, pi), mu, s_mu) == {k: (v, v, v) for k, v in div.items()}


@pytest.mark.slow
def test_mc_standard_error_matches_the_spread_of_the_reference(world):
    """Over 60 independent reference samples of 1024: the mean stated tr Cov equals the mean squared error against
    the exact gradient (within 20 %), and the grouped sum is the one-pass estimate."""
    problem, traj = world
    env, policy, pi = problem.env, problem.policy, traj.current
    exact = policy_gradient(env, policy, pi, exact_support(env, policy, pi, 10**6))
    errors, stated = [], []
    for seed in range(60):
        support = mc_support(env, policy, pi, 1024, torch.Generator().manual_seed(seed))
        grad, var = reference_gradient(env, policy, pi, support)
        if seed == 0:
            assert torch.allclose(grad, policy_gradient(env, policy, pi, support), rtol=1e-12, atol=1e-15)
        errors.append(float(((grad - exact) ** 2).sum()))
        stated.append(var)
    assert np.mean(stated) == pytest.approx(np.mean(errors), rel=0.2)
    assert np.std(stated) < 0.5 * np.mean(stated)  # 32 batches: a stable estimate
    _, var = reference_gradient(env, policy, pi, mc_support(env, policy, pi, 1, torch.Generator().manual_seed(0)))
    assert np.isnan(var)  # one sample has no spread


@pytest.mark.slow
def test_mc_divergence_intervals_cover_the_exact_divergence(world):
    problem, traj = world
    pi = (problem.policy, traj.current)
    mu = behaviour(problem, "lag", 6, traj, None)
    exact = divergence(pi, mu, exact_support(problem.env, *mu, 10**6))
    assert exact["kl_token"] > 1e-3
    covered = {k: 0 for k in METRICS if k != "mean_len"}
    for seed in range(40):
        support = mc_support(problem.env, *mu, 2000, torch.Generator().manual_seed(seed))
        ci = divergence_intervals(pi, mu, support, 0.95)
        assert {k: v for k, (v, _, _) in ci.items()} == divergence(pi, mu, support)  # the same points
        for k in covered:
            v, lo, hi = ci[k]
            assert lo < v < hi, k
            covered[k] += lo <= exact[k] <= hi
    assert min(covered.values()) >= 32, covered  # nominal 95 % of 40 = 38


@pytest.mark.slow
def test_a_sampled_target_is_not_counted_as_bias():
    """Estimates with bias b against a true target t, compared with t + e (tr Cov e = s2): bias2 given s2 is unbiased
    for ||b||^2 and its interval covers it; ignoring s2 inflates it by s2."""
    rng = np.random.default_rng(0)
    D, M, s2 = 40, 50, 0.5
    t = torch.from_numpy(rng.normal(size=D))
    b = torch.from_numpy(rng.normal(size=D)) * 0.1
    counts = stats.bootstrap_counts(M, 200, rng)
    corrected, naive, covered = [], [], 0
    for _ in range(300):
        g = t + b + torch.from_numpy(rng.normal(size=(M, D)))
        target = t + torch.from_numpy(rng.normal(size=D)) * np.sqrt(s2 / D)
        m = gram_metrics(g, target, counts, 0.95, target_var=s2)
        corrected.append(m["bias2"][0])
        naive.append(gram_metrics(g, target, counts, 0.95)["bias2"][0])
        covered += m["bias2"][1] <= float(b @ b) <= m["bias2"][2]
    truth = float(b @ b)
    assert np.mean(corrected) == pytest.approx(truth, abs=3 * np.std(corrected) / np.sqrt(300))
    assert np.mean(naive) - np.mean(corrected) == pytest.approx(s2, rel=1e-9)
    assert covered >= 0.93 * 300
    g = torch.from_numpy(rng.normal(size=(M, D)))
    assert gram_metrics(g, t, counts, 0.95, target_var=0.0) == gram_metrics(g, t, counts, 0.95)


@pytest.mark.slow
def test_a_study_states_its_reference():
    common = dict(policy="markov", values=[0, 2], replicates=20, n_boot=50, trajectory_steps=4,
                  estimators=["seq_is", "ppo_clip"])
    mc = variance.run(variance.Config(env="large_parity", reference="mc", mc_samples=4096, **common), progress=False)
    s, res = mc.summary, mc.results
    assert s["reference"] == "mc" and s["reference_pairs"] == 4096
    assert 0 < s["target_grad_se"] < np.inf
    se = res[res.metric == "target_grad_se"]
    assert len(se) == 2 and (se.value == s["target_grad_se"]).all()
    stale = res[(res.staleness == 2.0) & (res.estimator == "-")].set_index("metric")
    for k in ("kl_token", "chi2_seq", "logw_var", "kl_seq"):
        assert stale.loc[k, "lo"] < stale.loc[k, "value"] < stale.loc[k, "hi"], k
    entry = s["per_value"][1]
    assert entry["divergence_intervals"]["kl_token"] == [stale.loc["kl_token", "lo"], stale.loc["kl_token", "hi"]]

    exact = variance.run(variance.Config(env="small_dense", **common), progress=False)
    res = exact.results
    div = res[(res.estimator == "-") & res.metric.isin(METRICS)]
    assert len(div) == 2 * len(METRICS) and (div.lo == div.value).all() and (div.hi == div.value).all()
    assert exact.summary["target_grad_se"] == 0.0 and "target_grad_se" not in set(res.metric)
