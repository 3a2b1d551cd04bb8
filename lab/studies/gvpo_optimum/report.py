"""What the gvpo_optimum report decides, from the study's Summary alone; the sentences are in templates/, the figures
in figures.py. The distance is TV(π, π*) after the last step (0: the optimum π* = π_ref exp(R/β)/Z), a mean over seeds
with its percentile-bootstrap interval."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lab.reports.templates import render
from lab.studies.gvpo_optimum.study import FinalTV, Summary
from lab.typed import build

HERE = Path(__file__).parent
SAMPLER_LABELS = {"on_policy": "on-policy (π_θ)", "reference": "π_ref (fixed)",
                  "tempered": "tempered π_ref (fixed)", "uniform": "uniform (fixed)"}
SAMPLER_WORDS = {"on_policy": "on-policy", "reference": "π_ref", "tempered": "tempered π_ref", "uniform": "uniform"}
POLICY_WORDS = {"prefix": "prefix-tree", "markov": "Markov"}
REACHED_TV = 0.05  # a final TV whose upper interval bound is below this counts as having reached pi*


def summary_of(data: dict | Summary) -> Summary:
    return data if isinstance(data, Summary) else build(Summary, data)


@dataclass
class Alternative:
    """Where a method other than GVPO ends from one fixed sampler, against GVPO from the same samples."""

    method: str
    tv: float
    ratio: float  # its final TV over GVPO's


@dataclass
class OnPolicy:
    low: float  # the lowest mean final TV over methods
    high: float
    overlap: bool  # every method's interval overlaps every other's (more than one method)


@dataclass
class Decisions:
    methods: list[str]
    samplers: list[str]
    best: dict[str, str]  # sampler -> the method with the lowest mean final TV
    gvpo: str | None  # "reached" | "approaching" | "not approaching" π* from every sampler; None without GVPO
    gvpo_worst: float | None  # GVPO's largest mean final TV over samplers
    gvpo_worst_hi: float | None  # and the largest upper interval bound
    alternatives: dict[str, list[Alternative]]  # per fixed sampler, every other method against GVPO
    contrast: str | None  # the fixed sampler where the best alternative ends farthest from GVPO
    on_policy: OnPolicy | None


def decide(summary: dict | Summary) -> Decisions:
    s = summary_of(summary)
    ft = s.final_tv
    methods, samplers = list(ft), list(next(iter(ft.values())))
    fixed = [x for x in samplers if x != "on_policy"]
    best = {x: min(methods, key=lambda m: ft[m][x].mean) for x in samplers}
    verdict = worst = worst_hi = None
    alternatives, contrast = {}, None
    if "gvpo" in ft:
        g = ft["gvpo"]
        worst, worst_hi = max(g[x].mean for x in samplers), max(g[x].hi for x in samplers)
        verdict = ("reached" if worst_hi < REACHED_TV else "approaching" if all(g[x].mean < s.tv_at_start
                                                                                 for x in samplers)
                   else "not approaching")
        others = [m for m in methods if m != "gvpo"]
        if others:
            alternatives = {x: [Alternative(m, ft[m][x].mean, ft[m][x].mean / max(g[x].mean, 1e-12)) for m in others]
                            for x in fixed}
            contrast = max(fixed, key=lambda x: min(a.ratio for a in alternatives[x]), default=None)
    elif fixed:
        contrast = fixed[-1]
    on = None
    if "on_policy" in samplers:
        e: list[FinalTV] = [ft[m]["on_policy"] for m in methods]
        on = OnPolicy(min(x.mean for x in e), max(x.mean for x in e),
                      len(e) > 1 and max(x.lo for x in e) <= min(x.hi for x in e))
    return Decisions(methods, samplers, best, verdict, worst, worst_hi, alternatives, contrast, on)


def headline(name: str, summary: dict) -> str:
    """One line: GVPO's worst final TV over samplers, and every method's from the fixed sampler where the
    alternatives end farthest from GVPO."""
    s = summary_of(summary)
    d = decide(s)
    ft = s.final_tv
    parts = []
    if d.gvpo is not None:
        parts.append(f"GVPO ends within TV {d.gvpo_worst:.2g} of π* from every sampler, with no importance weights")
    if d.contrast and len(d.methods) > 1:
        x = d.contrast
        parts.append(f"from {SAMPLER_WORDS.get(x, x)} samples: " + ", ".join(f"{m} {ft[m][x].mean:.2g}"
                                                                             for m in d.methods))
    return f"{'; '.join(parts)} ({s.steps} steps, β = {s.beta:g})"


def answer(summary: dict) -> str:
    """Markdown: setup, final TV(pi, pi*) per method and sampler with intervals over seeds (lowest in bold), and the
    verdicts: whether GVPO reached pi* from every sampler, where the alternatives end, the on-policy case."""
    s = summary_of(summary)
    cfg = s.config
    return render(HERE, "answer.md", s=s, d=decide(s), cfg=cfg, overrides=cfg.get("env_overrides") or {},
                  policy=POLICY_WORDS.get(s.policy, s.policy), labels=SAMPLER_LABELS, words=SAMPLER_WORDS,
                  REACHED_TV=REACHED_TV)
