"""Report parameters: read from the notebook's parameters cell, and checked before anything runs.

A parameter's type is its annotation in the parameters cell, else its default's: a whole number stays a whole number,
a list of whole numbers is a list of whole numbers (``-p lengths=1.5,2`` is refused), a list with any fractional
number a list of numbers, a string stays a string. A parameter whose default is None declares its type with an
annotation and takes that type or None::

    workers: int = None  # default: every core
    values: list[float] = [0, 1, 2]  # an annotation also overrides the default's type

Types are ``int``, ``float``, ``str``, ``bool``, ``dict``, ``list`` and ``list[T]`` (nested: ``list[list[float]]``);
without an annotation a None default takes any value. ``-p estimators=reinforce`` is the one-element list,
``-p values=0,4`` a list of numbers. Wrong names, types or list syntax are one ``LabError`` line.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

from lab.errors import LabError
from lab.inputs import load_yaml, plain

DRIVER_PARAMS = ("out_dir",)  # set by the driver, not by users
SCALARS = ("int", "float", "str", "bool", "dict")


@dataclass(frozen=True)
class Param:
    name: str
    default: object
    help: str
    kind: str = "any"  # int | float | str | bool | dict | list | list[T] | any


def infer(value) -> str:
    """The type of a default value: lists take their elements' type (whole numbers mixed with fractions: float)."""
    if value is None:
        return "any"
    if isinstance(value, list):
        inner = {infer(v) for v in value}
        if len(inner) > 1:
            inner = {k.replace("int", "float") for k in inner}
        return f"list[{inner.pop()}]" if len(inner) == 1 else "list"
    return type(value).__name__ if type(value).__name__ in SCALARS else "any"


def _declared(annotation: str | None) -> str | None:
    """An annotation of the parameters cell as a type, or None when there is none."""
    if not annotation or annotation == "None":
        return None
    kind = annotation.replace(" ", "")
    inner = kind
    while inner.startswith("list[") and inner.endswith("]"):
        inner = inner[5:-1]
    if inner not in (*SCALARS, "list", "any"):
        raise LabError(f"unsupported parameter annotation {annotation!r}; use int, float, str, bool, dict, list or "
                       f"list[T]")
    return kind


def specs(notebook: Path) -> dict[str, Param]:
    """The parameters cell of ``notebook`` as {name: Param}, driver-set parameters left out."""
    import papermill as pm

    found = pm.inspect_notebook(str(notebook))
    out = {}
    for name, v in found.items():
        if name in DRIVER_PARAMS:
            continue
        try:
            default = ast.literal_eval(v["default"])
        except (ValueError, SyntaxError):
            default = None
        kind = _declared(v.get("inferred_type_name")) or infer(default)
        out[name] = Param(name, default, v.get("help") or "", kind)
    return out


_WHAT = {"bool": "true or false", "int": "a whole number", "float": "a number", "str": "a string",
         "dict": "a mapping", "list": "a list", "any": "a value"}
_PLURAL = {"bool": "true/false values", "int": "whole numbers", "float": "numbers", "str": "strings",
           "dict": "mappings", "any": "values"}


def _what(kind: str) -> str:
    if kind.startswith("list["):
        return f"a list of {_PLURAL.get(kind[5:-1], 'lists')}"
    return _WHAT.get(kind, kind)


def _fits(value, kind: str) -> bool:
    if kind == "any":
        return True
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind.startswith("list"):
        return isinstance(value, list)
    return type(value).__name__ == kind


def _as_list(name: str, value) -> list:
    """A list from a list, a comma-separated string (``0,4``) or a single value."""
    if isinstance(value, list):
        return value
    if not isinstance(value, str):
        return [value]
    if value.lstrip().startswith("["):
        raise LabError(f"parameter {name}: cannot read {value!r} as a list; write JSON ([0, 4]) or 0,4")
    items = [_parse(x.strip()) for x in value.split(",")]
    if any(x == "" for x in items):
        raise LabError(f"parameter {name}: cannot read {value!r} as a list (an empty entry)")
    return items


def coerce(name: str, value, kind: str, nullable: bool = False):
    """``value`` checked against ``kind`` at every depth (plain data only: ``lab.inputs.plain``); a comma-separated
    string becomes a list where one is expected."""
    plain(value, f"parameter {name}")
    if value is None and (nullable or kind == "any"):
        return None
    if kind.startswith("list"):
        value = _as_list(name, value)
        inner = kind[5:-1] if kind.startswith("list[") else "any"
        return [coerce(f"{name}[{i}]", v, inner) for i, v in enumerate(value)]
    if not _fits(value, kind):
        raise LabError(f"parameter {name} takes {_what(kind)}{' or null' if nullable else ''}, got {value!r}")
    return value


def _parse(text: str):
    """A command-line value: JSON if it reads as JSON (numbers, true/false, lists), else the text itself."""
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        return text


def check(name: str, notebook: Path, params: dict) -> dict:
    """``params`` for report ``name`` with names and types checked against the notebook's parameters cell."""
    valid = specs(notebook)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise LabError(f"unknown parameter(s) {', '.join(unknown)} for report {name!r}; "
                       f"valid parameters: {', '.join(valid)} (see `lab report {name} --params`)")
    return {k: coerce(k, v, valid[k].kind, valid[k].default is None) for k, v in params.items()}


def from_file(path) -> dict:
    """Parameters from a YAML (or JSON) mapping: plain data only, bounded (``lab.inputs``)."""
    raw = load_yaml(path, "parameter file")
    if raw is None:
        raise LabError(f"parameter file {path} is empty; write one `name: value` per line")
    if not isinstance(raw, dict):
        raise LabError(f"parameter file {path} must be a mapping of parameter names to values, got a "
                       f"{type(raw).__name__}")
    return raw


def study_config(module: str):
    """A config hook for a report whose notebook builds ``lab.studies.<module>.Config`` from its parameters (same
    names): the Config built from the parameters it has a field for and validated, so that bad input is refused
    before papermill starts. None-valued parameters keep the Config's default."""
    def config(values: dict):
        import dataclasses
        import importlib

        cls = importlib.import_module(f"lab.studies.{module}").Config
        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: v for k, v in values.items() if k in names and v is not None})
        cfg.validate()
        return cfg

    return config
