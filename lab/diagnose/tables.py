"""From the accumulated state of a pass (lab.diagnose.streaming) to the report's tables, summary and verdict.

Per step and pair, over the step's sequences (those without NaN tokens): Kish ESS fraction (sum W)^2 / (n sum W^2)
(Kish 1965), ``chi2_seq_sampled`` = mean W^2 - 1 (the sampled estimate; lab.engine.exact's ``chi2_seq`` is the
exact one), max-weight share, PSIS Pareto k-hat (Vehtari et al. 2024; > 0.7: unreliable; NaN below 25 sequences),
the *dominant share* (the smallest fraction of the step's sequences that holds half of its total weight W),
k3 = mean over tokens of e^delta - 1 - delta (Schulman 2020), and the token log-ratio's moments and quantiles.
These are lab.diagnostics' functions, the ones the training simulator logs.

The tables are pandas DataFrames built on first access (``LazyTables``): the summary and the verdict need none,
so ``lab diagnose`` without ``--out`` never imports pandas.
"""
from __future__ import annotations

from collections.abc import MutableMapping

import numpy as np

from lab import diagnostics as wd
from lab.diagnose import dashboards, histogram as H, truncation
from lab.diagnose.corrections import sequence_weight
from lab.diagnose.streaming import KHAT_WARN, LOW_P, MAX_LAG, P_EDGES, PAIR_TEXT, QS, Diagnostics
from lab.diagnose.fits import median_interval, ols, ratio_intervals
from lab.diagnose.verdict import verdict


class LazyTables(MutableMapping):
    """{name: DataFrame} whose entries may be given as ``Pending(fn)``: fn() is called (once) on first access."""

    def __init__(self):
        self._d = {}

    def __getitem__(self, key):
        v = self._d[key]
        if isinstance(v, Pending):
            v = self._d[key] = v.fn()
        return v

    def __setitem__(self, key, value):
        self._d[key] = value

    def __delitem__(self, key):
        del self._d[key]

    def __iter__(self):
        return iter(self._d)

    def __len__(self):
        return len(self._d)


class Pending:
    def __init__(self, fn):
        self.fn = fn


def frame(rows) -> Pending:
    """A DataFrame of ``rows`` (a list of dicts), built when first read."""
    def make():
        import pandas as pd

        return pd.DataFrame(rows)
    return Pending(make)


def dominant_share(L: np.ndarray) -> float:
    """Smallest fraction of the sequences whose weights W = e^L hold at least half of sum W."""
    if L.size == 0:
        return np.nan
    w = np.sort(np.exp(L - L.max()))[::-1]
    cum = np.cumsum(w)
    k = int(np.searchsorted(cum, 0.5 * cum[-1], side="left")) + 1
    return k / L.size


def sequence_stats(L: np.ndarray) -> dict:
    """Weight diagnostics of one step's sequence log-weights (lab.diagnostics, float64)."""
    if L.size == 0:
        return dict.fromkeys(("ess_frac", "chi2_seq_sampled", "max_weight_share", "khat", "dominant_share", "logw_mean",
                              "logw_sd", "w_median", "w_mean"), np.nan)
    t = np.array(L, dtype=np.float64)
    with np.errstate(over="ignore"):
        w_mean = float(np.mean(np.exp(np.minimum(L, 700.0))))
    return {"ess_frac": float(wd.kish_ess_fraction(t)), "chi2_seq_sampled": float(wd.chi2(t)),
            "max_weight_share": float(wd.max_weight_share(t)), "khat": float(wd.psis_khat(L)),
            "dominant_share": dominant_share(L), "logw_mean": float(L.mean()),
            "logw_sd": float(L.std(ddof=1)) if L.size > 1 else np.nan, "w_median": float(np.exp(np.median(L))),
            "w_mean": w_mean}


