"""What the staleness_training report decides and draws: decisions computed from the study's Summary alone (which
estimator ends highest and whether the seeds separate it, where estimators differ most, how the toy orders VESPO's
methods against the paper's table, Shen et al., arXiv 2602.10693), the sentences in templates/, and figures from the
tidy results table (and the training curves from the summary)."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from lab.errors import LabError
from lab.reports.style import color
from lab.reports.templates import render
from lab.studies.staleness_training.aggregate import setting_key
from lab.studies.staleness_training.paper import PAPER_NAMES, RANK_TIE
from lab.studies.staleness_training.study import Cell, Summary
from lab.typed import build

HERE = Path(__file__).parent
AXIS_LABELS = {"sync": "mini-batches per rollout N (max staleness N - 1)",
               "async": "staleness bound η (largest lag admitted as is)",
               "mismatch": "sampler log-prob noise σ (train/inference mismatch)"}
KNOBS = {"sync": "N", "async": "staleness bound η", "mismatch": "sampler log-prob noise σ"}
COINCIDE = 0.02  # IQMs within this at every setting: the estimators coincide


def summary_of(data: dict | Summary) -> Summary:
    return data if isinstance(data, Summary) else build(Summary, data)


def _cell(s: Summary, study: str, e: str, x) -> Cell:
    return s.table[study][e][setting_key(x)]


def _iqm(s: Summary, study: str, e: str, x) -> list:
    return _cell(s, study, e, x).final_reward_iqm


def _apart(a: list, b: list) -> bool:
    """Two [value, lo, hi] whose intervals do not overlap."""
    return a[1] > b[2] or b[1] > a[2]


# ---- decisions ------------------------------------------------------------------------------------------------------

def spread_at(s: Summary, study: str, x) -> float:
    """The gap between the highest and the lowest IQM at one setting value."""
    v = [_iqm(s, study, e, x)[0] for e in s.table[study]]
    return max(v) - min(v)


@dataclass
class Focus:
    """The sync setting where the estimators differ most: the largest gap between the highest and the lowest IQM
    (the staler N on a tie)."""

    n: float
    best: str
    worst: str
    spread: float
    apart: bool  # the best's and the worst's intervals do not overlap


def focus(s: Summary) -> Focus | None:
    if "sync" not in s.table:
        return None
    xs = s.settings["sync"].values
    n = max(reversed(xs), key=lambda x: spread_at(s, "sync", x))
    at = {e: _iqm(s, "sync", e, n) for e in s.table["sync"]}
    best, worst = max(at, key=lambda e: at[e][0]), min(at, key=lambda e: at[e][0])
    return Focus(n, best, worst, at[best][0] - at[worst][0], _apart(at[best], at[worst]))


@dataclass
class Sync:
    """The sync study at its smallest and largest N."""

    n1: float
    nh: float
    rows: list  # {name, low, high, collapse}: IQM at n1 and nh, collapse rate at nh ([value, lo, hi])
    low_range: tuple  # (min, max) IQM at n1 over estimators
    high_range: tuple  # ... at nh
    collapses: bool  # any run met the collapse rule
    runs: int
    collapse_upper: float  # the largest Wilson upper bound of a cell's collapse rate
    worst_collapse: tuple | None  # (estimator, setting, rate) with the highest collapse rate
    best: str  # highest IQM at nh
    tied: list  # others whose interval reaches the best's
    poi: dict  # estimator -> P(improvement over the baseline) over all N
    poi_above: list  # interval above 0.5
    poi_below: list  # interval below 0.5


def sync(s: Summary) -> Sync | None:
    if "sync" not in s.table:
        return None
    xs, ests = s.settings["sync"].values, list(s.table["sync"])
    n1, nh = xs[0], xs[-1]
    rows = [{"name": e, "low": _iqm(s, "sync", e, n1), "high": _iqm(s, "sync", e, nh),
             "collapse": _cell(s, "sync", e, nh).collapse_rate} for e in ests]
    low, high = [r["low"][0] for r in rows], [r["high"][0] for r in rows]
    rates = [(e, float(x), c.collapse_rate) for e, cells in s.table["sync"].items() for x, c in cells.items()]
    collapses = any(r[2][0] != 0 for r in rates)
    worst = max(rates, key=lambda r: r[2][0])
    best = max(ests, key=lambda e: _iqm(s, "sync", e, nh)[0])
    top = _iqm(s, "sync", best, nh)
    tied = [e for e in ests if e != best and _iqm(s, "sync", e, nh)[2] >= top[1]]
    poi = s.poi_all.get("sync", {})
    return Sync(n1, nh, rows, (min(low), max(low)), (min(high), max(high)), collapses, s.runs["sync"],
                max(r[2][2] for r in rates), (worst[0], worst[1], worst[2][0]) if collapses else None, best, tied,
                poi, [e for e, v in poi.items() if v[1] > 0.5], [e for e, v in poi.items() if v[2] < 0.5])


@dataclass
class Paper:
    """The toy's sync study against VESPO's table at the largest N both swept."""

    n_low: float
    n_high: float
    paper_order: str  # "VESPO > GRPO = ..." (ties within RANK_TIE)
    toy_order: str
    changes: list  # {name, paper, toy}: change from n_low to n_high (paper in points, toy in J)
    vespo: dict | None = None  # rank, of, agrees, beats, below, unresolved
    why: dict | None = None  # the measured reasons the toy and the paper can disagree


def _order(ests: dict, key: str) -> str:
    order = sorted(ests, key=lambda e: -getattr(ests[e], key))
    text = PAPER_NAMES[order[0]]
    for a, b in zip(order, order[1:]):
        text += (" = " if abs(getattr(ests[a], key) - getattr(ests[b], key)) < RANK_TIE else " > ") + PAPER_NAMES[b]
    return text


def paper(s: Summary) -> Paper | None:
    pc = s.paper_comparison
    if pc is None:
        return None
    ests = pc.estimators
    out = Paper(pc.n_low, pc.n_high, _order(ests, "paper_high"), _order(ests, "toy_high"),
                [{"name": PAPER_NAMES[e], "paper": 100 * (p.paper_high - p.paper_low), "toy": p.toy_high - p.toy_low}
                 for e, p in ests.items()])
    if "vespo" not in ests:
        return out
    v, others = ests["vespo"], [e for e in ests if e != "vespo"]
    beats = [e for e in others if v.toy_high_interval[0] > ests[e].toy_high_interval[1]]
    below = [e for e in others if v.toy_high_interval[1] < ests[e].toy_high_interval[0]]
    agrees = len(beats) == len(others)
    out.vespo = {"rank": v.toy_rank, "of": len(ests), "agrees": agrees, "beats": beats, "below": below,
                 "unresolved": [e for e in others if e not in beats and e not in below]}
    o = (s.outcomes or {}).get(setting_key(pc.n_high))
    if not agrees and o is not None:
        iqms = [p.toy_high for p in ests.values()]
        spread = max(iqms) - min(iqms)
        out.why = {"outcome": o, "decided_early": o.whole_share >= 0.5, "spread": spread,
                   "seeds_more": o.seed_range > spread, "zero_reward": not math.isnan(o.zero_reward_share)}
    return out


@dataclass
class Regime:
    """The async or mismatch study from its first to its last setting."""

    study: str
    knob: str
    first: float
    last: float
    rows: list  # {name, first (IQM value), last ([value, lo, hi])}
    spread: float  # the largest IQM gap between estimators at one setting
    coincide: bool  # async: the IQMs within COINCIDE at every setting
    aware: list = field(default_factory=list)  # mismatch: the estimators that read the sampler's log-probs


def regime(s: Summary, study: str) -> Regime | None:
    if study not in s.table:
        return None
    xs = s.settings[study].values
    spread = max(spread_at(s, study, x) for x in xs)
    rows = [{"name": e, "first": _iqm(s, study, e, xs[0])[0], "last": _iqm(s, study, e, xs[-1])}
            for e in s.table[study]]
    aware = [e for e in s.mismatch_aware if e in s.table[study]] if study == "mismatch" else []
    return Regime(study, KNOBS[study], xs[0], xs[-1], rows, spread, study != "mismatch" and spread < COINCIDE, aware)


@dataclass
class Decisions:
    focus: Focus | None
    sync: Sync | None
    paper: Paper | None
    regimes: list  # Regime, for async and mismatch when swept


def decide(summary: dict | Summary) -> Decisions:
    s = summary_of(summary)
    return Decisions(focus(s), sync(s), paper(s),
                     [r for r in (regime(s, "async"), regime(s, "mismatch")) if r is not None])


# ---- text -----------------------------------------------------------------------------------------------------------

def _iv(v: list, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(v[0])} [{fmt.format(v[1])}, {fmt.format(v[2])}]"


def headline(name: str, summary: dict) -> str:
    """One line for the gallery: the best and the worst final reward at the N where the estimators differ most (and
    VESPO's, when it is neither), and whether the seeds separate them."""
    s = summary_of(summary)
    f = focus(s)
    if f is None:
        return "no synchronous staleness study in this run"
    if f.spread == 0:
        return f"every estimator ends at the same final reward at every N ({_iv(_iqm(s, 'sync', f.best, f.n))} at " \
               f"N={f.n:g})"
    at = {e: _iqm(s, "sync", e, f.n) for e in s.table["sync"]}
    line = (f"N={f.n:g} (where estimators differ most): best final reward {f.best} {_iv(at[f.best])}, worst "
            f"{f.worst} {_iv(at[f.worst])} (IQM over seeds; {'intervals apart' if f.apart else 'intervals overlap'})")
    if "vespo" in at and "vespo" not in (f.best, f.worst):
        line += f"; vespo {_iv(at['vespo'])}"
    return line


def answer(summary: dict) -> str:
    """Markdown: what the figures show, with numbers and intervals, and how it compares with VESPO's table."""
    s = summary_of(summary)
    return render(HERE, "answer.md", s=s, d=decide(s), iv=_iv)


# ---- figures (one function per figure, a matplotlib Figure without pyplot) ------------------------------------------

def _get(results: pd.DataFrame, study: str, metric: str, estimator: str) -> pd.DataFrame:
    t = results[(results["study"] == study) & (results["metric"] == metric) & (results["estimator"] == estimator)]
    return t.set_index("x")[["value", "lo", "hi"]].sort_index()


def _estimators(results: pd.DataFrame, study: str) -> list[str]:
    return list(dict.fromkeys(results[results["study"] == study]["estimator"]))


def reward_curves(curves: dict, label: str = "N") -> Figure:
    """One panel per N of the sync study (``curves``: the summary's, setting key -> estimator -> Curve or its dict):
    IQM over seeds of J after each rollout, per estimator, with a light band between the seeds' 25th and 75th
    percentiles."""
    data = {x: {e: c if isinstance(c, dict) else asdict(c) for e, c in per.items()} for x, per in curves.items()}
    xs = list(data)
    ncol = min(3, len(xs))
    nrow = math.ceil(len(xs) / ncol)
    fig = Figure(figsize=(4.2 * ncol, 3.0 * nrow), layout="constrained")
    axes = fig.subplots(nrow, ncol, squeeze=False, sharex=True, sharey=True)
    for ax, x in zip(axes.flat, xs):
        for e, c in data[x].items():
            r = np.asarray(c["rollout"]) + 1
            ax.plot(r, c["iqm"], color=color(e), label=e, lw=1.6, alpha=0.9)
            ax.fill_between(r, c["q25"], c["q75"], color=color(e), alpha=0.06, lw=0)
        ax.set_title(f"{label} = {x}", fontsize=10)
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(xs):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("rollouts consumed")
    for ax in axes[:, 0]:
        ax.set_ylabel("expected reward J")
    axes.flat[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("Training curves: IQM over seeds (light band: 25th-75th percentile of seeds)", fontsize=11)
    return fig


def _dodge_plot(ax, results: pd.DataFrame, study: str, metric: str, ests: list[str]) -> None:
    """Per estimator: value with [lo, hi] error bars at evenly spaced setting positions, dodged sideways."""
    xs = sorted(results[results["study"] == study]["x"].dropna().unique())
    pos = {x: i for i, x in enumerate(xs)}
    width = 0.5 / max(len(ests), 1)
    for k, e in enumerate(ests):
        t = _get(results, study, metric, e)
        p = np.array([pos[x] for x in t.index]) + (k - (len(ests) - 1) / 2) * width
        ax.errorbar(p, t["value"], yerr=[t["value"] - t["lo"], t["hi"] - t["value"]], color=color(e), marker="o",
                    ms=4, lw=1.0, elinewidth=1.0, capsize=2, alpha=0.9, label=e)
    ax.set_xticks(range(len(xs)), [setting_key(x) for x in xs])
    ax.grid(alpha=0.3)


def _vs_setting(results, study, metric, ylabel, title, legend_loc, height) -> Figure:
    ests = _estimators(results, study)
    fig = Figure(figsize=(8.5, height), layout="constrained")
    ax = fig.subplots()
    _dodge_plot(ax, results, study, metric, ests)
    ax.set_xlabel(AXIS_LABELS[study])
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.03, 1.03)
    ax.legend(fontsize=8, ncol=min(6, len(ests)), loc=legend_loc)
    ax.set_title(title, fontsize=11)
    return fig


def final_vs_setting(results: pd.DataFrame, study: str = "sync") -> Figure:
    """Final J (IQM over seeds, 95% stratified-bootstrap interval) against the study's setting, per estimator."""
    title = ("Final reward vs staleness (the toy counterpart of VESPO's table)" if study == "sync"
             else f"Final reward: {study}")
    return _vs_setting(results, study, "final_reward_iqm", "final expected reward J (IQM)", title, "lower left", 3.8)


def collapse_vs_setting(results: pd.DataFrame, study: str = "sync") -> Figure:
    """Collapse rate (share of seeds whose run met the training collapse rule) with Wilson 95% intervals."""
    return _vs_setting(results, study, "collapse_rate", "collapse rate",
                       "Collapse rate (Wilson 95% interval over seeds)", "upper left", 3.2)


def regimes(results: pd.DataFrame) -> Figure:
    """Two panels: final J against the async staleness bound η and against the sampler mismatch level."""
    studies = [s for s in ("async", "mismatch") if s in set(results["study"])]
    if not studies:
        raise LabError("no async or mismatch study in this table; sweep etas or noise levels to draw this figure")
    ests = list(dict.fromkeys(results[results["study"].isin(studies)]["estimator"]))
    fig = Figure(figsize=(5.2 * len(studies), 3.8), layout="constrained")
    axes = fig.subplots(1, len(studies), squeeze=False)[0]
    for ax, s in zip(axes, studies):
        _dodge_plot(ax, results, s, "final_reward_iqm", ests)
        ax.set_xlabel(AXIS_LABELS[s], fontsize=9)
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(s, fontsize=10)
    axes[0].set_ylabel("final expected reward J (IQM)")
    axes[0].legend(fontsize=8, loc="lower left")
    return fig


def poi_figure(results: pd.DataFrame, study: str = "sync") -> Figure:
    """Probability of improvement over the baseline per setting value, with bootstrap intervals; 0.5 = a tie."""
    t = results[(results["study"] == study) & (results["metric"] == "poi_vs_baseline")]
    if t.empty:
        raise LabError("no probability of improvement in this table; summarise with a baseline")
    b = t["baseline"].iloc[0]
    ests = [e for e in dict.fromkeys(t["estimator"]) if e != b]
    fig = Figure(figsize=(8.5, 3.2), layout="constrained")
    ax = fig.subplots()
    _dodge_plot(ax, results[results["estimator"] != b], study, "poi_vs_baseline", ests)
    ax.axhline(0.5, color="k", lw=0.8, ls="--")
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel(AXIS_LABELS[study])
    ax.set_ylabel(f"P(final J > {b}'s)")
    ax.legend(fontsize=8, ncol=min(6, len(ests)), loc="lower left")
    ax.set_title(f"Probability of improvement over {b} (stratified bootstrap 95%)", fontsize=11)
    return fig
