"""The plain-language verdict at the top of the report: a few sentences, each backed by a number in the summary.

Thresholds (stated so that a reader can disagree with them): k-hat > 0.7 marks a step where sequence-level IS is
unreliable (Vehtari et al. 2024); the mismatch is "concentrated" on low-probability tokens when, per token, tokens with
p < 0.1 carry at least 1.5 times the |log-ratio| of the other tokens, with the whole 95 % interval above 1.5
("not concentrated" when it lies below, "not resolved" otherwise); a log-ratio is "one-sided" when at
least 90 % of tokens have the same sign; sampler truncation is detected when the mean trainer/sampler token ratio's
interval lies below 0.99 and at least 80 % of tokens have a ratio below 1 (lab.diagnose.truncation).
"""
from __future__ import annotations

import math

from lab.diagnose.corrections import CORRECTIONS
from lab.diagnose.truncation import ONE_SIDED, RATIO_MAX

CONCENTRATED = 1.5  # |Δ| per token on p < 0.1 over |Δ| per token on the others
PAIR_WORDS = {"mismatch": "trainer/sampler", "update": "current/old policy", "total": "current/sampler"}


def _ok(x) -> bool:
    return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def _pct(x, digits: int = 2) -> str:
    if not _ok(x):
        return "n/a"
    v = 100 * x
    if v == 0:
        return "0 %"
    return f"{v:.{max(0, digits - 1 - int(math.floor(math.log10(abs(v)))))}f} %" if abs(v) < 10 else f"{v:.0f} %"


def _num(x) -> str:
    return f"{x:.3g}" if _ok(x) else "n/a"


def _r(x) -> str:
    """A ratio near 1, to three decimals."""
    return f"{x:.3f}" if _ok(x) else "n/a"


def _ci(lo, hi, fmt=_num) -> str:
    return f" [{fmt(lo)}, {fmt(hi)}]" if _ok(lo) and _ok(hi) else ""


def verdict(summary: dict) -> list[str]:
    """The verdict's sentences, in order: sequence-level IS, where the mismatch lives, growth with length,
    staleness, the corrections, truncated or one-sided sampling, dropped NaN tokens (those that apply)."""
    pairs = summary["pairs"]
    main = "total" if "total" in pairs else pairs[0]
    mis = "mismatch" if "mismatch" in pairs else main
    om = summary["overall"][mis]
    lines = [_sequence_is(summary["overall"][main], main),
             _low_prob(summary["low_prob"].get(mis), mis),
             _growth(om, summary["growth"].get(mis, {}), mis),
             _staleness(summary.get("staleness")),
             _corrections(summary["corrections"], mis),
             _sampling(summary, om),
             _dropped_nan(summary.get("nan", {}))]
    return [line for line in lines if line is not None]


def _sequence_is(o: dict, main: str) -> str:
    """1. Would sequence-level IS work: dominant share and Kish ESS (medians over steps), k-hat > 0.7 steps."""
    n_steps = o["n_steps"]
    text = (f"Sequence-level IS on {PAIR_WORDS[main]} ratios would be dominated by {_pct(o['dominant_median'])}"
            f"{_ci(o['dominant_lo'], o['dominant_hi'], _pct)} of sequences: that share of a step's sequences holds "
            f"half of its total weight (median over {n_steps} step{'s' if n_steps != 1 else ''}); Kish ESS "
            f"{_pct(o['ess_median'])} of the batch")
    if o["khat_steps"]:
        text += f"; Pareto k-hat > 0.7 in {o['khat_warning_steps']} of {o['khat_steps']} steps"
        if o["khat_warning_steps"] > o["khat_steps"] / 2:
            text += ": sequence-level IS estimates are unreliable here"
    else:
        text += "; k-hat needs at least 25 sequences per step"
    return text + "."


