"""Standard figures of a variance study: one function per figure, each taking the tidy results table.
Figures shared by several reports (the staleness axis, log scales) live here too.

Every function returns a ``matplotlib.figure.Figure`` built without pyplot (no global state, no GUI, safe
under any backend and in worker processes); notebooks display it as the cell's value, scripts call
``fig.savefig(path)``. Shaded bands are the table's ``lo``/``hi`` bootstrap intervals.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import FixedFormatter, FixedLocator, NullLocator

from lab.errors import LabError
from lab.reports.style import color

KIND_LABELS = {
    "lag": "lag (optimiser steps between μ and π)",
    "kl": "target per-token KL(μ‖π)",
    "temperature": "sampling temperature of μ",
}
KHAT_RELIABLE = 0.7  # Vehtari et al. (2024): above this the importance-sampling estimate is unreliable


def _study(results: pd.DataFrame) -> pd.DataFrame:
    """The rows of one study; refuses a table mixing several envs, policies, knobs or seeds."""
    keys = [k for k in ("env", "policy", "staleness_kind", "seed", "reference") if k in results]
    if results.empty:
        raise LabError("the results table is empty; nothing to plot")
    if len(results.drop_duplicates(keys)) > 1:
        raise LabError(f"the results table holds several studies ({', '.join(keys)}); select one before plotting")
    return results


def estimator_names(results: pd.DataFrame) -> list[str]:
    """Estimators in the table, in the order the study ran them."""
    return [e for e in pd.unique(results["estimator"]) if e != "-"]


def estimator_colors(results: pd.DataFrame) -> dict[str, str]:
    """Each estimator's colour (the same in every report: ``lab.reports.style``)."""
    return {e: color(e) for e in estimator_names(results)}


def _series(results: pd.DataFrame, metric: str, estimator: str = "-") -> pd.DataFrame:
    rows = results[(results["metric"] == metric) & (results["estimator"] == estimator)]
    return rows.sort_values("staleness")[["staleness", "value", "lo", "hi"]]


def _staleness_axis(ax, results: pd.DataFrame) -> None:
    kind = results["staleness_kind"].iloc[0] if "staleness_kind" in results else ""
    staleness_axis(ax, results["staleness"], kind)


def staleness_axis(ax, values, kind: str) -> None:
    """x = the staleness values (ticks at each), symlog/log when they span a decade, labelled by the knob."""
    x = np.sort(np.unique(np.asarray(values, dtype=float)))
    pos = x[x > 0]
    if len(pos) >= 2 and pos.max() / pos.min() >= 8:
        if (x <= 0).any():
            ax.set_xscale("symlog", linthresh=pos.min(), linscale=0.6)
        else:
            ax.set_xscale("log")
    ax.xaxis.set_major_locator(FixedLocator(x))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FixedFormatter([f"{v:g}" for v in x]))
    t = ax.xaxis.get_transform()  # pad 4% either side in display space, so every value shows
    lo, hi = t.transform([x.min(), x.max()])
    pad = 0.04 * (hi - lo) if hi > lo else 0.5
    ax.set_xlim(*t.inverted().transform([lo - pad, hi + pad]))
    ax.set_xlabel(KIND_LABELS.get(kind, str(kind)))
    ax.grid(True, alpha=0.3)


def _log_y(ax, values: np.ndarray, linthresh: float | None = None) -> None:
    """Log y when the positive values span more than a decade.

    Zeros and negatives (a debiased squared bias, a sampled KL) stay visible on a symlog axis whose linear
    part [-L, L] sits below the smallest decade shown; ticks at 0 and at each decade from L up.
    """
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    pos = v[v > 0]
    if len(pos) < 2 or pos.max() / pos.min() < 10:
        return
    if not (v <= 0).any():
        ax.set_yscale("log")
        return
    top = float(pos.max()) * 2
    L = 10.0 ** np.floor(np.log10(linthresh or np.quantile(pos, 0.1)))
    ax.set_yscale("symlog", linthresh=L, linscale=0.7)
    decades = 10.0 ** np.arange(np.log10(L), np.ceil(np.log10(top)) + 1)
    ax.yaxis.set_major_locator(FixedLocator([0.0, *decades]))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.set_ylim(-L if (v < 0).any() else -0.3 * L, top)


def _line(ax, s: pd.DataFrame, label: str, color: str, style: str = "-o", alpha: float = 0.14) -> None:
    s = s[np.isfinite(s["value"])]
    if s.empty:
        return
    ax.plot(s["staleness"], s["value"], style, color=color, label=label, lw=1.8, ms=4)
    ax.fill_between(s["staleness"], s["lo"], s["hi"], color=color, alpha=alpha, lw=0)


def gradient_norm2(results: pd.DataFrame) -> float:
    """‖∇J‖² of the study's target gradient (= mse / rel_mse of any estimator row); NaN if not recorded."""
    mse = results[results["metric"] == "mse"].set_index(["staleness", "estimator"])["value"]
    rel = results[results["metric"] == "rel_mse"].set_index(["staleness", "estimator"])["value"]
    ratio = (mse / rel).replace([np.inf, -np.inf], np.nan).dropna()
    return float(ratio.median()) if len(ratio) else float("nan")


