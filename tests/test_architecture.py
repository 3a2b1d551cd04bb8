"""The layout's rules, checked on the source: the core (engine, policies, estimators) never imports a study, a
report or the command line; studies never import reports; top-level imports form no cycle; every study has the one
shape (a ``Config`` dataclass with a docstring per field, ``run(config) -> StudyResult``)."""
import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest

from lab.studies import StudyResult

ROOT = Path(__file__).resolve().parents[1]
CORE = ("lab.engine", "lab.policies", "lab.estimators")


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted((ROOT / "lab").rglob("*.py")):
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


def test_the_core_never_imports_studies_reports_or_the_command_line():
    wrong = [f"{m} -> {t}" for m, (top, inner) in IMPORTS.items() if m.startswith(CORE)
             for t in top | inner if t.startswith(("lab.studies", "lab.reports", "lab.cli", "lab.teach"))]
    assert wrong == []


def test_studies_never_import_reports():
    wrong = [f"{m} -> {t}" for m, (top, inner) in IMPORTS.items() if m.startswith("lab.studies")
             for t in top | inner if t.startswith(("lab.reports", "lab.cli", "lab.teach"))]
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


STUDIES = sorted(m for m in MODULES if m.startswith("lab.studies.") and inspect.getsource(
    importlib.import_module(m)).count("def run(") == 1 and hasattr(importlib.import_module(m), "Config"))


def test_every_study_module_is_found():
    assert len(STUDIES) >= 9


@pytest.mark.parametrize("name", STUDIES)
def test_each_study_has_one_shape(name):
    mod = importlib.import_module(name)
    assert dataclasses.is_dataclass(mod.Config)
    tree = ast.parse(inspect.getsource(mod.Config))
    body = tree.body[0].body
    undocumented = [s.target.id for i, s in enumerate(body) if isinstance(s, ast.AnnAssign)
                    and not (i + 1 < len(body) and isinstance(body[i + 1], ast.Expr)
                             and isinstance(body[i + 1].value, ast.Constant) and isinstance(body[i + 1].value.value, str))]
    assert undocumented == [], f"{name}.Config fields without a docstring"
    params = list(inspect.signature(mod.run).parameters)
    assert params[0] in ("cfg", "config") and inspect.signature(mod.run).return_annotation in (StudyResult, "StudyResult")
