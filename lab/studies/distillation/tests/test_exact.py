"""The distillation study's exact quantities (lab/studies/distillation/exact.py): the sequence target against finite
differences, every estimator's exact expectation against the targets, importance weights under a stale behaviour,
and coordinates that keep every statistic."""
import numpy as np
import pytest
import torch

import toy_envs
from lab.engine.estimator import Estimator
from lab.engine.exact import exact_support
from lab.engine.metrics import gram_metrics
from lab.policies import init_params, make_policy, sequence_log_probs
from lab.studies.distillation.exact import (expected_estimate, isometric_coordinates, kl_per_token, per_token_target,
                                            sequence_kl, sequence_target)

@pytest.fixture(scope="module", params=["prefix", "markov-eos"])
def toy(request):
    """A student and a perturbed teacher on an enumerable env (fixed length, or variable length with an end token)."""
    if request.param == "prefix":
        env = toy_envs.make("small_dense", vocab_size=4, length=3, n_prompts=2)
        policy = make_policy("prefix", env)
    else:
        env = toy_envs.make("small_eos", vocab_size=4, length=3, n_prompts=2)
        policy = make_policy("markov", env)
    g = torch.Generator().manual_seed(7)
    th_s = init_params(policy, 1.0, g)
    th_t = th_s + 1.5 * torch.randn(th_s.shape, generator=g, dtype=torch.float64)
    support = exact_support(env, policy, th_s, 10_000)
    return env, policy, th_s, th_t, support


def test_sequence_target_matches_finite_differences(toy):
    env, policy, th_s, th_t, support = toy
    g = sequence_target(policy, th_s, th_t, support)

    def kl(theta):
        return sequence_kl(policy, theta, th_t, exact_support(env, policy, theta, 10_000))

    gen = torch.Generator().manual_seed(3)
    for _ in range(4):  # central differences along random directions: error O(h^2)
        d = torch.randn(th_s.shape, generator=gen, dtype=torch.float64)
        h = 1e-5
        fd = (kl(th_s + h * d) - kl(th_s - h * d)) / (2 * h)
        assert float(g @ d.reshape(-1)) == pytest.approx(fd, rel=1e-6, abs=1e-9)
    # and it equals grad E_{pi_S}[sum_t KL_t] with the probabilities differentiated (the chain rule)
    theta = th_s.clone().requires_grad_(True)
    ls = sequence_log_probs(policy, theta, support.prompts, support.tokens, support.mask)
    kl_t = kl_per_token(policy, theta, th_t, support.prompts, support.tokens)
    (g2,) = torch.autograd.grad((torch.exp(ls) / env.n_prompts * (kl_t * support.mask).sum(-1)).sum(), theta)
    assert torch.allclose(g, g2.reshape(-1), atol=1e-12)


def test_exact_expectations_equal_the_targets(toy):
    env, policy, th_s, th_t, support = toy
    g_tok = per_token_target(policy, th_s, th_t, support)
    g_seq = sequence_target(policy, th_s, th_t, support)
    assert (g_tok - g_seq).norm() > 0.05 * g_seq.norm()  # the targets really differ

    def mean(name, mode="seq-mean-token-sum", **hyper):
        return expected_estimate(policy, th_s, th_t, support, Estimator.resolve(name, hyper, mode))

    close = dict(atol=1e-10 * float(g_tok.norm()), rtol=0)
    assert torch.allclose(mean("opd"), -g_tok, **close)
    assert torch.allclose(mean("opd", return_to_go=True), -g_seq, **close)
    assert torch.allclose(mean("vopd"), -g_tok, **close)
    for k in (1, 2, 3):
        assert torch.allclose(mean("vopd_topk", k=k), -g_tok, **close)
    assert torch.allclose(mean("kl_full"), -g_tok, **close)
    # the top-k KL loss is biased (exactly, not by sampling): 2 of 4 tokens
    assert (mean("kl_topk", k=2) + g_tok).norm() > 0.1 * g_tok.norm()
    assert torch.allclose(mean("kl_topk", k=4), -g_tok, **close)  # k = V: the full loss
    if not env.eos:  # token-mean with fixed length T estimates g / T
        assert torch.allclose(mean("vopd", "token-mean"), -g_tok / env.length, **close)


def test_importance_weighted_opd_holds_the_behaviour_visitation(toy):
    # with a stale behaviour mu, token IS corrects each token but states still come from mu:
    # E_mu[-grad loss] = -grad sum_y sg[mu(y)] sum_t m_t KL_t(theta) (the per-token target under mu's visitation)
    env, policy, th_s, th_t, _ = toy
    th_mu = th_s + 0.5 * torch.randn(th_s.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    support_mu = exact_support(env, policy, th_mu, 10_000)
    want = -per_token_target(policy, th_s, th_t, support_mu)
    for name in ("opd", "vopd"):
        got = expected_estimate(policy, th_s, th_t, support_mu,
                                Estimator.resolve(name, {"importance_weights": True}, "seq-mean-token-sum"),
                                theta_mu=th_mu)
        assert torch.allclose(got, want, atol=1e-10 * float(want.norm()), rtol=0)
    support_s = exact_support(env, policy, th_s, 10_000)
    assert (want + per_token_target(policy, th_s, th_t, support_s)).norm() > 0.01 * want.norm()  # biased off-policy



@pytest.mark.slow
def test_isometric_coordinates_preserve_every_statistic():
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(30, 200, generator=g) + 0.3
    t1, t2 = torch.randn(200, generator=g, dtype=torch.float64), torch.randn(200, generator=g, dtype=torch.float64)
    coords, (c1, c2) = isometric_coordinates(grads, t1, t2)
    assert coords.shape[1] <= 32
    counts = np.random.default_rng(0).multinomial(30, np.full(30, 1 / 30), size=50).astype(float)
    for t, c in ((t1, c1), (t2, c2)):
        raw, small = gram_metrics(grads, t, counts, 0.95), gram_metrics(coords, c, counts, 0.95)
        for key in raw:
            assert np.allclose(raw[key], small[key], rtol=1e-9, atol=1e-9), key
