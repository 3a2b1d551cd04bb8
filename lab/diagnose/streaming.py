"""One streaming pass over a neutral rollout log: every diagnostic of the ``rollout_diagnostics`` report.

Log-ratio pairs (computed where the log has both columns), per loss-masked token t:

    mismatch  delta_t = log pi_old(y_t) - log mu(y_t)      trainer against sampler (kernels, precision, staleness)
    update    delta_t = log pi(y_t)     - log pi_old(y_t)  between policy versions inside the trainer
    total     delta_t = log pi(y_t)     - log mu(y_t)      what a full importance weight corrects

Sequence log-weight L = sum_t m_t delta_t (a plain sum, no length division), W = exp(L). The token difference is
taken in the log's log-prob dtype and then widened to float64, as the lab's trainer does.

Memory and speed: the pass reads only the token columns it needs, in chunks of ``chunk_rows`` rows (64k by
default) decoded page by page from a buffered stream whatever the writer's row-group size; it keeps one 641-bin
histogram per step and pair and about 1.4 KB per sequence (the sequences table and per-sequence sums). Per chunk,
the work on tokens is numpy on whole arrays: per-sequence sums are np.add.reduceat over runs (consecutive rows of
one sequence), per-step moments and lag buckets add those run sums, so the tokens are summed once; the corrections'
effects are computed on the tokens whose coefficient differs from their weight. Measured in
benchmarks/bench_diagnose.py: the whole command against a bare pyarrow read of the same columns, and its peak
memory, the same for logs of 10M and 20M tokens and for one 20M-row group. The pass imports no torch (the
corrections' coefficients are numpy, lab.diagnose.coefficients).

Bad input stops with one LabError naming the file and row: an unknown (run, step, sample_id), a sequence whose
token rows do not match its ``response_length``, or missing/NaN log-probs on loss-masked tokens. With
``nan="drop"`` NaN tokens are instead counted and excluded (token statistics leave out the token, sequence
statistics leave out its whole sequence), and the counts are reported in the summary and the verdict.
"""
from __future__ import annotations

import functools
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from lab.diagnose import dashboards, histogram as H, truncation
from lab.diagnose.corrections import CORRECTIONS, LOG_W_BOUND, resolve, token_effect
from lab.diagnose.neutral import RolloutLog
from lab.errors import LabError
from lab.progress import bar as progress_bar

PAIRS = {"mismatch": ("old_logp", "sampler_logp"), "update": ("current_logp", "old_logp"),
         "total": ("current_logp", "sampler_logp")}
PAIR_TEXT = {"mismatch": "trainer old / sampler", "update": "current / trainer old", "total": "current / sampler"}
P_EDGES = np.array([0.0, 1e-4, 1e-3, 1e-2, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0 + 1e-12])
LOW_P = 0.1
MAX_LAG = 64  # lag buckets 0..63, 64 = "64 or more", 65 = negative, 66 = unknown
KHAT_WARN = 0.7
QS = (0.01, 0.05, 0.5, 0.95, 0.99)
LOGP_MAX = 0.1  # a log-prob above this (probability above 1.105) is no rounding of a log-softmax: bad input
CHUNK_ROWS = 1 << 16  # token rows per chunk: its arrays stay in the CPU's cache
CHUNK_ROWS_MAX = 1 << 24  # the most token rows a chunk may hold (a few GiB of float64 arrays)


def pairs_of(logp_columns) -> list[str]:
    """The log-ratio pairs a log with these log-prob columns can form, in PAIRS order."""
    return [p for p in ("mismatch", "update", "total") if all(c in logp_columns for c in PAIRS[p])]


@dataclass
class Diagnostics:
    """Tables (pandas) and the summary of one log; ``verdict`` lines lead the report."""
    meta: dict
    summary: dict
    tables: dict = field(default_factory=dict)

    @property
    def verdict(self) -> list[str]:
        return self.summary["verdict"]


