"""The dynamic-programming reference equals enumeration wherever enumeration runs, and runs where it cannot."""
import math

import pytest
import torch

import toy_envs
from lab.engine import dp
from lab.engine.estimator import Estimator
from lab.engine.exact import divergence, exact_support, objective, policy_gradient
from lab.engine.gradients import expected_gradient
from lab.errors import LabError
from lab.policies import Perturbed, Tempered, init_params, make_policy, sample
import lab.policies as policies

CASES = [(reward, eos, V, T, seed) for reward in dp.DP_REWARDS for eos in (False, True)
         for V, T, seed in ((3, 2, 0), (3, 5, 1), (4, 4, 2), (3 if eos else 2, 7 if eos else 8, 3))]


def _world(reward, eos, V, T, seed, behaviour="perturbed"):
    env = toy_envs.make("long_dense", n_prompts=3, vocab_size=V, length=T, reward=reward, eos=eos, seed=seed)
    policy = make_policy("markov", env)
    g = torch.Generator().manual_seed(seed)
    theta = init_params(policy, 1.0, g)
    if behaviour == "perturbed":
        mu = (Perturbed(policy, policy.noise_table(g), 0.6), theta)
    elif behaviour == "tempered":
        mu = (Tempered(policy, 1.7), theta)
    else:  # another table altogether
        mu = (policy, theta + 0.5 * torch.randn(theta.shape, generator=g, dtype=torch.float64))
    return env, policy, theta, mu


@pytest.mark.parametrize("reward,eos,V,T,seed", CASES)
def test_dp_equals_enumeration(reward, eos, V, T, seed):
    env, policy, theta, mu = _world(reward, eos, V, T, seed, ("perturbed", "tempered", "table")[seed % 3])
    s_pi = exact_support(env, policy, theta, 10**6)
    assert dp.objective(env, policy, theta) == pytest.approx(objective(env, s_pi), abs=1e-12)
    grad = policy_gradient(env, policy, theta, s_pi)
    assert grad.norm() > 1e-5
    assert torch.allclose(dp.policy_gradient(env, policy, theta), grad, atol=1e-12, rtol=0)
    s_mu = exact_support(env, *mu, 10**6)
    exact = divergence((policy, theta), mu, s_mu)
    moments = dp.weight_moments((policy, theta), mu, env)
    assert exact["kl_token"] > 1e-3
    for k, v in exact.items():
        assert moments[k] == pytest.approx(v, abs=1e-10, rel=1e-10), k
    assert moments["log_m2"] == pytest.approx(math.log1p(exact["chi2_seq"]), abs=1e-10)
    token_is = Estimator.resolve("token_is", {}, "seq-mean-token-sum")
    by_enum = expected_gradient(env, policy, theta, mu, s_mu, token_is)
    by_dp = dp.token_is_gradient(env, policy, theta, mu).reshape(-1)
    assert (by_enum - grad.reshape(-1)).norm() > 1e-2 * grad.norm()  # biased off-policy: the check is not vacuous
    assert torch.allclose(by_dp, by_enum, atol=1e-12, rtol=0)


def test_on_policy_the_moments_are_those_of_one_weight():
    env, policy, theta, _ = _world("dense", True, 4, 64, 0)
    m = dp.weight_moments((policy, theta), (policy, theta), env)
    assert abs(m["kl_seq"]) < 1e-12 and abs(m["chi2_seq"]) < 1e-10 and abs(m["logw_var"]) < 1e-10
    assert 1 <= m["mean_len"] < 64


def test_independent_tokens_give_the_product_of_per_token_second_moments():
    """Rows that ignore the previous token make tokens independent: E_mu[W^2] = prod_t (1 + chi2_t) exactly."""
    env = toy_envs.make("long_dense", length=300)
    policy = make_policy("markov", env)
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(env.n_prompts, env.length, 1, env.vocab_size, generator=g, dtype=torch.float64)
    theta = theta.expand(policy.shape).contiguous()
    noise = torch.randn(env.n_prompts, env.length, 1, env.vocab_size, generator=g, dtype=torch.float64)
    mu = (Perturbed(policy, noise.expand(policy.shape).contiguous(), 0.3), theta)
    m = dp.weight_moments((policy, theta), mu, env)
    lp = torch.log_softmax(theta[:, :, 0], -1)
    lm = torch.log_softmax(theta[:, :, 0] + 0.3 * noise[:, :, 0], -1)
    per_prompt = torch.log(torch.exp(2 * lp - lm).sum(-1)).sum(-1)  # sum_t log(1 + chi2_t)
    assert m["log_m2"] == pytest.approx(float(torch.logsumexp(per_prompt, 0) - math.log(2)), rel=1e-12)
    assert m["log_m2"] > 10  # E_mu[W^2] ~ e^10 and more: far beyond what sampling resolves


