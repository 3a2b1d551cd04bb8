"""Interval estimates: percentile bootstrap over replicates (or seeds); rliable-style IQM, stratified bootstrap,
probability of improvement and Wilson rate intervals.

Libraries where they serve, the lab's own code where speed needs it, each held equal to the library in
tests/test_stats.py:

- Wilson intervals: scipy.stats.binomtest(k, n).proportion_ci(method="wilson"), used directly.
- Percentile bootstrap: ``bootstrap_counts`` + ``mean_interval`` / ``percentile_interval`` are the percentile
  method of scipy.stats.bootstrap, vectorised so that every estimator and metric of a study shares one [n_boot, M]
  resampling matrix (the Gram-matrix bootstrap of the variance engine reuses it); on the same resamples they equal
  scipy.stats.bootstrap(method="percentile").
- IQM and the stratified bootstrap follow rliable (Agarwal et al. 2021): ``iqm`` is scipy.stats.trim_mean(x, 0.25),
  which is rliable.metrics.aggregate_iqm, vectorised over leading axes so one call scores all resamples. rliable
  itself is not a dependency: rliable 1.2 pins arch < 8, arch 7 does not import with pandas 3, and arch 8 drops the
  ``random_state`` argument rliable passes. On one task the stratified bootstrap equals
  scipy.stats.bootstrap(method="percentile") on the same resamples.
"""
from __future__ import annotations

import numpy as np


def bootstrap_counts(n: int, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """[n_boot, n] resampling counts: row b says how often each of the n items is drawn in resample b (shared by every
    statistic of a study, which is why the lab keeps this instead of calling scipy.stats.bootstrap per statistic)."""
    return rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot).astype(np.float64)


def percentile_interval(samples: np.ndarray, ci: float = 0.95) -> tuple[float, float]:
    """The (1-ci)/2 and (1+ci)/2 quantiles (linear interpolation, as scipy.stats.bootstrap's percentile method) of
    the finite bootstrap replicates; NaN when none is finite."""
    samples = np.asarray(samples, dtype=np.float64)
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return float("nan"), float("nan")
    alpha = (1.0 - ci) / 2
    lo, hi = np.quantile(samples, [alpha, 1 - alpha])
    return float(lo), float(hi)


def mean_interval(x: np.ndarray, counts: np.ndarray, ci: float = 0.95) -> tuple[float, float, float]:
    """Mean of x over replicates and its bootstrap interval; non-finite entries are left out."""
    x = np.asarray(x, dtype=np.float64)
    ok = np.isfinite(x)
    if not ok.any():
        return float("nan"), float("nan"), float("nan")
    w = counts * ok
    n = w.sum(1)
    boot = np.where(n > 0, (w @ np.where(ok, x, 0.0)) / np.maximum(n, 1), np.nan)
    return (float(x[ok].mean()), *percentile_interval(boot, ci))


# ---- rliable-style aggregate statistics (Agarwal et al. 2021, "Deep RL at the edge of the statistical precipice") --
# Scores are arrays with runs (seeds) along one axis and tasks (settings) along another; a dict task -> (runs,) is
# stacked into (runs, tasks). Intervals are percentile intervals of a stratified bootstrap: runs are resampled with
# replacement within each task, never across tasks.

def _z(ci: float) -> float:
    from scipy.stats import norm

    if not 0 < ci < 1:
        from lab.errors import LabError

        raise LabError(f"confidence level ci must lie strictly between 0 and 1, got {ci}")
    return float(norm.ppf(1 - (1 - ci) / 2))


def iqm(x, axis=None) -> np.ndarray | float:
    """Interquartile mean: the mean of the middle 50 % of ``x`` along ``axis`` (None: all entries; a tuple: those axes
    together). rliable's convention (scipy.stats.trim_mean(x, 0.25)): floor(n / 4) values are cut from each end of the
    sorted n values, so IQM(1..8) = mean(3, 4, 5, 6) = 4.5 and IQM of 1 to 3 values is their plain mean."""
    from lab.errors import LabError

    a = np.asarray(x, dtype=np.float64)
    if axis is None:
        a, axis = a.reshape(-1), 0
    axes = tuple(ax % a.ndim for ax in (axis if isinstance(axis, tuple) else (axis,)))
    rest = [d for d in range(a.ndim) if d not in axes]
    a = np.transpose(a, rest + list(axes)).reshape([a.shape[d] for d in rest] + [-1])
    n = a.shape[-1]
    if n == 0:
        raise LabError("the interquartile mean of no values is undefined; pass at least one score")
    cut = n // 4
    mid = np.sort(a, axis=-1)[..., cut:n - cut]
    out = mid.mean(-1)
    return float(out) if out.ndim == 0 else out


