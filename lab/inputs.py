"""Reading the files and values users hand the lab: YAML and JSON as plain data, bounded, never code.

Every YAML or JSON input (sweep specs, report parameter files, command-line values, log metadata) goes through
here. What comes back is plain data only: None, bool, int, finite float, str, lists and string-keyed mappings. Refused
with one ``LabError`` line naming the file and the place:

- a file that is missing, a folder, larger than ``MAX_BYTES``, not UTF-8 text, or not valid YAML/JSON;
- YAML tags beyond the JSON types (``!!binary``, ``!!timestamp``, ``!!set``, ``!!python/...``, custom tags), and
  unquoted dates are read as strings, not timestamps;
- a key given twice in one mapping (YAML and JSON would silently keep the last);
- more than ``MAX_NODES`` values once aliases are expanded (a "billion laughs" alias bomb is refused from its node
  graph in milliseconds, before anything is built), a self-referencing alias, or nesting deeper than ``MAX_DEPTH``;
- non-finite numbers (``.inf``, ``NaN``, ``1e400``) and integers of more than ``MAX_DIGITS`` digits.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

from lab.errors import LabError

MAX_BYTES = 1 << 20  # 1 MiB: specs and parameter files are a few hundred bytes
MAX_NODES = 100_000  # values after alias expansion
MAX_DEPTH = 64  # nesting of lists and mappings
MAX_DIGITS = 30  # an integer of more digits is not a setting

_CORE = {f"tag:yaml.org,2002:{t}" for t in ("str", "int", "float", "bool", "null", "seq", "map", "merge")}
_TIMESTAMP = "tag:yaml.org,2002:timestamp"


def read_text(path, what: str, max_bytes: int = MAX_BYTES) -> str:
    """The UTF-8 text of a user's file; LabError (one line) if it is missing, a folder, too large or not text."""
    path = Path(path)
    if path.is_dir():
        raise LabError(f"{what} {path} is a folder; pass the file itself")
    if not path.exists():
        raise LabError(f"{what} {path} does not exist")
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise LabError(f"cannot read {what} {path} ({e.strerror or e})") from None
    if len(data) > max_bytes:
        raise LabError(f"{what} {path} is larger than {max_bytes // 1024} KiB; a {what} is a short text file")
    if b"\x00" in data:
        raise LabError(f"{what} {path} is not a text file (it holds NUL bytes)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LabError(f"{what} {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None


def _where(node) -> str:
    mark = getattr(node, "start_mark", None)
    return f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""


def _check_yaml(root, what: str, max_nodes: int, max_depth: int) -> None:
    """Walk the composed node graph once per distinct node: tags, duplicate keys, cycles, depth and the expanded
    size (a node reached through k aliases counts k times, computed without expanding anything)."""
    size: dict[int, int] = {}
    open_: set[int] = set()

    def visit(node, depth: int) -> int:
        key = id(node)
        if key in size:
            return size[key]
        if key in open_:
            raise LabError(f"{what}: an alias refers to the collection that contains it{_where(node)}")
        if depth > max_depth:
            raise LabError(f"{what} nests deeper than {max_depth} levels{_where(node)}")
        if node.tag == _TIMESTAMP and isinstance(node, yaml.ScalarNode) and node.style is None:
            node.tag = "tag:yaml.org,2002:str"  # an unquoted date stays the text it is
        if node.tag not in _CORE:
            raise LabError(f"{what} uses the YAML tag {node.tag!r}{_where(node)}; only plain values (text, numbers, "
                           f"true/false, null, lists and mappings) are read")
        open_.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(visit(child, depth + 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            seen = {}
            for k, v in node.value:
                if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                    if k.value in seen:
                        raise LabError(f"{what} gives the key {k.value!r} twice{_where(k)}; give each key once")
                    seen[k.value] = True
                total += visit(k, depth + 1) + visit(v, depth + 1)
        open_.discard(key)
        size[key] = total
        if total > max_nodes:
            raise LabError(f"{what} expands to more than {max_nodes:,} values (aliases included){_where(node)}; "
                           f"write the values out")
        return total

    visit(root, 0)


def _yaml_error(e: yaml.YAMLError, what: str) -> LabError:
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return LabError(f"{what} is not valid YAML{where}: {problem}")


def parse_yaml(text: str, what: str, max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH):
    """Plain data from YAML text (see the module docstring); LabError naming ``what`` otherwise."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_yaml(node, what, max_nodes, max_depth)
        data = loader.construct_document(node)
    except yaml.YAMLError as e:
        raise _yaml_error(e, what) from None
    except RecursionError:
        raise LabError(f"{what} nests too deeply") from None
    finally:
        loader.dispose()
    return plain(data, what, max_nodes, max_depth)


def load_yaml(path, what: str, **bounds):
    """Plain data from a YAML (or JSON) file: ``read_text`` then ``parse_yaml``."""
    return parse_yaml(read_text(path, what), f"{what} {path}", **bounds)


def load_json(path, what: str, max_bytes: int = MAX_BYTES, **bounds):
    """Plain data from a JSON file: ``read_text`` (at most ``max_bytes``) then ``parse_json``."""
    return parse_json(read_text(path, what, max_bytes), f"{what} {path}", **bounds)


def _no_duplicates(what):
    def hook(items):
        out = {}
        for k, v in items:
            if k in out:
                raise LabError(f"{what} gives the key {k!r} twice; give each key once")
            out[k] = v
        return out
    return hook


def _int(what):
    def parse(text: str) -> int:
        if len(text.lstrip("-")) > MAX_DIGITS:
            raise LabError(f"{what} holds an integer of {len(text.lstrip('-'))} digits; no setting is that large")
        return int(text)
    return parse


def _float(what):
    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            raise LabError(f"{what} holds the number {text[:40]}, which is not finite in float64")
        return value
    return parse


def _constant(what):
    def parse(text: str):
        raise LabError(f"{what} holds {text}, which is not a number; write a finite number")
    return parse


def parse_json(text: str, what: str, max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH):
    """Plain data from JSON text: duplicate keys, NaN/Infinity, huge numbers and deep nesting refused."""
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicates(what), parse_int=_int(what),
                          parse_float=_float(what), parse_constant=_constant(what))
    except json.JSONDecodeError as e:
        raise LabError(f"{what} is not valid JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise LabError(f"{what} nests deeper than {max_depth} levels") from None
    return plain(data, what, max_nodes, max_depth)


def plain(value, what: str, max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH):
    """``value`` itself if it is plain data within the bounds (see the module docstring); LabError otherwise."""
    count = 0
    stack = [(value, 0, "")]
    while stack:
        v, depth, path = stack.pop()
        count += 1
        if count > max_nodes:
            raise LabError(f"{what} holds more than {max_nodes:,} values")
        if depth > max_depth:
            raise LabError(f"{what} nests deeper than {max_depth} levels")
        if v is None or isinstance(v, (bool, str)):
            continue
        if isinstance(v, int):
            if abs(v) >= 10 ** MAX_DIGITS:
                raise LabError(f"{what}{path}: the integer {str(v)[:20]}... is too large for any setting")
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise LabError(f"{what}{path}: {v} is not a finite number")
        elif isinstance(v, list):
            stack.extend((x, depth + 1, f"{path}[{i}]") for i, x in enumerate(v))
        elif isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str):
                    raise LabError(f"{what}{path}: the key {k!r} is not text; keys are names")
                stack.append((x, depth + 1, f"{path}.{k}"))
        else:
            raise LabError(f"{what}{path}: a {type(v).__name__} is not a plain value (text, number, true/false, "
                           f"null, list or mapping)")
    return value
