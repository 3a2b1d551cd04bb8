"""Supervised warm start: reaches its target, caches per config outside the repository, reuses, refuses bad input
and corrupt files, and writes nothing half-done."""
import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

import toy_envs
from lab import pretrain as pt
from lab.errors import LabError
from lab.policies.transformer import TransformerPolicy

TARGET = 0.3


pytestmark = pytest.mark.usefixtures("one_thread_module")  # before the module's warm starts


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def env():
    return toy_envs.make("sort3", n_prompts=8)


def _files(root: Path):
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def test_cache_folder_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("LAB_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert pt.cache_dir() == tmp_path / "xdg" / "offpolicy-lab"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert pt.cache_dir() == tmp_path / "home" / ".cache" / "offpolicy-lab"
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path / "mine"))
    assert pt.cache_dir() == tmp_path / "mine"


@pytest.mark.slow
def test_warm_start_reaches_its_target_and_is_reused(cache, env, monkeypatch):
    ck = pt.pretrain(env, "test", TARGET, max_steps=2000, seed=0)
    assert ck.trained and ck.steps > 0 and ck.path.parent == cache / "pretrain" and ck.path.exists()
    assert TARGET <= ck.accuracy < TARGET + 0.1 and 0 <= ck.greedy_accuracy <= 1
    policy = TransformerPolicy.for_env(env, "test", initial=ck.theta)
    theta = policy.init_params(1.0, torch.Generator(), torch.float32)
    assert pt.accuracies(policy, theta, env.prompt_tokens, env.answers)[0] == pytest.approx(ck.accuracy, abs=1e-6)
    prompts, tokens, mask = env.enumerate()  # the accuracy IS the exact expected exact-match reward J
    p = torch.softmax(policy.logits(theta.double(), prompts, tokens), -1).gather(-1, tokens[..., None])[..., 0]
    J = float((p.prod(-1) * env.expected_reward(prompts, tokens, mask)).sum() / env.n_prompts)
    assert J == pytest.approx(ck.accuracy, abs=1e-5)

    monkeypatch.setattr(pt, "_train", lambda *a, **k: pytest.fail("a cached warm start was trained again"))
    again = pt.pretrain(env, "test", TARGET, max_steps=2000, seed=0)
    assert not again.trained and again.path == ck.path and torch.equal(again.theta, ck.theta)
    assert again.accuracy == ck.accuracy and again.steps == ck.steps
    assert torch.equal(pt.warm_start(env, "test", TARGET, seed=0), ck.theta)
    assert _files(cache) == [ck.path.parent / ".lab", ck.path]  # the folder's marker; no temporary files left


def test_the_key_covers_the_config(cache, env):
    base = pt.checkpoint_path(pt.run_config(env, "test", TARGET, 0, "cpu"))
    others = [pt.run_config(env, "small", TARGET, 0, "cpu"), pt.run_config(env, "test", 0.4, 0, "cpu"),
              pt.run_config(env, "test", TARGET, 1, "cpu"), pt.run_config(env, "test", TARGET, 0, "cuda"),
              pt.run_config(toy_envs.make("sort3", n_prompts=9), "test", TARGET, 0, "cpu"),
              pt.run_config(toy_envs.make("sort3", n_prompts=8, seed=1), "test", TARGET, 0, "cpu"),
              pt.run_config(toy_envs.make("chain3", n_prompts=8), "test", TARGET, 0, "cpu")]
    paths = {pt.checkpoint_path(c) for c in others}
    assert base not in paths and len(paths) == len(others)
    assert pt.checkpoint_path(pt.run_config(env, "test", TARGET, 0, "cpu")) == base  # stable
    # the reward does not change what is learned: exact match and partial credit share a checkpoint
    dense = dataclasses.replace(env, reward="dense", name="sort3_dense")
    assert pt.checkpoint_path(pt.run_config(dense, "test", TARGET, 0, "cpu")) == base
    config = pt.run_config(env, "test", TARGET, 0, "cpu")
    assert config["code"] == pt.code_version() and config["torch"] == torch.__version__


