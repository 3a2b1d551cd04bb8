import pytest
import torch

import toy_envs
from lab.policies import init_params, make_policy, sample, sequence_log_probs, token_log_probs


@pytest.mark.parametrize("kind", ["prefix", "markov"])
@pytest.mark.parametrize("eos", [False, True])
def test_sequence_probabilities_sum_to_one_per_prompt(kind, eos):
    env = toy_envs.make("tiny_target", eos=eos, vocab_size=4, length=4)
    policy = make_policy(kind, env)
    theta = init_params(policy, 2.0, torch.Generator().manual_seed(1))
    prompts, tokens, mask = env.enumerate()
    p = torch.exp(sequence_log_probs(policy, theta, prompts, tokens, mask))
    totals = torch.zeros(env.n_prompts, dtype=torch.float64).index_add_(0, prompts, p)
    assert torch.allclose(totals, torch.ones_like(totals), atol=1e-12)


def test_prefix_tree_represents_any_sequence_distribution():
    env = toy_envs.make("tiny_target", n_prompts=1, vocab_size=3, length=3)
    policy = make_policy("prefix", env)
    prompts, tokens, mask = env.enumerate()
    target = torch.distributions.Dirichlet(torch.ones(tokens.shape[0], dtype=torch.float64)).sample()
    theta = torch.full(policy.shape, -60.0, dtype=torch.float64)
    rows = policy.rows(prompts, tokens)  # [N, T]
    V = env.vocab_size
    flat = theta.reshape(-1, V)
    for t in range(env.length):  # logits = log P(prefix + a) (unnormalised conditionals)
        prefix_mass = {}
        for i in range(tokens.shape[0]):
            key = (int(rows[i, t]), int(tokens[i, t]))
            prefix_mass[key] = prefix_mass.get(key, 0.0) + float(target[i])
        for (row, a), mass in prefix_mass.items():
            flat[row, a] = torch.log(torch.tensor(mass, dtype=torch.float64))
    logp = sequence_log_probs(policy, theta, prompts, tokens, mask)
    assert torch.allclose(torch.exp(logp), target, atol=1e-12)


@pytest.mark.parametrize("kind", ["prefix", "markov"])
@pytest.mark.slow
def test_sampling_matches_probabilities_and_records_log_probs(kind):
    env = toy_envs.make("tiny_target", n_prompts=1, vocab_size=3, length=3, eos=True)
    policy = make_policy(kind, env)
    theta = init_params(policy, 1.0, torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(3)
    n = 40_000
    tokens, mask, logp = sample(policy, theta, env, torch.zeros(n, dtype=torch.long), g)
    # recorded log-probs equal a re-computation, and padding is masked
    assert torch.allclose(logp, token_log_probs(policy, theta, torch.zeros(n, dtype=torch.long), tokens) * mask)
    assert torch.equal(mask, env.mask_of(tokens).to(mask.dtype))
    prompts, all_tokens, all_mask = env.enumerate()
    p = torch.exp(sequence_log_probs(policy, theta, prompts, all_tokens, all_mask))
    index = {tuple(t.tolist()): i for i, t in enumerate(all_tokens)}
    counts = torch.zeros(len(index), dtype=torch.float64)
    for t in tokens:
        counts[index[tuple(t.tolist())]] += 1
    chi2 = float(((counts - n * p) ** 2 / (n * p)).sum())
    df = len(index) - 1
    assert chi2 < df + 4 * (2 * df) ** 0.5  # about 4 sd above the chi-square mean: a fixed seed, not a flake


def test_sampling_is_seeded(tiny):
    env, policy, theta = tiny
    prompts = torch.zeros(100, dtype=torch.long)
    a = sample(policy, theta, env, prompts, torch.Generator().manual_seed(5))[0]
    b = sample(policy, theta, env, prompts, torch.Generator().manual_seed(5))[0]
    c = sample(policy, theta, env, prompts, torch.Generator().manual_seed(6))[0]
    assert torch.equal(a, b) and not torch.equal(a, c)
