"""A training run's neutral rollout log reproduces the weight diagnostics the run computed itself: both the
mini-batch recomputation (lab_weight_metrics) and the streaming report (diagnose, `lab diagnose --out`)."""
import json

import numpy as np
import pandas as pd
import pytest

from lab.cli import main as lab_main
from lab.diagnose import diagnose, lab_weight_metrics
from lab.diagnose.cli import main as diagnose_main
from lab.engine.training import TrainConfig, train

METRICS = ("ess_frac", "chi2_seq_sampled", "k3_token", "khat", "mismatch_abs_logprob")


@pytest.mark.parametrize("cfg", [
    TrainConfig(steps=3, minibatches=4, estimator="vespo", seed=1),
    TrainConfig(env="small_eos", policy="markov", steps=2, regime="mismatch", logprob_noise=0.3,
                sampler_temperature=1.2, estimator="tis_token", rollout_batch=32, group_size=8),
    TrainConfig(steps=4, regime="async", lag_max=3, eta=2, over_stale="keep", estimator="ppo_clip", minibatches=2),
])
@pytest.mark.slow
def test_diagnostics_from_the_log_equal_the_runs_own(tmp_path, cfg):
    result = train(cfg, progress=False, rollout_log=tmp_path / "log")
    table = result.table.set_index("update")
    logged = lab_weight_metrics(tmp_path / "log").set_index("step")
    assert list(logged.index) == list(table.index)
    for name in METRICS:
        a, b = table[name].to_numpy(), logged[name].to_numpy()
        assert np.array_equal(a, b, equal_nan=True), name


def from_report(per_step: pd.DataFrame) -> pd.DataFrame:
    """The trainer's per-update columns from the report's per-step table: pi against the sampler (pair total) for
    the sequence weights and k3, trainer old against the sampler (pair mismatch) for mean |delta logp|."""
    total = per_step[per_step["pair"] == "total"].set_index("step")
    out = total[["ess_frac", "chi2_seq_sampled", "k3_token", "khat"]].copy()
    out["mismatch_abs_logprob"] = per_step[per_step["pair"] == "mismatch"].set_index("step")["mean_abs"]
    return out


def assert_same(table: pd.DataFrame, report: pd.DataFrame, mismatch: bool) -> None:
    """Per update: the report's numbers equal the trainer's (1e-6 relative), on a run where they are not trivial."""
    assert list(report.index) == list(table.index)
    for name in METRICS:
        np.testing.assert_allclose(report[name].to_numpy(float), table[name].to_numpy(float), rtol=1e-6, atol=1e-12,
                                   err_msg=name)
    # a comparison that could fail: weights that are not all equal, finite k-hats, and steps that differ
    assert table["ess_frac"].min() < 0.95 and table["chi2_seq_sampled"].max() > 0.05
    assert table["k3_token"].max() > 1e-3 and np.isfinite(table["khat"]).sum() >= 2
    assert (table["mismatch_abs_logprob"] > 1e-3).all() if mismatch else (table["mismatch_abs_logprob"] == 0).all()
    shifted = report["ess_frac"].to_numpy()[1:], table["ess_frac"].to_numpy()[:-1]
    assert not np.allclose(*shifted, rtol=1e-6)


@pytest.mark.parametrize("cfg", [
    TrainConfig(env="tiny_parity", steps=3, regime="async", lag_max=2, eta=2, over_stale="keep", minibatches=2,
                estimator="ppo_clip", lr=0.3),
    TrainConfig(env="small_dense", policy="markov", steps=2, regime="mismatch", logprob_noise=0.3,
                sampler_temperature=1.2, estimator="tis_token", minibatches=2),
    TrainConfig(env="chain3", policy="transformer", size="test", rollout_batch=64, group_size=4, steps=2,
                minibatches=2, lr=3e-2, regime="mismatch", sampler_dtype="bfloat16", sampler_temperature=1.3,
                estimator="tis_seq"),
], ids=["tabular-async", "tabular-mismatch", "transformer-mismatch"])
@pytest.mark.slow
def test_the_report_on_a_runs_log_equals_the_runs_own_numbers(tmp_path, cfg):
    result = train(cfg, progress=False, rollout_log=tmp_path / "log")
    report = from_report(diagnose(tmp_path / "log", progress=False).tables["per_step"])
    assert_same(result.table.set_index("update"), report, mismatch=cfg.regime == "mismatch")


@pytest.mark.slow
def test_lab_train_then_lab_diagnose(tmp_path, capsys):
    """The command-line path: `lab train --rollout-log`, then `lab diagnose --out` on its log; an --out that would
    replace the training run (which holds the log) is refused and the run is left as it was."""
    run, diag = tmp_path / "trun", tmp_path / "diag"
    assert lab_main(["train", "--env", "small_dense", "--policy", "markov", "--steps", "2", "--regime", "mismatch",
                     "--logprob-noise", "0.3", "--estimator", "tis_token", "--minibatches", "2", "--rollout-log",
                     "--out", str(run)]) == 0
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    for out in (run, run / "rollout_log", run / "rollout_log" / "diag"):
        assert diagnose_main([str(run / "rollout_log"), "--out", str(out)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "the input" in err and "choose another --out" in err
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before
    assert diagnose_main([str(run / "rollout_log"), "--out", str(diag)]) == 0
    assert json.loads((diag / "config.json").read_text())["log_meta"]["source"] == "lab"
    table = pd.read_parquet(run / "results.parquet").set_index("update")
    assert_same(table, from_report(pd.read_parquet(diag / "per_step.parquet")), mismatch=True)
