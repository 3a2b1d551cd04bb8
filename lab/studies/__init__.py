"""Studies: each module has a ``Config`` dataclass (a docstring per field) and ``run(config) -> StudyResult``, a
(results, summary) pair: a tidy results table and a JSON-ready summary. Computation only; figures and answer text
live in ``lab.reports.<study>`` and read the summary (and the tidy table for figures)."""
from __future__ import annotations

from typing import NamedTuple

import pandas as pd


class StudyResult(NamedTuple):
    results: pd.DataFrame  # tidy rows
    summary: dict  # headline numbers, JSON-ready
