"""What the length_scaling report decides, from the study's Summary alone; the sentences are in templates/.

Relative numbers are against c ‖∇J‖ (the estimator's target): ‖bias‖ ÷ ‖∇J‖, √variance ÷ ‖∇J‖, MSE ÷ ‖∇J‖². The
report flags where theory and measurement disagree:

- ``markov``: the exact growth rate of log E_μ[W²] (DP) differs from the independent-token theory
  T log(1 + χ²_token) by more than ``RATE_TOLERANCE`` (relative, and 0.1 nats over the lengths): the tokens'
  dependence matters;
- ``variance``: the sampled growth rate of Var(seq_is) ÷ Var(reinforce) has an interval that excludes the theory's
  rate (typically where k-hat > 0.7: a sample does not see the weight's tail, so its variance stops growing);
- ``first_order``: the exact token-level bias is off its first-order prediction by more than ``FIRST_ORDER_BAND``;
- ``engine``: a sampled bias interval excludes the exact (DP) bias of the same estimator;
- ``khat``: the sampled k-hat exceeds 0.7 (importance sampling with these weights is unreliable).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from lab.reports.style import color, interval, table
from lab.reports.templates import render
from lab.studies.length_scaling.study import Fit, Point, Summary
from lab.typed import build

HERE = Path(__file__).parent
RATE_TOLERANCE = 0.1  # relative gap between the exact (DP) and the independent-token growth rates worth a flag
FIRST_ORDER_BAND = (0.8, 1.25)  # exact bias / first-order prediction within which first order holds
KHAT_UNRELIABLE = 0.7


def summary_of(data: dict | Summary) -> Summary:
    return data if isinstance(data, Summary) else build(Summary, data)


@dataclass
class Flag:
    regime: str
    length: int | None  # None: about the fit over every length
    kind: str  # markov | variance | first_order | engine | khat (module docstring)
    estimator: str
    measured: float
    expected: float


@dataclass
class Decisions:
    """Per regime: the points by length, the fit, the lowest-MSE estimator at each length, the lengths where that
    changes (flips), and the flags."""

    points: dict  # regime -> [Point] by length
    fits: dict  # regime -> Fit
    best: dict  # regime -> {length: name}
    flips: dict  # regime -> [(length before, name before, length, name)]
    flags: list


def _best(p: Point) -> str:
    mse = {n: v["rel_mse"] for n, v in p.estimators.items() if math.isfinite(v["rel_mse"])}
    return min(mse, key=mse.get) if mse else "-"


def _rate_flags(fit: Fit, span: float) -> list[Flag]:
    """``span``: the range of lengths; the rates' gap matters when it moves log E[W²] across that range by more than
    RATE_TOLERANCE relative to the theory's own change, and by at least RATE_TOLERANCE nats."""
    out = []
    if abs(fit.dp_rate - fit.theory_rate) * span > RATE_TOLERANCE * max(1.0, abs(fit.theory_rate) * span):
        out.append(Flag(fit.regime, None, "markov", "seq_is", fit.dp_rate, fit.theory_rate))
    v, lo, hi = fit.measured_rate
    if math.isfinite(v) and not lo <= fit.theory_rate <= hi:
        out.append(Flag(fit.regime, None, "variance", "seq_is", v, fit.theory_rate))
    return out


def _point_flags(p: Point) -> list[Flag]:
    out = []
    for name, e in p.exact.items():
        ratio = e["rel_bias"] / e["first_order"] if e["first_order"] > 0 else math.inf
        if not FIRST_ORDER_BAND[0] <= ratio <= FIRST_ORDER_BAND[1]:
            out.append(Flag(p.regime, p.length, "first_order", name, e["rel_bias"], e["first_order"]))
        if name in p.intervals:
            lo, hi = p.intervals[name]["rel_bias"]
            if not lo <= e["rel_bias"] <= hi:
                out.append(Flag(p.regime, p.length, "engine", name, p.estimators[name]["rel_bias"], e["rel_bias"]))
    if p.khat[0] > KHAT_UNRELIABLE:
        out.append(Flag(p.regime, p.length, "khat", "-", p.khat[0], KHAT_UNRELIABLE))
    return out


def decide(summary: Summary) -> Decisions:
    points, fits, best, flips, flags = {}, {}, {}, {}, []
    for regime in summary.regimes:
        pts = sorted([p for p in summary.points if p.regime == regime], key=lambda p: p.length)
        points[regime] = pts
        fits[regime] = next(f for f in summary.fits if f.regime == regime)
        best[regime] = {p.length: _best(p) for p in pts}
        flips[regime] = [(a.length, best[regime][a.length], b.length, best[regime][b.length])
                         for a, b in zip(pts, pts[1:]) if best[regime][a.length] != best[regime][b.length]]
        flags += _rate_flags(fits[regime], pts[-1].length - pts[0].length)
        for p in pts:
            flags += _point_flags(p)
    return Decisions(points, fits, best, flips, flags)


