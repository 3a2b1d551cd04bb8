"""Report notebooks end to end: real papermill executions, the HTML export, the gallery, the CLI, and a real
headless Chromium rendering of the page."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lab import reports
from lab.reports import figures
from lab.errors import LabError

NAME = "variance"
SMALL = {"replicates": 40, "values": [0, 4]}
RUN_FILES = {"config.json", "results.parquet", "summary.json"}
LAB = Path(sys.executable).parent / "lab"


@pytest.fixture(scope="module")
def built(gallery) -> Path:
    return gallery / NAME


@pytest.fixture(scope="module")
def page(built) -> str:
    return (built / f"{NAME}.html").read_text(encoding="utf-8")


def test_report_folder_holds_notebook_html_and_run_files(built):
    assert {p.name for p in built.iterdir()} == {f"{NAME}.ipynb", f"{NAME}.html", ".lab"} | RUN_FILES
    config = json.loads((built / "config.json").read_text())
    assert config["replicates"] == 40 and config["values"] == [0, 4] and config["versions"]["papermill"]
    summary = json.loads((built / "summary.json").read_text())
    assert set(summary["best_by_mse"]) == {"0.0", "4.0"}
    results = pd.read_parquet(built / "results.parquet")
    assert set(results["staleness"]) == {0.0, 4.0} and {"mse", "ess_frac", "kl_token"} <= set(results["metric"])
    assert not [p for p in built.parent.iterdir() if p.name.startswith(".")], "staging folders left behind"


def test_html_is_self_contained_with_no_code(page):
    assert len(re.findall(r"data:image/png;base64,", page)) >= 3
    assert not re.search(r"<script[^>]*\bsrc\s*=\s*[\"']?(https?:)?//", page, re.I)
    assert not re.search(r"<link[^>]*\bhref\s*=\s*[\"']?(https?:)?//", page, re.I)
    assert "cdnjs" not in page and "cdn.jsdelivr" not in page
    assert "run_study(" not in page and "VarianceConfig(" not in page  # code inputs are hidden
    assert 'class="jp-InputPrompt' not in page and 'class="highlight' not in page
    code_cells = re.findall(r'class="jp-Cell jp-CodeCell[^"]*"', page)
    assert code_cells and all("jp-mod-noInput" in c for c in code_cells)
    assert "Traceback" not in page and 'data-mime-type="application/vnd.jupyter.stderr"' not in page  # no warnings


def test_html_answers_the_question(page):
    for text in ("The answer", "how wrong", "how noisy", "Headline table", "KL(μ‖π)/token", "ESS",
                 "reinforce", "seq_is", "token_is", "ppo_clip", "How to read this"):
        assert text in page, text


def test_gallery_index_links_each_report_with_its_headline(gallery):
    index = (gallery / "index.html").read_text(encoding="utf-8")
    assert f'href="{NAME}/{NAME}.html"' in index
    assert reports.get(NAME).description in index
    summary = json.loads((gallery / NAME / "summary.json").read_text())
    assert reports.get(NAME).headline_of(summary) in index and "lowest MSE" in index
    assert "data:image/png;base64," in index


def test_unknown_report_name_lists_known_reports(tmp_path):
    with pytest.raises(LabError, match=f"unknown report 'nope'.*{NAME}"):
        reports.run_report("nope", {}, tmp_path)
    assert reports.names() == list(reports.catalog()) and NAME in reports.names()


@pytest.mark.parametrize("key", ["replicats", "out_dir"])
def test_unknown_parameter_names_the_valid_ones(tmp_path, key):
    with pytest.raises(LabError, match=rf"unknown parameter\(s\) {key}.*valid parameters: .*replicates"):
        reports.run_report(NAME, {key: 3}, tmp_path)
    assert not any(tmp_path.iterdir())


def test_bad_input_is_refused_before_papermill(tmp_path):
    out = tmp_path / "new" / "reports"
    with pytest.raises(LabError, match=rf"^report '{NAME}': unknown env 'nope'") as err:
        reports.run_report(NAME, {**SMALL, "env": "nope"}, out)
    assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())


FAILING = {"reference": "mc", "mc_samples": 2, "replicates": 4, "values": [0]}  # fails in the study, not before


@pytest.mark.slow
def test_failed_execution_leaves_nothing(tmp_path):
    out = tmp_path / "new" / "reports"
    with pytest.raises(LabError, match=r"failed in cell \d+: LabError: .*raise --mc-samples") as err:
        reports.run_report(NAME, FAILING, out)
    assert "\n" not in str(err.value)
    assert not list(tmp_path.iterdir())


def test_failed_rebuild_keeps_the_previous_report(tmp_path, built):
    shutil.copytree(built, tmp_path / NAME)
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / NAME).iterdir()}
    with pytest.raises(LabError, match="failed in cell"):
        reports.run_report(NAME, FAILING, tmp_path)
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / NAME).iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == [NAME]


def test_refuses_to_replace_a_folder_that_is_not_a_report(tmp_path):
    (tmp_path / NAME).mkdir()
    (tmp_path / NAME / "notes.txt").write_text("mine")
    with pytest.raises(LabError, match="a folder the lab did not write"):
        reports.run_report(NAME, SMALL, tmp_path)
    assert (tmp_path / NAME / "notes.txt").read_text() == "mine"


@pytest.mark.slow
def test_cli_report(tmp_path):
    proc = subprocess.run([str(LAB), "report", NAME, "-p", "replicates=40", "-p", "values=[0,2]", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote {tmp_path / NAME}"
    assert "Traceback" not in proc.stderr and "WARNING" not in proc.stderr
    assert json.loads((tmp_path / NAME / "config.json").read_text())["values"] == [0, 2]
    assert (tmp_path / NAME / f"{NAME}.html").stat().st_size > 10_000


@pytest.mark.slow
def test_cli_bad_parameter_is_one_line(tmp_path):
    proc = subprocess.run([str(LAB), "report", NAME, "-p", "replicats=40", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: unknown parameter(s) replicats")


def test_figures_from_the_run_table(built):
    results = pd.read_parquet(built / "results.parquet")
    for fn in (figures.bias_variance_mse, figures.weight_diagnostics, figures.divergence):
        fig = fn(results)
        assert len(fig.axes) >= 2 and fig.axes[0].get_xlabel().startswith("lag")
    two = pd.concat([results, results.assign(seed=1)])
    with pytest.raises(LabError, match="several studies"):
        figures.bias_variance_mse(two)


def _chromium() -> str:
    for candidate in ("chromium", "chromium-browser", "google-chrome", "/usr/bin/chromium"):
        found = shutil.which(candidate)
        if found:
            return found
    if os.environ.get("CI"):
        pytest.fail("headless Chromium is required in CI (apt-get install chromium) but is not on PATH")
    pytest.skip("chromium not installed (apt-get install chromium); CI runs this check")


def test_html_renders_in_headless_chromium(built, tmp_path):
    browser = _chromium()
    html_file = (built / f"{NAME}.html").resolve()
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--disable-background-networking", "--disable-component-update", "--disable-sync", "--no-first-run",
             "--hide-scrollbars", f"--user-data-dir={tmp_path / 'profile'}"]
    url = html_file.as_uri()

    def chromium(*args) -> str:
        # Output to files, not pipes: Chromium's helper processes outlive it and would hold a pipe open.
        log, dom = tmp_path / "chromium.log", tmp_path / "dom.html"
        with open(dom, "w") as out, open(log, "w") as err:
            rc = subprocess.run([*flags, *args, url], stdout=out, stderr=err, timeout=120).returncode
        assert rc == 0, log.read_text()[-2000:]
        return dom.read_text()

    dom = chromium("--dump-dom")
    assert len(re.findall(r'<img[^>]+src="data:image/png;base64,', dom)) >= 3
    assert "Headline table" in dom and "lab-headline" in dom and "ppo_clip" in dom

    shot = tmp_path / "page.png"
    chromium("--window-size=1280,4200", f"--screenshot={shot}")
    assert shot.exists()
    from PIL import Image

    pixels = np.asarray(Image.open(shot).convert("RGB")).reshape(-1, 3).astype(int)
    assert len(np.unique(pixels @ np.array([1 << 16, 1 << 8, 1]))) > 50, "blank screenshot"
    colors = figures.estimator_colors(pd.read_parquet(built / "results.parquet"))
    for name, hex_color in list(colors.items())[:2]:  # the figures' line colours are on screen: images drew
        rgb = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
        assert (np.abs(pixels - rgb).max(1) < 12).sum() > 200, f"no {name} line pixels in the screenshot"


def test_gallery_pages_have_no_broken_images_links_script_errors_or_overflow(gallery, tmp_path):
    """The gallery and every report page in a real headless Chromium: nothing scrolls sideways, spills out of its box
    or is cut short with "..." (see browser.layout_problems)."""
    from browser import Browser, _chromium, layout_problems

    browser = Browser(_chromium(), tmp_path / "profile")
    try:
        pages = [gallery / "index.html"] + [gallery / n / f"{n}.html" for n in reports.names()]
        for page in pages:
            browser.open(page.as_uri(), width=1280)
            broken = browser.js("[...document.images].filter(i => !i.complete || i.naturalWidth === 0).length")
            overflow = browser.js("document.documentElement.scrollWidth - window.innerWidth")
            links = browser.js("[...document.links].map(a => a.getAttribute('href'))")
            assert broken == 0, (page, broken)
            assert overflow <= 0, (page, overflow)
            assert layout_problems(browser) == [], page
            assert browser.errors() == [], (page, browser.errors())
            missing = [h for h in links if not h.startswith(("http", "#", "data:"))
                       and not (page.parent / h).resolve().exists()]
            assert missing == [], (page, missing)
            assert browser.js("[...document.images].every(i => i.alt && i.alt.length > 3)"), page  # alt text
    finally:
        browser.close()