def _score_matrix(scores) -> np.ndarray:
    """dict task -> (runs,) or an array (runs,) / (runs, tasks) -> float64 (runs, tasks)."""
    from lab.errors import LabError

    if isinstance(scores, dict):
        cols = [np.asarray(v, dtype=np.float64).reshape(-1) for v in scores.values()]
        if not cols:
            raise LabError("no tasks given; pass at least one task's scores")
        if len({c.size for c in cols}) > 1:
            raise LabError(f"every task needs the same number of runs for the stratified bootstrap, got "
                           f"{sorted({c.size for c in cols})}; use the same seeds for every task")
        m = np.stack(cols, axis=1)
    else:
        m = np.asarray(scores, dtype=np.float64)
        m = m[:, None] if m.ndim == 1 else m
    if m.ndim != 2 or m.shape[0] < 1 or m.shape[1] < 1:
        raise LabError(f"scores must be (runs,) or (runs, tasks) with at least one run, got shape {m.shape}")
    return m


def _stratified_resample(m: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """[n_boot, runs, tasks]: runs drawn with replacement independently within each task."""
    runs, tasks = m.shape
    idx = rng.integers(0, runs, size=(n_boot, runs, tasks))
    return np.take_along_axis(np.broadcast_to(m, (n_boot, runs, tasks)), idx, axis=1)


def stratified_bootstrap(scores, statistic=None, n_boot: int = 2000, ci: float = 0.95, rng=None):
    """(point, lo, hi): ``statistic`` of the (runs, tasks) score matrix and its percentile interval over ``n_boot``
    stratified resamples (runs resampled within each task). ``statistic(x)`` must reduce the last two axes
    (runs, tasks) of x and accept leading batch axes (it is called once on all resamples); default: IQM over all
    runs and tasks, rliable's aggregate IQM."""
    from lab.errors import LabError

    m = _score_matrix(scores)
    if not isinstance(n_boot, int) or n_boot < 1:
        raise LabError(f"n_boot must be a positive whole number of resamples, got {n_boot!r}")
    _z(ci)
    statistic = statistic or (lambda x: iqm(x, axis=(-2, -1)))
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    point = float(statistic(m))
    boot = np.asarray(statistic(_stratified_resample(m, n_boot, rng)), dtype=np.float64).reshape(-1)
    lo, hi = percentile_interval(boot, ci)
    return point, lo, hi


def _poi(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """P(X > Y) + 1/2 P(X = Y) over all run pairs within each task, averaged over tasks; x [..., n, T], y [..., m, T].
    """
    gt = (x[..., :, None, :] > y[..., None, :, :]).mean(axis=(-3, -2))
    eq = (x[..., :, None, :] == y[..., None, :, :]).mean(axis=(-3, -2))
    return (gt + 0.5 * eq).mean(-1)


def probability_of_improvement(x, y, n_boot: int = 2000, ci: float = 0.95, rng=None):
    """(point, lo, hi) of P(X > Y) + 1/2 P(X = Y): the Mann-Whitney U statistic / (n m) per task, comparing every run
    of algorithm X with every run of Y on that task, averaged over tasks (rliable). Scores as for
    ``stratified_bootstrap`` (same tasks in the same order for x and y; run counts may differ). The interval
    resamples the runs of x and of y independently within each task."""
    from lab.errors import LabError

    mx, my = _score_matrix(x), _score_matrix(y)
    if mx.shape[1] != my.shape[1]:
        raise LabError(f"x has {mx.shape[1]} tasks and y has {my.shape[1]}; compare the two on the same tasks")
    if not isinstance(n_boot, int) or n_boot < 1:
        raise LabError(f"n_boot must be a positive whole number of resamples, got {n_boot!r}")
    _z(ci)
    rng = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
    point = float(_poi(mx, my))
    boot = np.concatenate([_poi(_stratified_resample(mx, b, rng), _stratified_resample(my, b, rng))
                           for b in np.diff(np.r_[0:n_boot:250, n_boot])])  # chunks of 250: bounded memory
    lo, hi = percentile_interval(boot, ci)
    return point, lo, hi


def rate_interval(k, n, ci: float = 0.95) -> tuple[float, float, float]:
    """(k / n, lo, hi): a rate (e.g. collapses in n runs) with its Wilson score interval,
    (p + z^2/2n -+ z sqrt(p(1-p)/n + z^2/4n^2)) / (1 + z^2/n), z the normal quantile of ci, computed by
    scipy.stats.binomtest(k, n).proportion_ci(method="wilson"). Unlike the Wald interval it stays inside [0, 1] and
    is not degenerate at k = 0 or k = n."""
    from scipy.stats import binomtest

    from lab.errors import LabError

    if not (float(n).is_integer() and n >= 1):
        raise LabError(f"a rate needs a positive whole number of trials n, got {n!r}")
    if not (float(k).is_integer() and 0 <= k <= n):
        raise LabError(f"the count k must be a whole number between 0 and n = {n}, got {k!r}")
    _z(ci)
    interval = binomtest(int(k), int(n)).proportion_ci(confidence_level=ci, method="wilson")
    return float(k / n), max(0.0, float(interval.low)), min(1.0, float(interval.high))