def _token_stats(n, s, s2, a, k3, mx, hist) -> dict:
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = s / n
        var = np.maximum(s2 / n - mean**2, 0.0) * n / np.maximum(n - 1, 1)
    q = H.quantiles(hist, QS)
    qa = H.abs_quantiles(hist, (0.5, 0.99))
    out = {"n_tok": n, "mean": mean, "mean_abs": np.where(n > 0, a / np.maximum(n, 1), np.nan),
           "std": np.sqrt(var), "k3_token": np.where(n > 0, k3 / np.maximum(n, 1), np.nan), "max_abs": mx,
           "abs_p50": qa[..., 0], "abs_p99": qa[..., 1],
           "neg_share": np.where(n > 0, hist[..., :H.ZERO].sum(-1) / np.maximum(n, 1), np.nan)}
    for j, qq in enumerate(QS):
        out[f"p{int(round(qq * 100)):02d}"] = q[..., j]
    return out


def _sequence_correction(st, c, usable: np.ndarray) -> dict:
    """Per-sequence weights of a sequence-level correction (zeros outside ``usable``) and its shares."""
    n_all = st.n_seq
    ids = np.flatnonzero(usable)
    n = st.n_valid[ids]
    W = sequence_weight(c, st.L[c.pair][ids], n)
    a_seq = st.seq_adv[ids]
    a_seq = np.where(np.isfinite(a_seq), a_seq, st.a_sum[ids])
    coef = c.coefficient(W, np.where(a_seq >= 0, 1.0, -1.0))
    weight = st.a_abs[ids]
    ch = np.abs(coef - W) > 1e-6 * (1.0 + W)
    zero = coef == 0
    out = {}
    for key, v in (("seq_w", weight * W), ("seq_removed", weight * np.maximum(W - coef, 0.0)),
                   ("seq_added", weight * np.maximum(coef - W, 0.0))):
        full = np.zeros(n_all)
        full[ids] = v
        out[key] = full
    tot = n.sum()
    out.update({"tokens_changed": float(n[ch].sum() / tot) if tot else np.nan,
                "tokens_zeroed": float(n[zero].sum() / tot) if tot else np.nan,
                "sequences_changed": float(ch.mean()) if ch.size else np.nan,
                "sequences_zeroed": float(zero.mean()) if zero.size else np.nan})
    return out


def build(st, seed: int = 0) -> Diagnostics:
    """Every table, the summary and the verdict from the accumulated state ``st`` of a pass. Sequences with a NaN
    token or no usable token are left out of the sequence statistics."""
    usable = (st.n_bad_seq == 0) & (st.n_valid > 0)
    seq_corr = {c.name: _sequence_correction(st, c, usable) for c in st.corrections if c.level != "token"}
    ci = _intervals(st, seq_corr, seed)
    tables, summary = LazyTables(), {}
    tables["per_step"], tables["overall"], summary["overall"] = _step_tables(st, usable, ci, seed)
    tables["by_probability"], summary["low_prob"] = _probability_table(st, ci)
    tables["by_length"], tables["growth"], summary["growth"] = _length_tables(st, usable)
    tables["staleness"], summary["staleness"] = _staleness_table(st, usable)
    tables["corrections"], summary["corrections"] = _corrections_table(st, seq_corr, ci)
    tables["truncation"], summary["truncation"] = _truncation(st, ci)
    hist, groups, pairs = st.hist, st.step_groups, st.pairs
    tables["histograms"] = Pending(lambda: _histogram_table(hist, groups, pairs))
    tables["dashboards"] = Pending(lambda: dashboards.table(st))
    summary.update(_run_summary(st))
    summary["verdict"] = verdict(summary)
    summary["headline"] = summary["verdict"][0] if summary["verdict"] else ""
    summary["truncation"] = summary.pop("truncation")  # last: added after the summary's first release
    tables["results"] = Pending(lambda: tidy(tables))
    return Diagnostics(meta=st.log.meta, summary=summary, tables=tables)


