"""One streaming pass over a neutral rollout log: every diagnostic of the ``rollout_diagnostics`` report.

Log-ratio pairs (computed where the log has both columns), per loss-masked token t:

    mismatch  delta_t = log pi_old(y_t) - log mu(y_t)      trainer against sampler (kernels, precision, staleness)
    update    delta_t = log pi(y_t)     - log pi_old(y_t)  between policy versions inside the trainer
    total     delta_t = log pi(y_t)     - log mu(y_t)      what a full importance weight corrects

Sequence log-weight L = sum_t m_t delta_t (a plain sum, no length division), W = exp(L). The token difference is
taken in the log's log-prob dtype and then widened to float64, as the lab's trainer does.

Memory: one chunk of token rows (``chunk_rows``, 256k by default) and one parquet row group (the writers use 1M
rows), one 641-bin histogram per step and pair, and about 1.1 KB per sequence at peak (the sequences table, 40
float64 accumulators and the bootstrap's per-sequence sums). It does not grow with the number of tokens but does
with the number of sequences: measured peak above the resident size at start, 316 MiB for a 10M-token log and
391 MiB for 30M of 256-token responses, 798 MiB for 4M tokens of 8-token responses (0.5M sequences;
benchmarks/bench_diagnose.py --mean-len). Torch work (the corrections' coefficients) runs on one thread: on
elementwise chunk work more threads add contention.

Bad input stops with one LabError naming the file and row: an unknown (run, step, sample_id), a sequence whose
token rows do not match its ``response_length``, or missing/NaN log-probs on loss-masked tokens. With
``nan="drop"`` NaN tokens are instead counted and excluded (token statistics leave out the token, sequence
statistics leave out its whole sequence), and the counts are reported in the summary and the verdict.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from lab.diagnose import dashboards, histogram as H
from lab.diagnose.corrections import CORRECTIONS, resolve, token_effect
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

    def __init__(self, seq: pd.DataFrame):
        self.runs = {r: i for i, r in enumerate(pd.unique(seq["run"]))}
        rc = seq["run"].map(self.runs).to_numpy(np.int64)
        self.steps = np.unique(seq["step"].to_numpy(np.int64))
        self.sids = np.unique(seq["sample_id"].to_numpy(np.int64))
        key = self._key(rc, seq["step"].to_numpy(np.int64), seq["sample_id"].to_numpy(np.int64))
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


def _add_at(target: np.ndarray, idx: np.ndarray, values: np.ndarray) -> None:
    np.add.at(target, idx, values)


class _Pass:
    """State of the streaming pass."""

    def __init__(self, log: RolloutLog, nan: str, pair: str, hyper: dict | None, names, chunk_rows: int):
        self.log, self.nan, self.chunk_rows = log, nan, int(chunk_rows)
        self.seq = log.sequences()
        self.index = _SeqIndex(self.seq)
        n = len(self.seq)
        cols = log.logp_columns
        self.pairs = pairs_of(cols)
        if not self.pairs:
            raise LabError(f"{log.path}: no pair of log-prob columns to compare (has {', '.join(cols)})")
        self.corrections = resolve(self.pairs, names, pair, hyper)
        # steps: (run, step) groups in order of first appearance in the sequences table
        groups = self.seq[["run", "step"]].drop_duplicates().reset_index(drop=True)
        self.step_groups = groups
        gkey = {(r, s): i for i, (r, s) in enumerate(zip(groups["run"], groups["step"]))}
        self.seq_step = np.fromiter((gkey[(r, s)] for r, s in zip(self.seq["run"], self.seq["step"])),
                                    dtype=np.int64, count=n)
        S = len(groups)
        self.S = S
        f64 = lambda *shape: np.zeros(shape, np.float64)  # noqa: E731
        self.n_rows, self.n_masked, self.n_valid = f64(n), f64(n), f64(n)
        self.n_bad_seq = f64(n)
        self.pos_sum = f64(n)
        self.resp_len = self.seq["response_length"].to_numpy(np.int64)
        self.a_abs, self.a_sum = f64(n), f64(n)
        self.L = {p: f64(n) for p in self.pairs}
        self.S_abs = {p: f64(n) for p in self.pairs}
        self.S_low = {p: f64(n) for p in self.pairs}
        self.hist = {p: np.zeros((S, H.NBINS), np.int64) for p in self.pairs}
        self.mom = {p: {k: f64(S) for k in ("n", "sum", "sum2", "abs", "k3", "max")} for p in self.pairs}
        NP = len(P_EDGES) - 1
        self.pbin = {p: {k: f64(NP) for k in ("n", "sum", "abs", "sum2")} for p in self.pairs}
        self.lag = {p: {k: f64(MAX_LAG + 3) for k in ("n", "abs", "sum")} for p in self.pairs}
        self.tok_corr = {c.name: {"tot": f64(5), "seq_changed": f64(n), "seq_w": f64(n), "seq_removed": f64(n),
                                  "seq_added": f64(n)} for c in self.corrections if c.level == "token"}
        self.bad = {c: 0 for c in cols}
        self.first_bad = None  # (row, column)
        self.seq_adv = self.seq["advantage"].to_numpy(np.float64)
        self.seq_tv = self.seq["trainer_version"].to_numpy(np.float64)
        vmin, vmax = self.seq["version_min"].to_numpy(np.float64), self.seq["version_max"].to_numpy(np.float64)
        self.seq_ver = np.where(vmin == vmax, vmin, np.nan)  # a token's version when its row has none
        self.adv_source = set()
        self.dash = dashboards.Accumulator(n, S) if "mismatch" in self.pairs else None
        self.dtype = np.float32 if log.meta["logp_dtype"] == "float32" else np.float64

    # ------------------------------------------------------------------------------------------------ per chunk
    def chunk(self, offset: int, c: dict) -> None:
        """Add one chunk of token rows (``offset``: the first row's number) to every accumulator. A run is a span of
        consecutive rows of one sequence; per-sequence sums are np.add.reduceat over the runs."""
        step, sid, starts, run_seq, seq_idx = self._locate_runs(offset, c)
        if starts is None:
            return
        pos = c["position"].astype(np.int64)
        self._check_positions(offset, pos, seq_idx, step, sid)
        _add_at(self.pos_sum, run_seq, np.add.reduceat(pos.astype(np.float64), starts))
        mask = c["loss_mask"].astype(bool)
        _add_at(self.n_masked, run_seq, np.add.reduceat(mask.astype(np.float64), starts))
        bad_any = self._count_bad(offset, c, mask, seq_idx, pos, run_seq, starts)
        if self.nan == "error" and self.first_bad is not None:
            return  # the pass will fail: only keep counting
        valid = mask & ~bad_any
        _add_at(self.n_valid, run_seq, np.add.reduceat(valid.astype(np.float64), starts))
        adv, a_w = self._advantages(c, seq_idx, valid, run_seq, starts)
        deltas = self._add_pairs(c, seq_idx, valid, run_seq, starts)
        self._add_token_corrections(deltas, adv, a_w, valid, run_seq, starts)

    def _locate_runs(self, offset: int, c: dict):
        """(step, sample_id, run starts, sequence row per run, sequence row per token); starts None for an empty
        chunk. Counts each sequence's rows; LabError for a (run, step, sample_id) not in the sequences table."""
        run_map = np.array([self.index.runs.get(v, -1) for v in c["run_values"]], dtype=np.int64)
        rc = run_map[c["run"]] if len(run_map) else c["run"]
        step, sid = c["step"].astype(np.int64), c["sample_id"].astype(np.int64)
        n = len(step)
        if n == 0:
            return step, sid, None, None, None
        brk = np.flatnonzero((rc[1:] != rc[:-1]) | (step[1:] != step[:-1]) | (sid[1:] != sid[:-1])) + 1
        starts = np.concatenate(([0], brk))
        lens = np.diff(np.concatenate((starts, [n])))
        run_seq = self.index.lookup(rc[starts], step[starts], sid[starts])
        if (run_seq < 0).any():
            j = int(np.flatnonzero(run_seq < 0)[0])
            r = starts[j]
            run_name = c["run_values"][c["run"][r]] if len(c["run_values"]) else ""
            raise LabError(f"{self.log.tokens_file}: row {offset + r}: (run {run_name!r}, step {step[r]}, sample_id "
                           f"{sid[r]}) has no row in {self.log.sequences_file.name}")
        _add_at(self.n_rows, run_seq, lens.astype(np.float64))
        return step, sid, starts, run_seq, np.repeat(run_seq, lens)

    def _check_positions(self, offset: int, pos, seq_idx, step, sid) -> None:
        """LabError for a position outside 0..response_length - 1 of its sequence."""
        out = (pos < 0) | (pos >= self.resp_len[seq_idx])
        if out.any():
            r = int(np.argmax(out))
            raise LabError(f"{self.log.tokens_file}: row {offset + r}: position {pos[r]} is outside 0..response_length - 1 "
                           f"= {self.resp_len[seq_idx[r]] - 1} of (step {step[r]}, sample_id {sid[r]})")

    def _count_bad(self, offset: int, c: dict, mask, seq_idx, pos, run_seq, starts) -> np.ndarray:
        """Loss-masked tokens with a missing, NaN or infinite log-prob in any column: counted per column and per
        sequence, the first one remembered; returns the mask of such tokens. A log-prob above LOGP_MAX (a
        probability above 1) stops the pass at once, whatever ``nan``."""
        n = len(mask)
        bad_any = np.zeros(n, bool)
        for col in self.log.logp_columns:
            x = c[col]
            with np.errstate(invalid="ignore"):
                high = mask & (x > LOGP_MAX)
            if high.any():
                j = int(np.argmax(high))
                raise LabError(f"{self._where(offset + j, int(seq_idx[j]), int(pos[j]))}: {col} is {float(x[j]):.6g}, "
                               f"a log-probability above 0 (probability {'above 1' if x[j] < 700 else 'infinite'}); "
                               f"the log holds something else than log-probs (logits? probabilities?)")
            bad = mask & ~np.isfinite(x)
            k = int(bad.sum())
            if k:
                self.bad[col] += k
                row = offset + int(np.argmax(bad))
                if self.first_bad is None or row < self.first_bad[0]:
                    j = int(np.argmax(bad))
                    what = "missing or NaN" if np.isnan(x[j]) else "+inf" if x[j] > 0 else \
                        "-inf (probability 0 for a sampled token)"
                    self.first_bad = (row, col, int(seq_idx[j]), int(pos[j]), what)
                bad_any |= bad
        if bad_any.any():
            _add_at(self.n_bad_seq, run_seq, np.add.reduceat(bad_any.astype(np.float64), starts))
        return bad_any

    def _where(self, row: int, si: int, pos: int) -> str:
        """Where a token is: its dump's origin and position, else the tokens file's row."""
        r = self.seq.iloc[si]
        if _has_origin(r):
            return f"{r['origin']}: token {pos} of step {r['step']}"
        return f"{self.log.tokens_file}: row {row}: step {r['step']}, sample_id {r['sample_id']}"

    def _advantages(self, c: dict, seq_idx, valid, run_seq, starts):
        """(advantage, |advantage| on valid tokens): the token's, else the sequence's, else 1 (unweighted); adds
        sum |A| and sum A per sequence and records which sources were used."""
        n = len(valid)
        adv = c.get("advantage")
        adv = np.full(n, np.nan) if adv is None else adv.astype(np.float64)
        miss = ~np.isfinite(adv)
        if (~miss).any():
            self.adv_source.add("token")
        if miss.any():
            adv = np.where(miss, self.seq_adv[seq_idx], adv)
            if np.isfinite(self.seq_adv[seq_idx][miss]).any():
                self.adv_source.add("sequence")
            miss = ~np.isfinite(adv)
            if (miss & valid).any():
                self.adv_source.add("none")
            adv = np.where(miss, 1.0, adv)
        a_w = np.where(valid, np.abs(adv), 0.0)
        _add_at(self.a_abs, run_seq, np.add.reduceat(a_w, starts))
        _add_at(self.a_sum, run_seq, np.add.reduceat(np.where(valid, adv, 0.0), starts))
        return adv, a_w

    def _lag_buckets(self, c: dict, seq_idx) -> np.ndarray:
        """Lag bucket per token of lag = trainer_version - version (the row's, else its sequence's single version):
        min(lag, MAX_LAG), MAX_LAG + 1 when negative, MAX_LAG + 2 when unknown."""
        n = len(seq_idx)
        version = c.get("version")
        version = np.full(n, np.nan) if version is None else version.astype(np.float64)
        version = np.where(np.isfinite(version), version, self.seq_ver[seq_idx])
        lag = self.seq_tv[seq_idx] - version
        known = np.isfinite(lag)
        lag_b = np.full(n, MAX_LAG + 2, np.int64)
        lag_b[known & (lag < 0)] = MAX_LAG + 1
        ok = known & (lag >= 0)
        lag_b[ok] = np.minimum(lag[ok], MAX_LAG).astype(np.int64)
        return lag_b

    def _add_pairs(self, c: dict, seq_idx, valid, run_seq, starts) -> dict:
        """delta_t = a_t - b_t per pair (in the log's dtype, widened to float64; 0 off valid tokens), added to the
        per-sequence, per-step, per-probability-bin and per-lag accumulators; returns {pair: delta}."""
        step_tok = self.seq_step[seq_idx]
        s_lo, s_hi = int(step_tok.min()), int(step_tok.max())
        ref = c["sampler_logp"] if "sampler_logp" in self.log.logp_columns else c["old_logp"]
        p_tok = np.exp(np.where(valid, ref.astype(np.float64), 0.0))
        pb = np.clip(np.searchsorted(P_EDGES, p_tok, side="right") - 1, 0, len(P_EDGES) - 2)
        low = valid & (p_tok < LOW_P)
        lag_b = self._lag_buckets(c, seq_idx)
        vstep = step_tok[valid] - s_lo
        deltas = {}
        for p in self.pairs:
            a_col, b_col = PAIRS[p]
            d = (c[a_col].astype(self.dtype, copy=False) - c[b_col].astype(self.dtype, copy=False)).astype(np.float64)
            d = np.where(valid, d, 0.0)
            deltas[p] = d
            ad = np.abs(d)
            _add_at(self.L[p], run_seq, np.add.reduceat(d, starts))
            _add_at(self.S_abs[p], run_seq, np.add.reduceat(ad, starts))
            _add_at(self.S_low[p], run_seq, np.add.reduceat(np.where(low, ad, 0.0), starts))
            dv = d[valid]
            self._add_step_moments(p, dv, vstep, s_lo, s_hi)
            np.maximum.at(self.mom[p]["max"], self.seq_step[run_seq], np.maximum.reduceat(ad, starts))
            self._add_bins(self.pbin[p], pb[valid], dv, ("n", "sum", "abs", "sum2"), len(P_EDGES) - 1)
            self._add_bins(self.lag[p], lag_b[valid], dv, ("n", "abs", "sum"), MAX_LAG + 3)
            if p == "mismatch":
                self.dash.add(d, c["old_logp"].astype(np.float64), c["sampler_logp"].astype(np.float64), valid,
                              vstep, s_lo, s_hi - s_lo + 1, run_seq, starts, _add_at)
        return deltas

    def _add_step_moments(self, p: str, dv, vstep, s_lo: int, s_hi: int) -> None:
        """Per step (steps s_lo..s_hi of this chunk): histogram of delta and n, sum delta, sum delta^2, sum |delta|,
        sum e^delta - 1 - delta."""
        width = s_hi - s_lo + 1
        b = H.bin_index(dv)
        self.hist[p][s_lo:s_hi + 1] += np.bincount(vstep * H.NBINS + b, minlength=width * H.NBINS
                                                   ).reshape(width, H.NBINS)
        m = self.mom[p]
        m["n"][s_lo:s_hi + 1] += np.bincount(vstep, minlength=width)
        m["sum"][s_lo:s_hi + 1] += np.bincount(vstep, weights=dv, minlength=width)
        m["sum2"][s_lo:s_hi + 1] += np.bincount(vstep, weights=dv * dv, minlength=width)
        m["abs"][s_lo:s_hi + 1] += np.bincount(vstep, weights=np.abs(dv), minlength=width)
        with np.errstate(over="ignore", invalid="ignore"):
            m["k3"][s_lo:s_hi + 1] += np.bincount(vstep, weights=np.expm1(dv) - dv, minlength=width)

    @staticmethod
    def _add_bins(acc: dict, bins, dv, keys, nbins: int) -> None:
        """Per bin, of the valid tokens' delta: n, sum delta, sum |delta| and sum delta^2 (those of ``keys``)."""
        for k in keys:
            w = None if k == "n" else dv if k == "sum" else np.abs(dv) if k == "abs" else dv * dv
            acc[k] += np.bincount(bins, weights=w, minlength=nbins)

    def _add_token_corrections(self, deltas: dict, adv, a_w, valid, run_seq, starts) -> None:
        """Per token-level correction: tokens it changes or zeroes, and per sequence the weight it is applied to, the
        weight it removes and the weight it adds (lab.diagnose.corrections.token_effect)."""
        for corr in self.corrections:
            if corr.level != "token":
                continue
            changed, zeroed, w, removed, added = token_effect(corr, deltas[corr.pair], adv, a_w)
            changed &= valid
            zeroed &= valid
            acc = self.tok_corr[corr.name]
            acc["tot"] += [valid.sum(), changed.sum(), zeroed.sum(), 0.0, 0.0]
            for key, arr in (("seq_changed", changed.astype(np.float64)), ("seq_w", np.where(valid, w, 0.0)),
                             ("seq_removed", np.where(valid, removed, 0.0)), ("seq_added", np.where(valid, added, 0.0))):
                _add_at(acc[key], run_seq, np.add.reduceat(arr, starts))

    # ------------------------------------------------------------------------------------------------ checks
    def finish_checks(self) -> None:
        want = self.seq["response_length"].to_numpy(np.float64)
        off = np.flatnonzero(self.n_rows != want)
        if off.size:
            i = int(off[0])
            r = self.seq.iloc[i]
            origin = f" (from {r['origin']})" if _has_origin(r) else ""
            raise LabError(f"{self.log.sequences_file}: row {i}: response_length is {int(want[i])} but "
                           f"{self.log.tokens_file.name} has {int(self.n_rows[i])} rows for (run {r['run']!r}, step "
                           f"{r['step']}, sample_id {r['sample_id']}){origin}; lengths and masks must match")
        n_len = self.resp_len.astype(np.float64)
        off = np.flatnonzero(self.pos_sum != n_len * (n_len - 1) / 2)
        if off.size:
            i = int(off[0])
            r = self.seq.iloc[i]
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
            what = (f"{len(self.seq)} sequences, none with a loss-masked token" if len(self.seq)
                    else "no sequences")
            dropped = f" ({total_bad} dropped by --nan drop)" if total_bad else ""
            raise LabError(f"{self.log.path}: nothing to diagnose: {what}{dropped}; the log needs loss-masked tokens "
                           f"with log-probs")


def _has_origin(row) -> bool:
    return isinstance(row.get("origin"), str) and bool(row.get("origin"))


def diagnose(log, *, nan: str = "error", pair: str = "natural", hyper: dict | None = None, corrections=CORRECTIONS,
             chunk_rows: int = 1 << 18, progress: bool | None = None, seed: int = 0) -> Diagnostics:
    """Stream ``log`` (a RolloutLog or a path) once and compute every diagnostic. See the module docstring."""
    check_options(nan, pair, chunk_rows)
    log = log if isinstance(log, RolloutLog) else RolloutLog(log)
    with _torch_threads(1):  # elementwise work on chunks: more threads add contention, not speed
        return _diagnose(log, nan, pair, hyper, corrections, chunk_rows, progress, seed)


def check_options(nan: str = "error", pair: str = "natural", chunk_rows: int = 1) -> None:
    """LabError for a ``nan``, ``pair`` or ``chunk_rows`` that ``diagnose`` does not take."""
    if nan not in ("error", "drop"):
        raise LabError(f"nan must be 'error' or 'drop', got {nan!r}")
    if pair not in ("natural", "total", "mismatch", "update"):
        raise LabError(f"pair must be natural, total, mismatch or update, got {pair!r}")
    if int(chunk_rows) < 1:
        raise LabError(f"chunk_rows must be a positive integer, got {chunk_rows!r}")


@contextmanager
def _torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _diagnose(log, nan, pair, hyper, corrections, chunk_rows, progress, seed) -> Diagnostics:
    st = _Pass(log, nan, pair, hyper, corrections, chunk_rows)
    cols = ["run", "step", "sample_id", "position", "loss_mask", "advantage", "version", *log.logp_columns]
    bar = progress_bar(log.n_token_rows, "diagnose", enabled=progress, unit="tok", unit_scale=True)
    try:
        for offset, chunk in log.iter_tokens(cols, chunk_rows):
            st.chunk(offset, chunk)
            bar.update(len(chunk["step"]))
    finally:
        bar.close()
    st.finish_checks()
    from lab.diagnose.tables import build  # tables and verdict from the accumulated state
    return build(st, seed=seed)


__all__ = ["Diagnostics", "KHAT_WARN", "LOW_P", "PAIRS", "PAIR_TEXT", "P_EDGES", "check_options", "diagnose"]
