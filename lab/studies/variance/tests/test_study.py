"""The variance engine's claims, checked exactly (enumeration) and statistically (fixed seeds)."""
import numpy as np
import pytest
import torch

import toy_envs
from lab import advantages as adv_mod
from lab.estimators.aggregation import target_scale
from lab.engine.batches import draw_batches
from lab.engine.estimator import Estimator
from lab.engine.exact import Problem, exact_support, policy_gradient
from lab.engine.gradients import expected_gradient, loop_gradients, replicate_gradients
from lab.engine.metrics import gram_metrics
from lab.policies import init_params, make_policy
from lab.engine.staleness import behaviour, optimisation_trajectory
from lab.studies.variance.study import Config as VarianceConfig
from lab.studies.variance.study import run as run_study

LIMIT = toy_envs.DEFAULT_ENUM_LIMIT
CORE = ["reinforce", "seq_is", "token_is", "ppo_clip"]


def _world(name, policy_kind="prefix", agg="seq-mean-token-sum", **overrides):
    env = toy_envs.make(name, **overrides)
    policy = make_policy(policy_kind, env)
    g = torch.Generator().manual_seed(0)
    traj = optimisation_trajectory(Problem(env, policy), init_params(policy, 1.0, g), 32, 0.05, g)
    pi = traj.current
    g_star = target_scale(agg, env.length) * policy_gradient(env, policy, pi, exact_support(env, policy, pi, LIMIT))
    return env, policy, traj, g_star.reshape(-1)


def _expected(env, policy, traj, kind, value, name, agg="seq-mean-token-sum", hyper=None):
    mu = behaviour(Problem(env, policy), kind, value, traj, torch.Generator().manual_seed(1))
    return expected_gradient(env, policy, traj.current, mu, exact_support(env, *mu, LIMIT),
                             Estimator.resolve(name, hyper or {}, agg))


@pytest.mark.parametrize("name,policy_kind,agg", [
    ("tiny_target", "prefix", "seq-mean-token-sum"), ("small_dense", "markov", "token-mean"),
    ("small_eos", "markov", "seq-mean-token-sum"), ("small_bernoulli", "markov", "seq-mean-token-sum-norm")])
@pytest.mark.slow
def test_every_estimator_is_exact_at_zero_staleness(name, policy_kind, agg):
    env, policy, traj, g_star = _world(name, policy_kind, agg)
    assert g_star.norm() > 1e-4
    for kind, zero in [("lag", 0), ("kl", 0.0), ("temperature", 1.0)]:
        for est in CORE:
            e = _expected(env, policy, traj, kind, zero, est, agg)
            assert torch.allclose(e, g_star, atol=1e-12, rtol=1e-9), (kind, est)


@pytest.mark.parametrize("name,policy_kind", [("tiny_target", "prefix"), ("small_dense", "markov"),
                                              ("small_eos", "markov")])
@pytest.mark.slow
def test_seq_is_is_exactly_unbiased_and_token_corrections_are_not(name, policy_kind):
    env, policy, traj, g_star = _world(name, policy_kind)
    token_bias, clip_bias = [], []
    for lag in [1, 4, 16, 32]:
        assert torch.allclose(_expected(env, policy, traj, "lag", lag, "seq_is"), g_star, atol=1e-12, rtol=1e-9)
        token_bias.append(float((_expected(env, policy, traj, "lag", lag, "token_is") - g_star).norm()))
        clip_bias.append(float((_expected(env, policy, traj, "lag", lag, "ppo_clip") - g_star).norm()))
    for kl in [0.01, 0.1, 0.5]:
        assert torch.allclose(_expected(env, policy, traj, "kl", kl, "seq_is"), g_star, atol=1e-12, rtol=1e-8)
    rel = np.array(token_bias) / float(g_star.norm())
    assert rel[0] > 1e-5 and all(np.diff(token_bias) > 0), token_bias  # biased, growing with staleness
    assert clip_bias[0] > 1e-5 and clip_bias[-1] > clip_bias[0], clip_bias


@pytest.mark.slow
def test_sampled_means_fall_inside_their_intervals_for_seq_is():
    """Sampled seq-IS means (rloo advantages) cover the exact gradient; token IS is caught as biased."""
    cfg = VarianceConfig(env="small_dense", policy="markov", staleness="kl", values=[0.0, 0.05, 0.2],
                         estimators=["seq_is", "token_is"], replicates=800, seed=3)
    res = run_study(cfg).results
    b2 = res[res.metric == "bias2"].set_index(["staleness", "estimator"])
    for v in cfg.values:
        lo, hi = b2.loc[(v, "seq_is"), ["lo", "hi"]]
        assert lo <= 0 <= hi, (v, lo, hi)
    assert b2.loc[(0.2, "token_is"), "lo"] > 0  # the interval excludes zero: bias detected
    assert b2.loc[(0.0, "token_is"), "lo"] <= 0  # and at zero staleness it is not


@pytest.mark.parametrize("name,policy_kind,kind,value", [("tiny_target", "prefix", "lag", 16),
                                                         ("small_dense", "markov", "kl", 0.05)])
