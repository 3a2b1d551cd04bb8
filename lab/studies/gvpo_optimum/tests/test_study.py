"""The gvpo_optimum study: training reaches pi* from on-policy and fixed samplers, the tidy tables and the typed
summary, and bad input refused before any work."""
import numpy as np
import pytest

from lab.errors import LabError
from lab.studies.gvpo_optimum import study as go
from lab.typed import build


def test_training_reaches_the_optimum_from_both_samplers():
    cfg = go.Config(methods=["gvpo"], samplers=["on_policy", "uniform"], seeds=[0], steps=500, n_boot=100)
    result = go.run(cfg)
    final = result.summary["final_tv"]["gvpo"]
    assert result.summary["tv_at_start"] > 0.5  # pi_ref is far from pi*: the test is not satisfied at the start
    assert final["on_policy"]["mean"] < 0.05 and final["uniform"]["mean"] < 0.05
    tv = result.results[result.results["metric"] == "tv"]
    assert tv["step"].max() == 500 and set(tv["sampler"]) == {"on_policy", "uniform"}


def test_study_tables_and_a_typed_summary():
    cfg = go.Config(methods=["gvpo", "seq_is"], samplers=["tempered", "uniform"], seeds=[0, 1], steps=5,
                    groups_per_step=4)
    result = go.run(cfg)
    summary, res = build(go.Summary, result.summary), result.results
    assert summary.steps == 5 and summary.seeds == [0, 1] and summary.tv_at_start > 0
    for m in cfg.methods:
        for s in cfg.samplers:
            e = summary.final_tv[m][s]
            assert e.lo <= e.mean <= e.hi and len(e.per_seed) == 2 and e.mean == pytest.approx(np.mean(e.per_seed))
    curves = res[res["metric"] == "tv"]
    assert len(curves) == 2 * 2 * 2 * 6  # methods x samplers x seeds x (steps + 1)
    last = curves[curves["step"] == 5].groupby(["method", "sampler"])["value"].mean()
    assert last["seq_is", "uniform"] == pytest.approx(summary.final_tv["seq_is"]["uniform"].mean)
    probs = res[res["metric"] == "prob"]
    for (m, s), p in probs.groupby(["method", "sampler"]):  # every stored distribution sums to 1 per prompt
        assert p.groupby("prompt")["value"].sum().to_numpy() == pytest.approx([1.0, 1.0])
    assert {"pi*", "pi_ref"} <= set(probs["method"])


@pytest.mark.parametrize("bad,match", [
    ({"samplers": ["replay"]}, r"samplers\[0\] must be one of on_policy, reference, tempered, uniform"),
    ({"samplers": []}, "at least one sampler"), ({"group_size": 1}, "group_size must be >= 2"),
    ({"groups_per_step": 0}, "groups_per_step must be >= 1"),
    ({"env": "small_bernoulli", "env_overrides": {}}, "deterministic rewards"),
    ({"methods": ["kl_k3"]}, "extra inputs|unknown estimator"), ({"methods": ["gvpo", "gvpo"]}, "must not repeat"),
    ({"beta": 0.0}, "beta must be > 0"), ({"schedule": "linear"}, "schedule must be one of constant, cosine"),
    ({"seeds": []}, "at least one seed"), ({"ci": 1.0}, "ci must be > 0 and < 1"),
])
def test_bad_input_is_one_clear_error_before_any_work(bad, match):
    with pytest.raises(LabError, match=match):
        go.Config(**bad).validate()
