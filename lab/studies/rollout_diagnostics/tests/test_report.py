"""What the rollout_diagnostics report decides and shows: decisions and headline on a smoke run's summary (and on
edited copies of it), the answer naming the log and the verdict, and the notebook's cells run in process as the
driver runs them."""
from __future__ import annotations

import ast
import copy
import json
from pathlib import Path

import pytest

from lab.studies.rollout_diagnostics import report, study

NOTEBOOK = Path(study.__file__).parent / "rollout_diagnostics.ipynb"


@pytest.fixture(scope="module")
def smoke():
    cfg = study.Config(**study.SMOKE)
    diag = study.diagnostics(cfg, progress=False)
    return cfg, diag, study.result(diag).summary


def test_decisions_name_the_corrections_that_differ_most(smoke):
    _, _, summary = smoke
    d = report.decide(summary)
    removed = {n: c["removed"] for n, c in summary["corrections"].items()}
    assert (d.mismatch, d.main) == ("mismatch", "total")
    assert removed[d.most] == max(removed.values()) and removed[d.least] == min(removed.values())
    assert d.idle == [n for n, v in removed.items() if v == 0] and not d.negligible
    line = report.headline("rollout_diagnostics", summary)
    o = summary["overall"]
    assert line.startswith(f"mean |log trainer old / sampler| {o['mismatch']['mean_abs']:.3g} per token")
    assert f"ESS {o['total']['ess_median']:.0%}" in line
    assert f"{summary['corrections'][d.most]['label']} removes {removed[d.most]:.1%}" in line


def test_headline_says_when_nothing_separates_the_corrections(smoke):
    s = copy.deepcopy(smoke[2])
    for i, c in enumerate(s["corrections"].values()):
        c.update(removed=0.1 + 0.001 * i, removed_lo=0.05, removed_hi=0.2)
    d = report.decide(s)
    assert not d.separated and d.idle == [] and report.headline("x", s).endswith("(intervals overlap)")
    for c in s["corrections"].values():
        c.update(removed=0.001, removed_lo=0.0, removed_hi=0.002)
    assert report.decide(s).negligible and "no correction removes as much as 0.5%" in report.headline("x", s)
    s["pairs"] = ["mismatch"]  # a log without current log-probs: everything on trainer/sampler
    assert (report.decide(s).main, report.decide(s).mismatch) == ("mismatch", "mismatch")


def test_the_answer_names_the_log_and_gives_the_verdict(smoke):
    cfg, _, summary = smoke
    md = " ".join(report.answer(summary, cfg).split())
    assert md.startswith("Log: a simulated asynchronous run (bfloat16 sampler, float32 trainer); 1,")
    assert "**old_logp** = trainer (float32)" in md and all(f"- {line}" in md for line in summary["verdict"])
    given = study.Config(log_path="runs/x/rollout_log")
    assert "Log: lab log `runs/x/rollout_log`;" in report.answer(summary, given)


def test_notebook_runs_as_the_driver_runs_it(smoke, tmp_path, monkeypatch):
    """The parameters cell holds only out_dir; the smoke values are injected after it as the driver does, and every
    code cell runs here in process: the run folder has every table, the verdict matches, six figures and seven
    tables are shown."""
    import matplotlib
    import pandas as pd

    matplotlib.use("Agg")
    nb = json.loads(NOTEBOOK.read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    params = [c for c in code if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(params) == 1 and "".join(params[0]["source"]).startswith("out_dir = None")
    out = tmp_path / "run"
    monkeypatch.chdir(Path(study.__file__).parents[3])
    ns: dict = {}
    shown = []
    for cell in code:  # as Jupyter runs a cell: the statements, then the value of a last expression is shown
        body = ast.parse("".join(cell["source"]).replace("%matplotlib inline", "")).body
        last = body.pop() if body and isinstance(body[-1], ast.Expr) else None
        exec(compile(ast.Module(body, []), NOTEBOOK.name, "exec"), ns)
        if last is not None:
            shown.append(eval(compile(ast.Expression(last.value), NOTEBOOK.name, "eval"), ns))
        if cell is params[0]:
            ns.update(study.SMOKE, out_dir=str(out))
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "results.parquet", "summary.json", "corrections.parquet", "dashboards.parquet"} <= files
    summary = json.loads((out / "summary.json").read_text())
    assert summary["verdict"] == smoke[2]["verdict"] == ns["diag"].verdict
    assert json.loads((out / "config.json").read_text())["simulate_steps"] == 3
    assert len([x for x in shown if isinstance(x, matplotlib.figure.Figure)]) == 6
    assert len([x for x in shown if isinstance(x, pd.io.formats.style.Styler)]) == 7