def _intervals(st, seq_corr: dict, seed: int) -> dict:
    """Bootstrap intervals (lab.diagnose.fits.ratio_intervals) of the per-sequence ratios sum(num) / sum(den):
    mean |delta| = sum |delta| / n_tok and low-p |delta| mass share per pair; weight removed and added by each
    correction over the weight it is applied to."""
    req = {}
    for p in st.pairs:
        req[f"mean_abs/{p}"] = (st.S_abs[p], st.n_valid)
        req[f"low/{p}"] = (st.S_low[p], st.S_abs[p])
    for c in st.corrections:
        acc = st.tok_corr.get(c.name) or seq_corr[c.name]
        req[f"removed/{c.name}"] = (acc["seq_removed"], acc["seq_w"])
        req[f"added/{c.name}"] = (acc["seq_added"], acc["seq_w"])
    req.update(st.trunc.requests(st.n_valid))  # the mean ratio and the share below 1 (lab.diagnose.truncation)
    return ratio_intervals(req, seed=seed)


def _truncation(st, ci: dict):
    """(truncation table, truncation summary or None): the mean trainer/sampler token ratio and the share of tokens
    with ratio below 1, on all tokens and on those with a recorded kept set (lab.diagnose.truncation)."""
    rows = truncation.rows(st.trunc, st.n_valid, ci, st.log.meta["sampling"])
    return frame(rows), truncation.summary(st.trunc, rows, st.log.meta["sampling"])


# ------------------------------------------------------------------------------------------------ per step, overall
def _step_tables(st, usable: np.ndarray, ci: dict, seed: int):
    """(per_step table, overall table, overall summary): token statistics and sequence_stats per step and pair, and
    over the whole log."""
    order = np.argsort(st.seq_step, kind="stable")
    bounds = np.searchsorted(st.seq_step[order], np.arange(st.S + 1))
    per_step, overall = [], {}
    for p in st.pairs:
        steps_p = _per_step_rows(st, p, usable, order, bounds)
        per_step.extend(steps_p)
        overall[p] = _overall_row(st, p, usable, steps_p, ci, seed)
    return frame(per_step), frame(list(overall.values())), overall


def _per_step_rows(st, p: str, usable: np.ndarray, order: np.ndarray, bounds: np.ndarray) -> list[dict]:
    """One row per step of pair ``p``: its token statistics and the sequence_stats of its usable sequences."""
    m, groups = st.mom[p], st.step_groups
    tok = _token_stats(m["n"], m["sum"], m["sum2"], m["abs"], m["k3"], m["max"], st.hist[p])
    rows = []
    for s in range(st.S):
        ids = order[bounds[s]:bounds[s + 1]]
        ids = ids[usable[ids]]
        row = {"run": groups["run"][s], "step": int(groups["step"][s]), "pair": p, "n_seq": int(ids.size),
               **{k: float(v[s]) for k, v in tok.items()}, **sequence_stats(st.L[p][ids])}
        row["khat_warning"] = bool(row["khat"] > KHAT_WARN)
        rows.append(row)
    return rows