class _SeqIndex:
    """Vectorised (run, step, sample_id) -> row of the sequences table."""

    def __init__(self, seq: dict):
        self.rc, _, names = _in_order_of_appearance(seq["run"].astype(str))
        self.runs = {str(name): i for i, name in enumerate(names)}
        step, sid = np.asarray(seq["step"], np.int64), np.asarray(seq["sample_id"], np.int64)
        self.steps = np.unique(step)
        self.sids = np.unique(sid)
        key = self._key(self.rc, step, sid)
        self.order = np.argsort(key, kind="stable")
        self.sorted = key[self.order]

    def _key(self, rc, step, sid):
        si = np.searchsorted(self.steps, step)
        di = np.searchsorted(self.sids, sid)
        return (rc * (len(self.steps) + 1) + si) * (len(self.sids) + 1) + di

    def lookup(self, rc, step, sid) -> np.ndarray:
        """Sequence row per entry, -1 where unknown."""
        si = np.clip(np.searchsorted(self.steps, step), 0, max(len(self.steps) - 1, 0))
        di = np.clip(np.searchsorted(self.sids, sid), 0, max(len(self.sids) - 1, 0))
        ok = (rc >= 0) & (len(self.steps) > 0) & (self.steps[si] == step) & (self.sids[di] == sid)
        key = (rc * (len(self.steps) + 1) + si) * (len(self.sids) + 1) + di
        pos = np.clip(np.searchsorted(self.sorted, key), 0, max(len(self.sorted) - 1, 0))
        ok &= self.sorted[pos] == key if len(self.sorted) else np.zeros_like(ok)
        return np.where(ok, self.order[pos] if len(self.order) else -1, -1)


class _Chunk:
    """One chunk's runs (spans of consecutive rows of one sequence) and the helpers that sum per run and add per
    sequence and per step."""

    def __init__(self, starts: np.ndarray, lens: np.ndarray, run_seq: np.ndarray, run_step: np.ndarray):
        self.starts, self.lens, self.run_seq, self.run_step = starts, lens, run_seq, run_step
        self.n = int(lens.sum())
        self.unique = len(np.unique(run_seq)) == len(run_seq)
        self.s_lo, self.s_hi = int(run_step.min()), int(run_step.max())
        self._seq_idx = None

    def red(self, x: np.ndarray) -> np.ndarray:
        """Per-run sums of a per-token array (float64)."""
        return np.add.reduceat(x, self.starts, dtype=np.float64)

    def add(self, target: np.ndarray, per_run: np.ndarray) -> None:
        """Add per-run values to a per-sequence accumulator."""
        if self.unique:
            target[self.run_seq] += per_run
        else:
            np.add.at(target, self.run_seq, per_run)

    def add_max(self, target: np.ndarray, per_run: np.ndarray) -> None:
        np.maximum.at(target, self.run_seq, per_run)

    def per_step(self, target: np.ndarray, per_run: np.ndarray, run_step=None) -> None:
        """Add per-run values to a per-step accumulator."""
        rs = self.run_step if run_step is None else run_step
        width = self.s_hi - self.s_lo + 1
        target[self.s_lo:self.s_hi + 1] += np.bincount(rs - self.s_lo, weights=per_run, minlength=width)

    @functools.cached_property
    def step_spans(self) -> list:
        """(step, first row, end row) of each span of consecutive rows of one step."""
        change = np.flatnonzero(self.run_step[1:] != self.run_step[:-1]) + 1
        firsts = np.concatenate(([0], change))
        bounds = np.append(self.starts[firsts], self.n)
        return [(int(self.run_step[f]), int(bounds[j]), int(bounds[j + 1])) for j, f in enumerate(firsts)]

    @property
    def run_index(self) -> np.ndarray:
        """Run of each token."""
        return np.repeat(np.arange(len(self.starts)), self.lens)

    @property
    def seq_idx(self) -> np.ndarray:
        """Sequence row of each token (computed on demand: the slow paths need it)."""
        if self._seq_idx is None:
            self._seq_idx = np.repeat(self.run_seq, self.lens)
        return self._seq_idx


