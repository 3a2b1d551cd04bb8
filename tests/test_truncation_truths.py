"""Mask replay and the two truths of a truncating sampler, exact by enumeration over every batch.

As tests/test_estimator_unbiasedness.py: a batch is one group of G = 2 responses to one prompt, every pair is
enumerated with its probability under the sampler q (pi truncated by top-p / top-k), and the engine's own path
(lab.engine.variance.estimator_batch, lab.engine.gradients.replicate_gradients) computes each batch's gradient with
A = R. Must hold, for every ratio-based estimator:

- with mask replay and the sampler at pi's own parameters, every ratio is 1: every estimator unbiased on-policy is
  exactly unbiased for the deployed gradient grad J(q), and sequence IS is at any staleness (lag + top-p);
- without replay, the expectation is what the kept mass predicts: the same estimator fed the sampler log-probs
  log pi - log pi(S_t) computed from pi and the kept sets alone; for sequence IS that is the full gradient over
  the kept paths (lab.engine.truncation), which is neither truth;
- against the full truth grad J(pi), even replayed sequence IS is biased by exactly grad J(q) - grad J(pi).
"""
import itertools

import pytest
import torch

import toy_envs
from lab import estimators
from lab.engine.batches import Batch
from lab.engine.estimator import Estimator
from lab.engine.exact import Problem, exact_support
from lab.engine.gradients import expected_gradient, replayed_log_probs, replayed_pullback, replicate_gradients
from lab.engine.staleness import behaviour, optimisation_trajectory, truncate
from lab.engine.truncation import (deployed_gradient, full_gradient, kept_mass_log_probs, kept_path_gradient,
                                   sampler_kept_sets)
from lab.engine.variance import PROVIDED_INPUTS, estimator_batch
from lab.policies import Truncated, init_params, make_policy, masked, token_log_probs
from lab.policies.truncation import replayed

G = 2
LIMIT = 10**6
RATIO_BASED = [n for n in estimators.names()
               if estimators.info(n).mask_replay and estimators.info(n).family not in ("on-policy", "kl-penalty")
               and set(estimators.info(n).inputs) <= set(PROVIDED_INPUTS)]
SETTINGS = [dict(top_p=0.7), dict(top_k=2), dict(top_p=0.9, min_p=0.2)]


@pytest.fixture(scope="module")
def world():
    env = toy_envs.make("tiny_target", reward="dense", length=2, vocab_size=3)
    policy = make_policy("prefix", env)
    g = torch.Generator().manual_seed(2)
    problem = Problem(env, policy)
    traj = optimisation_trajectory(problem, init_params(policy, 1.5, g), 8, 0.3, g)
    return env, policy, problem, traj


def enumerate_batches(env, policy, pi, mu, old_log_probs=None):
    """Every batch of G responses to one prompt under mu: (Batch with its kept sets, probabilities, pi's
    log-probs). ``old_log_probs(prompts, tokens, mask, kept)``: the sampler log-probs to put in the batch
    (default: mu's own)."""
    s = exact_support(env, *mu, LIMIT)
    rows, probs = [], []
    for x in range(env.n_prompts):
        idx = (s.prompts == x).nonzero()[:, 0].tolist()
        for combo in itertools.product(idx, repeat=G):
            rows.append(list(combo))
            probs.append(torch.prod(s.weights[list(combo)] * env.n_prompts) / env.n_prompts)
    rows = torch.tensor(rows)
    prompts, tokens, mask = s.prompts[rows], s.tokens[rows], s.mask[rows]
    flat = (prompts.reshape(-1), tokens.reshape(-1, env.length))
    kept = sampler_kept_sets(mu[0], mu[1], *flat)
    with torch.no_grad():
        lp_mu = masked(token_log_probs(mu[0], mu[1].double(), *flat), mask.reshape(-1, env.length))
        lp_pi = token_log_probs(policy, pi.double(), *flat)
    if old_log_probs is not None:
        lp_mu = old_log_probs(*flat, mask.reshape(-1, env.length), kept)
    rewards = env.expected_reward(*flat, mask.reshape(-1, env.length)).reshape(rows.shape)
    batch = Batch(prompts, tokens, mask, lp_mu.reshape(tokens.shape), rewards, G,
                  kept.reshape(*tokens.shape, -1))
    return batch, torch.stack(probs), lp_pi.reshape(tokens.shape) * mask


