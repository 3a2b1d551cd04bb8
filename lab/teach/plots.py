"""The lessons' matplotlib figures (one function per figure) and how the notebooks show them.

Figures are ``matplotlib.figure.Figure`` objects (no pyplot state). ``show(fig, alt)`` displays one as a PNG at
150 dpi with its alt text: the bundle carries ``image/png`` (galleries, thumbnails) and ``text/html`` with an
``<img alt=...>`` (JupyterLab and the HTML export prefer it), so the alt text travels with the picture. A series
that is an estimator (``ppo_clip``, ``vopd``, ...) takes the lab's colour for it (``lab.reports.style.color``), the
same in every report; other series (settings, samplers, kernels) take ``COLORS`` in order.
"""
from __future__ import annotations

import base64
import html
import io

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from lab.reports.style import color

DPI = 150
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf", "#7f7f7f")
MU, TARGET = "#333333", "#b8860b"  # the behaviour policy mu and a target (pi, pi*) drawn beside an estimator's series


def png_bytes(fig: Figure, dpi: int = DPI, tight: bool = True) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight" if tight else None)
    return buf.getvalue()


def bundle(fig: Figure, alt: str, dpi: int = DPI, tight: bool = True) -> dict:
    """The display bundle of a figure: PNG, an <img> with alt text, and the alt text as plain text."""
    data = base64.b64encode(png_bytes(fig, dpi, tight)).decode()
    img = (f'<img src="data:image/png;base64,{data}" alt="{html.escape(alt, quote=True)}" '
           f'style="max-width:100%;height:auto">')
    return {"image/png": data, "text/html": img, "text/plain": f"[figure] {alt}"}


def show(fig: Figure, alt: str, dpi: int = DPI) -> None:
    """Display ``fig`` in a notebook at ``dpi`` with alt text ``alt``."""
    from IPython.display import display

    display(bundle(fig, alt, dpi), raw=True)