class _Pass:
    """State of the streaming pass: per-sequence and per-step sums, histograms and bins, added chunk by chunk."""

    def __init__(self, log: RolloutLog, nan: str, pair: str, hyper: dict | None, names, chunk_rows: int):
        self.log, self.nan, self.chunk_rows = log, nan, int(chunk_rows)
        self.seq = log.sequence_arrays()
        self.index = _SeqIndex(self.seq)
        self.n_seq = n = len(self.seq["step"])
        cols = log.logp_columns
        self.pairs = pairs_of(cols)
        if not self.pairs:
            raise LabError(f"{log.shown}: no pair of log-prob columns to compare (has {', '.join(cols)})")
        self.corrections = resolve(self.pairs, names, pair, hyper)
        # steps: (run, step) groups numbered in order of first appearance in the sequences table
        step = np.asarray(self.seq["step"], np.int64)
        run_step = self.index.rc * (len(self.index.steps) + 1) + np.searchsorted(self.index.steps, step)
        self.seq_step, first, _ = _in_order_of_appearance(run_step)
        self.step_groups = {"run": self.seq["run"][first], "step": step[first]}
        S = len(first)
        self.S = S
        f64 = lambda *shape: np.zeros(shape, np.float64)  # noqa: E731
        self.n_rows, self.n_masked, self.n_valid = f64(n), f64(n), f64(n)
        self.n_bad_seq = f64(n)
        self.pos_sum = f64(n)
        self.resp_len = np.asarray(self.seq["response_length"], np.int64)
        self.a_abs, self.a_sum = f64(n), f64(n)
        self.L = {p: f64(n) for p in self.pairs}
        self.S_abs = {p: f64(n) for p in self.pairs}
        self.S_low = {p: f64(n) for p in self.pairs}
        self.hist = {p: np.zeros((S, H.NBINS), np.int64) for p in self.pairs}
        self.mom = {p: {k: f64(S) for k in ("n", "sum", "sum2", "abs", "k3", "max")} for p in self.pairs}
        NP = len(P_EDGES) - 1
        self.pbin = {p: {k: f64(NP) for k in ("n", "sum", "abs", "sum2", "ratio")} for p in self.pairs}
        self.trunc = truncation.Accumulator(n, self.pairs, cols, log.has_kept_sets, log.tokens_file)
        self.lag = {p: {k: f64(MAX_LAG + 3) for k in ("n", "abs", "sum")} for p in self.pairs}
        self.tok_corr = {c.name: {"tot": f64(5), "seq_changed": f64(n), "seq_w": f64(n), "seq_removed": f64(n),
                                  "seq_added": f64(n)} for c in self.corrections if c.level == "token"}
        self.bad = {c: 0 for c in cols}
        self.first_bad = None  # (row, column, sequence row, position, what)
        self.seq_adv = np.asarray(self.seq["advantage"], np.float64)
        self.seq_tv = np.asarray(self.seq["trainer_version"], np.float64)
        vmin, vmax = np.asarray(self.seq["version_min"], np.float64), np.asarray(self.seq["version_max"], np.float64)
        self.seq_ver = np.where(vmin == vmax, vmin, np.nan)  # a token's version when its row has none
        self.adv_source = set()
        self.dash = dashboards.Accumulator(n, S) if "mismatch" in self.pairs else None
        self.dtype = np.float32 if log.meta["logp_dtype"] == "float32" else np.float64
        self.ref = "sampler_logp" if "sampler_logp" in cols else "old_logp"
        self.pool = None  # a thread pool for the pairs' sums (see _diagnose)
        p_edges = P_EDGES[1:-1]  # p_bin = number of inner edges <= p (searchsorted's bins, as comparisons)
        self._inner_edges = p_edges
        self._low_bin = int(np.searchsorted(p_edges, LOW_P, side="right"))  # p < LOW_P <=> p_bin < this

    # ------------------------------------------------------------------------------------------------ per chunk
    def chunk(self, offset: int, c: dict) -> None:
        """Add one chunk of token rows (``offset``: the first row's number) to every accumulator. Per-sequence sums
        are np.add.reduceat over the chunk's runs; per-step sums add the runs' sums by step."""
        k = self._locate_runs(offset, c)
        if k is None:
            return
        for col in self.log.logp_columns:  # log-probs in the log's declared dtype (beyond float32's range: inf)
            if c[col].dtype != self.dtype:
                with np.errstate(over="ignore"):
                    c[col] = c[col].astype(self.dtype)
        k.add(self.n_rows, k.lens.astype(np.float64))
        pos = c["position"]
        self._check_positions(offset, pos, k, c)
        k.add(self.pos_sum, k.red(pos))
        mask = c["loss_mask"].astype(bool, copy=False)
        n_masked = k.red(mask)
        k.add(self.n_masked, n_masked)
        bad_any = self._count_bad(offset, c, mask, pos, k)
        if self.nan == "error" and self.first_bad is not None:
            return  # the pass will fail: only keep counting
        valid = mask if bad_any is None else mask & ~bad_any
        k.n_val = n_masked if bad_any is None else k.red(valid)
        k.add(self.n_valid, k.n_val)
        k.valid = valid
        k.n_inv = k.lens - k.n_val  # rows that are not valid tokens, per run
        k.invalid = None if not k.n_inv.any() else ~valid
        adv, a_w = self._advantages(c, k)
        pb, low = self._probability_bins(c, k)
        lag_run, lag_tok = self._lag_buckets(c, k)
        w_pairs, deltas, ratios = {}, {}, {}
        ds = {p: self._delta(c, p, k) for p in self.pairs}
        k.step_spans  # computed once here, read by every pair's thread
        if self.pool is not None:  # each pair's sums are its own: the pairs run side by side (numpy frees the GIL)
            futures = {p: self.pool.submit(self._add_pair, p, ds[p], k, pb, low, lag_run, lag_tok) for p in ds}
            max_abs_of = {p: f.result() for p, f in futures.items()}
        else:
            max_abs_of = {p: self._add_pair(p, ds[p], k, pb, low, lag_run, lag_tok) for p in ds}
        for p in self.pairs:
            d, max_abs = ds[p], max_abs_of[p]
            if p == "mismatch" or p in self.trunc.pairs or any(corr.pair == p and corr.level == "token"
                                                                for corr in self.corrections):
                with np.errstate(over="ignore"):
                    w_pairs[p] = np.exp(np.clip(d, -LOG_W_BOUND, LOG_W_BOUND))
            if p in self.trunc.pairs:  # e^delta clipped at +-50: the same numbers as w where |delta| <= 20
                deltas[p] = d
                ratios[p] = truncation.ratio(d, valid, w_pairs[p] if max_abs <= LOG_W_BOUND else None)
                self.pbin[p]["ratio"] += np.bincount(pb, weights=ratios[p], minlength=len(P_EDGES) - 1)
            if p == "mismatch":
                self.dash.add(d, w_pairs[p], c["old_logp"], c["sampler_logp"], k)
        self._add_token_corrections(w_pairs, adv, a_w, k)
        self.trunc.add(offset, c, k, deltas, valid, pos, ratios)

    def _locate_runs(self, offset: int, c: dict) -> _Chunk | None:
        """The chunk's runs (None for an empty chunk); LabError for a (run, step, sample_id) not in the sequences
        table."""
        step, sid = c["step"], c["sample_id"]
        n = len(step)
        if n == 0:
            return None
        run_map = np.array([self.index.runs.get(v, -1) for v in c["run_values"]], dtype=np.int64)
        edge = (step[1:] != step[:-1]) | (sid[1:] != sid[:-1])
        if len(run_map) > 1:
            edge |= c["run"][1:] != c["run"][:-1]
        starts = np.concatenate(([0], np.flatnonzero(edge) + 1))
        lens = np.diff(np.append(starts, n))
        rc = run_map[c["run"][starts]] if len(run_map) else np.full(len(starts), -1)
        s0, i0 = step[starts].astype(np.int64), sid[starts].astype(np.int64)
        run_seq = self.index.lookup(rc, s0, i0)
        if (run_seq < 0).any():
            j = int(np.flatnonzero(run_seq < 0)[0])
            r = starts[j]
            run_name = c["run_values"][c["run"][r]] if len(c["run_values"]) else ""
            raise LabError(f"{self.log.tokens_file}: row {offset + r}: (run {run_name!r}, step {s0[j]}, sample_id "
                           f"{i0[j]}) has no row in {self.log.sequences_file.name}")
        return _Chunk(starts, lens, run_seq, self.seq_step[run_seq])

    def _check_positions(self, offset: int, pos, k: _Chunk, c: dict) -> None:
        """LabError for a position outside 0..response_length - 1 of its sequence."""
        limit = self.resp_len[k.run_seq]
        if (np.minimum.reduceat(pos, k.starts) >= 0).all() and (np.maximum.reduceat(pos, k.starts) < limit).all():
            return
        out = (pos < 0) | (pos >= self.resp_len[k.seq_idx])
        r = int(np.argmax(out))
        raise LabError(f"{self.log.tokens_file}: row {offset + r}: position {pos[r]} is outside 0..response_length - 1 "
                       f"= {self.resp_len[k.seq_idx[r]] - 1} of (step {c['step'][r]}, sample_id {c['sample_id'][r]})")

    def _count_bad(self, offset: int, c: dict, mask, pos, k: _Chunk) -> np.ndarray | None:
        """Loss-masked tokens with a missing, NaN or infinite log-prob in any column: counted per column and per
        sequence, the first one remembered; returns the mask of such tokens (None when there is none). A
        log-prob above LOGP_MAX (a probability above 1) stops the pass at once, whatever ``nan``."""
        bad_any = None
        for col in self.log.logp_columns:
            x = c[col]
            if np.isfinite(x.min()) and x.max() <= LOGP_MAX:  # every row finite and at most LOGP_MAX
                continue
            with np.errstate(invalid="ignore"):
                high = mask & (x > LOGP_MAX)
            if high.any():
                j = int(np.argmax(high))
                raise LabError(f"{self._where(offset + j, int(k.seq_idx[j]), int(pos[j]))}: {col} is "
                               f"{float(x[j]):.6g}, a log-probability above 0 (probability "
                               f"{'above 1' if x[j] < 700 else 'infinite'}); the log holds something else than "
                               f"log-probs (logits? probabilities?)")
            bad = mask & ~np.isfinite(x)
            n_bad = int(bad.sum())
            if n_bad:
                self.bad[col] += n_bad
                j = int(np.argmax(bad))
                if self.first_bad is None or offset + j < self.first_bad[0]:
                    what = "missing or NaN" if np.isnan(x[j]) else "+inf" if x[j] > 0 else \
                        "-inf (probability 0 for a sampled token)"
                    self.first_bad = (offset + j, col, int(k.seq_idx[j]), int(pos[j]), what)
                bad_any = bad if bad_any is None else bad_any | bad
        if bad_any is not None:
            k.add(self.n_bad_seq, k.red(bad_any))
        return bad_any

    def _where(self, row: int, si: int, pos: int) -> str:
        """Where a token is: its dump's origin and position, else the tokens file's row."""
        r = self._seq_row(si)
        if _has_origin(r):
            return f"{r['origin']}: token {pos} of step {r['step']}"
        return f"{self.log.tokens_file}: row {row}: step {r['step']}, sample_id {r['sample_id']}"

    def _advantages(self, c: dict, k: _Chunk):
        """(advantage, |advantage| on valid tokens, 0 elsewhere): the token's, else the sequence's, else 1
        (unweighted); adds sum |A| and sum A per sequence and records which sources were used."""
        adv = c.get("advantage")
        if adv is not None:  # writable: the corrections' coefficients see it as a tensor
            adv = adv.astype(np.float64, copy=not adv.flags.writeable)
        miss = None if adv is not None and np.isfinite(adv).all() else \
            (np.ones(k.n, bool) if adv is None else ~np.isfinite(adv))
        if miss is None or not miss.all():
            self.adv_source.add("token")
        if miss is not None:
            seq_adv = self.seq_adv[k.seq_idx]
            adv = seq_adv.copy() if adv is None else np.where(miss, seq_adv, adv)
            if np.isfinite(seq_adv[miss]).any():
                self.adv_source.add("sequence")
            miss = ~np.isfinite(adv)
            if (miss & k.valid).any():
                self.adv_source.add("none")
            adv[miss] = 1.0
        a_w = np.abs(adv)
        signed = adv
        if k.invalid is not None:
            a_w[k.invalid] = 0.0
            signed = np.where(k.valid, adv, 0.0)
        k.add(self.a_abs, k.red(a_w))
        k.add(self.a_sum, k.red(signed))
        return adv, a_w

    def _probability_bins(self, c: dict, k: _Chunk):
        """(p bin of each token's reference probability p = e^(log mu) (1 on rows that are not valid tokens),
        float mask of valid tokens with p < LOW_P); counts the valid tokens per bin."""
        ref = c[self.ref].astype(np.float64)
        if k.invalid is not None:
            ref[k.invalid] = 0.0
        p = np.exp(ref, out=ref)
        pb = np.zeros(k.n, np.int8)
        for e in self._inner_edges:
            pb += p >= e
        pb = pb.astype(np.intp)
        counts = np.bincount(pb, minlength=len(P_EDGES) - 1)
        counts[-1] -= int(k.n - k.n_val.sum())  # rows that are not valid tokens sit in the last bin (p = 1)
        for p_ in self.pairs:  # every pair counts the same tokens
            self.pbin[p_]["n"] += counts
        low = (pb < self._low_bin).astype(np.float64)
        return pb, low

    def _lag_buckets(self, c: dict, k: _Chunk):
        """Lag bucket of lag = trainer_version - version (the row's, else its sequence's single version):
        min(lag, MAX_LAG), MAX_LAG + 1 when negative, MAX_LAG + 2 when unknown. Returns (bucket per run, -1 for
        a run whose rows have different versions; (rows, bucket per row) of those runs, or None)."""
        seq_v = self.seq_ver[k.run_seq]
        v = c.get("version")
        if v is not None and v.dtype.kind == "f" and np.isnan(v).all():
            v = None
        if v is None:
            run_v, mixed = seq_v, np.zeros(len(seq_v), bool)
        else:
            v = v.astype(np.float64, copy=False)
            if np.isnan(v).any():
                v = np.where(np.isnan(v), self.seq_ver[k.seq_idx], v)
            run_v = np.minimum.reduceat(v, k.starts)
            mixed = run_v != np.maximum.reduceat(v, k.starts)  # also where a version is unknown (NaN)
            mixed &= ~(np.isnan(run_v) & np.isnan(seq_v))
        buckets = _lag_bucket(self.seq_tv[k.run_seq] - run_v)
        if not mixed.any():
            return buckets, None
        buckets[mixed] = -1
        rows = np.repeat(mixed, k.lens)
        return buckets, (rows, _lag_bucket(self.seq_tv[k.seq_idx[rows]] - v[rows]))

    def _delta(self, c: dict, p: str, k: _Chunk) -> np.ndarray:
        """delta_t = a_t - b_t of pair ``p`` in the log's dtype, widened to float64; 0 on rows that are not valid."""
        a_col, b_col = PAIRS[p]
        d = np.subtract(c[a_col], c[b_col], dtype=self.dtype).astype(np.float64)
        if k.invalid is not None:
            d[k.invalid] = 0.0
        return d

    def _add_pair(self, p: str, d: np.ndarray, k: _Chunk, pb, low, lag_run, lag_tok) -> float:
        """Add pair ``p``'s delta to the per-sequence sums (L, sum |delta|, sum |delta| on low-p tokens), the
        per-step moments and histogram, the probability bins and the lag buckets; returns the chunk's max |delta|."""
        ad = np.abs(d)
        L, S_abs = k.red(d), k.red(ad)
        k.add(self.L[p], L)
        k.add(self.S_abs[p], S_abs)
        k.add(self.S_low[p], k.red(ad * low))
        d2 = d * d
        with np.errstate(over="ignore", invalid="ignore"):
            k3 = np.expm1(d) - d
        m = self.mom[p]
        for key, per_run in (("n", k.n_val), ("sum", L), ("abs", S_abs), ("sum2", k.red(d2)), ("k3", k.red(k3))):
            k.per_step(m[key], per_run)
        run_max = np.maximum.reduceat(ad, k.starts)
        np.maximum.at(m["max"], k.run_step, run_max)
        self._add_histogram(self.hist[p], d, k)
        q = self.pbin[p]
        q["sum"] += np.bincount(pb, weights=d, minlength=len(q["sum"]))
        q["abs"] += np.bincount(pb, weights=ad, minlength=len(q["abs"]))
        q["sum2"] += np.bincount(pb, weights=d2, minlength=len(q["sum2"]))
        g, nb = self.lag[p], MAX_LAG + 3
        ok = lag_run >= 0
        for key, per_run in (("n", k.n_val), ("abs", S_abs), ("sum", L)):
            g[key] += np.bincount(lag_run[ok], weights=per_run[ok], minlength=nb)
        if lag_tok is not None:
            rows, b = lag_tok
            v = k.valid[rows]
            g["n"] += np.bincount(b, weights=v, minlength=nb)
            g["abs"] += np.bincount(b, weights=ad[rows], minlength=nb)
            g["sum"] += np.bincount(b, weights=d[rows], minlength=nb)
        return float(run_max.max())

    @staticmethod
    def _add_histogram(hist: np.ndarray, d: np.ndarray, k: _Chunk) -> None:
        """Histogram of the valid tokens' delta per step (rows that are not valid have delta 0: they are taken
        back out of the central bin)."""
        b = H.bin_index(d)
        for s, lo, hi in k.step_spans:
            hist[s] += np.bincount(b[lo:hi], minlength=H.NBINS)
        if k.invalid is not None:
            width = k.s_hi - k.s_lo + 1
            hist[k.s_lo:k.s_hi + 1, H.ZERO] -= np.bincount(k.run_step - k.s_lo, weights=k.n_inv,
                                                          minlength=width).astype(np.int64)

    def _add_token_corrections(self, w_pairs: dict, adv, a_w, k: _Chunk) -> None:
        """Per token-level correction: tokens it changes or zeroes, and per sequence the weight it is applied to, the
        weight it removes and the weight it adds (lab.diagnose.corrections.token_effect), computed on the valid
        tokens whose coefficient differs from their weight (all others add nothing), or on every token when those
        are many."""
        seq_w, n_val = {}, float(k.n_val.sum())
        for corr in self.corrections:
            if corr.level != "token":
                continue
            w = w_pairs[corr.pair]
            c = corr.coefficient(w, adv)
            moved = np.flatnonzero(c != w)
            if k.invalid is not None:
                moved = moved[k.valid[moved]]
            if len(moved) > k.n // 8:
                changed, zeroed, removed, added = token_effect(c, w, a_w)
                if k.invalid is not None:
                    changed &= k.valid
                    zeroed &= k.valid
                per_run = k.red
            else:
                changed, zeroed, removed, added = token_effect(c[moved], w[moved], a_w[moved])
                run = k.run_index[moved]
                per_run = lambda x: np.bincount(run, weights=x, minlength=len(k.starts))  # noqa: E731
            if corr.pair not in seq_w:
                seq_w[corr.pair] = k.red(a_w * w)
            acc = self.tok_corr[corr.name]
            acc["tot"] += [n_val, np.count_nonzero(changed), np.count_nonzero(zeroed), 0.0, 0.0]
            for key, values in (("seq_changed", per_run(changed)), ("seq_w", seq_w[corr.pair]),
                                ("seq_removed", per_run(removed)), ("seq_added", per_run(added))):
                k.add(acc[key], values)

    def _seq_row(self, i: int) -> dict:
        """Row ``i`` of the sequences table."""
        return {k: v[i] for k, v in self.seq.items()}

    # ------------------------------------------------------------------------------------------------ checks
    def finish_checks(self) -> None:
        want = self.resp_len.astype(np.float64)
        off = np.flatnonzero(self.n_rows != want)
        if off.size:
            i = int(off[0])
            r = self._seq_row(i)
            origin = f" (from {r['origin']})" if _has_origin(r) else ""
            raise LabError(f"{self.log.sequences_file}: row {i}: response_length is {int(want[i])} but "
                           f"{self.log.tokens_file.name} has {int(self.n_rows[i])} rows for (run {r['run']!r}, step "
                           f"{r['step']}, sample_id {r['sample_id']}){origin}; lengths and masks must match")
        n_len = self.resp_len.astype(np.float64)
        off = np.flatnonzero(self.pos_sum != n_len * (n_len - 1) / 2)
        if off.size:
            i = int(off[0])
            r = self._seq_row(i)
            raise LabError(f"{self.log.sequences_file}: row {i}: the token positions of (run {r['run']!r}, step "
                           f"{r['step']}, sample_id {r['sample_id']}) are not 0..{int(n_len[i]) - 1}, each once")
        total_bad = sum(self.bad.values())
        if total_bad and self.nan == "error":
            row, col, si, pos, what = self.first_bad
            counts = ", ".join(f"{k} {v}" for k, v in self.bad.items() if v)
            n_seq = int((self.n_bad_seq > 0).sum())
            raise LabError(f"{self._where(row, si, pos)}: {col} is {what} on a loss-masked token; {total_bad} "
                           f"such tokens in {n_seq} sequences ({counts}); fix the log or pass "
                           f"--nan drop to exclude them (counted in the report)")
        if not self.n_valid.sum():
            what = (f"{self.n_seq} sequences, none with a loss-masked token" if self.n_seq
                    else "no sequences")
            dropped = f" ({total_bad} dropped by --nan drop)" if total_bad else ""
            raise LabError(f"{self.log.shown}: nothing to diagnose: {what}{dropped}; the log needs loss-masked tokens "
                           f"with log-probs")


