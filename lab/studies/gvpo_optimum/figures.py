"""The gvpo_optimum report's figures: the final distance to pi* per sampler and method, the distance along training,
and the learned distribution against the closed form. Methods take their estimator's colour from
``lab.reports.style``."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

from lab.reports.style import color
from lab.studies.gvpo_optimum.report import SAMPLER_LABELS, summary_of
from lab.studies.gvpo_optimum.study import methods_of, samplers_of


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
    ft = summary_of(summary).final_tv
    methods, samplers = list(ft), list(next(iter(ft.values())))
    fig = Figure(figsize=(9, 4.2), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        for i, s in enumerate(samplers):
            e, xpos = ft[m][s], i - 0.4 + width * (j + 0.5)
            ax.errorbar([xpos], [e.mean], yerr=[[e.mean - e.lo], [e.hi - e.mean]], fmt="o", ms=7, color=color(m),
                        capsize=4, label=m if i == 0 else None)
            ax.scatter(np.full(len(e.per_seed), xpos), e.per_seed, s=10, color=color(m), alpha=0.35, zorder=1)
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
