"""Run a trainer's own loss functions from its installed source, without importing its package.

AReaL's and SkyRL's packages import a distributed runtime at package level (``areal/__init__.py`` starts its
infrastructure, ``skyrl/backends/__init__.py`` its backends), which does not install on a CPU test machine; SkyRL
0.4.0 also declares Python >= 3.12 while its loss modules run on 3.11 (``.ci/run`` installs both wheels with
``--no-deps``, SkyRL with ``--ignore-requires-python``). ``load`` finds a module's file with
``importlib.util.find_spec`` (which does not run the package's ``__init__``), runs the module's import statements
where they succeed (the rest are left out: a function that needs one fails with NameError, visibly), and executes the
named top-level definitions exactly as the file writes them, decorators on functions aside (registry decorators,
which only record the function). The code under test is the trainer's own. ``load(..., module_name=...)`` defines
them in a module of that name (a pickle names a class by its module), and ``methods`` takes functions from a class
body the same way (a method called with a stand-in ``self`` that carries what the method reads).
"""
from __future__ import annotations

import ast
import importlib.util
import sys
import types
from pathlib import Path

import pytest


def source_file(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed (see .ci/run: pip install --no-deps)")
    path = Path(spec.submodule_search_locations[0]) / relative
    if not path.is_file():
        pytest.skip(f"{package} has no {relative}")
    return path


def _name(node) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
        return node.targets[0].id
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return node.target.id
    return None


def _module(package: str, relative: str, namespace: dict | None, module_name: str | None):
    path = source_file(package, relative)
    tree = ast.parse(path.read_text(), filename=str(path))
    module = types.ModuleType(module_name or f"shipped_{package}_{relative.replace('/', '_').removesuffix('.py')}")
    sys.modules[module.__name__] = module  # dataclasses (and pickle) look their module up by name
    ns = module.__dict__
    ns.update(namespace or {})

    def run(node):
        exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), ns)

    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            try:
                run(node)
            except Exception:  # noqa: BLE001 - a heavy import the functions under test do not need
                pass
    return tree, ns, run


def load(package: str, relative: str, names=None, namespace: dict | None = None,
         module_name: str | None = None) -> dict:
    """The module's namespace with ``names`` (every top-level definition when None) defined from its source, in a
    module registered in ``sys.modules`` as ``module_name`` (the caller removes it) or a private ``shipped_`` name."""
    tree, ns, run = _module(package, relative, namespace, module_name)
    wanted = None if names is None else set(names)
    for node in tree.body:
        name = _name(node)
        if name is None or (wanted is not None and name not in wanted):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.decorator_list = []
        run(node)
    missing = (wanted or set()) - set(ns)
    assert not missing, f"{relative} defines no {sorted(missing)}"
    return ns


def methods(package: str, relative: str, cls: str, names, namespace: dict | None = None) -> dict:
    """Methods ``names`` of class ``cls`` as plain functions, defined from the source in the module's namespace (its
    imports where they succeed, then ``namespace``); each is called with ``self`` passed explicitly."""
    tree, ns, run = _module(package, relative, namespace, None)
    (body,) = [n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls] or [None]
    assert body is not None, f"{relative} defines no class {cls}"
    out = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            node.decorator_list = []
            run(node)
            out[node.name] = ns.pop(node.name)
    missing = set(names) - set(out)
    assert not missing, f"{relative}: {cls} defines no {sorted(missing)}"
    return out


def permutation_keys(candidates, seed: int):
    """Selection keys under which the lab's Clip-Cov chooses what verl's and SkyRL's ``torch.randperm`` chooses under
    ``torch.manual_seed(seed)``: the candidates are listed in row-major order (torch.nonzero) and the one at list
    position perm[j] gets key j. Returns (keys with the candidates' shape, the number of candidates)."""
    import torch

    positions = torch.nonzero(candidates.reshape(-1))[:, 0]
    torch.manual_seed(seed)
    perm = torch.randperm(len(positions))
    keys = torch.full((candidates.numel(),), 1e9, dtype=torch.float64)
    keys[positions[perm]] = torch.arange(len(positions), dtype=torch.float64)
    return keys.reshape(candidates.shape), len(positions)
