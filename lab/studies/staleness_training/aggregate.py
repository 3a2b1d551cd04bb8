"""Training runs aggregated over seeds, rliable's protocol (Agarwal et al. 2021, "Deep RL at the edge of the
statistical precipice"; ``lab.stats``): per estimator x setting, the interquartile mean (IQM) of the final score with
a stratified-bootstrap interval, its median, the collapse rate with a Wilson interval, and the probability of
improvement P(X > Y) + 1/2 P(X = Y) of the estimator's final score over a baseline estimator's, per setting and
averaged over every setting (tasks). Shared by the staleness_training and real_staleness_training studies."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from lab import stats
from lab.errors import LabError


def final_scores(runs: pd.DataFrame, score: str | None = None) -> pd.DataFrame:
    """``runs`` with two normalised columns: ``final`` (the final exact expected reward, or the column ``score``) and
    ``collapse`` (bool).

    Accepts the sweep's names (final_reward, collapsed / first_collapse) and the training summary's
    (final_expected_reward, first_collapse_update)."""
    runs = runs.copy()
    final = score if score is not None and score in runs else \
        next((c for c in ("final_reward", "final_expected_reward") if c in runs and score is None), None)
    if final is None:
        raise LabError(f"the runs table has no final score column ({score or 'final_reward'}); load it with "
                       f"lab.engine.sweep.load_results")
    runs["final"] = runs[final].astype(float)
    if "collapsed" in runs:
        runs["collapse"] = runs["collapsed"].fillna(False).astype(bool)
    else:
        first = next((c for c in ("first_collapse", "first_collapse_update") if c in runs), None)
        if first is None:
            raise LabError("the runs table has no collapse column (collapsed); load it with "
                           "lab.engine.sweep.load_results")
        runs["collapse"] = runs[first].notna()
    return runs


def _cell_rows(f: np.ndarray, collapses: int, x, e: str, n_boot: int, ci: float, rng,
               label: str = "final_reward") -> list[dict]:
    n = f.size
    rows = []
    v, lo, hi = stats.stratified_bootstrap(f, n_boot=n_boot, ci=ci, rng=rng)
    rows.append(dict(x=x, estimator=e, metric=f"{label}_iqm", value=v, lo=lo, hi=hi, n=n))
    v, lo, hi = stats.stratified_bootstrap(f, lambda a: np.median(a, axis=(-2, -1)), n_boot, ci, rng)
    rows.append(dict(x=x, estimator=e, metric=f"{label}_median", value=v, lo=lo, hi=hi, n=n))
    v, lo, hi = stats.rate_interval(collapses, n, ci)
    rows.append(dict(x=x, estimator=e, metric="collapse_rate", value=v, lo=lo, hi=hi, n=n))
    return rows


def _finals(runs: pd.DataFrame, setting: str, e: str, x) -> np.ndarray:
    return runs[(runs["estimator"] == e) & (runs[setting] == x)]["final"].to_numpy()


def _poi_all_row(runs, setting, xs, e, baseline, n_boot, ci, rng) -> list[dict]:
    """P(final > baseline's final) averaged over every setting value (tasks); none with unequal seeds per setting."""
    mx = {x: _finals(runs, setting, e, x) for x in xs}
    my = {x: _finals(runs, setting, baseline, x) for x in xs}
    try:
        v, lo, hi = stats.probability_of_improvement(mx, my, n_boot, ci, rng)
    except LabError:
        return []
    return [dict(x=math.nan, estimator=e, metric="poi_vs_baseline_all", value=v, lo=lo, hi=hi,
                 n=sum(a.size for a in mx.values()), baseline=baseline)]


def summarise(runs: pd.DataFrame, setting: str, baseline: str | None = None, n_boot: int = 2000, ci: float = 0.95,
              seed: int = 0, score: str | None = None, label: str = "final_reward") -> pd.DataFrame:
    """Tidy table, one row per estimator x setting value x metric: columns setting, x, estimator, metric, value, lo,
    hi, n, baseline. Metrics: ``final_reward_iqm`` (IQM over seeds, stratified bootstrap), ``final_reward_median``,
    ``collapse_rate`` (Wilson), ``poi_vs_baseline`` (P(final > baseline's final), bootstrap; its ``baseline`` column
    names the baseline) and, with x = NaN, ``poi_vs_baseline_all``: the same averaged over every setting value
    (tasks), with runs resampled within each setting. ``score``: the runs column scored (default the final exact
    expected reward), named ``label`` in the metrics (``label``_iqm, ``label``_median)."""
    runs = final_scores(runs, score)
    if setting not in runs:
        raise LabError(f"the runs table has no column {setting!r}; it is not a grid key of this sweep")
    rng = np.random.default_rng(seed)
    ests = list(dict.fromkeys(runs["estimator"]))
    if baseline is not None and baseline not in ests:
        raise LabError(f"baseline {baseline!r} is not among the swept estimators ({', '.join(ests)})")
    xs = sorted(runs[setting].unique())
    rows = []
    for e in ests:
        for x in xs:
            cell = runs[(runs["estimator"] == e) & (runs[setting] == x)]
            if cell.empty:
                continue
            f = cell["final"].to_numpy()
            rows += _cell_rows(f, int(cell["collapse"].sum()), x, e, n_boot, ci, rng, label)
            b = _finals(runs, setting, baseline, x) if baseline is not None else np.empty(0)
            if b.size:
                v, lo, hi = stats.probability_of_improvement(f, b, n_boot, ci, rng)
                rows.append(dict(x=x, estimator=e, metric="poi_vs_baseline", value=v, lo=lo, hi=hi, n=f.size,
                                 baseline=baseline))
        if baseline is not None:
            rows += _poi_all_row(runs, setting, xs, e, baseline, n_boot, ci, rng)
    table = pd.DataFrame(rows)
    table.insert(0, "setting", setting)
    if "baseline" not in table:
        table["baseline"] = None
    return table


def setting_key(x) -> str:
    """A setting value as the summary's key: 4 -> "4", 0.5 -> "0.5"."""
    return f"{x:g}" if isinstance(x, (int, float, np.integer, np.floating)) else str(x)


def _get(table, study, metric, estimator) -> pd.DataFrame:
    t = table[(table["study"] == study) & (table["metric"] == metric) & (table["estimator"] == estimator)]
    return t.set_index("x")[["value", "lo", "hi"]].sort_index()


def summary_table(table: pd.DataFrame, label: str = "final_reward") -> dict:
    """{study: {estimator: {setting key: {``label``_iqm, collapse_rate: [value, lo, hi]}}}}."""
    out = {}
    for study in table["study"].unique():
        out[study] = {}
        for e in dict.fromkeys(table[table["study"] == study]["estimator"]):
            iq, cr = _get(table, study, f"{label}_iqm", e), _get(table, study, "collapse_rate", e)
            out[study][e] = {setting_key(x): {f"{label}_iqm": [float(v) for v in iq.loc[x]],
                                              "collapse_rate": [float(v) for v in cr.loc[x]]} for x in iq.index}
    return out


def poi_all(table: pd.DataFrame) -> dict:
    """{study: {estimator: [P(improvement over the baseline) over every setting, lo, hi]}} (baseline left out)."""
    t = table[(table["metric"] == "poi_vs_baseline_all") & (table["estimator"] != table["baseline"])]
    return {study: {r.estimator: [float(r.value), float(r.lo), float(r.hi)] for r in part.itertuples()}
            for study, part in t.groupby("study", sort=False)}


def per_rollout(steps: pd.DataFrame, setting: str) -> pd.DataFrame:
    """Exact expected reward after each rollout's last update: columns estimator, setting, seed, rollout, J."""
    keys = ["estimator", setting, "seed", "rollout"]
    last = steps.sort_values("update").groupby(keys, as_index=False).last()
    return last[keys + ["expected_reward"]]


def curves(steps: pd.DataFrame, setting: str) -> dict:
    """{setting key: {estimator: {rollout, iqm, q25, q75}}}: J after each rollout, IQM and quartiles over seeds."""
    d = per_rollout(steps, setting)
    out = {}
    for x in sorted(d[setting].unique()):
        out[setting_key(x)] = {}
        for e in dict.fromkeys(steps["estimator"]):
            g = d[(d[setting] == x) & (d["estimator"] == e)].groupby("rollout")["expected_reward"]
            q = g.quantile([0.25, 0.75]).unstack()
            out[setting_key(x)][e] = {"rollout": [int(r) for r in q.index],
                                      "iqm": [float(v) for v in g.agg(lambda v: stats.iqm(v.to_numpy()))],
                                      "q25": [float(v) for v in q[0.25]], "q75": [float(v) for v in q[0.75]]}
    return out
