"""Every estimator's unbiasedness claim (``EstimatorInfo.unbiased``, the checkable form of ``unbiased_for``), checked
exactly by enumeration on a toy env, for every registered estimator and every verl preset (a new one is covered
without new test code):

- "always":    E_mu[g] = c grad J at mu = pi and at a stale mu;
- "on-policy": E_pi[g] = c grad J, and a stale mu biases it;
- "never":     biased even on-policy.

The expectation is over whole batches, so estimators that couple a batch's responses (group baselines, batch-level
masks and bounds, covariance ranks) are covered: a batch is one group of G = 2 responses to one prompt, every pair of
responses is enumerated with its probability under mu, and the engine's own path computes each batch's gradient
(lab.engine.variance.estimator_batch: the three-policy batch with pi_old = pi for decoupled estimators;
lab.engine.gradients.replicate_gradients). Advantages are the rewards (A = R: dense, both signs), so the target is
c grad J with c from the aggregation (seq-mean-token-sum: c = 1), exact in float64.
"""
import itertools

import pytest
import torch

import toy_envs
from lab import estimators
from lab.engine.batches import Batch
from lab.engine.estimator import Estimator
from lab.engine.exact import Problem, exact_support, policy_gradient
from lab.engine.gradients import replicate_gradients
from lab.engine.staleness import behaviour, optimisation_trajectory
from lab.engine.variance import estimator_batch
from lab.estimators import presets
from lab.policies import init_params, make_policy, token_log_probs

G = 2
STALE = 6  # stale enough that every cap binds somewhere (sequence TIS's W <= 2 up to lag 3 here)
NAMES = [n for n in estimators.names() + presets.names() if estimators.info(n).unbiased != "other"]


@pytest.fixture(scope="module")
def world():
    env = toy_envs.make("tiny_target", reward="dense", length=2, vocab_size=3)
    policy = make_policy("prefix", env)
    g = torch.Generator().manual_seed(2)
    problem = Problem(env, policy)
    traj = optimisation_trajectory(problem, init_params(policy, 1.5, g), 8, 0.3, g)
    pi = traj.current
    g_star = policy_gradient(env, policy, pi, exact_support(env, policy, pi, 10**6)).reshape(-1)
    batches = {lag: enumerate_batches(env, policy, pi, behaviour(problem, "lag", lag, traj, g)) for lag in (0, STALE)}
    return env, policy, pi, g_star, batches


def enumerate_batches(env, policy, pi, mu):
    """Every batch of G responses to one prompt: (Batch [M, G, ...], probabilities [M], pi's log-probs [M, G, T])."""
    s = exact_support(env, *mu, 10**6)
    per_prompt = s.prompts.shape[0] // env.n_prompts
    rows, probs = [], []
    for x in range(env.n_prompts):
        idx = range(x * per_prompt, (x + 1) * per_prompt)
        for combo in itertools.product(idx, repeat=G):
            rows.append(list(combo))
            probs.append(torch.prod(s.weights[list(combo)] * env.n_prompts) / env.n_prompts)
    rows = torch.tensor(rows)
    tokens, mask = s.tokens[rows], s.mask[rows]
    with torch.no_grad():
        lp_mu = token_log_probs(mu[0], mu[1].double(), s.prompts[rows].reshape(-1), tokens.reshape(-1, env.length))
        lp_pi = token_log_probs(policy, pi.double(), s.prompts[rows].reshape(-1), tokens.reshape(-1, env.length))
    rewards = env.expected_reward(s.prompts[rows].reshape(-1), tokens.reshape(-1, env.length),
                                  mask.reshape(-1, env.length)).reshape(rows.shape)
    batch = Batch(s.prompts[rows], tokens, mask, lp_mu.reshape(tokens.shape) * mask, rewards, G)
    return batch, torch.stack(probs), lp_pi.reshape(tokens.shape) * mask


def expected_gradient(world, name, lag, **hyper):
    env, policy, pi, g_star, batches = world
    batch, probs, lp_pi = batches[lag]
    est = Estimator.resolve(name, hyper, "seq-mean-token-sum")
    est_batch, extras = estimator_batch(batch, lp_pi, est)
    adv = batch.rewards[..., None] * batch.mask
    grads, _ = replicate_gradients(policy, pi.double(), est_batch, adv, est, extras, {"group_size": G})
    expected = (probs[:, None] * grads.double()).sum(0) / est.grad_scale
    return expected, est.target_scale(env.length) * g_star


def relative_bias(world, name, lag, **hyper):
    expected, target = expected_gradient(world, name, lag, **hyper)
    return float((expected - target).norm() / target.norm())


def test_the_enumeration_is_exact_and_the_world_is_off_policy(world):
    env, policy, pi, g_star, batches = world
    for lag in (0, STALE):
        assert float(batches[lag][1].sum()) == pytest.approx(1.0, abs=1e-12)
    assert relative_bias(world, "seq_is", STALE) < 1e-10  # the enumeration reproduces an unbiased estimator exactly
    assert relative_bias(world, "reinforce", STALE) > 0.05  # and the stale sampler really is off-policy


@pytest.mark.parametrize("name", NAMES)
def test_unbiasedness_claim_holds_by_enumeration(world, name):
    claim = estimators.info(name).unbiased
    on_policy = relative_bias(world, name, 0)
    stale = relative_bias(world, name, STALE)
    if claim == "never":
        assert on_policy > 1e-3, f"{name} claims to be biased on-policy, but E[g] = grad J to {on_policy:.2e}"
        return
    assert on_policy < 1e-9, f"{name}: on-policy E[g] misses grad J by {on_policy:.2e} (relative)"
    if claim == "always":
        assert stale < 1e-9, f"{name}: stale E[g] misses grad J by {stale:.2e}"
    else:
        assert stale > 1e-3, f"{name} claims to be biased off-policy, but E[g] = grad J to {stale:.2e}"


def test_vcpo_without_its_step_scale_is_unbiased_at_any_staleness(world):
    assert relative_bias(world, "vcpo", STALE, ess_scale=False) < 1e-9
    assert relative_bias(world, "vcpo", STALE) > 1e-3


def test_a_cap_that_never_binds_makes_the_truncated_corrections_unbiased(world):
    for name, hyper in [("tis_seq", {"cap": 1e9}), ("seq_rs", {"lower": 1e-9, "upper": 1e9, "cap": 1e9})]:
        assert relative_bias(world, name, STALE, **hyper) < 1e-9, name