def _overall_row(st, p: str, usable: np.ndarray, steps_p: list[dict], ci: dict, seed: int) -> dict:
    """Pair ``p`` over the whole log: pooled token statistics, medians over steps (with bootstrap intervals) of the
    Kish ESS fraction and dominant share, k-hat warning counts and the log-weight of all usable sequences."""
    m = st.mom[p]
    tot = _token_stats(m["n"].sum(), m["sum"].sum(), m["sum2"].sum(), m["abs"].sum(), m["k3"].sum(),
                       m["max"].max(initial=0.0), st.hist[p].sum(0))
    ess = median_interval([r["ess_frac"] for r in steps_p], seed=seed)
    dom = median_interval([r["dominant_share"] for r in steps_p], seed=seed)
    kh = np.array([r["khat"] for r in steps_p], dtype=float)
    mabs = ci[f"mean_abs/{p}"]
    L = st.L[p][usable]
    return {"pair": p, **{k: float(v) for k, v in tot.items()}, "mean_abs_lo": mabs[1],
            "mean_abs_hi": mabs[2], "n_seq": int(usable.sum()), "n_steps": st.S,
            "ess_median": ess[0], "ess_lo": ess[1], "ess_hi": ess[2],
            "dominant_median": dom[0], "dominant_lo": dom[1], "dominant_hi": dom[2],
            "khat_steps": int(np.isfinite(kh).sum()), "khat_warning_steps": int((kh > KHAT_WARN).sum()),
            "khat_median": float(np.nanmedian(kh)) if np.isfinite(kh).any() else np.nan,
            **{k: v for k, v in sequence_stats(L).items() if k in ("logw_mean", "logw_sd", "w_median", "w_mean")},
            "median_len": float(np.median(st.n_valid[usable])) if usable.any() else np.nan}


# ------------------------------------------------------------------------------------------------ token probability
def _probability_table(st, ci: dict):
    """(by_probability table, low_prob summary): the log-ratio per bin of the reference token probability p."""
    rows, low = [], {}
    for p in st.pairs:
        rows.extend(_probability_rows(st.pbin[p], p))
        low[p] = _low_prob(st.pbin[p], ci[f"low/{p}"])
    return frame(rows), low


def _probability_rows(q: dict, p: str) -> list[dict]:
    """Per p bin b: n_tok, token share n_b / n, mean = sum_b / n_b, mean |delta|, rms = sqrt(sum2_b / n_b), the
    bin's share of the total |delta| mass, and the mean ratio e^delta (pairs over the sampler; NaN for the others)."""
    n_all, abs_all = q["n"].sum(), q["abs"].sum()
    rows = []
    for b in range(len(P_EDGES) - 1):
        n = q["n"][b]
        rows.append({"pair": p, "p_lo": P_EDGES[b], "p_hi": min(P_EDGES[b + 1], 1.0), "n_tok": n,
                     "token_share": n / n_all if n_all else np.nan,
                     "mean": q["sum"][b] / n if n else np.nan, "mean_abs": q["abs"][b] / n if n else np.nan,
                     "rms": np.sqrt(q["sum2"][b] / n) if n else np.nan,
                     "abs_mass_share": q["abs"][b] / abs_all if abs_all else np.nan,
                     "mean_ratio": q["ratio"][b] / n if n and p in ("mismatch", "total") else np.nan})
    return rows


def _low_prob(q: dict, mass) -> dict:
    """Tokens with p < LOW_P: their share, their |delta| mass share (with its interval ``mass``), and mean |delta|
    on them against tokens with p >= 0.9."""
    n_all = q["n"].sum()
    lo_b = P_EDGES[1:] <= LOW_P + 1e-12
    hi_b = P_EDGES[:-1] >= 0.9 - 1e-12
    n_lo, n_hi = q["n"][lo_b].sum(), q["n"][hi_b].sum()
    return {"token_share": n_lo / n_all if n_all else np.nan, "abs_mass_share": mass[0], "lo": mass[1],
            "hi": mass[2], "mean_abs_low": q["abs"][lo_b].sum() / n_lo if n_lo else np.nan,
            "mean_abs_high": q["abs"][hi_b].sum() / n_hi if n_hi else np.nan}


# ------------------------------------------------------------------------------------------------ length
def _length_tables(st, usable: np.ndarray):
    """(by_length table, growth table, growth summary): the sequence log-weight L in power-of-two length bins, and
    its growth with length."""
    n_len = st.n_valid[usable]
    if n_len.size:
        edges = 2.0 ** np.arange(0, max(int(np.ceil(np.log2(n_len.max() + 1))) + 1, 1) + 1)
    else:
        edges = np.array([1., 2.])
    rows, growth = [], {}
    for p in st.pairs:
        L = st.L[p][usable]
        rows.extend(_length_rows(L, n_len, edges, p))
        growth[p] = _growth(L, n_len)
    return frame(rows), frame([{"pair": p, **g} for p, g in growth.items()]), growth


