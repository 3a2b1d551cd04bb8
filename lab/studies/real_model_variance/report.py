"""What the real_model_variance report decides, from the study's Summary alone, and its figures (from the tidy
results); the sentences are in templates/. MSE is in units of ‖∇J‖² (1 is what a zero update scores)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from lab.reports.style import color, interval, table
from lab.reports.templates import render
from lab.studies.real_model_variance.study import Coverage, Exactness, Lowest, Summary
from lab.typed import build

HERE = Path(__file__).parent
MODELS = ("transformer", "tabular")
LABELS = {"transformer": "transformer", "tabular": "tabular (same π₀)"}  # column and panel titles
NOUNS = {"transformer": "transformer", "tabular": "table"}


def summary_of(data: dict | Summary) -> Summary:
    return data if isinstance(data, Summary) else build(Summary, data)


def max_lag(summary: Summary) -> str:
    return f"{max(summary.lags):g}"


@dataclass
class Pick:
    """One model's lowest-MSE estimator at one (length, lag), with the divergence and uncorrected REINFORCE there."""

    model: str
    estimator: str
    rel_mse: list  # [value, lo, hi]
    beats_zero_update: bool  # its interval lies below 1
    kl_token: float
    spread: float  # the largest MSE over the smallest among the estimators
    reinforce: float | None  # REINFORCE's MSE (None when not run)


@dataclass
class Focus:
    """The (length, lag) where the corrections differ most, among those where one helps; both models' picks there."""

    length: int
    lag: str
    picks: dict[str, Pick]  # model -> its lowest MSE there
    agree: bool | None  # the two models' lowest-MSE estimator is the same (None: one model only)


@dataclass
class Length:
    """One response length at the largest lag: each model's lowest MSE (the study's findings) and their agreement."""

    length: int
    picks: dict[str, Lowest]  # model -> its lowest MSE at the largest lag
    agree: bool | None


@dataclass
class Decisions:
    exact: Exactness | None  # sequence IS's exact relative bias, over every cell and lag
    coverage: Coverage | None  # its sampled bias2 intervals that cover 0
    max_lag: str
    lengths: list[Length]  # per response length
    focus: Focus
    noise: dict[str, float]  # model -> REINFORCE's on-policy (lag 0) MSE at the focus length, when both ran


def pick(summary: Summary, model: str, T: int, lag: str) -> Pick | None:
    cell = summary.cells.get(f"{model}/T={T}")
    if cell is None:
        return None
    at = cell.per_lag[lag]
    mse = {e: p.rel_mse[0] for e, p in at.estimators.items()}
    best = min(mse, key=mse.get)
    finite = [v for v in mse.values() if math.isfinite(v) and v > 0]
    return Pick(model, best, at.estimators[best].rel_mse, at.estimators[best].rel_mse[2] < 1, at.kl_token,
                max(finite) / min(finite) if finite else 1.0, mse.get("reinforce"))


def most_informative(summary: Summary) -> Focus:
    """The (length, lag) where the corrections differ most (the largest spread of MSE, either model) among those
    where a correction helps (some MSE interval reaches below a zero update's 1, either model); the largest lag of
    the longest response if none helps."""
    settings = []
    for T in summary.lengths:
        for lag in (f"{v:g}" for v in summary.lags):
            picks = {m: p for m in MODELS if (p := pick(summary, m, T, lag)) is not None}
            helps = any(pt.rel_mse[1] < 1 for m in picks for pt in
                        summary.cells[f"{m}/T={T}"].per_lag[lag].estimators.values())
            settings.append((T, lag, picks, helps))
    useful = [s for s in settings if s[3]]
    T, lag, picks, _ = (max(useful, key=lambda s: max(p.spread for p in s[2].values())) if useful else
                        next(s for s in settings if s[0] == max(summary.lengths) and s[1] == max_lag(summary)))
    agree = picks["transformer"].estimator == picks["tabular"].estimator if len(picks) == 2 else None
    return Focus(T, lag, picks, agree)


def decide(summary: Summary) -> Decisions:
    f, lag = summary.findings, max_lag(summary)
    lengths = [Length(T, {m: p for m in MODELS if (p := f.lowest_mse_at_max_lag.get(f"{m}/T={T}"))},
                      f.agree.get(str(T))) for T in summary.lengths]
    focus = most_informative(summary)
    noise = {}
    if 0 in summary.lags:
        noise = {m: r for m in MODELS if (p := pick(summary, m, focus.length, "0")) and (r := p.reinforce) is not None}
    return Decisions(f.seq_is_exactly_unbiased, f.seq_is_sampled_bias_covers_zero, lag, lengths, focus, noise)


