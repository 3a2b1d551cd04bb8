"""The Monte Carlo reference keeps its stated coverage at long T: its intervals, over independent seeds, cover the
exact values that dynamic programming gives (``lab.engine.dp``) at their nominal rate, within a binomial tolerance."""
import numpy as np
import pytest
import torch
from scipy.stats import binom

import toy_envs
from lab.engine import dp
from lab.engine.exact import divergence_intervals, mc_support, reference_gradient
from lab.policies import Perturbed, init_params, make_policy

SEEDS, CI = 40, 0.95
METRICS = ("kl_seq", "kl_token", "chi2_seq", "chi2_token", "logw_var", "mean_len")


def _world(name, T, scale):
    env = toy_envs.make(name, length=T)
    policy = make_policy("markov", env)
    g = torch.Generator().manual_seed(0)
    theta = init_params(policy, 1.0, g)
    if env.eos:
        theta[..., 0] -= 3.0  # responses of a few dozen tokens and more, of every length
    return env, policy, theta, (Perturbed(policy, policy.noise_table(g), scale), theta)


def _binomial_band(n: int, p: float, level: float = 1e-3) -> tuple[int, int]:
    """Counts of covering intervals outside which a nominal-p interval is rejected at ``level`` (two-sided)."""
    return int(binom.ppf(level / 2, n, p)), int(binom.isf(level / 2, n, p))


@pytest.mark.slow
@pytest.mark.parametrize("name,T,scale,n", [("long_dense", 256, 0.08, 800), ("long_eos", 512, 0.1, 800)])
def test_mc_divergence_intervals_cover_the_dp_values_at_long_T(name, T, scale, n):
    env, policy, theta, mu = _world(name, T, scale)
    exact = dp.weight_moments((policy, theta), mu, env)
    assert exact["kl_seq"] > 0.1 and exact["mean_len"] > 20  # far enough off-policy, long enough
    covered = {k: 0 for k in METRICS}
    for seed in range(SEEDS):
        ci = divergence_intervals((policy, theta), mu, mc_support(env, *mu, n, torch.Generator().manual_seed(seed)), CI)
        for k in covered:  # a fixed length's interval is a point: allow the DP's rounding
            tol = 1e-9 * abs(exact[k])
            covered[k] += ci[k][1] - tol <= exact[k] <= ci[k][2] + tol
    lo, hi = _binomial_band(SEEDS, CI)
    assert all(lo <= c <= hi for c in covered.values()), (covered, lo, hi)


@pytest.mark.slow
def test_mc_gradient_error_is_what_it_states_at_long_T():
    """The stated tr Cov of a Monte Carlo grad J equals its mean squared error against the DP grad J: the ratio of
    their sums over 40 seeds is within 25 % of 1."""
    env, policy, theta, _ = _world("long_dense", 256, 0.0)
    exact = dp.policy_gradient(env, policy, theta)
    errors, stated = [], []
    for seed in range(SEEDS):
        support = mc_support(env, policy, theta, 512, torch.Generator().manual_seed(100 + seed))
        grad, var = reference_gradient(env, policy, theta, support)
        errors.append(float(((grad - exact) ** 2).sum()))
        stated.append(var)
    ratio = np.sum(errors) / np.sum(stated)
    assert ratio == pytest.approx(1.0, abs=0.25), ratio