def _in_order_of_appearance(keys: np.ndarray):
    """(code of each row, first row of each code, each code's key): the distinct keys numbered 0, 1, ... in the order
    of their first row."""
    keys_sorted, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.argsort(first, kind="stable")
    code = np.empty(len(first), np.int64)
    code[rank] = np.arange(len(first))
    return code[inverse.reshape(-1)], first[rank], keys_sorted[rank]


def _lag_bucket(lag: np.ndarray) -> np.ndarray:
    """min(lag, MAX_LAG) for lag >= 0, MAX_LAG + 1 when negative, MAX_LAG + 2 when unknown (NaN)."""
    out = np.full(len(lag), MAX_LAG + 2, np.int64)
    known = np.isfinite(lag)
    out[known & (lag < 0)] = MAX_LAG + 1
    ok = known & (lag >= 0)
    out[ok] = np.minimum(lag[ok], MAX_LAG).astype(np.int64)
    return out


def _has_origin(row) -> bool:
    return isinstance(row.get("origin"), str) and bool(row.get("origin"))


def diagnose(log, *, nan: str = "error", pair: str = "natural", hyper: dict | None = None, corrections=CORRECTIONS,
             chunk_rows: int = CHUNK_ROWS, progress: bool | None = None, seed: int = 0) -> Diagnostics:
    """Stream ``log`` (a RolloutLog or a path) once and compute every diagnostic. See the module docstring."""
    check_options(nan, pair, chunk_rows)
    log = log if isinstance(log, RolloutLog) else RolloutLog(log)
    return _diagnose(log, nan, pair, hyper, corrections, chunk_rows, progress, seed)


