"""What the vespo_bound report shows: its answer text from the summary alone, its figures and its table.

Colours: estimators take their colour from ``lab.reports.style``; VESPO's two kernels (A >= 0, A < 0) keep one colour
each in every figure of this report, the other kernels of the bound check take ``KERNEL_PALETTE`` in order.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from lab.errors import LabError
from lab.estimators import vespo
from lab.reports.figures import KIND_LABELS, staleness_axis
from lab.reports.style import color, interval, table
from lab.studies.vespo_bound import bound_rows, kernel_label

POS, NEG = (vespo.K_POS, vespo.LAMBDA_POS), (vespo.K_NEG, vespo.LAMBDA_NEG)  # VESPO's kernels for A >= 0, A < 0
SIGN_COLORS = {POS: color("vespo"), NEG: "#6a3d9a"}
KERNEL_PALETTE = ["#2ca02c", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#ff7f0e", "#d62728"]
NOTABLE_BIAS = 0.05  # an exact bias above 5% of ‖∇J‖ is worth a sentence
SAME_DIRECTION = 0.95  # cos(E g, ∇J) at or above this: the bias is a step size, not a direction
NEAR_ZERO_UPDATE = 0.9  # MSE ÷ ‖∇J‖² above this is close to a zero update's 1


def _num(v) -> float:
    """A summary number (None in summary.json for NaN or inf) as a float."""
    return math.nan if v is None else float(v)


def _lags(xs) -> str:
    return ", ".join(f"{x:g}" for x in xs) or "none"


# ---- text ---------------------------------------------------------------------------------------------------

def headline(summary: dict) -> str:
    """One line for the gallery: whether the bound held, and VESPO's and sequence IS's MSE at the largest lag."""
    if summary["violations"]:
        return (f"Prop. 3.1 VIOLATED in {summary['violations']} of {summary['settings_checked']} settings "
                f"(max E[φ²]/(ZKC) = {summary['max_bound_ratio']:.3f})")
    last = summary["per_lag"][f"{summary['max_lag']:g}"]
    return (f"Prop. 3.1 never violated ({summary['violations']} of {summary['settings_checked']} exact settings; max "
            f"E[φ²]/(ZKC) = {summary['max_bound_ratio']:.3f}); lag {summary['max_lag']:g}: MSE÷‖∇J‖² VESPO "
            f"{last['vespo_rel_mse'][0]:.3g} vs seq IS {last['seq_is_rel_mse'][0]:.3g}")


def _bounded(summary: dict) -> dict:
    """Kernels with a finite K (those the bound applies to)."""
    return {label: v for label, v in summary["per_kernel"].items() if v["max_ratio"] is not None}


def _violation_answer(summary: dict) -> str:
    n, v = summary["settings_checked"], summary["violations"]
    scope = (f"({len(_bounded(summary))} kernels with finite K × staleness knobs "
             f"{', '.join(summary['staleness_kinds'])} × {summary['bound_seeds']} random "
             f"{'policy' if summary['bound_seeds'] == 1 else 'policies'}), computed by "
             f"enumerating every response in float64 with the estimator's own clamps.")
    if v == 0:
        return f"**Is the bound ever violated?** **No.** E_μ[φ(W)²] ≤ Z·K·C held in all {n} exact settings {scope}"
    return (f"**Is the bound ever violated?** **Yes, {v} {'time' if v == 1 else 'times'}.** E_μ[φ(W)²] exceeded "
            f"Z·K·C in {v} of {n} exact settings {scope}")


def _tightness_answer(summary: dict) -> str:
    t = summary["tightest"]
    text = (f"**How tight is it?** The largest ratio E_μ[φ²]/(ZKC) is **{summary['max_bound_ratio']:.4f}** "
            f"({t['kernel']}, {t['staleness_kind']} = {t['staleness']:g})")
    if summary.get("max_bound_ratio_off_policy") is not None:
        text += f"; off-policy (KL(μ‖π) > 0) it is {summary['max_bound_ratio_off_policy']:.4f}"
    text += (". The bound is tight only where μ puts its mass where φ(w)/w peaks, w = (k−1)/λ; on-policy every "
             "weight is W = 1 and the ratio is 1/K.")
    at_one = [label for label, v in _bounded(summary).items() if math.isclose(_num(v["peak_w"]), 1.0)]
    if at_one:
        text += (f" For {' and '.join(at_one)} the peak is at w = 1: the bound is an equality on-policy and loosens "
                 f"as μ drifts.")
    if summary["max_floor_mass"] > 0:
        text += (f" Up to {summary['max_floor_mass']:.2g} of μ's mass has log W below log 10⁻⁸, where the authors' "
                 f"floor lifts φ(w)/w above K for k = 1.")
    return text


def _kernel_table(summary: dict) -> list[str]:
    lines = ["| kernel | K | φ(w)/w peaks at w | on-policy ratio 1/K | largest ratio | median ratio |",
             "|---|---|---|---|---|---|"]
    for label, v in summary["per_kernel"].items():
        if v["max_ratio"] is None:
            lines.append(f"| {label} | ∞ | – | – | no bound (k < 1) | – |")
        else:
            peak = f"{v['peak_w']:.3g}" if v["k"] > 1 else "→ 0"  # k = 1: the supremum is approached at 0
            lines.append(f"| {label} | {_num(v['K']):.4g} | {peak} | {_num(v['on_policy_ratio']):.3f} "
                         f"| {v['max_ratio']:.4f} | {v['median_ratio']:.3f} |")
    return lines


def per_lag(summary: dict) -> pd.DataFrame:
    """The summary's per-lag comparison as a frame: one row per lag, [v, lo, hi] entries split into v, _lo, _hi."""
    rows = []
    for lag, entry in summary["per_lag"].items():
        row = {"lag": float(lag)}
        for key, v in entry.items():
            if isinstance(v, list):
                row[key], row[f"{key}_lo"], row[f"{key}_hi"] = (_num(x) for x in v)
            else:
                row[key] = v if isinstance(v, str) else _num(v)
        rows.append(row)
    return pd.DataFrame(rows)


