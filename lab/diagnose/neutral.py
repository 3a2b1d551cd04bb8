"""Write and read neutral rollout logs (format: lab.diagnose.schema, docs/rollout-logs.md).

Writers stage everything in a hidden sibling folder and rename it into place on ``close()``: an error or an
interrupted run leaves nothing half-written (``abort()`` or leaving the ``with`` block by an exception removes
the staging folder). Tokens are buffered into parquet row groups of ``row_group_rows`` rows, so the reader can
stream a log of any size in bounded memory.

- ``NeutralLogWriter``: flat columns (dicts of 1-d arrays), used by the framework adapters.
- ``RolloutLogWriter``: the trainer-side API, [B, T] / [B] torch tensors per mini-batch (the lab's training
  simulator calls it; the README shows the same few lines for verl, TRL, AReaL and tinker).
- ``RolloutLog``: validated reading: the sequences table in memory, the tokens table in chunks.
"""
from __future__ import annotations

import json
import queue
import shutil
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lab.diagnose.schema import (ALL_TOKEN_COLUMNS, LOGP_COLUMNS, META, OPTIONAL_TOKEN_COLUMNS, SEQUENCE_COLUMNS,
                                 SEQUENCES, TOKEN_COLUMNS, TOKENS, arrow_schema, check_meta, check_schema, make_meta,
                                 read_meta)
from lab.errors import LabError

if TYPE_CHECKING:
    import pandas as pd

ROW_GROUP_ROWS = 1 << 20
READ_BUFFER = 1 << 20  # bytes read at a time from a column chunk


def _is_log_folder(path: Path) -> bool:
    return path.is_dir() and (path / META).exists()


def check_log_target(path: Path) -> None:
    """Refuse an output path that exists and is neither empty nor a rollout log (checked before any work)."""
    path = Path(path)
    if path.exists() and (not path.is_dir() or (any(path.iterdir()) and not _is_log_folder(path))):
        raise LabError(f"{path} exists and is not a rollout log folder; choose another path")


def _column(values, field: pa.Field, n: int) -> pa.Array:
    """One arrow column from a numpy array, a list, a scalar or None (all null); NaN marks null in int columns."""
    typ = field.type
    if values is None:
        if not field.nullable:
            raise LabError(f"column {field.name!r} is required")
        return pa.nulls(n, typ)
    if pa.types.is_list(typ):
        return kept_sets_array(values, n, field.name)
    if isinstance(values, str) and pa.types.is_string(typ):  # one value for every row
        return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([values])).cast(typ)
    if isinstance(values, (list, tuple)) and pa.types.is_string(typ):
        return pa.array(values, type=typ)
    arr = np.asarray(values)
    if arr.ndim == 0:
        arr = np.full(n, arr.item())
    if arr.shape != (n,):
        raise LabError(f"column {field.name!r} has shape {arr.shape}, expected ({n},)")
    if pa.types.is_string(typ):
        return pa.array(arr.astype(str), type=typ)
    if pa.types.is_integer(typ) and arr.dtype.kind == "f":
        missing = np.isnan(arr)
        return pa.array(np.where(missing, 0, arr).astype(np.int64), type=typ, mask=missing if missing.any() else None)
    if pa.types.is_floating(typ):
        return pa.array(arr.astype(typ.to_pandas_dtype(), copy=False), type=typ)
    return pa.array(arr.astype(typ.to_pandas_dtype(), copy=False), type=typ)


def kept_sets_array(values, n: int, name: str = "kept_token_ids") -> pa.Array:
    """An arrow list<int64> column of per-token kept sets from a pyarrow list array (``kept_sets_from_offsets``) or
    a list of ``n`` id arrays (None: not recorded)."""
    typ = pa.list_(pa.int64())
    if isinstance(values, (pa.Array, pa.ChunkedArray)):
        arr = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    else:
        values = list(values)
        sizes = np.array([-1 if v is None else np.size(v) for v in values], dtype=np.int64)
        flat = [np.asarray(v, dtype=np.int64).reshape(-1) for v in values if v is not None]
        arr = _list_array(np.concatenate(flat) if flat else np.zeros(0, np.int64),
                          np.concatenate(([0], np.cumsum(np.maximum(sizes, 0)))), sizes < 0)
    if len(arr) != n:
        raise LabError(f"column {name!r} has {len(arr)} rows, expected {n}")
    return arr.cast(typ)


