"""Report notebooks: a registry, a papermill driver with a self-contained HTML export, and the gallery index.

``run_report(name, params)`` executes ``notebooks/<name>.ipynb`` with papermill in a hidden staging folder
next to the destination, exports HTML (code hidden, figures embedded as base64 PNG, no external scripts or
styles) and renames the folder into ``<out_root>/<name>/``:

    <name>.ipynb  <name>.html  config.json  results.parquet  summary.json

Parameters are checked against the notebook's parameters cell before anything runs (``lab.reports.params``), and a
report whose notebook builds a study config builds and validates that config too (``Report.config``), so that an
unknown estimator or a missing device is one line before any kernel starts. A failed execution raises ``LabError``
naming the failing cell's error; nothing is left in the reports folder, and the partially executed notebook is kept
for debugging in ``$LAB_FAILED_REPORTS`` (default: the per-user cache's ``failed-reports/``), named in the error.
A kill -9 leaves a hidden staging folder; the next run of the same report removes it (a lock per report name keeps
two runs of one report apart).
Each study's figures and answer text live beside the driver, one module per study (``lab.reports.variance``, ...),
with the shared look in ``lab.reports.style``.
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from lab.errors import LabError
from lab.reports import distillation as distillation_text
from lab.reports import staleness_training as staleness_text
from lab.reports import gvpo_optimum as gvpo_optimum_text
from lab.reports import mismatch as mismatch_text
from lab.reports import real_model_variance as real_model_text
from lab.reports import variance as variance_text
from lab.reports import vespo_bound as vespo_bound_text
from lab.reports import params as report_params
from lab.reports import inject
from lab.runs import (FILE_MARK, MARKER, RUN_FILES, atomic_dir, cache_dir, check_out_dir, exclusive_lock,
                      remove_empty, write_file)
from lab.teach import LESSONS

REPO_ROOT = Path(__file__).resolve().parents[2]
_study = report_params.study_config


def _summary_headline(summary: dict) -> str:
    return str(summary.get("headline", ""))


@dataclass(frozen=True)
class Report:
    notebook: str  # path relative to the repository root
    description: str  # one line for listings and the gallery
    params: dict = field(default_factory=dict)  # overrides of the notebook's defaults used by run_all
    smoke: dict = field(default_factory=dict)  # small parameters: the test suite builds every report with them
    headline: Callable[[dict], str] = _summary_headline  # summary.json -> one line for the gallery
    config: Callable[[dict], object] | None = None  # all parameter values -> the validated study config (or raises)
    page: str = ""  # a lesson's static page (lab.teach.pages slug), written into the report folder


REPORTS: dict[str, Report] = {
    "estimator_variance": Report(
        "notebooks/estimator_variance.ipynb",
        "How wrong and how noisy is the policy gradient under each off-policy correction as rollouts go stale.",
        smoke={"replicates": 40, "values": [0, 4]}, headline=variance_text.headline, config=_study("variance")),
    "estimator_zoo": Report(
        "notebooks/estimator_zoo.ipynb",
        "Every estimator side by side: its effective coefficient on grad log pi, and bias, variance and MSE on the "
        "same batches across staleness.",
        smoke={"replicates": 30, "values": [0, 8]}, config=_study("variance")),
    "vespo_bound": Report(
        "notebooks/vespo_bound.ipynb",
        "VESPO's variance bound (Proposition 3.1) checked exactly by enumeration, and VESPO against sequence IS up "
        "to 64x staleness.",
        smoke={"lags": [0, 4], "kl_targets": [0.1], "temperatures": [2.0], "bound_seeds": [0], "replicates": 40,
               "trajectory_steps": 4, "kernels": [[2, 3], [3, 2], [1, 1], [0.5, 1]]},
        headline=vespo_bound_text.headline, config=_study("vespo_bound")),
    "gvpo_optimum": Report(
        "notebooks/gvpo_optimum.ipynb",
        "GVPO converges to the KL-constrained optimum pi_ref exp(R/beta)/Z, on-policy and from other sampling "
        "distributions, against IS-corrected alternatives.",
        smoke={"steps": 60, "seeds": [0, 1], "groups_per_step": 8}, headline=gvpo_optimum_text.headline,
        config=_study("gvpo_optimum")),
    "opd_variance": Report(
        "notebooks/opd_variance.ipynb",
        "On-policy distillation: vanilla OPD, vOPD (full and top-k baselines), full-vocabulary and top-k KL: bias "
        "against both targets, variance, and where the baseline's variance reduction holds (vocabulary size, "
        "student-teacher divergence).",
        smoke={"vocab_size": 8, "length": 2, "replicates": 40, "k_values": [2], "teacher_steps": 3,
               "grid_vocab_sizes": [3, 8], "grid_teacher_noises": [1.0], "grid_replicates": 40, "grid_lengths": [2]},
        headline=distillation_text.headline, config=_study("distillation")),
    "staleness_training": Report(
        "notebooks/staleness_training.ipynb",
        "Training under staleness: final reward, collapse rate and probability of improvement per correction as "
        "mini-batch staleness N, the async bound eta and sampler mismatch grow, beside VESPO's table.",
        smoke={"estimators": ["reinforce", "ppo_clip", "vespo"], "minibatches": [1, 4], "seeds": [0, 1], "steps": 4,
               "etas": [0, 2], "noise_levels": [0.0, 0.5], "n_boot": 200},
        headline=staleness_text.headline, config=_study("staleness_training")),
    "rollout_diagnostics": Report(
        "notebooks/rollout_diagnostics.ipynb",
        "Importance-weight diagnostics of a training run's own rollout log (or a simulated bf16/async run): "
        "sampler/trainer log-ratios by token probability and length, ESS and k-hat per step, staleness, and what each "
        "correction would clip or mask.",
        smoke={"simulate": {"steps": 3, "batch": 32, "group_size": 8, "vocab": 32, "mean_len": 20, "lag_max": 2,
                            "drift": 0.05, "sampler_dtype": "bfloat16", "seed": 0}}),
    "real_model_variance": Report(
        "notebooks/real_model_variance.ipynb",
        "The variance study on the lab's own transformer beside a table holding the same starting distribution: "
        "bias, variance and MSE of each correction against lag and response length, exact by enumeration.",
        smoke={"lengths": [2], "model": "test", "values": [0, 2], "replicates": 30, "trajectory_steps": 2,
               "estimators": ["reinforce", "seq_is", "token_is"]},
        headline=real_model_text.headline, config=_study("real_model_variance")),
    "mismatch_anatomy": Report(
        "notebooks/mismatch_anatomy.ipynb",
        "Train/inference mismatch measured on real networks: bf16 weights, KV cache and MoE routing (with replay) of "
        "the lab's transformer and SmolLM2-135M, per token, against token probability and along the response, beside "
        "the figures practitioners report.",
        smoke={"inlab_sizes": ["test", "test_moe"], "inlab_init": "random", "lm": "none", "n_boot": 200},
        headline=mismatch_text.headline, config=mismatch_text.config),
    "real_staleness_training": Report(
        "notebooks/real_staleness_training.ipynb",
        "VESPO's staleness table in miniature on the lab's transformer: final held-out accuracy and collapse rate of "
        "each correction as mini-batch staleness N grows to 64, under async lag and a real bf16 / MoE sampler.",
        smoke={"env": "chain3", "size": "test", "estimators": ["reinforce", "ppo_clip", "vespo"], "minibatches": [1, 4],
               "seeds": [0, 1], "steps": 2, "rollout_batch": 32, "group_size": 4, "etas": [0, 2],
               "sampler_dtypes": ["bfloat16"], "replay": [False, True], "n_boot": 200},
        config=_study("real_staleness_training")),
    "real_distillation": Report(
        "notebooks/real_distillation.ipynb",
        "On-policy distillation from a real teacher transformer: where vOPD's baseline cuts the gradient variance "
        "and why; reverse KL over steps, gradient variance along training and cost per step of vanilla OPD, vOPD, "
        "full-vocabulary and top-k KL across vocabulary sizes and student-teacher gaps (or a sweep's results).",
        smoke={"vocab_sizes": [10], "student_accuracies": [0.0], "seeds": [0, 1], "steps": 4, "grad_every": 2,
               "probe_size": 8, "batch_size": 16, "teacher_size": "small", "teacher_accuracy": 0.5,
               "student_size": "test"},
        config=_study("real_distillation")),
}

REPORTS.update({lesson.name: Report(lesson.notebook, lesson.description, smoke=lesson.smoke, page=lesson.page)
                for lesson in LESSONS})


def names() -> list[str]:
    return list(REPORTS)


def _get(name: str) -> Report:
    if name not in REPORTS:
        raise LabError(f"unknown report {name!r}; known reports: {', '.join(names())}")
    return REPORTS[name]


def parameters(name: str) -> dict:
    """The notebook's parameters as {name: Param(name, default, help)}, driver-set parameters left out."""
    return report_params.specs(REPO_ROOT / _get(name).notebook)


