"""Typed config fields: one declaration per field, one checker for every way a value arrives.

A config is a dataclass. A field's type is its annotation (``bool``, ``int``, ``float``, ``str``, ``list[T]``,
``dict[str, T]``, ``typing.Literal[...]`` for a closed set of choices, ``T | None``); its allowed range and the
setting it applies to are declared with ``knob``::

    lr: float = knob(0.1, gt=0, le=1e3)  # followed by its docstring, as every field
    eta: int = knob(2, ge=0, le=10_000, only=("regime", "async"))

``check_fields(cfg)`` holds every field to its declaration (whole numbers are not booleans, numbers are finite,
choices are among the Literal's, values lie in their range, a field that applies only to another field's setting
keeps its default elsewhere) with one ``LabError`` sentence; ``parse(text, tp)`` reads a command-line value as its
type (``1.5`` is not a whole number, ``true`` is not a number). Command-line flags, ``--set`` overrides, sweep specs,
report parameters and parameter files all go through these two, so a value means the same wherever it is given.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from dataclasses import MISSING, field, fields

from lab.errors import LabError
from lab.inputs import MAX_DIGITS, parse_json, plain

_INT = re.compile(r"[+-]?\d+")


def knob(default, *, ge=None, gt=None, le=None, lt=None, only: tuple | None = None, **metadata):
    """A dataclass field with its range (``ge``/``gt``/``le``/``lt``: bounds on a number, or on every number of a
    list) and, with ``only=(field, value, ...)``, the setting of another field it applies to. Other keyword
    arguments are kept as field metadata (``flag``, ``parse``)."""
    meta = dict(metadata)
    bounds = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le), ("lt", lt)) if v is not None}
    if bounds:
        meta["range"] = bounds
    if only:
        meta["only"] = (only[0], tuple(only[1:]))
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: json.loads(json.dumps(d)), metadata=meta)
    return field(default=default, metadata=meta)


def hints(cls) -> dict:
    """{field name: resolved annotation} of a dataclass (string annotations included)."""
    return typing.get_type_hints(cls)


def describe(tp) -> str:
    """A type in words, for messages and help."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is bool:
        return "true or false"
    if tp is int:
        return "a whole number"
    if tp is float:
        return "a number"
    if tp is str:
        return "text"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    if origin in (typing.Union, types.UnionType):
        inner = [describe(a) for a in args if a is not type(None)]
        return " or ".join(inner) + (" or none" if type(None) in args else "")
    if origin is list or tp is list:
        return f"a list of {_plural(args[0])}" if args else "a list"
    if origin is dict or tp is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields"
    return "a value"


def _plural(tp) -> str:
    return {bool: "true/false values", int: "whole numbers", float: "numbers", str: "names"}.get(tp, describe(tp))


def _show(value) -> str:
    text = json.dumps(value) if isinstance(value, (bool, type(None))) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_value(value, tp, name: str):
    """``value`` held to type ``tp`` (whole numbers given for a float become floats); LabError naming ``name``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp in (typing.Any, object):
        return plain(value, name)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in (a for a in args if a is not type(None)):
            try:
                return check_value(value, a, name)
            except LabError:
                continue
        raise LabError(f"{name} must be {describe(tp)}, got {_show(value)}")
    if origin is typing.Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise LabError(f"{name} must be {describe(tp)}, got {_show(value)}")
    if tp is bool:
        ok = isinstance(value, bool)
    elif tp is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and abs(value) < 10 ** MAX_DIGITS
    elif tp is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
            (isinstance(value, float) or abs(value) < 10 ** MAX_DIGITS) and math.isfinite(float(value))
        if ok:
            return float(value)
    elif tp is str:
        ok = isinstance(value, str)
    elif origin is list or tp is list:
        if not isinstance(value, list):
            raise LabError(f"{name} must be {describe(tp)}, got {_show(value)}")
        inner = args[0] if args else typing.Any
        return [check_value(v, inner, f"{name}[{i}]") for i, v in enumerate(value)]
    elif origin is dict or tp is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise LabError(f"{name} must be {describe(tp)} (names to values), got {_show(value)}")
        inner = args[1] if args else typing.Any
        return {k: check_value(v, inner, f"{name}.{k}") for k, v in value.items()}
    else:
        raise TypeError(f"unsupported field type {tp!r} for {name}")
    if not ok:
        raise LabError(f"{name} must be {describe(tp)}, got {_show(value)}")
    return value


def parse(text: str, tp, name: str):
    """A command-line value as type ``tp``: numbers, true/false, comma-separated or JSON lists, JSON mappings;
    ``none`` for an optional field."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    text = text.strip()
    if origin in (typing.Union, types.UnionType):
        if text.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return parse(text, inner[0], name)
        if text.startswith(("[", "{")):
            return check_value(parse_json(text, name), tp, name)
        for a in inner:
            try:
                return parse(text, a, name)
            except LabError:
                continue
        raise LabError(f"{name} must be {describe(tp)}, got {text!r}")
    if tp is bool:
        low = text.lower()
        if low in ("true", "yes", "1"):
            return True
        if low in ("false", "no", "0"):
            return False
        raise LabError(f"{name} must be true or false, got {text!r}")
    if tp is int:
        if not _INT.fullmatch(text) or len(text.lstrip("+-")) > MAX_DIGITS:
            raise LabError(f"{name} must be a whole number, got {text!r}")
        return int(text)
    if tp is float:
        try:
            value = float(text)
        except ValueError:
            raise LabError(f"{name} must be a number, got {text!r}") from None
        if not math.isfinite(value):
            raise LabError(f"{name} must be a finite number, got {text!r}")
        return value
    if tp is str or origin is typing.Literal:
        return check_value(text, tp, name)
    if origin is list or tp is list:
        if text.startswith("["):
            return check_value(parse_json(text, name), tp, name)
        items = [x.strip() for x in text.split(",")]
        if any(x == "" for x in items):
            raise LabError(f"{name}: cannot read {text!r} as a comma-separated list (an empty entry)")
        inner = args[0] if args else typing.Any
        return [parse(x, inner, f"{name}[{i}]") for i, x in enumerate(items)]
    if tp in (typing.Any, object):
        try:
            return parse_json(text, name)
        except LabError:
            return text
    if origin is dict or tp is dict:
        return check_value(parse_json(text, name), tp, name)
    raise TypeError(f"unsupported field type {tp!r} for {name}")