def _verdict_lines(comp: pd.DataFrame) -> list[str]:
    lags = {v: comp.loc[comp["verdict"] == v, "lag"].tolist() for v in ("VESPO lower", "seq IS lower", "unresolved")}
    on = comp.loc[comp["kl_token"] == 0, "lag"].tolist()
    last = comp.iloc[-1]

    def iv(e):
        return interval(last[f"{e}_rel_mse"], last[f"{e}_rel_mse_lo"], last[f"{e}_rel_mse_hi"])

    return [f"- VESPO lower at lags **{_lags(lags['VESPO lower'])}**; sequence IS lower at lags "
            f"**{_lags(lags['seq IS lower'])}**; not resolved at lags {_lags(lags['unresolved'])}"
            + (f" (lag {_lags(on)} is on-policy: both are REINFORCE)." if on else "."),
            f"- At lag {last['lag']:g} (KL(μ‖π) {last['kl_token']:.2g} nats/token, ESS {last['ess_frac']:.0%}): "
            f"VESPO {iv('vespo')} against sequence IS {iv('seq_is')}."]


def _bias_lines(comp: pd.DataFrame) -> list[str]:
    c = comp.set_index("lag")
    misses = ", ".join(f"{v:.0%}" for v in c["vespo_exact_bias"])
    seq = f"sequence IS by {c['seq_is_exact_bias'].abs().max():.0%} (unbiased up to the |log W| ≤ 20 clamp)."
    if c["vespo_exact_bias"].max() <= NOTABLE_BIAS:
        return [f"- **VESPO's bias is small here.** Its exact expected gradient (advantage = R) misses ∇J by {misses} "
                f"of its norm at lags {_lags(c.index)}; {seq}"]
    lines = [f"- **The price is bias.** VESPO's exact expected gradient (advantage = R) misses ∇J by {misses} of its "
             f"norm at lags {_lags(c.index)}; {seq}"]
    mid = c[c["vespo_exact_bias"] > NOTABLE_BIAS]
    if "vespo_exact_cos" in c:
        cos = mid["vespo_exact_cos"]
        start = ("**Mostly a shorter step, not a wrong direction**" if (cos.dropna() >= SAME_DIRECTION).all()
                 else "**Direction and step size**")
        lines.append(f"- {start}: where the bias exceeds {NOTABLE_BIAS:.0%} (lags {_lags(mid.index)}) cos(E g, ∇J) = "
                     + ", ".join("undefined" if np.isnan(v) else f"{v:.2f}" for v in cos)
                     + " and ‖E g‖ ÷ ‖∇J‖ = " + ", ".join(f"{v:.2g}" for v in mid["vespo_exact_size"]) + ".")
        if (mid["vespo_exact_size"] == 0).any():
            lines[-1] += (" A size of 0 means φ(W) underflows to 0 for every response with a nonzero reward: VESPO's "
                          "expected update vanishes.")
    return lines


