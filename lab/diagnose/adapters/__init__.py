"""Framework dumps -> neutral rollout logs. ``FORMATS`` names what ``lab diagnose --from`` accepts."""
from __future__ import annotations

from pathlib import Path

from lab.errors import LabError

FORMATS = ("lab", "prime-rl", "slime", "skyrl")


def converter(fmt: str):
    """The convert(path, out, *, trust, sampling) function for a framework format."""
    if fmt == "prime-rl":
        from lab.diagnose.adapters.prime_rl import convert
    elif fmt == "slime":
        from lab.diagnose.adapters.slime import convert
    elif fmt == "skyrl":
        from lab.diagnose.adapters.skyrl import convert
    else:
        raise LabError(f"unknown log format {fmt!r}; known formats: {', '.join(FORMATS)}")
    return convert


def convert(fmt: str, path, out, *, trust: bool = False, sampling: dict | None = None) -> Path:
    """Write the neutral log of the ``fmt`` dump at ``path`` to ``out`` (atomically) and return ``out``."""
    return Path(converter(fmt)(path, out, trust=trust, sampling=sampling))
