import pytest
import torch

import toy_envs
from lab.errors import LabError


@pytest.mark.parametrize("name", toy_envs.names())
def test_presets_construct_and_count(name):
    env = toy_envs.make(name)
    V, T = env.vocab_size, env.length
    expected = V**T if not env.eos else sum((V - 1) ** t for t in range(T)) + (V - 1) ** T
    assert env.num_pairs == env.n_prompts * expected


@pytest.mark.parametrize("eos", [False, True])
def test_enumeration_is_complete_and_distinct(eos):
    env = toy_envs.make("tiny_target", eos=eos, length=3, vocab_size=4)
    prompts, tokens, mask = env.enumerate()
    assert tokens.shape[0] == env.num_pairs
    keys = {(int(p), tuple(int(x) for x in t[m > 0])) for p, t, m in zip(prompts, tokens, mask)}
    assert len(keys) == env.num_pairs  # every pair once
    if eos:
        # the end token is masked in, padding after it is masked out and zero
        lengths = mask.sum(-1).long()
        for t, n in zip(tokens, lengths):
            assert (t[n:] == 0).all()
            if n < env.length:
                assert t[n - 1] == 0 and (t[: n - 1] != 0).all()


def test_enumeration_limit_points_to_monte_carlo():
    env = toy_envs.make("large_parity")
    with pytest.raises(LabError, match="Monte Carlo"):
        env.enumerate()
    toy_envs.make("large_dense").check_enumerable()  # exactly at the default limit


def test_target_reward_is_exact_match_and_unique():
    env = toy_envs.make("tiny_target")
    prompts, tokens, mask = env.enumerate()
    r = env.expected_reward(prompts, tokens, mask)
    assert set(r.tolist()) == {0.0, 1.0}
    assert r.sum() == env.n_prompts  # one target per prompt


def test_parity_reward_by_hand():
    env = toy_envs.make("tiny_parity")
    tokens = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [3, 3, 3, 3]])
    prompts = torch.tensor([0, 0, 1])
    r = env.expected_reward(prompts, tokens, torch.ones(3, 4))
    assert r.tolist() == [0.0, 1.0, 0.0]  # (0+1)%2, (0+2)%2, (1+12)%2


def test_bernoulli_reward_samples_have_the_expected_mean():
    env = toy_envs.make("small_bernoulli")
    prompts, tokens, mask = env.enumerate()
    sel = slice(0, 2000)
    p = env.expected_reward(prompts[sel], tokens[sel], mask[sel])
    assert ((p > 0) & (p < 1)).all()
    g = torch.Generator().manual_seed(0)
    draws = torch.stack([env.sample_reward(prompts[sel], tokens[sel], mask[sel], g) for _ in range(200)])
    assert set(draws.unique().tolist()) <= {0.0, 1.0}
    z = (draws.mean(0) - p) / torch.sqrt(p * (1 - p) / 200)
    assert z.abs().mean() < 1.0 and z.mean().abs() < 0.1  # |z| ~ 0.8 on average, centred


def test_dense_reward_is_sum_of_per_token_terms():
    env = toy_envs.make("small_dense")
    prompts, tokens, mask = (x[:50] for x in env.enumerate())
    _, scores = env._tables()
    by_hand = torch.tensor([sum(float(scores[p, t, y[t]]) for t in range(env.length)) / env.length
                            for p, y in zip(prompts, tokens)], dtype=torch.float64)
    assert torch.allclose(env.expected_reward(prompts, tokens, mask), by_hand)


def test_make_rejects_unknown_names_and_fields():
    with pytest.raises(LabError, match="unknown env"):
        toy_envs.make("nope")
    with pytest.raises(LabError, match="unknown env field"):
        toy_envs.make("tiny_target", colour=3)
    with pytest.raises(LabError, match="whole number from 1"):
        toy_envs.make("tiny_target", length=0)
