"""The mismatch report's figures, from the study's tidy results table (model, setting, metric, x, value, lo, hi,
n): |Δ log p| against the trainer's token probability, the sequence log-weight against length, every setting's
per-token numbers, and the MoE routes with and without replay."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from lab.errors import LabError
from lab.reports.style import _PALETTE, color

BAR_METRICS = {"abs_mean": "mean |Δ log p| per token", "abs_q99": "99th percentile of |Δ log p|",
               "kl_k3": "KL(sampler ‖ trainer) per token (k3)"}


def setting_colors(settings) -> dict[str, str]:
    """One colour per sampler setting, from the lab's palette (bf16 settings warm, fp32 cool)."""
    order = sorted(dict.fromkeys(settings), key=lambda s: (not s.startswith("bf16"), s))
    warm, cool = ["#d62728", "#ff7f0e", "#8c564b", "#e377c2"], ["#1f77b4", "#17becf", "#9467bd", "#2ca02c"]
    out, w, c = {}, 0, 0
    for s in order:
        if s.startswith("fp32"):
            out[s], c = cool[c % len(cool)], c + 1
        elif s.startswith("bf16"):
            out[s], w = warm[w % len(warm)], w + 1
        else:
            out[s] = _PALETTE[(w + c) % len(_PALETTE)]
            w += 1
    return out


def _models(results: pd.DataFrame) -> list[str]:
    if results.empty:
        raise LabError("no mismatch results to draw")
    return list(dict.fromkeys(results["model"]))


def _noisy(s: str) -> bool:
    return not s.startswith("fp32")


def _panels(results: pd.DataFrame, metric: str):
    """A figure with one panel per model; per panel (axes, model, [(setting, its ``metric`` rows sorted by x)]) for
    the reduced-precision settings (fp32 ones sit at rounding level)."""
    models = _models(results)
    fig = Figure(figsize=(4.2 * len(models), 3.6), layout="constrained")
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    df = results[results["metric"] == metric]
    panels = [(ax, model, [(s, g.sort_values("x")) for s, g in df[df["model"] == model].groupby("setting", sort=False)
                           if _noisy(s) and not g.empty]) for ax, model in zip(axes, models)]
    return fig, panels


def _labelled(fig: Figure, panels, xlabel: str, ylabel: str, title: str, legend: int) -> Figure:
    """Each panel titled with its model, the x axes and the first y axis labelled, the figure titled."""
    for ax, model, _ in panels:
        ax.set_title(model, fontsize=10)
        ax.set_xlabel(xlabel)
        ax.legend(fontsize=legend)
    panels[0][0].set_ylabel(ylabel)
    fig.suptitle(title, fontsize=11)
    return fig


def abs_delta_vs_probability(results: pd.DataFrame) -> Figure:
    """Mean |Δ log p| against the trainer's probability of the token, one panel per model, one line per reduced-
    precision setting (bands: 95% intervals)."""
    fig, panels = _panels(results, "abs_delta_by_prob")
    colors = setting_colors(results["setting"])
    for ax, model, lines in panels:
        for s, g in lines:
            ax.plot(g["x"], g["value"], "-o", ms=3.5, lw=1.6, color=colors[s], label=s)
            ax.fill_between(g["x"], g["lo"].clip(lower=1e-12), g["hi"], color=colors[s], alpha=0.15, lw=0)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.axvline(0.1, color="0.6", lw=0.8, ls=":")
        ax.axvline(0.9, color="0.6", lw=0.8, ls=":")
    return _labelled(fig, panels, "trainer probability of the sampled token", "mean |Δ log p|",
                     "Low-probability tokens carry larger log-prob differences", 8)


def log_weight_vs_length(results: pd.DataFrame) -> Figure:
    """Mean |log w_t| (the sequence log-weight after t tokens) against t, each response's |log w| at its own length
    as a dot, the linear rule |Δ| × t dashed and the practitioners' 0.012 × t dotted; one panel per model."""
    fig, panels = _panels(results, "abs_L_by_length")
    dots = results[results["metric"] == "seq_log_weight"]
    scal = results[results["metric"] == "abs_mean"]
    colors = setting_colors(results["setting"])
    for ax, model, lines in panels:
        top = 0.0
        for s, g in lines:
            ax.plot(g["x"], g["value"], "-", lw=1.8, color=colors[s], label=f"{s}: measured")
            ax.fill_between(g["x"], g["lo"], g["hi"], color=colors[s], alpha=0.15, lw=0)
            seq = dots[(dots["model"] == model) & (dots["setting"] == s)]
            ax.scatter(seq["x"], seq["value"].abs(), s=7, color=colors[s], alpha=0.35, lw=0)
            a = scal[(scal["model"] == model) & (scal["setting"] == s)]["value"]
            if len(a):
                ax.plot(g["x"], float(a.iloc[0]) * g["x"], "--", lw=1.0, color=colors[s],
                        label=f"{s}: |Δ| × t")
            top = max(top, float(g["hi"].max()), float(np.quantile(seq["value"].abs(), 0.95)) if len(seq) else 0.0)
        xs = results[(results["metric"] == "abs_L_by_length") & (results["model"] == model)]["x"]
        if len(xs):
            t = np.linspace(1, xs.max(), 50)
            ax.plot(t, 0.012 * t, ":", color="0.35", lw=1.2, label="0.012 × t (practitioners)")
            ax.set_ylim(0, max(top * 1.4, 1e-12))
    return _labelled(fig, panels, "tokens t", "mean |log w_t|  (log p_sampler − log p_trainer)",
                     "Sequence log-weight against response length", 7)


