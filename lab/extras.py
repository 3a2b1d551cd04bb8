"""Optional parts of the lab and the packages they need: ``pip install offpolicy-variance-lab`` gives the core
(estimators, the engine, `lab variance`, `lab train`, `lab sweep`, `lab diagnose`); the extras add the rest
(``[all]`` gives everything; `make` installs it). ``require(extra)`` says in one line what to install."""
from __future__ import annotations

import importlib.util

from lab.errors import LabError

EXTRAS = {  # extra: (what it is for, the modules it brings)
    "reports": ("report notebooks (`lab report`)", ("papermill", "nbconvert", "nbformat", "matplotlib", "jinja2",
                                                    "bs4", "ipykernel")),
    "teach": ("the lessons' live controls and static pages", ("bokeh", "ipywidgets")),
    "hf": ("Hugging Face checkpoints (policy hf, the mismatch study's pretrained LM)", ("transformers", "gguf")),
    "ray": ("the Ray executor of `lab sweep`", ("ray",)),
}


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def missing(extra: str) -> list[str]:
    return [m for m in EXTRAS[extra][1] if _absent(m)]


def require(*extras: str) -> None:
    """LabError naming the pip command when a module of these extras is not installed."""
    gone = [e for e in extras if missing(e)]
    if gone:
        what = "; ".join(f"{EXTRAS[e][0]} need {', '.join(missing(e))}" for e in gone)
        raise LabError(f"{what}: pip install 'offpolicy-variance-lab[{','.join(gone)}]' (or `make setup` for all)")
