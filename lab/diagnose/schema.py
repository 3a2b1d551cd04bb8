"""The neutral rollout-log format: its columns, its metadata file, and their validation.

A log is a folder with three files (specified in docs/rollout-logs.md):

    tokens.parquet     one row per response token: run, step, sample_id, position, token_id, loss_mask,
                       sampler_logp, old_logp, current_logp, version, advantage, entropy, and optionally
                       kept_token_ids (the sampler's kept set at the position, when it truncated)
    sequences.parquet  one row per (run, step, sample_id): group_id, reward, advantage, response_length,
                       version_min, version_max, trainer_version, origin
    meta.json          what each log-prob column means, the sampling settings, the log-prob dtype

Nullable columns hold null where a framework does not record the quantity; a log-prob column that the metadata
declares absent (``null`` description) is entirely null. ``response_length`` counts the token rows of the
sequence (its positions 0 .. response_length - 1). Every check raises ``LabError`` naming the file and the
column (and the row, for value checks).
"""
from __future__ import annotations

import math
from pathlib import Path

import pyarrow as pa

from lab.errors import LabError
from lab.inputs import load_json

FORMAT = "rollout-log"
FORMAT_VERSION = 1
TOKENS, SEQUENCES, META = "tokens.parquet", "sequences.parquet", "meta.json"
LOGP_COLUMNS = ("sampler_logp", "old_logp", "current_logp")

# name -> (kind, required non-null); kinds: int, float, logp (float32 or float64), bool, string
TOKEN_COLUMNS = {
    "run": ("string", True),
    "step": ("int", True),
    "sample_id": ("int", True),
    "position": ("int", True),
    "token_id": ("int", False),
    "loss_mask": ("bool", True),
    "sampler_logp": ("logp", False),
    "old_logp": ("logp", False),
    "current_logp": ("logp", False),
    "version": ("int", False),
    "advantage": ("float", False),
    "entropy": ("float", False),
}
# optional token columns: a log without them is valid; the writers always write them (null when not recorded)
OPTIONAL_TOKEN_COLUMNS = {
    "kept_token_ids": ("int_list", False),
}
ALL_TOKEN_COLUMNS = {**TOKEN_COLUMNS, **OPTIONAL_TOKEN_COLUMNS}
SEQUENCE_COLUMNS = {
    "run": ("string", True),
    "step": ("int", True),
    "sample_id": ("int", True),
    "group_id": ("int", False),
    "reward": ("float", False),
    "advantage": ("float", False),
    "response_length": ("int", True),
    "version_min": ("int", False),
    "version_max": ("int", False),
    "trainer_version": ("int", False),
    "origin": ("string", False),
}
KEY = ("run", "step", "sample_id")

_ARROW = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "string": pa.string(),
          "int_list": pa.list_(pa.int64())}


def arrow_schema(columns: dict, logp_dtype: str = "float32") -> pa.Schema:
    """The arrow schema the writers use (string columns dictionary-encoded by the parquet writer)."""
    logp = pa.float32() if logp_dtype == "float32" else pa.float64()
    fields = []
    for name, (kind, required) in columns.items():
        typ = logp if kind == "logp" else _ARROW[kind]
        if name == "position" or name == "response_length":
            typ = pa.int32()
        fields.append(pa.field(name, typ, nullable=not required))
    return pa.schema(fields)


def _kind_ok(kind: str, typ: pa.DataType) -> bool:
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    if kind == "int":
        return pa.types.is_integer(typ)
    if kind in ("float", "logp"):
        return pa.types.is_floating(typ) or pa.types.is_null(typ)
    if kind == "bool":
        return pa.types.is_boolean(typ)
    if kind == "int_list":
        return pa.types.is_null(typ) or ((pa.types.is_list(typ) or pa.types.is_large_list(typ))
                                         and pa.types.is_integer(typ.value_type))
    return pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_null(typ)


def check_schema(schema: pa.Schema, columns: dict, file: Path, optional: dict | None = None) -> None:
    """Every column present with a type of the right kind (``optional`` ones when present); one LabError naming the
    first bad column."""
    names = set(schema.names)
    for name, (kind, _) in {**columns, **(optional or {})}.items():
        if name not in names and name in (optional or {}):
            continue
        if name not in names:
            raise LabError(f"{file}: column {name!r} is missing (a {file.name} table needs "
                           f"{', '.join(columns)}; see docs/rollout-logs.md)")
        typ = schema.field(name).type
        if not _kind_ok(kind, typ):
            want = {"logp": "float32 or float64", "int": "an integer type", "float": "a float type",
                    "bool": "bool", "string": "string", "int_list": "a list of integers"}[kind]
            raise LabError(f"{file}: column {name!r} has type {typ}, expected {want}")


