"""What the rollout_diagnostics report shows: the headline and the answer from the study's Summary (the verdict's
sentences are lab.diagnose.verdict's, the command's own), and the tables from a Diagnostics' tables; the figures are
lab.diagnose.figures'. Δ is a log-ratio per token (the pair says which: mismatch = log π_old − log μ, update =
log π − log π_old, total = log π − log μ), log W = Σ_t Δ_t per sequence."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lab.reports.style import interval, table
from lab.reports.templates import render
from lab.studies.rollout_diagnostics.study import Config, Summary
from lab.typed import build

HERE = Path(__file__).parent
NEGLIGIBLE = 0.005  # a correction removing less than this share of the gradient weight barely acts


def summary_of(data: dict | Summary) -> Summary:
    return data if isinstance(data, Summary) else build(Summary, data)


def main_pair(s: Summary) -> str:
    """The pair sequence-level IS is judged on: current/sampler when the log has it (lab.diagnose.verdict)."""
    return "total" if "total" in s.pairs else s.pairs[0]


def mismatch_pair(s: Summary) -> str:
    """The trainer/sampler pair when the log has it, else the main pair."""
    return "mismatch" if "mismatch" in s.pairs else main_pair(s)


@dataclass
class Decisions:
    """What the headline states: the per-token size of the mismatch, whether sequence-level IS works, and how far
    apart the corrections are in the gradient weight they remove."""

    mismatch: str  # the pair of the per-token numbers
    main: str  # the pair of the sequence-level numbers
    most: str  # the correction removing the largest share of the gradient weight
    least: str  # ... the smallest share
    separated: bool  # the most's interval lies above the least's
    negligible: bool  # no correction removes as much as NEGLIGIBLE
    idle: list[str]  # the corrections that remove no weight at all


def decide(summary: dict | Summary) -> Decisions:
    s = summary_of(summary)
    c = s.corrections
    most = max(c, key=lambda n: c[n].removed)
    least = min(c, key=lambda n: c[n].removed)
    return Decisions(mismatch_pair(s), main_pair(s), most, least, c[most].removed_lo > c[least].removed_hi,
                     c[most].removed < NEGLIGIBLE, [n for n in c if c[n].removed == 0])


def headline(name: str, summary: dict) -> str:
    """One line for the gallery: the per-token mismatch, sequence-level IS's health, and the corrections' spread."""
    s = summary_of(summary)
    d = decide(s)
    o, m = s.overall[d.main], s.overall[d.mismatch]
    text = (f"mean |log {s.pair_text[d.mismatch]}| {m.mean_abs:.3g} per token; sequence IS on "
            f"{s.pair_text[d.main]}: ESS {o.ess_median:.0%}, k-hat > 0.7 in {o.khat_warning_steps} of "
            f"{o.khat_steps} steps; ")
    c = s.corrections
    if d.negligible:
        return text + f"no correction removes as much as {NEGLIGIBLE:.1%} of the gradient weight"
    text += f"{c[d.most].label} removes {c[d.most].removed:.1%} of the gradient weight"
    if d.idle:
        return text + f", {len(d.idle)} of {len(c)} corrections none"
    return text + f", {c[d.least].label} {c[d.least].removed:.1%}" + ("" if d.separated else " (intervals overlap)")


def answer(summary: dict, cfg: Config | None = None) -> str:
    """Markdown: which log, what its log-probs are, and the verdict's sentences."""
    s = summary_of(summary)
    return render(HERE, "answer.md", s=s, cfg=cfg or Config())


def overall_table(diag):
    """One column per log-ratio: token statistics over loss-masked tokens, weight statistics per step."""
    overall = diag.tables["overall"].set_index("pair")
    pct = "{:.1%}".format
    rows = {"loss-masked tokens": lambda r: f"{r.n_tok:,.0f}",
            "mean Δ": lambda r: f"{r['mean']:.3g}",
            "mean |Δ| [95 %]": lambda r: interval(r.mean_abs, r.mean_abs_lo, r.mean_abs_hi),
            "median |Δ|": lambda r: f"{r.abs_p50:.3g}",
            "99th percentile |Δ|": lambda r: f"{r.abs_p99:.3g}",
            "max |Δ|": lambda r: f"{r.max_abs:.3g}",
            "KL per token (k3)": lambda r: f"{r.k3_token:.3g}",
            "ESS per step (median)": lambda r: pct(r.ess_median),
            "steps with k-hat > 0.7": lambda r: f"{r.khat_warning_steps:.0f} of {r.khat_steps:.0f}",
            "sequences holding half the weight (median)": lambda r: pct(r.dominant_median),
            "sd of log W": lambda r: f"{r.logw_sd:.3g}",
            "median W": lambda r: f"{r.w_median:.3g}"}
    return table(pd.DataFrame([{"": name, **{p: f(overall.loc[p]) for p in overall.index}}
                               for name, f in rows.items()]),
                 "One column per log-ratio: token statistics over loss-masked tokens, weight statistics per step.",
                 text=("",))