def _one_line(text: str) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(text)).strip()
    return text.splitlines()[0] if text else ""


_WIDGET = "application/vnd.jupyter.widget-view+json"
_SCRIPTS = re.compile(r"<script\b.*?</script>", re.I | re.S)  # MathJax, require.js, mermaid: all from CDNs
_REMOTE_LINKS = re.compile(r"<link\b[^>]*\bhref\s*=\s*[\"']?(?:https?:)?//[^>]*>", re.I)
_CSS = """<style>
body { max-width: 1180px; margin: 0 auto !important; padding: 0 24px 48px; }
.jp-Notebook { padding: 8px 0 !important; }
.jp-RenderedHTMLCommon table.lab-headline { font-size: 13px; }
.jp-RenderedImage img { max-width: 100%; height: auto; }
.lab-provenance { color: #666; font: 12px system-ui, sans-serif; padding: 10px 0; border-bottom: 1px solid #eee;
                  overflow-wrap: anywhere; }
</style>
"""


def export_html(notebook: Path, title: str) -> str:
    """Self-contained HTML of an executed notebook: outputs only, images inline, no scripts or remote resources."""
    import nbformat
    from nbconvert import HTMLExporter

    from bs4 import BeautifulSoup

    nb = nbformat.read(str(notebook), as_version=4)
    for out in (o for cell in nb.cells for o in cell.get("outputs", [])):
        data = out.get("data", {})
        if _WIDGET in data and ({"text/html", "image/png"} & set(data)):
            del data[_WIDGET]  # a static page has no widget state: show the output's static fallback instead
    exporter = HTMLExporter(template_name="lab", exclude_input=True, exclude_input_prompt=True,
                            exclude_output_prompt=True)
    exporter.log.setLevel("ERROR")  # it warns about missing alt text, which is added below
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title}})
    body = _REMOTE_LINKS.sub("", _SCRIPTS.sub("", body))  # a report is static: tables, text, PNGs
    soup = BeautifulSoup(body, features="html.parser")
    images = [img for img in soup.select("img") if img.get("src", "").startswith("data:image/png")]
    for img, alt in zip(images, figure_alts(nb)):
        if alt and (not img.get("alt") or img["alt"].startswith("No description")):
            img["alt"] = alt
    return str(soup).replace("</head>", _CSS + "</head>", 1)


