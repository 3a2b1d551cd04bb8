"""Building reports: one notebook with papermill into a report folder, or the whole gallery.

``run_report`` checks the parameters against the report's config and runs its ``validate()`` (one ``LabError`` line
before any kernel starts), writes them into the notebook as a cell of literals (``lab.reports.inject``: data, never
code), executes it with papermill in a hidden staging folder beside the destination (progress bars off in the
kernel), exports the HTML and renames the folder into place::

    <out_root>/<name>/  <name>.ipynb  <name>.html  config.json  results.parquet  summary.json  (.lab)

A failed execution raises ``LabError`` naming the failing cell's error; nothing is left in the reports folder, and
the partially executed notebook is kept in ``$LAB_FAILED_REPORTS`` (default: the per-user cache's
``failed-reports/``). ``run_all`` builds the gallery's reports as separate ``lab report`` processes, ``workers`` at
a time, so that an interrupt (Ctrl-C, SIGTERM) stops every build and leaves nothing half-written.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from lab.errors import LabError
from lab.extras import require
from lab.reports import inject, params as report_params
from lab.reports.catalog import REPO_ROOT, catalog, get
from lab.reports.gallery import write_index
from lab.reports.html import export_html, stamp
from lab.runs import (MARKER, RUN_FILES, atomic_dir, cache_dir, check_out_dir, exclusive_lock, remove_empty,
                      scratch_dir, write_atomic)


def failed_reports_dir() -> Path:
    """Where partially executed notebooks of failed reports are kept: $LAB_FAILED_REPORTS, else the per-user cache's
    failed-reports/ (apart from the model cache, so that tests can send them elsewhere and still share the models)."""
    return Path(os.environ.get("LAB_FAILED_REPORTS") or cache_dir() / "failed-reports")


def check_failed_reports_dir() -> None:
    """Before a report runs: the folder for failed notebooks must be a folder (or creatable)."""
    folder = failed_reports_dir()
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        where = "LAB_FAILED_REPORTS" if os.environ.get("LAB_FAILED_REPORTS") else "the failed-reports folder"
        raise LabError(f"{where} {folder} cannot hold notebooks: {blocker} is a file; point LAB_FAILED_REPORTS at a "
                       f"folder")


def _keep_failed(executed: Path, name: str) -> Path | str:
    """Copy a partially executed notebook to the failed-reports folder under a new name; its path (or why not)."""
    try:
        folder = failed_reports_dir()
        folder.mkdir(parents=True, exist_ok=True)
        fd, kept = tempfile.mkstemp(prefix=f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-", suffix=".ipynb", dir=folder)
        with os.fdopen(fd, "wb") as out, open(executed, "rb") as src:
            shutil.copyfileobj(src, out)
        os.chmod(kept, 0o644)
        return Path(kept)
    except OSError as e:
        return f"not kept: {e.strerror or e}"


def _one_line(text) -> str:
    import re

    text = re.sub(r"\x1b\[[0-9;]*m", "", str(text)).strip()
    return text.splitlines()[0] if text else ""


def _prepared(report, cfg, given: list[str], run_dir: Path):
    """The report's notebook with the parameters cell written in after its cell tagged "parameters"."""
    import nbformat

    nb = nbformat.read(str(report.notebook), as_version=4)
    at = next((i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])), -1)
    cell = nbformat.v4.new_code_cell(inject.parameters_cell(cfg, given, str(run_dir), report.name))
    cell.metadata["tags"] = ["injected-parameters"]
    nb.cells.insert(at + 1, cell)
    nb.metadata["lab"] = {"report": report.name, "config": report.config}
    return nb


@contextmanager
def _quiet_kernel():
    """The kernel inherits LAB_QUIET: no progress bars in the notebook's outputs."""
    before = os.environ.get("LAB_QUIET")
    os.environ["LAB_QUIET"] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LAB_QUIET", None)
        else:
            os.environ["LAB_QUIET"] = before


def run_report(name: str, params: dict | None = None, out_root: Path = Path("reports"), cli: dict | None = None,
               smoke: bool = False) -> Path:
    """Execute report ``name`` into ``out_root/name``: ``params`` are values (a parameter file's), ``cli``
    command-line strings, ``smoke`` the report's small values under both."""
    report = get(name)
    require("reports", *(("teach",) if report.page else ()))
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    if not report.notebook.exists():
        raise LabError(f"report notebook {report.notebook} not found; reports run from a source checkout "
                       f"(pip install -e .)")
    params, cli = dict(params or {}), dict(cli or {})
    cfg, values = report_params.resolve(report, params, cli, smoke)
    given = [k for k in values if k in params or k in cli or (smoke and k in report.smoke)]
    out_root = Path(out_root).resolve()
    dest = out_root / name
    check_out_dir(dest, kind="report")
    check_failed_reports_dir()
    inject.register()
    with _report_lock(out_root, name), atomic_dir(dest, kind="report") as stage:
        executed = stage / f"{name}.ipynb"
        nb = _prepared(report, cfg, given, stage / "run")
        plain = asdict(cfg)
        nb.metadata["lab"]["given"] = {k: plain[k] for k in given}
        try:  # papermill formats paths with str.format: braces in a folder name are escaped
            with _quiet_kernel():
                pm.execute_notebook(nb, str(executed).replace("{", "{{").replace("}", "}}"), parameters=None,
                                    kernel_name=inject.KERNEL, cwd=str(REPO_ROOT), progress_bar=False,
                                    log_output=False, extra_arguments=["--IPKernelApp.log_level=CRITICAL"])
        except PapermillExecutionError as e:
            kept = _keep_failed(executed, name)
            raise LabError(f"report {name!r} failed in cell {e.exec_count}: {e.ename}: {_one_line(e.evalue)} "
                           f"(partial notebook: {kept})") from None
        except Exception as e:  # kernel missing or dead: still one line
            raise LabError(f"report {name!r} could not run: {type(e).__name__}: {_one_line(e)}") from None
        for f in RUN_FILES:
            if not (stage / "run" / f).exists():
                raise LabError(f"report {name!r} did not write its run folder ({f} missing)")
        for f in (stage / "run").iterdir():  # the run files, and whatever else the report keeps (logs, tables)
            if f.name != MARKER:
                os.replace(f, stage / f.name)
        (stage / "run" / MARKER).unlink(missing_ok=True)
        (stage / "run").rmdir()
        if report.page:  # the lesson's static page with live controls, linked from its "Try it" section
            from lab.teach import pages

            lesson = next(p for p in pages.pages() if p.slug == report.page)
            (stage / f"{report.page}.html").write_text(pages.render(lesson), encoding="utf-8")
        page = stamp(export_html(executed, title=f"{name} report"), stage, name, report.page)
        (stage / f"{name}.html").write_text(page, encoding="utf-8")
    return dest


