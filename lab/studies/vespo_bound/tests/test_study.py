"""The vespo_bound study: the bound check along the three staleness knobs, the exact directions against the variance
engine, the per-lag verdicts, and bad input refused before any work."""
import math

import numpy as np
import pytest

from lab.errors import LabError
from lab.studies.variance import study as variance
from lab.studies.vespo_bound.bound import bound_summary
from lab.studies.vespo_bound import study as vb


def test_bound_study_along_staleness_knobs():
    cfg = vb.Config(lags=[0, 2, 8], kl_targets=[0.05, 1.0], temperatures=[0.5, 2.0], bound_seeds=[0],
                    trajectory_steps=8, kernels=[[2, 3], [3, 2], [1, 1], [0.5, 1]])
    bound = vb.bound_table(cfg)
    assert len(bound) == 7 * 4
    s = bound_summary(bound)
    assert s["violations"] == 0 and s["settings_checked"] == 21 and s["settings_without_bound"] == 7
    assert s["max_bound_ratio"] == pytest.approx(1.0)  # (3, 2) at lag 0
    assert s["per_kernel"]["k=0.5, λ=1"]["max_ratio"] is None
    on = bound[(bound["staleness"] == 0) & (bound["staleness_kind"] == "lag")]
    assert np.allclose(on["Z"], 1.0) and np.allclose(on["C"], 1.0)
    assert np.allclose(bound.loc[bound["staleness_kind"] == "kl"].groupby("staleness")["kl_token"].first(),
                       [0.05, 1.0], rtol=1e-6)
    with pytest.raises(LabError, match="lag 16 exceeds"):
        vb.bound_table(vb.Config(lags=[16], trajectory_steps=8))
    with pytest.raises(LabError, match="lambda"):
        vb.bound_table(vb.Config(kernels=[[2, 0]]))


@pytest.mark.filterwarnings("ignore:Degrees of freedom:RuntimeWarning")  # the engine's NaN cosine intervals
def test_exact_directions_match_the_engine_and_vanish_on_policy():
    d = vb.exact_directions(vb.Config(lags=[0, 8], trajectory_steps=8))
    on = d[d["lag"] == 0]
    assert np.allclose(on["rel_bias"], 0.0, atol=1e-12) and np.allclose(on["cos"], 1.0)
    off = d[(d["lag"] == 8)].set_index("estimator")
    assert off.loc["seq_is", "rel_bias"] < 1e-12 and off.loc["vespo", "rel_bias"] > 1e-3
    results, _ = variance.run(variance.Config(values=[8], estimators=["vespo", "seq_is"], advantage="reward",
                                              replicates=2, n_boot=10, loss_agg_mode="token-mean", trajectory_steps=8),
                              progress=False)
    res = results.set_index(["estimator", "metric"])["value"]
    norm = math.sqrt(res["vespo", "mse"] / res["vespo", "rel_mse"])  # the study's target norm ‖c ∇J‖
    assert res["vespo", "exact_bias_norm"] / norm == pytest.approx(off.loc["vespo", "rel_bias"], rel=1e-6)


def _row(vespo, seq_is):
    """A comparison row with VESPO's and sequence IS's (MSE, lo, hi)."""
    return {f"{e}_rel_mse{suffix}": v for e, t in (("vespo", vespo), ("seq_is", seq_is))
            for suffix, v in zip(("", "_lo", "_hi"), t)}


def test_the_verdict_needs_intervals_that_do_not_overlap():
    assert vb._verdict(_row((0.5, 0.4, 0.6), (3.0, 2.0, 4.0))) == "VESPO lower"
    assert vb._verdict(_row((3.0, 2.0, 4.0), (0.5, 0.4, 0.6))) == "seq IS lower"
    assert vb._verdict(_row((0.5, 0.4, 2.5), (3.0, 2.0, 4.0))) == "unresolved"  # 0.5 is lower, not resolved
    assert vb._verdict(_row((1.0, 0.9, 1.1), (1.0, 0.9, 1.1))) == "equal"  # on-policy: both are REINFORCE


@pytest.mark.filterwarnings("ignore:Degrees of freedom:RuntimeWarning")
def test_a_run_gives_one_tidy_table_and_a_typed_summary():
    from lab.typed import build

    cfg = vb.Config(lags=[0, 2], kl_targets=[0.1], temperatures=[2.0], bound_seeds=[0], trajectory_steps=2,
                    kernels=[[2, 3], [0.5, 1]], replicates=20)
    results, summary = vb.run(cfg, progress=False)
    assert set(results["part"]) == {"bound", "variance", "exact_bias", "exact_direction"}
    s = build(vb.Summary, summary)
    assert s.settings_checked == 4 and s.settings_without_bound == 4 and s.violations == 0  # 4 settings x 2 kernels
    assert list(s.per_lag) == ["0", "2"] and s.max_lag == 2.0
    on, off = s.per_lag["0"], s.per_lag["2"]
    assert on.kl_token == 0 and on.verdict == "equal" and on.vespo_rel_mse == on.seq_is_rel_mse  # both REINFORCE
    assert off.kl_token > 0 and off.seq_is_exact_bias < 1e-12 and off.vespo_exact_bias > 0
    for e in (on, off):
        for triple in (e.vespo_rel_mse, e.seq_is_rel_mse):
            assert triple[1] <= triple[0] <= triple[2]
    assert s.mse_ratio_vespo_over_seq_is_at_max_lag == pytest.approx(off.vespo_rel_mse[0] / off.seq_is_rel_mse[0])


@pytest.mark.parametrize("given,message", [
    ({"lags": [0.5]}, r"lags\[0\] must be a whole number"), ({"kernels": [[2, 3, 1]]}, "a pair"),
    ({"kernels": [[-1, 3]]}, "k must be a finite number >= 0"), ({"temperatures": [0.001]}, ">= 0.01"),
    ({"policy": "transformer"}, "policy must be one of prefix, markov"), ({"advantage": "gae"}, "advantage must be"),
    ({"bound_seeds": []}, "at least one bound seed"), ({"lags": [0, 80]}, "lag 80 exceeds"),
])
def test_bad_input_is_one_clear_error_before_any_work(given, message):
    with pytest.raises(LabError, match=message):
        vb.Config(**given).validate()
