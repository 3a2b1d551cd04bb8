"""The mismatch measurement (lab.studies.mismatch.measure) on the lab's transformer and a tiny Hugging Face MoE, with
every network connection refused."""
from __future__ import annotations

import dataclasses

import pytest
import torch

import toy_envs
from lab import estimators
from lab.errors import LabError
from lab.policies.hf import HFPolicy
from lab.policies.transformer import SIZES, TransformerPolicy
from lab.studies.mismatch import measure

pytestmark = pytest.mark.usefixtures("no_network", "one_thread")


@pytest.fixture(scope="module")
def inlab():
    """The lab's dense test transformer over chain6's prompts, answering 32 tokens (a long response to grow along)."""
    env = toy_envs.make("chain6")
    cfg = dataclasses.replace(SIZES["test"], block_size=64)
    policy = TransformerPolicy(cfg, env.prompt_tokens, length=32, vocab_size=10)
    theta = policy.init_params(2.0, torch.Generator().manual_seed(0), torch.float32)
    return policy, theta


@pytest.fixture(scope="module")
def moe(tiny_mixtral):
    policy = HFPolicy.load(tiny_mixtral, [[1, 2, 3, 4], [5, 6, 7, 8]], 24)
    return policy, policy.init_params()


def test_bf16_mismatch_is_real_larger_on_unlikely_tokens_growing_and_reproducible(inlab):
    policy, theta = inlab
    prompts = torch.arange(64)
    d = measure.draw(policy, theta, prompts, "bf16+kv", torch.Generator().manual_seed(1))
    s, curves = measure.summarize(d, n_boot=300)
    assert s["abs_mean"][1] > 0 and s["abs_max"][0] > 1e-3  # non-zero, with its interval clear of 0
    assert s["low_high_ratio"][1] > 1  # larger on p < 0.1 tokens than on p > 0.9 tokens, interval above 1
    assert s["growth_rate"][1] > 0  # |log w_t| grows with the length
    by_t = [r for r in curves if r["metric"] == "abs_L_by_length"]
    assert by_t[-1]["value"] > 2 * by_t[0]["value"]
    assert s["kl_k3"][0] > 0 and 0.99 < s["prob_corr"][0] <= 1
    assert abs(sum(s[f"token_share[{b}]"][0] for b in measure.PROB_BIN_NAMES) - 1) < 1e-9
    again = measure.draw(policy, theta, prompts, "bf16+kv", torch.Generator().manual_seed(1))
    for field in ("tokens", "sampler", "trainer"):
        assert torch.equal(getattr(again, field), getattr(d, field))  # bit for bit with the same seed
    assert measure.summarize(again, n_boot=300)[0] == s
    fp32 = measure.summarize(measure.draw(policy, theta, prompts, "fp32+kv", torch.Generator().manual_seed(1)),
                             n_boot=50)[0]
    assert fp32["abs_mean"][0] < s["abs_mean"][0] / 50


def test_replaying_routes_removes_routing_induced_mismatch(moe):
    policy, theta = moe
    d = measure.draw(policy, theta, torch.arange(2).repeat(24), "bf16+kv", torch.Generator().manual_seed(0))
    s, _ = measure.summarize(d, n_boot=200)
    assert 0 < s["route_disagreement"][0] < 0.2  # a few flipped routes ...
    assert s["kl_k3_replay"][0] < 0.2 * s["kl_k3"][0] and s["replay_kl_reduction"][1] > 0.3  # ... carry the KL
    assert s["abs_mean_replay"][0] < s["abs_mean"][0]
    fp32 = measure.summarize(measure.draw(policy, theta, torch.arange(2), "fp32+kv", torch.Generator()), 20)[0]
    assert fp32["route_disagreement"][0] == 0


def test_three_policy_batch_feeds_the_rollout_aware_estimators(inlab):
    policy, theta = inlab
    d = measure.draw(policy, theta, torch.arange(16), "bf16+kv", torch.Generator().manual_seed(2))
    th = theta.clone().requires_grad_(True)
    b = measure.three_policy_batch(policy, theta, d, theta_pi=th)
    assert torch.equal(b["log_prob"].detach(), b["old_log_prob"])  # pi = pi_old: only the sampler differs
    adv = torch.randn(16, 1, generator=torch.Generator().manual_seed(3)) * b["response_mask"]
    gaps = (b["old_log_prob"] - b["rollout_log_probs"]).abs().sum()
    assert gaps > 0
    for name in ("tis_token", "tis_seq", "mis_token", "mis_seq", "vespo"):
        info = estimators.info(name)
        assert "rollout_log_probs" in info.optional_inputs
        loss, metrics = info.fn(b["log_prob"], b["old_log_prob"], adv, b["response_mask"],
                                rollout_log_probs=b["rollout_log_probs"])
        (grad,) = torch.autograd.grad(loss, th, retain_graph=True)
        assert torch.isfinite(loss) and torch.isfinite(grad).all() and grad.abs().max() > 0, name
        plain, _ = info.fn(b["log_prob"], b["old_log_prob"], adv, b["response_mask"])
        if name in ("tis_token", "mis_token", "tis_seq", "mis_seq"):
            expected = ((b["rollout_log_probs"] - b["old_log_prob"]) * b["response_mask"]).sum() / \
                b["response_mask"].sum()
            assert torch.allclose(metrics["rollout_kl"], expected, atol=1e-6)
        assert not torch.equal(loss.detach(), plain.detach()) or name == "mis_seq", name  # the sampler's log-probs act


def test_settings_are_parsed_and_bad_ones_refused():
    s = measure.parse_setting("bf16+kv+head32")
    assert s.dtype == torch.bfloat16 and s.kv_cache and s.head32
    assert not measure.parse_setting("fp32").kv_cache
    for bad in ("int8", "bf16+cache", "bf16+kv+kv", ""):
        with pytest.raises(LabError, match="setting"):
            measure.parse_setting(bad)
