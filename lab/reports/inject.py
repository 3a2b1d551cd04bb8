"""Report parameters enter a notebook as data, never as code.

papermill writes the parameters into an "injected-parameters" cell as Python source. Its own translator quotes
strings but writes any other object through ``str()``, so a ``bytes`` value from a YAML ``!!binary`` tag became code.
The lab registers ``DataTranslator`` for the notebooks' kernel instead: it accepts plain data only (None, bool, int,
finite float, str, lists and string-keyed mappings: ``lab.inputs.plain``), writes each value as a Python literal,
and proves the cell is data by parsing it back: every statement is ``name = literal`` and ``ast.literal_eval`` of
each literal gives back exactly the value (types included). Anything else raises ``LabError`` before a kernel starts.
"""
from __future__ import annotations

import ast
import keyword

from lab.errors import LabError
from lab.inputs import plain

KERNEL = "python3"


def _source(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_source(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_source(k)}: {_source(v)}" for k, v in value.items()) + "}"
    return repr(value)  # None, bool, int, finite float, str: repr is the literal


def _same(a, b) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


def literal(value, name: str) -> str:
    """Python source for plain data ``value``, checked to evaluate back to exactly ``value``."""
    plain(value, f"parameter {name}")
    text = _source(value)
    if not _same(ast.literal_eval(text), value):
        raise LabError(f"parameter {name} cannot be written as a plain literal")
    return text


def cell(parameters: dict, comment: str = "Parameters") -> str:
    """The injected cell: one ``name = literal`` line per parameter, verified to contain nothing else."""
    lines = [f"# {comment}"]
    for name, value in parameters.items():
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
            raise LabError(f"{name!r} is not a parameter name")
        lines.append(f"{name} = {literal(value, name)}")
    source = "\n".join(lines) + "\n"
    _only_data(source)
    return source


def register() -> None:
    """Make papermill write parameters for the lab's kernel and for Python notebooks with ``cell``: plain data as
    literals, anything else refused (idempotent)."""
    from papermill.translators import PythonTranslator, papermill_translators

    class DataTranslator(PythonTranslator):
        @classmethod
        def codify(cls, parameters, comment="Parameters"):
            return cell(parameters, comment)

    for name in (KERNEL, "python"):
        papermill_translators.register(name, DataTranslator)


def parameters_cell(cfg, given=(), out_dir: str | None = None, name: str = "NAME") -> str:
    """The cell a report notebook receives: every field of its config ``cfg`` as ``name = literal  # type: help``
    (the values the config holds after its checks), then the driver's ``out_dir``; verified like ``cell``."""
    from dataclasses import asdict, fields

    from lab.configs import field_docs
    from lab.typed import describe, hints

    cls = type(cfg)
    docs, tps, values = field_docs(cls), hints(cls), asdict(cfg)
    lines = [f"# Parameters: {cls.__module__}.{cls.__qualname__} (their help: `lab report {name} --params`); "
             f"given: {', '.join(given) or 'none, the defaults'}"]
    for f in fields(cfg):
        if not f.name.isidentifier() or keyword.iskeyword(f.name):
            raise LabError(f"{f.name!r} is not a parameter name")
        note = " ".join(f"{describe(tps[f.name])}: {docs.get(f.name, '')}".split())
        lines.append(f"{f.name} = {literal(values[f.name], f.name)}  # {note}")
    lines.append(f"out_dir = {literal(out_dir, 'out_dir')}  # where the driver keeps the run folder")
    source = "\n".join(lines) + "\n"
    _only_data(source)
    return source


def _only_data(source: str) -> None:
    for stmt in ast.parse(source).body:
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name)):
            raise LabError("the parameters cell would hold more than assignments of data")
        ast.literal_eval(stmt.value)
