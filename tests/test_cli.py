"""The `lab` command through a real subprocess: run folders, and bad input as one clear line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from lab.engine.batches import Batch
from lab.cli import main
from lab.errors import LabError

LAB = [sys.executable, "-m", "lab.cli"]
ROOT = Path(__file__).resolve().parents[1]


def run(*args, cwd=None):
    env = {**os.environ, "LAB_QUIET": "1"}
    return subprocess.run([*LAB, *args], capture_output=True, text=True, cwd=cwd or ROOT, env=env, timeout=600)


@pytest.mark.slow
def test_variance_writes_a_complete_run_folder(tmp_path):
    out = tmp_path / "run"
    p = run("variance", "--values", "0,4", "--replicates", "30", "--n-boot", "50", "--seed", "5", "--out", str(out))
    assert p.returncode == 0, p.stderr
    config = json.loads((out / "config.json").read_text())
    assert config["seed"] == 5 and config["values"] == [0.0, 4.0] and config["versions"]["torch"].startswith("2.13")
    assert "git_revision" in config
    df = pd.read_parquet(out / "results.parquet")
    assert {"env", "staleness", "estimator", "metric", "value", "lo", "hi", "seed"} <= set(df.columns)
    assert set(df.estimator) == {"-", "reinforce", "seq_is", "token_is", "ppo_clip"}
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["best_by_mse"]) == {"0.0", "4.0"}
    assert sorted(os.listdir(tmp_path)) == ["run"]  # no temporary folders left


@pytest.mark.slow
def test_default_variance_study_runs(tmp_path):
    p = run("variance", "--out", str(tmp_path / "d"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "d" / "summary.json").exists()


@pytest.mark.parametrize("args,needle", [
    (["--env", "nope"], "unknown env 'nope'"),
    (["--estimators", "seq_is,vespo9"], "unknown estimator 'vespo9'"),
    (["--values", "0,-2"], "values must be >= 0"),
    (["--staleness", "kl", "--values", "-0.1"], "values must be >= 0"),
    (["--staleness", "temperature", "--values", "0"], "positive"),
    (["--values", "nan"], "finite"),
    (["--batch-size", "0"], "batch_size must be >= 1"),
    (["--group-size", "1"], "groups of at least 2"),
    (["--env", "large_parity"], "Monte Carlo"),
    (["--set", "length=14"], "enumeration limit"),
    (["--set", "colour=1"], "unknown env field"),
    (["--hyper", "ppo_clip.eps=0.1"], "no hyper-parameter"),
    (["--init-scale", "nan"], "--init-scale must be a finite number"),
    (["--agg", "sum"], "--agg must be one of"),
    (["--replicates", "x"], "--replicates must be a whole number"),
])
def test_bad_input_is_one_clear_line_and_leaves_nothing(tmp_path, capsys, args, needle):
    out = tmp_path / "run"
    assert main(["variance", *args, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], captured.err
    assert captured.out == ""
    assert not out.exists() and os.listdir(tmp_path) == []


@pytest.mark.slow
def test_bad_input_through_the_installed_command(tmp_path):
    p = run("variance", "--env", "nope", "--out", str(tmp_path / "run"))
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_existing_foreign_output_is_refused(tmp_path):
    (tmp_path / "keep.txt").write_text("precious")
    p = run("variance", "--replicates", "5", "--out", str(tmp_path))
    assert p.returncode == 2 and "folder the lab did not write" in p.stderr
    assert (tmp_path / "keep.txt").read_text() == "precious"


def test_nan_log_probs_are_rejected():
    lp = torch.zeros(2, 4, 3)
    lp[1, 2, 0] = float("nan")
    with pytest.raises(LabError, match="NaN"):
        Batch(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4, 3, dtype=torch.long), torch.ones(2, 4, 3), lp,
              torch.zeros(2, 4), 2)


@pytest.mark.slow
def test_listing_commands():
    envs = run("envs")
    assert envs.returncode == 0 and "tiny_target" in envs.stdout and "large_dense" in envs.stdout
    ests = run("estimators")
    assert ests.returncode == 0
    for name in ["reinforce", "seq_is", "token_is", "ppo_clip"]:
        assert name in ests.stdout
    assert "clip_ratio_high=0.2" in ests.stdout


@pytest.mark.slow
def test_train_writes_a_run_folder_and_rejects_bad_input(tmp_path, capsys):
    out = tmp_path / "train"
    assert main(["train", "--steps", "3", "--minibatches", "2", "--estimator", "seq_is", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["minibatches"] == 2 and config["estimator"] == "seq_is"
    table = pd.read_parquet(out / "results.parquet")
    assert len(table) == 3 * 2  # steps x mini-batches updates
    capsys.readouterr()
    bad = tmp_path / "bad"
    assert main(["train", "--minibatches", "5", "--out", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "do not divide the rollout batch" in err[0]
    assert not bad.exists()


@pytest.mark.slow
def test_sweep_command_runs_and_resumes(tmp_path, capsys):
    spec = tmp_path / "tiny.yaml"
    spec.write_text("name: tiny\nbase: {steps: 2, rollout_batch: 16, group_size: 4}\n"
                    "grid: {estimator: [reinforce, seq_is], seed: [0, 1]}\n")
    out = tmp_path / "sweep"
    assert main(["sweep", str(spec), "--workers", "1", "--out", str(out)]) == 0
    assert "4 cells run, 0 already done" in capsys.readouterr().out
    assert main(["sweep", str(spec), "--out", str(out)]) == 0
    assert "0 cells run, 4 already done" in capsys.readouterr().out
    assert main(["sweep", str(spec), "--executor", "dask", "--out", str(out)]) == 2
    assert "unknown executor" in capsys.readouterr().err
