"""What the staleness_training report says and draws: answer text from the study's summary alone, the comparison
with VESPO's staleness table (Shen et al., arXiv 2602.10693), figures from the tidy results table (and the training
curves from the summary). The numbers come from ``lab.studies.staleness_training``."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from lab.errors import LabError
from lab.reports.style import color, interval
from lab.studies.staleness_training import PAPER_NAMES, RANK_TIE, setting_key

AXIS_LABELS = {"sync": "mini-batches per rollout N (max staleness N - 1)",
               "async": "staleness bound η (largest lag admitted as is)",
               "mismatch": "sampler log-prob noise σ (train/inference mismatch)"}
KNOBS = {"sync": "N", "async": "staleness bound η", "mismatch": "sampler log-prob noise σ"}


def _iv(v: list, fmt: str = "{:.2f}") -> str:
    return interval(*v, fmt)


def _cell(summary: dict, study: str, e: str, x, metric: str = "final_reward_iqm") -> list:
    return summary["table"][study][e][setting_key(x)][metric]


def _values(summary: dict, study: str) -> list[float]:
    return summary["settings"][study]["values"]


# ---- text -----------------------------------------------------------------------------------------------------------

def headline(summary: dict) -> str:
    """One line: the best and the worst final reward at the largest N (and VESPO's, when it is neither)."""
    if "sync" not in summary["table"]:
        return "no synchronous staleness study in this run"
    n_hi = _values(summary, "sync")[-1]
    at = {e: _cell(summary, "sync", e, n_hi) for e in summary["table"]["sync"]}
    best = max(at, key=lambda e: at[e][0])
    worst = min(at, key=lambda e: at[e][0])
    line = f"N={n_hi:g}: best final reward {best} {_iv(at[best])}, worst {worst} {_iv(at[worst])} (IQM over seeds)"
    if "vespo" in at and best != "vespo":
        line += f"; vespo {_iv(at['vespo'])}"
    return line


def _setup(summary: dict) -> str:
    s = summary["setup"]
    return (f"**Setup.** `{s['env']}` ({s['length']}-token responses over {s['vocab_size']} tokens, "
            f"{s['n_prompts']} prompt{'s' if s['n_prompts'] != 1 else ''}), `{s['policy']}` policy, rollouts of "
            f"{s['rollout_batch']} responses ({s['group_size']} per prompt), Adam lr {s['lr']}, {s['steps']} rollouts "
            f"per run, {s['seeds']} seeds per cell. Score: the exact expected reward J after the last update.")


def _glance(summary: dict, n1, nh) -> str:
    """How much staleness costs, whether any correction clearly helps over all N, and collapses."""
    sync = summary["table"]["sync"]
    at1 = [_cell(summary, "sync", e, n1)[0] for e in sync]
    ath = [_cell(summary, "sync", e, nh)[0] for e in sync]
    first = f"{min(at1):.2f}" if max(at1) - min(at1) < 0.005 else f"{min(at1):.2f}-{max(at1):.2f}"
    text = (f"**At a glance.** Final reward IQM {first} at N = {n1:g} against {min(ath):.2f}-{max(ath):.2f} at "
            f"N = {nh:g} across estimators. ")
    rates = [(e, float(x), cell["collapse_rate"]) for e, cells in sync.items() for x, cell in cells.items()]
    if all(r[2][0] == 0 for r in rates):
        text += (f"No run met the collapse rule ({summary['runs']['sync']} runs; Wilson upper bound per cell "
                 f"{max(r[2][2] for r in rates):.0%}): failures here are runs that never find the reward, not "
                 f"collapses. ")
    else:
        e, x, r = max(rates, key=lambda r: r[2][0])
        text += f"Highest collapse rate: {e} at {x:g}, {r[0]:.0%}. "
    poi = summary["poi_all"].get("sync")
    if poi:
        above = [e for e, v in poi.items() if v[1] > 0.5]
        below = [e for e, v in poi.items() if v[2] < 0.5]
        text += (f"Over all N, {', '.join(above) if above else 'no estimator'} beat{'s' if len(above) == 1 else ''} "
                 f"`{summary['baseline']}` with a probability-of-improvement interval above 0.5"
                 + (f"; {', '.join(below)} fall{'s' if len(below) == 1 else ''} below it" if below else "") + ".")
    return text


def _sync_lines(summary: dict) -> list[str]:
    sync = summary["table"]["sync"]
    xs = _values(summary, "sync")
    n1, nh = xs[0], xs[-1]
    lines = [_glance(summary, n1, nh), "",
             f"**Synchronous mini-batching, N = {n1:g} against N = {nh:g}** (final J, IQM over seeds [95% stratified "
             f"bootstrap]; collapse rate [Wilson 95%]):", "",
             f"| estimator | N = {n1:g} | N = {nh:g} | collapses at N = {nh:g} |", "|---|---|---|---|"]
    lines += [f"| {e} | {_iv(_cell(summary, 'sync', e, n1))} | {_iv(_cell(summary, 'sync', e, nh))} | "
              f"{_iv(_cell(summary, 'sync', e, nh, 'collapse_rate'), '{:.0%}')} |" for e in sync]
    at_hi = {e: _cell(summary, "sync", e, nh) for e in sync}
    best = max(at_hi, key=lambda e: at_hi[e][0])
    tied = [e for e in sync if e != best and at_hi[e][2] >= at_hi[best][1]]
    lines += ["", f"- **Highest at N = {nh:g}: {best}**" + (
        f"; its interval overlaps {', '.join(tied)}: not separated at this number of seeds." if tied
        else ", clear of every other estimator's interval.")]
    poi = summary["poi_all"].get("sync")
    if poi:
        b = summary["baseline"]
        lines.append(f"- **Probability of improvement over `{b}`** (chance that a run's final J beats a `{b}` run's, "
                     f"averaged over N; 0.5 = no difference): "
                     + ", ".join(f"{e} {_iv(v)}" for e, v in poi.items()) + ".")
    lines.append(paper_lines(summary))
    return lines


def _spread(summary: dict, study: str) -> float:
    """The largest gap between the estimators' IQMs at one setting value."""
    table = summary["table"][study]
    return max(max(v) - min(v) for v in ([_cell(summary, study, e, x)[0] for e in table]
                                         for x in _values(summary, study)))


def _regime_line(summary: dict, study: str) -> str:
    xs = _values(summary, study)
    parts = [f"{e} {_cell(summary, study, e, xs[0])[0]:.2f} → {_iv(_cell(summary, study, e, xs[-1]))}"
             for e in summary["table"][study]]
    line = (f"- **{study.capitalize()}** ({KNOBS[study]} {setting_key(xs[0])} → {setting_key(xs[-1])}): "
            + "; ".join(parts) + ".")
    spread = _spread(summary, study)
    if study == "mismatch":
        aware = [e for e in summary["mismatch_aware"] if e in summary["table"][study]]
        n = summary["setup"]["mismatch_minibatches"]
        line += (f" At N = {n} an estimator that does not read the sampler's log-probs sees π/π_old = 1 and is "
                 f"REINFORCE: only {', '.join(aware) if aware else 'none of these'} can correct the mismatch here "
                 f"(largest IQM gap between estimators: {spread:.2f}).")
    elif spread < 0.02:
        line += (f" The estimators coincide (IQMs within {spread:.3f} at every setting). Possible reasons: lags are "
                 f"capped by the versions that exist, so the first rollouts are nearly on-policy, and a group whose "
                 f"responses all score the same carries no advantage, so once a prompt is solved or stuck staleness "
                 f"has nothing left to act on.")
    return line


def answer(summary: dict) -> str:
    """Markdown: what the figures show, with numbers and intervals, and how it compares with VESPO's table."""
    lines = [_setup(summary), ""]
    if "sync" in summary["table"]:
        lines += _sync_lines(summary)
    lines += [_regime_line(summary, s) for s in ("async", "mismatch") if s in summary["table"]]
    return "\n".join(lines)


def _order(order: list, ests: dict, key: str) -> str:
    text = PAPER_NAMES[order[0]]
    for a, b in zip(order, order[1:]):
        text += (" = " if abs(ests[a][key] - ests[b][key]) < RANK_TIE else " > ") + PAPER_NAMES[b]
    return text


def paper_lines(summary: dict) -> str:
    """The comparison with VESPO's staleness table: order at the largest shared N, changes, VESPO's rank."""
    pc = summary["paper_comparison"]
    if not pc:
        return "- **VESPO's table**: the sweep shares fewer than two N with the paper (4..64); no comparison."
    ests, lo_n, hi_n = pc["estimators"], pc["n_low"], pc["n_high"]
    toy_order = sorted(ests, key=lambda e: -ests[e]["toy_high"])
    paper_order = sorted(ests, key=lambda e: -ests[e]["paper_high"])
    text = (f"- **Against VESPO's table** (paper: accuracy on Qwen3-30B-A3B; `ppo_clip` stands in for GRPO). "
            f"Order at N = {hi_n:g}: paper {_order(paper_order, ests, 'paper_high')}; toy "
            f"{_order(toy_order, ests, 'toy_high')} (IQM). Change from N = {lo_n:g} to {hi_n:g}: "
            + ", ".join(f"{PAPER_NAMES[e]} paper {100 * (ests[e]['paper_high'] - ests[e]['paper_low']):+.1f} pts, "
                        f"toy {ests[e]['toy_high'] - ests[e]['toy_low']:+.2f}" for e in ests) + ".")
    if "vespo" in ests:
        text += _vespo_verdict(summary, ests, hi_n)
    return text


def _vespo_verdict(summary: dict, ests: dict, hi_n) -> str:
    v = ests["vespo"]
    others = [e for e in ests if e != "vespo"]
    beats = [e for e in others if v["toy_high_interval"][0] > ests[e]["toy_high_interval"][1]]
    below = [e for e in others if v["toy_high_interval"][1] < ests[e]["toy_high_interval"][0]]
    text = f" VESPO ranks {v['toy_rank']} of {len(ests)} in the toy at N = {hi_n:g} (1 of {len(ests)} in the paper)."
    if len(beats) == len(others):
        return text + " **The toy agrees**: VESPO is highest at the largest N with intervals clear of the others."
    unresolved = [e for e in others if e not in beats and e not in below]
    text += (" **The toy does not reproduce the paper's separation**: "
             + (f"VESPO's interval is above {', '.join(beats)}; " if beats else "")
             + (f"below {', '.join(below)}; " if below else "")
             + (f"its interval overlaps {', '.join(unresolved)}. " if unresolved else ""))
    return text + _why(summary, hi_n, ests)


def _why(summary: dict, n_hi, ests: dict) -> str:
    """The measured reasons the toy and the paper can disagree at N = n_hi (sync study)."""
    o = summary.get("outcomes", {}).get(setting_key(n_hi))
    if not o:
        return ""
    s = summary["setup"]
    iqms = [ests[e]["toy_high"] for e in ests]
    spread = max(iqms) - min(iqms)
    text = (f"The numbers suggest why: {o['whole_share']:.0%} of the runs at N = {n_hi:g} end within 0.02 of a whole "
            f"number of solved prompts (J = k/{s['n_prompts']})")
    if o["whole_share"] >= 0.5:
        text += (": each prompt ends either solved or never solved, so the outcome is decided early by whether a run "
                 "finds the reward")
    text += (f"; seeds differ {'more' if o['seed_range'] > spread else 'less'} (median range over seeds "
             f"{o['seed_range']:.2f}) than estimators do (IQM spread {spread:.2f})")
    if not math.isnan(o["zero_reward_share"]):
        text += f"; {o['zero_reward_share']:.0%} of the N = {n_hi:g} mini-batches hold no rewarded response"
    return text + (f". The toy is also small where the paper is large: {s['length']}-token responses (sequence ratios "
                   f"multiply {s['length']} token ratios, not thousands), a `{s['policy']}` policy with "
                   f"{s['policy_params']:,} parameters and rollouts of {s['rollout_batch']} responses rather than "
                   f"thousands, so the extreme sequence ratios that separate the corrections in the paper rarely "
                   f"occur. More seeds, an env with longer responses or a denser reward would test it harder.")


# ---- figures (one function per figure, a matplotlib Figure without pyplot) ------------------------------------------

def _get(results: pd.DataFrame, study: str, metric: str, estimator: str) -> pd.DataFrame:
    t = results[(results["study"] == study) & (results["metric"] == metric) & (results["estimator"] == estimator)]
    return t.set_index("x")[["value", "lo", "hi"]].sort_index()


def _estimators(results: pd.DataFrame, study: str) -> list[str]:
    return list(dict.fromkeys(results[results["study"] == study]["estimator"]))


def reward_curves(summary: dict, label: str = "N") -> Figure:
    """One panel per N of the sync study: IQM over seeds of J after each rollout, per estimator, with a light band
    between the seeds' 25th and 75th percentiles."""
    data = summary["curves"]
    xs = list(data)
    ncol = min(3, len(xs))
    nrow = math.ceil(len(xs) / ncol)
    fig = Figure(figsize=(4.2 * ncol, 3.0 * nrow), layout="constrained")
    axes = fig.subplots(nrow, ncol, squeeze=False, sharex=True, sharey=True)
    for ax, x in zip(axes.flat, xs):
        for e, c in data[x].items():
            r = np.asarray(c["rollout"]) + 1
            ax.plot(r, c["iqm"], color=color(e), label=e, lw=1.6, alpha=0.9)
            ax.fill_between(r, c["q25"], c["q75"], color=color(e), alpha=0.06, lw=0)
        ax.set_title(f"{label} = {x}", fontsize=10)
        ax.set_ylim(-0.03, 1.03)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(xs):]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("rollouts consumed")
    for ax in axes[:, 0]:
        ax.set_ylabel("expected reward J")
    axes.flat[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("Training curves: IQM over seeds (light band: 25th-75th percentile of seeds)", fontsize=11)
    return fig


def _dodge_plot(ax, results: pd.DataFrame, study: str, metric: str, ests: list[str]) -> None:
    """Per estimator: value with [lo, hi] error bars at evenly spaced setting positions, dodged sideways."""
    xs = sorted(results[results["study"] == study]["x"].dropna().unique())
    pos = {x: i for i, x in enumerate(xs)}
    width = 0.5 / max(len(ests), 1)
    for k, e in enumerate(ests):
        t = _get(results, study, metric, e)
        p = np.array([pos[x] for x in t.index]) + (k - (len(ests) - 1) / 2) * width
        ax.errorbar(p, t["value"], yerr=[t["value"] - t["lo"], t["hi"] - t["value"]], color=color(e), marker="o",
                    ms=4, lw=1.0, elinewidth=1.0, capsize=2, alpha=0.9, label=e)
    ax.set_xticks(range(len(xs)), [setting_key(x) for x in xs])
    ax.grid(alpha=0.3)


def _vs_setting(results, study, metric, ylabel, title, legend_loc, height) -> Figure:
    ests = _estimators(results, study)
    fig = Figure(figsize=(8.5, height), layout="constrained")
    ax = fig.subplots()
    _dodge_plot(ax, results, study, metric, ests)
    ax.set_xlabel(AXIS_LABELS[study])
    ax.set_ylabel(ylabel)
    ax.set_ylim(-0.03, 1.03)
    ax.legend(fontsize=8, ncol=min(6, len(ests)), loc=legend_loc)
    ax.set_title(title, fontsize=11)
    return fig


def final_vs_setting(results: pd.DataFrame, study: str = "sync") -> Figure:
    """Final J (IQM over seeds, 95% stratified-bootstrap interval) against the study's setting, per estimator."""
    title = ("Final reward vs staleness (the toy counterpart of VESPO's table)" if study == "sync"
             else f"Final reward: {study}")
    return _vs_setting(results, study, "final_reward_iqm", "final expected reward J (IQM)", title, "lower left", 3.8)


def collapse_vs_setting(results: pd.DataFrame, study: str = "sync") -> Figure:
    """Collapse rate (share of seeds whose run met the training collapse rule) with Wilson 95% intervals."""
    return _vs_setting(results, study, "collapse_rate", "collapse rate",
                       "Collapse rate (Wilson 95% interval over seeds)", "upper left", 3.2)


def regimes(results: pd.DataFrame) -> Figure:
    """Two panels: final J against the async staleness bound η and against the sampler mismatch level."""
    studies = [s for s in ("async", "mismatch") if s in set(results["study"])]
    if not studies:
        raise LabError("no async or mismatch study in this table; sweep etas or noise levels to draw this figure")
    ests = list(dict.fromkeys(results[results["study"].isin(studies)]["estimator"]))
    fig = Figure(figsize=(5.2 * len(studies), 3.8), layout="constrained")
    axes = fig.subplots(1, len(studies), squeeze=False)[0]
    for ax, s in zip(axes, studies):
        _dodge_plot(ax, results, s, "final_reward_iqm", ests)
        ax.set_xlabel(AXIS_LABELS[s], fontsize=9)
        ax.set_ylim(-0.03, 1.03)
        ax.set_title(s, fontsize=10)
    axes[0].set_ylabel("final expected reward J (IQM)")
    axes[0].legend(fontsize=8, loc="lower left")
    return fig


def poi_figure(results: pd.DataFrame, study: str = "sync") -> Figure:
    """Probability of improvement over the baseline per setting value, with bootstrap intervals; 0.5 = a tie."""
    t = results[(results["study"] == study) & (results["metric"] == "poi_vs_baseline")]
    if t.empty:
        raise LabError("no probability of improvement in this table; summarise with a baseline")
    b = t["baseline"].iloc[0]
    ests = [e for e in dict.fromkeys(t["estimator"]) if e != b]
    fig = Figure(figsize=(8.5, 3.2), layout="constrained")
    ax = fig.subplots()
    _dodge_plot(ax, results[results["estimator"] != b], study, "poi_vs_baseline", ests)
    ax.axhline(0.5, color="k", lw=0.8, ls="--")
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel(AXIS_LABELS[study])
    ax.set_ylabel(f"P(final J > {b}'s)")
    ax.legend(fontsize=8, ncol=min(6, len(ests)), loc="lower left")
    ax.set_title(f"Probability of improvement over {b} (stratified bootstrap 95%)", fontsize=11)
    return fig
