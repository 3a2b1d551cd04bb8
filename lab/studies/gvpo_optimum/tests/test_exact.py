"""GVPO's optimum by enumeration (Theorems 1 and 2): the exact expected gradient of the registered estimator is beta
grad J on-policy, carries the KL term, and vanishes at pi* = pi_ref exp(R/beta)/Z and nowhere else; descending the
population loss lands on pi*."""
import math

import pytest
import torch

import toy_envs
from lab.engine.exact import exact_support, policy_gradient
from lab.policies import make_policy
from lab.studies.gvpo_optimum import study as go

BETA = 0.1


@pytest.fixture(scope="module")
def small():
    """2 prompts x 9 responses (V = 3, T = 2) with dense rewards; pi_ref random."""
    env = toy_envs.make("tiny_target", reward="dense", vocab_size=3, length=2)
    theta_ref = go.reference_params(env, 0, 1.0)
    prompts, tokens, mask = env.enumerate()
    reward = env.expected_reward(prompts, tokens, mask).reshape(env.n_prompts, -1)
    log_opt = go.optimum_log_probs(go.enumerated_log_probs(env, theta_ref), reward, BETA)
    return env, theta_ref, reward, log_opt


@pytest.mark.parametrize("k", [2, 3])
def test_on_policy_expected_gradient_is_beta_grad_J_exactly(small, k):
    """At pi = pi_ref' (on-policy, no update yet) E[-grad L] = beta * grad J: the registry's grad_scale."""
    env, theta, _, _ = small
    policy = make_policy("prefix", env)
    log_pi = go.enumerated_log_probs(env, theta)
    expected = -go.expected_gvpo_gradient(env, theta, theta, log_pi, k, BETA)
    grad_J = policy_gradient(env, policy, theta, exact_support(env, policy, theta, 10**6)).reshape(-1)
    assert grad_J.norm() > 1e-2
    assert torch.allclose(expected, BETA * grad_J, atol=1e-14, rtol=1e-10)


def test_on_policy_expected_gradient_includes_the_kl_term(small):
    """Sampling from pi with pi_ref' fixed elsewhere: E[-grad L] = beta * grad (J - beta KL(pi || pi_ref))."""
    env, theta_ref, reward, _ = small
    theta = theta_ref + 0.5 * torch.randn(theta_ref.shape, generator=torch.Generator().manual_seed(3),
                                          dtype=torch.float64)
    expected = -go.expected_gvpo_gradient(env, theta, theta_ref, go.enumerated_log_probs(env, theta), 2, BETA)
    th = theta.clone().requires_grad_(True)
    log_pi, log_ref = go.enumerated_log_probs(env, th), go.enumerated_log_probs(env, theta_ref)
    objective = (log_pi.exp() * (reward - BETA * (log_pi - log_ref))).sum(-1).mean()  # J - beta KL, prompts uniform
    (g,) = torch.autograd.grad(objective, th)
    assert torch.allclose(expected, BETA * g.reshape(-1), atol=1e-14, rtol=1e-10)


@pytest.mark.parametrize("sampler", ["uniform", "reference"])
def test_expected_gradient_vanishes_at_the_optimum_and_nowhere_else(small, sampler):
    """Theorems 1-2 with k = 2 and a fixed sampler q: the exact expected gradient (all 81 pairs per prompt) is
    0 at pi* and nonzero elsewhere; it equals grad of 1/2 Var_q(beta log(pi/pi_ref) - R) (the population loss)."""
    env, theta_ref, reward, log_opt = small
    log_q = (torch.full_like(log_opt, -math.log(9)) if sampler == "uniform"
             else go.enumerated_log_probs(env, theta_ref))
    theta_opt = go.prefix_tree_params(env, log_opt)
    assert torch.allclose(go.enumerated_log_probs(env, theta_opt), log_opt, atol=1e-12)
    at_opt = go.expected_gvpo_gradient(env, theta_opt, theta_ref, log_q, 2, BETA)
    assert at_opt.norm() < 1e-13
    gen = torch.Generator().manual_seed(4)
    others = [theta_ref, go.prefix_tree_params(env, go.optimum_log_probs(go.enumerated_log_probs(env, theta_ref),
                                                                         reward, 2 * BETA))]
    others += [theta_opt + 0.3 * torch.randn(theta_opt.shape, generator=gen, dtype=torch.float64) for _ in range(3)]
    for theta in others:
        g = go.expected_gvpo_gradient(env, theta, theta_ref, log_q, 2, BETA)
        th = theta.clone().requires_grad_(True)
        (g_pop,) = torch.autograd.grad(go.population_loss(env, th, theta_ref, log_q, BETA), th)
        assert torch.allclose(g, g_pop.reshape(-1), atol=1e-14, rtol=1e-10)
        assert g.norm() > 1e-4
    # and descending the population loss from pi_ref lands on pi*
    th = theta_ref.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([th], max_iter=500, tolerance_grad=1e-14, tolerance_change=0, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = go.population_loss(env, th, theta_ref, log_q, BETA)
        loss.backward()
        return loss

    opt.step(closure)
    tv = go.total_variation(go.enumerated_log_probs(env, th.detach()), log_opt)
    assert float(tv) < 1e-6