def expectation(policy, pi, batch, probs, lp_pi, name, replay):
    est = Estimator.resolve(name, {}, "seq-mean-token-sum", mask_replay=replay)
    replayed_old = None
    if replay and est.info.three_policy:
        with torch.no_grad():
            logits = policy.logits(pi.double(), batch.prompts, batch.tokens)
            replayed_old = replayed(logits, batch.tokens, batch.kept) * batch.mask
    est_batch, extras = estimator_batch(batch, lp_pi, est, replayed_old=replayed_old)
    adv = batch.rewards[..., None] * batch.mask
    grads, _ = replicate_gradients(policy, pi.double(), est_batch, adv, est, extras, {"group_size": G})
    return (probs[:, None] * grads.double()).sum(0) / est.grad_scale


@pytest.fixture(scope="module", params=range(len(SETTINGS)), ids=[str(s) for s in SETTINGS])
def truncated(world, request):
    env, policy, problem, traj = world
    pi = traj.current
    setting = SETTINGS[request.param]
    sampler = Truncated(policy, **setting)
    mu = (sampler, pi)
    truths = {"full": full_gradient(env, policy, pi, LIMIT), "deployed": deployed_gradient(env, sampler, pi, LIMIT)}
    assert exact_support(env, sampler, pi, LIMIT).prompts.shape[0] < env.n_prompts * 9  # some paths are cut
    sampled = enumerate_batches(env, policy, pi, mu)
    predicted = enumerate_batches(env, policy, pi, mu, lambda p, t, m, k: kept_mass_log_probs(policy, pi, p, t, m, k))
    return env, policy, pi, sampler, truths, sampled, predicted