def _zero_update_line(comp: pd.DataFrame) -> list[str]:
    last = comp.iloc[-1]
    if last["vespo_rel_mse"] <= NEAR_ZERO_UPDATE:
        return []
    text = f"- **At lag {last['lag']:g} VESPO's MSE is close to 1, the MSE of a zero update**"
    size = last.get("vespo_exact_size", math.nan)
    if np.isfinite(size) and size < 0.1:
        text += (f": its expected update is {size:.2g} of ∇J's length, because φ shrinks the responses that carry the "
                 f"gradient. It is stable because it barely moves, not because it finds ∇J.")
    return [text + ("" if text.endswith(".") else ".")]


def answer(summary: dict) -> str:
    """The report's at-a-glance markdown: the bound's verdict and tightness, the kernels, VESPO against sequence IS."""
    comp = per_lag(summary)
    lines = [_violation_answer(summary), "", _tightness_answer(summary), "", *_kernel_table(summary), "",
             "**Where does VESPO beat sequence IS?** MSE ÷ ‖∇J‖² on the same batches, lower where the 95% intervals "
             "do not overlap (details in the table below):", "", *_verdict_lines(comp)]
    if "vespo_exact_bias" in comp:
        lines += _bias_lines(comp)
    return "\n".join(lines + _zero_update_line(comp))


def comparison_table(summary: dict):
    """Per lag: KL, ESS, MSE ÷ ‖∇J‖² of VESPO and sequence IS with intervals (the lower one marked where the intervals
    do not overlap), VESPO's exact bias, the verdict."""
    comp = per_lag(summary)
    rows, marks = [], {}
    for i, r in comp.iterrows():
        row = {"lag": f"{r['lag']:g}", "KL(μ‖π)/token": f"{r['kl_token']:.2g}", "ESS": f"{r['ess_frac']:.0%}"}
        for e, name in (("vespo", "VESPO"), ("seq_is", "seq IS")):
            row[f"{name} MSE"] = interval(r[f"{e}_rel_mse"], r[f"{e}_rel_mse_lo"], r[f"{e}_rel_mse_hi"])
        if "vespo_exact_bias" in comp:
            row["VESPO exact bias"] = f"{r['vespo_exact_bias']:.0%}"
        row["verdict"] = r["verdict"]
        rows.append(row)
        marks[i] = {"VESPO lower": ["VESPO MSE"], "seq IS lower": ["seq IS MSE"]}.get(r["verdict"], [])
    return table(pd.DataFrame(rows), "MSE ÷ ‖∇J‖² [95% bootstrap interval]; verdict: the lower MSE where the intervals "
                                     "do not overlap. Exact bias: ‖E_μ g − ∇J‖ ÷ ‖∇J‖ with advantage = R.", marks)


# ---- figures ------------------------------------------------------------------------------------------------

def _kernel_color(k: float, lam: float, others: list) -> str:
    if (k, lam) in SIGN_COLORS:
        return SIGN_COLORS[(k, lam)]
    return KERNEL_PALETTE[others.index((k, lam)) % len(KERNEL_PALETTE)]


def _kernel_panel(ax, w, k, lam, c, sign, dx) -> None:
    K, wm, ws = vespo.bound_constant(k, lam), vespo.argmax_phi(k, lam), vespo.argmax_bound(k, lam)
    top = vespo.phi_max(k, lam)
    ax.plot(w, vespo.phi(w, k, lam), color=c, lw=2, label=f"φ for {sign}: {kernel_label(k, lam)}")
    ax.plot(w, K * w, color=c, ls="--", lw=1, label=f"K·W, K = {K:.3g}")
    ax.plot([wm], [top], "o", color=c, ms=6)
    ax.annotate(f"max {top:.3f}\nat W = {wm:.2g}", (wm, top), textcoords="offset points", xytext=(dx, 7),
                fontsize=8, color=c, ha="right" if dx < 0 else "left")
    ax.plot([ws], [vespo.phi(ws, k, lam)], "s", mfc="white", color=c, ms=6, mew=1.5)


