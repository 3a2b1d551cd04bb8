"""The transformer policy: the lab's policy protocol, torch.func gradients, MoE routing record/replay, and the
sampler/trainer mismatch contract (KV cache, bfloat16)."""
import math

import pytest
import torch
from torch.func import grad, vmap

import toy_envs
from lab import advantages as adv_mod
from lab.engine.batches import draw_batches
from lab.engine.estimator import Estimator
from lab.engine.exact import exact_support, objective, policy_gradient
from lab.engine.gradients import expected_gradient, loop_gradients, replicate_gradients
from lab.errors import LabError
from lab.policies import Perturbed, sample, sequence_log_probs
from lab.policies.transformer import SIZES, TransformerConfig, TransformerPolicy, parameter_count


pytestmark = pytest.mark.usefixtures("one_thread_module")  # before the module's warm starts


def _policy(size="test", env="chain3", **overrides):
    env = toy_envs.make(env, **overrides)
    policy = TransformerPolicy.for_env(env, size)
    theta = policy.init_params(1.0, torch.Generator().manual_seed(0), torch.float64)
    return env, policy, theta


def test_sizes_and_parameter_counts():
    for name, cfg in SIZES.items():
        d, L = cfg.n_embd, cfg.n_layer
        if not cfg.moe:
            assert parameter_count(cfg) == d * (cfg.n_tokens + cfg.block_size + 2) + L * (12 * d * d + 13 * d), name
    assert 1_000 < parameter_count(SIZES["test"]) < 10_000
    assert 0.9e6 < parameter_count(SIZES["1m"]) < 1.1e6
    env, policy, theta = _policy()
    assert policy.shape == theta.shape == (parameter_count(SIZES["test"]),)
    assert policy.gradient_backend == "functional" and policy.vocab_size == 10 and policy.length == 3


def test_logits_are_causal():
    env, policy, theta = _policy("test_moe")
    g = torch.Generator().manual_seed(1)
    prompts, tokens = torch.randint(env.n_prompts, (6,), generator=g), torch.randint(10, (6, 3), generator=g)
    base = policy.logits(theta, prompts, tokens)
    assert base.shape == (6, 3, 10) and base.dtype == torch.float64
    for t in range(3):
        changed = tokens.clone()
        changed[:, t] = (changed[:, t] + 1 + torch.arange(6) % 9) % 10
        out = policy.logits(theta, prompts, changed)
        assert torch.equal(out[:, :t + 1], base[:, :t + 1])  # positions <= t never see token t
        if t + 1 < 3:
            assert (out[:, t + 1:] - base[:, t + 1:]).abs().max() > 1e-6
    other = policy.logits(theta, (prompts + 1) % env.n_prompts, tokens)
    assert (other[:, 0] - base[:, 0]).abs().max() > 1e-6  # the prompt matters from the first position


def test_init_params():
    env, policy, theta = _policy()
    again = policy.init_params(1.0, torch.Generator().manual_seed(0), torch.float32)
    assert again.dtype == torch.float32 and torch.equal(again, theta.float())
    zero = policy.init_params(0.0, torch.Generator().manual_seed(0))
    assert torch.equal(policy.logits(zero, torch.tensor([0]), torch.zeros(1, 3, dtype=torch.long)),
                       torch.zeros(1, 3, 10, dtype=torch.float64))  # scale 0: the uniform policy
    prompts, tokens = env.enumerate()[:2]
    stds = []
    for scale in (0.5, 1.0, 2.0):
        th = policy.init_params(scale, torch.Generator().manual_seed(1))
        stds.append(float(policy.logits(th, prompts[::97], tokens[::97]).std(-1).mean()))
        assert 0.5 * scale < stds[-1] < 3 * scale  # logits of the order of scale, as the tabular N(0, scale^2)
    assert 1.8 < stds[1] / stds[0] < 2.2 and 1.8 < stds[2] / stds[1] < 2.2  # and proportional to it
    warm = TransformerPolicy.for_env(env, "test", initial=theta.float())
    assert torch.equal(warm.init_params(3.0, torch.Generator(), torch.float64), theta.float().double())
    with pytest.raises(LabError, match="needs"):
        TransformerPolicy.for_env(env, "test", initial=torch.zeros(5))


@pytest.mark.parametrize("size", ["test", "test_moe"])
def test_vmap_grad_equals_a_loop_of_backward_passes(size):
    env, policy, theta = _policy(size)
    g = torch.Generator().manual_seed(2)
    M, B = 4, 6
    prompts, tokens = torch.randint(env.n_prompts, (M, B), generator=g), torch.randint(10, (M, B, 3), generator=g)
    weights = torch.randn(M, B, 3, generator=g, dtype=torch.float64)

    def loss(th, p, y, w):
        return (torch.log_softmax(policy.logits(th, p, y), -1).gather(-1, y[..., None])[..., 0] * w).sum()

    fast = vmap(grad(loss), in_dims=(None, 0, 0, 0))(theta, prompts, tokens, weights)
    for m in range(M):
        th = theta.clone().requires_grad_(True)
        loss(th, prompts[m], tokens[m], weights[m]).backward()
        assert torch.allclose(fast[m], th.grad, atol=1e-6, rtol=0)
    assert fast.abs().max() > 1e-3


