"""Config dataclasses as the single source of command-line flags.

A config is a dataclass whose fields carry a docstring each (a string literal right after the field, as in
CleanRL), a precise type annotation and, where it has one, a range (``lab.typed.knob``). ``add_flags`` turns every
field into ``--field-name`` with the field's docstring, choices and range as help; ``from_args`` builds the config
back, reading each value as its field's type (``lab.typed.parse``). Field metadata can rename a flag
(``{"flag": "--agg"}``) or say how a value is read (``"parse": "pairs"``: repeated KEY=VALUE; ``"estimator_pairs"``:
repeated ESTIMATOR.KEY=VALUE). ``check_types(cfg)`` holds a built config to its declarations (``lab.typed``).
"""
from __future__ import annotations

import argparse
import ast
import inspect
import math
import textwrap
import typing
from dataclasses import asdict, fields, is_dataclass

from lab import typed
from lab.errors import LabError
from lab.inputs import parse_json
from lab.typed import default_of  # noqa: F401 - re-exported


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


def to_dict(cfg) -> dict:
    """The config as plain JSON-ready data."""
    return asdict(cfg)


def value(text: str):
    """A KEY=VALUE value whose type its consumer checks: JSON if it reads as JSON (numbers, true/false, lists),
    else the text itself. Non-finite and oversized numbers are refused (``lab.inputs.parse_json``)."""
    try:
        return parse_json(text, f"value {text[:40]!r}")
    except LabError as e:
        if "not valid JSON" in str(e):
            return text
        raise


def pairs(items, what: str, parse: bool = True) -> dict:
    """Repeated KEY=VALUE as {key: value} (``parse``: values read as JSON where they are, else kept as text); a key
    given twice is refused."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise LabError(f"{what} must look like key=value, got {item!r}")
        k, v = item.split("=", 1)
        k = k.strip()
        if not k:
            raise LabError(f"{what} {item!r} names no key; write key=value")
        if k in out:
            raise LabError(f"{what} gives {k!r} twice; give each key once")
        out[k] = value(v.strip()) if parse else v.strip()
    return out


def estimator_pairs(items, what: str = "--hyper") -> dict:
    """Repeated ESTIMATOR.KEY=VALUE as {estimator: {key: value}}."""
    out: dict = {}
    for key, v in pairs(items, what).items():
        est, dot, name = key.partition(".")
        if not dot or not est.strip() or not name.strip():
            raise LabError(f"{what} takes ESTIMATOR.KEY=VALUE with both names (e.g. tis_seq.cap=3), got {key!r}")
        out.setdefault(est.strip(), {})[name.strip()] = v
    return out


def _help(f, tp, docs: dict, default) -> str:
    text = docs.get(f.name, "")
    if typing.get_origin(tp) is typing.Literal:
        text += f" ({' | '.join(map(str, typing.get_args(tp)))})"
    bounds = f.metadata.get("range")
    if bounds:
        text += f" ({typed.range_text(bounds)})"
    if f.metadata.get("parse") in ("pairs", "estimator_pairs"):
        return text
    if isinstance(default, list):
        shown = ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in default)
        return f"{text} (comma-separated; default {shown})"
    return f"{text} (default {default})"


def add_flags(parser, cls, skip=()) -> None:
    """One flag per field of ``cls`` (except ``skip``), read as its type, its docstring, choices and range as help."""
    docs, tps = field_docs(cls), typed.hints(cls)
    for f in fields(cls):
        if f.name in skip:
            continue
        flag = f.metadata.get("flag", "--" + f.name.replace("_", "-"))
        how = f.metadata.get("parse")
        default = default_of(f)
        if how in ("pairs", "estimator_pairs"):
            meta = "ESTIMATOR.KEY=VALUE" if how == "estimator_pairs" else "KEY=VALUE"
            parser.add_argument(flag, dest=f.name, action="append", metavar=meta, default=None,
                                help=_help(f, tps[f.name], docs, default))
            continue
        metavar = "A,B,..." if isinstance(default, list) else None
        parser.add_argument(flag, dest=f.name, default=None, metavar=metavar, help=_help(f, tps[f.name], docs, default))


def flag_of(f) -> str:
    return f.metadata.get("flag", "--" + f.name.replace("_", "-"))


def from_args(cls, args, **extra):
    """The config from parsed flags: given flags override the defaults; ``extra`` sets fields directly. Each value
    is read as its field's type; a wrong one is one LabError naming the flag."""
    values, tps = {}, typed.hints(cls)
    for f in fields(cls):
        given = getattr(args, f.name, None)
        if given is None:
            continue
        how = f.metadata.get("parse")
        if how == "pairs":
            given = pairs(given, flag_of(f))
        elif how == "estimator_pairs":
            given = estimator_pairs(given, flag_of(f))
        else:
            given = typed.parse(given, tps[f.name], flag_of(f))
        values[f.name] = given
    return cls(**{**values, **extra})


def is_config(obj) -> bool:
    return is_dataclass(obj) and not isinstance(obj, type)


SEED_MAX = 2**63 - 1


def check_types(cfg) -> None:
    """Every field held to its declaration (``lab.typed.check_fields``: type, choices, range, the setting it
    applies to); a seed lies in 0 .. 2^63 - 1."""
    typed.check_fields(cfg)
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


def _key(v):
    """A value's identity for repeat checks: numbers by value (0, 0.0 and -0.0 are one), lists element-wise."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return (type(v).__name__, v)
    if isinstance(v, (int, float)):
        return ("number", 0.0 if v == 0 else (float(v) if math.isfinite(v) else repr(v)))
    if isinstance(v, (list, tuple)):
        return ("list", tuple(_key(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((k, _key(x)) for k, x in v.items())))
    return (type(v).__name__, repr(v))


def check_unique(name: str, values: list) -> None:
    """Refuse repeated entries (they would duplicate rows of the results table); 0 and -0 are one value."""
    seen = set()
    for v in values:
        key = _key(v)
        if key in seen:
            raise LabError(f"{name} lists {v!r} more than once; give each value once")
        seen.add(key)
