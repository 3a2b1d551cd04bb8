"""Sampler truncation (top-p, top-k) seen in a log, with and without the sampler's recorded kept sets.

An engine that samples from the truncated, renormalised q(y) = pi(y) 1[y in S] / pi(S) and reports log q differs from
the trainer's full log pi by log pi(S) <= 0 on every token, so the token ratio r_t = pi(y_t) / q(y_t) = pi(S_t) and

    E_q[r] = sum_{y in S} pi(y) = pi(S) < 1,

while any sampler that reports the probabilities it sampled from, with full support (bf16 or other precision
mismatch, a stale policy, another temperature), gives E_mu[pi / mu] = 1 exactly. The statistic is the mean token
ratio rbar = sum_t e^(delta_t) / n over loss-masked tokens (delta = log trainer - log sampler), with a 95 % bootstrap
interval over sequences (lab.diagnose.fits.ratio_intervals), and the share of tokens with ratio below 1
(delta < -1e-6, the log-ratio histogram's central bin). Truncation is detected when

    the whole interval of rbar lies below RATIO_MAX = 0.99   and   at least ONE_SIDED = 80 % of tokens have r < 1.

The first condition is the test (an untruncated sampler's rbar is 1 up to sampling error; the margin 0.01 leaves out
rounding of reported log-probs and truncation that removes less than 1 % of the mass); the second guards it against
heavy right tails (a very stale sampler's rbar, a mean of rare large ratios, falls below 1 in most finite samples,
but its log-ratio is two-sided). Calibrated and tested on lab.diagnose.synthetic.simulate
(tests/test_diagnose_truncation.py): top_p 0.8-0.95 and top_k 5-20 fire, bf16 mismatch and stale samplers do not.
Under truncation rbar estimates the mean kept mass pi(S_t) over sampled positions (each top-p kept set holds at least
top_p of the sampler's mass).

With kept sets (``kept_token_ids``: slime's ``rollout_top_p_token_ids`` / offsets), the same statistic on the tokens
that carry a set says whether the trainer's log-probs were renormalised over them (mask replay: rbar = 1) or not;
on a token whose kept set is the sampled token alone, a renormalised log-prob is exactly 0, so the mean trainer
log-prob there is reported too. Source of the fix: "keep sampling mask" (DeepSeek-V3.2), slime PR 2102.
"""
from __future__ import annotations

import numpy as np

from lab.errors import LabError

RATIO_MAX = 0.99  # the mean ratio's whole interval below this
ONE_SIDED = 0.8  # and at least this share of tokens with ratio < 1
BELOW = -1e-6  # delta below this: ratio < 1 (the histogram's central bin is |delta| < 1e-6)
LOG_BOUND = 50.0
SUBSETS = ("all", "kept_sets")


def ratio(d: np.ndarray, valid: np.ndarray, e: np.ndarray | None = None) -> np.ndarray:
    """e^delta on valid tokens (delta clipped to +-LOG_BOUND), 0 elsewhere; ``e``: e^delta already computed (the
    caller's, when every |delta| is within its own clip)."""
    if e is None:
        e = np.exp(np.clip(d, -LOG_BOUND, LOG_BOUND))
    return np.where(valid, e, 0.0)


def pairs_with_sampler(pairs) -> list[str]:
    """The log-ratio pairs whose denominator is the sampler's log-prob (trainer over sampler)."""
    return [p for p in ("mismatch", "total") if p in pairs]


