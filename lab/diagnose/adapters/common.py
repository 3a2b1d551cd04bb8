"""Shared pieces of the framework adapters: a buffer of sequences flushed into a NeutralLogWriter in chunks."""
from __future__ import annotations

import numpy as np

from lab.diagnose.neutral import NeutralLogWriter
from lab.errors import LabError

FLUSH_TOKENS = 1 << 18


def float_array(values, where: str, name: str) -> np.ndarray:
    """A float64 array from a list that may hold None (-> NaN); one LabError for anything else."""
    try:
        return np.array([np.nan if v is None else v for v in values], dtype=np.float64) if isinstance(values, list) \
            else np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise LabError(f"{where}: {name!r} must be a list of numbers") from None


def int_version(v):
    """A policy version as an int: SGLang names the weights it was launched with "default" (version 0)."""
    if v is None:
        return np.nan
    if isinstance(v, str):
        if v.strip() == "default":
            return 0
        try:
            return int(v)
        except ValueError:
            return np.nan
    try:
        return int(v)
    except (TypeError, ValueError):
        return np.nan


class SequenceBuffer:
    """Collect per-sequence token arrays and sequence fields; write them in chunks of about FLUSH_TOKENS rows."""

    TOKEN_FIELDS = ("token_id", "loss_mask", "sampler_logp", "old_logp", "current_logp", "version", "advantage",
                    "entropy")
    SEQ_FIELDS = ("group_id", "reward", "advantage", "version_min", "version_max", "trainer_version", "origin")

    def __init__(self, writer: NeutralLogWriter):
        self.writer = writer
        self._tok, self._seq, self._n = [], [], 0
        self.n_sequences = 0

    def add(self, run: str, step: int, sample_id: int, tokens: dict, seq: dict) -> None:
        n = len(tokens["loss_mask"])
        self._tok.append((run, step, sample_id, n, tokens))
        self._seq.append((run, step, sample_id, n, seq))
        self._n += n
        self.n_sequences += 1
        if self._n >= FLUSH_TOKENS:
            self.flush()

    def flush(self) -> None:
        if not self._tok:
            return
        lens = np.array([t[3] for t in self._tok], dtype=np.int64)
        runs = [t[0] for t in self._tok]
        cols = {"run": runs[0] if len(set(runs)) == 1 else np.repeat(np.array(runs, dtype=object), lens),
                "step": np.repeat([t[1] for t in self._tok], lens),
                "sample_id": np.repeat([t[2] for t in self._tok], lens),
                "position": np.concatenate([np.arange(n) for n in lens]) if len(lens) else np.zeros(0, np.int64)}
        for f in self.TOKEN_FIELDS:
            parts = [t[4].get(f) for t in self._tok]
            if all(p is None for p in parts):
                cols[f] = None
            else:
                cols[f] = np.concatenate([np.full(n, np.nan) if p is None else np.asarray(p) for p, n in zip(parts, lens)])
        self.writer.write_tokens(cols)
        seq = {"run": [s[0] for s in self._seq], "step": np.array([s[1] for s in self._seq]),
               "sample_id": np.array([s[2] for s in self._seq]), "response_length": lens}
        for f in self.SEQ_FIELDS:
            vals = [s[4].get(f) for s in self._seq]
            if f == "origin":
                seq[f] = [None if v is None else str(v) for v in vals]
            else:
                seq[f] = None if all(v is None for v in vals) else np.array(
                    [np.nan if v is None else float(v) for v in vals], dtype=np.float64)
        self.writer.write_sequences(seq)
        self._tok, self._seq, self._n = [], [], 0