@pytest.mark.slow
def test_sampled_seq_is_mean_matches_exact_gradient_along_directions(name, policy_kind, kind, value):
    """z-tests of the sampled mean along the exact gradient and 20 random directions (a fixed seed).

    Single coordinates are not used: a rarely visited node makes a coordinate so skewed that a z-test on it
    is invalid, whereas projections on dense directions average many coordinates.
    """
    env, policy, traj, g_star = _world(name, policy_kind)
    mu = behaviour(Problem(env, policy), kind, value, traj, torch.Generator().manual_seed(1))
    M, B, G = 2000, 16, 4
    batch = draw_batches(env, mu, M, B, G, torch.Generator().manual_seed(7))
    adv = adv_mod.group_advantages(batch.rewards.reshape(M, B // G, G), "rloo").reshape(M, B)[..., None] * batch.mask
    grads, _ = replicate_gradients(policy, traj.current.float(), batch, adv,
                                   Estimator.resolve("seq_is", {}, "seq-mean-token-sum"))
    directions = torch.cat([g_star[None] / g_star.norm(),
                            torch.randn(20, g_star.numel(), generator=torch.Generator().manual_seed(0),
                                        dtype=torch.float64)])
    proj = grads.double() @ directions.T
    z = (proj.mean(0) - directions @ g_star) / (proj.std(0) / M**0.5)
    assert z.abs().max() < 3.5, z  # 21 tests at a Bonferroni level of about 1 %


def test_gram_metrics_match_direct_computation():
    g = torch.randn(50, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 0.3
    target = torch.randn(7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    counts = np.random.default_rng(0).multinomial(50, np.full(50, 1 / 50), size=200).astype(float)
    m = gram_metrics(g.float(), target.float(), counts, 0.95)
    mean = g.mean(0)
    var = float(((g - mean) ** 2).sum(1).sum() / 49)
    assert m["variance"][0] == pytest.approx(var, rel=1e-5)
    assert m["mse"][0] == pytest.approx(float(((g - target) ** 2).sum(1).mean()), rel=1e-5)
    assert m["bias2"][0] == pytest.approx(float(((mean - target) ** 2).sum()) - var / 50, rel=1e-4)
    assert m["cos_single"][0] == pytest.approx(float(torch.nn.functional.cosine_similarity(g, target[None]).mean()),
                                               rel=1e-5)
    for key, (v, lo, hi) in m.items():
        assert lo <= v + 1e-12 and v <= hi + 1e-12, key


@pytest.mark.parametrize("agg", ["seq-mean-token-sum", "token-mean", "seq-mean-token-mean"])
def test_vectorised_gradients_equal_the_per_sample_loop(agg):
    env = toy_envs.make("small_eos", n_prompts=2, vocab_size=4, length=4)
    policy = make_policy("prefix", env)
    g = torch.Generator().manual_seed(0)
    pi = init_params(policy, 1.0, g).float()
    mu = pi + 0.3 * torch.randn(pi.shape, generator=g)
    batch = draw_batches(env, (policy, mu), 3, 8, 4, g)
    adv = adv_mod.group_advantages(batch.rewards.reshape(3, 2, 4), "drgrpo").reshape(3, 8)[..., None] * batch.mask
    for name in CORE:
        est = Estimator.resolve(name, {}, agg)
        fast, _ = replicate_gradients(policy, pi, batch, adv, est)
        slow = loop_gradients(policy, pi, batch, adv, est)
        assert torch.allclose(fast, slow, atol=1e-6), name


@pytest.mark.slow
def test_same_seed_same_numbers_other_seed_other_numbers():
    cfg = dict(values=[0, 4], replicates=30, n_boot=50)
    a = run_study(VarianceConfig(**cfg, seed=1)).results
    b = run_study(VarianceConfig(**cfg, seed=1)).results
    c = run_study(VarianceConfig(**cfg, seed=2)).results
    assert a.equals(b)
    sampled = a.metric == "mse"
    assert not np.allclose(a[sampled].value.to_numpy(), c[sampled].value.to_numpy())


def test_monte_carlo_reference_runs_beyond_the_enumeration_limit():
    cfg = VarianceConfig(env="large_parity", policy="markov", reference="mc", mc_samples=4096, values=[0, 2],
                         replicates=20, n_boot=50, trajectory_steps=4, estimators=["seq_is", "ppo_clip"])
    out = run_study(cfg)
    assert out.summary["target_grad_norm"] > 0
    assert np.isfinite(out.results[out.results.metric == "mse"].value).all()
    assert "exact_bias_norm" not in set(out.results.metric)


def test_exact_bias_reported_for_reward_advantages():
    res = run_study(VarianceConfig(values=[0, 8], advantage="reward", replicates=20, n_boot=50)).results
    eb = res[res.metric == "exact_bias_norm"].set_index(["staleness", "estimator"]).value
    assert eb.loc[(0.0, "token_is")] < 1e-12 and eb.loc[(8.0, "token_is")] > 1e-6
    assert eb.loc[(8.0, "seq_is")] < 1e-12
