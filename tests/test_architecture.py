"""The layout's rules, checked on the source and by adding a study:

- the core (engine, policies, estimators) never imports a study, a report, the lessons or the command line;
- a study's computation (``study.py``) never imports report code, the lessons or the command line;
- top-level imports form no cycle;
- every study folder has the one shape (STUDY, Config typed and documented, SMOKE, Summary, run, report.headline,
  a notebook per report, tests), and nothing outside a study's folder names it: a study added as one folder (here
  from outside the repository, through LAB_STUDIES_PATH) is listed, runs from `lab study`, and builds its report.
"""
import ast
import dataclasses
import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from lab.studies import StudyResult, studies

ROOT = Path(__file__).resolve().parents[1]
CORE = ("lab.engine", "lab.policies", "lab.estimators")
LAB = Path(sys.executable).parent / "lab"


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted((ROOT / "lab").rglob("*.py")):
        if "tests" in p.relative_to(ROOT).parts:
            continue
        name = ".".join(p.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = p
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> tuple[set, set]:
    """(module-level imports, imports inside functions) of lab modules, resolved to module names."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top, inner = set(), set()
    body = set(map(id, ast.walk(ast.Module(body=[s for s in tree.body if not isinstance(
        s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))], type_ignores=[]))))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for n in names:
            while n and n not in MODULES:
                n = n.rpartition(".")[0]
            if n and n != name:
                (top if id(node) in body else inner).add(n)
    return top, inner


IMPORTS = {name: _imports(name, path) for name, path in MODULES.items()}


def test_the_core_never_imports_studies_reports_lessons_or_the_command_line():
    wrong = [f"{m} -> {t}" for m, (top, inner) in IMPORTS.items() if m.startswith(CORE)
             for t in top | inner if t.startswith(("lab.studies", "lab.reports", "lab.cli", "lab.teach"))]
    assert wrong == []


def test_a_studys_computation_never_imports_report_code():
    wrong = [f"{m} -> {t}" for m, (top, inner) in IMPORTS.items()
             if m.startswith("lab.studies.") and not m.endswith((".report", ".figures")) and ".report" not in m
             for t in top | inner if t.startswith(("lab.reports", "lab.cli", "lab.teach")) or t.endswith(".report")]
    assert wrong == []


def test_module_level_imports_form_no_cycle():
    graph = {m: {t for t in top if not m.startswith(t + ".")} for m, (top, _) in IMPORTS.items()}  # a parent package
    state, cycles = {}, []                                                                           # is not a cycle

    def visit(m, stack):
        state[m] = "open"
        for t in graph.get(m, ()):
            if state.get(t) == "open":
                cycles.append(stack[stack.index(t):] + [t])
            elif t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert cycles == []


STUDIES = studies()


def test_studies_are_found():
    assert "variance" in STUDIES and len(STUDIES) >= 1


def _documented(cls) -> list[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body
    return [s.target.id for i, s in enumerate(body) if isinstance(s, ast.AnnAssign)
            and not (i + 1 < len(body) and isinstance(body[i + 1], ast.Expr)
                     and isinstance(body[i + 1].value, ast.Constant) and isinstance(body[i + 1].value.value, str))]


@pytest.mark.parametrize("name", sorted(STUDIES))
def test_each_study_folder_has_the_one_shape(name):
    study = STUDIES[name]
    mod = importlib.import_module(f"lab.studies.{name}.study")
    assert dataclasses.is_dataclass(mod.Config) and _documented(mod.Config) == [], f"{name}: undocumented fields"
    assert dataclasses.is_dataclass(mod.Summary), f"{name}: no typed Summary"
    assert isinstance(mod.SMOKE, dict) and set(mod.SMOKE) <= {f.name for f in dataclasses.fields(mod.Config)}
    sig = inspect.signature(mod.run)
    assert list(sig.parameters)[0] in ("cfg", "config") and sig.return_annotation in (StudyResult, "StudyResult")
    report = importlib.import_module(f"lab.studies.{name}.report")
    assert callable(report.headline) and list(inspect.signature(report.headline).parameters) == ["name", "summary"]
    assert study.reports and all(r.name.startswith(name) for r in study.reports)
    assert all((study.folder / f"{r.name}.ipynb").exists() for r in study.reports)
    assert list((study.folder / "tests").glob("test_*.py")), f"{name}: no tests in its folder"
    assert not (ROOT / "notebooks" / f"{name}.ipynb").exists()
    assert not (ROOT / "lab" / "reports" / f"{name}.py").exists()


def test_no_module_outside_a_study_lists_it():
    """The driver, the catalog, the command line and the shared test fixtures discover studies: none imports one or
    names its module or folder."""
    shared = [*(ROOT / "lab" / "reports").glob("*.py"), ROOT / "lab" / "cli.py", ROOT / "conftest.py",
              ROOT / "lab" / "studies" / "__init__.py", ROOT / "Makefile", ROOT / ".ci" / "run"]
    wrong = []
    for path in shared:
        text = path.read_text()
        for name in STUDIES:
            if re.search(rf"lab[./]studies[./]{name}\b", text):
                wrong.append((path.name, name))
    assert wrong == []


PROBE = {
    "__init__.py": '''
        """A probe study: one folder, nothing else touched."""
        from lab.studies import Report, Study

        STUDY = Study("probe", rank=1000, reports=(Report("probe", "A study added as one folder.",
                                                          smoke={"n": 3}),))
        ''',
    "study.py": '''
        """The probe's computation: the squares of 0..n-1."""
        from dataclasses import asdict, dataclass

        import pandas as pd

        from lab.configs import check_types
        from lab.studies import StudyResult
        from lab.typed import knob

        SMOKE = {"n": 3}


        @dataclass
        class Config:
            n: int = knob(5, ge=1, le=1000)
            """how many squares"""

            def validate(self) -> None:
                check_types(self)


        @dataclass
        class Summary:
            total: int


        def run(config: Config, progress: bool | None = None) -> StudyResult:
            config.validate()
            rows = [{"i": i, "square": i * i} for i in range(config.n)]
            return StudyResult(pd.DataFrame(rows), asdict(Summary(sum(r["square"] for r in rows))))
        ''',
    "report.py": '''
        def headline(name, summary):
            return f"the squares add up to {summary['total']}"
        ''',
}
NOTEBOOK = {"cells": [
    {"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["# Probe"]},
    {"cell_type": "code", "id": "b", "metadata": {"tags": ["parameters"]}, "execution_count": None, "outputs": [],
     "source": ["out_dir = None  # set by the driver"]},
    {"cell_type": "code", "id": "c", "metadata": {}, "execution_count": None, "outputs": [],
     "source": ["from lab.runs import write_run\n", "from lab.studies import from_parameters\n",
                "from lab.studies.probe import study\n", "cfg = from_parameters(study.Config, globals())\n",
                "results, summary = study.run(cfg)\n", "if out_dir:\n",
                "    write_run(out_dir, {'n': cfg.n}, results, summary)\n", "results"]}],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
    "nbformat": 4, "nbformat_minor": 5}


@pytest.mark.slow
def test_a_study_is_added_as_one_folder(tmp_path):
    folder = tmp_path / "studies" / "probe"
    (folder / "tests").mkdir(parents=True)
    for name, text in PROBE.items():
        (folder / name).write_text(textwrap.dedent(text).lstrip())
    (folder / "probe.ipynb").write_text(json.dumps(NOTEBOOK))
    env = {**os.environ, "LAB_STUDIES_PATH": str(tmp_path / "studies"), "LAB_QUIET": "1"}

    def lab(*args):
        return subprocess.run([str(LAB), *args], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)

    listed = lab("report", "probe", "--params")
    assert listed.returncode == 0 and listed.stdout.split()[:3] == ["n", "a", "whole"], listed.stderr
    ran = lab("study", "probe", "--n", "4", "--out", "run")
    assert ran.returncode == 0 and json.loads((tmp_path / "run" / "summary.json").read_text()) == {"total": 14}
    built = lab("report", "probe", "-p", "n=6", "--out", "reports")
    assert built.returncode == 0, built.stderr
    assert json.loads((tmp_path / "reports" / "probe" / "summary.json").read_text()) == {"total": 55}
    assert "the squares add up to 55" in (tmp_path / "reports" / "index.html").read_text()
    refused = lab("report", "probe", "-p", "n=0")
    assert refused.returncode == 2 and "parameter n must be >= 1" in refused.stderr
