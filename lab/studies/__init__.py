"""Studies: one folder per study, one name, discovered.

A study is the folder ``lab/studies/<name>/`` and nothing else::

    __init__.py      STUDY = Study(name, reports=(Report(...), ...)): what it is called and which reports it owns
    study.py         Config (a dataclass, one docstring per field, typed and ranged: lab.typed), SMOKE (small
                     field values the tests run), Summary (a dataclass: the summary's typed shape), and
                     run(config) -> StudyResult: computation only, no report code
    report.py        decisions computed from the Summary (tested in Python), figures from the tidy results, and
                     headline(name, summary) for the gallery; prose lives in templates/
    templates/       Markdown templates (Jinja2) of the report's sentences
    <name>*.ipynb    its report notebooks: the report name is the notebook's, and starts with the study's name
    sweeps/          sweep specs of its full tables (`lab sweep lab/studies/<name>/sweeps/X.yaml`)
    tests/           its tests

``studies()`` finds every folder of ``lab.studies.__path__`` whose ``__init__.py`` defines ``STUDY``; the report
driver, ``lab study NAME`` and ``lab report NAME`` read this registry, so adding a study touches its folder only.
Folders of your own studies can live outside the lab: ``LAB_STUDIES_PATH`` (folders separated by ``os.pathsep``)
adds them to ``lab.studies.__path__``. Importing a study's ``__init__`` is cheap (no torch): listings and
``--help`` stay fast.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

__path__ += [p for p in os.environ.get("LAB_STUDIES_PATH", "").split(os.pathsep) if p]  # noqa: F821 - a package


class StudyResult(NamedTuple):
    results: "pd.DataFrame"  # noqa: F821 - tidy rows (pandas is imported by the studies, not here)
    summary: dict  # headline numbers, JSON-ready (``dataclasses.asdict`` of the study's Summary)


@dataclass(frozen=True)
class Report:
    """A report a study owns: ``<study folder>/<name>.ipynb`` built from the study's Config."""

    name: str  # the notebook's stem; starts with the study's name
    description: str  # one line for listings and the gallery
    defaults: dict = field(default_factory=dict)  # the report's own values over the Config's defaults
    smoke: dict = field(default_factory=dict)  # small values over ``defaults``: the tests build every report so
    gallery: bool = True  # built by `lab report --all` (the default gallery)
    formerly: tuple = ()  # names it had before (`lab report OLD` says what it is called now)


@dataclass(frozen=True)
class Study:
    """What ``lab.studies.<name>.STUDY`` declares."""

    name: str  # the folder's name
    reports: tuple = ()  # Report, ...
    rank: int = 100  # place in the gallery (lower first)
    folder: Path | None = None  # set by discovery

    @property
    def module(self) -> str:
        return f"lab.studies.{self.name}"


def studies() -> dict[str, Study]:
    """Every study folder on ``lab.studies.__path__`` (name order), with its folder."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        if not info.ispkg or info.name.startswith("_"):
            continue
        try:
            mod = importlib.import_module(f"{__name__}.{info.name}")
        except Exception as e:  # noqa: BLE001 - a study folder of one's own (LAB_STUDIES_PATH) can fail in any way
            from lab.errors import LabError

            where = getattr(info.module_finder, "path", "lab/studies")
            raise LabError(f"the study folder {where}/{info.name} cannot be imported ({type(e).__name__}: "
                           f"{str(e).splitlines()[0] if str(e) else ''}); fix it, or take its folder off "
                           f"LAB_STUDIES_PATH") from None
        study = getattr(mod, "STUDY", None)
        if isinstance(study, Study):
            if study.name != info.name:
                from lab.errors import LabError

                raise LabError(f"{Path(mod.__file__).parent}: STUDY is named {study.name!r}; name it after its "
                               f"folder")
            found[info.name] = Study(study.name, tuple(study.reports), study.rank, Path(mod.__file__).parent)
    return found


def study_module(name: str):
    """``lab.studies.<name>.study``: Config, SMOKE, Summary, run."""
    return importlib.import_module(f"{__name__}.{name}.study")


def report_module(name: str):
    """``lab.studies.<name>.report``: decisions, figures, headline."""
    return importlib.import_module(f"{__name__}.{name}.report")


def from_parameters(config_cls, namespace: dict):
    """The config a report notebook was given: each field from ``namespace`` (the notebook's globals, where the
    driver wrote the parameters), else its default, so that a notebook opened by hand runs with the defaults."""
    from dataclasses import fields

    return config_cls(**{f.name: namespace[f.name] for f in fields(config_cls) if f.name in namespace})
