"""What the real_distillation report decides, from the study's Summary alone (``decide``), and draws from its tidy
aggregates; the sentences are in templates/. Var(OPD) ÷ Var(estimator) is measured on the same probe responses at the
same parameters (above 1: the estimator is less noisy); intervals are 95% bootstrap intervals over runs."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from lab import estimators
from lab.reports.style import color, interval, table
from lab.reports.templates import render
from lab.studies.real_distillation.study import Measured, Setting, Summary
from lab.typed import build

HERE = Path(__file__).parent
ORDER = ("opd", "vopd", "vopd_topk", "kl_full", "kl_topk")


def summary_of(data: dict | Summary) -> Summary:
    return data if isinstance(data, Summary) else build(Summary, data)


def pretty(name: str) -> str:
    """An estimator's display name (its registry label)."""
    return estimators.info(name).label if name in estimators.names() else name


def shown(r: Measured | None, fmt: str = "{:.2g}") -> str:
    """'v [lo, hi]', or a dash when absent."""
    return interval(r.value, r.lo, r.hi, fmt) if r else "–"


def span(values, fmt: str = "{:.2g}") -> str:
    """'a-b' over the values, or one value."""
    values = sorted(values)
    return fmt.format(values[0]) if len(values) == 1 or values[0] == values[-1] else \
        f"{fmt.format(values[0])}-{fmt.format(values[-1])}"


# ---- decisions ------------------------------------------------------------------------------------------------------

@dataclass
class Decisions:
    """What the report states, computed."""

    rated: list[Setting]  # settings where vOPD's variance reduction was measured
    most: Setting | None  # where the baseline cuts the variance most
    least: Setting | None  # ... least
    vs_full: list[float]  # Var(vOPD) / Var(full KL) over the rated settings
    costs: list[float]  # vOPD's step time / OPD's, per V
    trained_both: list[Setting]  # rated settings where vOPD's final KL was compared with OPD's
    lower_kl: list[Setting]  # ... where it ends below OPD's (interval below 0)
    rises_with_share: bool  # the measured factor rises with the value share across settings
    below_prediction: list[Setting]  # the measured factor's interval lies below the predicted one
    topk_loss_worse: list[Setting]  # the top-k KL loss ends above OPD's final KL (interval above 0)
    predicted: list[Setting]  # rated settings with a predicted factor
    topk: list[Setting]  # rated settings where the top-k baseline was measured
    quiet: list[Setting]  # rated settings where vOPD was compared with full-vocabulary KL
    compared: list[Setting]  # settings where final KLs were compared with OPD's
    costed: list[tuple]  # (V, {estimator: step time / OPD's}) where measured


def decide(summary: dict | Summary) -> Decisions:
    s = summary_of(summary)
    rated = [x for x in s.settings if x.var_reduction.get("vopd")]

    def factor(x: Setting) -> float:
        return x.var_reduction["vopd"].value

    ranks = [factor(x) for x in sorted(rated, key=lambda x: x.value_share)]
    predicted = [x for x in rated if x.pred_reduction]
    trained = [x for x in rated if x.kl_minus_opd.get("vopd")]
    return Decisions(
        rated=rated, most=max(rated, key=factor, default=None), least=min(rated, key=factor, default=None),
        vs_full=[x.var_vs_kl_full["vopd"].value for x in rated if x.var_vs_kl_full.get("vopd")],
        costs=[r.value for c in s.step_cost.values() for e, r in c.items() if e == "vopd"],
        trained_both=trained, lower_kl=[x for x in trained if x.kl_minus_opd["vopd"].hi < 0],
        rises_with_share=all(a <= b for a, b in zip(ranks, ranks[1:])),
        below_prediction=[x for x in predicted if x.var_reduction["vopd"].hi < x.pred_reduction.lo],
        topk_loss_worse=[x for x in s.settings if (d := x.kl_minus_opd.get("kl_topk")) and d.lo > 0],
        predicted=predicted, topk=[x for x in rated if x.var_reduction.get("vopd_topk")],
        quiet=[x for x in rated if x.var_vs_kl_full.get("vopd")], compared=[x for x in s.settings if x.kl_minus_opd],
        costed=[(V, c) for V, c in s.step_cost.items() if c])


# ---- text -----------------------------------------------------------------------------------------------------------

def _gap(s: Setting) -> str:
    return "random student" if s.student_accuracy == 0 else f"student at accuracy {s.student_accuracy:g}"