def headline(name: str, summary: dict) -> str:
    """One line for the gallery: where the corrections differ most, each model's lowest MSE and whether they agree."""
    s = summary_of(summary)
    fo = decide(s).focus
    said = [f"{p.estimator} {p.rel_mse[0]:.3g}×‖∇J‖² on the {NOUNS[m]} (KL {p.kl_token:.2g}/token)"
            for m, p in fo.picks.items()]
    text = f"T={fo.length}, lag {fo.lag}, where the corrections differ most: lowest MSE " + ", ".join(said)
    if fo.agree is not None:
        text += "; the same on both" if fo.agree else "; different winners: the toy's ranking does not carry over"
    below = [NOUNS[m] for m, p in fo.picks.items() if not p.beats_zero_update]
    if below:
        whose = "neither" if len(below) == len(fo.picks) > 1 else f"the {below[0]}'s"
        text += f"; {whose} clearly below a zero update (1×)"
    return text


def answer(summary: dict) -> str:
    """Markdown: the setup, whether sequence IS stays unbiased, the focus, and the lowest MSE per length and model."""
    s = summary_of(summary)
    params = {c.model: c.parameters for c in s.cells.values()}
    return render(HERE, "answer.md", s=s, d=decide(s), params=params, labels=LABELS)


def mse_table(summary: dict):
    """Estimators as rows; per (length, model) the MSE ÷ ‖∇J‖² at the largest lag [95% interval], lowest starred."""
    s = summary_of(summary)
    lag = max_lag(s)
    rows, marks, cols = {}, {}, []
    for cell in s.cells.values():
        col = f"T={cell.length} {LABELS[cell.model]}"
        cols.append(col)
        ests = cell.per_lag[lag].estimators
        best = min(ests, key=lambda e: ests[e].rel_mse[0])
        for e, v in ests.items():
            rows.setdefault(e, {"estimator": e})[col] = ("★ " if e == best else "") + interval(*v.rel_mse)
    df = pd.DataFrame(list(rows.values()), columns=["estimator", *cols])
    for i, e in enumerate(df["estimator"]):
        marks[i] = [c for c in cols if str(df.loc[i, c]).startswith("★")]
    return table(df, f"MSE ÷ ‖∇J‖² at lag {lag} (★ lowest per column; [95% bootstrap interval]); a zero update scores "
                     f"1.", marks)


def _panel(results: pd.DataFrame, metric: str, ylabel: str, title: str) -> Figure:
    """One panel per (response length, model), one line per estimator, against the achieved KL(mu||pi) per token:
    the same lag is a different divergence for the two parameterisations, so they are compared at equal KL."""
    lengths = sorted(results["length"].unique())
    models = [m for m in MODELS if m in set(results["model"])]
    fig = Figure(figsize=(5.2 * len(models), 3.3 * len(lengths)), layout="constrained")
    axes = np.atleast_2d(fig.subplots(len(lengths), len(models), sharey=True, squeeze=False))
    for i, T in enumerate(lengths):
        for j, model in enumerate(models):
            ax = axes[i, j]
            cell = results[(results["length"] == T) & (results["model"] == model)]
            kl = cell[(cell["estimator"] == "-") & (cell["metric"] == "kl_token")].set_index("staleness")["value"]
            sub = cell[cell["metric"] == metric]
            for e in [e for e in pd.unique(sub["estimator"]) if e != "-"]:
                s = sub[sub["estimator"] == e].sort_values("staleness")
                x = kl.loc[s["staleness"]].to_numpy()
                ax.plot(x, s["value"], "-o", ms=3.5, lw=1.6, color=color(e), label=e)
                if (s["hi"] > s["lo"]).any():
                    ax.fill_between(x, s["lo"], s["hi"], color=color(e), alpha=0.12, lw=0)
            ax.set_xscale("symlog", linthresh=max(float(kl[kl > 0].min()) if (kl > 0).any() else 1e-3, 1e-6))
            ax.set_xlabel("KL(μ‖π) per token (lags " + ", ".join(f"{v:g}" for v in kl.index) + ")")
            ax.grid(True, alpha=0.3)
            ax.set_title(f"{LABELS[model]}, T = {T}", fontsize=10)
            if metric == "rel_mse":
                ax.axhline(1.0, color="black", lw=0.8, ls=":")
                ax.set_yscale("log")
            if j == 0:
                ax.set_ylabel(ylabel)
    axes[0, -1].legend(frameon=False, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title, fontsize=11)
    return fig


def mse_figure(results: pd.DataFrame) -> Figure:
    """MSE ÷ ‖∇J‖² against lag: one panel per (response length, model), one line per estimator."""
    return _panel(results, "rel_mse", "MSE ÷ ‖∇J‖²", "One batch's MSE at equal divergence, transformer against table "
                  "(dotted: a zero update; bands: 95% CI)")


def exact_bias_figure(results: pd.DataFrame) -> Figure:
    """The exact relative bias ‖E g − ∇J‖ ÷ ‖∇J‖ (advantage R, by enumeration) against lag, same layout."""
    return _panel(results, "exact_rel_bias", "‖E g − ∇J‖ ÷ ‖∇J‖",
                  "Exact bias of the expected gradient (advantage = R, every response enumerated)")
