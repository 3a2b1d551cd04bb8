"""A report's parameters are the fields of its config class, declared once (``lab.typed``): their types, ranges,
choices and help come from the dataclass, their defaults from the config and the report's own ``defaults``.

``specs(report)`` lists them; ``resolve(report, given)`` holds every given value to its field's type (a
command-line string is read as that type, a parameter file's value is checked at every depth, plain data only),
refuses unknown names, builds the config and runs its ``validate()``: every bad value is one ``LabError`` line before
any kernel starts. Command-line values (``-p key=value``) override a parameter file's (``-f params.yaml``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from lab import typed
from lab.configs import field_docs
from lab.errors import LabError
from lab.inputs import load_yaml


@dataclass(frozen=True)
class Param:
    name: str
    default: object
    help: str
    kind: str  # the type in words


def specs(report) -> dict[str, Param]:
    """{name: Param} of ``report`` (a catalog ReportSpec), in the config's field order."""
    cls = report.config_class()
    docs, tps = field_docs(cls), typed.hints(cls)
    defaults = {**{f.name: typed.default_of(f) for f in fields(cls)}, **report.defaults}
    out = {}
    for f in fields(cls):
        text = docs.get(f.name, "")
        bounds = f.metadata.get("range")
        if bounds:
            text += f" ({typed.range_text(bounds)})"
        out[f.name] = Param(f.name, defaults[f.name], text, typed.describe(tps[f.name]))
    return out


def resolve(report, given: dict, cli: dict | None = None, smoke: bool = False):
    """(config, values): the report's config from its defaults, its smoke values when ``smoke``, the parameter
    file's values ``given`` (plain data) and the command line's ``cli`` (strings), checked and validated."""
    cls = report.config_class()
    tps = typed.hints(cls)
    unknown = sorted((set(given) | set(cli or {})) - set(tps))
    if unknown:
        raise LabError(f"unknown parameter(s) {', '.join(map(str, unknown))} for report {report.name!r}; valid "
                       f"parameters: {', '.join(tps)} (see `lab report {report.name} --params`)")
    values = {**report.defaults, **(report.smoke if smoke else {})}
    values.update({k: typed.check_value(v, tps[k], f"parameter {k}") for k, v in given.items()})
    values.update({k: typed.parse(v, tps[k], f"parameter {k}") for k, v in (cli or {}).items()})
    try:
        cfg = cls(**values)
        typed.check_fields(cfg, lambda name: f"parameter {name}")
        if hasattr(cfg, "validate"):
            cfg.validate()
    except LabError as e:
        raise LabError(f"report {report.name!r}: {e}") from None
    return cfg, values


def from_file(path) -> dict:
    """Parameters from a YAML (or JSON) mapping: plain data only, bounded (``lab.inputs``)."""
    raw = load_yaml(path, "parameter file")
    if raw is None:
        raise LabError(f"parameter file {path} is empty; write one `name: value` per line")
    if not isinstance(raw, dict):
        raise LabError(f"parameter file {path} must be a mapping of parameter names to values, got a "
                       f"{type(raw).__name__}")
    return raw