def _list_array(ids: np.ndarray, offsets: np.ndarray, missing: np.ndarray) -> pa.Array:
    return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(ids.astype(np.int64)),
                                    mask=pa.array(missing) if missing.any() else None)


def kept_sets_from_offsets(ids, offsets) -> pa.Array:
    """Kept sets in slime's layout (``rollout_top_p_token_ids`` / ``rollout_top_p_token_offsets``: the set of
    response token i is ids[offsets[i]:offsets[i + 1]]) as a list column; an empty span is a position without a
    recorded set (slime pads appended tool tokens so), written as null."""
    ids, offsets = np.asarray(ids, np.int64).reshape(-1), np.asarray(offsets, np.int64).reshape(-1)
    return _list_array(ids, offsets, np.diff(offsets) == 0)


class NeutralLogWriter:
    """Stage a neutral log in a hidden sibling folder; ``close()`` renames it to ``path`` (replacing an older log).

    ``write_tokens(cols)`` / ``write_sequences(cols)`` take dicts of equal-length 1-d arrays keyed by column name;
    a missing nullable column is written as nulls.
    """

    def __init__(self, path, meta: dict, *, row_group_rows: int = ROW_GROUP_ROWS):
        self.path = Path(path)
        check_log_target(self.path)
        self.meta = check_meta(dict(meta), Path(META))
        self.row_group_rows = int(row_group_rows)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._tmp = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.", dir=self.path.parent))
        self._tok_schema = arrow_schema(ALL_TOKEN_COLUMNS, self.meta["logp_dtype"])
        self._seq_schema = arrow_schema(SEQUENCE_COLUMNS)
        # dictionary encoding for the run name only: on the log-probs it never pays and doubles the writing time
        self._tok_writer = pq.ParquetWriter(self._tmp / TOKENS, self._tok_schema, use_dictionary=["run"])
        self._seq_writer = pq.ParquetWriter(self._tmp / SEQUENCES, self._seq_schema)
        self._buf = {"tok": [], "seq": []}
        self._buffered = {"tok": 0, "seq": 0}
        self.n_tokens = self.n_sequences = 0
        self._closed = False

    def _table(self, cols: dict, schema: pa.Schema) -> pa.Table:
        unknown = set(cols) - set(schema.names)
        if unknown:
            raise LabError(f"unknown column(s) {', '.join(sorted(unknown))}; known: {', '.join(schema.names)}")
        lengths = {len(v) for k, v in cols.items() if v is not None and not isinstance(v, str) and
                   (k == "kept_token_ids" or np.ndim(v) > 0)}
        if len(lengths) != 1:
            raise LabError(f"columns have different lengths {sorted(lengths)}")
        n = lengths.pop()
        arrays = [_column(cols.get(f.name), f, n) for f in schema]
        for f, a in zip(schema, arrays):
            if not f.nullable and a.null_count:
                row = int(np.flatnonzero(a.is_null().to_numpy(zero_copy_only=False))[0])
                raise LabError(f"column {f.name!r} is required but is null at row {row} of this batch")
        return pa.Table.from_arrays(arrays, schema=schema)

    def _add(self, which: str, table: pa.Table) -> None:
        self._buf[which].append(table)
        self._buffered[which] += table.num_rows
        if self._buffered[which] >= self.row_group_rows:
            self._flush(which)

    def _flush(self, which: str) -> None:
        if not self._buf[which]:
            return
        writer = self._tok_writer if which == "tok" else self._seq_writer
        writer.write_table(pa.concat_tables(self._buf[which]), row_group_size=max(self.row_group_rows, 1))
        self._buf[which], self._buffered[which] = [], 0

    def write_tokens(self, cols: dict) -> None:
        table = self._table(cols, self._tok_schema)
        for name in LOGP_COLUMNS:  # a log-prob column the metadata declares absent stays null
            if self.meta["logp"][name] is None and table.column(name).null_count != table.num_rows:
                table = table.set_column(table.schema.get_field_index(name), self._tok_schema.field(name),
                                         pa.nulls(table.num_rows, self._tok_schema.field(name).type))
        self.n_tokens += table.num_rows
        self._add("tok", table)

    def write_sequences(self, cols: dict) -> None:
        table = self._table(cols, self._seq_schema)
        self.n_sequences += table.num_rows
        self._add("seq", table)

    def close(self) -> Path:
        if self._closed:
            return self.path
        try:
            self._flush("tok")
            self._flush("seq")
            self._tok_writer.close()
            self._seq_writer.close()
            (self._tmp / META).write_text(json.dumps(self.meta, indent=2) + "\n")
            self._tmp.chmod(0o755)
            check_log_target(self.path)
            from lab.runs import replace_dir  # imports pandas: not on the reading path

            replace_dir(self._tmp, self.path)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return self.path

    def abort(self) -> None:
        """Drop everything written so far; the destination is left as it was."""
        for w in (self._tok_writer, self._seq_writer):
            try:
                w.close()
            except Exception:  # noqa: BLE001 - already failing; the folder is removed below
                pass
        shutil.rmtree(self._tmp, ignore_errors=True)
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


