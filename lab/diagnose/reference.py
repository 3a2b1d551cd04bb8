"""A plain pandas read-then-compute of the report's core numbers: the benchmark's baseline and the tests' oracle.

It loads both tables whole (``pd.read_parquet``), keeps the loss-masked tokens and computes with groupby what
lab.diagnose.streaming computes in one bounded-memory pass: per step and pair the token log-ratio's count, mean,
mean |Δ|, sd, k3 and max |Δ|, the sequence weights' Kish ESS, chi2, max-weight share, PSIS k-hat and dominant
share; overall exact quantiles; mean |Δ| and |Δ|-mass share by token probability; the version-lag distribution;
and for each correction the share of tokens it changes and of gradient weight it removes. Its memory grows with
the log (every column of every token at once).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from lab.diagnose.corrections import CORRECTIONS, resolve, sequence_weight
from lab.diagnose.schema import LOGP_COLUMNS, read_meta
from lab.diagnose.streaming import P_EDGES, PAIRS, QS
from lab.diagnose.tables import sequence_stats


def reference(path, corrections=CORRECTIONS) -> dict:
    meta = read_meta(path)
    dtype = np.float32 if meta["logp_dtype"] == "float32" else np.float64
    tok = pd.read_parquet(f"{path}/tokens.parquet")
    seq = pd.read_parquet(f"{path}/sequences.parquet")
    tok["run"], seq["run"] = tok["run"].astype(str), seq["run"].astype(str)
    present = [c for c in LOGP_COLUMNS if meta["logp"][c] is not None]
    pairs = [p for p in ("mismatch", "update", "total") if all(c in present for c in PAIRS[p])]
    tok = tok[tok["loss_mask"]].copy()
    key = ["run", "step", "sample_id"]
    tok = tok.merge(seq[key + ["advantage", "trainer_version"]].rename(columns={"advantage": "seq_adv"}), on=key,
                    how="left")
    for p in pairs:
        a, b = PAIRS[p]
        tok[p] = (tok[a].to_numpy(dtype) - tok[b].to_numpy(dtype)).astype(np.float64)
    adv = tok["advantage"].fillna(tok["seq_adv"]).fillna(1.0)
    tok["a_abs"] = adv.abs()
    tok["adv"] = adv
    out = {"per_step": [], "overall": [], "by_probability": [], "corrections": []}
    groups = seq[["run", "step"]].drop_duplicates()
    for p in pairs:
        d = tok[p]
        g = tok.groupby(["run", "step"], sort=False)[p]
        stats = pd.DataFrame({"n_tok": g.size(), "mean": g.mean(), "mean_abs": g.apply(lambda x: x.abs().mean()),
                              "std": g.std(ddof=1), "k3_token": g.apply(lambda x: (np.expm1(x) - x).mean()),
                              "max_abs": g.apply(lambda x: x.abs().max())})
        L = tok.groupby(key, sort=False)[p].sum()
        for run, step in groups.itertuples(index=False):
            Ls = L.loc[(run, step)].to_numpy() if (run, step) in stats.index else np.zeros(0)
            row = {"run": run, "step": int(step), "pair": p,
                   **(stats.loc[(run, step)].to_dict() if (run, step) in stats.index else {}),
                   **sequence_stats(np.asarray(Ls, np.float64))}
            out["per_step"].append(row)
        q = np.quantile(d, QS) if len(d) else np.full(len(QS), np.nan)
        out["overall"].append({"pair": p, "n_tok": len(d), "mean": d.mean(), "mean_abs": d.abs().mean(),
                               **{f"p{int(round(x * 100)):02d}": v for x, v in zip(QS, q)}})
        ref = tok["sampler_logp"] if "sampler_logp" in present else tok["old_logp"]
        pb = pd.cut(np.exp(ref.astype(np.float64)), P_EDGES, right=False, labels=False)
        by = tok.assign(pb=pb, ad=d.abs()).groupby("pb")["ad"].agg(["size", "mean", "sum"])
        by["abs_mass_share"] = by["sum"] / by["sum"].sum()
        for b, r in by.iterrows():
            out["by_probability"].append({"pair": p, "p_lo": P_EDGES[int(b)], "n_tok": r["size"],
                                          "mean_abs": r["mean"], "abs_mass_share": r["abs_mass_share"]})
    for c in resolve(pairs, corrections):
        if c.level == "token":
            w = np.exp(np.clip(tok[c.pair].to_numpy(), -20, 20))
            coef = c.coefficient(w, tok["adv"].to_numpy())
            a = tok["a_abs"].to_numpy()
            changed = np.abs(coef - w) > 1e-6 * (1 + w)
            row = {"name": c.name, "pair": c.pair, "tokens_changed": changed.mean(),
                   "removed": (a * np.maximum(w - coef, 0)).sum() / (a * w).sum()}
        else:
            s = tok.groupby(key, sort=False).agg(L=(c.pair, "sum"), n=(c.pair, "size"), a_abs=("a_abs", "sum"),
                                                 a_sum=("adv", "sum"), seq_adv=("seq_adv", "first"))
            W = sequence_weight(c, s["L"].to_numpy(), s["n"].to_numpy(np.float64))
            sign = np.where(s["seq_adv"].fillna(s["a_sum"]).to_numpy() >= 0, 1.0, -1.0)
            coef = c.coefficient(W, sign)
            changed = np.abs(coef - W) > 1e-6 * (1 + W)
            n, a = s["n"].to_numpy(np.float64), s["a_abs"].to_numpy()
            row = {"name": c.name, "pair": c.pair, "tokens_changed": n[changed].sum() / n.sum(),
                   "removed": (a * np.maximum(W - coef, 0)).sum() / (a * W).sum()}
        out["corrections"].append(row)
    lag = (seq["trainer_version"] - seq["version_min"]).dropna()
    out["staleness"] = lag.astype(int).value_counts().sort_index().rename("n_seq").reset_index().rename(
        columns={"index": "lag"})
    return {k: (pd.DataFrame(v) if isinstance(v, list) else v) for k, v in out.items()}
