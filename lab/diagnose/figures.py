"""The rollout_diagnostics report's figures, one function each, drawn from a Diagnostics' tables."""
from __future__ import annotations

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter

from lab.diagnose.streaming import KHAT_WARN, PAIR_TEXT

COLORS = {"mismatch": "#1f77b4", "update": "#2ca02c", "total": "#d62728"}


def logratio_distribution(diag):
    """Per pair: the share of tokens with |Δ| above x (log-log), and the signed distribution (symmetric log axis)."""
    h = diag.tables["histograms"]
    h = h[h["step"].isna()]
    fig = Figure(figsize=(11, 3.6))
    axes = fig.subplots(1, 2)
    for pair, g in h.groupby("pair", sort=False):
        lo = g["bin_lo"].clip(-100, 100).to_numpy()
        hi = g["bin_hi"].clip(-100, 100).to_numpy()
        counts = g["count"].to_numpy(float)
        absolute = np.maximum(np.abs(lo), np.abs(hi))  # upper |Δ| edge of each bin
        order = np.argsort(absolute)
        survive = 1.0 - np.cumsum(counts[order]) / counts.sum()
        keep = survive > 0
        axes[0].step(absolute[order][keep], survive[keep], where="post", color=COLORS.get(pair), label=PAIR_TEXT[pair])
        mid = np.where(np.abs(lo) < 1e-6, 0.0, np.sign(lo + hi) * np.sqrt(np.abs(lo * hi)))
        o = np.argsort(mid)
        axes[1].plot(mid[o], counts[o] / counts.sum(), lw=1, color=COLORS.get(pair), label=PAIR_TEXT[pair])
    axes[0].set_xscale("log")
    axes[0].set_yscale("log")
    axes[0].set_xlabel("|Δ|")
    axes[0].set_ylabel("share of tokens with a larger |Δ|")
    axes[1].set_xscale("symlog", linthresh=1e-4)
    axes[1].set_yscale("log")
    axes[1].set_xlabel("Δ (signed; 40 bins per decade)")
    axes[1].set_ylabel("share of tokens per bin")
    axes[0].legend(frameon=False, fontsize=8)
    fig.suptitle("Token log-ratio distributions (all steps)")
    fig.tight_layout()
    return fig


def by_probability(diag):
    """Mean |Δ| and share of the |Δ| mass by the sampled token's probability."""
    t = diag.tables["by_probability"]
    fig = Figure(figsize=(10, 3.6))
    axes = fig.subplots(1, 2)
    for pair, g in t.groupby("pair", sort=False):
        g = g[g["n_tok"] > 0]
        x = np.sqrt(np.maximum(g["p_lo"], 1e-5) * g["p_hi"])
        axes[0].plot(x, g["mean_abs"], marker="o", color=COLORS.get(pair), label=PAIR_TEXT[pair])
        axes[1].plot(x, g["abs_mass_share"], marker="o", color=COLORS.get(pair), label=PAIR_TEXT[pair])
    first = t[t["pair"] == t["pair"].iloc[0]]
    first = first[first["n_tok"] > 0]
    axes[1].bar(np.sqrt(np.maximum(first["p_lo"], 1e-5) * first["p_hi"]), first["token_share"],
                width=0.35 * np.sqrt(np.maximum(first["p_lo"], 1e-5) * first["p_hi"]), color="0.85",
                label="share of tokens", zorder=0)
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("probability of the sampled token (sampler)")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("mean |Δ|")
    axes[1].set_ylabel("share of the |Δ| mass")
    axes[0].legend(frameon=False, fontsize=8)
    axes[1].legend(frameon=False, fontsize=8)
    fig.suptitle("Where the log-ratio lives: by token probability")
    fig.tight_layout()
    return fig