def headline(name: str, summary: dict) -> str:
    """One line for the gallery: per-token growth of sequence-IS variance, measured against theory, at fixed
    per-token KL (else the first regime), and the lowest MSE at the longest length."""
    s = summary_of(summary)
    d = decide(s)
    regime = "token" if "token" in s.regimes else s.regimes[0]
    fit, first, longest = d.fits[regime], d.points[regime][0], d.points[regime][-1]
    text = f"{regime} KL fixed, T {first.length}–{longest.length}: lowest MSE {d.best[regime][longest.length]}"
    if math.isfinite(fit.measured_rate[0]):
        text += (f"; seq-IS variance grows {fit.measured_rate[0]:.3g}/token measured vs "
                 f"{fit.theory_rate:.3g} theory")
    n = len(d.flags)
    return text + (f"; {n} disagreement{'s' if n != 1 else ''} flagged" if n else "; theory and measurement agree")


def answer(summary: dict) -> str:
    s = summary_of(summary)
    d = decide(s)
    return render(HERE, "answer.md", s=s, d=d, flags=[describe(f) for f in d.flags])


def describe(f: Flag) -> str:
    """One sentence per flag, with its numbers."""
    where = f"{f.regime}-KL regime" + (f", T = {f.length}" if f.length is not None else "")
    if f.kind == "markov":
        return (f"{where}: log E_μ[W²] grows {f.measured:.3g}/token exactly, the independent-token theory says "
                f"{f.expected:.3g}: the tokens' Markov dependence changes the rate.")
    if f.kind == "variance":
        return (f"{where}: the sampled seq-IS variance grows {f.measured:.3g}/token, the theory (1 + χ²)^T says "
                f"{f.expected:.3g}; where k-hat > 0.7 a batch does not see the weight's tail.")
    if f.kind == "first_order":
        return (f"{where}: {f.estimator}'s exact bias {f.measured:.3g}×‖∇J‖ is off its first-order prediction "
                f"{f.expected:.3g}×: higher orders matter.")
    if f.kind == "engine":
        return (f"{where}: {f.estimator}'s sampled bias {f.measured:.3g}×‖∇J‖ has an interval that excludes the "
                f"exact {f.expected:.3g}×.")
    return f"{where}: k-hat {f.measured:.2f} > 0.7: importance sampling with these weights is unreliable."


def length_table(summary: dict, regime: str):
    """Per length: the exact divergences, the theory's and the DP's log E[W²], ESS and k-hat, each estimator's MSE ÷
    ‖∇J‖² [interval] (lowest starred) and token-IS's bias, exact, first-order and sampled."""
    s = summary_of(summary)
    d = decide(s)
    rows, marks = [], {}
    for i, p in enumerate(d.points[regime]):
        row = {"T": p.length, "KL/token": f"{p.kl_token:.2g}", "KL seq": f"{p.kl_seq:.3g}",
               "log E[W²] DP": f"{p.log_m2:.3g}", "T·log(1+χ²)": f"{p.mean_len * math.log1p(p.chi2_token):.3g}",
               "ESS": interval(*p.ess_frac, "{:.0%}"), "k-hat": interval(*p.khat, "{:.2f}")}
        for n in p.estimators:
            row[n] = interval(p.estimators[n]["rel_mse"], *p.intervals[n]["rel_mse"])
        if "token_is" in p.exact:
            e = p.exact["token_is"]
            row["token_is bias: exact / 1st order"] = f"{e['rel_bias']:.3g} / {e['first_order']:.3g}"
        rows.append(row)
        marks[i] = [d.best[regime][p.length]]
    return table(pd.DataFrame(rows), f"{regime}-KL regime: MSE ÷ ‖∇J‖² per estimator [95% bootstrap interval], "
                                     f"lowest marked; divergences exact (dynamic programming).", marks)


