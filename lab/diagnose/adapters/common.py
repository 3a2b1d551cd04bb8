"""Shared pieces of the framework adapters: bounded JSON lines, checked arrays and fields, and a buffer of sequences
flushed into a NeutralLogWriter in chunks."""
from __future__ import annotations

import json
import math
import re

import numpy as np
import orjson
import pyarrow as pa

from lab.diagnose.neutral import NeutralLogWriter
from lab.errors import LabError

FLUSH_TOKENS = 1 << 18


def _entries(values, where: str, name: str, ok, expected: str) -> None:
    """One LabError naming the first entry of the list ``values`` for which ``ok`` is false."""
    bad = next((i for i, v in enumerate(values) if not ok(v)), None)
    if bad is not None:
        raise LabError(f"{where}: {name!r} entry {bad} is {values[bad]!r:.40}; expected {expected}")


def _number(v) -> bool:
    if v is None or isinstance(v, (float, np.floating)):
        return True
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and -2**63 <= v < 2**63


_FLOATS = {float, type(None)}


class OutOfRange(str):
    """A JSON number too large for a float64, kept as its text so the field check names it."""

    def __repr__(self):
        return f"{str(self)[:24]}{'...' if len(self) > 24 else ''} (out of range)"


MAX_JSON_DEPTH = 64


def _parse_int(s: str):
    """An integer as orjson reads it: an int within [-2^63, 2^64), else the nearest float64 (OutOfRange beyond)."""
    if len(s) > 310:  # beyond any float64 (and Python's 4300-digit limit)
        return OutOfRange(s)
    v = int(s)
    if -2**63 <= v < 2**64:
        return v
    try:
        return float(v)
    except OverflowError:
        return OutOfRange(s)


def _parse_float(s: str):
    v = float(s)
    return v if math.isfinite(v) else OutOfRange(s)


_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STEP = np.zeros(256, np.int8)
_STEP[[ord("["), ord("{")]], _STEP[[ord("]"), ord("}")]] = 1, -1


