"""What the real_staleness_training report decides and draws: decisions from the study's Summary alone (which
estimators degrade as N grows and whether the seeds resolve it, which of VESPO's orderings the miniature reproduces,
Shen et al., arXiv 2602.10693, which corrections lose accuracy under a top-p sampler and whether mask replay wins it
back), the sentences in templates/, the miniature beside the paper's table, and figures from the tidy results table
(the training curves are the staleness_training study's figure)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from lab.reports.style import color
from lab.reports.templates import render
from lab.studies.real_staleness_training.study import LABEL, Summary
from lab.studies.staleness_training.paper import PAPER, PAPER_N, PAPER_NAMES
from lab.studies.staleness_training.report import reward_curves  # noqa: F401 - the notebook's training curves
from lab.typed import build

HERE = Path(__file__).parent
IQM = f"{LABEL}_iqm"
AXIS = {"sync": "mini-batches per rollout N (max staleness N - 1)",
        "async": "staleness bound η (lags drawn on 0..lag_max)",
        "mismatch": "sampler (bfloat16: weights and KV cache in bf16; +replay: the trainer replays its routes)",
        "truncation": "sampler (top-p 1: nothing cut; +replay: the trainer renormalises over the kept sets)"}


def summary_of(data: dict | Summary) -> Summary:
    return data if isinstance(data, Summary) else build(Summary, data)


def _iv(v: list, fmt: str = "{:.2f}") -> str:
    return f"{fmt.format(v[0])} [{fmt.format(v[1])}, {fmt.format(v[2])}]"


def _order(xs) -> list[str]:
    """Setting keys in display order: numerically when they are numbers, else as they first appear (the study writes
    the truncation settings in their display order)."""
    xs = list(dict.fromkeys(xs))
    try:
        return sorted(xs, key=float)
    except ValueError:
        return xs


def _settings(s: Summary, study: str) -> list[str]:
    """A study's setting keys in display order (the truncation study's as the summary lists them, without replay
    where nothing is cut: a no-op, reported on its own)."""
    if study == "truncation" and s.truncation:
        return [x for x, t in s.truncation.items() if t.truncates or not t.replay]
    return _order(next(iter(s.table[study].values())))


def _at(s: Summary, study: str, x: str) -> dict:
    """estimator -> IQM [value, lo, hi] at setting ``x``."""
    return {e: getattr(cells[x], IQM) for e, cells in s.table.get(study, {}).items() if x in cells}


def _apart(a: list, b: list) -> bool:
    """Two [value, lo, hi] whose intervals do not overlap."""
    return a[1] > b[2] or b[1] > a[2]


# ---- decisions ------------------------------------------------------------------------------------------------------

@dataclass
class Spread:
    """The highest and the lowest IQM at one setting, and whether their intervals are apart."""

    x: str
    highest: str
    high: list
    lowest: str
    low: list
    apart: bool
    mismatch: float | None = None  # mismatch study: mean |log pi_old - log mu| per token at this setting


def spread(s: Summary, study: str, x: str) -> Spread:
    at = _at(s, study, x)
    ranked = sorted(at, key=lambda e: -at[e][0])
    hi, lo = ranked[0], ranked[-1]
    return Spread(x, hi, at[hi], lo, at[lo], _apart(at[hi], at[lo]), (s.mismatch_size or {}).get(x))


@dataclass
class Sync:
    """The sync study at its smallest and largest N."""

    n_low: str
    n_high: str
    top: Spread  # at n_high
    low_intervals: list  # the distinct IQM intervals at n_low (on-policy every estimator is one)
    collapse: dict  # estimator -> collapse rate at n_high, highest IQM first
    fell: list  # the n_high interval wholly below the n_low one
    held: list
    kl: dict  # estimator -> median final KL to the warm start at n_high, nearest first
    clear_of_reinforce: list | None  # interval above REINFORCE's at n_high (None: REINFORCE not trained)


def sync(s: Summary) -> Sync | None:
    table = s.table.get("sync")
    if not table:
        return None
    xs = _order(next(iter(table.values())))
    lo_x, hi_x = xs[0], xs[-1]
    at_hi, at_lo = _at(s, "sync", hi_x), _at(s, "sync", lo_x)
    ranked = sorted(at_hi, key=lambda e: -at_hi[e][0])
    deg = s.degradation
    kl = {e: d.final_kl_to_init_median for e, d in deg.items() if d.final_kl_to_init_median is not None}
    clear = None
    if "reinforce" in at_hi:
        clear = [e for e in ranked if e != "reinforce" and at_hi[e][1] > at_hi["reinforce"][2]]
    return Sync(lo_x, hi_x, spread(s, "sync", hi_x), sorted({_iv(at_lo[e]) for e in at_lo}),
                {e: table[e][hi_x].collapse_rate[0] for e in ranked},
                [e for e in ranked if deg[e].degrades], [e for e in ranked if not deg[e].degrades],
                {e: kl[e] for e in sorted(kl, key=kl.get)}, clear)


@dataclass
class Orderings:
    """The paper's pairwise orderings at its largest staleness, as the miniature's seeds resolve them."""

    n: int
    rows: list  # Ordering
    reproduced: list  # "better > worse"
    reversed: list  # "worse > better"
    unresolved: int


def orderings(s: Summary) -> Orderings | None:
    if not s.orderings:
        return None
    o = s.orderings
    return Orderings(int(o[0].n), o, [f"{r.better} > {r.worse}" for r in o if r.verdict == "reproduced"],
                     [f"{r.worse} > {r.better}" for r in o if r.verdict == "reversed"],
                     sum(r.verdict == "not separated" for r in o))


@dataclass
class TruncationRow:
    """One estimator under one truncating sampler: against the untruncated sampler, and with mask replay."""

    estimator: str
    reference: list | None  # IQM [value, lo, hi] with the untruncated sampler, no replay (None: not run)
    plain: list | None  # under truncation, the trainer scoring the full vocabulary
    replayed: list | None  # under truncation, the trainer renormalising over the kept sets
    collapse: list  # collapse rate [plain, replayed] (None where not run)
    loses: bool | None  # plain's interval wholly below the reference's (None: one of them not run)
    replay: str | None  # replayed against plain: raises | lowers | not separated (None: one of them not run)
    recovery: str | None  # an estimator that loses: recovered (replay raises it, no longer below the reference) |
    # partly (raises it, still below) | not recovered (replay does not raise it); None otherwise


@dataclass
class Truncation:
    """One truncating sampler, over the estimators: who loses accuracy against the untruncated sampler and what mask
    replay does about it (every verdict from 95% intervals that do not overlap)."""

    sampler: str
    reference: str | None  # the untruncated setting's key (None: not run)
    kept_mass: float | None  # mean pi(S_t) without replay
    rows: list  # TruncationRow
    lost: list
    recovered: list
    partly: list
    not_recovered: list
    raised: list  # replay raised the accuracy, whether or not it had been lost
    lowered: list


def _apart_below(a: list, b: list) -> bool:
    """a's interval lies wholly below b's."""
    return a[2] < b[1]


def truncation(s: Summary) -> list[Truncation]:
    """Per truncating sampler: each estimator without replay against the untruncated sampler (loses: intervals
    apart, below), with replay against without (raises / lowers / not separated), and for those that lose, whether
    replay recovers it (raises it and is no longer below the untruncated sampler), partly (raises it, still below)
    or not (does not raise it)."""
    settings, table = s.truncation or {}, s.table.get("truncation", {})
    ref = next((x for x, t in settings.items() if not t.truncates and not t.replay), None)
    samplers: dict = {}  # sampler -> {replay: setting key}
    for x, t in settings.items():
        if t.truncates:
            samplers.setdefault(t.sampler, {})[t.replay] = x
    out = []
    for sampler, keys in samplers.items():
        rows = []
        for e, cells in table.items():
            def iqm(x):
                return getattr(cells[x], IQM) if x is not None and x in cells else None

            r, p, q = iqm(ref), iqm(keys.get(False)), iqm(keys.get(True))
            if p is None and q is None:
                continue
            loses = None if r is None or p is None else _apart_below(p, r)
            effect = None if p is None or q is None else \
                "raises" if _apart_below(p, q) else "lowers" if _apart_below(q, p) else "not separated"
            recovery = None
            if loses and q is not None:
                recovery = ("partly" if _apart_below(q, r) else "recovered") if effect == "raises" else \
                    "not recovered"
            collapse = [cells[k].collapse_rate[0] if k in cells else None for k in (keys.get(False), keys.get(True))]
            rows.append(TruncationRow(e, r, p, q, collapse, loses, effect, recovery))
        mass = settings[keys[False]].kept_mass if False in keys else settings[keys[True]].kept_mass
        out.append(Truncation(sampler, ref, mass, rows, [r.estimator for r in rows if r.loses],
                              *([r.estimator for r in rows if r.recovery == v]
                                for v in ("recovered", "partly", "not recovered")),
                              [r.estimator for r in rows if r.replay == "raises"],
                              [r.estimator for r in rows if r.replay == "lowers"]))
    return out


@dataclass
class Decisions:
    sync: Sync | None
    regimes: dict  # "async" / "mismatch" / "truncation" -> [Spread per setting]
    orderings: Orderings | None
    truncation: list  # Truncation, per truncating sampler


def decide(summary: dict | Summary) -> Decisions:
    s = summary_of(summary)
    regimes = {study: [spread(s, study, x) for x in _settings(s, study)]
               for study in ("async", "mismatch", "truncation") if s.table.get(study)}
    return Decisions(sync(s), regimes, orderings(s), truncation(s))


# ---- text -----------------------------------------------------------------------------------------------------------

def headline(name: str, summary: dict) -> str:
    """One line for the gallery: what the miniature reproduces of the paper's orderings at the largest N (without
    the sync study: what a top-p sampler costs and what mask replay wins back)."""
    s = summary_of(summary)
    o = orderings(s)
    if o is None:
        truncated = truncation(s)
        if truncated and truncated[0].reference is not None:
            return "; ".join(f"Under {t.sampler}: lost accuracy {', '.join(t.lost) or 'none'}"
                             + (f", mask replay recovered {', '.join(t.recovered) or 'none'}" if t.lost else "")
                             + f", replay raised {', '.join(t.raised) or 'none'}" for t in truncated)
        return ("fewer than two of the paper's estimators (ppo_clip, gspo, sapo, vespo) at two or more N in the "
                "sync study")
    return (f"At N = {o.n}: reproduced {', '.join(o.reproduced) or 'none'}; reversed "
            f"{', '.join(o.reversed) or 'none'}; {o.unresolved} of {len(o.rows)} paper orderings not separated by "
            f"the seeds")


def answer(summary: dict) -> str:
    """Markdown: the sync study at its largest N, the async and mismatch settings, and the paper's orderings."""
    s = summary_of(summary)
    return render(HERE, "answer.md", s=s, d=decide(s), iv=_iv, paper_names=PAPER_NAMES)


def truncation_table(summary: dict) -> pd.DataFrame:
    """The truncation study per estimator (rows) and setting (columns, untruncated first): final held-out accuracy,
    IQM [95% interval], and the collapse rate."""
    s = summary_of(summary)
    xs = _settings(s, "truncation") if s.table.get("truncation") else []
    rows = []
    for e, cells in s.table.get("truncation", {}).items():
        row = {"estimator": e}
        for x in xs or _order(cells):
            if x in cells:
                row[x] = f"{_iv(getattr(cells[x], IQM))}, collapse {cells[x].collapse_rate[0]:.0%}"
        rows.append(row)
    return pd.DataFrame(rows)


def paper_table(summary: dict) -> pd.DataFrame:
    """The miniature's IQM [interval] per estimator and N beside the paper's accuracy at the same N."""
    s = summary_of(summary)
    rows = []
    for e, cells in s.table.get("sync", {}).items():
        row = {"estimator": e}
        for x in _order(cells):
            row[f"N={x}"] = _iv(getattr(cells[x], IQM))
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
