"""lab.stats: IQM, stratified bootstrap, probability of improvement, Wilson rate interval (hand-computed values,
statistical coverage with fixed seeds, edge cases)."""
import math

import numpy as np
import pytest
from scipy import stats as sps

from lab.errors import LabError
from lab.stats import iqm, probability_of_improvement, rate_interval, stratified_bootstrap

Z95 = 1.959963984540054


# ---- IQM ---------------------------------------------------------------------------------------------------------
def test_iqm_hand_values():
    # 1..8: floor(8/4) = 2 cut from each end -> mean(3, 4, 5, 6) = 18 / 4 = 4.5
    assert iqm(np.arange(1, 9)) == pytest.approx(4.5)
    # n = 5: floor(5/4) = 1 cut from each end of sorted [1, 2, 3, 4, 100] -> mean(2, 3, 4) = 3
    assert iqm([100, 3, 1, 4, 2]) == pytest.approx(3.0)
    # n = 3: floor(3/4) = 0: the plain mean (1 + 2 + 9) / 3 = 4; n = 1: the value itself
    assert iqm([1, 2, 9]) == pytest.approx(4.0)
    assert iqm([7.0]) == pytest.approx(7.0)
    # all equal -> that value
    assert iqm(np.full(10, 0.25)) == pytest.approx(0.25)


def test_iqm_axes_and_scipy_convention():
    x = np.random.default_rng(0).normal(size=(4, 11, 3))
    # rliable's aggregate IQM is scipy.stats.trim_mean(., 0.25) over the flattened scores
    assert iqm(x) == pytest.approx(sps.trim_mean(x.reshape(-1), 0.25))
    np.testing.assert_allclose(iqm(x, axis=1), sps.trim_mean(x, 0.25, axis=1))
    # a tuple of axes = those axes flattened together
    np.testing.assert_allclose(iqm(x, axis=(-2, -1)), [sps.trim_mean(x[i].reshape(-1), 0.25) for i in range(4)])
    # rows [1, 2, 3, 4] and [5, 6, 7, 8]: cut 1 each end -> 2.5 and 6.5
    np.testing.assert_allclose(iqm([[1, 2, 3, 4], [5, 6, 7, 8]], axis=1), [2.5, 6.5])


def test_iqm_empty_raises():
    with pytest.raises(LabError, match="at least one"):
        iqm([])


# ---- stratified bootstrap ----------------------------------------------------------------------------------------
def test_bootstrap_all_equal_and_single_run():
    assert stratified_bootstrap(np.full((5, 3), 0.7), rng=0) == pytest.approx((0.7, 0.7, 0.7))
    # one run per task: every resample is the data itself
    assert stratified_bootstrap({"a": [0.2], "b": [0.4]}, lambda x: x.mean(axis=(-2, -1)), rng=0) == \
        pytest.approx((0.3, 0.3, 0.3))


def test_bootstrap_resamples_within_tasks():
    # task a always scores 0, task b always 1 (4 runs each). Resampling runs within each task keeps 4 zeros and 4
    # ones in every resample, so the mean is exactly 1/2 every time: a zero-width interval. Resampling across tasks
    # would not.
    point, lo, hi = stratified_bootstrap({"a": np.zeros(4), "b": np.ones(4)}, lambda x: x.mean(axis=(-2, -1)),
                                         n_boot=500, rng=1)
    assert (point, lo, hi) == (0.5, 0.5, 0.5)


def test_bootstrap_default_statistic_is_iqm():
    x = np.random.default_rng(3).normal(size=(12, 2))
    point, lo, hi = stratified_bootstrap(x, rng=0)
    assert point == pytest.approx(sps.trim_mean(x.reshape(-1), 0.25))
    assert lo < point < hi


def test_bootstrap_coverage():
    # 300 data sets of 20 runs x 3 tasks from N(task mean, 1); the 95% interval of the grand mean should contain the
    # true grand mean about 95% of the time (percentile bootstrap slightly under-covers at n = 60: expect ~93-95%).
    rng = np.random.default_rng(2024)
    mu = np.array([0.0, 1.0, -2.0])
    hits = 0
    for _ in range(300):
        x = mu + rng.normal(size=(20, 3))
        _, lo, hi = stratified_bootstrap(x, lambda a: a.mean(axis=(-2, -1)), n_boot=400, rng=rng)
        hits += lo <= mu.mean() <= hi
    assert 0.89 <= hits / 300 <= 0.985, hits / 300


