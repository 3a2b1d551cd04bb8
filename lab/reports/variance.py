"""What the estimator_variance and estimator_zoo reports say, built from the variance study's summary alone."""
from __future__ import annotations

import math

import pandas as pd

from lab import estimators
from lab.reports.figures import KIND_LABELS
from lab.reports.style import interval, table


def _relative(entry: dict, name: str) -> dict:
    """{bias, noise, rel_mse}: (value, lo, hi) relative to the target's norm ‖g*‖ (‖g*‖² = mse / rel_mse)."""
    point, iv = entry["estimators"][name], entry["intervals"][name]
    norm2 = point["mse"] / point["rel_mse"] if point["rel_mse"] else math.nan
    norm = math.sqrt(norm2) if norm2 > 0 else math.nan
    noise = [math.sqrt(max(v, 0.0)) / norm for v in (point["variance"], *iv["variance"])]
    return {"bias": [v / norm for v in (point["bias_norm"], *iv["bias_norm"])], "noise": noise,
            "rel_mse": [point["rel_mse"], *iv["rel_mse"]]}


def _best(values: dict) -> list[str]:
    """Estimators with the lowest value (several when they coincide, as on-policy where all reduce to one)."""
    low = min(values.values())
    return [k for k, v in values.items() if v <= low + 1e-9 * abs(low)]


def _by_divergence(summary: dict) -> list[dict]:
    """Settings from least to most off-policy (exact per-token KL; ties keep the study's order)."""
    return sorted(summary["per_value"], key=lambda e: e["kl_token"])


def headline(summary: dict) -> str:
    """One line for the gallery: the lowest MSE at the most off-policy setting."""
    last = _by_divergence(summary)[-1]
    ests = last["estimators"]
    best = min(ests, key=lambda n: ests[n]["rel_mse"])
    text = (f"{summary['staleness']} {last['staleness']:g} (KL {last['kl_token']:.2g}/token): lowest MSE "
            f"{best}, {ests[best]['rel_mse']:.3g}×‖∇J‖²")
    if "reinforce" in ests and best != "reinforce":
        text += f" vs {ests['reinforce']['rel_mse']:.3g}× uncorrected"
    if ests[best]["rel_mse"] >= 1:
        text += "; no correction beats a zero update (1×)"
    return text


def answer(summary: dict) -> str:
    """Markdown answering "my rollouts are this stale: how wrong and how noisy is each correction?"."""
    kind, cfg = summary["staleness"], summary.get("config", {})
    settings = _by_divergence(summary)
    last = settings[-1]
    ests = list(last["estimators"])
    rel = {e: _relative(last, e) for e in ests}
    mse = {e: rel[e]["rel_mse"][0] for e in ests}
    best = _best(mse)
    values = sorted(e["staleness"] for e in settings)
    setup = (f"**Setup.** `{summary['env']}` with a `{summary.get('policy', '?')}` policy; behaviour policy μ set by "
             f"**{KIND_LABELS.get(kind, kind)}** ∈ {{{', '.join(f'{v:g}' for v in values)}}}")
    if cfg:
        setup += (f"; batches of {cfg['batch_size']} responses ({cfg['group_size']} per prompt, `{cfg['advantage']}` "
                  f"advantages, `{cfg['loss_agg_mode']}`), {cfg['replicates']} replicate batches per setting")
    truth = "the exact on-policy gradient ∇J of π" if summary.get("reference", "exact") == "exact" \
        else "∇J of π from a large on-policy Monte Carlo sample"
    lines = [setup + f". Truth: {truth}.", ""]
    lines += _where_it_matters(settings, kind)
    lines += [f"**At the most off-policy setting, {kind} = {last['staleness']:g}** (KL(μ‖π) {last['kl_token']:.2g} "
              f"nats/token, ESS {last['ess_frac'][0]:.0%} of the batch):", ""]
    lines += ["| estimator | how wrong: ‖bias‖ ÷ ‖∇J‖ | how noisy: one batch's √tr Cov ÷ ‖∇J‖ | MSE ÷ ‖∇J‖² |",
              "|---|---|---|---|"]
    for e in ests:
        r, name = rel[e], (f"**{e}** ★" if e in best else e)
        lines.append(f"| {name} | {interval(*r['bias'], '{:.0%}')} | {interval(*r['noise'], '{:.0%}')} | "
                     f"{interval(*r['rel_mse'])} |")
    lines += ["", "*Brackets: 95% bootstrap intervals over replicate batches.*", ""]
    if len(best) < len(ests):
        lines.append(f"- **Lowest MSE: {' = '.join(best)}.** " + _advice(rel, ests, best))
    if min(mse[b] for b in best) > 0.9:  # a zero gradient has MSE = ||grad J||^2 exactly
        lines.append("- **Nothing does much better than a zero update here**: a zero gradient has MSE ÷ ‖∇J‖² = 1. "
                     "The lowest MSE comes from an estimate that barely moves, not from a useful gradient.")
    if "reinforce" in ests and len(settings) > 1:
        base = _relative(settings[0], "reinforce")["rel_mse"]
        safe = settings[0]
        for entry in settings[1:]:
            if _relative(entry, "reinforce")["rel_mse"][1] > base[2]:
                break
            safe = entry
        base_name = "on-policy" if settings[0]["kl_token"] == 0 else f"{kind} = {settings[0]['staleness']:g}"
        lines.append(f"- Uncorrected `reinforce` stays within its {base_name} MSE interval up to "
                     f"**KL {safe['kl_token']:.2g}/token** ({kind} = {safe['staleness']:g})"
                     + ("." if safe is not last else ": every setting here."))
    return "\n".join(lines)


