"""What the distillation report decides, from the study's Summary alone (``decide``), and draws from its tidy
results; the sentences are in templates/. Var(OPD) ÷ Var is the variance reduction factor against vanilla OPD (above
1: the estimator is less noisy); bias is exact (by enumeration) and relative to the target's norm."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from lab import estimators
from lab.reports.style import color, interval, table
from lab.reports.templates import render
from lab.studies.distillation.study import TARGETS, GridCell, Interval, Summary, labels, lookup
from lab.typed import build

HERE = Path(__file__).parent
KEEPS = 0.9  # a top-k baseline "keeps" the full baseline's reduction when it removes this share of what it removes


def summary_of(data: dict | Summary) -> Summary:
    return data if isinstance(data, Summary) else build(Summary, data)


def pretty(label: str) -> str:
    """Display name of a variant label from the estimator registry (vopd_top8 -> "vOPD top-8")."""
    if label == "opd_rtg":
        return f"{estimators.info('opd').label} (reward-to-go)"
    m = re.fullmatch(r"(vopd|kl)_top(\d+)", label)
    if m:
        return estimators.info(f"{m[1]}_topk").label.replace("-k", f"-{m[2]}")
    return estimators.info(label).label if label in estimators.names() else label


def shown(r: Interval | None, fmt: str = "{:.3g}") -> str:
    """'v [lo, hi]', or a dash when absent."""
    return interval(r.value, r.lo, r.hi, fmt) if r else "–"


def separates(r: Interval) -> str:
    """above (the interval lies above 1), below, or overlaps."""
    return "above" if r.lo > 1 else "below" if r.hi < 1 else "overlaps"


# ---- decisions ------------------------------------------------------------------------------------------------------

@dataclass
class TopK:
    label: str
    k: int
    reduction: Interval
    kept_share: float | None


@dataclass
class Decisions:
    """What the report states, computed."""

    vopd_vs_opd: str | None  # above (vOPD beats OPD) | below (it does not) | overlaps; None without both
    vopd_unbiased: bool
    opd_unbiased: bool
    vopd_vs_full: str | None  # above (vOPD noisier than full KL) | below | overlaps; None without both
    topk: list[TopK]  # vOPD top-k baselines by k
    topk_biased: list[str]  # those biased for the per-token target
    kept_by: str | None  # the smallest top-k baseline keeping KEEPS of the full reduction, else the largest k
    unbiased_per_token: list[str]
    unbiased_sequence: list[str]
    biased_both: list[str]
    kl_topk: list[str]  # top-k KL losses by k
    hurts: list[GridCell]  # grid settings where the baseline raises the variance
    helps: list[GridCell]
    best: GridCell | None  # where it helps most


def _by_k(s: Summary, prefix: str) -> list[str]:
    return sorted((lab for lab in s.variants if lab.startswith(prefix)), key=lambda lab: s.variants[lab].k)


def decide(summary: dict | Summary) -> Decisions:
    s = summary_of(summary)
    red, full = s.variance_reduction, s.variance_reduction.get("vopd")
    tops = [TopK(t, s.variants[t].k, red[t], s.variants[t].kept_share) for t in _by_k(s, "vopd_top") if t in red]
    kept_by = None
    if tops and full and full.value > 1:
        good = [t for t in tops if (t.kept_share or 0) >= KEEPS]
        kept_by = (good[0] if good else tops[-1]).label
    unb = {lab: b.unbiased_for for lab, b in s.bias.items()}
    vs_full = s.variance_vs_kl_full.get("vopd")
    cells = s.reduction_grid.cells if s.reduction_grid else []
    helps = [c for c in cells if c.verdict == "helps"]
    return Decisions(
        vopd_vs_opd=separates(full) if full else None, vopd_unbiased="per_token" in unb.get("vopd", []),
        opd_unbiased="per_token" in unb.get("opd", []),
        vopd_vs_full=separates(vs_full) if vs_full and "kl_full" in s.bias else None, topk=tops,
        topk_biased=[t.label for t in tops if "per_token" not in unb[t.label]], kept_by=kept_by,
        unbiased_per_token=[lab for lab, u in unb.items() if "per_token" in u],
        unbiased_sequence=[lab for lab, u in unb.items() if "sequence" in u],
        biased_both=[lab for lab, u in unb.items() if not u], kl_topk=_by_k(s, "kl_top"),
        hurts=[c for c in cells if c.verdict == "hurts"], helps=helps,
        best=max(helps, key=lambda c: c.ratio) if helps else None)


# ---- text -----------------------------------------------------------------------------------------------------------

def headline(name: str, summary: dict) -> str:
    """One line for the gallery: vOPD's variance reduction, the smallest top-k baseline keeping 90% of it, the top-k
    KL loss's bias, and where the baseline raises the variance instead."""
    s = summary_of(summary)
    d = decide(s)
    parts = []
    full = s.variance_reduction.get("vopd")
    if full:
        verb = "cuts vanilla OPD's gradient variance by a factor" if full.value > 1 else \
            "does not cut vanilla OPD's gradient variance: factor"
        parts.append(f"vOPD {verb} {shown(full, '{:.2g}')}" + (" at no bias" if d.vopd_unbiased else ""))
    if d.kept_by:
        parts.append(f"a top-{s.variants[d.kept_by].k} baseline keeps {s.variance_reduction[d.kept_by].value:.2g}x")
    if d.kl_topk:
        last = d.kl_topk[-1]
        parts.append(f"the top-{s.variants[last].k} KL loss is {s.bias[last].per_token.exact_rel_bias:.0%} biased")
    if d.hurts:
        worst = min(d.hurts, key=lambda c: c.ratio)
        parts.append(f"it raises the variance in {len(d.hurts)} of {len(s.reduction_grid.cells)} grid settings, "
                     f"most at T = {worst.length}, V = {worst.vocab_size} ({worst.ratio:.2g}x)")
    return "; ".join(parts) if parts else "distillation study"


