import pytest
import torch

import toy_envs
from lab.engine.exact import exact_support, mc_support, objective, policy_gradient
from lab.policies import init_params, make_policy


def _objective_of(env, policy, theta):
    return objective(env, exact_support(env, policy, theta, toy_envs.DEFAULT_ENUM_LIMIT))


def test_exact_gradient_matches_finite_differences():
    env = toy_envs.make("small_dense", n_prompts=2, vocab_size=3, length=3)
    policy = make_policy("markov", env)
    theta = init_params(policy, 1.0, torch.Generator().manual_seed(0))
    g = policy_gradient(env, policy, theta, exact_support(env, policy, theta, 10**6))
    flat = theta.reshape(-1)
    h = 1e-6
    for idx in torch.randperm(flat.numel(), generator=torch.Generator().manual_seed(1))[:12]:
        e = torch.zeros_like(flat)
        e[idx] = h
        fd = (_objective_of(env, policy, (flat + e).reshape(theta.shape))
              - _objective_of(env, policy, (flat - e).reshape(theta.shape))) / (2 * h)
        assert abs(fd - float(g.reshape(-1)[idx])) < 1e-8


@pytest.mark.slow
def test_monte_carlo_reference_agrees_with_enumeration():
    env = toy_envs.make("tiny_parity")
    policy = make_policy("prefix", env)
    theta = init_params(policy, 1.0, torch.Generator().manual_seed(0))
    exact = policy_gradient(env, policy, theta, exact_support(env, policy, theta, 10**6))
    mc = policy_gradient(env, policy, theta, mc_support(env, policy, theta, 200_000, torch.Generator().manual_seed(1)))
    cos = float((exact * mc).sum() / (exact.norm() * mc.norm()))
    assert cos > 0.97
    assert abs(_objective_of(env, policy, theta)
               - objective(env, mc_support(env, policy, theta, 200_000, torch.Generator().manual_seed(2)))) < 0.005