def kernel_figure(pos=POS, neg=NEG) -> Figure:
    """phi(W) for both advantage signs with its maximum and the line K·W that bounds it; log-scale tails against
    IS's W; the surrogates f(W) whose W f'(W) is phi."""
    fig = Figure(figsize=(13, 4.3), layout="constrained")
    axes = fig.subplots(1, 3)
    w, wl = np.linspace(1e-4, 4.0, 800), np.logspace(-4, 3, 600)
    for (k, lam), sign, dx in ((pos, "A ≥ 0", -4), (neg, "A < 0", 4)):
        c = SIGN_COLORS.get((k, lam), KERNEL_PALETTE[0 if sign == "A ≥ 0" else 1])
        _kernel_panel(axes[0], w, k, lam, c, sign, dx)
        axes[1].loglog(wl, np.maximum(vespo.phi(wl, k, lam), 1e-30), color=c, lw=2, label=f"φ for {sign}")
        axes[2].plot(w, vespo.surrogate(w, k, lam), color=c, lw=2, label=f"f for {sign}")
    ax = axes[0]
    ax.axvline(1, color="#999", lw=0.6)
    ax.set_ylim(0, 1.95)
    ax.set_xlabel("sequence weight W = π(y)/μ(y)")
    ax.set_title(r"the kernel $\varphi(W) = W^k\, e^{\lambda(1-W)}$, $\varphi(1) = 1$", fontsize=10.5)
    ax.plot([], [], "o", color="#555", label="maximum, at W = k/λ")
    ax.plot([], [], "s", mfc="white", color="#555", label="φ = K·W, at W = (k−1)/λ")
    ax.legend(frameon=False, fontsize=7.5, loc="upper right")
    ax = axes[1]
    ax.loglog(wl, wl, color=color("seq_is"), lw=1.5, ls=":", label="sequence IS: W")
    ax.set_ylim(1e-12, 1e3)
    ax.set_xlabel("W (log scale)")
    ax.set_title("tails: φ vanishes at both ends, IS's W grows", fontsize=10.5)
    ax.legend(frameon=False, fontsize=8, loc="lower center")
    ax = axes[2]
    ax.plot(w, w, color=color("seq_is"), lw=1.5, ls=":", label="sequence IS: f(W) = W")
    ax.set_xlabel("W")
    ax.set_title(r"surrogate $f$ with $\varphi = W f'(W)$: $e^\lambda \lambda^{-k} \gamma(k, \lambda W)$",
                 fontsize=10.5)
    ax.legend(frameon=False, fontsize=8)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle("VESPO's reshaping kernel: the coefficient on A ∇log π as a function of the sequence weight",
                 fontsize=11)
    return fig


def bound_figure(results: pd.DataFrame) -> Figure:
    """E_mu[phi²] / (Z K C) against each staleness knob of the bound check, one line per kernel with finite K
    (median over random policies, band: min to max). Every point at or below 1 means the bound held."""
    bound = bound_rows(results)
    kinds = [k for k in ("lag", "kl", "temperature") if k in set(bound["staleness_kind"])]
    fig = Figure(figsize=(13, 4.6), layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(kinds), sharey=True))
    finite = bound[np.isfinite(bound["K"])]
    kernels = list(dict.fromkeys(zip(finite["k"], finite["lam"])))
    others = [kl for kl in kernels if kl not in SIGN_COLORS]
    for ax, kind in zip(axes, kinds):
        sub = finite[finite["staleness_kind"] == kind]
        for k, lam in kernels:
            g = sub[(sub["k"] == k) & (sub["lam"] == lam)].groupby("staleness")["ratio"]
            med, c, default = g.median(), _kernel_color(k, lam, others), (k, lam) in SIGN_COLORS
            ax.plot(med.index, med.values, "-o" if default else "-", color=c, ms=4, lw=2.2 if default else 1.1,
                    label=kernel_label(k, lam) + (" (VESPO)" if default else ""))
            ax.fill_between(med.index, g.min().values, g.max().values, color=c, alpha=0.12, lw=0)
        ax.axhline(1.0, color="black", lw=1.2, ls="--")
        ax.text(0.01, 1.0, " bound: ratio = 1", transform=ax.get_yaxis_transform(), va="bottom", fontsize=8)
        staleness_axis(ax, sub["staleness"], kind)
        ax.set_title(KIND_LABELS[kind].split(" (")[0], fontsize=10)
    axes[0].set_ylabel("E_μ[φ(W)²] ÷ (Z·K·C)")
    axes[0].set_ylim(0, max(1.12, 1.05 * float(finite["ratio"].max())))
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=4, frameon=False, fontsize=8.5)
    held = "ratio ≤ 1 everywhere" if (finite["ratio"] <= 1 + 1e-9).all() else "ratio ABOVE 1 somewhere: violated"
    fig.suptitle(f"Proposition 3.1 checked exactly: {held} (1 = tight). Line: median over random policies; "
                 f"band: min–max", fontsize=11)
    return fig