def _stamp(html_text: str, folder: Path, name: str) -> str:
    """The report page with its provenance and links to its run files at the top."""
    line = (f'<div class="lab-provenance">{html.escape(_provenance_line(provenance(folder, name)))}<br>'
            f'files: {_file_links(name)} · <a href="../index.html">all reports</a></div>')
    return re.sub(r"(<body[^>]*>)", lambda m: m.group(1) + line, html_text, count=1)


def figure_alts(nb) -> list[str]:
    """One alt text per PNG output, in order: the line starting "*Figure:" of the nearest Markdown cell above it,
    else that cell's first sentence (the notebooks describe each figure just before drawing it)."""
    alts, text = [], ""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            src = cell.source.strip()
            marked = [line.strip("* ") for line in src.splitlines() if line.lstrip("*").startswith("Figure:")]
            text = marked[0] if marked else re.split(r"(?<=[.!?])\s", re.sub(r"[#*`]", "", src).strip(), 1)[0]
        for out in cell.get("outputs", []):
            if "image/png" in out.get("data", {}):
                alts.append(text)
    return alts


def run_report(name: str, params: dict | None = None, out_root: Path = Path("reports")) -> Path:
    """Execute report ``name`` with ``params`` (overrides of its parameters cell) into ``out_root/name``."""
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    report = _get(name)
    notebook = REPO_ROOT / report.notebook
    if not notebook.exists():
        raise LabError(f"report notebook {notebook} not found; reports run from a source checkout (pip install -e .)")
    params = report_params.check(name, notebook, dict(params or {}))
    if report.config:  # the study's own checks, before a kernel starts
        defaults = {k: p.default for k, p in parameters(name).items()}
        try:
            report.config({**defaults, **params})
        except LabError as e:
            raise LabError(f"report {name!r}: {e}") from None
    out_root = Path(out_root).resolve()
    dest = out_root / name
    check_out_dir(dest, kind="report")
    check_failed_reports_dir()
    inject.register()
    with _report_lock(out_root, name), atomic_dir(dest, kind="report") as stage:
        executed = stage / f"{name}.ipynb"
        try:  # papermill formats paths with str.format: braces in a folder name are escaped
            pm.execute_notebook(str(notebook).replace("{", "{{").replace("}", "}}"),
                                str(executed).replace("{", "{{").replace("}", "}}"),
                                parameters={**params, "out_dir": str(stage / "run")}, kernel_name=inject.KERNEL,
                                cwd=str(REPO_ROOT), progress_bar=False, log_output=False,
                                extra_arguments=["--IPKernelApp.log_level=CRITICAL"])  # no kernel log noise
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
        page = _stamp(export_html(executed, title=f"{name} report"), stage, name)
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


