"""The mismatch measurement (lab.mismatch), its study and report, on the lab's transformer and tiny Hugging Face
models, with every network connection refused."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from matplotlib.figure import Figure

import toy_envs
from lab import estimators, mismatch
from lab.errors import LabError
from lab.policies.hf import HFPolicy
from lab.policies.transformer import SIZES, TransformerPolicy
from lab.reports import mismatch as report
from lab.studies import mismatch as study


def tiny_mixtral(path, seed=0):
    """A tiny MoE (8 experts, top 2) whose large weights make a flipped route change the output a lot."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=128, initializer_range=0.2)
    MixtralForCausalLM(cfg).eval().save_pretrained(path)


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
def moe(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    tiny_mixtral(path)
    policy = HFPolicy.load(path, [[1, 2, 3, 4], [5, 6, 7, 8]], 24)
    return policy, policy.init_params()


def test_bf16_mismatch_is_real_larger_on_unlikely_tokens_growing_and_reproducible(inlab):
    policy, theta = inlab
    prompts = torch.arange(64)
    d = mismatch.draw(policy, theta, prompts, "bf16+kv", torch.Generator().manual_seed(1))
    s, curves = mismatch.summarize(d, n_boot=300)
    assert s["abs_mean"][1] > 0 and s["abs_max"][0] > 1e-3  # non-zero, with its interval clear of 0
    assert s["low_high_ratio"][1] > 1  # larger on p < 0.1 tokens than on p > 0.9 tokens, interval above 1
    assert s["growth_rate"][1] > 0  # |log w_t| grows with the length
    by_t = [r for r in curves if r["metric"] == "abs_L_by_length"]
    assert by_t[-1]["value"] > 2 * by_t[0]["value"]
    assert s["kl_k3"][0] > 0 and 0.99 < s["prob_corr"][0] <= 1
    assert abs(sum(s[f"token_share[{b}]"][0] for b in mismatch.PROB_BIN_NAMES) - 1) < 1e-9
    again = mismatch.draw(policy, theta, prompts, "bf16+kv", torch.Generator().manual_seed(1))
    for field in ("tokens", "sampler", "trainer"):
        assert torch.equal(getattr(again, field), getattr(d, field))  # bit for bit with the same seed
    assert mismatch.summarize(again, n_boot=300)[0] == s
    fp32 = mismatch.summarize(mismatch.draw(policy, theta, prompts, "fp32+kv", torch.Generator().manual_seed(1)),
                              n_boot=50)[0]
    assert fp32["abs_mean"][0] < s["abs_mean"][0] / 50


def test_replaying_routes_removes_routing_induced_mismatch(moe):
    policy, theta = moe
    d = mismatch.draw(policy, theta, torch.arange(2).repeat(24), "bf16+kv", torch.Generator().manual_seed(0))
    s, _ = mismatch.summarize(d, n_boot=200)
    assert 0 < s["route_disagreement"][0] < 0.2  # a few flipped routes ...
    assert s["kl_k3_replay"][0] < 0.2 * s["kl_k3"][0] and s["replay_kl_reduction"][1] > 0.3  # ... carry the KL
    assert s["abs_mean_replay"][0] < s["abs_mean"][0]
    fp32 = mismatch.summarize(mismatch.draw(policy, theta, torch.arange(2), "fp32+kv", torch.Generator()), 20)[0]
    assert fp32["route_disagreement"][0] == 0


def test_three_policy_batch_feeds_the_rollout_aware_estimators(inlab):
    policy, theta = inlab
    d = mismatch.draw(policy, theta, torch.arange(16), "bf16+kv", torch.Generator().manual_seed(2))
    th = theta.clone().requires_grad_(True)
    b = mismatch.three_policy_batch(policy, theta, d, theta_pi=th)
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


def test_settings_and_bad_input():
    s = mismatch.parse_setting("bf16+kv+head32")
    assert s.dtype == torch.bfloat16 and s.kv_cache and s.head32
    assert not mismatch.parse_setting("fp32").kv_cache
    for bad in ("int8", "bf16+cache", "bf16+kv+kv", ""):
        with pytest.raises(LabError, match="setting"):
            mismatch.parse_setting(bad)
    for kwargs, match in (({"settings": ["bf16+x"]}, "setting"), ({"inlab_sizes": ["huge"]}, "size"),
                          ({"inlab_env": "tiny_target"}, "task env"), ({"lm_length": 0}, "lm_length"),
                          ({"inlab_sizes": [], "lm": "none"}, "nothing"), ({"settings": ["bf16+kv+head32"]}, "head32"),
                          ({"lm_prompts": []}, "lm_prompts"), ({"n_boot": 3}, "n_boot")):
        with pytest.raises(LabError, match=match):
            study.Config(**kwargs).validate()
    with pytest.raises(LabError, match="no model at"):
        study.run(study.Config(inlab_sizes=[], lm="/nonexistent/model"), progress=False)


def test_inlab_models_run_on_the_studys_device(monkeypatch):
    """The in-lab transformer (its warm start included) runs on cfg.device, as the pretrained LM does."""
    from lab import pretrain

    device = "cuda" if torch.cuda.is_available() else "cpu"
    seen = []
    generate = TransformerPolicy.generate

    def spy(self, theta, *args, **kwargs):
        seen.append(theta.device.type)
        return generate(self, theta, *args, **kwargs)

    monkeypatch.setattr(TransformerPolicy, "generate", spy)
    cfg = study.Config(settings=["bf16+kv"], inlab_sizes=["test"], inlab_init="random", inlab_samples=1, lm="none",
                       n_boot=20, device=device)
    _, summary = study.run(cfg, progress=False)
    assert seen == [device] and summary["models"]["in-lab test"]["device"].startswith(device)

    def warm(env, size, accuracy, **kwargs):
        seen.append(kwargs["device"])
        raise LabError("stop")

    monkeypatch.setattr(pretrain, "pretrain", warm)
    with pytest.raises(LabError, match="stop"):
        study.run(dataclasses.replace(cfg, inlab_init="warm"), progress=False)
    assert seen[-1] == device
    with pytest.raises(LabError, match="device"):
        study.Config(device=f"cuda:{torch.cuda.device_count() + 4}").validate()


def test_smoke_study_and_report(tmp_path):
    """The study end to end on the small in-lab models and a tiny Hugging Face MoE, and the report built from it."""
    path = tmp_path / "lm"
    tiny_mixtral(path)
    cfg = study.Config(inlab_sizes=["test", "test_moe"], inlab_init="random", inlab_samples=1, lm=str(path),
                       lm_prompts=[[1, 2, 3], [4, 5, 6, 7]], lm_length=12, lm_nocache_length=6, n_boot=100)
    results, summary = study.run(cfg, progress=False)
    assert set(results["model"]) == {"in-lab test", "in-lab test_moe", f"LM {path}"}
    assert {"abs_mean", "abs_delta_by_prob", "abs_L_by_length", "seq_log_weight", "route_disagreement"} <= \
        set(results["metric"])
    lm = summary["models"][f"LM {path}"]
    assert set(lm["settings"]) == set(cfg.lm_settings) and lm["nocache_length"] == 6
    assert lm["settings"]["bf16+kv"]["abs_mean"][0] > lm["settings"]["fp32+kv"]["abs_mean"][0]
    text = report.answer(summary)
    assert "0.01-0.04" in text and "R3" in text and "in-lab test_moe" in text
    line = report.headline(summary)
    assert "mean |Δlog p|" in line and "routes differ" in line
    for fig in (report.abs_delta_vs_probability(results), report.log_weight_vs_length(results),
                report.setting_bars(results), report.routing_replay(results)):
        assert isinstance(fig, Figure)
    report.settings_table(summary).to_html()
    assert math.isfinite(summary["seconds"])
    again, _ = study.run(cfg, progress=False)
    assert again.equals(results)  # deterministic given the seed
