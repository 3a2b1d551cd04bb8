"""What the real_model_variance report says (from the study's summary) and its figures (from the tidy results)."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from lab.reports.style import color, interval, table

LABELS = {"transformer": "transformer", "tabular": "tabular (same π₀)"}


def _max_lag(summary: dict) -> str:
    return f"{max(summary['lags']):g}"


def headline(summary: dict) -> str:
    f, lag = summary["findings"], _max_lag(summary)
    parts = []
    exact = f.get("seq_is_exactly_unbiased")
    if exact:
        parts.append("sequence IS exactly unbiased on the transformer and the table at every lag" if exact["holds"]
                     else f"sequence IS NOT exactly unbiased (max relative bias {exact['max_rel_bias']:.2g})")
    best = f["lowest_mse_at_max_lag"]
    T = max(summary["lengths"])
    for model in ("transformer", "tabular"):
        b = best.get(f"{model}/T={T}")
        if b:
            parts.append(f"lag {lag}, T={T}: lowest MSE {model} {b['estimator']} {b['rel_mse'][0]:.3g}×‖∇J‖²")
    return "; ".join(parts)


def answer(summary: dict) -> str:
    """Markdown: the setup, whether sequence IS stays unbiased, and the estimators' MSE per length and model."""
    lag, f = _max_lag(summary), summary["findings"]
    cells = summary["cells"]
    params = {c["model"]: c["parameters"] for c in cells.values()}
    lines = [f"**Setup.** Task `{summary['env']}` ({summary['task']}), response lengths "
             f"{', '.join(map(str, summary['lengths']))}; a `{summary['model_size']}` transformer "
             f"({params.get('transformer', 0):,} parameters) warm-started to exact-match accuracy "
             f"{summary['warm_start']:g}" + (f", and a prefix-tree table ({params['tabular']:,} parameters) holding "
                                             f"exactly the same π₀" if "tabular" in params else "")
             + f". Lags {', '.join(f'{v:g}' for v in summary['lags'])} Adam steps on the exact objective; "
             f"{summary['replicates']} replicate batches, `{summary['advantage']}` advantages. Truth: ∇J by "
             f"enumerating every response.", ""]
    exact, sampled = f.get("seq_is_exactly_unbiased"), f.get("seq_is_sampled_bias_covers_zero")
    if exact:
        lines.append(("- **Sequence IS stays exactly unbiased on the transformer**, as on the table: its expected "
                      f"gradient (advantage R, by enumeration) misses ∇J by at most {exact['max_rel_bias']:.1e} of its "
                      "norm (float64 rounding) at every lag and length." if exact["holds"] else
                      f"- **Sequence IS is NOT exactly unbiased here**: relative bias up to {exact['max_rel_bias']:.2g} "
                      "(the |log W| ≤ 20 clamp binds, or the reference is not exact)."))
    if sampled:
        lines.append(f"- Sampled check: the 95% interval of sequence IS's squared bias covers 0 in "
                     f"{sampled['covered']} of {sampled['settings']} settings (about 5% misses are expected).")
    for T in summary["lengths"]:
        agree = f["agree"].get(str(T))
        picks = {m: f["lowest_mse_at_max_lag"].get(f"{m}/T={T}") for m in ("transformer", "tabular")}
        said = "; ".join(f"{m}: **{p['estimator']}** {interval(*p['rel_mse'])}"
                         + ("" if p["beats_zero_update"] else " (not clearly below a zero update's 1)")
                         for m, p in picks.items() if p)
        if said:
            verdict = "" if agree is None else (" The two agree." if agree else
                                               " **They disagree**: the toy's ranking does not carry over here.")
            lines.append(f"- T = {T}, lag {lag}: lowest MSE ÷ ‖∇J‖² — {said}.{verdict}")
    return "\n".join(lines)


def mse_table(summary: dict):
    """Estimators as rows; per (length, model) the MSE ÷ ‖∇J‖² at the largest lag [95% interval], lowest starred."""
    lag = _max_lag(summary)
    rows, marks = {}, {}
    cols = []
    for key, cell in summary["cells"].items():
        col = f"T={cell['length']} {LABELS[cell['model']]}"
        cols.append(col)
        ests = cell["per_lag"][lag]["estimators"]
        best = min(ests, key=lambda e: ests[e]["rel_mse"][0])
        for e, v in ests.items():
            rows.setdefault(e, {"estimator": e})[col] = ("★ " if e == best else "") + interval(*v["rel_mse"])
    df = pd.DataFrame(list(rows.values()), columns=["estimator", *cols])
    for i, e in enumerate(df["estimator"]):
        marks[i] = [c for c in cols if str(df.loc[i, c]).startswith("★")]
    return table(df, f"MSE ÷ ‖∇J‖² at lag {lag} (★ lowest per column; [95% bootstrap interval]); a zero update scores "
                     f"1.", marks)


def _panel(results: pd.DataFrame, metric: str, ylabel: str, title: str) -> Figure:
    """One panel per (response length, model), one line per estimator, against the achieved KL(mu||pi) per token:
    the same lag is a different divergence for the two parameterisations, so they are compared at equal KL."""
    lengths = sorted(results["length"].unique())
    models = [m for m in ("transformer", "tabular") if m in set(results["model"])]
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