def _low_prob(lp: dict | None, mis: str) -> str | None:
    """2. Where the mismatch lives: intensity r = (mass / share) / ((1 - mass) / (1 - share)), the |delta| per
    p < 0.1 token over that of the others; concentrated when its interval lies above CONCENTRATED."""
    if not (lp and _ok(lp["token_share"]) and _ok(lp["abs_mass_share"]) and 0 < lp["token_share"] < 1):
        return None

    def intensity(mass):  # |Δ| per low-p token over |Δ| per other token
        return (mass / lp["token_share"]) / max((1 - mass) / (1 - lp["token_share"]), 1e-300)

    r, r_lo, r_hi = (intensity(lp[k]) if _ok(lp[k]) else float("nan") for k in ("abs_mass_share", "lo", "hi"))
    means = (f"; mean |Δ| {_num(lp['mean_abs_low'])} against {_num(lp['mean_abs_high'])} for p > 0.9"
             if _ok(lp["mean_abs_low"]) and _ok(lp["mean_abs_high"]) else "")
    share = (f"they are {_pct(lp['token_share'])} of tokens and carry {_pct(lp['abs_mass_share'])}"
             f"{_ci(lp['lo'], lp['hi'], _pct)} of the |log-ratio| mass, {_num(r)}x{_ci(r_lo, r_hi)} the |Δ| per "
             f"token of the others{means}")
    if _ok(r_lo) and r_lo >= CONCENTRATED:
        return f"The {PAIR_WORDS[mis]} mismatch is concentrated on tokens with p < 0.1: {share}."
    if _ok(r_hi) and r_hi < CONCENTRATED:
        return (f"The {PAIR_WORDS[mis]} mismatch is not concentrated on low-probability tokens (p < 0.1): "
                f"{share}.")
    return (f"Whether the {PAIR_WORDS[mis]} mismatch is concentrated on low-probability tokens (p < 0.1) "
            f"is not resolved (the interval straddles {CONCENTRATED}x): {share}.")


def _growth(om: dict, g: dict, mis: str) -> str:
    """3. Small per-token differences compound over length: mean |delta|, sd of L = sum delta, and the per-token
    growth of Var(L) and drift of L."""
    text = (f"Per token, |log {PAIR_WORDS[mis]} ratio| averages {_num(om['mean_abs'])}"
            f"{_ci(om['mean_abs_lo'], om['mean_abs_hi'])} (p99 {_num(om['abs_p99'])}, mean {_num(om['mean'])}); over "
            f"responses of median length {_num(om['median_len'])} the sequence log-weight has sd {_num(om['logw_sd'])} "
            f"and the median sequence ratio is {_num(om['w_median'])}")
    if _ok(g.get("var_per_token")):
        text += (f": Var(log W) grows by {_num(g['var_per_token'])}{_ci(g['var_lo'], g['var_hi'])} per token and "
                 f"log W drifts by {_num(g['drift_per_token'])}{_ci(g['drift_lo'], g['drift_hi'])} per token")
    return text + "."


def _staleness(st: dict | None) -> str:
    """4. Staleness: share of sequences at lag >= 1, mean and max lag, negative lags."""
    if not st:
        return "This log has no policy versions: staleness cannot be told apart from sampler/trainer mismatch."
    text = (f"Staleness: {_pct(st['stale_share'])} of sequences were generated at least one policy version "
            f"behind the trainer (mean lag {_num(st['mean_lag'])}, max {st['max_lag']})")
    if st.get("negative_lags"):
        text += f"; {st['negative_lags']} sequences claim a version newer than the trainer's (check the versions)"
    return text + "."


def _corrections(corrections: dict, mis: str) -> str | None:
    """5. What each correction does: tokens changed and gradient weight removed (and added), or that it changes
    no token."""
    parts, idle = [], []
    for name in CORRECTIONS:
        c = corrections.get(name)
        if not c:
            continue
        on = f" on {PAIR_WORDS[c['pair']]}" if c["pair"] != mis else ""
        if not (_ok(c["tokens_changed"]) and c["tokens_changed"] > 0):
            idle.append(c["label"] + on)
            continue
        parts.append(f"{c['label']}{on} changes {_pct(c['tokens_changed'])} of tokens and removes "
                     f"{_pct(c['removed'])}{_ci(c['removed_lo'], c['removed_hi'], _pct)} of the gradient weight"
                     + (f" (adds {_pct(c['added'])})" if _ok(c["added"]) and c["added"] >= 0.001 else ""))
    if not (parts or idle):
        return None
    text = f"At their default thresholds, on {PAIR_WORDS[mis]} ratios unless said: " + "; ".join(parts)
    if idle:
        text += ("; " if parts else "") + f"{', '.join(idle)} change{'s' if len(idle) == 1 else ''} no token"
    return text + "."