def headline(name: str, summary: dict) -> str:
    """One line for the gallery: vOPD's largest and smallest variance reduction with the value share that explains
    each, how far it stays from full-vocabulary KL, and its cost."""
    d = decide(summary)
    if d.most is None:
        return "real-teacher distillation: no vOPD variance measured"

    def part(s: Setting) -> str:
        r = s.var_reduction["vopd"]
        return (f"{r.value:.2g}x [{r.lo:.2g}, {r.hi:.2g}] at V = {s.vocab_size} from a {_gap(s)} (value share "
                f"{s.value_share:.0%})")

    text = f"vOPD's baseline cuts vanilla OPD's gradient variance by {part(d.most)}"
    if d.least is not d.most:
        text += f" but only {part(d.least)}"
    if d.vs_full:
        text += f"; it stays {span(d.vs_full)}x noisier than full-vocabulary KL"
    if d.costs:
        text += f"; a step costs {span(d.costs, '{:.2f}')}x vanilla OPD's"
    return text


def _facts(summary: dict) -> dict:
    s = summary_of(summary)
    return {"s": s, "d": decide(s), "shown": shown, "span": span, "pretty": pretty, "gap": _gap,
            "full": len(s.estimators) * len(s.vocab_sizes) * len(s.student_accuracies) * len(s.seeds)}


def opening(summary: dict) -> str:
    """Markdown: which runs, and the finding at the setting where the baseline matters most, beside where it matters
    least, and the vOPD paper's claim checked."""
    return render(HERE, "opening.md", **_facts(summary))


def answer(summary: dict) -> str:
    """Markdown: where the baseline helps and why, what top-k and full KL do, training outcome, cost."""
    return render(HERE, "answer.md", **_facts(summary))


def _start(s: Setting) -> str:
    return "random" if s.student_accuracy == 0 else f"{s.initial_accuracy:.2f}"


def results_table(summary: dict):
    """One row per setting: value share, the factor it predicts and the measured variance reductions."""
    rows = []
    for s in summary_of(summary).settings:
        red = s.var_reduction
        rows.append({"V": s.vocab_size, "student start": _start(s), "KL / token": f"{s.kl_token:.3g}",
                     "value share": f"{s.value_share:.0%}", "predicted": shown(s.pred_reduction),
                     **{pretty(e): shown(red.get(e)) for e in ORDER[1:] if e in red}})
    return table(pd.DataFrame(rows), "Var(OPD) ÷ Var(estimator), measured on the same probe responses at the same "
                                     "parameters [95% interval over runs], beside the value share mean KL_t² ÷ "
                                     "mean E[r_t²|s_t] and the factor 1 ÷ (1 − share) it predicts for vOPD.")


def final_table(summary: dict):
    """One row per setting: the held-out sequence KL at the start and after training, per trained estimator."""
    s_ = summary_of(summary)
    rows = []
    for s in s_.settings:
        fin = s.final_kl_seq
        rows.append({"V": s.vocab_size, "student start": _start(s), "start KL": f"{s.initial_kl_seq:.3g}",
                     **{pretty(e): shown(fin.get(e), "{:.3g}") for e in ORDER if e in fin}})
    return table(pd.DataFrame(rows), f"Held-out reverse KL(π_S ‖ π_T) per response (nats) at the start and after "
                                     f"{s_.steps} steps [95% interval over {len(s_.seeds)} seeds].")


# ---- figures --------------------------------------------------------------------------------------------------------

def _settings(results: pd.DataFrame):
    s = results[results["part"] == "variance"][["vocab_size", "student_accuracy"]].drop_duplicates()
    if s.empty:
        s = results[results["part"] == "curve"][["vocab_size", "student_accuracy"]].drop_duplicates()
    return sorted(s["vocab_size"].unique()), sorted(s["student_accuracy"].unique())


def _grid(results: pd.DataFrame, title: str):
    Vs, gaps = _settings(results)
    fig = Figure(figsize=(4.3 * len(gaps) + 0.6, 3.0 * len(Vs) + 0.6), layout="constrained")
    axes = np.array(fig.subplots(len(Vs), len(gaps), squeeze=False, sharex=True))
    for i, V in enumerate(Vs):
        for j, a in enumerate(gaps):
            axes[i, j].set_title(f"V = {V}, {'random student' if a == 0 else f'student at {a:g}'}", fontsize=9.5)
            axes[i, j].grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=11)
    return fig, axes, Vs, gaps


def _lines(ax, d: pd.DataFrame, label_fn) -> None:
    for e in [e for e in ORDER if e in set(d["estimator"])]:
        g = d[d["estimator"] == e].sort_values("update")
        ax.plot(g["update"], g["value"], "-", color=color(e), lw=1.6, label=label_fn(e))
        ax.fill_between(g["update"], g["lo"], g["hi"], color=color(e), alpha=0.15, lw=0)


