"""Synthetic rollout logs with a known mechanism, for the report's default, the tests and the benchmark.

``simulate``: a bigram language model (logit table Z_v [V, V] for policy version v; Z_{v+1} = Z_v + drift * N(0, 1))
trained asynchronously: every group of responses is sampled by version (trainer version - lag), lag uniform on
0..lag_max, from logits rounded to ``sampler_dtype`` (bfloat16 by default: an inference engine's precision),
while the trainer scores the tokens in float32 at its own version (old) and after the update (current, version + 1).
The mismatch is therefore real rounding plus real staleness, and it is largest on low-probability tokens, as in
bf16 engines (log p = z - logsumexp z: rounding errors cancel for the dominant token and not for the others).

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


def simulate(path, *, steps: int = 12, batch: int = 64, group_size: int = 8, vocab: int = 128, mean_len: int = 96,
             lag_max: int = 2, drift: float = 0.02, logit_scale: float = 3.0, sampler_dtype: str = "bfloat16",
             current: bool = True, seed: int = 0):
    """Write a simulated asynchronous run of ``steps`` batches of ``batch`` responses to ``path``; returns the path."""
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
    meta = make_meta("synthetic", logp, temperature=1.0, notes=[f"lab.diagnose.synthetic.simulate(steps={steps}, "
                     f"batch={batch}, vocab={vocab}, mean_len={mean_len}, lag_max={lag_max}, drift={drift}, "
                     f"sampler_dtype={sampler_dtype}, seed={seed})"])
    rows = np.arange(B)
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
            prev = prompt.copy()
            for t in range(T):
                lp = _log_softmax(stack[row_v, prev])
                cdf = np.cumsum(np.exp(lp), -1)
                tok = np.minimum((rng.random(B)[:, None] * cdf[:, -1:] > cdf).sum(-1), V - 1)
                tokens[:, t], lp_s[:, t], prev = tok, lp[rows, tok], tok
            mask = (np.arange(T)[None, :] < lengths[:, None]).astype(np.float32)
            prevs = np.concatenate([prompt[:, None], tokens[:, :-1]], 1)
            lp_old_all = _log_softmax(table(tv)[prevs])
            lp_old = np.take_along_axis(lp_old_all, tokens[..., None], -1)[..., 0]
            entropy = -(np.exp(lp_old_all) * lp_old_all).sum(-1)
            lp_cur = (np.take_along_axis(_log_softmax(table(tv + 1)[prevs]), tokens[..., None], -1)[..., 0]
                      if current else None)
            frac_low = ((tokens < V // 2) * mask).sum(1) / mask.sum(1)
            reward = (rng.random(B) < 1 / (1 + np.exp(-(4 * frac_low - 2)))).astype(np.float32)
            r = reward.reshape(-1, G)
            adv = ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(B)
            log.add(step + 1, np.arange(B), tokens, mask, sampler_logp=lp_s * mask,
                    old_logp=(lp_old * mask).astype(np.float32),
                    current_logp=None if lp_cur is None else (lp_cur * mask).astype(np.float32), version=gen,
                    advantages=adv, rewards=reward, group_ids=np.arange(B // G).repeat(G) + step * (B // G),
                    entropy=entropy * mask, trainer_version=tv)
            for v in [k for k in tables if k < tv - lag_max]:
                del tables[v]
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
            old = np.minimum(s + rng.standard_normal(n).astype(np.float32) * (0.002 + 0.05 * (1 - p)).astype(np.float32), 0)
            cur = np.minimum(old + 0.01 * rng.standard_normal(n).astype(np.float32), 0)
            lag = np.minimum(rng.integers(0, lag_max + 1, size=batch), step - 1)
            adv = rng.standard_normal(batch)
            w.write_tokens({"run": "", "step": step, "sample_id": sid, "position": pos,
                            "token_id": rng.integers(0, 32000, size=n), "loss_mask": rng.random(n) < 0.97,
                            "sampler_logp": s, "old_logp": old, "current_logp": cur,
                            "version": np.repeat(step - 1 - lag, lens), "advantage": np.repeat(adv, lens),
                            "entropy": rng.gamma(2.0, 0.5, size=n)})
            w.write_sequences({"run": "", "step": step, "sample_id": np.arange(batch), "group_id": np.arange(batch) // 8,
                               "reward": (adv > 0).astype(float), "advantage": adv, "response_length": lens,
                               "version_min": step - 1 - lag, "version_max": step - 1 - lag,
                               "trainer_version": np.full(batch, step - 1)})
            written += n
    return path
