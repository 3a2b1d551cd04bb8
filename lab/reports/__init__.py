"""Reports: every study's report notebooks and the lessons, built with papermill into self-contained HTML, and the
gallery page that links them.

- ``catalog`` discovers the reports (``lab.studies.studies()`` and ``lab.teach.LESSONS``): ``names()``, ``get(name)``.
- ``params``: a report's parameters are its config's fields (``parameters(name)``), checked before any kernel.
- ``inject``: parameters enter the notebook as literals, data never code.
- ``build``: ``run_report``, ``run`` (the Python API: returns the summary), ``run_all`` (the gallery).
- ``html`` and ``gallery``: the report page and ``index.html``; ``templates``: the reports' prose;
  ``style`` and ``figures``: one palette and the shared figures.
"""
from __future__ import annotations

from lab.reports.build import failed_reports_dir, run, run_all, run_report
from lab.reports.catalog import REPO_ROOT, catalog, get, names
from lab.reports.gallery import write_index
from lab.reports.html import export_html, figure_alts, provenance


def parameters(name: str) -> dict:
    """The report's parameters as {name: Param(name, default, help, kind)}: its config's fields."""
    from lab.reports.params import specs

    return specs(get(name))


__all__ = ["REPO_ROOT", "catalog", "export_html", "failed_reports_dir", "figure_alts", "get", "names", "parameters",
           "provenance", "run", "run_all", "run_report", "write_index"]