FIX = ("renormalise the trainer's log-probs over the sampler's kept set (mask replay: slime's keep-sampling-mask, or "
       "an engine that returns its kept sets) or sample without truncation for training; no correction recovers the "
       "tokens outside the kept set, which are never sampled")


def _settings(t: dict) -> str:
    s = ", ".join(f"{k} {t[k]}" for k in ("top_p", "top_k") if t.get(k) is not None)
    return f"the log declares {s}" if t.get("declared") else "the log declares no truncation"


def _sampling(summary: dict, om: dict) -> str | None:
    """6. Truncated sampling: detected from the mean trainer/sampler token ratio (lab.diagnose.truncation), the
    kept sets when the log records them, what to do; else a one-sided log-ratio (90 % of tokens of one sign)."""
    t = summary.get("truncation")
    if t:
        kept = _kept_sets(t)
        if kept:
            return kept
        ratio = (f"mean trainer/sampler token ratio {_r(t['mean_ratio'])}"
                 f"{_ci(t['mean_ratio_lo'], t['mean_ratio_hi'], _r)} where a sampler without truncation gives 1, "
                 f"with {_pct(t['below_one'])} of tokens below 1")
        if t["detected"]:
            bound = (f"; a top-p {t['top_p']} kept set holds at least {t['top_p']}" if t.get("top_p") and t["top_p"] < 1
                     else "")
            check = ("" if t["declared"] else "; if the engine did not truncate, look for log-probs reported at "
                     "another temperature than the one sampled")
            return (f"Truncated sampling detected: {ratio} ({_settings(t)}): the engine reports log-probs of its "
                    f"truncated, renormalised distribution, so each token's ratio is the mass the trainer gives the "
                    f"kept set, about {_r(t['mean_ratio'])} on average{bound}; {FIX}{check}.")
        if t["declared"]:
            return (f"Sampling was truncated ({_settings(t)[len('the log declares '):]}) but the ratios do not show "
                    f"it: {ratio} (detection needs the interval below {RATIO_MAX} and {_pct(ONE_SIDED)} below 1); "
                    f"either the engine reports full-distribution log-probs, or the trainer's are renormalised over "
                    f"the kept set, or truncation removes little mass.")
    neg = om.get("neg_share")
    if _ok(neg) and (neg >= 0.9 or neg <= 0.1) and om["n_tok"] > 0:
        return (f"The trainer/sampler log-ratio is one-sided: {_pct(neg)} of tokens are negative. Check that "
                f"both sides use the same temperature and no top-p/top-k truncation.")
    return None


def _kept_sets(t: dict) -> str | None:
    """With recorded kept sets: whether the trainer's log-probs are renormalised over them."""
    k = t.get("kept_sets")
    if not k:
        return None
    what = (f"The log records the sampler's kept sets on {_pct(k['share'])} of tokens (mean size {_num(k['mean_size'])}"
            f"; {_settings(t)})")
    ratio = (f"the mean trainer/sampler ratio on them is {_r(k['mean_ratio'])}"
             f"{_ci(k['mean_ratio_lo'], k['mean_ratio_hi'], _r)} with {_pct(k['below_one'])} below 1")
    single = (f"; on the {k['singletons']} tokens whose kept set is the sampled token alone the trainer's mean "
              f"log-prob is {_num(k.get('singleton_mean_old_logp'))}, where a renormalised one is 0"
              if k["singletons"] and _ok(k.get("singleton_mean_old_logp")) else "")
    if k["detected"]:
        return (f"{what}, but the trainer's log-probs are not renormalised over them: {ratio}{single}; "
                f"renormalise the trainer's log-softmax over the recorded sets (mask replay) or sample without "
                f"truncation; no correction recovers the tokens outside the kept sets, which are never sampled.")
    return (f"{what}, and the trainer's log-probs match them ({ratio}{single}): mask replay is in place, but the "
            f"tokens outside the kept sets are never sampled, so the policy trained is the truncated one.")


def _dropped_nan(nan: dict) -> str | None:
    """7. Loss-masked tokens dropped for missing or NaN log-probs (--nan drop)."""
    n_bad = sum(nan.get("tokens", {}).values())
    if not n_bad:
        return None
    return (f"{n_bad} loss-masked tokens had missing or NaN log-probs ({nan['sequences']} sequences): "
            f"excluded from token statistics, their sequences from sequence statistics.")
