"""Modules imported on first use, so that listing commands (`lab --help`, `lab envs`, `lab estimators`) answer
without loading torch or scipy (about a second each). ``from lab.lazy import torch`` gives an object that behaves
as the torch module: the first attribute read imports it. Only for modules whose top level merely names torch in
definitions (function bodies, annotations); a module that calls torch at import time imports it then."""
from __future__ import annotations

import importlib
import types


class LazyModule(types.ModuleType):
    """A stand-in for module ``name`` that imports it on the first attribute access."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__dict__["_lazy_name"] = name

    def _load(self):
        module = importlib.import_module(self.__dict__["_lazy_name"])
        self.__dict__.update(module.__dict__)
        return module

    def __getattr__(self, attr):
        return getattr(self._load(), attr)

    def __dir__(self):
        return dir(self._load())


torch = LazyModule("torch")
F = LazyModule("torch.nn.functional")
