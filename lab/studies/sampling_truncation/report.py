"""What the sampling_truncation report decides, from the study's Summary alone; the sentences are in templates/.
Biases are exact (enumeration, A = R) and relative to the truth they are measured against: ‖E g − ∇J‖ ÷ ‖∇J‖,
with ∇J either the full policy's gradient ∇J(π) or the deployed sampler's ∇J(q)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from lab.reports.style import color, table
from lab.reports.templates import render
from lab.studies.sampling_truncation.study import BAND, Setting, Summary
from lab.typed import build

HERE = Path(__file__).parent
EXACT = 1e-6  # a relative bias below this is exact zero up to float64 enumeration


def summary_of(data: dict | Summary) -> Summary:
    return data if isinstance(data, Summary) else build(Summary, data)


def label(s: Setting) -> str:
    return f"{s.kind} {s.value:g}"


def bias(s: Setting, name: str, mode: str, truth: str = "deployed") -> float:
    """The exact relative bias of ``name`` at ``s`` (NaN where it does not enumerate), else the sampled one."""
    e = s.estimators[name][mode]
    key = "exact_bias" if truth == "deployed" else "exact_bias@full"
    if key in e:
        return e[key]
    return e["rel_bias" if truth == "deployed" else "rel_bias@full"]


@dataclass
class Decisions:
    """At the focus (the setting with the least kept mass): which corrections replay makes exactly unbiased for the
    deployed gradient, how far each is without it, and the gap to the full gradient that nothing closes."""

    focus: Setting
    untouched: list  # settings that cut nothing (kept mass 1)
    plain: dict  # name -> relative bias against the deployed truth without replay
    replay: dict  # name -> the same with replay
    plain_full: dict  # against the full truth
    replay_full: dict
    fixed: list  # exactly unbiased for the deployed gradient with replay (and not without)
    worst: str  # the largest bias without replay
    helped: list  # bias against the deployed truth lower with replay
    ratio_tracks_mass: bool  # the sampled mean ratio's interval holds the exact kept mass
    replay_band: float  # share of replayed ratios outside BAND at the focus


def decide(summary: Summary) -> Decisions:
    s = summary
    cut = [e for e in s.per_setting if e.kept_mass < 1 - 1e-12]
    focus = min(s.per_setting, key=lambda e: e.kept_mass)
    names = list(focus.estimators)
    plain = {n: bias(focus, n, "plain") for n in names}
    replay = {n: bias(focus, n, "replay") for n in names}
    plain_full = {n: bias(focus, n, "plain", "full") for n in names}
    replay_full = {n: bias(focus, n, "replay", "full") for n in names}
    fixed = [n for n in names if replay[n] < EXACT <= plain[n]]
    worst = max(names, key=lambda n: plain[n] if math.isfinite(plain[n]) else -1)
    helped = [n for n in names if replay[n] < plain[n]]
    lo, hi = focus.mean_ratio[1], focus.mean_ratio[2]
    tracks = all(abs(e.mean_ratio[0] - e.kept_mass) <= max(e.mean_ratio[2] - e.mean_ratio[1], 1e-9) for e in cut) \
        if cut else lo <= focus.kept_mass <= hi
    return Decisions(focus, [e for e in s.per_setting if e not in cut], plain, replay, plain_full, replay_full,
                     fixed, worst, helped, tracks, focus.outside_band_replay[0])


def headline(name: str, summary: dict) -> str:
    """One line for the gallery: at the most truncating setting, the ratio, and sequence IS with and without replay."""
    s = summary_of(summary)
    d = decide(s)
    f = d.focus
    text = (f"{label(f)}: mean ratio {f.mean_ratio[0]:.3f} (kept mass {f.kept_mass:.3f}), "
            f"{f.outside_band[0]:.0%} of tokens outside [{BAND[0]:g}, {BAND[1]:g}]")
    ref = "seq_is" if "seq_is" in d.plain else d.worst
    text += (f"; {ref} {d.plain[ref]:.0%} off the deployed gradient, {d.replay[ref]:.0%} with mask replay; "
             f"{len(d.fixed)}/{len(d.plain)} corrections exact with replay")
    return text


def answer(summary: dict) -> str:
    """Markdown answering "my engine samples with top-p/top-k: how wrong is each correction, against which truth,
    and does mask replay fix it?"."""
    s = summary_of(summary)
    d = decide(s)
    return render(HERE, "answer.md", s=s, d=d, f=d.focus, band=BAND, label=label, exact=EXACT)


