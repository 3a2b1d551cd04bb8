"""RL training of the lab's transformer (lab/engine/training.py with policy="transformer"): the N = 1 identity,
exact reproduction, real mismatch, bad input, a killed sweep that resumes to the uninterrupted result (the
real_staleness_training study built on it has its tests in its folder)."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lab.engine.sweep import load_results, load_spec, run_sweep
from lab.engine.training import TrainConfig, train
from lab.errors import LabError

LAB = Path(sys.executable).parent / "lab"
TINY = dict(env="chain3", policy="transformer", size="test", warm_start=0.3, rollout_batch=16, group_size=4, steps=3,
            lr=1e-3)
RATIO_BASED = ["seq_is", "token_is", "ppo_clip", "tis_token", "tis_seq", "mis_token", "mis_seq", "vespo", "cispo",
               "gspo", "gmpo", "sapo"]


@pytest.mark.slow
def test_n1_every_ratio_estimator_follows_reinforce_on_the_transformer():
    # sync, N = 1: the trainer's pi_old and pi are the same full-sequence pass on the same parameters, so every ratio
    # is exactly 1 and each estimator's gradient is REINFORCE's (SAPO's gate at ratio 1 included). In float64: Adam
    # divides each gradient component by its own running scale, so in float32 the rounding noise of components whose
    # gradient is ~1e-7 (a loss written in another order, e.g. GMPO's geometric mean) becomes a step of size lr.
    base = train(TrainConfig(**TINY, dtype="float64", record_params=True), progress=False)
    assert (base.table["grad_norm"] > 0).sum() >= 2  # a rollout whose groups all tie has zero advantages
    assert float((base.params[-1] - base.params[0]).abs().max()) > 1e-4  # the updates move the network
    for name in RATIO_BASED:
        run = train(TrainConfig(**TINY, dtype="float64", estimator=name, record_params=True), progress=False)
        diff = float((run.params - base.params).abs().max())
        assert diff <= 1e-9, f"{name} departs from reinforce by {diff}"
    # ... and it can fail: with N = 4 the stale mini-batches make sequence IS differ from REINFORCE
    stale = dict(TINY, dtype="float64", minibatches=4, rollout_batch=32, record_params=True)
    a = train(TrainConfig(**stale), progress=False)
    b = train(TrainConfig(**stale, estimator="seq_is"), progress=False)
    assert float((a.params - b.params).abs().max()) > 1e-4


@pytest.mark.slow
def test_same_seed_reproduces_a_run_exactly_and_another_seed_differs():
    cfg = dict(TINY, estimator="vespo", regime="async", minibatches=2, lag_max=2, eta=1, over_stale="requeue")
    a, b = train(TrainConfig(**cfg), progress=False), train(TrainConfig(**cfg), progress=False)
    pd.testing.assert_frame_equal(a.table, b.table)
    c = train(TrainConfig(**cfg, seed=1), progress=False)
    assert not np.allclose(a.table["loss"], c.table["loss"])


@pytest.mark.slow
def test_task_metrics_are_exact_accuracies():
    run = train(TrainConfig(**TINY), progress=False)
    t = run.table
    assert {"expected_reward", "heldout_accuracy", "kl_to_init_answers", "entropy_answers"} <= set(t.columns)
    # the warm start's exact accuracy is the checkpoint's own figure (mean_x pi(a*|x) on the training prompts)
    from lab.pretrain import pretrain
    import toy_envs

    ck = pretrain(toy_envs.make("chain3"), "test", 0.3, progress=False)
    assert run.summary["initial_expected_reward"] == pytest.approx(ck.accuracy, abs=1e-6)
    assert run.summary["initial_heldout_accuracy"] == pytest.approx(ck.heldout_accuracy, abs=1e-6)
    assert (t["kl_to_init_answers"] > 0).all() and (t["entropy_answers"] > 0).all()


@pytest.mark.slow
def test_a_bf16_sampler_is_a_real_mismatch_and_replay_runs():
    base = dict(TINY, size="test_moe", regime="mismatch", estimator="tis_seq")
    fp32 = train(TrainConfig(**base), progress=False).table["mismatch_abs_logprob"]
    bf16 = train(TrainConfig(**base, sampler_dtype="bfloat16"), progress=False).table["mismatch_abs_logprob"]
    assert fp32.max() < 1e-5  # a float32 sampler with a KV cache differs from the trainer only by rounding
    assert bf16.min() > 1e-3  # bfloat16 weights: a mismatch of the size practitioners report
    replay = train(TrainConfig(**base, sampler_dtype="bfloat16", replay_routes=True), progress=False)
    assert replay.table["finite"].all()


@pytest.mark.parametrize("flags, words", [
    (["--size", "huge"], "unknown model size"),
    (["--sampler-dtype", "bfloat16"], "use regime 'mismatch'"),
    (["--regime", "mismatch", "--replay-routes", "true"], "mixture-of-experts"),
    (["--env", "tiny_target", "--warm-start", "0.3"], "needs a task env"),
    (["--env", "chain3_dense"], "exact-match reward"),
    (["--warm-start", "1.5"], "warm_start"),
    (["--device", "tpu"], "device"),
])
@pytest.mark.slow
def test_bad_transformer_settings_are_one_line_and_exit_2(tmp_path, flags, words):
    args = ["train", "--policy", "transformer", "--env", "chain3", "--size", "test", *flags, "--out",
            str(tmp_path / "run")]
    out = subprocess.run([str(LAB), *args], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "LAB_QUIET": "1"})
    assert out.returncode == 2, out.stderr
    assert words in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "run").exists()


def test_tabular_runs_refuse_transformer_fields():
    with pytest.raises(LabError, match="sampler_dtype applies only with policy transformer or hf"):
        TrainConfig(sampler_dtype="bfloat16").validate()


SPEC = """name: real
base: {env: chain3, policy: transformer, size: test, warm_start: 0.3, steps: 12, rollout_batch: 64, group_size: 4,
       lr: 0.001, minibatches: 4}
