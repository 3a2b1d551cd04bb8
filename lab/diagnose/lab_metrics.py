"""The training simulator's per-mini-batch weight diagnostics, recomputed from a neutral log of the run.

Same formulas as lab.engine.training (``weight_metrics``), same dtypes, same [B, T] layout, so the numbers are equal:

    delta = (log pi - log mu) * mask   (in the log-prob dtype, then float64)     L = delta.sum(-1)
    ess_frac = Kish ESS fraction of L       chi2_seq_sampled = mean e^(2L) - 1       khat = PSIS k-hat of L
    k3_token = sum(k3(delta) * mask) / n_tok,  k3(d) = e^d - 1 - d              n_tok = max(sum mask, 1)
    mismatch_abs_logprob = sum(|log pi_old - log mu| * mask) / n_tok

pi = current_logp, mu = sampler_logp, pi_old = old_logp. One step of the log is one mini-batch: its sequences in
the order they were written, padded to the run's ``batch_width`` (recorded by RolloutLogWriter) so that sums run
over the same [B, T] tensor as during training.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch

from lab import diagnostics
from lab.diagnose.neutral import RolloutLog
from lab.errors import LabError

METRICS = ("ess_frac", "chi2_seq_sampled", "k3_token", "khat", "mismatch_abs_logprob")


def weight_metrics_tensors(lp_pi: torch.Tensor, lp_mu: torch.Tensor, lp_old: torch.Tensor, mask: torch.Tensor) -> dict:
    """Sampled diagnostics of pi against the sampler mu on one [B, T] mini-batch (float64 where the trainer is)."""
    delta = ((lp_pi - lp_mu) * mask).double()
    L = delta.sum(-1)
    n_tok = float(mask.sum().clamp(min=1.0))
    return {"ess_frac": float(diagnostics.kish_ess_fraction(L)),
            "chi2_seq_sampled": float(diagnostics.chi2(L)),
            "k3_token": float((diagnostics.kl_k3(delta) * mask).sum()) / n_tok,
            "khat": float(diagnostics.psis_khat(L.numpy())),
            "mismatch_abs_logprob": float(((lp_old - lp_mu).abs() * mask).sum()) / n_tok}


def densify(tokens: pd.DataFrame, sample_ids: np.ndarray, width: int | None, dtype) -> dict:
    """[B, T] arrays (rows in ``sample_ids`` order) from a step's token rows; absent positions are 0."""
    B = len(sample_ids)
    pos = tokens["position"].to_numpy(np.int64)
    T = int(width) if width else (int(pos.max()) + 1 if len(pos) else 1)
    if len(pos) and pos.max() >= T:
        raise LabError(f"a token position ({int(pos.max())}) is beyond the batch width {T}")
    order = np.argsort(sample_ids, kind="stable")
    rows = order[np.searchsorted(sample_ids[order], tokens["sample_id"].to_numpy(np.int64))]
    out = {}
    for name in ("current_logp", "sampler_logp", "old_logp"):
        a = np.zeros((B, T), dtype)
        a[rows, pos] = tokens[name].to_numpy(dtype)
        out[name] = torch.from_numpy(a)
    m = np.zeros((B, T), dtype)
    m[rows, pos] = tokens["loss_mask"].to_numpy(bool)
    out["mask"] = torch.from_numpy(m)
    return out


def lab_weight_metrics(log, width: int | None = None) -> pd.DataFrame:
    """Per step (one mini-batch): run, step and the five metrics above, in the log's step order."""
    log = log if isinstance(log, RolloutLog) else RolloutLog(log)
    missing = [c for c in ("current_logp", "sampler_logp", "old_logp") if c not in log.logp_columns]
    if missing:
        raise LabError(f"{log.path}: the lab's weight diagnostics need current, sampler and old log-probs; "
                       f"this log lacks {', '.join(missing)}")
    width = width or log.meta.get("batch_width")
    dtype = np.float32 if log.meta["logp_dtype"] == "float32" else np.float64
    seq = log.sequences()
    cols = ["sample_id", "position", "loss_mask", "current_logp", "sampler_logp", "old_logp"]
    rows = []
    for (run, step), group in seq.groupby(["run", "step"], sort=False):
        toks = pq.read_table(log.tokens_file, columns=cols,
                             filters=[("run", "=", run), ("step", "=", int(step))]).to_pandas()
        dense = densify(toks, group["sample_id"].to_numpy(np.int64), width, dtype)
        rows.append({"run": run, "step": int(step), **weight_metrics_tensors(
            dense["current_logp"], dense["sampler_logp"], dense["old_logp"], dense["mask"])})
    return pd.DataFrame(rows, columns=["run", "step", *METRICS])
