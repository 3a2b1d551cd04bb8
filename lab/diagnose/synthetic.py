"""Synthetic rollout logs with a known mechanism, for the report's default, the tests and the benchmark.

``simulate``: a bigram language model (logit table Z_v [V, V] for policy version v; Z_{v+1} = Z_v + drift * N(0, 1))
trained asynchronously: every group of responses is sampled by version (trainer version - lag), lag uniform on
0..lag_max, from logits rounded to ``sampler_dtype`` (bfloat16 by default: an inference engine's precision),
while the trainer scores the tokens in float32 at its own version (old) and after the update (current, version + 1).
The mismatch is therefore real rounding plus real staleness, and it is largest on low-probability tokens, as in
bf16 engines (log p = z - logsumexp z: rounding errors cancel for the dominant token and not for the others).
With ``top_k`` / ``top_p`` the sampler truncates as vLLM and SGLang do (top-k first, then the smallest
most-probable prefix of the top-k-renormalised distribution whose mass reaches top_p), samples from the
renormalised q = mu 1[S] / mu(S) and records log q, so that log pi_old - log q = log pi_old(y) - log mu(y) +
log mu(S); ``kept_sets`` records each position's kept set S (token ids, as slime's dump does) and
``renormalise`` makes the trainer's log-probs those of pi renormalised over S (mask replay). The notes give the
mean trainer kept mass pi_old(S) over the loss-masked tokens: under truncation alone the expected token ratio.

``random_log``: independent columns at any size (tens of millions of tokens) for throughput and memory tests;
per-token mismatch noise grows as the sampled token's probability falls.
"""
from __future__ import annotations

import numpy as np
import torch

from lab.diagnose.neutral import NeutralLogWriter, RolloutLogWriter
from lab.diagnose.schema import make_meta

SIM_LOGP = {"sampler_logp": "bigram sampler at a stale version, logits rounded to {dtype}",
            "old_logp": "trainer (float32) at its own version before the update",
            "current_logp": "trainer (float32) after one update (version + 1)"}


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def kept_mask(lp: np.ndarray, top_p: float | None = None, top_k: int | None = None) -> np.ndarray:
    """Boolean mask [..., V] of the tokens a top-k then top-p sampler keeps from log-probs ``lp`` [..., V]: the k
    most probable (top_k None or <= 0: all), then the smallest most-probable prefix of those, renormalised, whose
    mass reaches top_p (None or 1: all); ties broken by token id."""
    V = lp.shape[-1]
    order = np.argsort(-lp, axis=-1, kind="stable")
    p_sorted = np.exp(np.take_along_axis(lp, order, -1))
    keep_sorted = np.ones(p_sorted.shape, bool)
    if top_k is not None and 0 < top_k < V:
        keep_sorted[..., top_k:] = False
        p_sorted = np.where(keep_sorted, p_sorted, 0.0)
    if top_p is not None and top_p < 1:
        p_sorted = p_sorted / p_sorted.sum(-1, keepdims=True)
        before = np.cumsum(p_sorted, -1) - p_sorted  # mass of the more probable tokens
        keep_sorted &= before < top_p
    mask = np.zeros(lp.shape, bool)
    np.put_along_axis(mask, order, keep_sorted, -1)
    return mask