@contextmanager
def _report_lock(out_root: Path, name: str):
    """One run of a report at a time in ``out_root`` (a lock that belongs to the process holding it)."""
    made = [p for p in (out_root, *out_root.parents) if not p.exists()]
    out_root.mkdir(parents=True, exist_ok=True)
    try:
        with exclusive_lock(out_root / f".{name}.lock",
                            f"report {name!r} is being built in {out_root} by another process; wait for it"):
            yield
    finally:
        remove_empty(made)  # folders this run created and left empty (a failed first build)


def run(name: str, out_root: Path = Path("reports"), **params) -> dict:
    """Build report ``name`` with ``params`` into ``out_root/name``, refresh the gallery, return its summary."""
    path = run_report(name, params, out_root)
    write_index(out_root)
    return json.loads((path / "summary.json").read_text())


def _end_with_parent() -> None:
    """In a build's process before it starts (Linux): SIGTERM when the gallery's process dies, even by kill -9, so
    that no build outlives it (each cleans its staging on SIGTERM)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def run_all(out_root: Path = Path("reports"), workers: int = 1, on_event=None, smoke: bool = False,
            only: list[str] | None = None, params: dict | None = None) -> list[Path]:
    """Build the gallery's reports (or ``only`` these) with their defaults (``smoke``: their small values; ``params``:
    {report: values} over them), ``workers`` at a time, each in its own ``lab report`` process; then the gallery
    ``out_root/index.html``. ``on_event(kind, name, seconds)`` hears "start", then "done" or "failed" (with the one-line
    error as ``error=``). A failed report does not stop the others: the gallery shows those that built, then a
    ``LabError`` names the failures. An interrupt stops every build (each cleans its staging) and is raised again."""
    names = only or [r.name for r in catalog().values() if r.gallery]
    for n in names:
        get(n)
    out_root = Path(out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "LAB_QUIET": "1"}
    if workers > 1:  # one compute thread per build: parallel kernels would otherwise contend for the same cores
        env["OMP_NUM_THREADS"] = "1"
    failed, paths, running = {}, {}, {}
    todo = list(names)
    scratch = scratch_dir("lab-gallery") if params else None  # parameter files (a killed gallery's: by the next)
    try:
        def start(name: str):
            argv = [sys.executable, "-m", "lab.cli", "report", name, "--out", str(out_root)]
            if smoke:
                argv.append("--smoke")
            if params and name in params:
                f = Path(scratch) / f"{name}.json"
                write_atomic(f, json.dumps(params[name]))
                argv += ["-f", str(f)]
            if on_event:
                on_event("start", name, 0.0)
            running[name] = (subprocess.Popen(argv, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL,
                                              stderr=subprocess.PIPE, text=True, preexec_fn=_end_with_parent),
                             time.perf_counter())

        try:
            while todo or running:
                while todo and len(running) < max(1, workers):
                    start(todo.pop(0))
                time.sleep(0.1)
                for name, (proc, t0) in list(running.items()):
                    if proc.poll() is None:
                        continue
                    del running[name]
                    err = [ln for ln in proc.stderr.read().splitlines() if ln.strip()]
                    seconds = time.perf_counter() - t0
                    if proc.returncode == 0:
                        paths[name] = out_root / name
                        if on_event:
                            on_event("done", name, seconds)
                    else:
                        failed[name] = (err[-1] if err else f"exit status {proc.returncode}").removeprefix("error: ")
                        if on_event:
                            on_event("failed", name, seconds, error=failed[name])
        except BaseException:
            for proc, _ in running.values():
                proc.send_signal(signal.SIGTERM)
            for proc, _ in running.values():
                proc.wait()
            raise
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    index = write_index(out_root)
    if failed:
        raise LabError(f"{len(failed)} of {len(names)} reports failed ({'; '.join(failed.values())}); the gallery "
                       f"{index} shows the {len(names) - len(failed)} others")
    return [*(paths[n] for n in names), index]