def run(name: str, out_root: Path = Path("reports"), **params) -> dict:
    """Build report ``name`` with ``params`` into ``out_root/name``, refresh the gallery, return its summary."""
    path = run_report(name, params, out_root)
    write_index(out_root)
    return json.loads((path / "summary.json").read_text())


def run_all(out_root: Path = Path("reports"), workers: int = 1, on_event=None) -> list[Path]:
    """Build every report with its default parameters (``workers`` notebooks at a time), then the gallery
    ``out_root/index.html``. ``on_event(kind, name, seconds)`` hears "start", then "done" or "failed" (with the
    one-line error as ``error=``) for each report. A failed report does not stop the others: the gallery is written
    with those that built, then a ``LabError`` names the failures."""
    failed = {}

    def build(name: str) -> Path | None:
        if on_event:
            on_event("start", name, 0.0)
        t0 = time.perf_counter()
        try:
            path = run_report(name, REPORTS[name].params, out_root)
        except LabError as e:
            failed[name] = str(e)
            if on_event:
                on_event("failed", name, time.perf_counter() - t0, error=str(e))
            return None
        if on_event:
            on_event("done", name, time.perf_counter() - t0)
        return path

    Path(out_root).mkdir(parents=True, exist_ok=True)
    threads = os.environ.get("OMP_NUM_THREADS")
    if workers > 1:  # one compute thread per kernel: parallel kernels would otherwise contend for the same cores
        os.environ["OMP_NUM_THREADS"] = "1"
    try:
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:  # each report runs in its own kernel process
            paths = list(pool.map(build, names()))
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    index = write_index(out_root)
    if failed:
        raise LabError(f"{len(failed)} of {len(paths)} reports failed ({'; '.join(failed.values())}); the gallery "
                       f"{index} shows the {len(paths) - len(failed)} others")
    return [*paths, index]