def _fig(ncols: int = 1, nrows: int = 1, width: float = 5.2, height: float = 3.6, fast: bool = False):
    """A figure with a grid of axes. ``fast``: fixed margins instead of constrained layout (live redraws)."""
    fig = Figure(figsize=(width * ncols, height * nrows), layout=None if fast else "constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    if fast:
        fig.subplots_adjust(left=0.1, right=0.98, bottom=0.17, top=0.9, wspace=0.3)
    return fig, axes.ravel()


# ---- 1. sequence weights ---------------------------------------------------------------------------------------

def ess_against_length(table: pd.DataFrame) -> Figure:
    """Population ESS fraction (lines) and the batch's Kish ESS (median, 10-90 % band) against length; PSIS k-hat."""
    fig, (ax, bx) = _fig(2)
    for i, (kl, g) in enumerate(table.groupby("kl_target")):
        c = COLORS[i % len(COLORS)]
        exact = g[g.metric == "ess_frac"]
        ax.plot(exact.length, exact.value, color=c, lw=2, label=f"KL {kl:g}/token: (1 + chi2)^-T")
        batch = g[g.metric == "batch_ess_frac"]
        ax.errorbar(batch.length, batch.value, yerr=[batch.value - batch.lo, batch.hi - batch.value], color=c,
                    fmt="o", ms=4, capsize=2, alpha=0.8)
        kh = g[g.metric == "batch_khat"]
        bx.plot(kh.length, kh.value, "o-", color=c, ms=4, label=f"KL {kl:g}")
    ax.set(xscale="log", yscale="log", xlabel="response length T", ylabel="ESS / batch size",
           title="Population ESS (lines) vs one batch's Kish ESS (dots)")
    ax.set_ylim(max(ax.get_ylim()[0], 1e-14), 1.5)
    ax.legend(fontsize=7, loc="lower left")
    bx.axhline(0.7, color="k", ls="--", lw=1)
    bx.text(1, 0.72, "k-hat 0.7: IS unreliable", fontsize=8, va="bottom")
    bx.set(xscale="log", xlabel="response length T", ylabel="PSIS k-hat (median over batches)",
           title="Pareto k-hat of the batch's weights")
    bx.legend(fontsize=7)
    return fig


def growth_against_length(table: pd.DataFrame) -> Figure:
    """chi2_seq (exponential) and Var(log W) (linear) against length, one line per per-token KL."""
    fig, (ax, bx) = _fig(2)
    for i, (kl, g) in enumerate(table.groupby("kl_target")):
        c = COLORS[i % len(COLORS)]
        chi = g[g.metric == "chi2_seq"]
        var = g[g.metric == "var_log_w"]
        ax.plot(chi.length, chi.value, color=c, lw=2, label=f"KL {kl:g}/token")
        bx.plot(var.length, var.value, color=c, lw=2, label=f"KL {kl:g}/token")
    ax.set(xscale="log", yscale="log", xlabel="response length T", ylabel="chi2(pi || mu) of the sequence",
           title="chi2_seq = (1 + chi2_tok)^T - 1")
    ax.set_ylim(1e-4, 1e30)
    bx.set(xscale="log", yscale="log", xlabel="response length T", ylabel="Var_mu(log W)",
           title="Var(log W) = T Var(log rho): only linear")
    for a in (ax, bx):
        a.legend(fontsize=7)
    return fig


# ---- 2. clipping and masking -----------------------------------------------------------------------------------

def coefficient_curves(methods, coefficient_fn, labels: dict) -> Figure:
    """Each method's effective coefficient c(rho, A) on A grad log pi against rho, for A > 0 and A < 0."""
    fig, axes = _fig(2, width=4.8, height=3.4)
    rho = np.exp(np.linspace(np.log(0.1), np.log(10.0), 400))
    for ax, sign in zip(axes, (1.0, -1.0)):
        for m in methods:
            ax.plot(rho, coefficient_fn(m, rho, np.full_like(rho, sign)), color=color(m), lw=2, label=labels[m],
                    alpha=0.85)
        ax.set(xscale="log", xlabel="rho = pi(y) / mu(y)", ylabel="coefficient c(rho, A)", ylim=(-0.1, 6),
               title=f"A {'>' if sign > 0 else '<'} 0")
    axes[0].legend(fontsize=7)
    return fig


def token_panels(table: pd.DataFrame, methods, labels: dict) -> Figure:
    """One panel per method: every token at (log rho, A), size ~ mu, coloured kept / reweighted / dropped; each
    panel's legend (the share of mu in each group) sits under it, off the data."""
    n = len(methods)
    ncols = 3
    fig, axes = _fig(ncols, (n + ncols - 1) // ncols, width=3.6, height=3.6)
    x = np.log(table["rho"].to_numpy())
    size = 4 + 300 * table["mu"].to_numpy()
    for ax, m in zip(axes, methods):
        coef, rho = table[m].to_numpy(), table["rho"].to_numpy()
        state = np.where(coef == 0, 2, np.where(np.isclose(coef, rho), 0, 1))
        for s, (name, c) in enumerate((("kept", COLORS[0]), ("reweighted", COLORS[3]), ("dropped", COLORS[1]))):
            sel = state == s
            ax.scatter(x[sel], table["advantage"].to_numpy()[sel], s=size[sel], color=c, alpha=0.7,
                       label=f"{name} ({table['mu'].to_numpy()[sel].sum():.0%} of mu)")
        ax.axvline(0, color="k", lw=0.5)
        ax.axhline(0, color="k", lw=0.5)
        ax.set(title=labels[m], xlabel="log rho", ylabel="advantage A")
        legend = ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3, frameon=False,
                           handletextpad=0.2, columnspacing=0.8)
        for handle in legend.legend_handles:
            handle.set_sizes([16])
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig


def losses_against_kl(table: pd.DataFrame, labels: dict) -> Figure:
    """Share of mu dropped, IS mass removed, cosine to grad J, and the lost vector's parts, against staleness."""
    fig, axes = _fig(2, 2, width=4.6, height=3.2)
    panels = (("zeroed", "mu-probability of dropped tokens"), ("mass_lost", "share of IS weight mass removed"),
              ("cos", "cos(expected update, grad J)"), ("lost_across", "lost vector across grad J / |grad J|"))
    for ax, (metric, title) in zip(axes, panels):
        for m, g in table[table.metric == metric].groupby("method", sort=False):
            ax.plot(g.kl_target, g.value, color=color(m), lw=2, label=labels[m])
        ax.set(xlabel="per-token KL(mu || pi)", title=title)
    axes[0].legend(fontsize=7)
    return fig


# ---- 3. VESPO's kernel -----------------------------------------------------------------------------------------

def kernel_shapes(kernels, phi_fn, bound_fn) -> Figure:
    """phi(W) for each (k, lambda) with its bound K W (dashed) and W itself (dotted), on a log-W axis."""
    fig, (ax,) = _fig(1, width=6.4)
    log_w = np.linspace(-4, 3, 400)
    W = np.exp(log_w)
    ax.plot(log_w, W, color="0.6", ls=":", label="W (importance sampling)")
    for i, (k, lam) in enumerate(kernels):
        c = COLORS[i % len(COLORS)]
        ax.plot(log_w, phi_fn(W, k, lam), color=c, lw=2, label=f"phi, (k, lambda) = ({k:g}, {lam:g})")
        K = bound_fn(k, lam)
        if np.isfinite(K):
            ax.plot(log_w, K * W, color=c, ls="--", lw=1)
    ax.set(xlabel="log W", ylabel="coefficient on A grad log pi", ylim=(0, 3),
           title="VESPO kernels (solid) under their bounds K W (dashed)")
    ax.legend(fontsize=7, loc="upper left")
    return fig


def proposal_histograms(edges, hists: dict, means: dict) -> Figure:
    """Probability of each log-W bin under mu, pi and the proposals Q of several kernels; triangles mark means."""
    fig, (ax,) = _fig(1, width=6.8)
    centres = 0.5 * (np.asarray(edges[:-1]) + np.asarray(edges[1:]))
    for i, (label, mass) in enumerate(hists.items()):
        c = COLORS[i % len(COLORS)]
        ax.step(centres, mass, where="mid", color=c, lw=2, label=label)
        ax.plot([means[label]], [0], marker="^", ms=10, color=c, clip_on=False)
    ax.set(xlabel="log W = log pi(y) - log mu(y)", ylabel="probability of the bin",
           title="Where each distribution puts its mass (triangles: mean log W)")
    ax.legend(fontsize=8)
    return fig


def bound_check(table: pd.DataFrame) -> Figure:
    """E_mu[phi^2] against Z K C for every exact setting (Proposition 3.1: all points on or below the diagonal)."""
    fig, (ax, bx) = _fig(2)
    finite = table[np.isfinite(table["K"])]
    for i, ((k, lam), g) in enumerate(finite.groupby(["k", "lam"])):
        ax.scatter(g["bound"], g["phi2"], s=14, color=COLORS[i % len(COLORS)], label=f"({k:g}, {lam:g})")
    lo = max(min(finite["bound"].min(), finite["phi2"].min()), 1e-30)
    hi = max(finite["bound"].max(), finite["phi2"].max())
    ax.plot([lo, hi], [lo, hi], "k--", lw=1, label="equality")
    ax.set(xscale="log", yscale="log", xlabel="Z K C", ylabel="E_mu[phi(W)^2]", title="Proposition 3.1, exactly")
    ax.legend(fontsize=7, title="(k, lambda)", title_fontsize=7)
    for i, ((k, lam), g) in enumerate(finite.groupby(["k", "lam"])):
        bx.scatter(g["kl_target"] * g["length"], g["ratio"], s=14, color=COLORS[i % len(COLORS)])
    bx.axhline(1, color="k", ls="--", lw=1)
    bx.set(xscale="log", xlabel="sequence KL(mu || pi) = T x per-token KL", ylabel="E_mu[phi^2] / (Z K C)",
           ylim=(0, 1.1), title="How tight the bound is")
    return fig


def position_against_kl(table: pd.DataFrame) -> Figure:
    """Mean log W under mu, pi and each kernel's Q against the sequence KL."""
    fig, (ax,) = _fig(1, width=6.4)
    one = table.drop_duplicates(["kl_target", "length", "seed"]).sort_values(["kl_target", "length"])
    x = one["kl_target"] * one["length"]
    order = np.argsort(x.to_numpy())
    ax.plot(x.to_numpy()[order], one["mean_logw_mu"].to_numpy()[order], color="k", lw=2, label="mu")
    ax.plot(x.to_numpy()[order], one["mean_logw_pi"].to_numpy()[order], color="k", lw=2, ls="--", label="pi")
    for i, ((k, lam), g) in enumerate(table.groupby(["k", "lam"])):
        g = g.sort_values(["kl_target", "length"])
        gx = (g["kl_target"] * g["length"]).to_numpy()
        o = np.argsort(gx)
        ax.plot(gx[o], g["mean_logw_q"].to_numpy()[o], "o-", ms=3, color=COLORS[i % len(COLORS)],
                label=f"Q, ({k:g}, {lam:g})")
    ax.set(xscale="log", xlabel="sequence KL(mu || pi)", ylabel="mean log W",
           title="Where Q sits: between mu and pi only once they are far apart")
    ax.legend(fontsize=7)
    return fig


# ---- 4. GVPO ---------------------------------------------------------------------------------------------------

def zero_sum_weights(weights: dict) -> Figure:
    """Bars of GVPO's weights for one group under several reward shifts (identical bars: the shift cancels)."""
    fig, (ax,) = _fig(1, width=6.4, height=3.2)
    n = len(next(iter(weights.values())))
    width = 0.8 / len(weights)
    for i, (label, w) in enumerate(weights.items()):
        ax.bar(np.arange(n) + (i - (len(weights) - 1) / 2) * width, w, width, color=COLORS[i % len(COLORS)],
               label=f"{label} (sum {np.sum(w):+.1e})")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(np.arange(n))
    ax.set(xlabel="response i in the group", ylabel="weight w_i", title="GVPO weights: a reward shift changes none")
    ax.legend(fontsize=7)
    return fig


def tv_trajectories(table: pd.DataFrame, sampled: dict | None = None) -> Figure:
    """TV(pi, pi*) along training: expected GVPO loss (solid), uncentred loss (dashed), sampled groups (dots)."""
    fig, (ax,) = _fig(1, width=7.0, height=4.0)
    for i, (s, g) in enumerate(table.groupby("sampler", sort=False)):
        c = COLORS[i % len(COLORS)]
        for loss, ls in (("gvpo", "-"), ("uncentred", "--")):
            h = g[g["loss"] == loss]
            ax.plot(h.step, np.maximum(h.value, 1e-12), ls=ls, color=c, lw=2,
                    label=f"{s}" if loss == "gvpo" else None)
        if sampled and s in sampled:
            tr = sampled[s]
            ax.plot(np.arange(len(tr)), np.maximum(tr, 1e-12), ":", color=c, lw=1.5)
    ax.plot([], [], "k-", label="GVPO, expected loss")
    ax.plot([], [], "k--", label="uncentred regression")
    if sampled:
        ax.plot([], [], "k:", label="GVPO, sampled groups (lab loss)")
    ax.set(yscale="log", ylim=(1e-9, 1.5), xlabel="gradient step", ylabel="TV(pi, pi*)",
           title="Distance to pi* = pi_ref exp(R / beta) / Z from each sampler")
    ax.legend(fontsize=7, ncols=2)
    return fig


def final_policies(ref, opt, finals: dict) -> Figure:
    """Bars: pi_ref, pi* and the final policies."""
    fig, (ax,) = _fig(1, width=7.0, height=3.4)
    series = {"pi_ref": ref, "pi*": opt, **finals}
    n = len(ref)
    width = 0.85 / len(series)
    for i, (label, p) in enumerate(series.items()):
        ax.bar(np.arange(n) + (i - (len(series) - 1) / 2) * width, p, width, label=label,
               color=("0.6" if label == "pi_ref" else COLORS[i % len(COLORS)]))
    ax.set_xticks(np.arange(n))
    ax.set(xlabel="response", ylabel="probability", title="Final policies against pi_ref and pi*")
    ax.legend(fontsize=7, ncols=2)
    return fig


# ---- 5. vOPD ---------------------------------------------------------------------------------------------------

def _parabola(ax, baselines, variance, moments: dict, title: str) -> None:
    ax.plot(baselines, variance, color="0.3", lw=2)
    lo, hi = sorted((0.0, 2 * moments["b_star"]))
    ax.axvspan(lo, hi, color=COLORS[2], alpha=0.15, label="b lowers the variance")
    for b, v, c, label in ((0.0, moments["var_opd"], color("opd"), "OPD, b = 0"),
                           (moments["value"], moments["var_vopd"], color("vopd"), "vOPD, b = V = -KL"),
                           (moments["b_star"], moments["var_best"], COLORS[2], "best constant b*")):
        ax.plot([b], [v], "o", ms=8, color=c, label=label)
    ax.set(xlabel="baseline b", ylabel="Var (trace of the covariance)", title=title)
    ax.legend(fontsize=7)


def variance_parabolas(examples) -> Figure:
    """One panel per (title, baselines, Var(b), moments): the parabola with OPD (b = 0), vOPD (b = V) and b*, and the
    band (0, 2 b*) where a constant baseline lowers the variance."""
    fig, axes = _fig(len(examples), width=5.2, height=3.6)
    for ax, (title, baselines, variance, moments) in zip(axes, examples):
        _parabola(ax, baselines, variance, moments, title)
    return fig


def helps_against_vocab(tables: dict) -> Figure:
    """Share of random pairs where vOPD lowers the variance (Wilson 95 % band) and the median variance ratio."""
    fig, (ax, bx) = _fig(2)
    for i, (label, t) in enumerate(tables.items()):
        c = COLORS[i % len(COLORS)]
        ax.plot(t.vocab, t.helps_frac, "o-", color=c, ms=4, label=label)
        ax.fill_between(t.vocab, t.helps_lo, t.helps_hi, color=c, alpha=0.15)
        bx.plot(t.vocab, t.ratio_median, "o-", color=c, ms=4, label=label)
        bx.fill_between(t.vocab, t.ratio_q25, t.ratio_q75, color=c, alpha=0.15)
    ax.axhline(0.5, color="k", lw=0.5)
    ax.set(xscale="log", ylim=(0, 1.02), xlabel="vocabulary size V", ylabel="share of pairs",
           title="vOPD lowers the variance in ...")
    bx.axhline(1, color="k", lw=0.5)
    bx.set(xscale="log", xlabel="vocabulary size V", ylabel="Var(vOPD) / Var(OPD)",
           title="Median ratio (band: quartiles)")
    ax.legend(fontsize=7)
    return fig


# ---- 6. sampler truncation -------------------------------------------------------------------------------------

MARKERS = ("o", "s", "^", "D", "v")  # methods whose curves coincide stay visible (decreasing marker sizes)


def kept_tokens(ax, table: pd.DataFrame, title: str, shown: int = 24) -> None:
    """pi per token, most probable first (kept: blue, dropped: grey), and the sampler's mu (black dots)."""
    t = table.head(shown)
    x = np.arange(len(t))
    ax.bar(x, t["pi"], color=np.where(t["kept"], COLORS[0], "#bbbbbb"), label="pi (grey: outside the kept set)")
    ax.plot(x, t["mu"], "o", color=MU, ms=3, label="sampler mu")
    ax.set(xlabel=f"token, most probable first (the first {len(t)})", ylabel="probability", title=title)
    ax.legend(fontsize=7, loc="upper right")


def truncation_tokens(table: pd.DataFrame, kind_label: str, band) -> Figure:
    """Left: the kept set (``kept_tokens``); right: each kept token's ratio pi/mu without replay and pi_S/mu with
    replay, the band shaded."""
    fig, (ax, bx) = _fig(2, width=5.0, height=3.4)
    kept = table[table["kept"]]
    kept_tokens(ax, table, f"{kind_label}: {len(kept)} of {len(table)} tokens kept")
    x = np.arange(len(kept))
    bx.axhspan(*band, color=COLORS[2], alpha=0.15, label=f"band [{band[0]:g}, {band[1]:g}]")
    bx.plot(x, kept["ratio"], "o", color=COLORS[1], ms=5, label="pi / mu (no replay)")
    bx.plot(x, kept["ratio_replay"], "s", color=COLORS[0], ms=4, label="pi_S / mu (replay)")
    bx.xaxis.set_major_locator(MaxNLocator(integer=True))
    bx.set(xlabel="kept token, most probable first", ylabel="trainer / sampler ratio",
           title="Ratios of the kept tokens",
           ylim=(min(0.4, float(kept["ratio"].min()) - 0.05), max(1.2, float(kept["ratio"].max()) + 0.05)))
    bx.legend(fontsize=7)
    return fig


def _curve(table: pd.DataFrame, method: str, metric: str, replay: bool = False):
    """(levels, values) of one curve of a sampler_truncation sweep, as float arrays."""
    sel = table[(table.method == method) & (table.metric == metric) & (table.replay == replay)]
    return sel["level"].to_numpy(np.float64), sel["value"].to_numpy(np.float64)


def _setting_curve(table: pd.DataFrame, metric: str, replay: bool = False):
    return _curve(table, "-", metric, replay)


def ratio_against_level(table: pd.DataFrame, xlabel: str, band) -> Figure:
    """Kept mass and the mean ratio under the sampler (equal), and the share of sampled tokens outside the band
    without and with replay, against the sampler's knob."""
    fig, (ax, bx) = _fig(2, width=4.8, height=3.4)
    ax.plot(*_setting_curve(table, "kept_mass"), color=COLORS[0], lw=2, label="kept mass m = pi(S)")
    ax.plot(*_setting_curve(table, "mean_ratio"), "o", color=COLORS[1], ms=5, label="E_mu[pi / mu]")
    ax.axhspan(*band, color=COLORS[2], alpha=0.15)
    ax.set(xlabel=xlabel, ylabel="value", title="The mean ratio is the kept mass")
    ax.legend(fontsize=7)
    for replay, c, ls, label in ((False, COLORS[1], "-", "no replay"), (True, COLORS[0], "--", "with replay")):
        bx.plot(*_setting_curve(table, "share_out", replay), ls, color=c, lw=2, marker=".", label=label)
    bx.set(xlabel=xlabel, ylabel="share of sampled tokens", ylim=(-0.05, 1.05),
           title=f"Ratio outside [{band[0]:g}, {band[1]:g}]")
    bx.legend(fontsize=7)
    for a in (ax, bx):
        if table.kind.iloc[0] != "min_p":  # from no truncation (left) to the strongest (right)
            a.invert_xaxis()
    return fig


def bias_lines(ax, table: pd.DataFrame, truth: str, labels: dict, markers: bool = True) -> None:
    """Each method's bias against ``truth`` (solid: no replay, dashed: replay); coinciding curves stay visible by
    their markers (or, without markers, by decreasing line widths)."""
    methods = [m for m in table.method.unique() if m != "-"]
    for i, m in enumerate(methods):
        style = {"lw": 2, "marker": MARKERS[i % len(MARKERS)], "ms": 6 - 1.5 * i} if markers else {"lw": 4 - 1.2 * i}
        for replay, ls in ((False, "-"), (True, "--")):
            ax.plot(*_curve(table, m, f"bias_{truth}", replay), ls, color=color(m), **style,
                    label=f"{labels[m]}{', replay' if replay else ''}")


def bias_against_level(table: pd.DataFrame, labels: dict, xlabel: str) -> Figure:
    """The bias of each expected one-token update (in units of |grad J(pi)|) against the full gradient (left, with
    the gap between the truths) and the deployed gradient (right), without (solid) and with (dashed) replay."""
    fig, axes = _fig(2, width=4.8, height=3.6)
    for ax, truth, title in zip(axes, ("full", "deployed"), ("against grad J(pi), the full policy",
                                                             "against grad J(pi_S), the deployed policy")):
        bias_lines(ax, table, truth, labels)
        if truth == "full":
            ax.plot(*_setting_curve(table, "gap"), ":", color="k", lw=2, label="gap |grad J(pi_S) - grad J(pi)|")
        ax.set(xlabel=xlabel, ylabel="|E[update] - truth| / |grad J(pi)|", title=title)
        if table.kind.iloc[0] != "min_p":
            ax.invert_xaxis()
    axes[0].legend(fontsize=6)
    return fig