def _length_rows(L: np.ndarray, n_len: np.ndarray, edges: np.ndarray, p: str) -> list[dict]:
    """Per non-empty length bin [edges[k], edges[k + 1]): n_seq, mean length, mean L, mean |L|, sd L and the median
    weight e^median(L)."""
    b = np.clip(np.searchsorted(edges, n_len, side="right") - 1, 0, len(edges) - 2)
    rows = []
    for k in range(len(edges) - 1):
        sel = b == k
        if not sel.any():
            continue
        Lk = L[sel]
        rows.append({"pair": p, "len_lo": int(edges[k]), "len_hi": int(edges[k + 1]) - 1, "n_seq": int(sel.sum()),
                     "mean_len": float(n_len[sel].mean()), "logw_mean": float(Lk.mean()),
                     "logw_abs_mean": float(np.abs(Lk).mean()),
                     "logw_sd": float(Lk.std(ddof=1)) if Lk.size > 1 else np.nan,
                     "w_median": float(np.exp(np.median(Lk)))})
    return rows


def _growth(L: np.ndarray, n_len: np.ndarray) -> dict:
    """Drift per token = OLS slope of L on length; variance per token = OLS slope of the squared residual on length
    (residual about the fit, or about mean L when there is no slope)."""
    drift = ols(n_len, L)
    resid = L - drift["intercept"] - drift["slope"] * n_len if np.isfinite(drift["slope"]) else L - L.mean()
    var = ols(n_len, resid**2)
    return {"drift_per_token": drift["slope"], "drift_lo": drift["lo"], "drift_hi": drift["hi"],
            "var_per_token": var["slope"], "var_lo": var["lo"], "var_hi": var["hi"], "n_seq": drift["n"]}


# ------------------------------------------------------------------------------------------------ staleness
def _staleness_table(st, usable: np.ndarray):
    """(staleness table, staleness summary or None): lag = trainer_version - version_min per sequence (from the
    sequences table), token counts and mean |delta| per lag from the pass."""
    seq = st.seq
    tv = st.seq_tv
    lag_max = tv - np.asarray(seq["version_min"], np.float64)
    lag_min = tv - np.asarray(seq["version_max"], np.float64)
    known = np.isfinite(lag_max)
    if not known.any():
        return frame([]), None
    lags = lag_max[known].astype(np.int64)
    rows = [_staleness_row(st, usable, lag_max, known, lag) for lag in np.unique(lags)]
    stale = lag_max[known]
    summary = {"n_seq": int(known.sum()), "stale_share": float((stale >= 1).mean()),
               "mean_lag": float(stale.mean()), "max_lag": int(stale.max()),
               "negative_lags": int((stale < 0).sum()),
               "spanning_versions": int((lag_max[known] != lag_min[known]).sum()),
               "pair": "total" if "total" in st.pairs else st.pairs[0]}
    return frame(rows), summary


def _staleness_row(st, usable: np.ndarray, lag_max: np.ndarray, known: np.ndarray, lag) -> dict:
    """One lag: its sequences and their share; per pair the tokens at that lag, their mean |delta| and the mean |L|
    of its usable sequences."""
    sel = known & (lag_max == lag)
    r = {"lag": int(lag), "n_seq": int(sel.sum()), "seq_share": float(sel.sum() / known.sum())}
    b = MAX_LAG + 1 if lag < 0 else min(int(lag), MAX_LAG)
    for p in st.pairs:
        g = st.lag[p]
        r[f"n_tok_{p}"] = float(g["n"][b])
        r[f"mean_abs_{p}"] = g["abs"][b] / g["n"][b] if g["n"][b] else np.nan
        Ls = st.L[p][sel & usable]
        r[f"logw_abs_mean_{p}"] = float(np.abs(Ls).mean()) if Ls.size else np.nan
    return r