def growth_figure(summary: dict):
    """Per regime: log E_μ[W²] exact and from the theory, and log(Var seq_is ÷ Var reinforce) sampled, against T."""
    s = summary_of(summary)
    d = decide(s)
    fig, axes = plt.subplots(1, len(s.regimes), figsize=(5.5 * len(s.regimes), 3.8), squeeze=False)
    for ax, regime in zip(axes[0], s.regimes):
        pts = d.points[regime]
        T = [p.length for p in pts]
        ax.plot(T, [p.log_m2 for p in pts], "o-", color="black", label="log E[W²] (exact, DP)")
        ax.plot(T, [p.mean_len * math.log1p(p.chi2_token) for p in pts], "--", color="grey",
                label="T log(1+χ²_token) (independent tokens)")
        if {"seq_is", "reinforce"} <= set(pts[0].estimators):
            ratio = [math.log(p.estimators["seq_is"]["variance"] / p.estimators["reinforce"]["variance"])
                     for p in pts]
            ax.plot(T, ratio, "s-", color=color("seq_is"), label="log Var(seq_is)/Var(reinforce) (sampled)")
        ax.set_xscale("log")
        ax.set_xlabel("response length T")
        ax.set_title(f"{regime}-KL fixed")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def mse_figure(results: pd.DataFrame):
    """Per regime: each estimator's MSE ÷ ‖∇J‖² and relative bias against T (log-log), with interval bands."""
    results = results[results.policy == "markov"]
    regimes = list(dict.fromkeys(results.regime))
    fig, axes = plt.subplots(2, len(regimes), figsize=(5.5 * len(regimes), 7), squeeze=False)
    for j, regime in enumerate(regimes):
        sub = results[(results.regime == regime) & (results.estimator != "-")]
        for i, metric in enumerate(("rel_mse", "rel_bias")):
            ax = axes[i][j]
            for name, g in sub[sub.metric == metric].groupby("estimator", sort=False):
                g = g.sort_values("length")
                ax.plot(g.length, g.value, "o-", color=color(name), label=name)
                ax.fill_between(g.length, g.lo, g.hi, color=color(name), alpha=0.15)
            exact = sub[sub.metric == "exact_rel_bias"]
            for name, g in exact.groupby("estimator", sort=False):
                if metric == "rel_bias":
                    g = g.sort_values("length")
                    ax.plot(g.length, g.value, "x:", color=color(name), label=f"{name} exact (DP)")
            ax.set_xscale("log")
            ax.set_yscale("symlog", linthresh=1e-2)
            ax.set_xlabel("response length T")
            ax.set_ylabel("MSE ÷ ‖∇J‖²" if metric == "rel_mse" else "‖bias‖ ÷ ‖∇J‖")
            ax.set_title(f"{regime}-KL fixed")
        axes[0][j].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def diagnostics_figure(results: pd.DataFrame):
    """Sampled ESS (share of the batch) and k-hat against T, per regime."""
    diag = results[(results.policy == "markov") & (results.estimator == "-")]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for regime, g in diag.groupby("regime", sort=False):
        for ax, metric in zip(axes, ("ess_frac", "khat")):
            m = g[g.metric == metric].sort_values("length")
            ax.plot(m.length, m.value, "o-", label=f"{regime}-KL fixed")
            ax.fill_between(m.length, m.lo, m.hi, alpha=0.15)
    axes[0].set_ylabel("ESS ÷ batch")
    axes[1].set_ylabel("k-hat")
    axes[1].axhline(KHAT_UNRELIABLE, color="grey", ls="--", lw=0.8)
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xlabel("response length T")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# ---- the transformer staleness table across lengths (summary["staleness"]) ----------------------------------------

@dataclass
class LengthOrder:
    """One study's setting at one length: the estimators by IQM, highest first, and whether the first and the last
    are apart (non-overlapping intervals)."""

    length: int
    ranked: list  # [(estimator, [value, lo, hi])]
    apart: bool


@dataclass
class StalenessDecisions:
    """What the staleness section states: per study, its largest setting's order at every length; the flips; and
    per length VESPO's orderings reproduced, reversed or not separated."""

    settings: dict  # study -> the largest setting key (N or eta)
    orders: dict  # study -> [LengthOrder] by length, at that setting
    flips: list  # staleness.Flip
    reproduced: dict  # length -> ["better > worse"]
    reversed: dict  # length -> ["worse > better"]
    unresolved: dict  # length -> count of paper pairs not separated
    appears: list  # lengths where every paper pair trained here is reproduced and at least one is
    ordering_n: float | None  # the N at which the paper's orderings are checked (the largest trained)


def _setting_order(xs) -> list:
    return sorted(xs, key=float)