def setting_bars(results: pd.DataFrame) -> Figure:
    """Per model and setting: mean |Δ|, p99 |Δ| and KL per token (log scale; whiskers: 95% intervals), with the
    practitioners' 0.01-0.04 band on the mean |Δ| panel."""
    df = results[results["metric"].isin(BAR_METRICS) & results["x"].isna()]
    fig = Figure(figsize=(12, 3.9), layout="constrained")
    axes = fig.subplots(1, len(BAR_METRICS))
    colors = setting_colors(results["setting"])
    labels = list(dict.fromkeys(zip(df["model"], df["setting"])))
    y = np.arange(len(labels))
    for ax, (metric, title) in zip(axes, BAR_METRICS.items()):
        d = df[df["metric"] == metric]
        at = {(m, s): (v, lo, hi) for m, s, v, lo, hi in zip(d["model"], d["setting"], d["value"], d["lo"], d["hi"])}
        vals, lo, hi = (np.array([max(float(at[k][i]), 1e-12) for k in labels]) for i in range(3))
        ax.barh(y, vals, color=[colors[s] for _, s in labels], alpha=0.8)
        ax.errorbar(vals, y, xerr=[np.maximum(vals - lo, 0), np.maximum(hi - vals, 0)], fmt="none", color="black",
                    lw=0.8, capsize=2)
        if metric == "abs_mean":
            ax.axvspan(0.01, 0.04, color="0.5", alpha=0.18, lw=0, label="practitioners: 0.01-0.04")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_yticks(y)
        ax.set_yticklabels([f"{m}: {s}" for m, s in labels] if ax is axes[0] else [], fontsize=8)
        ax.invert_yaxis()
    fig.suptitle("Every sampler setting against the fp32 full-sequence trainer", fontsize=11)
    return fig


def routing_replay(results: pd.DataFrame) -> Figure | None:
    """MoE models in reduced precision: share of routing decisions that differ, and the KL per token with free
    routing and with the sampler's routes replayed, per setting (references: about 10% of routes, replay halving
    the KL)."""
    moe = results[(results["metric"] == "route_disagreement") & results["setting"].map(_noisy)]
    if moe.empty:
        return None
    labels = list(dict.fromkeys(zip(moe["model"], moe["setting"])))
    fig = Figure(figsize=(10, 0.6 * len(labels) + 2.4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    y = np.arange(len(labels))
    scalars = results[results["x"].isna()]
    d = {(m, s, metric): v for m, s, metric, v in zip(scalars["model"], scalars["setting"], scalars["metric"],
                                                      scalars["value"])}

    def get(k, metric):
        return float(d.get((*k, metric), math.nan))

    rd = np.array([get(k, "route_disagreement") for k in labels])
    ax1.barh(y, rd * 100, color=color("mis_token"), alpha=0.8)
    for yi, v in zip(y, rd):
        ax1.annotate(f"{v:.2%}", (v * 100, yi), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax1.axvline(10, color="0.35", ls=":", lw=1.2, label="practitioners: about 10%")
    ax1.set_xlabel("routing decisions that differ (%)")
    ax1.set_yticks(y)
    ax1.set_yticklabels([f"{m}: {s}" for m, s in labels], fontsize=8)
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    free = np.array([get(k, "kl_k3") for k in labels])
    rep = np.array([get(k, "kl_k3_replay") for k in labels])
    ax2.barh(y - 0.2, free, height=0.4, color="0.55", label="free routing")
    ax2.barh(y + 0.2, rep, height=0.4, color=color("vespo"), label="routes replayed (R3)")
    ax2.scatter(free / 2, y + 0.2, marker="|", color="black", s=120, label="half the free KL (R3's figure)")
    ax2.set_xlabel("KL(sampler ‖ trainer) per token")
    ax2.set_yticks(y)
    ax2.set_yticklabels([])
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, frameon=False)
    for ax in (ax1, ax2):
        ax.invert_yaxis()
    fig.suptitle("Mixture of experts: routes that flip, and what replaying them removes", fontsize=11)
    return fig
