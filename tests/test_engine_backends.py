"""The policy seam: the functional gradient backend (any policy) equals the tabular rows backend, chunking changes
nothing, and streamed statistics with bounded memory keep every point estimate exact."""
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import toy_envs
from lab import advantages as adv_mod
from lab import stats
from lab.engine.batches import draw_batches
from lab.engine.estimator import Estimator
from lab.engine.exact import Problem
from lab.engine.gradients import replicate_gradients
from lab.engine.metrics import gram_metrics, streamed_metrics
from lab.policies import MarkovPolicy, PrefixTreePolicy, Tempered, init_params, make_policy, token_log_probs
from lab.studies.variance import study as variance


@dataclass(frozen=True)
class FunctionalPrefix(PrefixTreePolicy):
    """The prefix-tree policy seen as an opaque network: gradients through ``logits`` with torch.func."""

    gradient_backend = "functional"


@dataclass(frozen=True)
class FunctionalMarkov(MarkovPolicy):
    gradient_backend = "functional"


def _batch(policy, env, M=6, B=8, G=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    pi = init_params(policy, 1.0, g).float()
    mu = pi + 0.3 * torch.randn(pi.shape, generator=g)
    batch = draw_batches(env, (policy, mu), M, B, G, g)
    adv = adv_mod.group_advantages(batch.rewards.reshape(M, B // G, G), "drgrpo").reshape(M, B)[..., None] * batch.mask
    return pi, batch, adv


@pytest.mark.parametrize("agg", ["seq-mean-token-sum", "token-mean"])
def test_functional_backend_equals_rows_backend(agg):
    env = toy_envs.make("small_eos", n_prompts=2, vocab_size=4, length=4)
    rows_policy = make_policy("prefix", env)
    fn_policy = FunctionalPrefix(env.n_prompts, env.vocab_size, env.length)
    pi, batch, adv = _batch(rows_policy, env)
    extras, static = {"rewards": batch.rewards}, {"group_size": 4}
    for name in ["reinforce", "seq_is", "token_is", "ppo_clip", "vespo", "gvpo", "cispo"]:
        est = Estimator.resolve(name, {}, agg)
        fast, m1 = replicate_gradients(rows_policy, pi, batch, adv, est, extras, static)
        func, m2 = replicate_gradients(fn_policy, pi, batch, adv, est, extras, static)
        chunked, m3 = replicate_gradients(fn_policy, pi, batch, adv, est, extras, static, chunk=4)
        assert torch.allclose(fast, func, atol=1e-6), name
        assert torch.equal(func, chunked), name
        for k in m1:
            assert torch.allclose(m1[k], m2[k], atol=1e-6) and torch.equal(m2[k], m3[k]), (name, k)


def _stream(g, chunk):
    def stream(start):
        for s in range(start, g.shape[0], chunk):
            yield slice(s, min(s + chunk, g.shape[0])), g[s:s + chunk], {"x": g[s:s + chunk, 0]}
    return stream


def test_streamed_metrics_are_exact_beyond_the_memory_budget():
    """Over budget the Gram is built block by block by recomputing the stream: the same numbers, bounded memory."""
    g = torch.randn(90, 700, generator=torch.Generator().manual_seed(0)) * 0.2 + 0.05
    target = torch.full((700,), 0.06, dtype=torch.float64)
    counts = stats.bootstrap_counts(90, 200, np.random.default_rng(0))
    exact = gram_metrics(g, target.float(), counts, 0.95)
    calls = []

    def counted(start):
        calls.append(start)
        return _stream(g, 16)(start)

    res, metrics, buffer = streamed_metrics(counted, 90, 700, target, budget=8 * 700 * 25, counts=counts, ci=0.95)
    assert buffer is None and calls == [0, 25, 50, 75]  # 4 passes of 25 held replicates
    assert torch.equal(metrics["x"], g[:, 0])
    for key in exact:
        for a, b in zip(res[key], exact[key]):
            assert a == pytest.approx(b, rel=1e-5, abs=1e-9), key


def test_streamed_exact_path_is_gram_metrics():
    g = torch.randn(50, 40, generator=torch.Generator().manual_seed(2))
    target = torch.randn(40, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    counts = stats.bootstrap_counts(50, 100, np.random.default_rng(1))
    res, _, buffer = streamed_metrics(_stream(g, 20), 50, 40, target, 10**9, counts, 0.9)
    assert torch.equal(buffer, g) and res == gram_metrics(g, target.float(), counts, 0.9)


def test_variance_study_on_a_functional_policy_matches_the_tabular_one(monkeypatch):
    """The whole study through the seam: a policy the engine can only call gives the tabular numbers."""
    cfg = variance.Config(env="small_dense", env_overrides={"n_prompts": 2, "vocab_size": 3, "length": 3},
                          policy="markov", values=[0, 2], replicates=30, n_boot=50, trajectory_steps=4,
                          estimators=["seq_is", "ppo_clip"])
    a = variance.run(cfg).results
    monkeypatch.setitem(__import__("lab.policies", fromlist=["POLICIES"]).POLICIES, "markov", FunctionalMarkov)
    b = variance.run(cfg).results
    assert np.allclose(a["value"], b["value"], rtol=1e-4, atol=1e-7, equal_nan=True)


def test_staleness_knobs_act_on_logits():
    env = toy_envs.make("tiny_target")
    policy = make_policy("prefix", env)
    theta = init_params(policy, 1.0, torch.Generator().manual_seed(0))
    p, t = torch.zeros(3, dtype=torch.long), torch.zeros(3, env.length, dtype=torch.long)
    hot = Tempered(policy, 2.0)
    assert torch.allclose(hot.logits(theta, p, t), policy.logits(theta, p, t) / 2)
    assert torch.allclose(token_log_probs(hot, theta, p, t), token_log_probs(policy, theta / 2, p, t))
    problem = Problem(env, policy)
    assert problem.support(theta).weights.sum().item() == pytest.approx(1.0)