class Accumulator:
    """Per-sequence sums of the token ratio and of tokens with ratio < 1, on all valid tokens and on those with a
    recorded kept set; kept-set sizes and singletons; checked kept sets."""

    def __init__(self, n_seq: int, pairs, logp_columns, has_kept_sets: bool, file):
        self.pairs = pairs_with_sampler(pairs)
        self.kept = has_kept_sets
        self.file = file
        z = lambda: np.zeros(n_seq)  # noqa: E731
        self.n = {"all": None, "kept_sets": z()}
        self.ratio = {(p, s): z() for p in self.pairs for s in SUBSETS}
        self.below = {(p, s): z() for p in self.pairs for s in SUBSETS}
        self.sizes = np.zeros(3)  # tokens with a set, sum of set sizes, singletons
        self.single = {c: 0.0 for c in logp_columns}  # sums of each log-prob column on singleton sets

    def add(self, offset: int, c: dict, k, deltas: dict, valid: np.ndarray, pos, ratios: dict | None = None) -> None:
        """Add one chunk: ``deltas`` per pair (0 on rows that are not valid tokens), ``valid`` the valid tokens;
        ``ratios``: ratio(delta, valid) per pair, when the caller has them."""
        has = self._kept_sets(offset, c, k, valid, pos) if self.kept else None
        for p in self.pairs:
            d = deltas[p]
            r = ratio(d, valid) if ratios is None else ratios[p]
            below = (d < BELOW) & valid
            k.add(self.ratio[(p, "all")], k.red(r))
            k.add(self.below[(p, "all")], k.red(below))
            if has is not None:
                k.add(self.ratio[(p, "kept_sets")], k.red(np.where(has, r, 0.0)))
                k.add(self.below[(p, "kept_sets")], k.red(below & has))

    def _kept_sets(self, offset: int, c: dict, k, valid: np.ndarray, pos) -> np.ndarray | None:
        """Valid tokens with a recorded kept set (None when the chunk has none); LabError for an empty set, a
        negative id or a sampled token outside its set."""
        parts = c.get("kept_token_ids")
        if parts is None:
            return None
        offsets, ids, recorded = parts
        sizes = np.diff(offsets)
        check = recorded & c["loss_mask"].astype(bool)
        bad = check & (sizes == 0)
        if bad.any():
            self._fail(offset, k, c, pos, int(np.argmax(bad)), "an empty kept set (write null where the sampler "
                       "recorded none)")
        if ids.size and ids.min() < 0:
            j = int(np.searchsorted(offsets, int(np.argmax(ids < 0)), side="right") - 1)
            self._fail(offset, k, c, pos, j, "a negative token id in its kept set")
        tok = c.get("token_id")
        if tok is not None and ids.size:
            row = np.repeat(np.arange(len(sizes)), sizes)
            hit = np.zeros(len(sizes), bool)
            hit[row[ids == tok[row]]] = True
            bad = check & ~hit
            if bad.any():
                j = int(np.argmax(bad))
                self._fail(offset, k, c, pos, j, f"token {tok[j]} outside its kept set "
                           f"({sizes[j]} ids, e.g. {ids[offsets[j]:offsets[j] + 5].tolist()}): the sampler cannot "
                           f"have sampled it")
        has = recorded & valid
        if not has.any():
            return None
        k.add(self.n["kept_sets"], k.red(has))
        one = has & (sizes == 1)
        self.sizes += [has.sum(), sizes[has].sum(), one.sum()]
        for col in self.single:
            if one.any():
                self.single[col] += float(np.asarray(c[col], np.float64)[one].sum())
        return has

    def _fail(self, offset: int, k, c: dict, pos, j: int, what: str) -> None:
        raise LabError(f"{self.file}: row {offset + j}: column 'kept_token_ids': step {c['step'][j]}, sample_id "
                       f"{c['sample_id'][j]}, position {pos[j]} has {what}")

    def requests(self, n_valid: np.ndarray) -> dict:
        """Bootstrap requests (per-sequence numerator, denominator) of the mean ratio and the share below 1."""
        out = {}
        for (p, s), ratio in self.ratio.items():
            n = n_valid if s == "all" else self.n["kept_sets"]
            out[f"trunc_ratio/{p}/{s}"] = (ratio, n)
            out[f"trunc_below/{p}/{s}"] = (self.below[(p, s)], n)
        return out


def rows(acc: Accumulator, n_valid: np.ndarray, ci: dict, sampling: dict) -> list[dict]:
    """One row per sampler pair and subset (all tokens; tokens with a kept set, when the log records them)."""
    out = []
    for p in acc.pairs:
        for s in SUBSETS:
            n = float((n_valid if s == "all" else acc.n["kept_sets"]).sum())
            if s == "kept_sets" and not n:
                continue
            m, b = ci[f"trunc_ratio/{p}/{s}"], ci[f"trunc_below/{p}/{s}"]
            row = {"pair": p, "name": s, "n_tok": n, "mean_ratio": m[0], "mean_ratio_lo": m[1],
                   "mean_ratio_hi": m[2], "below_one": b[0], "below_one_lo": b[1], "below_one_hi": b[2]}
            row["detected"] = detected(row)
            out.append(row)
    return out


def detected(row: dict) -> bool:
    """The rule of the module docstring: the mean ratio's interval below RATIO_MAX and a one-sided log-ratio."""
    hi, below = row["mean_ratio_hi"], row["below_one"]
    return bool(np.isfinite(hi) and hi < RATIO_MAX and np.isfinite(below) and below >= ONE_SIDED)


def summary(acc: Accumulator, table: list[dict], sampling: dict) -> dict | None:
    """The truncation summary: the main pair's rows (mismatch when the log has it), the kept sets' sizes and the
    mean log-probs on singleton sets; None when no pair has the sampler."""
    if not acc.pairs:
        return None
    pair = acc.pairs[0]
    by = {r["name"]: r for r in table if r["pair"] == pair}
    n_set, size_sum, n_one = acc.sizes
    kept = None
    if "kept_sets" in by:
        n_all = by["all"]["n_tok"]
        kept = {"share": n_set / n_all if n_all else float("nan"),
                "mean_size": size_sum / n_set if n_set else float("nan"),
                "singletons": int(n_one),
                **{f"singleton_mean_{c}": (acc.single[c] / n_one if n_one and c in acc.single else float("nan"))
                   for c in ("sampler_logp", "old_logp", "current_logp")},
                **{k: by["kept_sets"][k] for k in ("n_tok", "mean_ratio", "mean_ratio_lo", "mean_ratio_hi",
                                                    "below_one", "detected")}}
    a = by["all"]
    return {"pair": pair, "detected": a["detected"], **{k: a[k] for k in ("n_tok", "mean_ratio", "mean_ratio_lo",
                                                                          "mean_ratio_hi", "below_one", "below_one_lo",
                                                                          "below_one_hi")},
            "declared": bool((sampling.get("top_p") or 1) < 1 or (sampling.get("top_k") or 0) > 0),
            "top_p": sampling.get("top_p"), "top_k": sampling.get("top_k"), "kept_sets": kept}
