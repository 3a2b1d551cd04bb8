"""Report parameters: read from the notebook's parameters cell, and checked before anything runs.

Every parameter's type is its default's: a whole number stays a whole number, a list stays a list (``-p
estimators=reinforce`` is the one-element list, ``-p values=0,4`` a list of numbers), a string stays a string. A
parameter whose default is None takes any value. Wrong names, types or list syntax are one ``LabError`` line.
"""
from __future__ import annotations

import ast
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from lab.errors import LabError

DRIVER_PARAMS = ("out_dir",)  # set by the driver, not by users


@dataclass(frozen=True)
class Param:
    name: str
    default: object
    help: str

    @property
    def kind(self) -> str:
        d = self.default
        if d is None:
            return "any"
        if isinstance(d, list):
            numeric = d and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in d)
            inner = {"number"} if numeric else {type(v).__name__ for v in d}
            return f"list[{'|'.join(sorted(inner))}]" if inner else "list"
        return type(d).__name__


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
        out[name] = Param(name, default, v.get("help") or "")
    return out


def _scalar(name: str, value, default):
    kind = type(default)
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
    elif isinstance(value, kind):
        return value
    raise LabError(f"parameter {name} takes {_what(default)}, got {value!r}")


def _what(default) -> str:
    return {bool: "true or false", int: "a whole number", float: "a number", str: "a string",
            list: "a list"}.get(type(default), type(default).__name__)


def coerce(name: str, value, default):
    """``value`` checked against ``default``'s type; a comma-separated string becomes a list where one is expected."""
    if default is None or value is None:
        return value
    if isinstance(default, list):
        if isinstance(value, str):
            value = [_parse(x.strip()) for x in value.split(",")]
            if any(x == "" for x in value):
                raise LabError(f"parameter {name}: cannot read {value!r} as a list (an empty entry)")
        elif not isinstance(value, list):
            value = [value]
        if default:  # elements of a list take the kind of the default's elements (numbers: any real number)
            proto = 0.0 if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in default) \
                else default[0]
            value = [_scalar(f"{name}[{i}]", v, proto) for i, v in enumerate(value)]
        return value
    return _scalar(name, value, default)


def _parse(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def check(name: str, notebook: Path, params: dict) -> dict:
    """``params`` for report ``name`` with names and types checked against the notebook's parameters cell."""
    valid = specs(notebook)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise LabError(f"unknown parameter(s) {', '.join(unknown)} for report {name!r}; "
                       f"valid parameters: {', '.join(valid)} (see `lab report {name} --params`)")
    return {k: coerce(k, v, valid[k].default) for k, v in params.items()}


def from_file(path) -> dict:
    """Parameters from a YAML (or JSON) mapping."""
    path = Path(path)
    if not path.is_file():
        raise LabError(f"parameter file {path} does not exist")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise LabError(f"parameter file {path} is not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(raw, dict):
        raise LabError(f"parameter file {path} must be a mapping of parameter names to values")
    return raw