def kl_figure(results: pd.DataFrame, metric: str = "kl_seq") -> Figure:
    """The sequence-level reverse KL to the teacher against the step, per setting and trained estimator (held-out
    prompts by default; ``kl_seq_train`` for the training prompts), mean over seeds with its interval."""
    where = "held-out" if metric == "kl_seq" else "training"
    fig, axes, Vs, gaps = _grid(results, f"Reverse KL(π_S ‖ π_T) per response on {where} prompts (mean over seeds, "
                                          f"95% interval)")
    curves = results[(results["part"] == "curve") & (results["metric"] == metric)]
    for i, V in enumerate(Vs):
        for j, a in enumerate(gaps):
            _lines(axes[i, j], curves[(curves["vocab_size"] == V) & (curves["student_accuracy"] == a)], pretty)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    for ax in axes[:, 0]:
        ax.set_ylabel("nats per response")
    _legend(fig, axes)
    return fig


def _legend(fig, axes) -> None:
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), frameon=False, fontsize=8.5)


def variance_figure(results: pd.DataFrame) -> Figure:
    """Each estimator's batch-gradient variance tr Cov ÷ B along training (log scale), measured on the same probe
    responses at the parameters of every run, mean over runs with its interval."""
    fig, axes, Vs, gaps = _grid(results, "Gradient variance of one batch along training (tr Cov ÷ B, log scale; "
                                         "all estimators on the same probes)")
    curves = results[(results["part"] == "curve") & (results["metric"] == "gvar")]
    for i, V in enumerate(Vs):
        for j, a in enumerate(gaps):
            _lines(axes[i, j], curves[(curves["vocab_size"] == V) & (curves["student_accuracy"] == a)], pretty)
            axes[i, j].set_yscale("log")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    _legend(fig, axes)
    return fig


def reduction_figure(results: pd.DataFrame) -> Figure:
    """Var(OPD) ÷ Var(estimator) against V, one panel per student start, with 95% intervals, and the factor the value
    share predicts for vOPD's state-only baseline (black diamonds); the dashed line is no change."""
    rows = results[(results["part"] == "variance") & (results["metric"] == "var_reduction")]
    pred = results[(results["part"] == "variance") & (results["metric"] == "pred_reduction")]
    Vs, gaps = sorted(rows["vocab_size"].unique()), sorted(rows["student_accuracy"].unique())
    fig = Figure(figsize=(4.2 * len(gaps) + 0.6, 3.9), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(gaps), sharey=True))
    x = {V: i for i, V in enumerate(Vs)}
    for ax, a in zip(axes, gaps):
        d = rows[rows["student_accuracy"] == a]
        for e in [e for e in ORDER if e in set(d["estimator"])]:
            g = d[d["estimator"] == e].sort_values("vocab_size")
            ax.errorbar([x[V] for V in g["vocab_size"]], g["value"], yerr=[np.maximum(g["value"] - g["lo"], 0),
                                                                        np.maximum(g["hi"] - g["value"], 0)],
                        fmt="-o", color=color(e), ms=4, lw=1.4, capsize=2, label=pretty(e))
        p = pred[pred["student_accuracy"] == a].sort_values("vocab_size")
        ax.plot([x[V] for V in p["vocab_size"]], p["value"], "D", color="black", ms=5, ls="none",
                label="vOPD predicted from the value share")
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_xticks(range(len(Vs)), [str(int(V)) for V in Vs])
        ax.set_xlabel("vocabulary size V")
        ax.set_title("random student" if a == 0 else f"student at accuracy {a:g}", fontsize=10)
        ax.grid(True, alpha=0.3, which="both")
    axes[0].set_ylabel("Var(OPD) ÷ Var(estimator)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncols=len(labels), frameon=False, fontsize=8.5)
    fig.suptitle("How much each estimator cuts vanilla OPD's gradient variance (log scale; 95% intervals over runs)",
                 fontsize=11)
    return fig


def cost_figure(results: pd.DataFrame) -> Figure:
    """Median wall-clock step time of each estimator's runs ÷ vanilla OPD's, against V, with 95% intervals."""
    rows = results[(results["part"] == "cost") & (results["metric"] == "step_ratio")]
    fig = Figure(figsize=(6.0, 3.4), layout="constrained")
    ax = fig.subplots()
    for e in [e for e in ORDER if e in set(rows["estimator"])]:
        g = rows[rows["estimator"] == e].sort_values("vocab_size")
        ax.errorbar(g["vocab_size"], g["value"], yerr=[np.maximum(g["value"] - g["lo"], 0),
                                                       np.maximum(g["hi"] - g["value"], 0)],
                    fmt="-o", color=color(e), ms=4, lw=1.4, capsize=2, label=pretty(e))
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xscale("log")
    Vs = sorted(rows["vocab_size"].unique())
    ax.set_xticks(Vs, [str(int(V)) for V in Vs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("vocabulary size V")
    ax.set_ylabel("step time ÷ vanilla OPD's")
    ax.grid(True, alpha=0.3)
    ax.legend(frameon=False, fontsize=8)
    fig.suptitle("Wall-clock cost per step, relative to vanilla OPD", fontsize=11)
    return fig