def test_engine_functional_backend_matches_its_loop():
    env, policy, theta = _policy("test_moe", "sort3", difficulty=2, n_prompts=4)
    pi = theta.float()
    g = torch.Generator().manual_seed(3)
    mu = pi + 0.05 * torch.randn(pi.shape, generator=g)
    batch = draw_batches(env, (policy, mu), 3, 8, 4, g)
    adv = adv_mod.group_advantages(batch.rewards.reshape(3, 2, 4), "drgrpo").reshape(3, 8)[..., None] * batch.mask
    for name in ["reinforce", "seq_is", "ppo_clip"]:
        est = Estimator.resolve(name, {}, "seq-mean-token-sum")
        fast, _ = replicate_gradients(policy, pi, batch, adv, est, chunk=2)
        assert torch.allclose(fast, loop_gradients(policy, pi, batch, adv, est), atol=1e-6), name


def test_exact_policy_gradient_matches_finite_differences():
    env, policy, theta = _policy("test", "sort3_dense", difficulty=2, n_prompts=3)
    support = exact_support(env, policy, theta, env.num_pairs)
    assert support.weights.shape == (env.num_pairs,) and abs(float(support.weights.sum()) - 1) < 1e-12
    g = policy_gradient(env, policy, theta, support)
    assert g.norm() > 1e-4

    def J(th):
        return objective(env, exact_support(env, policy, th, env.num_pairs))

    eps = 1e-6
    for i in torch.randperm(theta.numel(), generator=torch.Generator().manual_seed(4))[:4].tolist() + [0]:
        e = torch.zeros_like(theta)
        e[i] = eps
        fd = (J(theta + e) - J(theta - e)) / (2 * eps)
        assert abs(fd - float(g[i])) < 1e-7 + 1e-5 * abs(fd), i
    for name in ["reinforce", "seq_is", "token_is", "ppo_clip"]:  # at zero staleness every estimator is exact
        est = Estimator.resolve(name, {}, "seq-mean-token-sum")
        e = expected_gradient(env, policy, theta, (policy, theta), support, est)
        assert torch.allclose(e, g, atol=1e-12, rtol=1e-9), name


def test_noise_is_fixed_per_state():
    env, policy, theta = _policy()
    z = policy.noise_table(torch.Generator().manual_seed(0))
    prompts, tokens = torch.tensor([0, 0, 1]), torch.tensor([[1, 2, 3], [1, 2, 4], [1, 2, 3]])
    n = policy.noise_logits(z, prompts, tokens)
    assert n.shape == (3, 3, 10) and n.dtype == torch.float64
    assert torch.equal(n[0, :3], n[1, :3])  # same prompt and prefix at every position: same noise
    assert not torch.equal(n[0, 0], n[2, 0])  # another prompt: another state
    rows = policy.state_rows(*env.enumerate()[:2])
    assert rows[:, 0].unique().numel() == env.n_prompts
    assert rows.unique().numel() > 0.95 * env.n_prompts * 111  # few hash collisions
    mu = Perturbed(policy, z, 0.5)
    assert torch.allclose(mu.logits(theta, prompts, tokens), policy.logits(theta, prompts, tokens) + 0.5 * n)


def test_generate_with_kv_cache_equals_full_recompute_in_float32():
    for size in ("test", "test_moe"):
        env, policy, theta = _policy(size)
        th = theta.float()
        prompts = torch.arange(256) % env.n_prompts
        tok, lp, routes = policy.generate(th, prompts, torch.Generator().manual_seed(5))
        tok2, lp2, routes2 = policy.generate(th, prompts, torch.Generator().manual_seed(5), kv_cache=False)
        assert torch.equal(tok, tok2) and torch.allclose(lp, lp2, atol=1e-5)
        assert lp.dtype == torch.float32 and tok.shape == lp.shape == (256, 3) and (lp <= 0).all()
        assert torch.allclose(policy.score(th, prompts, tok), lp, atol=1e-5)
        engine = torch.log_softmax(policy.logits(th, prompts, tok), -1).gather(-1, tok[..., None])[..., 0]
        assert torch.allclose(engine, lp, atol=1e-5)
        same, _, _ = policy.generate(th, prompts, torch.Generator().manual_seed(5))
        other, _, _ = policy.generate(th, prompts, torch.Generator().manual_seed(6))
        assert torch.equal(tok, same) and not torch.equal(tok, other)
        if size == "test":
            assert routes is None and routes2 is None
        else:
            assert routes.shape == (256, 2, policy.prompt_length + 2, 2) and torch.equal(routes, routes2)
            assert torch.equal(routes, policy.routes(th, prompts, tok))


