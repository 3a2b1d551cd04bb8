"""Progress bars: tqdm on stderr when stderr is a terminal; quiet when it is not (a pipe, a file, a caller capturing
the output: its only lines are the command's own, e.g. the one error line of bad input), under CI (env ``CI``) or
when ``LAB_QUIET`` is set.

The environment is read here only; every long loop calls ``bar(...)`` and may force it off with ``enabled=False``.
"""
from __future__ import annotations

import os
import sys

from tqdm import tqdm


def quiet() -> bool:
    if os.environ.get("CI") or os.environ.get("LAB_QUIET"):
        return True
    isatty = getattr(sys.stderr, "isatty", None)
    return not (isatty is not None and isatty())


def bar(total: int, desc: str, enabled: bool | None = None, **kw) -> tqdm:
    """A tqdm bar; ``enabled=None`` follows the environment, False always hides it."""
    return tqdm(total=total, desc=desc, disable=quiet() or enabled is False, **kw)


def close_all() -> None:
    """Close every open bar (their last line goes out now), so that an error printed next is the last line."""
    for b in list(getattr(tqdm, "_instances", ())):
        b.close()