def test_long_responses_take_seconds_and_little_memory():
    env = toy_envs.make("long_eos")  # T = 1024
    assert env.length == 1024 and env.num_pairs > 10**400
    policy = make_policy("markov", env)
    theta = init_params(policy, 1.0, torch.Generator().manual_seed(0))
    theta[..., 0] -= 8.0  # rarely end, so responses are long
    mu = (Tempered(policy, 1.2), theta)
    m = dp.weight_moments((policy, theta), mu, env)
    assert m["mean_len"] > 500 and all(math.isfinite(v) for k, v in m.items() if k != "chi2_seq")
    g = dp.policy_gradient(env, policy, theta)
    assert torch.isfinite(g).all() and g.norm() > 0
    assert dp.dp_memory(env) < 2**23  # a few MB


def test_the_dp_refuses_what_it_cannot_do():
    env = toy_envs.make("tiny_target")
    with pytest.raises(LabError, match="markov policy"):
        dp.objective(env, make_policy("prefix", env), torch.zeros(make_policy("prefix", env).shape))
    env = toy_envs.make("small_bernoulli")
    with pytest.raises(LabError, match="accumulated along the response"):
        dp.objective(env, make_policy("markov", env), torch.zeros(make_policy("markov", env).shape))


@pytest.mark.parametrize("behaviour", ["perturbed", "tempered", "table"])
def test_markov_sampling_reads_rows_and_draws_the_same_tokens(behaviour, monkeypatch):
    """The O(T) Markov sampler draws exactly what the teacher-forced loop draws (same generator, same numbers)."""
    env, policy, theta, mu = _world("target", True, 4, 7, 1, behaviour)
    prompts = torch.randint(3, (300,), generator=torch.Generator().manual_seed(0))
    fast = sample(mu[0], mu[1].float(), env, prompts, torch.Generator().manual_seed(5), dtype=torch.float32)
    monkeypatch.setattr(policies, "markov_logits", lambda *a: None)
    slow = sample(mu[0], mu[1].float(), env, prompts, torch.Generator().manual_seed(5), dtype=torch.float32)
    for a, b in zip(fast, slow):
        assert torch.equal(a, b)


@pytest.mark.parametrize("reward,eos", [("dense", True), ("parity", False), ("target", True)])
def test_uncorrected_reinforce_on_mu_samples_equals_enumeration(reward, eos):
    env, policy, theta, mu = _world(reward, eos, 3, 5, 4)
    s_mu = exact_support(env, *mu, 10**6)
    by_enum = expected_gradient(env, policy, theta, mu, s_mu, Estimator.resolve("reinforce", {}, "seq-mean-token-sum"))
    by_dp = dp.expected_token_gradient(env, policy, theta, mu, weighted=False).reshape(-1)
    assert torch.allclose(by_dp, by_enum, atol=1e-12, rtol=0) and by_enum.norm() > 1e-4


@pytest.mark.slow
def test_a_leave_one_out_baseline_moves_reinforce_off_policy_and_not_token_is():
    """Sampled means with rloo advantages (groups of 4, 20000 groups) against the DP's expectations with the
    per-prompt baseline E_mu[R | x]: z-tests along the exact vectors."""
    from lab import advantages
    from lab.engine.batches import draw_batches
    from lab.engine.gradients import replicate_gradients

    env, policy, theta, mu = _world("dense", False, 3, 6, 5)
    batch = draw_batches(env, (mu[0], mu[1].float()), 400, 200, 4, torch.Generator().manual_seed(0))
    adv = advantages.group_advantages(batch.rewards.reshape(400, 50, 4), "rloo").reshape(400, 200)[..., None]
    for name, weighted in (("reinforce", False), ("token_is", True)):
        est = Estimator.resolve(name, {}, "seq-mean-token-sum")
        grads, _ = replicate_gradients(policy, theta.float(), batch, adv * batch.mask, est)
        with_b = dp.expected_token_gradient(env, policy, theta, mu, weighted, baseline=True).reshape(-1)
        without = dp.expected_token_gradient(env, policy, theta, mu, weighted).reshape(-1)
        u = with_b / with_b.norm()
        proj = grads.double() @ u
        z = (proj.mean() - with_b @ u) / (proj.std() / 400**0.5)
        assert abs(float(z)) < 3.5, (name, float(z))
        if weighted:
            assert torch.allclose(with_b, without, atol=1e-12)
        else:
            assert (with_b - without).norm() > 0.1 * with_b.norm()
