"""Run folders and what the lab may write: config.json (resolved config, seed, versions, git revision),
results.parquet, summary.json, built atomically and owned by a marker.

Ownership. Every folder the lab writes (run folders, sweep folders, report folders, converted logs) holds a marker
file ``.lab`` (JSON: the owner, the folder's kind, a run id). The lab replaces or cleans only what carries its
marker: an existing output folder without it (a model folder that happens to hold a ``config.json``, a user's
project) is refused with one line; an empty folder is taken. Files the lab writes into folders it does not own (the
gallery's ``index.html``, a lesson page) carry the marker text ``FILE_MARK`` and are replaced only then.

Atomicity. A folder is built in a hidden staging sibling ``.NAME.lab-XXXXXXXX`` (an unpredictable name, created
exclusively) whose marker records the building process (pid and start time), then renamed into place; an existing
destination is swapped out by renames. A failure removes the staging folder; a process killed with kill -9 leaves
it, and the next run writing the same destination removes it once its process is gone. Files are written to an
exclusively created temporary name (``.NAME.lab-PID.START.XXXXXX``) and renamed, so a planted symbolic link is never
written through; a temporary file of a killed process is removed likewise, where the lab owns it.
"""
from __future__ import annotations

import errno
import json
import math
import os
import platform
import shutil
import subprocess
import tempfile
import time
import uuid
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

import pandas as pd

from lab.errors import LabError

RUN_FILES = ("config.json", "results.parquet", "summary.json")
MARKER = ".lab"
OWNER = "offpolicy-variance-lab"
FILE_MARK = '<meta name="generator" content="offpolicy-variance-lab">'
STAGING = ".lab-"  # infix of staging folders and temporary files: .NAME.lab-XXXXXXXX