def test_the_two_truths_differ_and_the_deployed_one_is_the_truncated_objectives_gradient(truncated):
    env, policy, pi, sampler, truths, *_ = truncated
    assert float((truths["full"] - truths["deployed"]).norm()) > 1e-3 * float(truths["full"].norm())
    # finite differences of J(q) with the kept sets frozen at pi's (a small step keeps them)
    s = exact_support(env, sampler, pi, LIMIT)
    kept = sampler_kept_sets(sampler, pi, s.prompts, s.tokens)
    R = env.expected_reward(s.prompts, s.tokens, s.mask)

    def J(theta):
        lq = masked(replayed_log_probs(policy, theta, s.prompts, s.tokens, kept), s.mask).sum(-1)
        return float((torch.exp(lq) / env.n_prompts * R).sum())

    direction = torch.randn(pi.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    h = 1e-6
    fd = (J(pi + h * direction) - J(pi - h * direction)) / (2 * h)
    assert abs(fd - float(truths["deployed"] @ direction.reshape(-1))) < 1e-6


UNBIASED_ON_POLICY = [n for n in RATIO_BASED if estimators.info(n).unbiased in ("always", "on-policy")]


def test_the_replay_check_covers_every_estimator_unbiased_on_policy():
    """The ones left out of the next test are those the registry calls biased even on-policy."""
    assert set(RATIO_BASED) - set(UNBIASED_ON_POLICY) == {"gvpo", "clip_cov", "gepo"}


@pytest.mark.parametrize("name", UNBIASED_ON_POLICY)
def test_with_replay_every_ratio_estimator_is_exactly_unbiased_for_the_deployed_gradient(truncated, name):
    env, policy, pi, sampler, truths, (batch, probs, lp_pi), _ = truncated
    e = expectation(policy, pi, batch, probs, lp_pi, name, replay=True)
    assert torch.allclose(e, truths["deployed"], atol=1e-10, rtol=1e-8), name
    gap = float((e - truths["full"]).norm())  # and biased for the full gradient, by exactly the truths' difference
    assert abs(gap - float((truths["deployed"] - truths["full"]).norm())) < 1e-9


@pytest.mark.parametrize("name", RATIO_BASED)
def test_without_replay_the_bias_is_what_the_kept_mass_predicts(truncated, name):
    env, policy, pi, sampler, truths, (batch, probs, lp_pi), (pbatch, pprobs, plp_pi) = truncated
    e = expectation(policy, pi, batch, probs, lp_pi, name, replay=False)
    predicted = expectation(policy, pi, pbatch, pprobs, plp_pi, name, replay=False)
    for truth in truths.values():
        assert torch.allclose(e - truth, predicted - truth, atol=1e-10, rtol=1e-8), name
    if name == "seq_is":  # closed form: the full gradient over the kept paths, neither truth
        kept_paths = kept_path_gradient(env, policy, pi, sampler, LIMIT)
        assert torch.allclose(e, kept_paths, atol=1e-12, rtol=1e-9)
        for truth in truths.values():
            assert float((e - truth).norm()) > 1e-4 * float(truth.norm())


def test_replayed_seq_is_at_a_lag_targets_pi_on_the_samplers_kept_sets(world):
    """With staleness the replayed trainer renormalises pi over the SAMPLER's kept sets: sequence IS is then exactly
    unbiased for the gradient of J under pi restricted to those sets, which is the deployed gradient where the
    sets coincide with pi's own and differs from it where they do not."""
    env, policy, problem, traj = world
    pi = traj.current
    differ = []
    for lag in (1, 6):
        mu = truncate(behaviour(problem, "lag", lag, traj, torch.Generator().manual_seed(0)), top_p=0.8)
        s = exact_support(env, *mu, LIMIT)
        kept = sampler_kept_sets(mu[0], mu[1], s.prompts, s.tokens)
        lq = masked(replayed_log_probs(policy, pi.double(), s.prompts, s.tokens, kept), s.mask)
        R = env.expected_reward(s.prompts, s.tokens, s.mask)
        coef = (torch.exp(lq.sum(-1)) / env.n_prompts * R)[:, None] * s.mask
        target = replayed_pullback(policy, pi, s.prompts, s.tokens, kept, coef).reshape(-1)
        batch, probs, lp_pi = enumerate_batches(env, policy, pi, mu)
        e = expectation(policy, pi, batch, probs, lp_pi, "seq_is", replay=True)
        assert torch.allclose(e, target, atol=1e-10, rtol=1e-8), lag
        est = Estimator.resolve("seq_is", {}, "seq-mean-token-sum", mask_replay=True)
        assert torch.allclose(expected_gradient(env, policy, pi, mu, s, est), target, atol=1e-10, rtol=1e-8)
        own = sampler_kept_sets(Truncated(policy, top_p=0.8), pi, s.prompts, s.tokens)
        deployed = deployed_gradient(env, Truncated(policy, top_p=0.8), pi, LIMIT)
        differ.append(not torch.equal(own, kept))
        assert torch.allclose(target, deployed, atol=1e-10) == (not differ[-1]), lag
    assert differ == [False, True]  # the sets still agree one step back and no longer six steps back


@pytest.mark.parametrize("name", ["seq_is", "token_is", "ppo_clip", "tis_token", "vespo", "gspo"])
def test_the_contracts_kept_log_mass_is_the_engines_replay_and_to_verl_passes_it(name):
    from lab.estimators import to_verl
    from lab.policies.truncation import kept_log_mass, kept_set

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 7, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(7, (4, 5), generator=g)
    kept = kept_set(logits, top_p=0.8)
    kept.scatter_(-1, tokens[..., None], True)  # the sampled tokens lie in their kept sets
    mask = torch.ones(4, 5, dtype=torch.float64)
    mask[0, 3:] = 0
    old = (replayed(logits.detach(), tokens, kept) + 0.1 * torch.randn(4, 5, generator=g, dtype=torch.float64))
    adv = torch.randn(4, 1, generator=g, dtype=torch.float64)
    fn = estimators.get(name)
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    a, _ = fn(lp, old, adv, mask, loss_agg_mode="seq-mean-token-sum", kept_log_mass=kept_log_mass(logits, kept))
    (ga,) = torch.autograd.grad(a, logits)
    b, _ = fn(replayed(logits, tokens, kept), old, adv, mask, loss_agg_mode="seq-mean-token-sum")
    (gb,) = torch.autograd.grad(b, logits)
    assert torch.allclose(a, b, atol=1e-12) and torch.allclose(ga, gb, atol=1e-12)
    c, _ = to_verl(name)(old, lp, adv, mask, "seq-mean-token-sum", kept_log_mass=kept_log_mass(logits, kept))
    assert torch.allclose(c, b, atol=1e-12)
    assert not torch.allclose(fn(lp, old, adv, mask, loss_agg_mode="seq-mean-token-sum")[0], b)


def test_mask_replay_is_refused_where_it_does_not_apply():
    from lab.errors import LabError

    with pytest.raises(LabError):
        Estimator.resolve("kl_k3", {}, mask_replay=True)
    x = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(LabError):
        estimators.get("kl_k3")(x, x, x, torch.ones(2, 3), ref_log_prob=x, kept_log_mass=x)