def decide_staleness(summary: dict | Summary) -> StalenessDecisions | None:
    t = summary_of(summary).staleness
    if t is None:
        return None
    settings, orders = {}, {}
    for study, by_length in t.table.items():
        xs = _setting_order({x for cells in by_length.values() for c in cells.values() for x in c})
        settings[study] = xs[-1]
        orders[study] = []
        for T in sorted(by_length, key=int):
            at = {e: c[xs[-1]].final_accuracy_iqm for e, c in by_length[T].items() if xs[-1] in c}
            ranked = sorted(at.items(), key=lambda kv: -kv[1][0])
            apart = len(ranked) > 1 and ranked[0][1][1] > ranked[-1][1][2]
            orders[study].append(LengthOrder(int(T), ranked, apart))
    reproduced, reversed_, unresolved, appears, n = {}, {}, {}, [], None
    for T, rows in t.orderings.items():
        n = rows[0].n if rows else n
        reproduced[int(T)] = [f"{r.better} > {r.worse}" for r in rows if r.verdict == "reproduced"]
        reversed_[int(T)] = [f"{r.worse} > {r.better}" for r in rows if r.verdict == "reversed"]
        unresolved[int(T)] = sum(r.verdict == "not separated" for r in rows)
        if rows and len(reproduced[int(T)]) == len(rows):
            appears.append(int(T))
    return StalenessDecisions(settings, orders, list(t.flips), reproduced, reversed_, unresolved, sorted(appears), n)


def describe_flip(f) -> str:
    """One sentence per flip, with both lengths' intervals."""
    what = f"N = {f.setting}" if f.study == "sync" else f"η = {f.setting}"
    return (f"{f.study}, {what}: {f.first} {interval(*f.first_at_a, '{:.2f}')} above {f.second} "
            f"{interval(*f.second_at_a, '{:.2f}')} at T = {f.length_a}, below it at T = {f.length_b} "
            f"({interval(*f.first_at_b, '{:.2f}')} against {interval(*f.second_at_b, '{:.2f}')}).")


def staleness_answer(summary: dict) -> str:
    """Markdown for the transformer staleness section: where the full table comes from when it was not run, else
    the setup, the order at the largest setting per length, the flips and VESPO's orderings at each length."""
    s = summary_of(summary)
    d = decide_staleness(s)
    return render(HERE, "staleness.md", t=s.staleness, d=d, flips=[describe_flip(f) for f in (d.flips if d else [])],
                  iv=lambda v: interval(*v, "{:.2f}"))


def staleness_table(summary: dict, study: str = "sync"):
    """Per estimator and setting, the final held-out accuracy's IQM [95% interval] at each length; the highest at
    each (length, setting) marked."""
    t = summary_of(summary).staleness
    by_length = t.table[study]
    lengths = sorted(by_length, key=int)
    xs = _setting_order({x for cells in by_length.values() for c in cells.values() for x in c})
    name = "N" if study == "sync" else "η"
    rows, marks = [], {}
    for e in t.estimators:
        for x in xs:
            row = {"estimator": e, name: x}
            for T in lengths:
                cell = by_length[T].get(e, {}).get(x)
                row[f"T={T}"] = interval(*cell.final_accuracy_iqm, "{:.2f}") if cell else "–"
            rows.append(row)
    df = pd.DataFrame(rows)
    for T in lengths:
        for x in xs:
            at = {i: by_length[T][r["estimator"]][x].final_accuracy_iqm[0] for i, r in df.iterrows()
                  if r[name] == x and x in by_length[T].get(r["estimator"], {})}
            if at:
                best = max(at, key=at.get)
                marks.setdefault(best, []).append(f"T={T}")
    return table(df, f"{study}: final held-out exact accuracy, IQM over {t.seeds} seeds [95% stratified-bootstrap "
                     f"interval], per answer length T; the highest at each T and {name} marked.", marks)


def staleness_figure(summary: dict):
    """Per study, at its largest setting: each estimator's IQM (95% interval) against the answer length T."""
    s = summary_of(summary)
    d = decide_staleness(s)
    fig, axes = plt.subplots(1, len(d.orders), figsize=(5.5 * len(d.orders), 3.6), squeeze=False)
    for ax, (study, orders) in zip(axes[0], d.orders.items()):
        for e in s.staleness.estimators:
            pts = [(o.length, dict(o.ranked)[e]) for o in orders if e in dict(o.ranked)]
            T = [p[0] for p in pts]
            v = [p[1] for p in pts]
            ax.errorbar(T, [x[0] for x in v], yerr=[[x[0] - x[1] for x in v], [x[2] - x[0] for x in v]], marker="o",
                        ms=4, capsize=2, color=color(e), label=e)
        ax.set_xscale("log", base=2)
        lengths = [o.length for o in orders]
        ax.set_xticks(lengths, [str(t) for t in lengths])  # the lengths trained, not powers of ten
        ax.minorticks_off()
        ax.set_xlabel("answer length T")
        ax.set_ylabel("final held-out accuracy (IQM)")
        ax.set_title(f"{study}, {'N' if study == 'sync' else 'η'} = {d.settings[study]}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
