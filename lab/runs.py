"""Run folders: config.json (resolved config, seed, versions, git revision), results.parquet, summary.json.

Every folder the lab writes (run folders, report folders, sweep cells) goes through ``atomic_dir``: it is built
in a hidden sibling folder that is renamed into place at the end, so an interrupted or failed run leaves nothing
half-written. An existing run folder is replaced; any other existing, non-empty path is refused.
"""
from __future__ import annotations

import json
import math
import os
import platform
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import pandas as pd

from lab.errors import LabError

RUN_FILES = ("config.json", "results.parquet", "summary.json")


def cache_dir() -> Path:
    """The per-user cache folder, outside any repository: $LAB_CACHE_DIR, else $XDG_CACHE_HOME/offpolicy-lab, else
    ~/.cache/offpolicy-lab (model checkpoints, the notebooks of failed reports)."""
    if os.environ.get("LAB_CACHE_DIR"):
        return Path(os.environ["LAB_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "offpolicy-lab"


def package_versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "numpy", "scipy", "pandas", "pyarrow", "matplotlib", "papermill", "offpolicy-variance-lab"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def git_revision() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def _jsonable(obj):
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(_jsonable(obj), indent=2, sort_keys=False) + "\n")


def check_out_dir(out: Path, marker: str = "config.json") -> None:
    """Refuse, before any work starts, an output path that exists and is not a run folder (one holding ``marker``),
    or one that cannot be written (a parent that is a file, a read-only place, a name too long)."""
    out = Path(out)
    check_writable(out)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / marker).exists())):
        raise LabError(f"output path {out} exists and is not a run folder; choose another --out")


def check_writable(out: Path) -> None:
    """Create and remove a hidden sibling of ``out`` (and the parents this makes): LabError if that fails."""
    out, made = Path(out).absolute(), []
    try:
        made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=f".{out.name[:200]}.", dir=out.parent))
        probe.rmdir()
        os.stat(out.parent)
        if len(out.name.encode()) > os.pathconf(out.parent, "PC_NAME_MAX"):
            raise OSError(36, "file name too long")
    except OSError as e:
        raise LabError(f"cannot write to {out} ({e.strerror or e}); choose another --out") from None
    finally:
        remove_empty(made)


@contextmanager
def atomic_dir(dest: Path):
    """Yield a hidden staging folder beside ``dest`` (mode 0755); on success it is renamed onto ``dest`` (an
    existing ``dest`` is swapped out), on any failure it is removed with the parent folders this call created."""
    dest = Path(dest)
    made = [p for p in (dest.parent, *dest.parent.parents) if not p.exists()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; results are for reading
        yield tmp
        replace_dir(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_empty(made)
        raise


def write_run(out: Path, config: dict, results: pd.DataFrame, summary: dict, extra: dict | None = None) -> Path:
    """Write a run folder atomically; ``extra`` maps file names to callables writing them (given the path)."""
    out = Path(out)
    check_out_dir(out)
    with atomic_dir(out) as tmp:
        write_json(tmp / "config.json", {**config, "versions": package_versions(), "git_revision": git_revision()})
        results.to_parquet(tmp / "results.parquet", index=False)
        write_json(tmp / "summary.json", summary)
        for name, writer in (extra or {}).items():
            writer(tmp / name)
    return out


def remove_empty(folders) -> None:
    """Remove the folders this process created, innermost first, where they are still empty (another process or
    thread may have started using one meanwhile)."""
    for p in folders:
        try:
            p.rmdir()
        except OSError:
            return


def replace_dir(src: Path, dest: Path) -> None:
    """Move ``src`` to ``dest``, swapping out an existing ``dest`` (renames only, on one file system)."""
    if dest.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old.", dir=dest.parent))
        os.replace(dest, old / "previous")
        os.replace(src, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dest)