def test_corrupt_or_mismatched_checkpoints_are_refused(cache, env):
    path = pt.checkpoint_path(pt.run_config(env, "test", TARGET, 0, "cpu"))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(LabError, match=f"{path}.*corrupt"):
        pt.pretrain(env, "test", TARGET)
    torch.save({"format": pt.FORMAT, "config": {"size": "test"}, "theta": torch.zeros(3)}, path)
    with pytest.raises(LabError, match="corrupt"):
        pt.pretrain(env, "test", TARGET)
    assert _files(cache) == [path]  # refused, neither replaced nor joined by anything


def test_bad_input_is_one_clear_error_and_writes_nothing(cache, env):
    with pytest.raises(LabError, match="unknown model size"):
        pt.pretrain(env, "huge")
    with pytest.raises(LabError, match="not a task"):
        pt.pretrain(toy_envs.make("tiny_target"))
    with pytest.raises(LabError, match="strictly between 0 and 1"):
        pt.pretrain(env, target_accuracy=1.0)
    with pytest.raises(LabError, match="max steps"):
        pt.pretrain(env, max_steps=0)
    with pytest.raises(LabError, match="device"):
        pt.pretrain(env, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(LabError, match="no CUDA device"):
            pt.pretrain(env, device="cuda")
    with pytest.raises(LabError, match="raise --max-steps"):
        pt.pretrain(env, "test", 0.9, max_steps=3)
    assert _files(cache) == []


@pytest.mark.slow
def test_command_line(cache, capsys):
    parser = argparse.ArgumentParser()
    pt.add_parser(parser.add_subparsers(dest="command"))
    defaults = parser.parse_args(["pretrain", "--task", "sort3"])
    assert defaults.size == "small" and defaults.seed == 0 and defaults.device == "cpu"
    assert defaults.target_accuracy == 0.5
    args = parser.parse_args(["pretrain", "--task", "sort3", "--size", "test", "--target-accuracy", "0.2",
                              "--max-steps", "1000"])
    assert args.func(args) == 0
    first = capsys.readouterr().out
    assert str(cache) in first and "accuracy 0." in first and "trained in" in first
    assert args.func(args) == 0
    assert "reused from the cache" in capsys.readouterr().out
    with pytest.raises(LabError, match="unknown env"):
        args.func(parser.parse_args(["pretrain", "--task", "nope"]))


@pytest.mark.slow
def test_the_checkpoint_does_not_depend_on_the_callers_thread_count(cache, env, tmp_path, monkeypatch):
    """Training runs on one thread whatever the caller set: two threads give the bit-identical checkpoint."""
    one = pt.pretrain(env, "test", 0.2, max_steps=2000, seed=3)
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path / "other"))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = pt.pretrain(env, "test", 0.2, max_steps=2000, seed=3)
    finally:
        torch.set_num_threads(before)
    assert two.trained and torch.equal(one.theta, two.theta) and one.steps == two.steps


@pytest.mark.slow
def test_a_stalled_run_restarts_from_fresh_draws_and_records_its_try(cache, env, monkeypatch):
    """A first try that cannot reach the target (its budget cut to 0 steps) hands over to the next try, drawn from the
    seed's next streams; the checkpoint says which try reached it, and equals a run of that try alone."""
    real = pt._train
    tries = []

    def first_stalls(env_, policy, target, max_steps, seed, attempt, device, progress):
        tries.append(attempt)
        return real(env_, policy, target, 0 if attempt == 0 else max_steps, seed, attempt, device, progress)

    monkeypatch.setattr(pt, "_train", first_stalls)
    ck = pt.pretrain(env, "test", 0.2, max_steps=2000, seed=0)
    assert tries == [0, 1] and ck.trained and ck.accuracy >= 0.2
    record = torch.load(ck.path, weights_only=True)
    assert record["try"] == 2
    alone = real(env, TransformerPolicy.for_env(env, "test"), 0.2, 2000, 0, 1, torch.device("cpu"), False)
    assert torch.equal(alone[0].float(), ck.theta) and alone[1] == ck.steps