grid:
  estimator: [reinforce, vespo]
  seed: [0, 1, 2]
"""


@pytest.mark.slow
def test_a_killed_transformer_sweep_resumes_to_the_uninterrupted_result(tmp_path):
    spec = tmp_path / "real.yaml"
    spec.write_text(SPEC)
    env = {**os.environ, "LAB_QUIET": "1"}
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    cmd = [str(LAB), "sweep", str(spec), "--workers", "2"]
    assert subprocess.run([*cmd, "--out", str(whole)], env=env, capture_output=True, timeout=600).returncode == 0
    driver = subprocess.Popen([*cmd, "--out", str(killed)], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((killed / "cells").glob("[!.]*"))) < 1:
        time.sleep(0.1)
    time.sleep(random.Random(0).uniform(0.0, 0.3))  # a point after the first finished cell (a cell takes seconds)
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    finished = len(list((killed / "cells").glob("[!.]*")))
    assert 1 <= finished < 6, f"kill landed with {finished} of 6 cells finished"
    done = subprocess.run([*cmd, "--out", str(killed)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert f"{finished} already done" in done.stdout and "6 in all" in done.stdout
    (sa, ra), (sb, rb) = load_results(whole), load_results(killed)
    assert len(ra) == len(rb) == 6 and rb["cell_id"].is_unique
    pd.testing.assert_frame_equal(sa, sb)
    pd.testing.assert_frame_equal(ra.drop(columns=["rollouts"], errors="ignore"),
                                  rb.drop(columns=["rollouts"], errors="ignore"))


@pytest.mark.slow
def test_a_transformer_sweep_on_ray_equals_the_local_pool(tmp_path):
    spec = tmp_path / "real.yaml"
    spec.write_text(SPEC.replace("seed: [0, 1, 2]", "seed: [0]"))
    spec = load_spec(spec)
    assert run_sweep(spec, tmp_path / "local", "local", workers=2)["done"] == 2
    assert run_sweep(spec, tmp_path / "ray", "ray", workers=2)["done"] == 2  # a local Ray instance, num_cpus=2
    (sa, ra), (sb, rb) = load_results(tmp_path / "local"), load_results(tmp_path / "ray")
    pd.testing.assert_frame_equal(sa, sb, check_exact=True)
    pd.testing.assert_frame_equal(ra, rb, check_exact=True)


@pytest.mark.parametrize("text, words", [
    ("name: x\nkind: nope\ngrid: {seed: [0]}\n", "unknown sweep kind 'nope'"),
    ("name: x\nbase: {policy: transformer, env: chain3}\ngrid: {size: [test, huge]}\n", "unknown model size"),
    ("name: x\nbase: {policy: transformer, env: chain3, size: test}\ngrid: {sampler_dtype: [bfloat16]}\n",
     "use regime 'mismatch'"),
    ("name: x\nbase: {policy: transformer, env: chain3, size: test}\ngrid: {teacher: [a]}\n", "not TrainConfig fields"),
])
@pytest.mark.slow
def test_bad_transformer_sweep_specs_are_one_line_and_exit_2(tmp_path, text, words):
    spec = tmp_path / "bad.yaml"
    spec.write_text(text)
    out = subprocess.run([str(LAB), "sweep", str(spec), "--out", str(tmp_path / "run")], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "LAB_QUIET": "1"})
    assert out.returncode == 2 and words in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_sweep_device_flag_overrides_the_base_and_is_refused_where_it_cannot_apply(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nbase: {policy: transformer, env: chain3, size: test}\ngrid: {device: [cpu]}\n")
    out = subprocess.run([str(LAB), "sweep", str(spec), "--device", "cpu", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "LAB_QUIET": "1"})
    assert out.returncode == 2 and "--device" in out.stderr, out.stderr
    spec.write_text("name: s\nbase: {policy: transformer, env: chain3, size: test}\ngrid: {seed: [0]}\n")
    out = subprocess.run([str(LAB), "sweep", str(spec), "--device", "tpu", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "LAB_QUIET": "1"})
    assert out.returncode == 2 and "device" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


def test_a_run_takes_its_warm_start_trained_on_its_own_device(monkeypatch):
    # the warm start's cache key holds the device type (lab.pretrain.run_config): a CUDA run must ask for the CUDA
    # warm start, not train the CPU one on one CPU thread in every worker
    import lab.pretrain

    asked = []
    real = lab.pretrain.warm_start

    def spy(env, size, target, **kw):
        asked.append(kw.get("device", "cpu (the default)"))
        return real(env, size, target, **kw)

    monkeypatch.setattr(lab.pretrain, "warm_start", spy)
    train(TrainConfig(**dict(TINY, steps=1), device="cpu"), progress=False)
    assert asked == ["cpu"]
