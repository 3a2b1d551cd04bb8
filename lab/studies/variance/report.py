"""What the variance and variance_zoo reports decide, from the study's Summary alone; the sentences are in
templates/. Every relative number is against the exact gradient: ‖bias‖ ÷ ‖∇J‖, √variance ÷ ‖∇J‖ and
MSE ÷ ‖∇J‖² (1 is what a zero update scores)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lab import estimators
from lab.reports.figures import KIND_LABELS
from lab.reports.style import interval, table
from lab.reports.templates import render
from lab.studies.variance.study import Setting, Summary
from lab.typed import build

HERE = Path(__file__).parent


def summary_of(data: dict | Summary) -> Summary:
    return data if isinstance(data, Summary) else build(Summary, data)


@dataclass
class Relative:
    """One estimator at one setting, relative to ‖∇J‖: each a (value, lo, hi) triple."""

    bias: tuple
    noise: tuple
    rel_mse: tuple


def relative(setting: Setting, name: str) -> Relative:
    """bias and noise (√variance) in units of ‖∇J‖, MSE in units of ‖∇J‖² (‖∇J‖² = mse / rel_mse)."""
    point, iv = setting.estimators[name], setting.intervals[name]
    norm2 = point["mse"] / point["rel_mse"] if point["rel_mse"] else math.nan
    norm = math.sqrt(norm2) if norm2 > 0 else math.nan
    noise = tuple(math.sqrt(max(v, 0.0)) / norm for v in (point["variance"], *iv["variance"]))
    return Relative(tuple(v / norm for v in (point["bias_norm"], *iv["bias_norm"])), noise,
                    (point["rel_mse"], *iv["rel_mse"]))


def lowest(values: dict) -> list[str]:
    """Names with the lowest value (several when they coincide, as on-policy where all reduce to one)."""
    low = min(values.values())
    return [k for k, v in values.items() if v <= low + 1e-9 * abs(low)]


def by_divergence(summary: Summary) -> list[Setting]:
    """Settings from least to most off-policy (exact per-token KL; ties keep the study's order)."""
    return sorted(summary.per_value, key=lambda e: e.kl_token)


@dataclass
class Gain:
    setting: Setting
    best: str
    ratio: float  # reinforce's MSE over the best's


def largest_gain(settings: list[Setting]) -> Gain | None:
    """Where a correction helps most against uncorrected REINFORCE (None without REINFORCE or a gain)."""
    gains = []
    for s in settings:
        ests = s.estimators
        best = min(ests, key=lambda e: ests[e]["rel_mse"])
        if "reinforce" in ests and best != "reinforce" and ests[best]["rel_mse"] > 0:
            gains.append(Gain(s, best, ests["reinforce"]["rel_mse"] / ests[best]["rel_mse"]))
    gain = max(gains, key=lambda g: g.ratio, default=None)
    return gain if gain and gain.ratio > 1 else None


def most_informative(summary: Summary) -> Setting:
    """The setting where the corrections differ most among those where one helps (an MSE interval below a zero
    update's 1): the largest spread between the worst and the best MSE; the most off-policy setting if none helps."""
    useful = [s for s in by_divergence(summary) if min(iv["rel_mse"][1] for iv in s.intervals.values()) < 1]
    if not useful:
        return by_divergence(summary)[-1]

    def spread(s: Setting) -> float:
        mse = [v["rel_mse"] for v in s.estimators.values() if math.isfinite(v["rel_mse"]) and v["rel_mse"] > 0]
        return max(mse) / min(mse) if mse else 0.0

    return max(useful, key=spread)


@dataclass
class Decisions:
    """What the report states, computed: at the focus setting (the most informative), which estimator has the lowest
    MSE, whether its interval clears the others, the least biased among those it cannot be told from."""

    focus: Setting
    most_off_policy: Setting
    off_best: list  # lowest MSE at the most off-policy setting
    relative: dict  # name -> Relative at the focus
    best: list  # lowest MSE at the focus
    tied: list  # others whose MSE interval overlaps the best's
    least_biased: str  # among best + tied
    zero_update: bool  # the lowest MSE is close to a zero update's (> 0.9)
    gain: Gain | None  # where a correction helps most against REINFORCE
    hopeless: list  # staleness values where every MSE interval is at or above 1
    reinforce_safe: Setting | None  # the most off-policy setting where REINFORCE stays in its first MSE interval


def decide(summary: Summary) -> Decisions:
    settings = by_divergence(summary)
    focus = most_informative(summary)
    names = list(focus.estimators)
    rel = {e: relative(focus, e) for e in names}
    mse = {e: rel[e].rel_mse[0] for e in names}
    best = lowest(mse)
    top = rel[best[0]].rel_mse[2]
    tied = [e for e in names if e not in best and rel[e].rel_mse[1] <= top] if len(best) < len(names) else []
    least = min(best + tied, key=lambda e: rel[e].bias[0])
    hopeless = [s.staleness for s in settings if min(iv["rel_mse"][0] for iv in s.intervals.values()) >= 1]
    safe = None
    if "reinforce" in names and len(settings) > 1:
        base = relative(settings[0], "reinforce").rel_mse
        safe = settings[0]
        for s in settings[1:]:
            if relative(s, "reinforce").rel_mse[1] > base[2]:
                break
            safe = s
    off = settings[-1]
    off_best = lowest({e: off.estimators[e]["rel_mse"] for e in off.estimators})
    return Decisions(focus, off, off_best, rel, best, tied, least, min(mse[b] for b in best) > 0.9,
                     largest_gain(settings), hopeless, safe)


def headline(name: str, summary: dict) -> str:
    """One line for the gallery: the lowest MSE where the corrections differ most."""
    s = summary_of(summary)
    d = decide(s)
    f = d.focus.estimators
    text = (f"{s.staleness} {d.focus.staleness:g} (KL {d.focus.kl_token:.2g}/token): lowest MSE {d.best[0]}, "
            f"{f[d.best[0]]['rel_mse']:.3g}×‖∇J‖²")
    if "reinforce" in f and d.best[0] != "reinforce":
        text += f" vs {f['reinforce']['rel_mse']:.3g}× uncorrected"
    if d.zero_update:
        text += "; no correction beats a zero update (1×)"
    return text


def answer(summary: dict) -> str:
    """Markdown answering "my rollouts are this stale: how wrong and how noisy is each correction?"."""
    s = summary_of(summary)
    d = decide(s)
    rows = [{"name": e, "star": e in d.best and len(d.best) < len(d.relative),
             "bias": interval(*r.bias, "{:.0%}"), "noise": interval(*r.noise, "{:.0%}"),
             "mse": interval(*r.rel_mse)} for e, r in d.relative.items()]
    return render(HERE, "answer.md", s=s, d=d, rows=rows, kind_label=KIND_LABELS.get(s.staleness, s.staleness),
                  values=sorted(e.staleness for e in s.per_value),
                  first_on_policy=by_divergence(s)[0].kl_token == 0)


def headline_table(summary: dict, wide_limit: int = 6):
    """MSE ÷ ‖∇J‖² [95% CI] per estimator and staleness value, with the exact per-token KL and the ESS; lowest
    starred. Estimators are columns when there are at most ``wide_limit`` of them, else rows (the page stays
    narrow)."""
    s = summary_of(summary)
    kind = s.staleness
    entries = sorted(s.per_value, key=lambda e: e.staleness)
    ests = list(entries[0].estimators)
    best = {}
    for entry in entries:
        low = lowest({e: entry.estimators[e]["rel_mse"] for e in ests})
        best[entry.staleness] = low if len(low) < len(ests) else []

    def cell(entry: Setting, e: str) -> str:
        return ("★ " if e in best[entry.staleness] else "") + interval(*entry.point(e, "rel_mse"))

    caption = ("MSE ÷ ‖∇J‖² per estimator (lower is better; ★ lowest; [95% bootstrap interval]). ESS: Kish "
               "effective sample size as a share of the batch.")
    if len(ests) <= wide_limit:
        rows = [{kind: f"{x.staleness:g}", "KL(μ‖π)/token": f"{x.kl_token:.2g}",
                 "ESS": interval(*x.ess_frac, "{:.0%}"), **{e: cell(x, e) for e in ests}} for x in entries]
        return table(pd.DataFrame(rows), caption, {i: best[x.staleness] for i, x in enumerate(entries)})
    cols = [f"{kind} {x.staleness:g}" for x in entries]
    rows = [{"": "KL(μ‖π)/token", **{c: f"{x.kl_token:.2g}" for c, x in zip(cols, entries)}},
            {"": "ESS", **{c: interval(*x.ess_frac, "{:.0%}") for c, x in zip(cols, entries)}}]
    rows += [{"": e, **{c: cell(x, e) for c, x in zip(cols, entries)}} for e in ests]
    marks = {2 + i: [c for c, x in zip(cols, entries) if e in best[x.staleness]] for i, e in enumerate(ests)}
    return table(pd.DataFrame(rows), caption, marks)


def registry_table(names: list[str]) -> pd.DataFrame:
    """One row per estimator: its label, family, source, defaults, own aggregation, what it is unbiased for."""
    rows = []
    for n in names:
        i = estimators.info(n)
        rows.append({"estimator": n, "label": i.label, "family": i.family, "ratio": i.ratio, "source": i.source,
                     "defaults": ", ".join(f"{k}={v}" for k, v in i.defaults.items()) or "-",
                     "own aggregation": i.loss_agg_mode, "unbiased for": i.unbiased_for})
    return pd.DataFrame(rows).set_index("estimator")
