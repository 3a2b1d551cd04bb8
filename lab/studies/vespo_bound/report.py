"""What the vespo_bound report decides, from the study's Summary alone; the sentences are in templates/, the figures
in figures.py. Errors are relative to the gradient: MSE ÷ ‖∇J‖² (1 is a zero update's), exact bias ‖E g − ∇J‖ ÷ ‖∇J‖
with advantage = R; the bound's tightness is E_μ[φ(W)²] ÷ (Z·K·C) (1: tight; above 1: violated)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lab.reports.style import interval, table
from lab.reports.templates import render
from lab.studies.vespo_bound.study import Lag, Summary
from lab.typed import build

HERE = Path(__file__).parent
NOTABLE_BIAS = 0.05  # an exact bias above 5% of ‖∇J‖ is worth a sentence
SAME_DIRECTION = 0.95  # cos(E g, ∇J) at or above this: the bias is a step size, not a direction
NEAR_ZERO_UPDATE = 0.9  # MSE ÷ ‖∇J‖² above this is close to a zero update's 1
SHRUNK = 0.1  # an expected update shorter than this fraction of ∇J barely moves


def summary_of(data: dict | Summary) -> Summary:
    return data if isinstance(data, Summary) else build(Summary, data)


def num(v) -> float:
    """A summary number (None in summary.json for NaN or inf) as a float."""
    return math.nan if v is None else float(v)


def per_lag(s: Summary) -> list[tuple[float, Lag]]:
    """(lag, entry) from the least to the most stale."""
    return sorted(((float(k), e) for k, e in s.per_lag.items()), key=lambda x: x[0])


@dataclass
class Focus:
    """The lag where VESPO and sequence IS differ most, among those where the intervals separate and the lower MSE
    is a useful update (below ``NEAR_ZERO_UPDATE``)."""

    lag: float
    entry: Lag
    lower: str  # "vespo" | "seq_is"
    ratio: float  # the higher MSE over the lower


@dataclass
class Bias:
    """VESPO's exact expected-gradient bias along the lags, and whether it is a direction or a step size."""

    lags: list[float]
    vespo: list[float]  # ‖E g − ∇J‖ ÷ ‖∇J‖ per lag
    seq_is_max: float  # sequence IS's largest (0 up to its |log W| <= 20 clamp)
    notable: bool  # above NOTABLE_BIAS somewhere
    notable_lags: list[float]
    cos: list[float]  # cos(E g, ∇J) at the notable lags (NaN: undefined, E g = 0)
    size: list[float]  # ‖E g‖ ÷ ‖∇J‖ there
    same_direction: bool  # every defined cosine at or above SAME_DIRECTION
    vanishes: bool  # a size of exactly 0: φ underflows for every rewarded response


@dataclass
class Decisions:
    violated: bool
    bounded: list[str]  # kernels with a finite K
    peak_at_one: list[str]  # kernels whose φ(w)/w peaks at w = 1: tight on-policy
    vespo_lower: list[float]  # lags where VESPO's MSE interval lies below sequence IS's
    seq_is_lower: list[float]
    unresolved: list[float]
    on_policy: list[float]  # lags with KL(μ‖π) = 0: both are REINFORCE
    last_lag: float
    last: Lag  # the most stale lag
    focus: Focus | None
    bias: Bias | None
    zero_update: bool  # VESPO's MSE at the most stale lag is close to a zero update's
    shrunk: float | None  # VESPO's expected update at that lag, as a fraction of ∇J, when it barely moves


def _bounded(s: Summary) -> list[str]:
    return [label for label, v in s.per_kernel.items() if v.max_ratio is not None]


def focus(entries: list[tuple[float, Lag]]) -> Focus | None:
    found = []
    for lag, e in entries:
        if e.verdict not in ("VESPO lower", "seq IS lower"):
            continue
        lower, higher = ("vespo", "seq_is") if e.verdict == "VESPO lower" else ("seq_is", "vespo")
        low, high = getattr(e, f"{lower}_rel_mse")[0], getattr(e, f"{higher}_rel_mse")[0]
        if low < NEAR_ZERO_UPDATE and low > 0:
            found.append(Focus(lag, e, lower, high / low))
    return max(found, key=lambda f: f.ratio, default=None)


def bias(entries: list[tuple[float, Lag]]) -> Bias | None:
    if any(e.vespo_exact_bias is None for _, e in entries):
        return None
    lags = [lag for lag, _ in entries]
    vespo = [num(e.vespo_exact_bias) for _, e in entries]
    notable = [(lag, e) for lag, e in entries if num(e.vespo_exact_bias) > NOTABLE_BIAS]
    cos = [num(e.vespo_exact_cos) for _, e in notable]
    size = [num(e.vespo_exact_size) for _, e in notable]
    return Bias(lags, vespo, max(abs(num(e.seq_is_exact_bias)) for _, e in entries), bool(notable),
                [lag for lag, _ in notable], cos, size, all(c >= SAME_DIRECTION for c in cos if not math.isnan(c)),
                any(x == 0 for x in size))


