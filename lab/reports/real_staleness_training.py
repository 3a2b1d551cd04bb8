"""What the real_staleness_training report says and draws: the answer from the study's summary alone, the miniature
beside VESPO's staleness table (Shen et al., arXiv 2602.10693), and figures from the tidy results table. The numbers
come from ``lab.studies.real_staleness_training``."""
from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from lab.reports.style import color, interval
from lab.studies.real_staleness_training import LABEL
from lab.studies.staleness_training import PAPER, PAPER_N, PAPER_NAMES

IQM = f"{LABEL}_iqm"
AXIS = {"sync": "mini-batches per rollout N (max staleness N - 1)",
        "async": "staleness bound η (lags drawn on 0..lag_max)",
        "mismatch": "sampler (bfloat16: weights and KV cache in bf16; +replay: the trainer replays its routes)"}


def _iv(v: list, fmt: str = "{:.2f}") -> str:
    return interval(*v, fmt)


def _order(xs) -> list[str]:
    """Setting keys in display order: numerically when they are numbers, else as they first appear."""
    xs = list(dict.fromkeys(xs))
    try:
        return sorted(xs, key=float)
    except ValueError:
        return xs


def _at(summary: dict, study: str, x: str) -> dict:
    return {e: cells[x] for e, cells in summary["table"].get(study, {}).items() if x in cells}


# ---- text -----------------------------------------------------------------------------------------------------------

def headline(summary: dict) -> str:
    """One line: what the miniature reproduces of the paper's ordering at the largest N."""
    orders = summary.get("orderings", [])
    if not orders:
        return "fewer than two of the paper's estimators (ppo_clip, gspo, sapo, vespo) at two or more N in the sync study"
    rep = [f"{o['better']} > {o['worse']}" for o in orders if o["verdict"] == "reproduced"]
    rev = [f"{o['worse']} > {o['better']}" for o in orders if o["verdict"] == "reversed"]
    n = int(orders[0]["n"])
    return (f"At N = {n}: reproduced {', '.join(rep) or 'none'}; reversed {', '.join(rev) or 'none'}; "
            f"{sum(o['verdict'] == 'not separated' for o in orders)} of {len(orders)} paper orderings not separated "
            f"by the seeds")


def _setup(summary: dict) -> str:
    s = summary["setup"]
    return (f"**Setup.** `{s['env']}` ({s['task']}; {s['length']}-token answers, {s['n_prompts']} training "
            f"prompts), the lab's `{s['size']}` transformer ({s['parameters']:,} parameters) "
            f"from a supervised warm start at held-out accuracy {s['initial_heldout_accuracy']:.2f}, {s['seeds']} seeds "
            f"per cell. Score: the exact held-out accuracy mean_x π(a*(x)|x) after the last update (IQM over seeds, "
            f"95% stratified-bootstrap interval). Shown: {s['source']}.")


def _apart(a: list, b: list) -> bool:
    """Two [value, lo, hi] whose intervals do not overlap."""
    return a[1] > b[2] or b[1] > a[2]


def _spread(at: dict) -> str:
    """'highest e v [..], lowest f v [..]' with whether the seeds separate them."""
    ranked = sorted(at, key=lambda e: -at[e][IQM][0])
    hi, lo = ranked[0], ranked[-1]
    sep = "intervals apart" if _apart(at[hi][IQM], at[lo][IQM]) else "intervals overlap: not separated"
    return f"highest {hi} {_iv(at[hi][IQM])}, lowest {lo} {_iv(at[lo][IQM])} ({sep})"


def _sync_lines(summary: dict) -> list[str]:
    table = summary["table"].get("sync")
    if not table:
        return []
    xs = _order(next(iter(table.values())))
    lo_x, hi_x = xs[0], xs[-1]
    at_hi, at_lo = _at(summary, "sync", hi_x), _at(summary, "sync", lo_x)
    ranked = sorted(at_hi, key=lambda e: -at_hi[e][IQM][0])
    deg = summary["degradation"]
    held = [e for e in ranked if not deg[e]["degrades"]]
    fell = [e for e in ranked if deg[e]["degrades"]]
    n_lo = " and ".join(sorted({_iv(at_lo[e][IQM]) for e in at_lo}))
    lines = [f"- **At the largest staleness, N = {hi_x}**, held-out accuracy: {_spread(at_hi)}; at N = {lo_x}: "
             f"{n_lo}. Collapse rate at N = {hi_x}: "
             + ", ".join(f"{e} {at_hi[e]['collapse_rate'][0]:.0%}" for e in ranked) + "."]
    lines.append(f"- **Degraded from N = {lo_x} to N = {hi_x}** (intervals apart): {', '.join(fell) or 'none'}; "
                 f"held within the seeds' resolution: {', '.join(held) or 'none'}.")
    kl = {e: d["final_kl_to_init_median"] for e, d in deg.items() if "final_kl_to_init_median" in d}
    if kl:
        lines.append(f"- **How far each moved** from the warm start by N = {hi_x} (median final KL per token at the "
                     f"answers' states): " + ", ".join(f"{e} {kl[e]:.2g}" for e in sorted(kl, key=kl.get))
                     + " (lower: nearer the warm start).")
    if "reinforce" in at_hi:
        better = [e for e in ranked if e != "reinforce" and at_hi[e][IQM][1] > at_hi["reinforce"][IQM][2]]
        lines.append(f"- **Against no correction (REINFORCE on stale samples) at N = {hi_x}:** clearly better: "
                     f"{', '.join(better) or 'none'}.")
    return lines