def bias_variance_mse(results: pd.DataFrame) -> Figure:
    """Squared bias, variance (trace of covariance) and MSE of each estimator against staleness.

    All three in units of ‖∇J‖² (the squared norm of the true gradient), so bias² + variance = MSE and a value of
    1 means an error as large as the gradient. Squared bias is the debiased estimate and dips below zero when the
    bias is lost in the noise: its symlog axis is linear inside the noise band.
    """
    results = _study(results)
    colors = estimator_colors(results)
    norm2 = gradient_norm2(results)
    scale = norm2 if np.isfinite(norm2) and norm2 > 0 else 1.0
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    axes = fig.subplots(1, 3)
    axes[2].sharey(axes[1])
    panels = [("bias2", "squared bias ‖E g − ∇J‖²"), ("variance", "variance  tr Cov(g)"),
              ("mse", "MSE  E‖g − ∇J‖²  (= bias² + variance)")]
    data = {}
    for ax, (metric, title) in zip(axes, panels):
        data[metric] = []
        for name, hue in colors.items():
            s = _series(results, metric, name)
            s[["value", "lo", "hi"]] /= scale
            _line(ax, s, name, hue, alpha=0.07 if metric == "bias2" else 0.14)  # bias bands overlap near 0
            data[metric].append(s)
        ax.set_title(title, fontsize=10.5)
        _staleness_axis(ax, results)
    bias = pd.concat(data["bias2"])
    half = ((bias["hi"] - bias["lo"]) / 2).replace(0, np.nan).dropna()
    _log_y(axes[0], bias[["value", "lo", "hi"]].to_numpy().ravel(),
           linthresh=float(half.median()) if len(half) else None)
    axes[0].axhline(0, color="black", lw=0.6)
    if axes[0].get_yscale() == "symlog":  # show negative point estimates down to one decade below the band
        L = axes[0].yaxis.get_transform().linthresh
        axes[0].set_ylim(max(min(float(bias["value"].min()) * 1.3, -L), -10 * L), axes[0].get_ylim()[1])
    _log_y(axes[1], pd.concat(data["variance"] + data["mse"])[["value", "lo", "hi"]].to_numpy().ravel())
    unit = "÷ ‖∇J‖²" if scale != 1.0 else "squared gradient norm"
    for ax in axes:
        ax.set_ylabel(unit)
    axes[-1].legend(frameon=False, fontsize=9)
    fig.suptitle("How wrong and how noisy is one batch's gradient? (shaded: 95% bootstrap interval)", fontsize=11)
    return fig


