"""Every report, discovered: the reports each study folder declares (``lab.studies.studies()``) and the lessons
(``lab.teach.LESSONS``). A report is a notebook, the config class whose fields are its parameters, its own default
values over that config's, small smoke values, and where its gallery headline comes from. Nothing here imports a
study's computation: listing reports is cheap."""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass, field
from pathlib import Path

from lab.errors import LabError

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class ReportSpec:
    name: str
    notebook: Path  # absolute
    description: str
    config: str  # "module:Class" of the dataclass whose fields are the report's parameters
    defaults: dict = field(default_factory=dict)  # the report's values over the config's defaults
    smoke: dict = field(default_factory=dict)  # small values over ``defaults`` (tests, `lab report --smoke`)
    gallery: bool = True  # built by `lab report --all`
    headline: str | None = None  # "module:function" (name, summary) -> one line for the gallery
    page: str = ""  # a lesson's static page (lab.teach.pages slug), written into the report folder
    owner: str = ""  # the study (or "lesson")
    formerly: tuple = ()  # earlier names

    def config_class(self):
        module, _, attr = self.config.partition(":")
        return getattr(importlib.import_module(module), attr)

    def headline_of(self, summary: dict) -> str:
        if not self.headline:
            return str(summary.get("headline", ""))
        module, _, attr = self.headline.partition(":")
        return getattr(importlib.import_module(module), attr)(self.name, summary)


@functools.cache
def catalog() -> dict[str, ReportSpec]:
    """{report name: ReportSpec}: the studies' reports in their gallery order, then the lessons."""
    from lab.studies import studies
    from lab.teach import LESSONS

    out = {}
    for study in sorted(studies().values(), key=lambda s: (s.rank, s.name)):
        for r in study.reports:
            if not r.name.startswith(study.name):
                raise ValueError(f"report {r.name!r} of study {study.name!r} must be named from the study")
            out[r.name] = ReportSpec(r.name, study.folder / f"{r.name}.ipynb", r.description,
                                     f"{study.module}.study:Config", dict(r.defaults), dict(r.smoke), r.gallery,
                                     f"{study.module}.report:headline", owner=study.name, formerly=tuple(r.formerly))
    for lesson in LESSONS:
        out[lesson.name] = ReportSpec(lesson.name, REPO_ROOT / lesson.notebook, lesson.description,
                                      f"{lesson.module}:Config", smoke=dict(lesson.smoke), page=lesson.page,
                                      owner="lesson")
    return out


def names() -> list[str]:
    return list(catalog())


def get(name: str) -> ReportSpec:
    if name not in catalog():
        now = next((r.name for r in catalog().values() if name in r.formerly), None)
        if now:
            raise LabError(f"report {name!r} is now called {now!r}: lab report {now}")
        raise LabError(f"unknown report {name!r}; known reports: {', '.join(names())}")
    return catalog()[name]