def probability_table(diag):
    """Mean |Δ| per token in bins of the sampler's probability of the sampled token."""
    bins = diag.tables["by_probability"].query("n_tok > 0")
    by_p = bins.pivot_table(index=["p_lo", "p_hi"], columns="pair", values="mean_abs", sort=False)
    first = bins.drop_duplicates(["p_lo", "p_hi"]).set_index(["p_lo", "p_hi"])
    return table(pd.DataFrame({"sampler's p of the token": [f"{lo:g} – {hi:g}" for lo, hi in by_p.index],
                               "share of tokens": [f"{v:.1%}" for v in first.loc[by_p.index, "token_share"]],
                               **{f"mean |Δ| {p}": [f"{v:.3g}" for v in by_p[p]] for p in by_p.columns}}),
                 "Mean |Δ| per token in bins of the sampler's probability of the sampled token.")


def growth_table(diag):
    """OLS slopes of the mean and the variance of log W on the response length, per log-ratio."""
    growth = diag.tables["growth"]
    return table(pd.DataFrame({
        "log-ratio": growth.pair,
        "drift per token [95 %]": [interval(*v) for v in growth[["drift_per_token", "drift_lo", "drift_hi"]].values],
        "variance per token [95 %]": [interval(*v) for v in growth[["var_per_token", "var_lo", "var_hi"]].values],
        "sequences": growth.n_seq}), "OLS slopes of the mean and the variance of log W on the response length.")


def staleness_table(diag):
    """Per version lag: mean |Δ| per token and mean |log W| per sequence, for each log-ratio (None: no versions)."""
    st = diag.tables["staleness"]
    if st.empty:
        return None
    pairs = [c.removeprefix("mean_abs_") for c in st.columns if c.startswith("mean_abs_")]
    return table(pd.DataFrame({"version lag": st.lag, "sequences": st.n_seq,
                               "share": [f"{v:.1%}" for v in st.seq_share],
                               **{f"|Δ| {p}": [f"{v:.3g}" for v in st[f"mean_abs_{p}"]] for p in pairs},
                               **{f"|log W| {p}": [f"{v:.3g}" for v in st[f"logw_abs_mean_{p}"]] for p in pairs}}),
                 "Per version lag: mean |Δ| per token and mean |log W| per sequence, for each log-ratio.")


def corrections_table(diag):
    """What each correction would do to this log, at the defaults its source runs."""
    cor = diag.tables["corrections"]
    pct = "{:.1%}".format
    return table(pd.DataFrame({
        "correction": cor.label, "level": cor.level, "log-ratio": cor.pair, "settings": cor.hyper,
        "tokens changed": [pct(v) for v in cor.tokens_changed], "tokens zeroed": [pct(v) for v in cor.tokens_zeroed],
        "sequences changed": [pct(v) for v in cor.sequences_changed],
        "weight removed [95 %]": [interval(*v, "{:.1%}") for v in cor[["removed", "removed_lo", "removed_hi"]].values],
        "weight added": [pct(v) for v in cor.added]}),
        "What each correction would do to this log, at the defaults its source runs.", text=("correction", "settings"))


def truncation_table(diag):
    """The mean trainer/sampler token ratio and the share of tokens below 1, on all tokens and on those with a recorded
    kept set (lab.diagnose.truncation); None when the log has no sampler log-probs."""
    tr = diag.tables.get("truncation")
    if tr is None or tr.empty:
        return None
    return table(pd.DataFrame({
        "log-ratio": tr.pair, "tokens": ["all" if n == "all" else "with a kept set" for n in tr.name],
        "count": [f"{int(v):,}" for v in tr.n_tok],
        "mean ratio [95 %]": [interval(*v, "{:.3f}")
                              for v in tr[["mean_ratio", "mean_ratio_lo", "mean_ratio_hi"]].values],
        "ratio < 1 [95 %]": [interval(*v, "{:.1%}") for v in tr[["below_one", "below_one_lo", "below_one_hi"]].values],
        "truncation detected": ["yes" if v else "no" for v in tr.detected]}),
        "Sampler truncation: the mean trainer/sampler token ratio is 1 for any sampler that reports the probabilities "
        "it sampled from, and the kept mass for one that truncates and renormalises (detected: interval below 0.99 "
        "and at least 80 % of tokens below 1).", text=("log-ratio", "tokens"))


def dashboards_table(diag):
    """The frameworks' own mismatch metrics on this log (mean over steps, the first and the last step), each with its
    definition; None when the log has no sampler and trainer log-probs to compare."""
    dash = diag.tables["dashboards"]
    if dash.empty:
        return None
    steps = dash.step.drop_duplicates()
    g = dash.groupby(["framework", "metric", "definition"], sort=False).value
    return table(pd.DataFrame({"framework": [k[0] for k in g.groups], "metric": [k[1] for k in g.groups],
                               "mean over steps": g.mean().to_numpy(),
                               f"step {steps.iloc[0]}": g.first().to_numpy(),
                               f"step {steps.iloc[-1]}": g.last().to_numpy(),
                               "definition": [k[2] for k in g.groups]}),
                 "The frameworks' own mismatch metrics on this log, each with its definition (d = log pi_old - log "
                 "mu).", text=("framework", "metric", "definition"))
