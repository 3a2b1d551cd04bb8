"""VESPO's staleness table (Shen et al., arXiv 2602.10693): average accuracy of Qwen3-30B-A3B at N = 4/8/16/32/64
mini-batches per rollout, and the toy's sync study set beside it. GRPO's loss is the PPO-clipped token ratio, so the
lab's ``ppo_clip`` stands in for it. The real_staleness_training study reads the same table from here."""
from __future__ import annotations

import pandas as pd

PAPER_N = (4, 8, 16, 32, 64)
PAPER = {"ppo_clip": (54.0, 57.0, 51.1, 52.4, 48.6),  # GRPO (PPO-clipped token ratio)
         "gspo": (59.9, 59.1, 58.3, 50.0, 47.6),
         "sapo": (65.2, 51.7, 50.5, 20.9, 16.5),
         "vespo": (70.0, 70.0, 67.3, 64.5, 61.8)}
PAPER_NAMES = {"ppo_clip": "GRPO", "gspo": "GSPO", "sapo": "SAPO", "vespo": "VESPO"}
RANK_TIE = 0.005  # IQMs closer than this share a rank


def paper_comparison(table: pd.DataFrame, label: str = "final_reward") -> dict | None:
    """Per paper estimator present in the sync study: toy IQM at the N of the paper that were swept, the toy's
    and the paper's change from the smallest to the largest shared N, and the ranks at the largest shared N
    (1 + the number of estimators clearly above, ties within ``RANK_TIE`` share a rank). The N compared are those
    every paper method present has (a partly finished sweep compares what all of them finished); None when fewer
    than two are shared with the paper or none of its methods was trained."""
    if "sync" not in set(table["study"]):
        return None
    t = table[(table["study"] == "sync") & (table["metric"] == f"{label}_iqm")]
    ests = [e for e in PAPER if e in set(t["estimator"])]
    shared = sorted(set(PAPER_N).intersection(*(set(t.loc[t["estimator"] == e, "x"]) for e in ests)))
    if len(shared) < 2 or not ests:
        return None
    lo_n, hi_n = shared[0], shared[-1]
    out = {"n_low": lo_n, "n_high": hi_n, "estimators": {}}
    for e in ests:
        toy = t[t["estimator"] == e].set_index("x")
        paper = dict(zip(PAPER_N, PAPER[e]))
        out["estimators"][e] = {
            "paper_name": PAPER_NAMES[e],
            "toy_low": float(toy.loc[lo_n, "value"]), "toy_high": float(toy.loc[hi_n, "value"]),
            "toy_high_interval": [float(toy.loc[hi_n, "lo"]), float(toy.loc[hi_n, "hi"])],
            "paper_low": paper[lo_n] / 100, "paper_high": paper[hi_n] / 100}
    for key in ("toy_high", "paper_high"):
        vals = {e: out["estimators"][e][key] for e in ests}
        for e in ests:
            out["estimators"][e][key.replace("high", "rank")] = 1 + sum(v > vals[e] + RANK_TIE for v in vals.values())
    return out
