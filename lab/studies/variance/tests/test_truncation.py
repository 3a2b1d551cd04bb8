"""The sampler-truncation knobs of the variance study: no-op settings are bit-identical to no truncation, bad
values are one line and exit 2, and a truncating sampler runs end to end (exact references with zero-probability
responses)."""
import math
import subprocess
import sys

import pytest

from lab.errors import LabError
from lab.studies.variance.study import Config, run

SMALL = dict(env="small_dense", policy="markov", replicates=40, n_boot=200, trajectory_steps=8,
             estimators=["reinforce", "seq_is", "token_is", "ppo_clip", "tis_token"])
NUMBERS = ["estimator", "metric", "value", "lo", "hi"]


@pytest.mark.slow
def test_no_op_truncation_is_bit_identical_to_none():
    base = run(Config(**SMALL, staleness="lag", values=[0, 4])).results
    noop = run(Config(**SMALL, staleness="lag", values=[0, 4], top_p=1.0, top_k=6, min_p=0.0,
                      mask_replay=True)).results
    assert base[NUMBERS].equals(noop[NUMBERS])
    for kind, one in [("top_p", 1.0), ("top_k", 6), ("min_p", 0.0)]:
        as_kind = run(Config(**SMALL, staleness=kind, values=[one])).results
        lag0 = base[base.staleness == 0]
        assert lag0[NUMBERS].reset_index(drop=True).equals(as_kind[NUMBERS].reset_index(drop=True)), kind


@pytest.mark.slow
def test_truncating_sampler_runs_on_top_of_another_kind():
    res = run(Config(**SMALL, staleness="temperature", values=[1.0, 1.5], top_p=0.8)).results
    assert res[res.metric.isin(["rel_mse", "bias_norm", "variance", "kl_token", "ess_frac"])].value.notna().all()
    kl = res[(res.metric == "kl_token") & (res.estimator == "-")].set_index("staleness").value
    assert kl[1.0] > 0  # top-p 0.8 alone already moves the sampler off pi
    chi2 = res[(res.metric == "chi2_token") & (res.estimator == "-")].value
    assert (chi2 == math.inf).all()  # pi puts mass where the sampler cannot go


@pytest.mark.parametrize("overrides", [dict(top_p=0.0), dict(top_k=0), dict(top_k=7), dict(min_p=1.0),
                                       dict(staleness="top_p", values=[0.9, 1.2]),
                                       dict(staleness="top_k", values=[2, 9]),
                                       dict(staleness="top_p", values=[0.9], top_p=0.8)])
def test_bad_values_refused_before_work(overrides):
    with pytest.raises(LabError) as err:
        Config(**{**SMALL, **overrides}).validate()
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_cli_exits_2_with_one_line(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "lab.cli", "variance", "--env", "small_dense", "--policy", "markov",
                           "--staleness", "top_p", "--values", "1,0.9,1.5", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "top_p" in proc.stderr and not out.exists()
