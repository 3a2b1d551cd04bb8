"""Framework dumps -> neutral rollout logs, through one registry.

Each entry of ``ADAPTERS`` says what ``lab diagnose --from NAME`` reads (``reads``), how to recognise such a dump
(``detect(path) -> bool``), which log-prob columns its neutral log holds (``logp``: the meta.json descriptions, None
for a column it lacks), and the converter module (``module``, whose ``convert(path, out, *, trust, sampling)``
writes the neutral log atomically). ``lab`` is the neutral format itself (no converter). The command's ``--from``
choices, the report notebook and docs/rollout-logs.md read this table; adding a framework is one entry here and
one module (see docs/rollout-logs.md, "Add a log adapter").
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from lab.errors import LabError


@dataclass(frozen=True)
class Adapter:
    name: str
    reads: str
    module: str | None  # lab.diagnose.adapters.<module>, None for the neutral format
    detect: Callable[[Path], bool]

    def load(self):
        if self.module is None:
            raise LabError(f"--from {self.name} reads a neutral log as it is; it has no converter")
        return importlib.import_module(f"lab.diagnose.adapters.{self.module}")

    @property
    def logp(self) -> dict | None:
        """The log-prob columns the converted log declares (None for the neutral format: read from its meta)."""
        return None if self.module is None else self.load().LOGP

    def convert(self, path, out, *, trust: bool = False, sampling: dict | None = None) -> Path:
        return Path(self.load().convert(path, out, trust=trust, sampling=sampling))


def _has(path: Path, *patterns: str) -> bool:
    path = Path(path)
    if path.is_file():
        return any(path.match(p.rsplit("/", 1)[-1]) for p in patterns)
    return path.is_dir() and any(next(path.glob(p), None) is not None for p in patterns)


ADAPTERS: dict[str, Adapter] = {a.name: a for a in (
    Adapter("lab", "a neutral rollout-log folder (tokens.parquet, sequences.parquet, meta.json)", None,
            lambda p: Path(p, "meta.json").is_file() and Path(p, "tokens.parquet").is_file()),
    Adapter("prime-rl", "prime-rl trainer token exports (trainer.enable_token_export: "
                        "token_exports/step_N/rank_R.jsonl)", "prime_rl",
            lambda p: _has(p, "rank_*.jsonl", "token_exports", "*/token_exports", "step_*/rank_*.jsonl")),
    Adapter("slime", "slime --dump-details DIR or --save-debug-train-data files ({rollout_id}.pt, "
                     "{rollout_id}_{rank}.pt) with rollout_data/ beside them", "slime",
            lambda p: _has(p, "train_data", "rollout_data", "*.pt")),
    Adapter("skyrl", "SkyRL trainer.dump_data_batch pickles (dumped_data/global_step_N_training_input.pkl)",
            "skyrl", lambda p: _has(p, "*_training_input.pkl", "dumped_data")),
    Adapter("nemo-rl", "NeMo-RL training-data logs (train_data_step<N>.jsonl in the log directory or its "
                       "exp_<NNN> folders)", "nemo_rl",
            lambda p: _has(p, "train_data_step*.jsonl", "*/train_data_step*.jsonl")),
)}
FORMATS = tuple(ADAPTERS)


def adapter(name: str) -> Adapter:
    """The registry entry for ``--from NAME``; one LabError listing the choices otherwise."""
    try:
        return ADAPTERS[name]
    except (KeyError, TypeError):
        raise LabError(f"unknown log format {name!r} for --from; known formats: {', '.join(FORMATS)}") from None


def detect(path) -> list[str]:
    """Names of the adapters whose ``detect`` recognises ``path`` (for the error message of a wrong --from)."""
    out = []
    for a in ADAPTERS.values():
        try:
            if a.detect(Path(path)):
                out.append(a.name)
        except OSError:
            pass
    return out


def convert(fmt: str, path, out, *, trust: bool = False, sampling: dict | None = None) -> Path:
    """Write the neutral log of the ``fmt`` dump at ``path`` to ``out`` (atomically) and return ``out``."""
    return adapter(fmt).convert(path, out, trust=trust, sampling=sampling)


__all__ = ["ADAPTERS", "Adapter", "FORMATS", "adapter", "convert", "detect"]