def cache_dir() -> Path:
    """The per-user cache folder, outside any repository: $LAB_CACHE_DIR, else $XDG_CACHE_HOME/offpolicy-lab, else
    ~/.cache/offpolicy-lab (model checkpoints, the notebooks of failed reports)."""
    if os.environ.get("LAB_CACHE_DIR"):
        return Path(os.environ["LAB_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "offpolicy-lab"


def check_cache_dir() -> Path:
    """The cache folder, created if needed; LabError (one line) if it is a file or cannot be written, so that a
    command finds out before it trains anything it would cache."""
    folder = cache_dir()
    where = "LAB_CACHE_DIR" if os.environ.get("LAB_CACHE_DIR") else "the cache folder"
    blocker = next((p for p in (folder, *folder.parents) if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        raise LabError(f"{where} {folder} cannot be used: {blocker} is a file, not a folder; point LAB_CACHE_DIR at a "
                       f"writable folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f"{STAGING}probe-", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise LabError(f"{where} {folder} cannot be used ({e.strerror or e}); point LAB_CACHE_DIR at a writable "
                       f"folder") from None
    return folder


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


def jsonable(obj):
    """``obj`` as plain JSON data: numpy scalars as Python numbers, non-finite floats as null."""
    if hasattr(obj, "dtype") and getattr(obj, "ndim", None) == 0 and hasattr(obj, "item"):  # a numpy scalar
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def write_json(path: Path, obj) -> None:
    """Write JSON into a file of a folder the lab is building (a staging folder)."""
    Path(path).write_text(json.dumps(jsonable(obj), indent=2, sort_keys=False) + "\n")


# ------------------------------------------------------------------------------------------------ ownership
def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, from /proc), None where /proc has no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()
    return None if fields[0] in ("Z", "X") else fields[19]  # a zombie has exited


def process_alive(pid: int, start: str | None) -> bool:
    """Whether the process that wrote a marker still runs (pid and start time, so a reused pid does not count)."""
    if Path("/proc/self/stat").exists():
        now = _start_time(pid)
        return now is not None and (start is None or now == start)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def marker(kind: str, staging: bool = False) -> dict:
    return {"owner": OWNER, "kind": kind, "id": uuid.uuid4().hex, "staging": staging, "pid": os.getpid(),
            "start": _start_time(os.getpid()), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}


def read_marker(folder: Path) -> dict | None:
    """The folder's marker, or None if it has none (a symbolic link or a foreign file does not count)."""
    path = Path(folder) / MARKER
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > 4096:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("owner") == OWNER else None


def owned(folder: Path, kinds=None) -> bool:
    """Whether the lab wrote ``folder`` (a finished one, of one of ``kinds`` when given)."""
    m = read_marker(folder)
    return m is not None and not m.get("staging") and (kinds is None or m.get("kind") in kinds)


def _mark(folder: Path, kind: str, staging: bool) -> None:
    (Path(folder) / MARKER).write_text(json.dumps(marker(kind, staging)) + "\n")


def check_out_dir(out: Path, kind: str = "run", what: str = "--out") -> None:
    """Refuse, before any work, an output path the lab may not replace: a file, a symbolic link, or a non-empty
    folder without the lab's marker of this kind; or one that cannot be written (a parent that is a file, a
    read-only place, a name too long)."""
    out = Path(out)
    check_writable(out, what)
    if out.is_symlink():
        raise LabError(f"{what} {out} is a symbolic link; give the folder itself")
    if out.exists():
        if not out.is_dir():
            raise LabError(f"{what} {out} is a file; choose another {what}")
        if any(out.iterdir()) and not owned(out, {kind}):
            raise LabError(f"{what} {out} is a folder the lab did not write (it has no {MARKER} marker of a {kind} "
                           f"folder); choose another {what}, or empty it yourself")


def check_writable(out: Path, what: str = "--out") -> None:
    """Create and remove a hidden sibling of ``out`` (and the parents this makes): LabError if that fails."""
    out, made = Path(out).absolute(), []
    try:
        blocker = next((a for a in out.parents if a.exists() and not a.is_dir()), None)
        if blocker is not None:
            raise LabError(f"cannot write to {out}: {blocker} is a file, not a folder; choose another {what}")
        made = [p for p in (out.parent, *out.parent.parents) if not p.exists()]
        out.parent.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=f".{out.name[:200]}{STAGING}", dir=out.parent))
        probe.rmdir()
        if len(out.name.encode()) > os.pathconf(out.parent, "PC_NAME_MAX"):
            raise OSError(errno.ENAMETOOLONG, "file name too long")
    except OSError as e:
        raise LabError(f"cannot write to {out} ({e.strerror or e}); choose another {what}") from None
    finally:
        remove_empty(made)


def clean_leftovers(parent: Path, name: str | None = None) -> None:
    """Remove staging folders and temporary files for ``parent/name`` (any name: None) left by processes that are
    gone (kill -9). Only entries carrying the lab's staging marker, or its temporary files in folders it owns, are
    touched."""
    parent = Path(parent)
    if not parent.is_dir():
        return
    parent_owned = read_marker(parent) is not None
    for p in list(parent.glob(f".{name}{STAGING}*" if name else f".*{STAGING}*")):
        if p.is_symlink():
            continue
        if p.is_dir():
            m = read_marker(p)
            if m and m.get("staging") and not process_alive(int(m.get("pid", -1)), m.get("start")):
                shutil.rmtree(p, ignore_errors=True)
        elif p.is_file() and (parent_owned or _file_owned(p)):  # a temporary file: .NAME.lab-PID.START.XXXXXX
            pid, _, rest = p.name[p.name.rindex(STAGING) + len(STAGING):].partition(".")
            start = rest.partition(".")[0]
            if pid.isdigit() and not process_alive(int(pid), None if start == "None" else start):
                p.unlink(missing_ok=True)


def staging_dir(dest: Path, kind: str) -> Path:
    """A new hidden staging folder beside ``dest`` (mode 0755), marked as being built by this process."""
    dest = Path(dest)
    clean_leftovers(dest.parent, dest.name)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}{STAGING}", dir=dest.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; results are for reading
        _mark(tmp, kind, staging=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def scratch_dir(name: str) -> Path:
    """A private working folder in the system's temporary folder (``.NAME.lab-XXXXXXXX``), marked like a staging
    folder: the caller removes it, and one left by a killed process is removed by the next call for ``name``."""
    tmp = staging_dir(Path(tempfile.gettempdir()) / name, kind="scratch")
    tmp.chmod(0o700)
    return tmp


@contextmanager
def atomic_dir(dest: Path, kind: str = "run"):
    """Yield a staging folder for ``dest``; on success it is renamed onto ``dest`` (an existing ``dest``, which must
    be the lab's, is swapped out), on any failure it is removed with the parent folders this call created."""
    dest = Path(dest)
    made = [p for p in (dest.parent, *dest.parent.parents) if not p.exists()]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_dir(dest, kind)
    try:
        yield tmp
        replace_dir(tmp, dest, kind)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        remove_empty(made)
        raise


def os_error_text(e: OSError) -> str:
    """Why a write failed, in a few words ("the disk is full" for ENOSPC, also as pyarrow words it)."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    if e.errno == errno.ENOSPC or "[errno 28]" in text.lower():
        return "the disk is full"
    return e.strerror or text


def write_failed(out: Path, e: OSError) -> LabError:
    """The one line for a run folder that could not be written (its staging folder is removed by then)."""
    return LabError(f"cannot write the run folder {out} ({os_error_text(e)}); nothing was written"
                    + (" and the previous run is kept" if Path(out).exists() else "")
                    + ": free the space or choose another --out")


def write_run(out: Path, config: dict, results: pd.DataFrame, summary: dict, extra: dict | None = None) -> Path:
    """Write a run folder atomically; ``extra`` maps file names to callables writing them (given the path)."""
    out = Path(out)
    check_out_dir(out)
    try:
        with atomic_dir(out) as tmp:
            write_run_files(tmp, config, results, summary, extra)
    except OSError as e:
        raise write_failed(out, e) from None
    return out


def write_run_files(folder: Path, config: dict, results: pd.DataFrame, summary: dict,
                    extra: dict | None = None) -> None:
    """The run files into a folder being built (a staging folder)."""
    write_json(folder / "config.json", {**config, "versions": package_versions(), "git_revision": git_revision()})
    results.to_parquet(folder / "results.parquet", index=False)
    write_json(folder / "summary.json", summary)
    for name, writer in (extra or {}).items():
        writer(folder / name)


def remove_empty(folders) -> None:
    """Remove the folders this process created, innermost first, where they are still empty (another process or
    thread may have started using one meanwhile)."""
    for p in folders:
        try:
            p.rmdir()
        except OSError:
            return


def replace_dir(src: Path, dest: Path, kind: str = "run") -> None:
    """Move the staging folder ``src`` to ``dest`` (marked finished), swapping out an existing ``dest`` by renames
    on one file system. An existing non-empty ``dest`` must carry the lab's marker of this kind."""
    src, dest = Path(src), Path(dest)
    if dest.is_symlink() or (dest.exists() and (not dest.is_dir() or (any(dest.iterdir()) and
                                                                       not owned(dest, {kind})))):
        raise LabError(f"{dest} is not a {kind} folder the lab wrote; nothing was replaced")
    _mark(src, kind, staging=False)
    if dest.exists():
        old = staging_dir(dest, kind)
        os.replace(dest, old / "previous")
        os.replace(src, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dest)


def check_file(dest: Path, what: str = "--out") -> None:
    """Refuse, before any work, a file the lab may not replace: one that exists without the lab's ``FILE_MARK``, a
    symbolic link or a folder; or a place that cannot be written."""
    dest = Path(dest)
    check_writable(dest, what)
    if dest.is_symlink() or dest.is_dir() or (dest.exists() and not _file_owned(dest)):
        raise LabError(f"{dest} exists and the lab did not write it; choose another {what}")


def write_file(dest: Path, text: str, what: str = "--out") -> None:
    """Write a text file the lab owns by its ``FILE_MARK`` into a folder it may not own (``check_file`` first);
    written to an exclusively created temporary name and renamed."""
    if FILE_MARK not in text:
        raise ValueError("a file written by write_file must carry FILE_MARK")
    check_file(dest, what)
    write_atomic(Path(dest), text)


def _file_owned(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return FILE_MARK in f.read(8192)
    except OSError:
        return False


def write_atomic(dest: Path, text: str | bytes, mode: int = 0o644) -> None:
    """Write ``text`` (or bytes) to ``dest`` through an exclusively created temporary file in the same folder, then
    rename."""
    dest = Path(dest)
    clean_leftovers(dest.parent, dest.name)
    pid = os.getpid()
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}{STAGING}{pid}.{_start_time(pid)}.", dir=dest.parent)
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w", **({} if isinstance(text, bytes) else
                                                                          {"encoding": "utf-8"})) as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def exclusive_lock(path: Path, busy: str):
    """Hold an exclusive lock on the file ``path`` for the block; LabError(``busy``) at once if another process holds
    it. The lock belongs to the process that took it: only the holder removes the file (while still holding it), a
    refused attempt leaves it alone, and a lock file replaced under a waiting process is taken again."""
    import fcntl

    path = Path(path)
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise LabError(f"cannot take the lock file {path} ({e.strerror or e}); remove it if it is not the "
                           f"lab's") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LabError(busy) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path, follow_symlinks=False))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)  # the holder removed the file between our open and our lock: lock the current one
    try:
        yield
    finally:
        try:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)
