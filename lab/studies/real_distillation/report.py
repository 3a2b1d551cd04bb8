"""What the real_distillation report says and draws: text and table from the study's summary alone, figures from its
tidy aggregates (``lab.studies.real_distillation``)."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from lab.reports.distillation import pretty
from lab.reports.style import color, interval, table

ORDER = ("opd", "vopd", "vopd_topk", "kl_full", "kl_topk")


def _fmt(r: dict | None, fmt: str = "{:.2g}") -> str:
    return interval(r["value"], r["lo"], r["hi"], fmt) if r else "–"


def _gap(s: dict) -> str:
    return "random student" if s["student_accuracy"] == 0 else f"student at accuracy {s['student_accuracy']:g}"


def _where(s: dict) -> str:
    return f"V = {s['vocab_size']}, {_gap(s)}"


def _rated(summary: dict) -> list[dict]:
    return [s for s in summary["settings"] if s["var_reduction"].get("vopd")]


# ---- text -----------------------------------------------------------------------------------------------------------

def headline(summary: dict) -> str:
    """vOPD's largest and smallest variance reduction with the value share that explains each, and its cost."""
    rated = [s for s in summary["settings"] if s["var_reduction"].get("vopd")]
    if not rated:
        return "real-teacher distillation: no vOPD variance measured"
    hi = max(rated, key=lambda s: s["var_reduction"]["vopd"]["value"])
    lo = min(rated, key=lambda s: s["var_reduction"]["vopd"]["value"])

    def part(s):
        r = s["var_reduction"]["vopd"]
        return (f"{r['value']:.2g}x [{r['lo']:.2g}, {r['hi']:.2g}] at V = {s['vocab_size']} from a {_gap(s)} (value "
                f"share {s['value_share']:.0%})")

    text = f"vOPD's baseline cuts vanilla OPD's gradient variance by {part(hi)}"
    if lo is not hi:
        text += f" but only {part(lo)}"
    vs_full = sorted(s["var_vs_kl_full"]["vopd"]["value"] for s in rated if s["var_vs_kl_full"].get("vopd"))
    if vs_full:
        text += (f"; it stays {vs_full[0]:.2g}-{vs_full[-1]:.2g}x noisier than full-vocabulary KL" if len(vs_full) > 1
                 else f"; it stays {vs_full[0]:.2g}x noisier than full-vocabulary KL")
    costs = [r["value"] for c in summary["step_cost"].values() for e, r in c.items() if e == "vopd"]
    if costs:
        span = f"{min(costs):.2f}x" if len(costs) == 1 else f"{min(costs):.2f}-{max(costs):.2f}x"
        text += f"; a step costs {span} vanilla OPD's"
    return text


def source_line(summary: dict) -> str:
    """Which runs the report shows: its small default grid, or a sweep's results folder."""
    where = ("**This report shows its small default grid**, run in the report itself" if summary["sweep"] is None else
             f"**This report shows a sweep's results folder** (`{summary['results']}`, sweep "
             f"`{summary['sweep']['name']}`)")
    full = (len(summary["estimators"]) * len(summary["vocab_sizes"]) * len(summary["student_accuracies"])
            * len(summary["seeds"]))
    partial = "" if summary["runs"] >= full else f" ({summary['runs']} of them finished: a partly run sweep)"
    vocab = ", ".join(map(str, summary["vocab_sizes"]))
    starts = ", ".join("random" if a == 0 else f"{a:g}" for a in summary["student_accuracies"])
    return (f"{where}: {len(summary['estimators'])} estimators × V ∈ {{{vocab}}} × student start ∈ "
            f"{{{starts}}} × {len(summary['seeds'])} seeds = {full} runs{partial}, {summary['steps']} steps each; a "
            f"`{summary['student_size']}` student distilled from a `{summary['teacher_size']}` teacher on "
            f"`{summary['env']}`.")


def opening(summary: dict) -> str:
    """Markdown: the finding at the setting where the baseline matters most, beside where it matters least."""
    rated = _rated(summary)
    lines = [source_line(summary), ""]
    if not rated:
        return "\n".join(lines + ["No vOPD gradient variance was measured (no probes)."])
    hi = max(rated, key=lambda s: s["var_reduction"]["vopd"]["value"])
    lo = min(rated, key=lambda s: s["var_reduction"]["vopd"]["value"])
    lines.append(f"**Where it matters ({_where(hi)}), vOPD's baseline divides vanilla OPD's gradient variance by "
                 f"{_fmt(hi['var_reduction']['vopd'])}**: the state's value −KL_t carries {hi['value_share']:.0%} of "
                 f"the sampled-token reward's second moment, so subtracting it removes most of the noise "
                 f"(a state-only baseline would give {_fmt(hi['pred_reduction'])}× if the score's size did not "
                 f"depend on the token).")
    if lo is not hi:
        lines.append(f"At {_where(lo)} it divides it by only {_fmt(lo['var_reduction']['vopd'])}: the value share "
                     f"is {lo['value_share']:.0%}, and most of the noise is the spread of rewards between tokens at "
                     f"the same state, which no state-only baseline can remove.")
    claim = _claim(summary)
    if claim:
        lines.append(claim)
    return "\n\n".join(lines)