def check_options(nan: str = "error", pair: str = "natural", chunk_rows: int = 1) -> None:
    """LabError for a ``nan``, ``pair`` or ``chunk_rows`` that ``diagnose`` does not take."""
    if nan not in ("error", "drop"):
        raise LabError(f"nan must be 'error' or 'drop', got {nan!r}")
    if pair not in ("natural", "total", "mismatch", "update"):
        raise LabError(f"pair must be natural, total, mismatch or update, got {pair!r}")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or not 1 <= chunk_rows <= CHUNK_ROWS_MAX:
        raise LabError(f"chunk_rows must be a whole number from 1 to {CHUNK_ROWS_MAX:,}, got {chunk_rows!r}")


def _diagnose(log, nan, pair, hyper, corrections, chunk_rows, progress, seed) -> Diagnostics:
    st = _Pass(log, nan, pair, hyper, corrections, chunk_rows)
    cols = ["run", "step", "sample_id", "position", "loss_mask", "advantage", "version", *log.logp_columns]
    if log.has_kept_sets:
        cols += ["token_id", "kept_token_ids"]
    bar = progress_bar(log.n_token_rows, "diagnose", enabled=progress, unit="tok", unit_scale=True)
    if len(st.pairs) > 1 and (os.cpu_count() or 1) > 1:
        st.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lab-diagnose-pair")
    try:
        for offset, chunk in log.iter_tokens(cols, chunk_rows):
            st.chunk(offset, chunk)
            bar.update(len(chunk["step"]))
    finally:
        bar.close()
        if st.pool is not None:
            st.pool.shutdown()
            st.pool = None
    st.finish_checks()
    from lab.diagnose.tables import build  # tables and verdict from the accumulated state
    with np.errstate(over="ignore"):  # a weight beyond float64 (|L| > 709) is reported as inf, not warned about
        return build(st, seed=seed)


__all__ = ["CHUNK_ROWS", "Diagnostics", "KHAT_WARN", "LOW_P", "PAIRS", "PAIR_TEXT", "P_EDGES", "check_options",
           "diagnose"]
