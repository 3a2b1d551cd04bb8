"""The aggregation over seeds (lab.studies.staleness_training.aggregate) on a hand-made runs table."""
import pandas as pd
import pytest

from lab.errors import LabError
from lab.stats import rate_interval
from lab.studies.staleness_training.aggregate import summarise


def test_summarise_hand_values():
    # 2 estimators x N in {1, 4} x 4 seeds; lab.engine.sweep.load_results' column names
    finals = {("a", 1): [0.1, 0.2, 0.3, 0.9], ("a", 4): [1.0, 1.0, 1.0, 1.0],
              ("b", 1): [0.1, 0.2, 0.3, 0.9], ("b", 4): [0.0, 0.0, 0.5, 0.0]}
    rows = [{"estimator": e, "minibatches": n, "seed": s, "final_reward": f, "collapsed": e == "b" and n == 4 and s < 3}
            for (e, n), fs in finals.items() for s, f in enumerate(fs)]
    t = summarise(pd.DataFrame(rows), "minibatches", baseline="b", n_boot=200)
    get = lambda e, x, m: t[(t.estimator == e) & (t.x == x) & (t.metric == m)].iloc[0]  # noqa: E731
    # IQM of [0.1, 0.2, 0.3, 0.9]: cut floor(4/4) = 1 each end -> (0.2 + 0.3) / 2 = 0.25
    assert get("a", 1, "final_reward_iqm").value == pytest.approx(0.25)
    # b at N = 4: 3 collapses in 4 seeds -> 0.75 with a Wilson interval
    assert tuple(get("b", 4, "collapse_rate")[["value", "lo", "hi"]]) == pytest.approx(rate_interval(3, 4))
    # a vs b at N = 1: identical scores -> 1/2; at N = 4: a's 1.0 beats every b -> 1; averaged over N: 0.75
    assert get("a", 1, "poi_vs_baseline").value == pytest.approx(0.5)
    assert get("a", 4, "poi_vs_baseline").value == 1.0
    assert t[(t.estimator == "a") & (t.metric == "poi_vs_baseline_all")].value.iloc[0] == pytest.approx(0.75)
    with pytest.raises(LabError, match="baseline"):
        summarise(pd.DataFrame(rows), "minibatches", baseline="c")