def _span(values, fmt="{:.2g}") -> str:
    values = sorted(values)
    return fmt.format(values[0]) if len(values) == 1 or values[0] == values[-1] else \
        f"{fmt.format(values[0])}-{fmt.format(values[-1])}"


def _claim(summary: dict) -> str | None:
    """The vOPD paper's claim, checked: beats vanilla OPD, matches full-vocabulary KL, at near-vanilla cost."""
    rated = _rated(summary)
    vs_full = [s["var_vs_kl_full"]["vopd"]["value"] for s in rated if s["var_vs_kl_full"].get("vopd")]
    better = [s for s in rated if s["kl_minus_opd"].get("vopd")]
    lower = [s for s in better if s["kl_minus_opd"]["vopd"]["hi"] < 0]
    costs = [r["value"] for c in summary["step_cost"].values() for e, r in c.items() if e == "vopd"]
    if not vs_full:
        return None
    parts = [f"**The claim, checked here.** vOPD beats vanilla OPD: less gradient variance in "
             f"{len(summary['helps'])} of {len(rated)} settings"]
    if better:
        parts[0] += (f", and a lower final held-out KL (paired by seed) in {len(lower)} of {len(better)}")
    parts.append(f"it does not match full-vocabulary KL's gradient noise, staying {_span(vs_full)}× noisier on the "
                 f"same responses")
    if costs:
        parts.append(f"its step costs {_span(costs, '{:.2f}')}× vanilla OPD's here (the networks dominate at "
                     f"V ≤ {max(summary['vocab_sizes'])}; see the benchmark for larger V)")
    return "; ".join(parts) + "."


def _variance_lines(summary: dict) -> list[str]:
    out = []
    for s in _rated(summary):
        r, p = s["var_reduction"]["vopd"], s["pred_reduction"]
        word = {"helps": "lowers", "hurts": "RAISES", "unresolved": "does not measurably change"}[s["verdict"]]
        out.append(f"- {_where(s)} (start accuracy {s['initial_accuracy']:.2f}, KL {s['kl_token']:.2g}/token): the "
                   f"baseline {word} the variance, Var(OPD) ÷ Var(vOPD) = **{_fmt(r)}**; value share "
                   f"{s['value_share']:.0%}, predicted {_fmt(p)}.")
    return out


def _topk_line(summary: dict) -> str | None:
    parts = []
    for s in _rated(summary):
        r = s["var_reduction"].get("vopd_topk")
        if r:
            share = s["kl_topk_token"] / s["kl_token"] if s["kl_token"] > 0 else float("nan")
            parts.append(f"{_where(s)}: {_fmt(r)} (its top-k KL is {share:.0%} of KL_t; top-k mass "
                         f"{s['topk_mass']:.0%})")
    if not parts:
        return None
    return ("- **The top-k baseline** (KL over the student's top-k tokens, both renormalised there) keeps less: "
            + "; ".join(parts) + ". Renormalising the teacher over the student's top tokens drops log of the "
            "teacher's total mass on them, the term that makes KL_t large when the student's favourites are wrong, "
            "so the baseline misses the value exactly where the full one helps most.")


def _topk_loss_line(summary: dict) -> str | None:
    worse = [s for s in summary["settings"] if (d := s["kl_minus_opd"].get("kl_topk")) and d["lo"] > 0]
    if not worse:
        return None
    parts = "; ".join(f"{_where(s)}: {_fmt(s['kl_minus_opd']['kl_topk'], '{:+.2g}')} nats (the student's top-k "
                      f"holds {s['topk_mass']:.0%} of its mass)" for s in worse)
    return ("- **The top-k KL loss is biased**: it optimises the KL over the student's top-k tokens only, so the mass "
            "the student keeps elsewhere (on distractors) goes unpunished, and it ends ABOVE vanilla OPD's final KL: "
            + parts + ".")


def _full_line(summary: dict) -> str | None:
    parts = [f"{_where(s)}: vOPD {_fmt(s['var_vs_kl_full'].get('vopd'))}×, OPD "
             f"{_fmt(s['var_vs_kl_full'].get('opd'))}×" for s in _rated(summary) if s["var_vs_kl_full"].get("vopd")]
    if not parts:
        return None
    return ("- **Full-vocabulary KL is the quietest** (variance ÷ full KL's on the same responses): "
            + "; ".join(parts)
            + ". It removes the within-state noise too; what remains is which states a batch visits.")


