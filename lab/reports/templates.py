"""The reports' prose: Markdown templates (Jinja2) beside each study, rendered from decisions computed in Python.

A study's ``report.py`` computes what its report decides (which estimator has the lowest MSE, whether intervals
separate, where a claim flips) as plain values and hands them to ``render(folder, template, **facts)``; the sentences
live in ``<study folder>/templates/<template>``. Tests check the decisions and that each template renders, not the
wording. Filters: ``interval`` ("v [lo, hi]"), ``pct`` (a percentage), ``g`` (three significant figures), ``names``
("a, b and c"), ``code`` (a name in backticks).
"""
from __future__ import annotations

import functools
from pathlib import Path

import jinja2


def interval(values, fmt: str = "{:.3g}") -> str:
    """'v [lo, hi]' from (v, lo, hi) with one format for all three."""
    v, lo, hi = values
    return f"{fmt.format(v)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def names(items, last: str = "and") -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}" if items else ""


@functools.cache
def _environment(folder: str) -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(folder), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, autoescape=False)
    env.filters.update(interval=interval, pct=lambda x, d=0: f"{x:.{d}%}", g=lambda x, n=3: f"{x:.{n}g}",
                       names=names, code=lambda x: f"`{x}`")
    return env


def render(folder: Path, template: str, **facts) -> str:
    """``folder/templates/template`` rendered with ``facts`` (a missing fact is an error, not a blank)."""
    return _environment(str(Path(folder) / "templates")).get_template(template).render(**facts).strip() + "\n"