# ------------------------------------------------------------------------------------------------ tensor API
LAB_LOGP = {
    "sampler_logp": "mu: the lab sampler's log-probs of the sampled tokens (a stale snapshot, or a perturbed "
                    "sampler in the mismatch regime)",
    "old_logp": "pi_old: the trainer's proximal log-probs recomputed at the rollout's version (equal to mu's "
                "outside the mismatch regime)",
    "current_logp": "pi: the policy being updated, at the mini-batch's optimiser step",
}


def _np(x, name: str, shape=None, dtype=None):
    if x is None:
        return None
    if hasattr(x, "detach"):
        x = x.detach().cpu()
        try:
            x = x.numpy()
        except TypeError:  # bfloat16 and other dtypes numpy lacks: widened to float32 (exact for bfloat16)
            x = x.float().numpy()
    x = np.asarray(x) if dtype is None else np.asarray(x, dtype=dtype)
    if shape is not None and x.shape not in shape:
        raise LabError(f"{name} has shape {x.shape}, expected one of {sorted(set(shape))}")
    return x


class RolloutLogWriter:
    """Write a training run's mini-batches as a neutral rollout log.

        with RolloutLogWriter("runs/x/rollout_log", meta) as log:       # meta: schema.make_meta(...) or None
            log.add(step, sample_ids, tokens, mask, sampler_logp=mu, old_logp=old, current_logp=None,
                    version=None, advantages=adv, rewards=None, group_ids=None, entropy=None, trainer_version=None,
                    kept_token_ids=None)

    ``step``, ``sample_ids``, ``tokens`` and ``mask`` are positional; everything else is a keyword and may be left
    out (None: the log does not have it).
    Shapes: ``tokens``, ``mask``, the log-probs, ``entropy`` [B, T]; ``sample_ids``, ``rewards``, ``group_ids`` [B];
    ``advantages`` and ``version`` [B] or [B, T]; ``trainer_version`` an int or [B]; ``kept_token_ids`` B rows of
    per-position kept sets (an id array, or None where not recorded), each row at least as long as the row's
    positions up to its last loss-masked token. A log-prob argument is None
    exactly when the metadata declares it absent. Each row keeps its positions up to its last loss-masked token
    (trailing padding is dropped; gaps inside the response stay, with loss_mask 0). ``meta=None`` describes a lab
    run (``LAB_LOGP``). Tensors may be on any device and of any dtype (bfloat16 log-probs are stored as float32,
    exactly). ``batch_width`` is recorded when every batch has the same T, so that per-batch
    diagnostics can be recomputed exactly as the trainer summed them (lab.diagnose.lab_metrics).
    """

    def __init__(self, path, meta: dict | None = None, *, run: str = "", row_group_rows: int = ROW_GROUP_ROWS):
        self.path = Path(path)
        check_log_target(self.path)
        self.meta = dict(meta) if meta is not None else make_meta("lab", LAB_LOGP)
        check_meta(self.meta, Path(META))
        self.run = str(run)
        self.row_group_rows = row_group_rows
        self._writer: NeutralLogWriter | None = None
        self._width: int | None | bool = False  # False: no batch yet; None: widths differ

    def _open(self, dtype: np.dtype) -> NeutralLogWriter:
        if self._writer is None:
            self.meta["logp_dtype"] = "float32" if dtype == np.float32 else "float64"
            self._writer = NeutralLogWriter(self.path, self.meta, row_group_rows=self.row_group_rows)
        return self._writer

    def add(self, step, sample_ids, tokens, mask, *, sampler_logp=None, old_logp=None, current_logp=None,
            version=None, advantages=None, rewards=None, group_ids=None, entropy=None,
            trainer_version=None, kept_token_ids=None) -> None:
        mask = _np(mask, "mask")
        if mask is None or mask.ndim != 2:
            raise LabError(f"mask must be a [B, T] tensor, got shape {None if mask is None else mask.shape}")
        B, T = mask.shape
        bt, b_ = {(B, T)}, {(B,)}
        tokens = _np(tokens, "tokens", bt)
        sample_ids = _np(sample_ids, "sample_ids", b_)
        logp = {"sampler_logp": _np(sampler_logp, "sampler_logp", bt), "old_logp": _np(old_logp, "old_logp", bt),
                "current_logp": _np(current_logp, "current_logp", bt)}
        for name, arr in logp.items():
            if (arr is None) != (self.meta["logp"][name] is None):
                raise LabError(f"{name} is {'missing' if arr is None else 'given'} but the log's metadata declares it "
                               f"{'present' if arr is None else 'absent'}")
        version = _np(version, "version", bt | b_)
        advantages = _np(advantages, "advantages", bt | b_)
        rewards = _np(rewards, "rewards", b_)
        group_ids = _np(group_ids, "group_ids", b_)
        entropy = _np(entropy, "entropy", bt)
        if trainer_version is not None and np.ndim(_np(trainer_version, "trainer_version")) == 0:
            trainer_version = np.full(B, int(np.asarray(_np(trainer_version, "trainer_version"))))
        trainer_version = _np(trainer_version, "trainer_version", b_)
        if sample_ids is None or len(np.unique(sample_ids)) != B:
            raise LabError("sample_ids must be B distinct ids")
        present = [a for a in logp.values() if a is not None]
        dtype = np.result_type(*[a.dtype for a in present])
        writer = self._open(dtype)
        want = np.float32 if self.meta["logp_dtype"] == "float32" else np.float64

        m = mask > 0
        pos = np.arange(T)
        length = np.where(m, pos[None, :], -1).max(axis=1) + 1  # through the last loss-masked token
        keep = pos[None, :] < length[:, None]
        rows = np.repeat(np.arange(B), length)
        n = int(length.sum())

        def tok(a):
            if a is None:
                return None
            return a[keep] if a.ndim == 2 else a[rows]

        cols = {"run": self.run, "step": np.full(n, int(step)),
                "sample_id": sample_ids[rows], "position": np.broadcast_to(pos, (B, T))[keep], "token_id": tok(tokens),
                "loss_mask": m[keep], "version": tok(version), "advantage": tok(advantages), "entropy": tok(entropy)}
        for name, arr in logp.items():
            cols[name] = None if arr is None else arr.astype(want, copy=False)[keep]
        if kept_token_ids is not None:
            if len(kept_token_ids) != B or any(len(row) < n_b for row, n_b in zip(kept_token_ids, length)):
                raise LabError(f"kept_token_ids must hold B = {B} rows, each with a kept set (or None) for every "
                               f"position up to the row's last loss-masked token")
            cols["kept_token_ids"] = [row[t] for row, n_b in zip(kept_token_ids, length) for t in range(n_b)]
        writer.write_tokens(cols)

        def first_masked(a):  # [B, T] -> value at each row's first loss-masked token (NaN if none)
            first = np.argmax(m, axis=1)
            out = a[np.arange(B), first].astype(np.float64)
            return np.where(m.any(axis=1), out, np.nan)

        if version is None:
            vmin = vmax = None
        elif version.ndim == 1:
            vmin = vmax = version.astype(np.float64)
        else:
            vv, any_m = version.astype(np.float64), m.any(axis=1)
            vmin = np.where(any_m, np.where(m, vv, np.inf).min(axis=1), np.nan)
            vmax = np.where(any_m, np.where(m, vv, -np.inf).max(axis=1), np.nan)
        seq_adv = None if advantages is None else (advantages.astype(np.float64) if advantages.ndim == 1
                                                   else first_masked(advantages))
        writer.write_sequences({"run": self.run, "step": np.full(B, int(step)),
                                "sample_id": sample_ids, "group_id": group_ids, "reward": rewards,
                                "advantage": seq_adv, "response_length": length, "version_min": vmin,
                                "version_max": vmax, "trainer_version": trainer_version, "origin": None})
        self._width = T if self._width is False or self._width == T else None

    def note(self, text: str) -> None:
        """Add a line to the log's notes (meta.json)."""
        (self._writer.meta if self._writer is not None else self.meta)["notes"].append(str(text))

    def close(self) -> Path:
        if self._writer is None:  # nothing added: an empty log is still a valid log
            self._open(np.dtype(np.float32))
        if self._width not in (False, None):
            self._writer.meta["batch_width"] = int(self._width)
        return self._writer.close()

    def abort(self) -> None:
        if self._writer is not None:
            self._writer.abort()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False