def _training_lines(summary: dict) -> list[str]:
    n = len(summary["seeds"])
    out = []
    for s in summary["settings"]:
        d = s["kl_minus_opd"]
        if not d:
            continue
        diffs = "; ".join(f"{pretty(e)} {_fmt(r, '{:+.2g}')}" for e, r in d.items())
        out.append(f"- {_where(s)}: held-out KL {s['initial_kl_seq']:.3g} → OPD "
                   f"{_fmt(s['final_kl_seq'].get('opd'), '{:.3g}')}; final minus OPD's, paired by seed: {diffs}.")
    if out:
        few = "; with so few, read the intervals as ranges" if n < 5 else ""
        out.insert(0, f"**Does lower variance train faster?** Final held-out sequence KL after {summary['steps']} "
                      f"steps ({n} seeds{few}):")
    return out


def _cost_line(summary: dict) -> str | None:
    parts = []
    for V, c in summary["step_cost"].items():
        if c:
            parts.append(f"V = {V}: " + ", ".join(f"{pretty(e)} {r['value']:.2f}×" for e, r in c.items()))
    if not parts:
        return None
    return ("- **Cost per step** (median wall clock over runs ÷ vanilla OPD's; sampling, teacher and update "
            "together): " + "; ".join(parts) + ". At these vocabularies the networks dominate and every estimator "
            "costs about the same; runs at different times on a shared machine also differ by its load, so "
            "`benchmarks/bench_real_distillation.py` measures the ratios in one run, interleaved, up to larger V.")


def _prediction_line(summary: dict) -> str:
    rated = [s for s in _rated(summary) if s["pred_reduction"]]
    below = [s for s in rated if s["var_reduction"]["vopd"]["hi"] < s["pred_reduction"]["lo"]]
    order = sorted(rated, key=lambda s: s["value_share"])
    ranks = [s["var_reduction"]["vopd"]["value"] for s in order]
    follows = all(a <= b for a, b in zip(ranks, ranks[1:]))
    return (f"Across the {len(rated)} settings the measured factor {'rises' if follows else 'does not always rise'} "
            f"with the value share, and lies below the prediction in {len(below)} of them: the prediction treats "
            f"every token's score ∇log π(y_t) as equally large and ignores the noise of which states a batch "
            f"visits, which no baseline removes (full-vocabulary KL keeps it too).")


def answer(summary: dict) -> str:
    """Markdown: where the baseline helps and why, what top-k and full KL do, training outcome, cost."""
    lines = ["**Where vOPD's baseline helps** (Var(OPD) ÷ Var(vOPD) on the same probe responses at the same "
             "parameters, pooled over every probe of every run; 95% bootstrap interval over runs):", ""]
    lines += _variance_lines(summary)
    lines += ["", "**Why.** Per token OPD's coefficient is r_t = log π_T(y_t) − log π_S(y_t), with E[r_t²|s_t] = "
              "Var(r_t|s_t) + KL_t². vOPD subtracts the mean −KL_t, so it can remove at most the value share "
              "KL_t² ÷ E[r_t²]: large for a random student whose sampled tokens are all about equally bad (with "
              "distractors, most of its mass sits where the teacher has none), small for a warm student whose right "
              "and wrong tokens get very different rewards at the same state. " + _prediction_line(summary), ""]
    lines += [x for x in (_topk_line(summary), _full_line(summary), _topk_loss_line(summary)) if x]
    lines += [""] + _training_lines(summary)
    cost = _cost_line(summary)
    if cost:
        lines += ["", cost]
    return "\n".join(lines)


def _start(s: dict) -> str:
    return "random" if s["student_accuracy"] == 0 else f"{s['initial_accuracy']:.2f}"


def results_table(summary: dict):
    """One row per setting: value share, the factor it predicts and the measured variance reductions."""
    rows = []
    for s in summary["settings"]:
        red = s["var_reduction"]
        rows.append({"V": s["vocab_size"], "student start": _start(s), "KL / token": f"{s['kl_token']:.3g}",
                     "value share": f"{s['value_share']:.0%}", "predicted": _fmt(s["pred_reduction"]),
                     **{pretty(e): _fmt(red.get(e)) for e in ORDER[1:] if e in red}})
    return table(pd.DataFrame(rows), "Var(OPD) ÷ Var(estimator), measured on the same probe responses at the same "
                                     "parameters [95% interval over runs], beside the value share mean KL_t² ÷ "
                                     "mean E[r_t²|s_t] and the factor 1 ÷ (1 − share) it predicts for vOPD.")


def final_table(summary: dict):
    """One row per setting: the held-out sequence KL at the start and after training, per trained estimator."""
    rows = []
    for s in summary["settings"]:
        fin = s["final_kl_seq"]
        rows.append({"V": s["vocab_size"], "student start": _start(s), "start KL": f"{s['initial_kl_seq']:.3g}",
                     **{pretty(e): _fmt(fin.get(e), "{:.3g}") for e in ORDER if e in fin}})
    return table(pd.DataFrame(rows), f"Held-out reverse KL(π_S ‖ π_T) per response (nats) at the start and after "
                                     f"{summary['steps']} steps [95% interval over {len(summary['seeds'])} seeds].")


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
