"""The length study end to end at smoke size, its Config's checks (one line before any work) and its fits."""
import math

import numpy as np
import pytest

from lab.errors import LabError
from lab.studies.length_scaling import report, study

pytestmark = pytest.mark.usefixtures("one_thread_module")


@pytest.mark.parametrize("kwargs,match", [
    ({"lengths": []}, "at least one response length"), ({"regimes": []}, "at least one regime"),
    ({"lengths": [8, 8]}, "more than once"), ({"lengths": [1]}, "lengths"),
    ({"env": "small_bernoulli"}, "accumulated along the response"), ({"env": "nope"}, "unknown env"),
    ({"env_overrides": {"length": 9}}, "lengths="), ({"estimators": ["kl_k1"]}, "leave it out"),
    ({"estimators": ["opd"]}, "leave it out"), ({"advantage": "grpo"}, "advantage"),
    ({"batch_size": 30}, "multiple of the group size"), ({"kl_token": 0.0}, "kl_token"),
    ({"hyper": {"ppo_clip": {"clip_ratio": 0.3}}, "estimators": ["seq_is"]}, "not in the study"),
    ({"lengths": [100_000], "replicates": 1000, "batch_size": 512}, "GiB"),
    ({"lengths": [20_000], "replicates": 1000, "batch_size": 2, "group_size": 2}, "gradient estimates"),
])
def test_bad_configs_are_one_line_before_any_work(kwargs, match):
    with pytest.raises(LabError, match=match):
        study.Config(**kwargs).validate()


def test_fit_rate_recovers_a_line_and_its_uncertainty():
    x = np.array([8.0, 32, 128, 512])
    assert study.fit_rate(x, 0.3 + 0.01 * x)[:1] == pytest.approx([0.01])
    rng = np.random.default_rng(0)
    covered = 0
    for _ in range(400):
        y = 0.01 * x + rng.normal(0, 0.2, size=4)
        v, lo, hi = study.fit_rate(x, y, se=[0.2] * 4)
        covered += lo <= 0.01 <= hi
    assert 0.92 * 400 <= covered <= 0.98 * 400  # a 95 % interval, known standard errors
    assert all(math.isnan(v) for v in study.fit_rate([8.0], [1.0]))
    assert study.power_exponent([8, 16, 32], [1.0, 4.0, 16.0]) == pytest.approx(2.0)


@pytest.fixture(scope="module")
def smoke():
    return study.run(study.Config(**study.SMOKE), progress=False)


def test_smoke_run_holds_each_regime_at_its_divergence(smoke):
    s = report.summary_of(smoke.summary)
    cfg = study.Config(**study.SMOKE)
    assert [(p.regime, p.length) for p in s.points] == [(r, T) for T in cfg.lengths for r in cfg.regimes]
    for p in s.points:
        if p.regime == "token":
            assert p.kl_token == pytest.approx(cfg.kl_token, rel=1e-8)
        else:
            assert p.kl_seq == pytest.approx(cfg.kl_seq, rel=1e-8)
        assert p.mean_len == pytest.approx(p.length)
        assert set(p.estimators) == set(study.DEFAULT_ESTIMATORS)
        assert p.exact["token_is"]["rel_bias"] > 0 and p.exact["reinforce"]["rel_bias"] > 0
    token = [p for p in s.points if p.regime == "token"]
    assert token[1].log_m2 > 3 * token[0].log_m2  # at a fixed per-token KL the second moment grows with T
    res = smoke.results
    assert {"rel_mse", "rel_bias", "rel_noise", "exact_rel_bias", "exact_first_order", "khat", "ess_frac",
            "log_m2"} <= set(res.metric)
    assert res.groupby(["regime", "length", "estimator", "metric"]).size().max() == 1  # tidy: one row per key


def test_sampled_bias_intervals_cover_the_exact_bias(smoke):
    """The engine's sampled token-IS and REINFORCE biases agree with the DP's exact ones (no engine flag)."""
    d = report.decide(report.summary_of(smoke.summary))
    assert not [f for f in d.flags if f.kind == "engine"], d.flags
    for p in report.summary_of(smoke.summary).points:
        lo, hi = p.intervals["seq_is"]["rel_bias"]
        assert lo == 0.0  # unbiased: its interval reaches zero


def test_same_seed_same_numbers():
    cfg = dict(lengths=[8], regimes=["token"], replicates=10, n_boot=20, trajectory_steps=1,
               estimators=["seq_is", "token_is"])
    a = study.run(study.Config(**cfg), progress=False).results
    b = study.run(study.Config(**cfg), progress=False).results
    c = study.run(study.Config(**cfg, seed=1), progress=False).results
    assert a.equals(b) and not a.equals(c)
