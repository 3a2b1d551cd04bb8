import numpy as np
import pytest
import torch

import toy_envs
from lab.errors import LabError
from lab.engine.exact import Problem, divergence, exact_support
from lab.policies import init_params, make_policy
from lab.engine.staleness import behaviour, optimisation_trajectory

LIMIT = toy_envs.DEFAULT_ENUM_LIMIT


def _setting(name="tiny_target", policy_kind="prefix", steps=32, **overrides):
    env = toy_envs.make(name, **overrides)
    policy = make_policy(policy_kind, env)
    g = torch.Generator().manual_seed(0)
    traj = optimisation_trajectory(Problem(env, policy), init_params(policy, 1.0, g), steps, 0.05, g)
    return env, policy, traj


def _divergences(env, policy, traj, kind, values):
    out = []
    for v in values:
        g = torch.Generator().manual_seed(1)
        mu = behaviour(Problem(env, policy), kind, v, traj, g)
        out.append(divergence((policy, traj.current), mu, exact_support(env, *mu, LIMIT)))
    return out


@pytest.mark.parametrize("name,policy_kind", [("tiny_target", "prefix"), ("small_dense", "markov"),
                                              ("small_eos", "markov")])
@pytest.mark.slow
def test_divergence_is_monotone_in_every_knob(name, policy_kind):
    env, policy, traj = _setting(name, policy_kind)
    for kind, values in [("lag", [0, 1, 2, 4, 8, 16, 32]), ("kl", [0.0, 0.005, 0.02, 0.05, 0.1]),
                         ("temperature", [1.0, 1.1, 1.3, 1.7, 2.5]), ("temperature", [1.0, 0.9, 0.7, 0.5])]:
        div = _divergences(env, policy, traj, kind, values)
        kl = [d["kl_token"] for d in div]
        assert kl[0] == pytest.approx(0.0, abs=1e-12)
        assert all(np.diff(kl) > 0), (kind, kl)
        assert all(np.diff([d["chi2_seq"] for d in div]) > 0), (kind, div)


def test_kl_target_is_hit():
    env, policy, traj = _setting()
    for target, d in zip([0.01, 0.1, 0.5], _divergences(env, policy, traj, "kl", [0.01, 0.1, 0.5])):
        assert d["kl_token"] == pytest.approx(target, rel=1e-3)


@pytest.mark.slow
def test_log_weight_variance_grows_with_length():
    variances = []
    for T in [2, 3, 4, 5, 6]:
        env, policy, traj = _setting("small_dense", "markov", steps=8, n_prompts=2, vocab_size=4, length=T)
        variances.append(_divergences(env, policy, traj, "kl", [0.05])[0]["logw_var"])
    assert all(np.diff(variances) > 0), variances


def test_exact_divergences_agree_with_sampled_k1_k3():
    from lab.diagnostics import kl_k1, kl_k3
    from lab.policies import sample, sequence_log_probs

    env, policy, traj = _setting()
    mu = behaviour(Problem(env, policy), "kl", 0.05, traj, torch.Generator().manual_seed(1))
    d = divergence((policy, traj.current), mu, exact_support(env, *mu, LIMIT))
    g = torch.Generator().manual_seed(2)
    prompts = torch.randint(env.n_prompts, (100_000,), generator=g)
    tokens, mask, lp_mu = sample(*mu, env, prompts, g)
    L = sequence_log_probs(policy, traj.current, prompts, tokens, mask) - lp_mu.sum(-1)
    for est in (kl_k1(L), kl_k3(L)):
        se = float(est.std() / len(est) ** 0.5)
        assert abs(float(est.mean()) - d["kl_seq"]) < 4 * se
    assert abs(float(L.var()) - d["logw_var"]) < 0.05 * d["logw_var"]


@pytest.mark.parametrize("kind,value,match", [("lag", -1, "non-negative"), ("lag", 1.5, "whole number"),
                                              ("lag", 99, "exceeds"), ("kl", -0.1, "non-negative"),
                                              ("temperature", 0.0, "positive"), ("kl", float("nan"), "finite"),
                                              ("age", 1, "unknown staleness")])
def test_bad_staleness_values(kind, value, match):
    env, policy, traj = _setting(steps=4)
    with pytest.raises(LabError, match=match):
        behaviour(Problem(env, policy), kind, value, traj, torch.Generator())
