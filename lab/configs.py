"""Config dataclasses as the single source of command-line flags.

A config is a dataclass whose fields carry a docstring each (a string literal right after the field, as in
CleanRL). ``add_flags`` turns every field into ``--field-name`` with the field's type and its docstring as help;
``from_args`` builds the config back. Field metadata can rename a flag (``{"flag": "--agg"}``) or say how a
value is read (``{"parse": "list"}``: comma-separated; ``"pairs"``: repeated KEY=VALUE;
``"estimator_pairs"``: repeated ESTIMATOR.KEY=VALUE).
"""
from __future__ import annotations

import argparse

import ast
import inspect
import json
import textwrap
from dataclasses import MISSING, asdict, fields, is_dataclass

from lab.errors import LabError


def field_docs(cls) -> dict[str, str]:
    """{field name: docstring} from the string literals that follow each field in the class body."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr) \
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def default_of(f):
    return f.default_factory() if f.default is MISSING else f.default


def to_dict(cfg) -> dict:
    """The config as plain JSON-ready data."""
    return asdict(cfg)


def value(text: str):
    """A command-line value: JSON if it parses (numbers, true/false, lists), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def pairs(items, what: str) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise LabError(f"{what} must look like key=value, got {item!r}")
        k, v = item.split("=", 1)
        if k.strip() in out:
            raise LabError(f"{what} gives {k.strip()!r} twice; give each key once")
        out[k.strip()] = value(v.strip())
    return out


def estimator_pairs(items, what: str = "--hyper") -> dict:
    """Repeated ESTIMATOR.KEY=VALUE as {estimator: {key: value}}."""
    out: dict = {}
    for key, v in pairs(items, what).items():
        if "." not in key:
            raise LabError(f"{what} takes ESTIMATOR.KEY=VALUE (e.g. tis_seq.cap=3), got {key!r}")
        est, name = key.split(".", 1)
        out.setdefault(est, {})[name] = v
    return out


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise LabError(f"expected true or false, got {text!r}")


def _number(kind):
    def parse(text: str):
        try:
            return kind(text)
        except ValueError:
            raise LabError(f"expected {'a whole number' if kind is int else 'a number'}, got {text!r}") from None

    parse.__name__ = kind.__name__
    return parse


def parse_list(text: str, cast):
    items = [x.strip() for x in text.split(",")]
    if any(x == "" for x in items):
        raise LabError(f"cannot read {text!r} as a comma-separated list: it has an empty entry")
    try:
        return [cast(x) for x in items]
    except (ValueError, LabError):
        raise LabError(f"cannot read {text!r} as a comma-separated list of {getattr(cast, '__name__', 'values')}") \
            from None


def _element_type(default):
    """Numbers in a list flag are read as floats (staleness values, KL targets); anything else as strings."""
    kinds = {type(v) for v in default}
    return _number(float) if kinds and kinds <= {int, float} else str


def add_flags(parser, cls, skip=()) -> None:
    """One flag per field of ``cls`` (except ``skip``), typed by its default, its docstring as help."""
    docs = field_docs(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        how = f.metadata.get("parse")
        default = default_of(f)
        help_text = docs.get(f.name, "")
        if how in ("pairs", "estimator_pairs"):
            meta = "ESTIMATOR.KEY=VALUE" if how == "estimator_pairs" else "KEY=VALUE"
            parser.add_argument(flag, dest=f.name, action="append", metavar=meta, default=None, help=help_text)
            continue
        if how == "list":
            shown = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in default)
            parser.add_argument(flag, dest=f.name, default=None, metavar="A,B,...",
                                help=f"{help_text} (comma-separated; default {shown})")
            continue
        kind = {bool: parse_bool, int: _number(int), float: _number(float)}.get(type(default), str)
        parser.add_argument(flag, dest=f.name, type=kind, default=None, help=f"{help_text} (default {default})")


def from_args(cls, args, **extra):
    """The config from parsed flags: given flags override the defaults; ``extra`` sets fields directly."""
    values = {}
    for f in fields(cls):
        given = getattr(args, f.name, None)
        if given is None:
            continue
        how = f.metadata.get("parse")
        if how == "pairs":
            given = pairs(given, f.metadata.get("flag", "--" + f.name.replace("_", "-")))
        elif how == "estimator_pairs":
            given = estimator_pairs(given, f.metadata.get("flag", "--" + f.name.replace("_", "-")))
        elif how == "list":
            given = parse_list(given, _element_type(default_of(f)))
        values[f.name] = given
    return cls(**{**values, **extra})


def is_config(obj) -> bool:
    return is_dataclass(obj) and not isinstance(obj, type)


SEED_MAX = 2**63 - 1


def check_types(cfg) -> None:
    """Every field holds a value of its default's kind: whole numbers for int fields (not floats, not strings, not
    booleans), real numbers for float fields, strings, booleans, lists and mappings where those are expected."""
    for f in fields(cfg):
        default, value = default_of(f), getattr(cfg, f.name)
        if default is None:
            continue
        kind = type(default)
        if kind is bool:
            ok = isinstance(value, bool)
        elif kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            what = {int: "a whole number", float: "a number", bool: "true or false", str: "a string", list: "a list",
                    dict: "a mapping"}.get(kind, kind.__name__)
            raise LabError(f"{f.name} must be {what}, got {value!r}")
    seed = getattr(cfg, "seed", 0)
    if not 0 <= seed <= SEED_MAX:
        raise LabError(f"seed must be a whole number between 0 and 2^63 - 1, got {seed}")


def seed_arg(text: str) -> int:
    """An argparse type: a seed in 0 .. 2^63 - 1."""
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if not 0 <= seed <= SEED_MAX:
        raise argparse.ArgumentTypeError(f"a seed is a whole number between 0 and 2^63 - 1, got {text!r}")
    return seed


def check_unique(name: str, values: list) -> None:
    """Refuse repeated entries (they would duplicate rows of the results table)."""
    seen = set()
    for v in values:
        key = json.dumps(v, sort_keys=True)
        if key in seen:
            raise LabError(f"{name} lists {v!r} more than once; give each value once")
        seen.add(key)