def mse_by_family(results: pd.DataFrame, columns: int = 3) -> Figure:
    """MSE ÷ ‖∇J‖² against staleness as small multiples, one panel per estimator family (registry families), so
    that many estimators stay readable; uncorrected REINFORCE and sequence IS are drawn in every panel as thin grey
    references, and each panel's legend sits beside it, off the data."""
    from lab import estimators

    results = _study(results)
    families: dict[str, list[str]] = {}
    for name in estimator_names(results):
        families.setdefault(estimators.info(name).family, []).append(name)
    refs = [r for r in ("reinforce", "seq_is") if r in estimator_names(results)]
    rows = -(-len(families) // columns)
    fig = Figure(figsize=(4.6 * columns, 2.9 * rows), layout="constrained")
    axes = np.atleast_1d(fig.subplots(rows, columns, sharex=True, sharey=True)).ravel()
    values = results[results["metric"] == "rel_mse"][["value", "lo", "hi"]].to_numpy().ravel()
    for ax, (family, names) in zip(axes, families.items()):
        for ref in refs:
            if ref not in names:
                s = _series(results, "rel_mse", ref)
                ax.plot(s["staleness"], s["value"], "--", color="#bbbbbb", lw=1.0, label=f"{ref} (reference)")
        for name in names:
            _line(ax, _series(results, "rel_mse", name), name, color(name))
        ax.axhline(1.0, color="black", lw=0.7, ls=":")
        ax.set_title(family, fontsize=10)
        _staleness_axis(ax, results)
        ax.set_xlabel("")
        ax.legend(frameon=False, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    for ax in axes[len(families):]:
        ax.set_visible(False)
    _log_y(axes[0], values)
    fig.supxlabel(KIND_LABELS.get(results["staleness_kind"].iloc[0], "staleness"), fontsize=10)
    fig.supylabel("MSE ÷ ‖∇J‖² (dotted: a zero update)", fontsize=10)
    fig.suptitle("MSE of one batch's gradient by estimator family (shaded: 95% bootstrap interval)", fontsize=11)
    return fig


def weight_diagnostics(results: pd.DataFrame) -> Figure:
    """Importance-weight health against staleness: ESS fraction, Pareto k-hat, sequence χ², log-weight variance."""
    results = _study(results)
    fig = Figure(figsize=(12, 3.6), layout="constrained")
    axes = fig.subplots(1, 4)
    grey, blue = "#444444", "#1f77b4"

    ax = axes[0]
    _line(ax, _series(results, "ess_frac"), "Kish ESS / B", blue)
    ax.set_ylim(0, 1.05)
    ax.set_title("ESS fraction (1 = on-policy)")

    ax = axes[1]
    k = _series(results, "khat")
    _line(ax, k, "k-hat", blue)
    ax.axhline(KHAT_RELIABLE, color="#d62728", ls="--", lw=1.2, label=f"{KHAT_RELIABLE} reliability limit")
    if not np.isfinite(k["value"]).all():
        ax.text(0.5, 0.5, "missing points: no tail fit\n(too few distinct large weights)", ha="center", va="center",
                transform=ax.transAxes, color=grey, fontsize=8)
    ax.set_title("Pareto k-hat of sequence weights")
    ax.legend(frameon=False, fontsize=8, loc="upper left")

    ax = axes[2]
    exact, sampled = _series(results, "chi2_seq"), _series(results, "chi2_seq_sampled")
    _line(ax, exact, "exact", grey, "-s")
    _line(ax, sampled, "sampled (per batch)", blue)
    _log_y(ax, np.concatenate([exact["value"].to_numpy(), sampled[["value", "lo", "hi"]].to_numpy().ravel()]))
    ax.set_title("sequence χ²(π‖μ) = E_μ[W²] − 1")
    ax.legend(frameon=False, fontsize=8)

    ax = axes[3]
    lv = _series(results, "logw_var")
    _line(ax, lv, "exact", grey, "-s")
    _log_y(ax, lv["value"].to_numpy())
    ax.set_title("Var_μ[log W] (exact)")

    for ax in axes:
        _staleness_axis(ax, results)
    fig.suptitle("Are the importance weights still usable?", fontsize=11)
    return fig


def divergence(results: pd.DataFrame) -> Figure:
    """Achieved divergence KL(μ‖π) against the staleness knob: exact value and sampled k1/k3 estimates."""
    results = _study(results)
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, level in zip(axes, ("token", "seq")):
        exact = _series(results, f"kl_{level}")
        k1, k3 = _series(results, f"k1_{level}"), _series(results, f"k3_{level}")
        refs = set(results["reference"])
        label = {"exact": "exact (enumeration)", "dp": "exact (dynamic programming)"}.get(refs.pop(), "reference") \
            if len(refs) == 1 else "reference"
        _line(ax, exact, label, "#444444", "-s")
        _line(ax, k1, "k1 = −log r (sampled)", "#1f77b4", "--o")
        _line(ax, k3, "k3 = r − 1 − log r (sampled)", "#ff7f0e", ":o")
        _log_y(ax, np.concatenate([exact["value"].to_numpy(), k1[["value", "lo", "hi"]].to_numpy().ravel(),
                                   k3[["value", "lo", "hi"]].to_numpy().ravel()]))
        ax.set_title(f"KL(μ‖π) per {'token' if level == 'token' else 'sequence'}")
        _staleness_axis(ax, results)
        ax.axhline(0, color="black", lw=0.6)
    axes[0].legend(frameon=False, fontsize=8)
    fig.suptitle("How far is the behaviour policy μ from π?", fontsize=11)
    return fig


def coefficient_curves(names: list[str] | None = None, max_ratio: float = 3.0) -> Figure:
    """Each estimator's effective coefficient on A grad log pi against its ratio, for A > 0 and A < 0.

    The ratio is the token ratio rho_t = pi/mu for token-level estimators, the sequence weight W = pi(y)/mu(y)
    for sequence-level ones ("seq") and its geometric mean W^(1/|y|) for GSPO-style ones ("geo"); REINFORCE's
    coefficient is 1, plain importance sampling's the ratio. Estimators without a coefficient function (group or
    distillation losses) and KL penalties (their coefficient reads pi/pi_ref, not a behaviour ratio) are left out.
    """
    from lab import estimators

    names = [n for n in (names or estimators.names())
             if estimators.info(n).coefficient is not None and estimators.info(n).family != "kl-penalty"]
    marks = {"sequence": " (seq)", "geometric": " (geo)"}
    ratio = np.linspace(1e-3, max_ratio, 600)
    fig = Figure(figsize=(12.5, 4.6), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    for col, (ax, sign) in enumerate(zip(axes, (1.0, -1.0))):
        for name in names:
            info = estimators.info(name)
            coef = np.asarray(info.coefficient(ratio, np.full_like(ratio, sign)), dtype=float)
            coef = np.broadcast_to(coef, ratio.shape)
            label = name + marks.get(info.ratio, "")
            style = "-" if info.ratio == "token" else "--"
            ax.plot(ratio, coef, style, color=color(name), lw=1.8, label=label)
        ax.axvline(1.0, color="0.6", lw=0.8)
        ax.set_xlabel("ratio: token ρ = π/μ; (seq) W = π(y)/μ(y); (geo) W^(1/|y|)")
        ax.set_title(f"advantage {'> 0' if sign > 0 else '< 0'}")
        ax.set_ylim(-0.1, min(max_ratio, 3.0) + 0.1)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("coefficient on A ∇log π")
    axes[1].legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    fig.suptitle("Effective coefficient on the score function: where each correction passes, damps or cuts gradient")
    return fig