def test_bootstrap_bad_input():
    with pytest.raises(LabError, match="same number of runs"):
        stratified_bootstrap({"a": [1, 2], "b": [1, 2, 3]})
    with pytest.raises(LabError, match="n_boot"):
        stratified_bootstrap([1.0, 2.0], n_boot=0)
    with pytest.raises(LabError, match="ci"):
        stratified_bootstrap([1.0, 2.0], ci=1.0)


# ---- probability of improvement -----------------------------------------------------------------------------------
def test_poi_hand_value():
    # x = [1, 2, 3], y = [2, 2, 0]: 9 pairs. x=1 beats y=0 (1 win); x=2 beats 0 and ties 2, 2 (1 win, 2 ties);
    # x=3 beats all three (3 wins). P = (5 + 2/2) / 9 = 6/9.
    point, lo, hi = probability_of_improvement([1, 2, 3], [2, 2, 0], rng=0)
    assert point == pytest.approx(6 / 9)
    assert lo <= point <= hi
    # the reverse comparison: 1 - 6/9 (wins and losses swap, ties stay)
    assert probability_of_improvement([2, 2, 0], [1, 2, 3], rng=0)[0] == pytest.approx(3 / 9)


def test_poi_matches_mann_whitney_and_averages_tasks():
    rng = np.random.default_rng(5)
    x, y = rng.integers(0, 4, size=7).astype(float), rng.integers(0, 4, size=5).astype(float)  # many ties
    u = sps.mannwhitneyu(x, y, alternative="two-sided").statistic  # U counts ties as 1/2
    assert probability_of_improvement(x, y, n_boot=10, rng=0)[0] == pytest.approx(u / (7 * 5))
    # task a: x always better (P = 1); task b: x always worse (P = 0) -> average 1/2
    assert probability_of_improvement({"a": [2, 3], "b": [0, 0]}, {"a": [0, 1], "b": [1, 1]}, rng=0)[0] == 0.5


def test_poi_edge_cases():
    assert probability_of_improvement(np.ones(4), np.ones(4), rng=0) == (0.5, 0.5, 0.5)  # all ties
    assert probability_of_improvement([5.0], [1.0], rng=0) == (1.0, 1.0, 1.0)  # n = 1 each
    with pytest.raises(LabError, match="same tasks"):
        probability_of_improvement(np.zeros((3, 2)), np.zeros((3, 3)))


def test_poi_interval_coverage():
    # X ~ N(0.5, 1), Y ~ N(0, 1): P(X > Y) = Phi(0.5 / sqrt 2) = 0.6382. 150 data sets of 25 runs each.
    truth = sps.norm.cdf(0.5 / math.sqrt(2))
    rng = np.random.default_rng(11)
    hits = 0
    for _ in range(150):
        _, lo, hi = probability_of_improvement(rng.normal(0.5, 1, 25), rng.normal(0, 1, 25), n_boot=300, rng=rng)
        hits += lo <= truth <= hi
    assert 0.87 <= hits / 150 <= 0.99, hits / 150


# ---- Wilson rate interval ----------------------------------------------------------------------------------------
def test_rate_interval_hand_values():
    # k = 0, n = 10: p = 0, the upper end is z^2/n / (1 + z^2/n) = z^2 / (n + z^2) = 3.8415 / 13.8415 = 0.27753
    p, lo, hi = rate_interval(0, 10)
    assert (p, lo) == (0.0, 0.0) and hi == pytest.approx(Z95 ** 2 / (10 + Z95 ** 2))
    assert hi == pytest.approx(0.27753, abs=1e-5)
    # k = 3, n = 10: centre (0.3 + 3.8415/20) / 1.38415 = 0.35550; half 1.96 sqrt(0.021 + 0.0096037) / 1.38415
    # = 0.24771 -> [0.10779, 0.60322]
    p, lo, hi = rate_interval(3, 10)
    assert p == 0.3 and lo == pytest.approx(0.10779, abs=1e-5) and hi == pytest.approx(0.60322, abs=1e-5)
    # k = n mirrors k = 0; n = 1
    assert rate_interval(10, 10) == pytest.approx((1.0, 1 - Z95 ** 2 / (10 + Z95 ** 2), 1.0))
    assert rate_interval(1, 1)[1] == pytest.approx(1 / (1 + Z95 ** 2))