# ------------------------------------------------------------------------------------------------ metadata
def make_meta(source: str, logp: dict, *, logp_dtype: str = "float32", temperature=None, top_p=None, top_k=None,
              batch_width: int | None = None, notes: list[str] | None = None) -> dict:
    """A metadata dict. ``logp`` maps each of sampler_logp / old_logp / current_logp to a description of what
    it holds (which model, which engine, which precision) or None when the log does not have it."""
    meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "source": source,
            "logp": {k: logp.get(k) for k in LOGP_COLUMNS}, "logp_dtype": logp_dtype,
            "sampling": {"temperature": temperature, "top_p": top_p, "top_k": top_k},
            "batch_width": batch_width, "notes": list(notes or [])}
    check_meta(meta, Path(META))
    return meta


def check_meta(meta, file: Path) -> dict:
    if not isinstance(meta, dict):
        raise LabError(f"{file}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT:
        raise LabError(f"{file}: 'format' is {meta.get('format')!r}, expected {FORMAT!r} (see docs/rollout-logs.md)")
    if meta.get("format_version") != FORMAT_VERSION:
        raise LabError(f"{file}: format_version {meta.get('format_version')!r} is not supported (this lab reads "
                       f"{FORMAT_VERSION})")
    source = meta.get("source")
    if not isinstance(source, str) or not source.strip():
        raise LabError(f"{file}: 'source' must name what wrote the log (a non-empty string), got {source!r}")
    logp = meta.get("logp")
    if not isinstance(logp, dict) or set(logp) != set(LOGP_COLUMNS):
        raise LabError(f"{file}: 'logp' must map exactly {', '.join(LOGP_COLUMNS)} to a description or null")
    for k, v in logp.items():
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise LabError(f"{file}: logp.{k} must be a non-empty description or null, got {v!r}")
    if sum(v is not None for v in logp.values()) < 2:
        raise LabError(f"{file}: at least two of {', '.join(LOGP_COLUMNS)} are needed to compare policies; "
                       f"this log declares {[k for k, v in logp.items() if v is not None] or 'none'}")
    if meta.get("logp_dtype") not in ("float32", "float64"):
        raise LabError(f"{file}: 'logp_dtype' must be float32 or float64, got {meta.get('logp_dtype')!r}")
    sampling = meta.get("sampling")
    if not isinstance(sampling, dict) or set(sampling) != {"temperature", "top_p", "top_k"}:
        raise LabError(f"{file}: 'sampling' must hold temperature, top_p and top_k (null when unknown)")
    for k in ("temperature", "top_p"):
        v = sampling[k]
        if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                              or v <= 0 or (k == "top_p" and v > 1)):
            span = "(0, 1]" if k == "top_p" else "(0, inf)"
            raise LabError(f"{file}: sampling.{k} must be null or a number in {span}, got {v!r}")
    top_k = sampling["top_k"]
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool)):
        raise LabError(f"{file}: sampling.top_k must be null or an integer (0 or -1: no top-k), got {top_k!r}")
    width = meta.get("batch_width")
    if width is not None and (not isinstance(width, int) or isinstance(width, bool) or width < 1):
        raise LabError(f"{file}: batch_width must be null or a positive integer, got {width!r}")
    notes = meta.get("notes", [])
    if not isinstance(notes, list) or not all(isinstance(n, str) for n in notes):
        raise LabError(f"{file}: 'notes' must be a list of strings")
    return meta


def read_meta(folder: Path) -> dict:
    file = Path(folder) / META
    if not file.exists():
        raise LabError(f"{file}: no such file; a neutral rollout log is a folder with {TOKENS}, {SEQUENCES} and {META}")
    return check_meta(load_json(file, "rollout log metadata"), file)  # plain data, bounded (lab.inputs)


def truncated_sampling(meta: dict) -> bool:
    """True when the sampler truncated its distribution (top-p < 1 or top-k > 0)."""
    s = meta["sampling"]
    return (s["top_p"] is not None and s["top_p"] < 1) or (s["top_k"] is not None and s["top_k"] > 0)