def _in_range(value, bounds: dict) -> bool:
    return all({"ge": value >= b, "gt": value > b, "le": value <= b, "lt": value < b}[k] for k, b in bounds.items())


def range_text(bounds: dict) -> str:
    words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    return " and ".join(f"{words[k]} {b:g}" for k, b in bounds.items())


def default_of(f):
    return f.default_factory() if f.default is MISSING else f.default


def check_fields(cfg, label=lambda name: name) -> None:
    """Every field of dataclass ``cfg`` held to its declaration (type, choices, range, ``only``); values are
    normalised in place (whole numbers for float fields become floats). ``label`` names a field in messages
    (e.g. its command-line flag)."""
    tps = hints(type(cfg))
    for f in fields(cfg):
        value = check_value(getattr(cfg, f.name), tps[f.name], label(f.name))
        object.__setattr__(cfg, f.name, value)
        bounds = f.metadata.get("range")
        if bounds:
            numbers = value if isinstance(value, list) else [value]
            bad = [v for v in numbers if isinstance(v, (int, float)) and not _in_range(v, bounds)]
            if bad:
                raise LabError(f"{label(f.name)} must be {range_text(bounds)}, got {_show(bad[0])}")
    by_name = {f.name: f for f in fields(cfg)}
    for f in fields(cfg):
        only = f.metadata.get("only")
        if only and getattr(cfg, f.name) != default_of(f) and getattr(cfg, only[0]) not in only[1]:
            settings = " or ".join(map(str, only[1]))
            raise LabError(f"{label(f.name)} applies only with {label(only[0])} {settings}, not "
                           f"{getattr(cfg, only[0])!r}; drop it or set {label(only[0])}")
        assert only is None or only[0] in by_name, f"{f.name}: 'only' names an unknown field"


def check_overrides(cls, overrides: dict, what: str, fixed=()) -> dict:
    """``overrides`` of dataclass ``cls``'s fields (not ``fixed``) with each value held to its field's type; LabError
    naming an unknown field or a value of the wrong type (``length=true`` is not a whole number)."""
    tps = {k: v for k, v in hints(cls).items() if k not in fixed}
    unknown = sorted(set(overrides) - set(tps))
    if unknown:
        raise LabError(f"unknown {what}(s) {', '.join(map(str, unknown))}; settable: {', '.join(sorted(tps))}")
    return {k: check_value(v, tps[k], f"{what} {k}") for k, v in overrides.items()}


def build(cls, data):
    """An instance of dataclass ``cls`` from JSON-ready ``data`` (a study's summary.json): nested dataclasses, lists
    and mappings of them are rebuilt from the annotations; keys the class does not declare are ignored."""
    tps = hints(cls)
    return cls(**{f.name: _build(tps[f.name], data[f.name]) for f in fields(cls) if f.name in data})


def _build(tp, value):
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if value is None:
        return None
    if dataclasses.is_dataclass(tp):
        return build(tp, value)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return _build(inner[0], value) if len(inner) == 1 else value
    if origin is list and args:
        return [_build(args[0], v) for v in value]
    if origin is dict and len(args) == 2:
        return {k: _build(args[1], v) for k, v in value.items()}
    return value