def _renormalised(lp: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """log-probs renormalised over the kept tokens (-inf outside them)."""
    masked = np.where(keep, lp, -np.inf)
    top = masked.max(-1, keepdims=True)
    return masked - top - np.log(np.exp(masked - top).sum(-1, keepdims=True))


def simulate(path, *, steps: int = 12, batch: int = 64, group_size: int = 8, vocab: int = 128, mean_len: int = 96,
             lag_max: int = 2, drift: float = 0.02, logit_scale: float = 3.0, sampler_dtype: str = "bfloat16",
             current: bool = True, top_p: float | None = None, top_k: int | None = None, kept_sets: bool = False,
             renormalise: bool = False, seed: int = 0):
    """Write a simulated asynchronous run of ``steps`` batches of ``batch`` responses to ``path``; returns the path.
    ``top_p`` / ``top_k``: a truncating sampler (module docstring); ``kept_sets``: record its kept sets;
    ``renormalise``: the trainer's log-probs renormalised over them."""
    truncate = (top_p is not None and top_p < 1) or (top_k is not None and 0 < top_k < vocab)
    if (kept_sets or renormalise) and not truncate:
        raise ValueError("kept_sets and renormalise need a truncating sampler (top_p < 1 or 0 < top_k < vocab)")
    rng = np.random.default_rng(seed)
    sdt = getattr(torch, sampler_dtype)
    V, B, G = vocab, batch, group_size
    tables = {0: (logit_scale * rng.standard_normal((V, V))).astype(np.float32)}

    def table(v: int) -> np.ndarray:
        while v not in tables:
            k = max(tables)
            tables[k + 1] = (tables[k] + drift * rng.standard_normal((V, V))).astype(np.float32)
        return tables[v]

    def rounded(v: int) -> np.ndarray:  # the sampler's logits, in its precision
        return torch.from_numpy(table(v)).to(sdt).float().numpy()

    logp = {k: (v.format(dtype=sampler_dtype) if k == "sampler_logp" else v) for k, v in SIM_LOGP.items()}
    if not current:
        logp["current_logp"] = None
    if truncate:
        logp["sampler_logp"] += f", truncated (top_p {top_p}, top_k {top_k}) and renormalised"
        if renormalise:
            for k in ("old_logp", "current_logp"):
                logp[k] = logp[k] and logp[k] + ", renormalised over the sampler's kept set"
    trunc_args = (f", top_p={top_p}, top_k={top_k}, kept_sets={kept_sets}, renormalise={renormalise}"
                  if truncate else "")
    meta = make_meta("synthetic", logp, temperature=1.0, top_p=top_p, top_k=top_k,
                     notes=[f"lab.diagnose.synthetic.simulate(steps={steps}, batch={batch}, vocab={vocab}, "
                            f"mean_len={mean_len}, lag_max={lag_max}, drift={drift}, sampler_dtype={sampler_dtype}"
                            f"{trunc_args}, seed={seed})"])
    rows = np.arange(B)
    kept_mass = [0.0, 0]  # sum of the trainer's pi_old(S) over loss-masked tokens, their count
    with RolloutLogWriter(path, meta) as log:
        for step in range(steps):
            tv = step  # the trainer has made `step` updates
            gen = tv - np.minimum(rng.integers(0, lag_max + 1, size=B // G), tv).repeat(G)
            lengths = np.clip(np.round(mean_len * np.exp(0.5 * rng.standard_normal(B) - 0.125)), 2, 4 * mean_len
                              ).astype(int)
            T = int(lengths.max())
            prompt = rng.integers(0, V, size=B // G).repeat(G)
            versions = sorted(set(gen.tolist()))
            stack = np.stack([rounded(v) for v in versions])
            row_v = np.searchsorted(versions, gen)
            tokens = np.zeros((B, T), np.int64)
            lp_s = np.zeros((B, T), np.float32)
            keep = np.ones((B, T, V), bool) if truncate else None
            prev = prompt.copy()
            for t in range(T):
                lp = _log_softmax(stack[row_v, prev])
                if truncate:
                    keep[:, t] = kept_mask(lp, top_p, top_k)
                    lp = _renormalised(lp, keep[:, t])
                cdf = np.cumsum(np.exp(lp), -1)
                tok = np.minimum((rng.random(B)[:, None] * cdf[:, -1:] > cdf).sum(-1), V - 1)
                tokens[:, t], lp_s[:, t], prev = tok, lp[rows, tok], tok
            mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
            prevs = np.concatenate([prompt[:, None], tokens[:, :-1]], 1)
            lp_old_all = _log_softmax(table(tv)[prevs])
            entropy = -(np.exp(lp_old_all) * lp_old_all).sum(-1)
            lp_cur_all = _log_softmax(table(tv + 1)[prevs]) if current else None
            if truncate:
                mass = np.where(keep, np.exp(lp_old_all), 0.0).sum(-1)
                kept_mass[0] += float((mass * mask).sum())
                kept_mass[1] += int(mask.sum())
                if renormalise:
                    lp_old_all = _renormalised(lp_old_all, keep)
                    lp_cur_all = None if lp_cur_all is None else _renormalised(lp_cur_all, keep)
            lp_old = np.take_along_axis(lp_old_all, tokens[..., None], -1)[..., 0]
            lp_cur = (None if lp_cur_all is None else
                      np.take_along_axis(lp_cur_all, tokens[..., None], -1)[..., 0])
            kept = ([[np.flatnonzero(keep[b, t]) for t in range(lengths[b])] for b in range(B)]
                    if kept_sets else None)
            frac_low = ((tokens < V // 2) * mask).sum(1) / mask.sum(1)
            reward = (rng.random(B) < 1 / (1 + np.exp(-(4 * frac_low - 2)))).astype(np.float32)
            r = reward.reshape(-1, G)
            adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(B)
            log.add(step + 1, np.arange(B), tokens, mask, sampler_logp=lp_s * mask,
                    old_logp=(lp_old * mask).astype(np.float32),
                    current_logp=None if lp_cur is None else (lp_cur * mask).astype(np.float32), version=gen,
                    advantages=adv, rewards=reward, group_ids=np.arange(B // G).repeat(G) + step * (B // G),
                    entropy=entropy * mask, trainer_version=tv, kept_token_ids=kept)
            for v in [k for k in tables if k < tv - lag_max]:
                del tables[v]
        if truncate:
            log.note(f"mean trainer kept mass pi_old(S) over the loss-masked tokens: "
                     f"{kept_mass[0] / max(kept_mass[1], 1):.6f}")
    return path


def random_log(path, n_tokens: int, *, mean_len: int = 256, lengths: tuple[int, int] | None = None, batch: int = 512,
               lag_max: int = 2, seed: int = 0, row_group_rows: int = 1 << 20):
    """Write about ``n_tokens`` token rows of independent synthetic columns (sampler, old and current log-probs,
    versions, advantages, entropy) in batches of ``batch`` sequences; returns the path. Response lengths are
    geometric with mean ``mean_len`` (clipped to 1..8 mean_len), or uniform on ``lengths = (lo, hi)`` inclusive."""
    rng = np.random.default_rng(seed)
    meta = make_meta("synthetic", {"sampler_logp": "random: log U^4", "old_logp": "sampler + noise growing as p falls",
                                   "current_logp": "old + N(0, 0.01^2)"}, temperature=1.0,
                     notes=[f"lab.diagnose.synthetic.random_log(n_tokens={n_tokens}, "
                            f"{f'lengths={tuple(lengths)}' if lengths else f'mean_len={mean_len}'}, seed={seed})"])
    written, step = 0, 0
    with NeutralLogWriter(path, meta, row_group_rows=row_group_rows) as w:
        while written < n_tokens:
            step += 1
            lens = (rng.integers(lengths[0], lengths[1] + 1, size=batch) if lengths
                    else np.clip(rng.geometric(1 / mean_len, size=batch), 1, 8 * mean_len))
            n = int(lens.sum())
            sid = np.repeat(np.arange(batch), lens)
            pos = np.arange(n) - np.repeat(np.cumsum(lens) - lens, lens)
            p = rng.random(n) ** 4 + 1e-9
            s = np.log(p).astype(np.float32)
            spread = (0.002 + 0.05 * (1 - p)).astype(np.float32)
            old = np.minimum(s + rng.standard_normal(n).astype(np.float32) * spread, 0)
            cur = np.minimum(old + 0.01 * rng.standard_normal(n).astype(np.float32), 0)
            lag = np.minimum(rng.integers(0, lag_max + 1, size=batch), step - 1)
            adv = rng.standard_normal(batch)
            w.write_tokens({"run": "", "step": step, "sample_id": sid, "position": pos,
                            "token_id": rng.integers(0, 32000, size=n), "loss_mask": rng.random(n) < 0.97,
                            "sampler_logp": s, "old_logp": old, "current_logp": cur,
                            "version": np.repeat(step - 1 - lag, lens), "advantage": np.repeat(adv, lens),
                            "entropy": rng.gamma(2.0, 0.5, size=n)})
            w.write_sequences({"run": "", "step": step, "sample_id": np.arange(batch),
                               "group_id": np.arange(batch) // 8,
                               "reward": (adv > 0).astype(float), "advantage": adv, "response_length": lens,
                               "version_min": step - 1 - lag, "version_max": step - 1 - lag,
                               "trainer_version": np.full(batch, step - 1)})
            written += n
    return path