def test_rate_interval_exact_coverage():
    # exact coverage by summing the binomial pmf over the k whose interval contains p (no simulation needed)
    for n, p in [(30, 0.3), (50, 0.1), (20, 0.5)]:
        inside = [k for k in range(n + 1) if rate_interval(k, n)[1] <= p <= rate_interval(k, n)[2]]
        cover = sps.binom.pmf(inside, n, p).sum()
        assert 0.92 <= cover <= 0.98, (n, p, cover)


def test_rate_interval_bad_input():
    with pytest.raises(LabError, match="positive whole number of trials"):
        rate_interval(0, 0)
    with pytest.raises(LabError, match="between 0 and n"):
        rate_interval(4, 3)
    with pytest.raises(LabError, match="ci"):
        rate_interval(1, 3, ci=0)


# ---- the kept libraries: the lab's vectorised code equals them on the same inputs ---------------------------------
@pytest.mark.parametrize("k,n,ci", [(0, 10, 0.95), (3, 10, 0.95), (10, 10, 0.95), (1, 1, 0.95), (7, 40, 0.9),
                                    (12, 13, 0.99)])
def test_rate_interval_is_scipys_wilson_interval(k, n, ci):
    wilson = sps.binomtest(k, n).proportion_ci(confidence_level=ci, method="wilson")
    p, lo, hi = rate_interval(k, n, ci)
    assert p == k / n and lo == pytest.approx(wilson.low, abs=1e-15) and hi == pytest.approx(wilson.high, abs=1e-15)


def _counts(idx: np.ndarray, n: int) -> np.ndarray:
    return np.stack([np.bincount(row, minlength=n) for row in idx]).astype(np.float64)


@pytest.mark.parametrize("ci", [0.95, 0.8])
def test_mean_interval_equals_scipy_percentile_bootstrap_on_the_same_resamples(ci):
    from lab.stats import mean_interval

    x = np.random.default_rng(4).standard_t(3, size=37)
    n_boot = 1500
    # scipy draws its resamples as rng.integers(0, n, (n_resamples, n)); the same draw as counts for the lab
    counts = _counts(np.random.default_rng(9).integers(0, x.size, (n_boot, x.size)), x.size)
    mean, lo, hi = mean_interval(x, counts, ci)
    res = sps.bootstrap((x,), np.mean, n_resamples=n_boot, method="percentile", confidence_level=ci,
                        vectorized=True, rng=np.random.default_rng(9))
    assert mean == pytest.approx(x.mean(), rel=1e-15)
    assert (lo, hi) == pytest.approx((res.confidence_interval.low, res.confidence_interval.high), rel=1e-12)


def test_stratified_bootstrap_on_one_task_equals_scipy_percentile_bootstrap_of_the_iqm():
    x = np.random.default_rng(6).normal(size=23)
    point, lo, hi = stratified_bootstrap(x, n_boot=800, rng=np.random.default_rng(2))
    res = sps.bootstrap((x,), lambda s, axis: sps.trim_mean(s, 0.25, axis=axis), n_resamples=800,
                        method="percentile", vectorized=True, rng=np.random.default_rng(2))
    assert point == pytest.approx(sps.trim_mean(x, 0.25), rel=1e-15)
    assert (lo, hi) == pytest.approx((res.confidence_interval.low, res.confidence_interval.high), rel=1e-12)


def test_psis_khat_equals_arviz_stats():
    from arviz_stats.base import array_stats

    from lab.diagnostics import psis_khat

    rng = np.random.default_rng(0)
    for n in (25, 64, 226, 1000):  # both tail rules: n / 5 below 225 draws, 3 sqrt(n) above
        log_w = rng.standard_t(2, size=(3, n)) * rng.uniform(0.5, 3.0, size=(3, 1))
        ours = psis_khat(log_w)
        theirs = np.array([array_stats.psislw(-row)[1] for row in log_w])  # psislw takes -log w (log-likelihoods)
        np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-14)
    assert np.isnan(psis_khat(rng.normal(size=(2, 24)))).all()  # fewer than 5 tail draws: NaN (arviz-stats raises)