def decide(summary: dict | Summary) -> Decisions:
    s = summary_of(summary)
    entries = per_lag(s)
    by = {v: [lag for lag, e in entries if e.verdict == v] for v in ("VESPO lower", "seq IS lower", "unresolved")}
    last_lag, last = entries[-1]
    size = num(last.vespo_exact_size)
    zero = last.vespo_rel_mse[0] > NEAR_ZERO_UPDATE
    return Decisions(
        s.violations > 0, _bounded(s),
        [label for label in _bounded(s) if math.isclose(num(s.per_kernel[label].peak_w), 1.0)],
        by["VESPO lower"], by["seq IS lower"], by["unresolved"], [lag for lag, e in entries if e.kl_token == 0],
        last_lag, last, focus(entries), bias(entries), zero, size if zero and math.isfinite(size) and size < SHRUNK
        else None)


def headline(name: str, summary: dict) -> str:
    """One line for the gallery: whether the bound held, and where VESPO and sequence IS differ most while the lower
    one still moves (else the most stale lag)."""
    s = summary_of(summary)
    d = decide(s)
    if d.violated:
        return (f"Prop. 3.1 VIOLATED in {s.violations} of {s.settings_checked} settings (max E[φ²]/(ZKC) = "
                f"{s.max_bound_ratio:.3f})")
    text = (f"Prop. 3.1 never violated ({s.violations} of {s.settings_checked} exact settings; max E[φ²]/(ZKC) = "
            f"{s.max_bound_ratio:.3f})")
    if d.focus is not None:
        f = d.focus
        text += (f"; lag {f.lag:g} (KL {f.entry.kl_token:.2g}/token): MSE÷‖∇J‖² VESPO {f.entry.vespo_rel_mse[0]:.3g} "
                 f"vs seq IS {f.entry.seq_is_rel_mse[0]:.3g}")
    if d.focus is None or d.focus.lag != d.last_lag:
        text += (f"; lag {d.last_lag:g}: MSE÷‖∇J‖² VESPO {d.last.vespo_rel_mse[0]:.3g} vs seq IS "
                 f"{d.last.seq_is_rel_mse[0]:.3g}")
        if d.zero_update:
            text += " (VESPO's about a zero update's 1)"
    return text


def answer(summary: dict) -> str:
    """The report's at-a-glance markdown: the bound's verdict and tightness, the kernels, VESPO against sequence IS."""
    s = summary_of(summary)
    return render(HERE, "answer.md", s=s, d=decide(s), num=num, NOTABLE_BIAS=NOTABLE_BIAS)


def comparison_table(summary: dict):
    """Per lag: KL, ESS, MSE ÷ ‖∇J‖² of VESPO and sequence IS with intervals (the lower one marked where the intervals
    do not overlap), VESPO's exact bias, the verdict."""
    s = summary_of(summary)
    rows, marks = [], {}
    for i, (lag, e) in enumerate(per_lag(s)):
        row = {"lag": f"{lag:g}", "KL(μ‖π)/token": f"{e.kl_token:.2g}", "ESS": f"{e.ess_frac:.0%}",
               "VESPO MSE": interval(*e.vespo_rel_mse), "seq IS MSE": interval(*e.seq_is_rel_mse)}
        if e.vespo_exact_bias is not None:
            row["VESPO exact bias"] = f"{e.vespo_exact_bias:.0%}"
        row["verdict"] = e.verdict
        rows.append(row)
        marks[i] = {"VESPO lower": ["VESPO MSE"], "seq IS lower": ["seq IS MSE"]}.get(e.verdict, [])
    return table(pd.DataFrame(rows), "MSE ÷ ‖∇J‖² [95% bootstrap interval]; verdict: the lower MSE where the intervals "
                                     "do not overlap. Exact bias: ‖E_μ g − ∇J‖ ÷ ‖∇J‖ with advantage = R.", marks)


def comparison_frame(summary: dict) -> pd.DataFrame:
    """The per-lag comparison as a frame for the figures: one row per lag, [v, lo, hi] entries split into v, _lo, _hi,
    null numbers as NaN; an estimator's exact columns only where the study computed them."""
    entries = per_lag(summary_of(summary))
    measured = {key.removesuffix("_bias") for _, e in entries for key, v in vars(e).items()
                if key.endswith("_exact_bias") and v is not None}
    rows = []
    for lag, e in entries:
        row = {"lag": lag}
        for key, v in vars(e).items():
            if isinstance(v, list):
                row[key], row[f"{key}_lo"], row[f"{key}_hi"] = (num(x) for x in v)
            elif isinstance(v, str):
                row[key] = v
            elif "_exact_" not in key or key.rpartition("_")[0] in measured:
                row[key] = num(v)
        rows.append(row)
    return pd.DataFrame(rows)