def _depth(raw: bytes) -> int:
    """Deepest nesting of [ and { outside JSON strings (a text field such as a decoded response may hold any number
    of brackets)."""
    steps = _STEP[np.frombuffer(_STRING.sub(b'""', raw), np.uint8)]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def json_line(raw: bytes, where: str):
    """One JSON value from one line of a JSONL file, bounded: UTF-8, at most MAX_JSON_DEPTH levels of nesting,
    numbers that fit a float64 or a 64-bit integer; NaN and Infinity literals are refused. One LabError naming
    ``where`` for anything else.

    orjson parses a line nested at most MAX_JSON_DEPTH deep (brackets inside strings do not count); it refuses what
    the bounds refuse and widens an integer beyond 64 bits to a float, which the field checks refuse where an integer
    is expected. A line orjson refuses, or one nested deeper, is read by the standard library parser with the
    bounds applied number by number (a number out of range comes back as OutOfRange text, which the field checks
    refuse by name), which says what is wrong."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_JSON_DEPTH or _depth(raw) <= MAX_JSON_DEPTH:
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass  # the careful parser below names the problem
    return _json_line_checked(raw, where)


def _json_line_checked(raw: bytes, where: str):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LabError(f"{where}: not valid UTF-8 (byte {e.start}); a JSONL export is UTF-8 text") from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and _depth(raw) > MAX_JSON_DEPTH:
        raise LabError(f"{where}: JSON nested deeper than {MAX_JSON_DEPTH} levels; not a training-data record")

    def constant(name):
        raise LabError(f"{where}: {name} is not JSON (the writer emits null for non-finite numbers)")
    try:
        return json.loads(text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise LabError(f"{where}: not valid JSON ({e.msg} at column {e.colno}; a truncated line?)") from None
    except RecursionError:
        raise LabError(f"{where}: JSON nested too deeply to read; not a training-data record") from None


def int_field(rec: dict, key: str, where: str, *, required: bool = False, minimum: int | None = 0):
    """An integer scalar field (None when absent and not required); LabError naming the field otherwise."""
    v = rec.get(key)
    if v is None:
        if required:
            raise LabError(f"{where}: field {key!r} is missing; expected an integer")
        return None
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not -2**62 < int(v) < 2**62 \
            or (minimum is not None and int(v) < minimum):
        want = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise LabError(f"{where}: field {key!r} is {v!r:.40}; expected {want} below 2^62")
    return int(v)


def float_array(values, where: str, name: str) -> np.ndarray:
    """A float64 array from a list of numbers that may hold None (-> NaN), or from a tensor or array; one LabError
    naming the entry for anything else (a string, a nested list)."""
    if isinstance(values, list):
        if set(map(type, values)) <= _FLOATS:  # floats and nulls: converted at once
            return np.array(values, dtype=np.float64)
        _entries(values, where, name, _number, "a number or null")
        return np.array([np.nan if v is None else v for v in values], dtype=np.float64)
    kind = str(getattr(values, "dtype", ""))
    if "complex" in kind or "bool" in kind:
        raise LabError(f"{where}: {name!r} is a {kind} array; expected real numbers")
    try:
        values = values.detach().cpu().float().numpy() if hasattr(values, "detach") else values
        return np.asarray(values, dtype=np.float64).reshape(-1)
    except (TypeError, ValueError):
        raise LabError(f"{where}: {name!r} must be a list of numbers") from None


def int_array(values, where: str, name: str) -> np.ndarray:
    """An int64 array from a list of integers, a tensor or an array; one LabError naming the entry otherwise."""
    if hasattr(values, "detach"):
        if values.is_floating_point():
            raise LabError(f"{where}: {name!r} is a {values.dtype} tensor; expected integers")
        values = values.detach().cpu().numpy()
    if isinstance(values, np.ndarray) and values.dtype.kind in "iub":
        return values.astype(np.int64).reshape(-1)
    if isinstance(values, np.ndarray):
        values = values.tolist()
    if not isinstance(values, (list, tuple)):
        raise LabError(f"{where}: {name!r} must be a list of integers, got {type(values).__name__}")
    if set(map(type, values)) <= {int}:
        try:
            return np.array(values, dtype=np.int64)
        except OverflowError:
            pass  # the entry check names it
    _entries(values, where, name, lambda v: isinstance(v, (int, np.integer)) and not isinstance(v, bool)
             and -2**63 <= v < 2**63, "an integer")
    return np.array(values, dtype=np.int64)


def mask_array(values, where: str, name: str) -> np.ndarray:
    """A bool array (nonzero = true) from a list of booleans / 0-1 integers, a tensor or an array."""
    if hasattr(values, "detach"):
        values = (values.detach() != 0).cpu().numpy()
    if isinstance(values, np.ndarray) and values.dtype.kind in "iubf":
        return values.reshape(-1) != 0
    if not isinstance(values, (list, tuple)):
        raise LabError(f"{where}: {name!r} must be a list of booleans, got {type(values).__name__}")
    kinds = set(map(type, values))
    if kinds <= {bool}:
        return np.array(values, dtype=bool).reshape(-1)
    _entries(values, where, name, lambda v: isinstance(v, (bool, int, np.bool_, np.integer)), "true/false (or 0/1)")
    return np.fromiter((bool(v) for v in values), dtype=bool, count=len(values))


def int_version(v):
    """A policy version as an int: SGLang names the weights it was launched with "default" (version 0); NaN
    (unknown) for anything that is not an integer below 2^62."""
    if v is None:
        return np.nan
    if isinstance(v, str):
        if v.strip() == "default":
            return 0
        try:
            v = int(v)
        except ValueError:
            return np.nan
        return v if -2**62 < v < 2**62 else np.nan
    try:
        v = int(v)
    except (TypeError, ValueError, OverflowError):
        return np.nan
    return v if -2**62 < v < 2**62 else np.nan


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
        for name, v in (("step", step), ("sample id", sample_id)):
            if not -2**62 < v < 2**62:
                raise LabError(f"{seq.get('origin') or f'step {step}'}: {name} {v!r:.40} is beyond 2^62; expected a "
                               f"small integer")
        for f in ("group_id", "version_min", "version_max", "trainer_version"):  # stored as float64: exact to 2^53
            v = seq.get(f)
            if v is not None and not (isinstance(v, float) and math.isnan(v)) and not -2**53 <= v <= 2**53:
                raise LabError(f"{seq.get('origin') or f'step {step}, sample {sample_id}'}: {f} {v!r:.40} is beyond "
                               f"2^53; expected a small integer")
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
                cols[f] = np.concatenate([np.full(n, np.nan) if p is None else np.asarray(p)
                                          for p, n in zip(parts, lens)])
        kept = [t[4].get("kept_token_ids") for t in self._tok]  # list arrays (neutral.kept_sets_from_offsets)
        if any(k is not None for k in kept):
            typ = pa.list_(pa.int64())
            cols["kept_token_ids"] = pa.concat_arrays([pa.nulls(n, typ) if k is None else k.cast(typ)
                                                       for k, n in zip(kept, lens)])
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
