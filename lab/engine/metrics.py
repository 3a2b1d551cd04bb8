"""Statistics of M gradient estimates against a target, and sampled importance-weight diagnostics.

Every vector statistic is a quadratic form in the Gram matrix of the estimates, so a bootstrap resample (a row
c of replicate counts) costs O(M^2), not O(M D); ``streamed_metrics`` builds the Gram from replicate chunks in
bounded memory:

    bias2      = ||mean_m g_m - g*||^2 - variance / M  (unbiased for ||E g - g*||^2; bias_norm = sqrt(max(bias2, 0)))
    variance   = trace Cov(g_m) (divisor M - 1)       mse = mean_m ||g_m - g*||^2
    cos_mean   = cos(mean_m g_m, g*)                  cos_single = mean_m cos(g_m, g*)

A sampled target (a Monte Carlo reference g* = g_true + e, e independent of the estimates with E e = 0 and
tr Cov(e) = ``target_var``) enters these forms linearly except through ||g*||^2, whose expectation is
||g_true||^2 + target_var. Every statistic therefore uses ||g*||^2 - target_var in its place (so bias2 and mse are
unbiased against g_true; rel_mse and the cosines, ratios by that norm, are NaN where it is not positive: the
reference does not resolve g_true), and the interval of bias2 is widened in quadrature by the sd of the
reference's own error, at most sqrt(4 bias2 target_var + 2 target_var^2) (the cross term 2 b.e and ||e||^2, bounded
through lambda_max(Cov e) <= tr Cov e). With an exact target (target_var = 0) nothing changes.
"""
from __future__ import annotations

import numpy as np
import torch
from scipy.special import erfinv

from lab import diagnostics, stats


def _resampled(gram: np.ndarray, counts: np.ndarray):
    """Rows: the sample itself, then each bootstrap resample. Returns (C, c^T G c, c^T diag G) per row."""
    M = gram.shape[0]
    C = np.vstack([np.ones(M), counts])
    return C, ((C @ gram) * C).sum(1), C @ np.diag(gram)


def variance_resamples(grads: torch.Tensor, counts: np.ndarray) -> np.ndarray:
    """tr Cov of the estimates [M, D] for the sample itself and each bootstrap resample: [1 + n_boot].

    The same ``counts`` for every estimator resamples replicate indices jointly, so ratios of these series are
    bootstrap draws of a variance ratio.
    """
    g = grads.double()
    M = g.shape[0]
    _, q, cd = _resampled((g @ g.T).numpy(), counts)
    return (cd - q / M) / (M - 1)


def gram_metrics(grads: torch.Tensor, target: torch.Tensor, counts: np.ndarray, ci: float,
                 target_var: float = 0.0) -> dict:
    """Bias, variance, MSE and cosines of estimates [M, D] against ``target`` [D], with bootstrap intervals.

    ||mean g - g*||^2 overstates the squared bias by variance / M, so the bias and the cosine of the mean use
    the debiased forms (bias2 = ||mean g - g*||^2 - variance/M; ||mean g||^2 - variance/M in the cosine's norm,
    NaN where that debiased squared norm is not positive: the mean is lost in the noise)
    with normal bootstrap intervals (point -/+ z sd of the resampled statistic): a percentile interval would
    inherit the resamples' upward shift. The variance and the means over replicates (mse, cos_single) use
    percentile intervals. ``target_var``: tr Cov of a sampled target (see the module docstring; 0: exact).
    """
    g = grads.double()
    gram = (g @ g.T).numpy()
    h = (g @ target.double()).numpy()
    return _statistics(gram, h, np.diag(gram).copy(), float(target.double() @ target.double()), counts, ci,
                       target_var)