def _thumbnail(notebook: Path) -> str | None:
    """The first PNG output of an executed notebook, base64."""
    nb = json.loads(notebook.read_text())
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            png = out.get("data", {}).get("image/png")
            if png:
                return "".join(png).strip()
    return None


def provenance(folder: Path, name: str) -> dict:
    """When and from what a built report came: date, lab version, git revision and the parameters it was given."""
    out = {"date": "", "version": "", "revision": "", "parameters": {}}
    try:
        config = json.loads((folder / "config.json").read_text())
        out["version"] = (config.get("versions") or {}).get("offpolicy-variance-lab") or ""
        out["revision"] = (config.get("git_revision") or "")[:12]
        nb = json.loads((folder / f"{name}.ipynb").read_text())
        pm = nb.get("metadata", {}).get("papermill", {})
        out["date"] = (pm.get("end_time") or "")[:16].replace("T", " ")
        out["parameters"] = {k: v for k, v in (pm.get("parameters") or {}).items() if k != "out_dir"}
    except (OSError, ValueError):
        pass
    return out


def _provenance_line(prov: dict) -> str:
    params = ", ".join(f"{k}={json.dumps(v)}" for k, v in prov["parameters"].items()) or "defaults"
    return (f"built {prov['date'] or '?'} UTC · lab {prov['version'] or '?'} · revision {prov['revision'] or '?'} · "
            f"parameters: {params}")


def _file_links(name: str, prefix: str = "") -> str:
    files = [f"{name}.ipynb", *RUN_FILES, *([f"{REPORTS[name].page}.html"] if REPORTS[name].page else [])]
    return " · ".join(f'<a href="{prefix}{html.escape(f)}">{html.escape(f)}</a>' for f in files)


def write_index(out_root: Path = Path("reports")) -> Path:
    """The gallery page: one card per built report with its description, headline, provenance and run files."""
    out_root = Path(out_root)
    cards = []
    for name, report in REPORTS.items():
        folder = out_root / name
        if not (folder / f"{name}.html").exists():
            continue
        try:
            headline = report.headline(json.loads((folder / "summary.json").read_text()))
        except (OSError, KeyError, ValueError, TypeError) as e:
            headline = f"(no headline: {type(e).__name__})"
        thumb = _thumbnail(folder / f"{name}.ipynb")
        img = (f'<a href="{name}/{name}.html"><img src="data:image/png;base64,{thumb}" '
               f'alt="{html.escape(name)}: first figure of the report"></a>') if thumb else ""
        cards.append(f'<div class="card">{img}<h2><a href="{name}/{name}.html">{html.escape(name)}</a></h2>'
                     f'<p>{html.escape(report.description)}</p><p class="num">{html.escape(headline)}</p>'
                     f'<p class="files">{html.escape(_provenance_line(provenance(folder, name)))}<br>'
                     f'{_file_links(name, f"{name}/")}</p></div>')
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">{FILE_MARK}<title>Off-policy variance lab: reports</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }}
.card {{ border: 1px solid #ddd; border-radius: 8px; padding: 1em; margin: 1em 0; overflow-wrap: anywhere; }}
.card:hover {{ border-color: #1f77b4; }} .card h2 a {{ color: inherit; }}
.card img {{ max-width: 100%; height: auto; }} .num {{ font-weight: 600; font-size: 1.1em; }}
.files {{ color: #666; font-size: .85em; }}
</style></head><body>
<h1>Off-policy variance lab: reports</h1>
<p>Generated by <code>make reports</code> (<code>lab report --all</code>). Each report folder holds the executed
notebook and its run files; <code>lab report NAME -p key=value</code> rebuilds one with other parameters and
refreshes this page, whose cards say which parameters each report was built with.</p>
{''.join(cards) or '<p>No reports built yet.</p>'}
</body></html>
"""
    out_root.mkdir(parents=True, exist_ok=True)
    write_file(out_root / "index.html", page)
    return out_root / "index.html"