def per_step(diag):
    """Per step: Kish ESS, PSIS k-hat (0.7 line), the dominant share and mean |Δ|."""
    t = diag.tables["per_step"]
    fig = Figure(figsize=(13, 3.2))
    axes = fig.subplots(1, 4)
    for pair, g in t.groupby("pair", sort=False):
        x = np.arange(len(g))
        kw = dict(marker=".", color=COLORS.get(pair), label=PAIR_TEXT[pair])
        axes[0].plot(x, g["ess_frac"], **kw)
        axes[1].plot(x, g["khat"], **kw)
        axes[2].plot(x, g["dominant_share"], **kw)
        axes[3].plot(x, g["mean_abs"], **kw)
    axes[1].axhline(KHAT_WARN, color="k", lw=0.8, ls="--")
    for ax, title in zip(axes, ("Kish ESS fraction", "PSIS k-hat", "share of sequences holding half the weight",
                                "mean |Δ| per token")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step (in log order)")
    axes[3].set_yscale("log")
    axes[0].legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def length_growth(diag):
    """Standard deviation and mean |log W| of the sequence log-weight against response length, with the fitted
    variance growth."""
    t, g = diag.tables["by_length"], diag.tables["growth"].set_index("pair")
    t = t[t["n_seq"] >= 5]  # length bins with at least 5 sequences
    fig = Figure(figsize=(10, 3.6))
    axes = fig.subplots(1, 2)
    for pair, d in t.groupby("pair", sort=False):
        axes[0].plot(d["mean_len"], d["logw_sd"], marker="o", color=COLORS.get(pair), label=PAIR_TEXT[pair])
        b = g.loc[pair, "var_per_token"]
        if np.isfinite(b) and b > 0:
            x = np.linspace(d["mean_len"].min(), d["mean_len"].max(), 50)
            axes[0].plot(x, np.sqrt(b * x), ls=":", color=COLORS.get(pair))
        axes[1].plot(d["mean_len"], d["logw_abs_mean"], marker="o", color=COLORS.get(pair), label=PAIR_TEXT[pair])
    for ax in axes:
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("response length (loss-masked tokens; bins with 5+ sequences)")
    axes[0].set_ylabel("sd of log W (dotted: sqrt(fitted slope x length))")
    axes[1].set_ylabel("mean |log W|")
    axes[0].legend(frameon=False, fontsize=8)
    fig.suptitle("Sequence log-weight against length")
    fig.tight_layout()
    return fig


def staleness(diag):
    """Distribution of the version lag, and mean |Δ| per token at each lag."""
    t = diag.tables["staleness"]
    fig = Figure(figsize=(10, 3.2))
    axes = fig.subplots(1, 2)
    if t.empty:
        for ax in axes:
            ax.text(0.5, 0.5, "no policy versions in this log", ha="center", va="center", transform=ax.transAxes)
            ax.set_axis_off()
        return fig
    axes[0].bar(t["lag"], t["seq_share"], color="0.5")
    axes[0].set_xlabel("version lag (trainer version - generating version)")
    axes[0].set_ylabel("share of sequences")
    for col in [c for c in t.columns if c.startswith("mean_abs_")]:
        pair = col.removeprefix("mean_abs_")
        axes[1].plot(t["lag"], t[col], marker="o", color=COLORS.get(pair), label=PAIR_TEXT.get(pair, pair))
    axes[1].set_xlabel("version lag")
    axes[1].set_ylabel("mean |Δ| per token")
    axes[1].legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig


def corrections(diag):
    """Share of tokens each correction changes and share of gradient weight it removes (95 % intervals)."""
    t = diag.tables["corrections"]
    y = np.arange(len(t))[::-1]
    fig = Figure(figsize=(10, 0.45 * len(t) + 1.2))
    axes = fig.subplots(1, 2, sharey=True)
    axes[0].barh(y, t["tokens_changed"], color="0.55")
    err = np.vstack([(t["removed"] - t["removed_lo"]).clip(lower=0), (t["removed_hi"] - t["removed"]).clip(lower=0)])
    axes[1].barh(y, t["removed"], xerr=np.nan_to_num(err), color="#d62728", label="removed")
    axes[1].barh(y, -t["added"], color="#2ca02c", label="added (drawn left)")
    axes[0].set_yticks(y, [f"{a} [{p}]" for a, p in zip(t["label"], t["pair"])])
    axes[0].set_xlabel("share of tokens clipped, masked or reweighted")
    axes[1].set_xlabel("share of IS gradient weight removed / added")
    axes[1].axvline(0, color="k", lw=0.6)
    axes[1].legend(frameon=False, fontsize=8)
    fig.tight_layout()
    return fig
