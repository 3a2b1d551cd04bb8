"""What the gvpo_optimum report shows: its answer text and headline from the summary alone, and its figures.

Methods take their estimator's colour from ``lab.reports.style``.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from lab.reports.style import color, interval
from lab.studies.gvpo_optimum import methods_of, samplers_of

SAMPLER_LABELS = {"on_policy": "on-policy (π_θ)", "reference": "π_ref (fixed)",
                  "tempered": "tempered π_ref (fixed)", "uniform": "uniform (fixed)"}
SAMPLER_WORDS = {"on_policy": "on-policy", "reference": "π_ref", "tempered": "tempered π_ref", "uniform": "uniform"}
POLICY_WORDS = {"prefix": "prefix-tree", "markov": "Markov"}
REACHED_TV = 0.05  # a final TV whose upper interval bound is below this counts as having reached pi*


def _fmt(e: dict) -> str:
    return interval(e["mean"], e["lo"], e["hi"], "{:.3f}")


def headline(summary: dict) -> str:
    """One line: GVPO's worst final TV over samplers, and every method's from the last fixed sampler."""
    ft = summary["final_tv"]
    samplers = list(next(iter(ft.values())))
    parts = []
    if "gvpo" in ft:
        worst = max(ft["gvpo"][s]["mean"] for s in samplers)
        parts.append(f"GVPO ends within TV {worst:.2g} of π* from every sampler, with no importance weights")
    off = [s for s in samplers if s != "on_policy"]
    others = [m for m in ft if m != "gvpo"]
    if off and others:
        s = off[-1]
        gv = f"gvpo {ft['gvpo'][s]['mean']:.2g}, " if "gvpo" in ft else ""
        parts.append(f"from {SAMPLER_WORDS.get(s, s)} samples: {gv}"
                     + ", ".join(f"{m} {ft[m][s]['mean']:.2g}" for m in others))
    return f"{'; '.join(parts)} ({summary['steps']} steps, β = {summary['beta']:g})"


def _setup(summary: dict) -> str:
    cfg = summary["config"]
    overrides = cfg.get("env_overrides") or {}
    env = cfg["env"] + (f" ({', '.join(f'{k}={v}' for k, v in overrides.items())})" if overrides else "")
    policy = POLICY_WORDS.get(summary.get("policy", "prefix"), summary.get("policy", "prefix"))
    return (f"**Setup.** `{env}`, a {policy} policy, β = {cfg['beta']:g}. Every method starts at π_ref and takes "
            f"{cfg['steps']} Adam steps (lr {cfg['lr']:g}, {cfg.get('schedule', 'constant')}) on "
            f"{cfg['groups_per_step']} groups of k = {cfg['group_size']} responses per step; {len(summary['seeds'])} "
            f"seeds, each with its own π_ref and samples. Truth: π* = π_ref exp(R/β)/Z by enumeration; "
            f"TV(π_ref, π*) = {summary['tv_at_start']:.2f} at the start.")


def _final_table(ft: dict, samplers: list) -> list[str]:
    lines = ["| method | " + " | ".join(SAMPLER_LABELS.get(s, s) for s in samplers) + " |",
             "|---|" + "---:|" * len(samplers)]
    best = {s: min(ft, key=lambda m: ft[m][s]["mean"]) for s in samplers}
    for m in ft:
        cells = [(f"**{_fmt(ft[m][s])}**" if best[s] == m else _fmt(ft[m][s])) for s in samplers]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return lines


def _gvpo_verdict(summary: dict, samplers: list) -> str:
    g, start, steps = summary["final_tv"]["gvpo"], summary["tv_at_start"], summary["steps"]
    worst_hi, worst = max(g[s]["hi"] for s in samplers), max(g[s]["mean"] for s in samplers)
    if worst_hi < REACHED_TV:
        return (f"- **GVPO lands on π* whichever distribution the groups came from** (upper interval bound "
                f"{worst_hi:.3f} over all samplers), with no importance weights: Theorems 1 and 2.")
    if all(g[s]["mean"] < start for s in samplers):
        return (f"- **GVPO moves toward π* from every sampler but has not reached it in {steps} steps**: its final TV "
                f"is at most {worst:.3f} (upper interval bound {worst_hi:.3f}), down from {start:.2f}; an upper bound "
                f"below {REACHED_TV:g} would count as reached. More steps would tell whether it gets there.")
    return (f"- **GVPO does not approach π* from every sampler**: its final TV reaches {worst:.3f} against "
            f"{start:.2f} at the start.")


def _alternatives(ft: dict, samplers: list) -> list[str]:
    lines, others = [], [m for m in ft if m != "gvpo"]
    for s in [s for s in samplers if s != "on_policy"]:
        g = ft["gvpo"][s]["mean"]
        text = ", ".join(f"{m} {ft[m][s]['mean']:.3f} ({ft[m][s]['mean'] / max(g, 1e-12):.2g}× GVPO's)" for m in others)
        lines.append(f"- From {SAMPLER_WORDS.get(s, s)} samples the alternatives end at {text}.")
    return lines if others else []


def _on_policy(ft: dict) -> str:
    on = {m: ft[m]["on_policy"] for m in ft}
    means = [e["mean"] for e in on.values()]
    overlap = max(e["lo"] for e in on.values()) <= min(e["hi"] for e in on.values())
    return (f"- On-policy every importance ratio is 1, so every method is REINFORCE on the KL-regularised reward up to "
            f"constants; they end at TV {min(means):.3f} to {max(means):.3f}"
            + (" (their intervals overlap)." if overlap and len(on) > 1 else "."))


def answer(summary: dict) -> str:
    """Markdown: setup, final TV(pi, pi*) per method and sampler with intervals over seeds (lowest in bold), and the
    verdicts: whether GVPO reached pi* from every sampler, where the alternatives end, the on-policy case."""
    ft = summary["final_tv"]
    samplers = list(next(iter(ft.values())))
    lines = [_setup(summary), "", "**Final TV(π, π*)**, mean over seeds [95% bootstrap interval]; 0 is the optimum, "
             "lowest per sampler in bold:", "", *_final_table(ft, samplers), ""]
    if "gvpo" in ft:
        lines += [_gvpo_verdict(summary, samplers), *_alternatives(ft, samplers)]
    if "on_policy" in samplers:
        lines.append(_on_policy(ft))
    return "\n".join(lines).replace("π*", "π\\*")  # a bare * would open emphasis in markdown


# ---- figures ------------------------------------------------------------------------------------------------

def _plain_log_y(ax) -> None:
    """Log y with plain-number tick labels (0.01, 0.2); minor ticks labelled too when the data span < 1 decade.

    Call after plotting (it reads the autoscaled limits)."""
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    lo, hi = ax.get_ylim()
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain if hi / lo < 10 else NullFormatter())


def final_tv_figure(summary: dict) -> Figure:
    """Final TV(pi, pi*) per sampler (x) and method (markers): the summary's mean over seeds with its bootstrap
    interval, and each seed (faint dots); log y."""
    ft = summary["final_tv"]
    methods, samplers = list(ft), list(next(iter(ft.values())))
    fig = Figure(figsize=(9, 4.2), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        for i, s in enumerate(samplers):
            e, xpos = ft[m][s], i - 0.4 + width * (j + 0.5)
            ax.errorbar([xpos], [e["mean"]], yerr=[[e["mean"] - e["lo"]], [e["hi"] - e["mean"]]], fmt="o", ms=7,
                        color=color(m), capsize=4, label=m if i == 0 else None)
            ax.scatter(np.full(len(e["per_seed"]), xpos), e["per_seed"], s=10, color=color(m), alpha=0.35, zorder=1)
    ax.set_xticks(range(len(samplers)), [SAMPLER_LABELS.get(s, s) for s in samplers])
    _plain_log_y(ax)
    ax.set_ylabel("final TV(π, π*)  (log scale)")
    ax.set_xlabel("where the sampled groups came from")
    ax.grid(True, axis="y", alpha=0.3, which="both")
    ax.legend(title="method", loc="best", fontsize=9)
    ax.set_title("Distance to the KL-constrained optimum after training (dots: seeds; bars: 95% interval)")
    return fig


def tv_curves_figure(results: pd.DataFrame, metric: str = "tv") -> Figure:
    """TV(pi, pi*) (or KL) against Adam steps, one panel per sampler: median over seeds, band min to max; log y."""
    rows = results[results["metric"] == metric]
    methods, samplers = methods_of(results), samplers_of(results)
    fig = Figure(figsize=(4.2 * len(samplers), 3.8), layout="constrained")
    axes = fig.subplots(1, len(samplers), sharey=True, squeeze=False)[0]
    for ax, s in zip(axes, samplers):
        for m in methods:
            wide = rows[(rows["method"] == m) & (rows["sampler"] == s)].pivot(index="step", columns="seed",
                                                                              values="value")
            ax.plot(wide.index, wide.median(axis=1), color=color(m), label=m, lw=1.6)
            ax.fill_between(wide.index, wide.min(axis=1), wide.max(axis=1), color=color(m), alpha=0.15, lw=0)
        ax.set_title(SAMPLER_LABELS.get(s, s))
        ax.set_xlabel("Adam step")
        ax.grid(True, alpha=0.3, which="both")
    for ax in axes:  # after every panel is drawn: the y limits are shared
        _plain_log_y(ax)
    axes[0].set_ylabel("TV(π, π*)" if metric == "tv" else "KL(π ‖ π*)")
    axes[-1].legend(title="method", fontsize=9, loc="lower left")
    return fig


def distribution_figure(results: pd.DataFrame, prompt: int = 0, top: int = 12, sampler: str | None = None) -> Figure:
    """Learned pi(y|x) against the closed form pi*(y|x) for one prompt (first seed).

    Left: the ``top`` most likely responses under pi*, bars for pi* and pi_ref, one marker per method (trained on
    ``sampler``'s groups; default: the last fixed sampler). Right: every response, learned against pi* (log-log), with
    the diagonal where they agree.
    """
    d = results[(results["metric"] == "prob") & (results["prompt"] == prompt)]
    samplers = samplers_of(results)
    sampler = sampler or ([s for s in samplers if s != "on_policy"] or samplers)[-1]
    opt = d[d["method"] == "pi*"].set_index("response")["value"]
    ref = d[d["method"] == "pi_ref"].set_index("response")["value"]
    order = opt.sort_values(ascending=False).index[:top]
    methods = methods_of(results)
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    ax, ax2 = fig.subplots(1, 2, width_ratios=[1.6, 1])
    xs = np.arange(len(order))
    ax.bar(xs - 0.2, opt[order], width=0.4, color="#444", alpha=0.8, label="π* (closed form)")
    ax.bar(xs + 0.2, ref[order], width=0.4, color="#bbb", label="π_ref (start)")
    for j, m in enumerate(methods):
        learned = d[(d["method"] == m) & (d["sampler"] == sampler)].set_index("response")["value"]
        ax.scatter(xs + (j - (len(methods) - 1) / 2) * 0.12, learned[order], color=color(m), zorder=3, s=28,
                   marker="o", edgecolor="white", linewidth=0.5, label=f"{m} (learned)")
        ax2.scatter(opt[learned.index], learned, color=color(m), s=10, alpha=0.7, label=m)
    ax.set_xticks(xs, list(order), rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("response (tokens), the most likely under π* first")
    ax.set_ylabel(f"probability given prompt {prompt}")
    ax.set_title(f"Learned vs closed form, groups from {SAMPLER_LABELS.get(sampler, sampler)}")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(True, axis="y", alpha=0.3)
    lo = max(float(opt.min()), 1e-12)
    ax2.plot([lo, 1], [lo, 1], color="k", lw=0.8, ls="--")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("π*(y|x)")
    ax2.set_ylabel("learned π(y|x)")
    ax2.set_title("All responses (diagonal: exact agreement)")
    ax2.grid(True, alpha=0.3, which="both")
    return fig