def _statistics(gram: np.ndarray, h: np.ndarray, diag: np.ndarray, tt: float, counts: np.ndarray, ci: float,
                target_var: float = 0.0) -> dict:
    """gram_metrics from the Gram matrix, the inner products h with the target, the squared norms ``diag`` (the
    Gram's diagonal), ||target||^2 and the target's own tr Cov (``target_var``)."""
    M = gram.shape[0]
    tt = tt - target_var  # debiased ||g_true||^2 (exactly tt for an exact target)
    C, q, cd = _resampled(gram, counts)
    ch = C @ h
    variance = (cd - q / M) / (M - 1)
    mean_sq = q / M**2 - variance / M  # debiased ||E g||^2
    bias2 = mean_sq - 2 * ch / M + tt
    with np.errstate(divide="ignore", invalid="ignore"):
        cos_mean = np.where(mean_sq > 0, np.clip((ch / M) / np.sqrt(np.abs(mean_sq) * tt), -1.0, 1.0), np.nan)
        cos_single = h / np.sqrt(diag * tt)
    z = float(np.sqrt(2.0) * erfinv(ci))
    out = {}
    out["variance"] = (float(variance[0]), *stats.percentile_interval(variance[1:], ci))
    for key, series in {"bias2": bias2, "cos_mean": cos_mean}.items():
        boot = series[1:][np.isfinite(series[1:])]
        sd = float(np.std(boot, ddof=1)) if boot.size > 1 else float("nan")
        if key == "bias2" and target_var > 0:
            sd = float(np.hypot(sd, reference_sd(float(series[0]), target_var)))
        out[key] = (float(series[0]), float(series[0]) - z * sd, float(series[0]) + z * sd)
    out["cos_mean"] = tuple(float(np.clip(v, -1.0, 1.0)) for v in out["cos_mean"])
    out["bias_norm"] = tuple(float(np.sqrt(max(v, 0.0))) for v in out["bias2"])
    out["mse"] = stats.mean_interval(diag - 2 * h + tt, counts, ci)
    out["rel_mse"] = tuple(v / tt if tt > 0 else float("nan") for v in out["mse"])
    out["cos_single"] = stats.mean_interval(cos_single, counts, ci)
    return out


def reference_sd(bias2: float, target_var: float) -> float:
    """Bound on the sd that a sampled target's error e (tr Cov e = target_var) adds to bias2 = ||b - e||^2 - ...:
    Var(2 b.e - ||e||^2) <= 4 ||b||^2 target_var + 2 target_var^2 (Gaussian e, lambda_max(Cov e) <= tr Cov e)."""
    return float(np.sqrt(4.0 * max(bias2, 0.0) * target_var + 2.0 * target_var**2))