def second_moment_figure(results: pd.DataFrame, kind: str = "lag") -> Figure:
    """Against one staleness knob: sequence IS's E_mu[W²] and, for VESPO's two kernels, E_mu[φ²] with its bound
    Z K C (the bound check's first seed, exact)."""
    bound = bound_rows(results)
    sub = bound[(bound["staleness_kind"] == kind) & (bound["seed"] == bound["seed"].min())]
    if sub.empty:
        raise LabError(f"the bound table has no {kind!r} rows")
    fig = Figure(figsize=(7.5, 4.0), layout="constrained")
    ax = fig.subplots()
    first = sub.drop_duplicates("staleness").sort_values("staleness")
    ax.plot(first["staleness"], first["w2"], "-s", color=color("seq_is"), lw=2, ms=4,
            label="sequence IS: E_μ[W²] = 1 + χ²")
    for (k, lam), c in SIGN_COLORS.items():
        g = sub[(sub["k"] == k) & (sub["lam"] == lam)].sort_values("staleness")
        if g.empty:
            continue
        ax.plot(g["staleness"], g["phi2"], "-o", color=c, lw=2, ms=4, label=f"VESPO E_μ[φ²], {kernel_label(k, lam)}")
        ax.plot(g["staleness"], g["bound"], "--", color=c, lw=1.2, label=f"its bound Z·K·C (K = {g['K'].iloc[0]:.3g})")
    ax.set_yscale("log")
    staleness_axis(ax, sub["staleness"], kind)
    ax.set_ylabel("second moment of the coefficient under μ")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title("Second moments: the weight IS multiplies by, against VESPO's φ and its bound", fontsize=10.5)
    return fig


def _mse_panels(axes, comp: pd.DataFrame, x) -> None:
    for ax, m, title in ((axes[0], "rel_mse", "MSE ÷ ‖∇J‖²"), (axes[1], "variance", "variance tr Cov(g) ÷ ‖∇J‖²")):
        for e, name in (("seq_is", "sequence IS"), ("vespo", "VESPO")):
            ax.plot(x, comp[f"{e}_{m}"], "-o", color=color(e), lw=2, ms=4, label=name)
            ax.fill_between(x, comp[f"{e}_{m}_lo"], comp[f"{e}_{m}_hi"], color=color(e), alpha=0.15, lw=0)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
    axes[0].axhline(1.0, color="black", lw=0.8, ls=":")
    axes[0].text(0.01, 1.0, " a zero update", transform=axes[0].get_yaxis_transform(), va="bottom", fontsize=8)


def _exact_panels(axes, comp: pd.DataFrame, x) -> None:
    ax = axes[0]
    for e in ("seq_is", "vespo", "ppo_clip", "reinforce"):
        if f"{e}_exact_bias" in comp:
            ax.plot(x, comp[f"{e}_exact_bias"], "-o", color=color(e), lw=2 if e in ("vespo", "seq_is") else 1.2, ms=4,
                    label=e)
    ax.set_ylim(-0.03, 1.1)
    ax.set_title("exact bias ‖E_μ g − ∇J‖ ÷ ‖∇J‖", fontsize=10)
    ax.legend(frameon=False, fontsize=8)
    if len(axes) < 2:
        return
    ax = axes[1]
    for e, ls in (("vespo", "-"), ("ppo_clip", "--")):
        if f"{e}_exact_cos" in comp:
            ax.plot(x, comp[f"{e}_exact_cos"], ls, marker="o", color=color(e), lw=1.8, ms=4, label=f"{e}: cos(E g, ∇J)")
            ax.plot(x, comp[f"{e}_exact_size"], ls, marker="s", mfc="white", color=color(e), lw=1.2, ms=4,
                    label=f"{e}: ‖E g‖ ÷ ‖∇J‖")
    ax.set_ylim(-0.05, 1.15)
    ax.set_title("is the bias a direction or a step size?", fontsize=10)
    ax.legend(frameon=False, fontsize=7.5, loc="lower left")


def comparison_figure(summary: dict) -> Figure:
    """VESPO against sequence IS per lag (from the summary): MSE and variance ÷ ‖∇J‖² with 95% intervals; every
    estimator's exact bias ‖E g − ∇J‖ ÷ ‖∇J‖; VESPO's (and PPO clip's) exact expected gradient split into direction
    (cosine) and size (‖E g‖ ÷ ‖∇J‖)."""
    comp = per_lag(summary)
    has_dir = "vespo_exact_cos" in comp
    fig = Figure(figsize=(14, 3.9), layout="constrained")
    axes = fig.subplots(1, 4 if has_dir else 3)
    x = comp["lag"].to_numpy()
    _mse_panels(axes, comp, x)
    _exact_panels(axes[2:], comp, x)
    for ax in axes:
        staleness_axis(ax, x, "lag")
        ax.set_xlabel("lag (optimiser steps)")
    axes[0].legend(frameon=False, fontsize=8)
    fig.suptitle("VESPO against sequence IS as rollouts go stale (shaded: 95% bootstrap interval over batches; "
                 "exact panels: advantage = R, by enumeration)", fontsize=11)
    return fig