def answer(summary: dict) -> str:
    """Markdown: does vOPD beat vanilla OPD, does it match full-vocabulary KL, what top-k keeps, who is biased."""
    s = summary_of(summary)
    return render(HERE, "answer.md", s=s, d=decide(s), pretty=pretty, shown=shown,
                  pretties=lambda labs: ", ".join(map(pretty, labs)))


def grid_answer(summary: dict) -> str:
    """Markdown: where vOPD's baseline lowers the variance and where it raises it (the reduction grid)."""
    s = summary_of(summary)
    return render(HERE, "grid.md", grid=s.reduction_grid, d=decide(s), shown=shown)


def results_table(summary: dict):
    """One row per estimator variant: exact relative bias against both targets, variance, variance reduction, MSE."""
    s = summary_of(summary)
    rows = []
    for lab, entry in s.variants.items():
        bias = s.bias[lab]
        rows.append({
            "estimator": pretty(lab),
            "bias vs per-token (exact)": f"{bias.per_token.exact_rel_bias:.1%}",
            "bias vs sequence (exact)": f"{bias.sequence.exact_rel_bias:.1%}",
            "variance ÷ ‖g_tok‖²": shown(entry.rel_variance),
            "Var(OPD) ÷ Var": shown(entry.variance_reduction, "{:.2f}"),
            "MSE ÷ ‖g_tok‖²": shown(bias.per_token.rel_mse),
        })
    return table(pd.DataFrame(rows), "Every estimator variant: exact relative bias against both targets; variance "
                                     "and MSE per batch ÷ ‖g_tok‖² [95% bootstrap interval]; Var(OPD) ÷ Var: the "
                                     "variance reduction factor against vanilla OPD.")


# ---- figures (one function per figure, a matplotlib Figure without pyplot) ------------------------------------------

def _val(results: pd.DataFrame, variant: str, metric: str, target: str = "-") -> float:
    r = lookup(results, variant, metric, target)
    return r["value"] if r else float("nan")