def _where_it_matters(settings: list, kind: str) -> list[str]:
    """The finding first: where a correction helps most against uncorrected REINFORCE, and where no estimator's MSE
    interval lies below that of a zero update (1)."""
    lines = []
    gains = []
    for entry in settings:
        ests = entry["estimators"]
        best = min(ests, key=lambda e: ests[e]["rel_mse"])
        if "reinforce" in ests and best != "reinforce" and ests[best]["rel_mse"] > 0:
            gains.append((ests["reinforce"]["rel_mse"] / ests[best]["rel_mse"], entry, best))
    if gains:
        gain, entry, best = max(gains, key=lambda g: g[0])
        if gain > 1:
            lines.append(f"- **Where a correction matters most: {kind} = {entry['staleness']:g}** (KL "
                         f"{entry['kl_token']:.2g}/token): {best} has MSE {entry['estimators'][best]['rel_mse']:.3g}×"
                         f"‖∇J‖² against {entry['estimators']['reinforce']['rel_mse']:.3g}× uncorrected, "
                         f"{gain:.3g} times lower.")
    hopeless = [e for e in settings if min(iv["rel_mse"][0] for iv in e["intervals"].values()) >= 1]
    if hopeless:
        lines.append(f"- **Where nothing beats a zero update** (every MSE interval at or above 1×‖∇J‖²): {kind} = "
                     + ", ".join(f"{e['staleness']:g}" for e in hopeless) + ".")
    return lines + ([""] if lines else [])


def _advice(rel: dict, ests: list, best: list) -> str:
    b = rel[best[0]]["rel_mse"][2]
    tied = [e for e in ests if e not in best and rel[e]["rel_mse"][1] <= b]
    if not tied:
        return "Its interval clears every other estimator's."
    least = min(best + tied, key=lambda e: rel[e]["bias"][0])
    return (f"Its interval overlaps {', '.join(tied)}: not resolved at this number of replicates; the least biased "
            f"of these is {least}.")


def headline_table(summary: dict, wide_limit: int = 6):
    """MSE ÷ ‖∇J‖² [95% CI] per estimator and staleness value, with the exact per-token KL and the ESS; lowest
    starred. Estimators are columns when there are at most ``wide_limit`` of them, else rows (the page stays
    narrow)."""
    kind = summary["staleness"]
    entries = sorted(summary["per_value"], key=lambda e: e["staleness"])
    ests = list(entries[0]["estimators"])
    best = {}
    for entry in entries:
        mse = {e: entry["estimators"][e]["rel_mse"] for e in ests}
        best[entry["staleness"]] = _best(mse) if len(_best(mse)) < len(ests) else []

    def cell(entry, e):
        v = entry["estimators"][e]["rel_mse"]
        return ("★ " if e in best[entry["staleness"]] else "") + interval(v, *entry["intervals"][e]["rel_mse"])

    caption = ("MSE ÷ ‖∇J‖² per estimator (lower is better; ★ lowest; [95% bootstrap interval]). ESS: Kish "
               "effective sample size as a share of the batch.")
    if len(ests) <= wide_limit:
        rows = [{kind: f"{x['staleness']:g}", "KL(μ‖π)/token": f"{x['kl_token']:.2g}",
                 "ESS": interval(*x["ess_frac"], "{:.0%}"), **{e: cell(x, e) for e in ests}} for x in entries]
        return table(pd.DataFrame(rows), caption, {i: best[x["staleness"]] for i, x in enumerate(entries)})
    cols = [f"{kind} {x['staleness']:g}" for x in entries]
    rows = [{"": "KL(μ‖π)/token", **{c: f"{x['kl_token']:.2g}" for c, x in zip(cols, entries)}},
            {"": "ESS", **{c: interval(*x["ess_frac"], "{:.0%}") for c, x in zip(cols, entries)}}]
    rows += [{"": e, **{c: cell(x, e) for c, x in zip(cols, entries)}} for e in ests]
    marks = {2 + i: [c for c, x in zip(cols, entries) if e in best[x["staleness"]]] for i, e in enumerate(ests)}
    return table(pd.DataFrame(rows), caption, marks)


def registry_table(names: list[str]) -> pd.DataFrame:
    """One row per estimator: family, source, its defaults, its own aggregation, what it is unbiased for."""
    rows = []
    for n in names:
        i = estimators.info(n)
        rows.append({"estimator": n, "family": i.family, "ratio": i.ratio, "source": i.source,
                     "defaults": ", ".join(f"{k}={v}" for k, v in i.defaults.items()) or "-",
                     "own aggregation": i.loss_agg_mode, "unbiased for": i.unbiased_for})
    return pd.DataFrame(rows).set_index("estimator")