# ------------------------------------------------------------------------------------------------ reading
class RolloutLog:
    """A validated neutral rollout log: ``meta``, ``sequences()`` (pandas), ``iter_tokens()`` (numpy chunks)."""

    def __init__(self, path, shown_as=None):
        """``shown_as``: what errors about the whole log name (the framework dump a converted log came from)."""
        self.path = Path(path)
        self.shown = Path(shown_as) if shown_as is not None else self.path
        if not self.path.exists():
            raise LabError(f"{self.path}: no such file or folder")
        if not self.path.is_dir():
            raise LabError(f"{self.path}: a neutral rollout log is a folder with {TOKENS}, {SEQUENCES} and {META}")
        self.meta = read_meta(self.path)
        self.tokens_file, self.sequences_file = self.path / TOKENS, self.path / SEQUENCES
        for f in (self.tokens_file, self.sequences_file):
            if not f.exists():
                raise LabError(f"{f}: no such file; a neutral rollout log needs {TOKENS}, {SEQUENCES} and {META}")
        self._tok = self._open(self.tokens_file)
        check_schema(self._tok.schema_arrow, TOKEN_COLUMNS, self.tokens_file, OPTIONAL_TOKEN_COLUMNS)
        self.has_kept_sets = "kept_token_ids" in self._tok.schema_arrow.names
        check_schema(self._open(self.sequences_file).schema_arrow, SEQUENCE_COLUMNS, self.sequences_file)
        self.n_token_rows = self._tok.metadata.num_rows
        self.logp_columns = [c for c in LOGP_COLUMNS if self.meta["logp"][c] is not None]
        self._seq = self._seq_arrays = None

    @staticmethod
    def _open(file: Path, buffer_size: int = 0) -> pq.ParquetFile:
        try:
            try:
                return pq.ParquetFile(file, read_dictionary=["run"], buffer_size=buffer_size, pre_buffer=False)
            except KeyError:  # no `run` column: open it as it is, the schema check names what is missing
                return pq.ParquetFile(file, buffer_size=buffer_size, pre_buffer=False)
        except (pa.ArrowInvalid, OSError) as e:
            raise LabError(f"{file}: not a readable parquet file ({str(e).splitlines()[0]})") from None

    def sequences(self) -> pd.DataFrame:
        """The sequences table (pandas), validated as ``sequence_arrays``."""
        if self._seq is None:
            self.sequence_arrays()  # the checks
            df = self._open(self.sequences_file).read().to_pandas()
            df["run"] = df["run"].astype(str)
            self._seq = df
        return self._seq

    def sequence_arrays(self) -> dict:
        """The sequences table as {column: numpy array} (``run`` as str objects, a nullable integer or float column
        as float64 with NaN for null), validated: required values present, keys unique, lengths >= 0."""
        if self._seq_arrays is not None:
            return self._seq_arrays
        f = self.sequences_file
        table = self._open(f).read()
        out = {}
        for name in table.column_names:
            col = table.column(name)
            if SEQUENCE_COLUMNS.get(name, (None, False))[1] and col.null_count:
                row = int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
                raise LabError(f"{f}: row {row}: column {name!r} is null; it is required")
            if pa.types.is_dictionary(col.type) or pa.types.is_string(col.type) or pa.types.is_large_string(col.type):
                out[name] = _strings(col)
                continue
            if pa.types.is_integer(col.type) and col.null_count:
                col = col.cast(pa.float64())  # as pandas reads it: NaN for null
            out[name] = _array(col.combine_chunks())
        out["run"] = out["run"].astype(str).astype(object)
        if (out["response_length"] < 0).any():
            row = int(np.flatnonzero(out["response_length"] < 0)[0])
            raise LabError(f"{f}: row {row}: response_length is negative")
        dup = _duplicated(out["run"], out["step"], out["sample_id"])
        if dup.any():
            row = int(np.flatnonzero(dup)[0])
            raise LabError(f"{f}: row {row}: sequence (run {out['run'][row]!r}, step {out['step'][row]}, sample_id "
                           f"{out['sample_id'][row]}) appears twice; (run, step, sample_id) must be unique")
        self._seq_arrays = out
        return out

    def _batches(self, columns, chunk_rows: int):
        """Record batches of at most ``chunk_rows`` rows, decoded page by page from a stream read in READ_BUFFER
        pieces, one row group at a time, so that memory stays flat whatever row-group size the writer chose (without
        a read buffer pyarrow reads a whole column chunk at once; one reader over the whole file keeps its
        allocations alive until it is closed, so a fresh one is opened for each row group)."""
        for g in range(self._tok.metadata.num_row_groups):
            pf = self._open(self.tokens_file, READ_BUFFER)
            try:
                yield from pf.iter_batches(batch_size=chunk_rows, row_groups=[g], columns=columns, use_threads=False)
            finally:
                pf.close()

    def iter_tokens(self, columns, chunk_rows: int = 1 << 20, prefetch: bool = True) -> Iterator[tuple[int, dict]]:
        """Yield (first row number, {column: numpy array}) chunks; ``run`` comes as integer codes (``run``) into the
        chunk's list of run names (``run_values``); an optional column that is null on every row of the chunk comes
        as None, a log-prob column as NaN; ``kept_token_ids`` comes as (offsets [n + 1], ids, recorded [n]) arrays
        (row i's set is ids[offsets[i]:offsets[i + 1]]). Required columns are checked for nulls. With ``prefetch``
        the next chunk is read and decoded on a second thread while the caller works on this one (pyarrow and
        numpy release the GIL): reading overlaps the caller's work, at the cost of one more chunk in memory."""
        chunks = self._chunks(list(dict.fromkeys(columns)), chunk_rows)
        return _prefetched(chunks) if prefetch else chunks

    def _chunks(self, columns: list, chunk_rows: int) -> Iterator[tuple[int, dict]]:
        offset = 0
        try:
            for batch in self._batches(columns, int(chunk_rows)):
                yield offset, self._numpy(batch, columns, offset)
                offset += batch.num_rows
        except (pa.ArrowInvalid, OSError) as e:
            raise LabError(f"{self.tokens_file}: cannot read row group near row {offset} "
                           f"({str(e).splitlines()[0]})") from None

    def _numpy(self, batch: pa.RecordBatch, columns: list, offset: int) -> dict:
        out = {}
        n = batch.num_rows
        for name in columns:
            col = batch.column(name)
            if ALL_TOKEN_COLUMNS[name][1] and col.null_count:
                row = offset + int(np.flatnonzero(col.is_null().to_numpy(zero_copy_only=False))[0])
                raise LabError(f"{self.tokens_file}: row {row}: column {name!r} is null; it is required")
            if name == "run":
                if pa.types.is_dictionary(col.type):
                    out["run"] = _array(col.indices)
                    out["run_values"] = [str(v) for v in col.dictionary.to_pylist()]
                else:
                    values, codes = np.unique(col.to_numpy(zero_copy_only=False).astype(str), return_inverse=True)
                    out["run"], out["run_values"] = codes, [str(v) for v in values]
            elif n and col.null_count == n:
                out[name] = np.full(n, np.nan) if name in LOGP_COLUMNS else None
            elif name == "kept_token_ids":
                out[name] = _list_parts(col)
            else:
                out[name] = _array(col)
        return out


