"""A training run's neutral rollout log reproduces the weight diagnostics the run computed itself."""
import numpy as np
import pytest

from lab.diagnose import lab_weight_metrics
from lab.engine.training import TrainConfig, train

METRICS = {"ess_frac": "ess_frac", "chi2_seq_sampled": "chi2_seq", "k3_token": "k3_token", "khat": "khat",
           "mismatch_abs_logprob": "mismatch_abs_logprob"}


@pytest.mark.parametrize("cfg", [
    TrainConfig(steps=3, minibatches=4, estimator="vespo", seed=1),
    TrainConfig(env="small_eos", policy="markov", steps=2, regime="mismatch", logprob_noise=0.3,
                sampler_temperature=1.2, estimator="tis_token", rollout_batch=32, group_size=8),
    TrainConfig(steps=4, regime="async", lag_max=3, eta=2, over_stale="keep", estimator="ppo_clip", minibatches=2),
])
def test_diagnostics_from_the_log_equal_the_runs_own(tmp_path, cfg):
    result = train(cfg, progress=False, rollout_log=tmp_path / "log")
    table = result.table.set_index("update")
    logged = lab_weight_metrics(tmp_path / "log").set_index("step")
    assert list(logged.index) == list(table.index)
    for ours, theirs in METRICS.items():
        a, b = table[ours].to_numpy(), logged[theirs].to_numpy()
        assert np.array_equal(a, b, equal_nan=True), ours
