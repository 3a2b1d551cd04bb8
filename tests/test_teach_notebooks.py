"""The teaching notebooks under papermill with their smoke parameters: no error cells, a run folder with a
headline shown first, static figures at 150 dpi whose alt text is in the notebook's Markdown, a static snapshot of the
live controls, and an HTML export that shows them."""
from __future__ import annotations

import dataclasses
import importlib
import io
import json
import re
from pathlib import Path

import nbformat
import numpy as np
import pandas as pd
import pytest

from lab.teach import LESSONS

ROOT = Path(__file__).resolve().parent.parent
FIGURES = {"teach_weight_explosion": 2, "teach_clip_mask": 3, "teach_vespo_kernel": 4, "teach_gvpo_zero_sum": 3,
           "teach_vopd_baseline": 2,
           "teach_sampler_truncation": 3}  # static figures, the live controls' snapshot not counted
WIDGET = "application/vnd.jupyter.widget-view+json"


def _outputs(path: Path) -> list:
    nb = nbformat.read(str(path), as_version=4)
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]


@pytest.fixture(scope="module")
def executed(gallery):
    """Every lesson as the report driver executed it (the session's gallery): (executed notebook, run folder)."""
    return {lesson.name: (gallery / lesson.name / f"{lesson.name}.ipynb", gallery / lesson.name) for lesson in LESSONS}


def test_lessons_list_the_notebooks():
    on_disk = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "notebooks" / "teach").glob("*.ipynb"))
    assert sorted(lesson.notebook for lesson in LESSONS) == on_disk
    assert set(FIGURES) == {lesson.name for lesson in LESSONS}


@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.name)
def test_parameters_cell_and_kernel(lesson):
    import papermill as pm

    nb = nbformat.read(str(ROOT / lesson.notebook), as_version=4)
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and re.search(r"^out_dir = None\b", tagged[0].source, re.M)
    assert set(pm.inspect_notebook(str(ROOT / lesson.notebook))) == {"out_dir"}  # the rest comes from the Config
    config = importlib.import_module(lesson.module).Config
    assert set(lesson.smoke) <= {f.name for f in dataclasses.fields(config)}
    assert nb.metadata.kernelspec.name == "offpolicy-lab"
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "commit notebooks without outputs"


@pytest.mark.slow  # executes the notebooks (the session's gallery)
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.name)
def test_runs_without_errors_and_writes_its_run_folder(executed, lesson):
    path, run = executed[lesson.name]
    nb = nbformat.read(str(path), as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [o for o in outputs if o.output_type == "stream" and o.name == "stderr"], "warnings or errors printed"
    config = json.loads((run / "config.json").read_text())
    for key, value in lesson.smoke.items():
        if key in config:
            assert config[key] == value, key
    summary = json.loads((run / "summary.json").read_text())
    assert isinstance(summary["headline"], str) and len(summary["headline"]) > 40
    assert "nan" not in summary["headline"].lower()
    results = pd.read_parquet(run / "results.parquet")
    assert len(results) > 0 and results.select_dtypes("number").notna().any().all()
    text = "".join(o.get("data", {}).get("text/markdown", "") for o in outputs if "data" in o)
    assert summary["headline"] in text, "the notebook shows the headline it writes"
    widgets = [o for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
    assert len(widgets) == 1 and "make lab" in widgets[0]["data"]["text/plain"]


@pytest.mark.slow  # executes the notebooks (the session's gallery)
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.name)
def test_figures_at_150_dpi_with_alt_text(executed, lesson):
    from base64 import b64decode

    from PIL import Image

    nb = nbformat.read(str(executed[lesson.name][0]), as_version=4)
    markdown = " ".join(c.source for c in nb.cells if c.cell_type == "markdown")
    figures = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
               if "image/png" in o.get("data", {}) and "text/html" in o.get("data", {}) and WIDGET not in o["data"]]
    assert len(figures) == FIGURES[lesson.name]
    for out in figures:
        image = Image.open(io.BytesIO(b64decode(out["data"]["image/png"])))
        assert [round(d) for d in image.info["dpi"]] == [150, 150]
        assert image.size[0] > 600 and len(np.unique(np.asarray(image.convert("L")))) > 20  # a real, non-blank plot
        alt = re.search(r'alt="([^"]+)"', out["data"]["text/html"]).group(1)
        assert len(alt) > 80 and alt.replace("&#x27;", "'") in markdown


@pytest.mark.slow  # executes the notebooks (the session's gallery)
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.name)
def test_the_finding_comes_first(executed, lesson):
    """After the title, before any figure or table: the headline the run folder holds, computed, not typed."""
    path, run = executed[lesson.name]
    nb = nbformat.read(str(path), as_version=4)
    assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
    assert "\n" not in nb.cells[0].source.strip()  # the title alone; the introduction follows the finding
    first = next(o for o in _outputs(path) if "data" in o)
    headline = json.loads((run / "summary.json").read_text())["headline"]
    assert first["data"]["text/markdown"] == f"**The finding.** {headline}."
    source = nbformat.read(str(ROOT / lesson.notebook), as_version=4)
    finding = next(c for c in source.cells if "**The finding.**" in c.source)
    assert source.cells.index(finding) <= 3 and "headline = " in finding.source


@pytest.mark.slow  # executes the notebooks (the session's gallery)
@pytest.mark.parametrize("lesson", LESSONS, ids=lambda l: l.name)
def test_live_controls_leave_a_static_snapshot(executed, lesson):
    """Under papermill there is no widget frontend: the controls' output also carries the figure at the notebook's
    setting (150 dpi, with alt text) and where to move them (the lesson's static page, make lab)."""
    from base64 import b64decode

    from PIL import Image

    path, run = executed[lesson.name]
    (out,) = [o for o in _outputs(path) if WIDGET in o.get("data", {})]
    image = Image.open(io.BytesIO(b64decode(out["data"]["image/png"])))
    assert [round(d) for d in image.info["dpi"]] == [150, 150] and image.size[0] > 600
    html_text = out["data"]["text/html"]
    assert f'href="{lesson.page}.html"' in html_text and "make lab" in html_text
    assert len(re.search(r'alt="([^"]+)"', html_text).group(1)) > 80
    assert (run / f"{lesson.page}.html").stat().st_size > 100_000  # the static page sits beside the report


@pytest.mark.slow  # executes the notebooks (the session's gallery)
def test_html_export_shows_the_figures(executed):
    """The static report as the driver writes it: every figure, the controls' snapshot instead of an empty widget
    area, the finding, no scripts."""
    path, run = executed["teach_vespo_kernel"]
    body = (run / "teach_vespo_kernel.html").read_text(encoding="utf-8")
    imgs = [tag for tag in re.findall(r"<img\b[^>]*>", body) if 'src="data:image/png;base64,' in tag]
    alts = [re.search(r'alt="([^"]*)"', tag) for tag in imgs]
    assert len(imgs) == FIGURES["teach_vespo_kernel"] + 1 and all(a and len(a.group(1)) > 80 for a in alts)
    assert "Traceback" not in body and "Proposition 3.1" in body and "The finding." in body
    assert "<script" not in body and 'class="jupyter-widgets' not in body
    assert body.index("The finding.") < body.index("<img") and 'href="vespo_kernel.html"' in body
