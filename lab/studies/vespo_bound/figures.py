"""The vespo_bound report's figures: VESPO's kernel, Proposition 3.1's ratio along each staleness knob, the second
moments against their bound, and VESPO against sequence IS per lag.

Colours: estimators take their colour from ``lab.reports.style``; VESPO's two kernels (A >= 0, A < 0) keep one colour
each in every figure of this report, the other kernels of the bound check take ``KERNEL_PALETTE`` in order.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from lab.errors import LabError
from lab.estimators import vespo
from lab.reports.figures import KIND_LABELS, staleness_axis
from lab.reports.style import color
from lab.studies.vespo_bound.bound import bound_rows, kernel_label
from lab.studies.vespo_bound.report import comparison_frame

POS, NEG = (vespo.K_POS, vespo.LAMBDA_POS), (vespo.K_NEG, vespo.LAMBDA_NEG)  # VESPO's kernels for A >= 0, A < 0
SIGN_COLORS = {POS: color("vespo"), NEG: "#6a3d9a"}
KERNEL_PALETTE = ["#2ca02c", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#ff7f0e", "#d62728"]


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
    comp = comparison_frame(summary)
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