def _array(a: pa.Array) -> np.ndarray:
    """A numpy array of an arrow array: a read-only view of the values buffer for a number or bool column without
    nulls (pyarrow's to_numpy would import pandas, a third of a second), else pyarrow's to_numpy (NaN for null)."""
    t = a.type
    if a.null_count or not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
        return a.to_numpy(zero_copy_only=False)
    n, off, buf = len(a), a.offset, a.buffers()[1]
    if buf is None:
        return np.zeros(n, bool if pa.types.is_boolean(t) else "f8")
    if pa.types.is_boolean(t):
        bits = np.frombuffer(buf, np.uint8)
        return np.unpackbits(bits, count=off + n, bitorder="little")[off:].view(bool)
    kind = "f" if pa.types.is_floating(t) else "i" if pa.types.is_signed_integer(t) else "u"
    return np.frombuffer(buf, np.dtype(f"{kind}{t.bit_width // 8}"), count=off + n)[off:]


def _strings(col) -> np.ndarray:
    """A (dictionary-encoded) string column as an object array of str, None where null (pyarrow's own to_numpy
    goes through pandas for strings)."""
    d = col.combine_chunks()
    if pa.types.is_dictionary(d.type) and not d.null_count:
        return np.array(d.dictionary.to_pylist(), dtype=object)[_array(d.indices).astype(np.intp)]
    out = np.empty(len(d), dtype=object)
    out[:] = d.to_pylist()
    return out