def bias_table(summary: dict, truth: str = "deployed"):
    """Relative bias (exact where it enumerates) per estimator and sampler setting, without → with mask replay,
    against one truth; the corrections replay makes exact are marked."""
    s = summary_of(summary)
    settings = [e for e in s.per_setting if e.kept_mass < 1 - 1e-12] or s.per_setting
    names = list(settings[0].estimators)
    cols = [label(e) for e in settings]
    rows = [{"": "kept mass π(S)", **{label(e): f"{e.kept_mass:.3f}" for e in settings}},
            {"": "mean ratio π/q (no replay)", **{label(e): f"{e.mean_ratio[0]:.3f}" for e in settings}},
            {"": f"tokens outside [{BAND[0]:g}, {BAND[1]:g}] → replay",
             **{label(e): f"{e.outside_band[0]:.0%} → {e.outside_band_replay[0]:.0%}" for e in settings}},
            {"": "‖∇J(q) − ∇J(π)‖ ÷ ‖∇J(π)‖", **{label(e): f"{e.truth_gap:.1%}" for e in settings}}]
    marks = {}
    for n in names:
        rows.append({"": n, **{label(e): f"{bias(e, n, 'plain', truth):.1%} → {bias(e, n, 'replay', truth):.1%}"
                               for e in settings}})
        marks[len(rows) - 1] = [label(e) for e in settings if bias(e, n, "replay", truth) < EXACT]
    which = "the deployed sampler's ∇J(q)" if truth == "deployed" else "the full policy's ∇J(π)"
    caption = (f"‖bias‖ ÷ ‖∇J‖ against {which}, without → with mask replay (exact by enumeration with A = R where "
               f"the loss enumerates; else sampled). Marked: exactly unbiased with replay.")
    return table(pd.DataFrame(rows, columns=["", *cols]), caption, marks)


def bias_vs_kept_mass(results: pd.DataFrame) -> Figure:
    """Relative bias against each truth as the sampler keeps less mass, every estimator, without (solid) and with
    (dashed) mask replay."""
    mass = results[(results.estimator == "-") & (results.metric == "kept_mass")].set_index(["kind", "level"]).value
    fig = Figure(figsize=(11, 4.2))
    axes = fig.subplots(1, 2, sharey=True)
    ests = [e for e in results.estimator.unique() if e != "-"]
    for ax, (metric, title) in zip(axes, [("exact_bias", "against the deployed ∇J(q)"),
                                          ("exact_bias@full", "against the full ∇J(π)")]):
        for e in ests:
            for mode, style in (("plain", "-"), ("replay", "--")):
                r = results[(results.estimator == e) & (results.replay == mode) & (results.metric == metric)]
                if r.empty:
                    continue
                x = [mass[(k, v)] for k, v in zip(r.kind, r.level)]
                order = sorted(range(len(x)), key=lambda i: x[i])
                ax.plot([x[i] for i in order], [r.value.iloc[i] for i in order], style, marker="o", ms=3,
                        color=color(e), label=e if mode == "plain" else None, lw=1.2)
        ax.set_title(title)
        ax.set_xlabel("kept mass π(S) per token")
        ax.invert_xaxis()
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("‖E g − ∇J‖ ÷ ‖∇J‖ (solid: no replay, dashed: replay)")
    axes[1].legend(fontsize=7, ncol=2, loc="upper left")
    fig.tight_layout()
    return fig
