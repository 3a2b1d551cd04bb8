"""The training simulator's truncating sampler (top-p, top-k, min-p) and mask replay (lab/engine/training.py):
settings that cut nothing are bit-identical to no truncation, bad values are refused before any work, the logged
sampler log-probs are the truncated, renormalised ones, and mask replay makes the on-policy ratio exactly 1."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import toy_envs
from lab.cli import main
from lab.engine.sweep import SweepSpec, expand
from lab.engine.training import TrainConfig, _Run, train
from lab.engine.truncation import kept_mass_log_probs
from lab.errors import LabError

FAST = dict(env="tiny_parity", rollout_batch=32, group_size=4, steps=4, record_params=True)
V = toy_envs.make("tiny_parity").vocab_size


def _same(a, b) -> None:
    assert torch.equal(a.params, b.params)
    for col in ("expected_reward", "loss", "grad_norm", "sampled_reward", "ess_frac"):
        np.testing.assert_array_equal(a.table[col].to_numpy(), b.table[col].to_numpy())


@pytest.mark.parametrize("extra", [{}, dict(regime="mismatch", logprob_noise=0.3, sampler_temperature=1.3)])
@pytest.mark.slow
def test_settings_that_cut_nothing_train_bit_identically(extra):
    base = train(TrainConfig(**FAST, **extra), progress=False)
    for knobs in (dict(top_p=1.0), dict(top_k=V), dict(min_p=0.0), dict(top_p=1.0, top_k=V, mask_replay=True)):
        run = train(TrainConfig(**FAST, **extra, **knobs), progress=False)
        _same(run, base)
        assert "kept_mass" not in run.table
    cut = train(TrainConfig(**FAST, **extra, top_k=V - 1), progress=False)  # ... and a setting that cuts differs
    assert not torch.equal(cut.params, base.params)


@pytest.mark.parametrize("flags, needle", [
    (["--top-p", "0"], "top_p"),
    (["--top-p", "1.5"], "top_p"),
    (["--top-k", "0"], "top_k"),
    (["--top-k", str(V + 1)], "exceeds the vocabulary size"),
    (["--min-p", "1"], "min_p"),
    (["--min-p", "-0.1"], "min_p"),
    (["--top-p", "0.9", "--mask-replay", "true", "--estimator", "_none_"], "unknown estimator"),
])
def test_bad_values_are_one_line_and_exit_2_before_any_work(tmp_path, monkeypatch, capsys, flags, needle):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--env", "tiny_parity", *flags, "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    assert os.listdir(tmp_path) == []




def test_sweeps_accept_the_knobs():
    spec = SweepSpec(name="t", base=dict(FAST, mask_replay=True), grid={"top_p": [1, 0.8], "top_k": [None, 2]})
    cells = expand(spec)
    assert [(c["top_p"], c["top_k"]) for c in cells] == [(1.0, None), (1.0, 2), (0.8, None), (0.8, 2)]
    with pytest.raises(LabError, match="top_p"):
        expand(SweepSpec(name="t", base={}, grid={"top_p": [0.8, 0]}))


@pytest.mark.parametrize("knobs", [dict(top_p=0.8), dict(top_k=2), dict(min_p=0.3)])
@pytest.mark.slow
def test_the_logged_sampler_log_probs_are_the_truncated_renormalised_ones(knobs):
    cfg = TrainConfig(**FAST, **knobs)
    cfg.validate()
    run = _Run(cfg, progress=False)
    ro = run.rollout(0)
    theta = run.snapshots[0]
    # every sampled token lies in its recorded kept set, and log mu = log pi - log pi(S_t) (the kept mass alone)
    inside = ro.kept.gather(-1, ro.tokens[..., None]).squeeze(-1)
    assert bool(inside[ro.mask > 0].all()) and bool((~ro.kept).any())
    predicted = kept_mass_log_probs(run.policy, theta, ro.prompts, ro.tokens, ro.mask, ro.kept)
    torch.testing.assert_close(ro.lp_mu.double(), predicted, rtol=0, atol=1e-5)
    # the trained run: on-policy (sync, N = 1) every token ratio pi / mu is the kept mass, below 1
    table = train(cfg, progress=False).table
    assert (table["token_ratio"] < 1).all()
    np.testing.assert_allclose(table["token_ratio"], table["kept_mass"], rtol=1e-5)


@pytest.mark.parametrize("estimator", ["reinforce", "seq_is", "ppo_clip", "decoupled_ppo"])
@pytest.mark.slow
def test_mask_replay_makes_the_on_policy_ratio_one(estimator):
    cfg = dict(FAST, top_p=0.8, estimator=estimator)
    replay = train(TrainConfig(**cfg, mask_replay=True), progress=False)
    assert (replay.table["token_ratio"] == 1).all()  # exactly: the trainer scores log q as the sampler did
    assert (replay.table["kept_mass"] < 1).all()
    assert (replay.table["ess_frac"] == 1).all()
    plain = train(TrainConfig(**cfg), progress=False)
    assert (plain.table["token_ratio"] < 1).all()
    # stale mini-batches move the ratio away from 1 even with replay: the metric can fail
    stale = train(TrainConfig(**dict(cfg, minibatches=2), mask_replay=True), progress=False)
    assert (stale.table.loc[stale.table["minibatch"] == 1, "token_ratio"] != 1).all()


def test_with_replay_every_ratio_estimator_trains_like_replayed_reinforce_at_n1():
    # on-policy with replay the ratio is 1, so sequence IS's gradient is REINFORCE's on log q; without replay the
    # sequence ratio prod_t pi(S_t) < 1 scales it down and the trajectories part
    cfg = dict(FAST, top_p=0.8)
    base = train(TrainConfig(**cfg, mask_replay=True), progress=False)
    for name in ("seq_is", "token_is", "ppo_clip"):
        run = train(TrainConfig(**cfg, estimator=name, mask_replay=True), progress=False)
        assert float((run.params - base.params).abs().max()) <= 1e-6, name
    plain = train(TrainConfig(**cfg, estimator="seq_is"), progress=False)
    assert float((plain.params - base.params).abs().max()) > 1e-4


def test_mismatch_with_truncation_records_kept_sets_and_replays_pi_old():
    cfg = TrainConfig(**FAST, regime="mismatch", logprob_noise=0.5, top_p=0.7, mask_replay=True,
                      estimator="decoupled_ppo")
    cfg.validate()
    run = _Run(cfg, progress=False)
    ro = run.rollout(0)
    inside = ro.kept.gather(-1, ro.tokens[..., None]).squeeze(-1)
    assert bool(inside[ro.mask > 0].all()) and bool((~ro.kept).any())
    assert torch.isfinite(ro.lp_mu).all() and torch.isfinite(ro.lp_old).all()
    full = run.trainer_log_probs(run.snapshots[0], ro.prompts, ro.tokens).to(ro.lp_old.dtype) * ro.mask
    assert bool((ro.lp_old >= full - 1e-6).all()) and bool((ro.lp_old > full + 1e-6).any())  # renormalised: larger
    table = train(cfg, progress=False).table
    assert table["finite"].all()


# ------------------------------------------------------------------------------------------ the transformer's engine
NET = dict(env="chain3", policy="transformer", size="test", rollout_batch=16, group_size=4, steps=2, lr=1e-3,
           record_params=True)


def test_the_transformer_sampler_truncates_each_decoding_step():
    from lab.policies import make_policy
    from lab.policies.truncation import kept_set, replayed

    env = toy_envs.make("chain3")
    policy = make_policy("transformer", env, "test")
    theta = policy.init_params(0.5, torch.Generator().manual_seed(0), torch.float32)
    prompts = torch.arange(env.n_prompts).repeat(8)
    plain = policy.generate(theta, prompts, torch.Generator().manual_seed(1))
    same = policy.generate(theta, prompts, torch.Generator().manual_seed(1), truncation=dict(top_k=policy.vocab_size))
    assert all(torch.equal(a, b) for a, b in zip(plain[:2], same[:2])) and bool(same[3].all())
    for kv in (True, False):
        tokens, lp, _, kept = policy.generate(theta, prompts, torch.Generator().manual_seed(1), kv_cache=kv,
                                              truncation=dict(top_p=0.7))
        logits = policy.logits(theta, prompts, tokens)
        # the trainer's teacher-forced logits give the same kept sets up to rounding at the boundary
        assert float((kept != kept_set(logits, top_p=0.7)).double().mean()) < 0.01
        assert bool(kept.gather(-1, tokens[..., None]).all()) and bool((~kept).any())
        torch.testing.assert_close(lp, replayed(logits, tokens, kept), rtol=0, atol=1e-5)


def test_transformer_training_truncates_and_replays():
    base = train(TrainConfig(**NET), progress=False)
    _same(train(TrainConfig(**NET, top_p=1.0, min_p=0.0), progress=False), base)
    plain = train(TrainConfig(**NET, top_p=0.7), progress=False).table
    assert (plain["token_ratio"] < 0.99).all()
    np.testing.assert_allclose(plain["token_ratio"], plain["kept_mass"], rtol=1e-4)  # KV cache: rounding only
    replay = train(TrainConfig(**NET, top_p=0.7, mask_replay=True), progress=False).table
    np.testing.assert_allclose(replay["token_ratio"], 1.0, atol=1e-4)
    assert (replay["kept_mass"] < 0.99).all()


@pytest.mark.usefixtures("no_network")
@pytest.mark.slow
def test_a_local_hf_model_samples_from_its_kept_sets(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from lab.policies.hf import HFPolicy
    from lab.policies.truncation import replayed

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                 initializer_range=0.2)).eval().save_pretrained(tmp_path)
    policy = HFPolicy.load(tmp_path, [[5, 6, 7, 8], [9, 10]], 5)
    theta = policy.init_params()
    prompts = torch.tensor([0, 1, 0, 1])
    plain = policy.generate(theta, prompts, torch.Generator().manual_seed(0))
    same = policy.generate(theta, prompts, torch.Generator().manual_seed(0), truncation=dict(top_p=1.0))
    assert all(torch.equal(a, b) for a, b in zip(plain[:2], same[:2]))
    tokens, lp, _, kept = policy.generate(theta, prompts, torch.Generator().manual_seed(0),
                                          truncation=dict(top_k=3))
    assert bool(kept.gather(-1, tokens[..., None]).all()) and bool((kept.sum(-1) == 3).all())
    torch.testing.assert_close(lp, replayed(policy.logits(theta, prompts, tokens), tokens, kept), rtol=0, atol=1e-5)