def _duplicated(*keys) -> np.ndarray:
    """True on each row whose key (the ``keys`` arrays together) appeared on an earlier row (pandas' duplicated)."""
    n = len(keys[0])
    codes = [np.unique(k, return_inverse=True)[1].reshape(-1).astype(np.int64) for k in keys]
    order = np.lexsort(codes[::-1])  # stable: equal keys stay in row order
    same = np.ones(max(n - 1, 0), bool)
    for c in codes:
        cs = c[order]
        same &= cs[1:] == cs[:-1]
    out = np.zeros(n, bool)
    out[order[1:][same]] = True
    return out


def _prefetched(items: Iterator, depth: int = 1) -> Iterator:
    """The items of ``items``, produced on a background thread at most ``depth`` ahead of the consumer; an
    exception raised while producing is raised here, in order; closing this generator stops the thread."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def produce():
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        q.put((item, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put((end, None))
        except BaseException as e:  # handed to the consumer
            q.put((end, e))
        finally:
            items.close()

    thread = threading.Thread(target=produce, name="lab-diagnose-read", daemon=True)
    thread.start()
    try:
        while True:
            item, error = q.get()
            if error is not None:
                raise error
            if item is end:
                return
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # let a blocked put finish
            try:
                q.get_nowait()
            except queue.Empty:
                thread.join(0.05)


def _list_parts(col: pa.Array) -> tuple:
    """(offsets [n + 1] from 0, ids, recorded [n] bool) of a list<int> column chunk."""
    if pa.types.is_null(col.type):
        n = len(col)
        return np.zeros(n + 1, np.int64), np.zeros(0, np.int64), np.zeros(n, bool)
    offsets = col.offsets.to_numpy().astype(np.int64)
    ids = col.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]].astype(np.int64, copy=False)
    recorded = ~col.is_null().to_numpy(zero_copy_only=False)
    return offsets - offsets[0], ids, recorded


def open_log(path) -> RolloutLog:
    return RolloutLog(path)


def write_tables(path, meta: dict, tokens: pd.DataFrame, sequences: pd.DataFrame) -> Path:
    """Write a small log from two pandas tables (tests, examples); columns as in lab.diagnose.schema."""
    with NeutralLogWriter(path, meta) as w:
        w.write_tokens({c: (tokens[c].tolist() if tokens[c].dtype == object else tokens[c].to_numpy())
                        for c in tokens.columns})
        w.write_sequences({c: (sequences[c].tolist() if sequences[c].dtype == object else sequences[c].to_numpy())
                           for c in sequences.columns})
    return Path(path)


__all__ = ["LAB_LOGP", "NeutralLogWriter", "RolloutLog", "RolloutLogWriter", "check_log_target", "open_log",
           "write_tables"]