# ------------------------------------------------------------------------------------------------ corrections
def _corrections_table(st, seq_corr: dict, ci: dict):
    """(corrections table, corrections summary): per correction the shares of tokens and sequences it changes or
    zeroes and the gradient weight it removes and adds (with intervals)."""
    rows, corr_sum = [], {}
    for c in st.corrections:
        rem, add = ci[f"removed/{c.name}"], ci[f"added/{c.name}"]
        tok_changed, tok_zeroed, seq_changed, seq_zeroed = _correction_shares(st, c, seq_corr)
        row = {"name": c.name, "label": c.label, "level": c.level, "pair": c.pair, "hyper": c.describe(),
               "tokens_changed": tok_changed, "tokens_zeroed": tok_zeroed, "sequences_changed": seq_changed,
               "sequences_zeroed": seq_zeroed, "removed": rem[0], "removed_lo": rem[1], "removed_hi": rem[2],
               "added": add[0], "added_lo": add[1], "added_hi": add[2]}
        rows.append(row)
        corr_sum[c.name] = {k: v for k, v in row.items() if k != "name"}
    return frame(rows), corr_sum


def _correction_shares(st, c, seq_corr: dict) -> tuple:
    """(tokens changed, tokens zeroed, sequences changed, sequences zeroed) as shares; a token-level correction's
    sequence share counts sequences with any changed token, and it zeroes no whole sequence (NaN)."""
    if c.level != "token":
        acc = seq_corr[c.name]
        return acc["tokens_changed"], acc["tokens_zeroed"], acc["sequences_changed"], acc["sequences_zeroed"]
    has_tok = st.n_valid > 0
    acc = st.tok_corr[c.name]
    n_tok, changed, zeroed = acc["tot"][0], acc["tot"][1], acc["tot"][2]
    seq_changed = float((acc["seq_changed"][has_tok] > 0).mean()) if has_tok.any() else np.nan
    tok_changed, tok_zeroed = changed / n_tok if n_tok else np.nan, zeroed / n_tok if n_tok else np.nan
    return tok_changed, tok_zeroed, seq_changed, np.nan


# ------------------------------------------------------------------------------------------------ histograms, facts
def _histogram_table(hist: dict, step_groups: dict, pairs: list):
    """Non-empty histogram bins per pair, overall (run and step null) and per step."""
    import pandas as pd

    lo, hi = H.bin_edges()
    runs = np.asarray(step_groups["run"], object)
    steps = np.asarray(step_groups["step"], np.int64)
    parts = []
    for p in pairs:
        counts = np.concatenate([hist[p].sum(0, keepdims=True), hist[p]])  # row 0: overall, row s + 1: step s
        row, nz = np.nonzero(counts)
        per_step = row > 0
        step = pd.array(np.where(per_step, steps[row - 1], 0), dtype="Int64")
        step[~per_step] = pd.NA
        parts.append(pd.DataFrame({"pair": p, "run": pd.Series(np.where(per_step, runs[row - 1], None), dtype=object),
                                   "step": step,
                                   "bin": nz, "bin_lo": lo[nz], "bin_hi": hi[nz], "count": counts[row, nz]}))
    return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()


def _run_summary(st) -> dict:
    """The log's facts for the summary: source, log-prob meaning, sampling, pairs, counts, advantage sources, NaN
    handling and whether sampling was truncated (top_p < 1 or top_k > 0)."""
    meta = st.log.meta
    bad = {k: int(v) for k, v in st.bad.items()}
    return {
        "study": "diagnose", "source": meta["source"], "logp": meta["logp"], "sampling": meta["sampling"],
        "pairs": st.pairs, "pair_text": {p: PAIR_TEXT[p] for p in st.pairs},
        "n_token_rows": int(st.n_rows.sum()), "n_loss_tokens": int(st.n_masked.sum()),
        "n_tokens_used": int(st.n_valid.sum()), "n_sequences": int(st.n_seq), "n_steps": int(st.S),
        "advantages": sorted(st.adv_source) or ["none"],
        "nan": {"mode": st.nan, "tokens": bad, "sequences": int((st.n_bad_seq > 0).sum())},
        "truncated_sampling": bool((meta["sampling"]["top_p"] or 1) < 1 or (meta["sampling"]["top_k"] or 0) > 0),
        "notes": meta.get("notes", []),
    }