def streamed_metrics(stream, M: int, D: int, target: torch.Tensor, budget: int, counts: np.ndarray, ci: float,
                     buffer: torch.Tensor | None = None, target_var: float = 0.0):
    """``gram_metrics`` of M estimates that arrive in replicate chunks, in memory bounded by ``budget`` bytes.

    ``stream(start)`` yields (rows, estimates [c, D], estimator metrics) for replicates start..M-1 in order,
    recomputing them on every call (the engine's gradients are deterministic). When all M x D float32 estimates
    fit the budget they are kept (in ``buffer`` when given) and this is exactly ``gram_metrics``. Otherwise the
    Gram matrix is built exactly block by block: pass p holds a block of ``budget / (8 D)`` replicates and takes
    its inner products with itself and every later replicate, so memory stays O(budget + M^2) whatever M and D
    (with the stream's own chunks bounded too: ``lab.engine.gradients.budget_chunk``), at the price of about
    M / (2 block) recomputations of the estimates. ``target_var``: tr Cov of a sampled target (module docstring).
    Returns (statistics, the estimator's own per-replicate metrics concatenated, the buffer for reuse or None).
    """
    target = target.detach().cpu()
    if M * D * 4 <= budget:
        metrics = []
        for rows, g, m in stream(0):
            if rows.start == 0 and rows.stop == M and g.dtype == torch.float32 and g.device.type == "cpu":
                buffer = g.detach()  # one chunk of all replicates: keep it as the buffer
            else:
                if buffer is None or buffer.shape != (M, D) or buffer.dtype != torch.float32:
                    buffer = torch.zeros(M, D, dtype=torch.float32)
                buffer[rows] = g.detach().float().cpu()
            metrics.append(m)
        return gram_metrics(buffer, target.float(), counts, ci, target_var), _cat(metrics), buffer
    t = target.double().cpu()
    block = max(1, budget // (8 * D))  # replicates held per pass, in float64
    gram, h, metrics = np.zeros((M, M)), np.zeros(M), []
    for p0 in range(0, M, block):
        p1 = min(p0 + block, M)
        held = torch.zeros(p1 - p0, D, dtype=torch.float64)
        for rows, g, m in stream(p0):
            g = g.detach().double().cpu()
            if p0 == 0:
                metrics.append(m)
            lo, hi = rows.start, rows.stop
            if lo < p1:  # replicates of this block: hold them; once complete, the block's own Gram
                held[lo - p0:min(hi, p1) - p0] = g[:min(hi, p1) - lo]
                h[lo:min(hi, p1)] = (g[:min(hi, p1) - lo] @ t).numpy()
                if hi >= p1:
                    gram[p0:p1, p0:p1] = (held @ held.T).numpy()
            if hi > p1:  # later replicates: their inner products with this block
                later = slice(max(lo, p1), hi)
                prod = (held @ g[later.start - lo:].T).numpy()
                gram[p0:p1, later] = prod
                gram[later, p0:p1] = prod.T
    return _statistics(gram, h, np.diag(gram).copy(), float(t @ t), counts, ci, target_var), _cat(metrics), None


def streamed_memory(M: int, D: int, chunk: int, budget: int) -> dict:
    """Bytes that ``streamed_metrics`` allocates at its peak, fed chunks of c = min(chunk, M) replicates:

        estimates  within the budget (4 M D <= budget): 4 M D (the float32 table) + 8 M D (its float64 copy);
                   beyond it: 8 b D (the held float64 block, b = min(M, budget // 8 D)) + 12 c D (one chunk in
                   float32 and in float64)
        chunk      8 c D (one chunk as float64 rows: what ``budget_chunk`` keeps within the budget)
        gram       8 M^2 (the Gram matrix) + 8 M (its diagonal and the inner products with the target)
    """
    c = min(chunk, M)
    if 4 * M * D <= budget:
        estimates = 12 * M * D
    else:
        estimates = 8 * min(M, max(1, budget // (8 * D))) * D + 12 * c * D
    return {"estimates": estimates, "chunk": 8 * c * D, "gram": 8 * M * M + 16 * M}


def _cat(metrics: list) -> dict:
    return {k: torch.cat([m[k] for m in metrics]) for k in metrics[0]} if metrics else {}


def weight_diagnostics(batch, log_prob_pi: torch.Tensor, counts: np.ndarray, ci: float) -> dict:
    """Sampled weight diagnostics per replicate of ``batch`` ([M, B, T]), summarised with bootstrap intervals."""
    delta = (log_prob_pi - batch.behaviour_log_probs) * batch.mask  # [M, B, T]
    L = delta.sum(-1).double()  # [M, B]
    tokens = batch.mask.sum((-2, -1)).double()
    per_rep = {
        "ess_frac": diagnostics.kish_ess_fraction(L),
        "max_weight_share": diagnostics.max_weight_share(L),
        "chi2_seq_sampled": diagnostics.chi2(L),
        "k1_seq": diagnostics.kl_k1(L).mean(-1),
        "k3_seq": diagnostics.kl_k3(L).mean(-1),
        "k1_token": (diagnostics.kl_k1(delta.double()) * batch.mask).sum((-2, -1)) / tokens,
        "k3_token": (diagnostics.kl_k3(delta.double()) * batch.mask).sum((-2, -1)) / tokens,
        "khat": torch.from_numpy(diagnostics.psis_khat(L.numpy())),
    }
    return {k: stats.mean_interval(v.numpy(), counts, ci) for k, v in per_rep.items()}
