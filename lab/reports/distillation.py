"""What the opd_variance report says and draws: answer text and table from the distillation study's summary alone,
figures from its tidy results table (``lab.studies.distillation``)."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator

from lab.reports.style import color, interval, table
from lab.studies.distillation import TARGETS, labels, lookup

_NAMES = {"opd": "OPD", "opd_rtg": "OPD (reward-to-go)", "vopd": "vOPD", "kl_full": "full-vocab KL"}


def pretty(label: str) -> str:
    """Display name of a variant label (vopd_top8 -> "vOPD top-8")."""
    if label in _NAMES:
        return _NAMES[label]
    if label.startswith("vopd_top"):
        return f"vOPD top-{label[8:]}"
    if label.startswith("kl_top"):
        return f"top-{label[6:]} KL"
    return label


def _fmt(r: dict | None, fmt: str = "{:.3g}") -> str:
    return interval(r["value"], r["lo"], r["hi"], fmt) if r else "–"


def _unbiased(summary: dict, label: str, target: str = "per_token") -> bool:
    return target in summary["bias"][label]["unbiased_for"]


def _by_k(summary: dict, prefix: str) -> list[str]:
    """Variant labels with ``prefix`` (vopd_top, kl_top), by top-k size."""
    return sorted((lab for lab in summary["variants"] if lab.startswith(prefix)),
                  key=lambda lab: summary["variants"][lab]["k"])


# ---- text -----------------------------------------------------------------------------------------------------------

def headline(summary: dict) -> str:
    """One line: vOPD's variance reduction, the smallest top-k baseline keeping 90% of it, the top-k KL loss's bias."""
    parts = []
    red = summary["variance_reduction"]
    full = red.get("vopd")
    if full:
        verb = "cuts vanilla OPD's gradient variance by a factor" if full["value"] > 1 else \
            "does not cut vanilla OPD's gradient variance: factor"
        parts.append(f"vOPD {verb} {_fmt(full, '{:.2g}')}" + (" at no bias" if _unbiased(summary, "vopd") else ""))
    tops = _by_k(summary, "vopd_top")
    if tops and full and full["value"] > 1:
        good = [t for t in tops if summary["variants"][t].get("kept_share", 0) >= 0.9]
        t = good[0] if good else tops[-1]
        parts.append(f"a top-{summary['variants'][t]['k']} baseline keeps {red[t]['value']:.2g}x")
    kl_tops = _by_k(summary, "kl_top")
    if kl_tops:
        b = summary["bias"][kl_tops[-1]]["per_token"]["exact_rel_bias"]
        parts.append(f"the top-{summary['variants'][kl_tops[-1]]['k']} KL loss is {b:.0%} biased")
    return "; ".join(parts) if parts else "distillation variance study"


def _setup(summary: dict) -> str:
    cfg = summary["config"]
    sampled = (f", sampled from the student {cfg['behaviour_lag']} steps stale" if cfg["behaviour_lag"]
               else ", on-policy")
    return (f"**Setup.** `{summary['env']}` with V = {summary['vocab_size']}, T = {summary['length']}; a "
            f"`{cfg['policy']}` student and a `{cfg['teacher']}` teacher, KL(π_S‖π_T) = {summary['kl_seq']:.3g} nats "
            f"per response ({summary['kl_token']:.3g} per token); {cfg['replicates']} replicate batches of "
            f"{cfg['batch_size']} responses{sampled}, `{cfg['loss_agg_mode']}`.")


def _vopd_vs_opd(summary: dict) -> str | None:
    r = summary["variance_reduction"].get("vopd")
    if not r:
        return None
    verdict = "beats" if r["lo"] > 1 else ("does not beat" if r["hi"] < 1 else "is not distinguishable from")
    if _unbiased(summary, "vopd"):
        like = ", like OPD's" if "opd" in summary["bias"] and _unbiased(summary, "opd") else ""
        bias_note = f"with no bias (its exact expectation is the per-token target{like})"
    else:
        stale = " (the batches are off-policy)" if summary["config"]["behaviour_lag"] else ""
        bias_note = (f"but its exact expectation misses the per-token target by "
                     f"{summary['bias']['vopd']['per_token']['exact_rel_bias']:.0%}{stale}")
    return (f"- **vOPD {verdict} vanilla OPD**: the closed-form baseline divides the gradient variance by "
            f"**{_fmt(r, '{:.2f}')}**, {bias_note}.")


def _vopd_vs_full(summary: dict) -> str | None:
    r = summary["variance_vs_kl_full"].get("vopd")
    if not r:
        return None
    rm_v = summary["bias"]["vopd"]["per_token"]["rel_mse"]["value"]
    rm_f = summary["bias"]["kl_full"]["per_token"]["rel_mse"]["value"]
    verdict = "is noisier than" if r["lo"] > 1 else "is less noisy than" if r["hi"] < 1 else "matches"
    return (f"- **Per batch, vOPD {verdict} full-vocabulary KL**: its variance is {_fmt(r)}× full KL's (MSE ÷ "
            f"‖target‖² {rm_v:.3g} vs {rm_f:.3g}). Full KL removes the sampled token's noise entirely, at O(V) cost "
            f"per token; what it keeps is the noise of which states a batch visits. (The paper's \"matches\" is "
            f"about accuracy after training, which this report does not measure.)")


def _topk_baselines(summary: dict) -> str | None:
    red, tops = summary["variance_reduction"], _by_k(summary, "vopd_top")
    if not tops or "vopd" not in red:
        return None
    keep = "; ".join(f"top-{red[t]['k']}: {_fmt(red[t], '{:.2f}')}×"
                     + (f" ({summary['variants'][t]['kept_share']:.0%})" if "kept_share" in summary["variants"][t]
                        else "") for t in tops)
    biased = [pretty(t) for t in tops if not _unbiased(summary, t)]
    tail = ("Every k is unbiased here (exact): a baseline only moves the variance." if not biased else
            f"Biased for the per-token target here: {', '.join(biased)}.")
    return (f"- **Top-k baselines** (Var(OPD) ÷ Var, and in brackets the share of the variance the full baseline "
            f"removes that they remove): {keep}. {tail}")


def _bias_line(summary: dict) -> str:
    labs = list(summary["bias"])
    per_tok = [pretty(lab) for lab in labs if _unbiased(summary, lab, "per_token")]
    seq = [pretty(lab) for lab in labs if _unbiased(summary, lab, "sequence")]
    neither = [pretty(lab) for lab in labs if not summary["bias"][lab]["unbiased_for"]]
    return (f"- **Bias (exact, by enumeration).** Unbiased for the per-token target: {', '.join(per_tok) or 'none'}. "
            f"Unbiased for the sequence-level target: {', '.join(seq) or 'none'}."
            + (f" Biased for both: {', '.join(neither)}." if neither else ""))


def _kl_topk_line(summary: dict) -> str | None:
    kl_tops = _by_k(summary, "kl_top")
    if not kl_tops:
        return None
    b = ", ".join(f"top-{summary['variants'][t]['k']}: {summary['bias'][t]['per_token']['exact_rel_bias']:.0%}"
                  for t in kl_tops)
    return f"- **Top-k KL losses are biased** (‖E g − target‖ ÷ ‖target‖, per-token target): {b}."


def answer(summary: dict) -> str:
    """Markdown: does vOPD beat vanilla OPD, does it match full-vocabulary KL, what top-k keeps, who is biased."""
    lines = [_setup(summary), ""]
    lines += [x for x in (_vopd_vs_opd(summary), _vopd_vs_full(summary), _topk_baselines(summary)) if x]
    lines.append(_bias_line(summary))
    lines += [x for x in (_kl_topk_line(summary),) if x]
    lines.append(f"- The two targets differ by {summary['targets_rel_gap']:.0%} of the sequence-level gradient "
                 f"(cosine {summary['targets_cos']:.2f}): immediate-reward OPD drops the reward-to-go term.")
    return "\n".join(lines)


def results_table(summary: dict):
    """One row per estimator variant: exact relative bias against both targets, variance, variance reduction, MSE."""
    rows = []
    for lab, entry in summary["variants"].items():
        bias = summary["bias"][lab]
        rows.append({
            "estimator": pretty(lab),
            "bias vs per-token (exact)": f"{bias['per_token']['exact_rel_bias']:.1%}",
            "bias vs sequence (exact)": f"{bias['sequence']['exact_rel_bias']:.1%}",
            "variance ÷ ‖g_tok‖²": _fmt(entry["rel_variance"]),
            "Var(OPD) ÷ Var": _fmt(entry["variance_reduction"], "{:.2f}"),
            "MSE ÷ ‖g_tok‖²": _fmt(bias["per_token"]["rel_mse"]),
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


# ---- where does the baseline help? ------------------------------------------------------------------------------------

def grid_answer(grid: dict) -> str:
    """Where vOPD's baseline lowers the variance, where it raises it, from ``reduction_grid``'s summary."""
    cells = grid["cells"]
    fmt = lambda c: (f"T = {c['length']}, V = {c['vocab_size']}, KL {c['kl_token']:.2g}/token: "  # noqa: E731
                     f"{interval(c['ratio'], c['lo'], c['hi'])}")
    hurts = [c for c in cells if c["verdict"] == "hurts"]
    helps = [c for c in cells if c["verdict"] == "helps"]
    lines = [f"Var(OPD) ÷ Var(vOPD) in {len(cells)} settings (responses of {', '.join(map(str, grid['lengths']))} "
             f"tokens, a perturbed teacher, {grid['replicates']} replicate batches each; above 1 the baseline "
             f"helps):", ""]
    if hurts:
        lines.append(f"- **The baseline raises the variance** in {len(hurts)} setting(s): " + "; ".join(map(fmt, hurts))
                     + ". Subtracting the state value −KL_t is unbiased, but it only lowers the variance when the "
                       "centred reward is less correlated with the score ∇log π(y_t) than the raw one; with a "
                       "handful of tokens the cross term can dominate.")
    if helps:
        best = max(helps, key=lambda c: c["ratio"])
        lines.append(f"- **It lowers the variance** in {len(helps)} setting(s), most at {fmt(best)}.")
    if grid["unresolved"]:
        lines.append(f"- Not resolved (the interval contains 1) in {grid['unresolved']} setting(s).")
    return "\n".join(lines)


def grid_figure(grid: pd.DataFrame) -> Figure:
    """Var(OPD) ÷ Var(vOPD) against vocabulary size, one panel per response length, one line per teacher
    perturbation (labelled by its KL per token), with 95% intervals."""
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