INTERVALS = {"mean_abs": ("mean_abs_lo", "mean_abs_hi"), "ess_median": ("ess_lo", "ess_hi"),
             "dominant_median": ("dominant_lo", "dominant_hi"), "removed": ("removed_lo", "removed_hi"),
             "added": ("added_lo", "added_hi"), "drift_per_token": ("drift_lo", "drift_hi"),
             "var_per_token": ("var_lo", "var_hi"), "abs_mass_share": ("lo", "hi"),
             "mean_ratio": ("mean_ratio_lo", "mean_ratio_hi"), "below_one": ("below_one_lo", "below_one_hi")}
SECTION_KEYS = {"per_step": ["pair", "run", "step"], "overall": ["pair"], "by_probability": ["pair", "p_lo", "p_hi"],
                "by_length": ["pair", "len_lo", "len_hi"], "growth": ["pair"], "staleness": ["lag"],
                "corrections": ["name", "pair"], "truncation": ["pair", "name"]}
TIDY_COLUMNS = ["section", "pair", "run", "step", "name", "lag", "p_lo", "p_hi", "len_lo", "len_hi", "metric", "value",
                "lo", "hi"]


def tidy(tables: dict):
    """One long table of every number: section, its keys (pair, run, step, name, lag, p or length bin), metric,
    value and the 95 % interval (lo, hi) where the report computes one; per section, metric by metric."""
    import pandas as pd

    bounds = {c for pair in INTERVALS.values() for c in pair}
    key_cols = TIDY_COLUMNS[1:-4]
    cols = {c: [] for c in TIDY_COLUMNS}
    for section, keys in SECTION_KEYS.items():
        df = tables.get(section)
        if df is None or df.empty:
            continue
        metrics = [c for c in df.columns if c not in keys and c not in bounds
                   and pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])]
        n = len(df) * len(metrics)
        cols["section"].append(np.full(n, section, object))
        for c in key_cols:
            cols[c].append(np.tile(df[c].to_numpy(object), len(metrics)) if c in keys else np.full(n, None, object))
        cols["metric"].append(np.repeat(np.array(metrics, object), len(df)))
        cols["value"].append(_floats(df, metrics))
        for j, side in enumerate(("lo", "hi")):
            cols[side].append(_floats(df, [INTERVALS[m][j] if m in INTERVALS and INTERVALS[m][j] in df else None
                                           for m in metrics]))
    if not cols["section"]:
        return pd.DataFrame(columns=TIDY_COLUMNS)
    out = pd.DataFrame({c: pd.Series(np.concatenate(v), dtype=str if c in ("section", "metric") else None)
                        for c, v in cols.items()})
    for col in ("step", "lag"):
        out[col] = pd.array(pd.to_numeric(out[col]), dtype="Int64")
    for col in ("p_lo", "p_hi", "len_lo", "len_hi"):
        out[col] = pd.to_numeric(out[col]).astype(float)
    for col in ("pair", "run", "name"):
        out[col] = out[col].astype(object).where(out[col].notna(), None)
    return out


def _floats(df, columns: list) -> np.ndarray:
    """The columns (None: all NaN) one after the other, as float64."""
    return np.concatenate([np.full(len(df), np.nan) if c is None else
                           df[c].to_numpy(dtype=float, na_value=np.nan) for c in columns])