def test_bfloat16_sampler_differs_measurably_and_reproducibly():
    env, policy, theta = _policy()
    th = theta.float()
    prompts = torch.arange(512) % env.n_prompts
    tok, lp, _ = policy.generate(th, prompts, torch.Generator().manual_seed(7), dtype=torch.bfloat16)
    delta = (lp - policy.score(th, prompts, tok)).abs()
    assert 1e-4 < delta.mean() < 0.1
    tok2, lp2, _ = policy.generate(th, prompts, torch.Generator().manual_seed(7), dtype=torch.bfloat16)
    assert torch.equal(tok, tok2) and torch.equal(lp, lp2)  # bit for bit on the CPU
    assert (policy.score(th, prompts, tok, dtype=torch.bfloat16) - lp).abs().max() < 0.1


@pytest.mark.slow
def test_generate_samples_the_policy():
    env, policy, theta = _policy()
    th = theta.float()
    n = 20_000
    prompts = torch.zeros(n, dtype=torch.long)
    for temperature in (1.0, 2.0):
        tok, lp, _ = policy.generate(th, prompts, torch.Generator().manual_seed(8), temperature=temperature)
        p = torch.softmax(policy.logits(th, prompts[:1], tok[:1])[0, 0] / temperature, -1)
        freq = torch.bincount(tok[:, 0], minlength=10) / n
        assert (freq - p).abs().max() < 4 * math.sqrt(0.25 / n)
        assert torch.allclose(lp[:, 0], p.log()[tok[:, 0]], atol=1e-5)


def test_moe_replays_recorded_routes_exactly():
    env, policy, theta = _policy("test_moe")
    th = theta.float()
    g = torch.Generator().manual_seed(9)
    prompts, tokens = torch.randint(env.n_prompts, (64,), generator=g), torch.randint(10, (64, 3), generator=g)
    own = policy.routes(th, prompts, tokens)
    assert own.shape == (64, 2, policy.prompt_length + 2, 2) and own.dtype == torch.long
    free = policy.score(th, prompts, tokens)
    assert torch.equal(policy.score(th, prompts, tokens, routes=own), free)
    moved = (own + 1) % policy.config.n_experts  # every token to other experts
    assert (policy.score(th, prompts, tokens, routes=moved) - free).abs().max() > 1e-4
    dense_env, dense, dth = _policy("test")
    with pytest.raises(LabError, match="mixture-of-experts"):
        dense.score(dth.float(), prompts, tokens, routes=own)


def test_bad_input_is_one_clear_error():
    env, policy, theta = _policy()
    with pytest.raises(LabError, match="theta has shape"):
        policy.logits(theta[:-1], torch.tensor([0]), torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(LabError, match="unknown model size"):
        TransformerPolicy.for_env(env, "huge")
    with pytest.raises(LabError, match="do not fit"):
        TransformerPolicy(TransformerConfig(block_size=8), env.prompt_tokens, length=3)
    with pytest.raises(LabError, match="multiple of n_head"):
        TransformerConfig(n_embd=10, n_head=4)
    with pytest.raises(LabError, match="variable-length"):
        TransformerPolicy.for_env(toy_envs.make("small_eos"))


def test_bandit_envs_get_one_prompt_token_each():
    env = toy_envs.make("tiny_target")
    policy = TransformerPolicy.for_env(env, "test")
    theta = policy.init_params(1.0, torch.Generator().manual_seed(0))
    prompts, tokens, mask = env.enumerate()
    assert abs(float(sequence_log_probs(policy, theta, prompts, tokens, mask).exp().sum()) - env.n_prompts) < 1e-9
    tok, m, lp = sample(policy, theta.float(), env, torch.tensor([0, 1]), torch.Generator().manual_seed(0))
    assert tok.shape == (2, 4) and (lp <= 0).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_matches_cpu():
    env, policy, theta = _policy("test_moe")
    th, cuda = theta.float(), theta.float().cuda()
    prompts = torch.arange(64) % env.n_prompts
    tokens = torch.randint(10, (64, 3), generator=torch.Generator().manual_seed(0))
    out = policy.logits(cuda, prompts, tokens)
    assert out.device.type == "cuda" and torch.allclose(out.cpu(), policy.logits(th, prompts, tokens), atol=1e-4)
    tok, lp, routes = policy.generate(theta.cuda(), prompts, torch.Generator().manual_seed(0), dtype=torch.float64)
    tok_cpu, lp_cpu, _ = policy.generate(theta, prompts, torch.Generator().manual_seed(0), dtype=torch.float64)
    assert torch.equal(tok.cpu(), tok_cpu) and torch.allclose(lp.cpu(), lp_cpu, atol=1e-5)
    assert torch.allclose(policy.score(cuda, prompts, tok, routes=routes).cpu(), lp_cpu, atol=1e-4)
    z = policy.noise_table(torch.Generator().manual_seed(0)).cuda()
    assert Perturbed(policy, z, 0.1).logits(cuda.double(), prompts, tokens).device.type == "cuda"
    g = vmap(grad(lambda t, p, y: policy.logits(t, p, y).logsumexp(-1).sum()), in_dims=(None, 0, 0))(
        cuda, prompts.reshape(4, 16), tokens.reshape(4, 16, 3))
    assert g.shape == (4, policy.n_params) and g.device.type == "cuda"