def bias_figure(results: pd.DataFrame) -> Figure:
    """Relative bias ‖E g − target‖ ÷ ‖target‖ of every variant against both targets: exact (bars) and sampled
    (debiased estimate with its 95% interval)."""
    labs = labels(results)
    fig = Figure(figsize=(12, 3.9), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    titles = ("per-token target (states held fixed)", "sequence-level target  ∇ KL(π_S(y) ‖ π_T(y))")
    for ax, target, title in zip(axes, TARGETS, titles):
        _bias_panel(ax, results, labs, target)
        ax.set_title(title, fontsize=10.5)
    axes[0].set_yticks(np.arange(len(labs)), [pretty(lab) for lab in labs])
    axes[0].invert_yaxis()
    axes[1].legend(frameon=False, fontsize=8, loc="lower right")
    fig.suptitle("Which estimators are biased, for which target?", fontsize=11)
    return fig


def _bias_panel(ax, results: pd.DataFrame, labs: list[str], target: str) -> None:
    norm = _val(results, "-", "target_norm", target)
    exact = np.array([_val(results, lab, "exact_rel_bias", target) for lab in labs])
    sampled = [lookup(results, lab, "bias_norm", target) for lab in labs]
    right = max(1.0, float(np.nanmax(exact)) * 1.18, max(r["hi"] / norm for r in sampled) * 1.1)
    ax.barh(np.arange(len(labs)), exact, color=[color(lab) for lab in labs], alpha=0.75, label="exact (enumeration)")
    for i, r in enumerate(sampled):
        ax.errorbar(r["value"] / norm, i, xerr=[[max(r["value"] - r["lo"], 0) / norm],
                                                [max(r["hi"] - r["value"], 0) / norm]],
                    fmt="o", color="black", ms=3.5, lw=1, capsize=2, label="sampled, 95% interval" if i == 0 else None)
        ax.text(max(exact[i], r["hi"] / norm) + 0.015 * right, i, f"{exact[i]:.0%}", va="center", fontsize=8,
                color="#333333")
    ax.set_xlabel("‖E g − target‖ ÷ ‖target‖  (labels: exact)")
    ax.grid(True, axis="x", alpha=0.3)
    ax.set_xlim(0, right)


def variance_figure(results: pd.DataFrame) -> Figure:
    """Variance tr Cov(g) of one batch's gradient and MSE against the per-token target, in units of ‖g_tok‖²."""
    labs = labels(results)
    fig = Figure(figsize=(12, 3.9), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    norm2 = _val(results, "-", "target_norm", "per_token") ** 2
    panels = [("variance", "-", "variance  tr Cov(g) ÷ ‖g_tok‖²"),
              ("mse", "per_token", "MSE against the per-token target ÷ ‖g_tok‖²")]
    for ax, (metric, target, title) in zip(axes, panels):
        for i, lab in enumerate(labs):
            r = lookup(results, lab, metric, target)
            v, lo, hi = r["value"] / norm2, r["lo"] / norm2, r["hi"] / norm2
            ax.barh(i, v, color=color(lab), alpha=0.75)
            ax.errorbar(v, i, xerr=[[max(v - lo, 0)], [max(hi - v, 0)]], fmt="none", color="black", lw=1, capsize=2)
        ax.set_xscale("log")
        ax.set_title(title, fontsize=10.5)
        ax.grid(True, axis="x", alpha=0.3, which="both")
    axes[0].set_yticks(np.arange(len(labs)), [pretty(lab) for lab in labs])
    axes[0].invert_yaxis()
    fig.suptitle("How noisy is one batch's gradient? (log scale; bars: 95% bootstrap intervals)", fontsize=11)
    return fig


def variance_reduction_figure(results: pd.DataFrame) -> Figure:
    """Var(OPD) ÷ Var(vOPD top-k) against k, with the full-vocabulary baseline as a band and 1 (no gain) marked;
    right: the student's probability mass inside its top-k (what the truncated baseline sees)."""
    rows = results[(results["metric"] == "variance_reduction") & results["variant"].str.startswith("vopd_top")]
    rows = rows.sort_values("k")
    V = int(results["vocab_size"].iloc[0])
    fig = Figure(figsize=(12, 3.9), layout="constrained")
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    _reduction_panel(ax, rows, lookup(results, "vopd", "variance_reduction"), V)
    mass = results[(results["metric"] == "student_topk_mass") & (results["variant"] == "-")].sort_values("k")
    ax2.plot([*mass["k"], V], [*mass["value"], 1.0], "-s", color="#444444", lw=1.6, ms=4)
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("k")
    ax2.set_title("student's probability mass in its top-k (exact)", fontsize=10.5)
    ks = sorted({*rows["k"], V})
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(ks, [f"{int(k)}" for k in ks])
        a.xaxis.set_minor_locator(NullLocator())
        a.grid(True, alpha=0.3)
    fig.suptitle("What does a top-k baseline keep?", fontsize=11)
    return fig


def _reduction_panel(ax, rows: pd.DataFrame, full: dict, V: int) -> None:
    if full:
        ax.axhline(full["value"], color=color("vopd"), lw=1.6, label=f"vOPD, full vocabulary (k = V = {V})")
        ax.axhspan(full["lo"], full["hi"], color=color("vopd"), alpha=0.12, lw=0)
        ax.plot([V], [full["value"]], "*", color=color("vopd"), ms=11)
    if not rows.empty:
        ax.plot(rows["k"], rows["value"], "-o", color=color("vopd_top"), lw=1.8, ms=4, label="vOPD top-k baseline")
        ax.fill_between(rows["k"], rows["lo"], rows["hi"], color=color("vopd_top"), alpha=0.15, lw=0)
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="1 = no reduction (vanilla OPD)")
    ax.set_xlabel("k (student's top-k tokens used for the baseline)")
    ax.set_ylabel("Var(OPD) ÷ Var(estimator)")
    ax.set_title("variance reduction factor (95% bootstrap interval, joint resampling)", fontsize=10.5)
    ax.legend(frameon=False, fontsize=8.5, loc="lower right")
    ax.set_ylim(0, max([1.0, *rows["hi"], *([full["hi"]] if full else [])]) * 1.15)


def grid_rows(results: pd.DataFrame) -> pd.DataFrame:
    """The reduction grid from the tidy results (``part`` reduction_grid): one row per (T, V, teacher noise) with the
    ratio Var(OPD) ÷ Var(vOPD), its interval and the KL per token."""
    g = results[results["part"] == "reduction_grid"] if "part" in results else results.iloc[:0]
    keys = ["length", "vocab_size", "teacher_noise"]
    ratio = g[g["metric"] == "variance_reduction"][[*keys, "value", "lo", "hi"]].rename(columns={"value": "ratio"})
    kl = g[g["metric"] == "kl_token"][[*keys, "value"]].rename(columns={"value": "kl_token"})
    return ratio.merge(kl, on=keys)


def grid_figure(results: pd.DataFrame) -> Figure:
    """Var(OPD) ÷ Var(vOPD) against vocabulary size, one panel per response length, one line per teacher
    perturbation (labelled by its KL per token), with 95% intervals (the reduction grid's rows of ``results``)."""
    grid = grid_rows(results)
    lengths = sorted(grid["length"].unique())
    fig = Figure(figsize=(5.0 * len(lengths), 3.8), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(lengths), sharey=True))
    blues = ["#9ecae1", "#4292c6", "#08519c", "#08306b"]
    for ax, T in zip(axes, lengths):
        for i, (noise, g) in enumerate(grid[grid["length"] == T].groupby("teacher_noise")):
            g = g.sort_values("vocab_size")
            ax.plot(g["vocab_size"], g["ratio"], "-o", color=blues[i % 4], ms=4,
                    label=f"teacher noise {noise:g} (KL {g['kl_token'].median():.2g}/token)")
            ax.fill_between(g["vocab_size"], g["lo"], g["hi"], color=blues[i % 4], alpha=0.15, lw=0)
        ax.axhline(1.0, color="black", lw=1, ls="--")
        ax.text(0.01, 1.0, " no change", transform=ax.get_yaxis_transform(), va="bottom", fontsize=8)
        ax.set_xscale("log", base=2)
        ticks = sorted(grid["vocab_size"].unique())
        ax.set_xticks(ticks, [str(v) for v in ticks])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("vocabulary size V")
        ax.set_title(f"responses of T = {T} tokens", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(frameon=False, fontsize=7.5)
    axes[0].set_ylabel("Var(OPD) ÷ Var(vOPD)")
    fig.suptitle("Where vOPD's baseline helps (above the dashed line) and where it hurts", fontsize=11)
    return fig