def _regime_line(summary: dict, study: str) -> str:
    table = summary["table"].get(study)
    if not table:
        return ""
    xs = _order(next(iter(table.values())))
    size = summary.get("mismatch_size", {})
    parts = [f"{x}" + (f" (mean |log π_old - log μ| {size[x]:.2g} per token)" if x in size else "")
             + f": {_spread(_at(summary, study, x))}" for x in xs]
    name = {"async": "Asynchronous lag, per bound η", "mismatch": "Mismatched sampler, per setting"}[study]
    return f"- **{name}:** " + "; ".join(parts) + "."


def orderings_text(summary: dict) -> str:
    orders = summary.get("orderings", [])
    if not orders:
        return "Fewer than two of the paper's estimators were trained here: no ordering to compare."
    n = int(orders[0]["n"])
    rows = [f"- {PAPER_NAMES.get(o['better'], o['better'])} > {PAPER_NAMES.get(o['worse'], o['worse'])} (paper at N = 64: "
            f"{o['paper'][0]:.0%} vs {o['paper'][1]:.0%}; miniature at N = {n}: {o['better']} "
            f"{_iv([o['miniature'][0], *o['intervals'][0]])} vs {o['worse']} {_iv([o['miniature'][1], *o['intervals'][1]])}):"
            f" **{o['verdict']}**" for o in orders]
    rep = sum(o["verdict"] == "reproduced" for o in orders)
    return (f"Of the paper's {len(orders)} pairwise ordering{'s' if len(orders) != 1 else ''} at its largest staleness, the miniature reproduces "
            f"{rep}, reverses {sum(o['verdict'] == 'reversed' for o in orders)} and cannot separate "
            f"{sum(o['verdict'] == 'not separated' for o in orders)} (95% intervals overlap):\n\n" + "\n".join(rows))


def answer(summary: dict) -> str:
    lines = _sync_lines(summary) + [line for line in (_regime_line(summary, s) for s in ("async", "mismatch")) if line]
    return "\n".join([_setup(summary), "", *lines, "", "**Against the paper.** " + orderings_text(summary)])


def paper_table(summary: dict) -> pd.DataFrame:
    """The miniature's IQM [interval] per estimator and N beside the paper's accuracy at the same N."""
    table = summary["table"].get("sync", {})
    rows = []
    for e, cells in table.items():
        row = {"estimator": e}
        for x in _order(cells):
            row[f"N={x}"] = _iv(cells[x][IQM])
        if e in PAPER:
            for n, v in zip(PAPER_N, PAPER[e]):
                if f"N={n}" in row:
                    row[f"N={n}"] += f"  (paper {v:.0f}%)"
        rows.append(row)
    return pd.DataFrame(rows)


# ---- figures --------------------------------------------------------------------------------------------------------

def _rows(results: pd.DataFrame, study: str, metric: str) -> pd.DataFrame:
    return results[(results["study"] == study) & (results["metric"] == metric)]


def _dodge(ax, t: pd.DataFrame) -> None:
    xs = _order(t["x"])
    ests = list(dict.fromkeys(t["estimator"]))
    width = 0.6 / max(len(ests), 1)
    for k, e in enumerate(ests):
        g = t[t["estimator"] == e].set_index("x").reindex(xs)
        p = np.arange(len(xs)) + (k - (len(ests) - 1) / 2) * width
        ax.errorbar(p, g["value"], yerr=[g["value"] - g["lo"], g["hi"] - g["value"]], color=color(e), marker="o",
                    ms=4, lw=1.0, elinewidth=1.0, capsize=2, label=e)
    ax.set_xticks(range(len(xs)), xs)
    ax.grid(alpha=0.3)


def accuracy_vs_setting(results: pd.DataFrame, study: str = "sync", metric: str = IQM) -> Figure:
    """Final held-out accuracy (IQM, 95% interval) or collapse rate (Wilson) per estimator against the setting."""
    t = _rows(results, study, metric)
    fig = Figure(figsize=(9, 3.6), layout="constrained")
    ax = fig.subplots()
    _dodge(ax, t)
    ax.set_xlabel(AXIS[study])
    ax.set_ylabel("final held-out accuracy (IQM)" if metric == IQM else "collapse rate")
    if metric != IQM:
        ax.set_ylim(-0.03, 1.03)
    ax.legend(fontsize=8, ncol=1, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title(("Final held-out accuracy" if metric == IQM else "Collapse rate") + f": {study}", fontsize=11)
    return fig
