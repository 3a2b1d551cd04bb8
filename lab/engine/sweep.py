"""Resumable sweeps: the Cartesian product of a grid of config fields, run on a local process pool or on Ray (one
machine or a cluster), one folder per cell.

A spec (YAML: ``name``, ``kind``, ``base``, ``grid``) gives what a cell runs (``kind``: ``train``, the RL training
simulator's ``TrainConfig``, the default; ``distill``, on-policy distillation's ``DistillConfig``; see
``CELL_KINDS``), the fields shared by every cell (``base``) and, per grid key, the values to sweep; the cells are the
product of the grid's lists, in the spec's key order. Every cell is resolved to a full config (defaults filled in,
whole numbers given for float fields made floats, in estimator hyper-parameters too) and every cell is validated
before any runs, so a typo fails in a second, not an hour in.

Layout of ``out_dir``::

    sweep.json               the spec, package versions, git revision (the latest spec run into this folder)
    cells/<cell_id>/         config.json (resolved config + versions), steps.parquet (TrainResult.table),
                             summary.json (TrainResult.summary)

``cell_id`` is the first 16 hex characters of the sha256 of the resolved config's canonical JSON, so a cell's folder
name says exactly what was run. Workers run ``train`` and send the table and summary back; the driver writes each
cell into a hidden temporary sibling (``cells/.<cell_id>.*``) and renames it into place, so a sweep killed at any
moment leaves complete cells only. Rerunning the same command skips the complete cells and runs the rest; hidden
leftovers of a killed sweep are removed first. A lock file (``out_dir/.lock``) keeps two sweeps from writing into
one folder at once. Growing a spec (more seeds, another estimator) and rerunning it into the same folder runs only
the new cells.

Executors: ``local`` is a ``concurrent.futures.ProcessPoolExecutor`` (forkserver context, ``workers`` processes,
default ``os.cpu_count()``); ``ray`` runs one Ray task (1 CPU) per cell, on a fresh local instance with
``num_cpus=workers`` (shut down at the end) or on the cluster at ``address`` (every node needs this package
installed; ``workers`` then caps the cells in flight; an instance the caller already started is used and left
running). Only the driver writes to ``out_dir``, so a cluster needs no shared file system. Workers use one torch
thread each (no oversubscription), and every cell is seeded by its own config's ``seed``, so the results do not
depend on the executor, the worker count or the order cells finish in. A tqdm bar shows cells done and the ETA
(quiet when CI or LAB_QUIET is set). A cell that fails at run time does not stop the others: the sweep finishes
what it can, then raises ``LabError`` naming the failed cells; rerun to retry them.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import multiprocessing
import os
import re
import shutil
import socket
import threading
from contextlib import closing, contextmanager
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pandas as pd
import torch

from lab.errors import LabError
from lab.inputs import MAX_BYTES, load_json, load_yaml
from lab.progress import bar
from lab.runs import (MARKER, jsonable, atomic_dir, check_out_dir, clean_leftovers, exclusive_lock, git_revision,
                      marker, os_error_text, package_versions, read_marker, remove_empty, write_atomic, write_json)

EXECUTORS = ("local", "ray")
MAX_CELLS = 10_000  # cells in one spec (each is validated before any runs)
CELL_KINDS = {  # kind: (module, config class, run function returning an object with .table and .summary)
    "train": ("lab.engine.training", "TrainConfig", "train"),  # RL training (tabular or transformer policies)
    "distill": ("lab.engine.distill", "DistillConfig", "distil"),  # on-policy distillation from a teacher
}
_RENAMED = {"final_expected_reward": "final_reward", "best_expected_reward": "best_reward",
            "first_collapse_update": "first_collapse"}


@dataclass
class SweepSpec:
    name: str  # used in logs and in sweep.json
    base: dict  # config fields shared by every cell
    grid: dict  # config field -> list of values; the cells are the Cartesian product
    kind: str = "train"  # what a cell runs: a key of CELL_KINDS


def cell_kind(kind: str):
    """(config class, run function) of a cell kind."""
    import importlib

    if kind not in CELL_KINDS:
        raise LabError(f"unknown sweep kind {kind!r}; choose one of {', '.join(CELL_KINDS)}")
    module, config_cls, run = CELL_KINDS[kind]
    mod = importlib.import_module(module)
    return getattr(mod, config_cls), getattr(mod, run)


def _fields(kind: str) -> set:
    return {f.name for f in fields(cell_kind(kind)[0])}


# ------------------------------------------------------------------------------------------------ specs
def load_spec(path) -> SweepSpec:
    """Read a YAML spec with keys ``name``, ``kind`` (optional, default train), ``base`` (optional) and ``grid``
    (plain data only, bounded: ``lab.inputs``); LabError on bad input."""
    path = Path(path)
    raw = load_yaml(path, "sweep spec")
    if not isinstance(raw, dict):
        raise LabError(f"sweep spec {path} must be a mapping with keys name, base, grid")
    unknown = sorted(set(raw) - {"name", "kind", "base", "grid"})
    if unknown:
        raise LabError(f"sweep spec {path} has unknown keys {', '.join(map(str, unknown))}; use name, kind, base, "
                       f"grid")
    spec = SweepSpec(name=raw.get("name", path.stem), base=raw.get("base") or {}, grid=raw.get("grid") or {},
                     kind=raw.get("kind", "train"))
    _check_spec(spec)
    return spec


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def _check_spec(spec: SweepSpec) -> None:
    if not isinstance(spec.name, str) or not _NAME.match(spec.name):
        raise LabError(f"a sweep's name must be a plain folder name (letters, digits, '.', '_', '-'), got "
                       f"{spec.name!r}")
    if not isinstance(spec.kind, str) or spec.kind not in CELL_KINDS:
        raise LabError(f"unknown sweep kind {spec.kind!r}; choose one of {', '.join(CELL_KINDS)}")
    config_cls = cell_kind(spec.kind)[0]
    names = _fields(spec.kind)
    for part in ("base", "grid"):
        value = getattr(spec, part)
        if not isinstance(value, dict):
            raise LabError(f"sweep {part} must be a mapping of {config_cls.__name__} fields, got "
                           f"{type(value).__name__}")
        bad = sorted(str(k) for k in value if k not in names)
        if bad:
            raise LabError(f"sweep {part} key(s) {', '.join(bad)} are not {config_cls.__name__} fields; "
                           f"see {config_cls.__module__}.{config_cls.__name__} for the fields")
    if not spec.grid:
        raise LabError("a sweep needs a grid with at least one key (e.g. grid: {seed: [0, 1]})")
    cells = 1
    for key, values in spec.grid.items():
        if not isinstance(values, list) or not values:
            raise LabError(f"grid key {key!r} must map to a non-empty list of values, got {values!r}")
        cells *= len(values)
        if cells > MAX_CELLS:
            raise LabError(f"the grid has more than {MAX_CELLS:,} cells; split the sweep into smaller specs")
    both = sorted(set(spec.base) & set(spec.grid))
    if both:
        raise LabError(f"key(s) {', '.join(both)} appear in both base and grid; keep each in one of them")


def _coerce(defaults: dict, name: str, value):
    """Whole numbers (and YAML's '1e-3' strings) given for a float field become floats: one canonical cell."""
    if isinstance(defaults[name], float) and not isinstance(value, bool) and isinstance(value, (int, str)):
        try:
            return float(value)
        except ValueError:
            return value  # validate() reports it
    return value


def resolve(config: dict, kind: str = "train") -> dict:
    """The full config dict of ``kind`` for ``config`` (defaults filled in); LabError for keys that are not fields."""
    config_cls = cell_kind(kind)[0]
    bad = sorted(str(k) for k in config if k not in _fields(kind))
    if bad:
        raise LabError(f"{', '.join(bad)} are not {config_cls.__name__} fields")
    defaults = asdict(config_cls())
    resolved = asdict(config_cls(**{k: _coerce(defaults, k, v) for k, v in config.items()}))
    if isinstance(resolved.get("hyper"), dict) and isinstance(resolved.get("estimator"), str):
        resolved["hyper"] = _hyper(resolved["estimator"], resolved["hyper"])
    return resolved


def _hyper(name: str, hyper: dict) -> dict:
    """An estimator's hyper-parameters with whole numbers given for its float ones made floats, so that
    ``{cap: 2}`` and ``{cap: 2.0}`` are one cell (an unknown estimator is left for ``validate`` to report)."""
    from lab import estimators

    try:
        defaults = estimators.info(name).defaults
    except (LabError, KeyError):
        return hyper
    return {k: float(v) if isinstance(defaults.get(k), float) and isinstance(v, int) and not isinstance(v, bool)
            else v for k, v in hyper.items()}


def _label(cell: dict, keys) -> str:
    return ", ".join(f"{k}={cell[k]!r}" for k in keys)


def expand(spec: SweepSpec) -> list[dict]:
    """One resolved config dict per cell (grid product in spec order); every cell validated up front."""
    _check_spec(spec)
    config_cls = cell_kind(spec.kind)[0]
    keys = list(spec.grid)
    cells = [resolve({**spec.base, **dict(zip(keys, combo))}, spec.kind)
             for combo in itertools.product(*spec.grid.values())]
    seen = {}
    for i, cell in enumerate(cells):
        try:
            config_cls(**cell).validate()
        except (LabError, TypeError, ValueError) as e:
            raise LabError(f"sweep cell {i} ({_label(cell, keys)}) is invalid: {e}") from None
        cid = cell_id(cell, spec.kind)
        if cid in seen:
            raise LabError(f"sweep cells {seen[cid]} and {i} are the same config; remove repeated grid values")
        seen[cid] = i
    return cells


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


# Fields added to a cell kind after sweeps of it were written: hashed only when they differ from their default, so
# that a folder written before them resumes with the same cell ids.
LATER_FIELDS = {"train": ("top_p", "top_k", "min_p", "mask_replay")}


def cell_id(config: dict, kind: str = "train") -> str:
    """First 16 hex characters of the sha256 of the resolved config's canonical JSON (a kind other than train is
    hashed with it; ``LATER_FIELDS`` at their defaults are left out)."""
    resolved = resolve(config, kind)
    defaults = asdict(cell_kind(kind)[0]())
    hashed = {k: v for k, v in resolved.items() if k not in LATER_FIELDS.get(kind, ()) or v != defaults[k]}
    text = _canonical(hashed) if kind == "train" else f"{kind}:{_canonical(hashed)}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ running
def _die_with(lifeline) -> None:
    """Worker initializer: exit as soon as the driver is gone, whatever its state. ``lifeline`` is the read end of a
    pipe whose only write end the driver holds; the kernel closes it when the driver exits (a kill -9 and a zombie
    driver included), and the read then ends. (A pid probe would take a zombie, or a reused pid, for alive.)
    Progress bars in a worker lock with a thread lock: tqdm's default interprocess lock is a named semaphore that a
    worker ended this way never releases, and the resource tracker would print a warning after the driver's last
    line."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())

    def watch():
        try:
            lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _run_cell(kind: str, config: dict) -> dict:
    """Run one cell (in a worker); errors come back as a one-line message, not an exception."""
    torch.set_num_threads(1)  # one thread per worker: no oversubscription, and the same numbers everywhere
    try:
        config_cls, run = cell_kind(kind)
        result = run(config_cls(**config), progress=False)
        return {"table": result.table, "summary": result.summary}
    except Exception as e:  # noqa: BLE001 - reported per cell by the driver
        return {"error": f"{type(e).__name__}: {e}"}


def _write_cell(cells: Path, cid: str, config: dict, out: dict, meta: dict) -> None:
    """Write one cell atomically: a hidden temporary sibling, renamed into place."""
    with atomic_dir(cells / cid, kind="cell") as tmp:
        write_json(tmp / "config.json", {**config, "cell_id": cid, **meta})
        out["table"].to_parquet(tmp / "steps.parquet", index=False)
        write_json(tmp / "summary.json", out["summary"])


def _done(cells: Path, cid: str) -> bool:
    return (cells / cid / "summary.json").is_file()


def _check_folder(out: Path, spec: SweepSpec, ids: list[str]) -> None:
    """Refuse a folder the lab did not write as a sweep folder, or one holding finished cells this spec would hide
    from its results."""
    check_out_dir(out, kind="sweep")
    finished = {p.name for p in (out / "cells").glob("[!.]*") if (p / "summary.json").is_file()} \
        if (out / "cells").is_dir() else set()
    hidden = finished - set(ids)
    if hidden:
        raise LabError(f"{len(hidden)} finished cell(s) in {out} are not in this spec and would be hidden; extend the "
                       f"spec to include them (a grown spec reruns only the new cells) or choose another --out")


@contextmanager
def _prepare(out: Path, spec: SweepSpec, meta: dict):
    """Own the folder (its marker), hold its lock, drop leftovers of killed sweeps, record the spec; yields cells/."""
    out.mkdir(parents=True, exist_ok=True)
    if read_marker(out) is None:  # a new or empty folder: the lab's from now on
        write_atomic(out / MARKER, json.dumps(marker("sweep")) + "\n")
    with exclusive_lock(out / ".lock", f"another sweep is writing to {out}; wait for it to finish or choose another "
                                       f"--out"):
        cells = out / "cells"
        cells.mkdir(exist_ok=True)
        clean_leftovers(cells)
        write_atomic(out / "sweep.json", json.dumps(
            jsonable({"name": spec.name, "kind": spec.kind, "base": spec.base, "grid": spec.grid, **meta}), indent=2)
            + "\n")
        yield cells


def _run_local(kind: str, configs: list[dict], workers: int):
    """Yield (index, output) as cells finish, on a forkserver process pool."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["lab.engine.sweep"])  # workers fork from a server that already imported torch
    lifeline, keep = ctx.Pipe(duplex=False)  # workers hold the read end, this process alone the write end
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_die_with, initargs=(lifeline,))
    finished_all = False
    try:
        futures = {pool.submit(_run_cell, kind, c): i for i, c in enumerate(configs)}
        pending = set(futures)
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in finished:
                yield futures[f], f.result()
        finished_all = True
    finally:
        if not finished_all:  # interrupted or failing: closing the lifeline ends the running cells now
            keep.close()
        pool.shutdown(wait=True, cancel_futures=True)
        keep.close()
        lifeline.close()


def _run_ray(kind: str, configs: list[dict], workers: int | None, address: str | None):
    """Yield (index, output) as cells finish, one Ray task per cell, at most ``workers`` in flight."""
    from lab.extras import require

    require("ray")
    import ray
    started = not ray.is_initialized()
    if started:
        if address:
            try:
                ray.init(address=address, log_to_driver=False)
            except Exception as e:  # noqa: BLE001 - Ray raises ConnectionError, RuntimeError, AuthenticationError
                raise LabError(f"cannot connect to the Ray cluster at {address} ({str(e).splitlines()[0]}); check "
                               f"the address (`ray status` on the head node) and, with token auth, RAY_AUTH_TOKEN") \
                    from None
        else:
            if not loopback_works():  # Ray would retry for minutes before failing
                raise LabError("a local Ray instance talks over 127.0.0.1, which does not answer here (is the loopback "
                               "interface down?); bring it up or use --executor local")
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=1)(_run_cell)
        limit = workers or len(configs)
        todo = list(enumerate(configs))
        refs = {}
        while todo or refs:
            while todo and len(refs) < limit:
                i, c = todo.pop(0)
                refs[task.remote(kind, c)] = i
            [ref], _ = ray.wait(list(refs), num_returns=1)
            yield refs.pop(ref), ray.get(ref)
    finally:
        if started:
            ray.shutdown()


def loopback_works() -> bool:
    """Whether a TCP connection to a listening socket on 127.0.0.1 succeeds (a fresh network namespace, e.g.
    ``unshare -n``, starts with its loopback interface down)."""
    try:
        with socket.socket() as server:
            server.bind(("127.0.0.1", 0))
            server.listen(1)
            socket.create_connection(server.getsockname(), timeout=2).close()
        return True
    except OSError:
        return False


def _answers(address: str) -> bool:
    """Whether a plain host:port address accepts a connection within 5 s (Ray itself retries for minutes)."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return True  # "auto", "ray://...": left to Ray
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        return True
    except OSError:
        return False


def run_sweep(spec: SweepSpec, out_dir, executor: str = "local", workers: int | None = None,
              address: str | None = None, progress: bool | None = None) -> dict:
    """Run every cell of ``spec`` not yet in ``out_dir/cells``; returns {"done", "skipped", "total"}."""
    if executor not in EXECUTORS:
        raise LabError(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise LabError(f"workers must be a positive whole number, got {workers!r}")
    if address and executor != "ray":
        raise LabError("--address is a Ray cluster address; use it with --executor ray")
    if address and not _answers(address):
        raise LabError(f"no Ray cluster answers at {address}; start one (`ray start --head`) and pass the address "
                       f"it prints")
    configs = expand(spec)
    out = Path(out_dir)
    ids = [cell_id(c, spec.kind) for c in configs]
    _check_folder(out, spec, ids)
    created = [p for p in (out.absolute(), *out.absolute().parents) if not p.exists()]  # innermost first
    meta = {"versions": package_versions(), "git_revision": git_revision()}
    failed, done, skipped, todo, failed_write = [], 0, 0, [], None
    try:
        with _prepare(out, spec, meta) as cells:
            todo = [i for i, cid in enumerate(ids) if not _done(cells, cid)]
            skipped = len(configs) - len(todo)
            with bar(len(configs), f"sweep {spec.name}", progress, initial=skipped, unit="cell") as cells_bar:
                if todo:
                    pending = [configs[i] for i in todo]
                    n = min(workers or os.cpu_count() or 1, len(todo))
                    if executor == "local":
                        stream = _run_local(spec.kind, pending, n)
                    else:  # on a cluster without --workers, Ray's own scheduling decides how many run at once
                        stream = _run_ray(spec.kind, pending, None if address and not workers else n, address)
                    with closing(stream):  # shuts the pool or Ray down now, even if writing a cell fails
                        for j, output in stream:
                            i = todo[j]
                            if "error" in output:
                                failed.append((i, output["error"]))
                            else:
                                _write_cell(cells, ids[i], configs[i], output, meta)
                                done += 1
                            cells_bar.update(1)
    except OSError as e:
        failed_write = e
    finally:
        if created and not any((out / "cells").glob("[!.]*")):  # this run made the folder and finished nothing
            shutil.rmtree(out, ignore_errors=True)
            remove_empty(created[1:])
    if failed_write is not None:
        kept = (f"the {done + skipped} finished cells are kept, rerun to resume" if out.exists() else
                "nothing was written")
        raise LabError(f"cannot write the sweep folder {out} ({os_error_text(failed_write)}); {kept}: free the "
                       f"space or choose another --out")
    if failed:
        i, err = failed[0]
        kept = (f"the {done + skipped} finished cells are saved in {out}, rerun to retry the rest" if out.exists()
                else "nothing was written")
        raise LabError(f"{len(failed)} of {len(todo)} sweep cells failed (first: cell {i}, "
                       f"{_label(configs[i], spec.grid)}: {err}); {kept}")
    return {"done": done, "skipped": skipped, "total": len(configs)}


# ------------------------------------------------------------------------------------------------ results
def _column(value):
    return _canonical(value) if isinstance(value, (dict, list)) else value


def load_results(out_dir) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(steps, runs) of the finished cells of the spec last run into ``out_dir``.

    steps: every cell's per-update table with ``cell_id`` and the spec's grid keys as the leading columns.
    runs: one row per cell: ``cell_id``, grid keys, then the summary's scalars, with ``final_reward``,
    ``best_reward``, ``first_collapse`` (1-based update, <NA> if none) and ``collapsed`` (bool).
    Dict or list grid values (e.g. ``hyper``) appear as their canonical JSON strings.
    """
    out = Path(out_dir)
    if not (out / "sweep.json").is_file():
        raise LabError(f"{out} is not a sweep folder (no sweep.json); run `lab sweep SPEC.yaml --out {out}` first")
    meta = load_json(out / "sweep.json", "sweep record", max_bytes=16 * MAX_BYTES)
    if not isinstance(meta, dict) or not {"name", "base", "grid"} <= set(meta):
        raise LabError(f"{out}/sweep.json is not a sweep record (name, base, grid); rerun the sweep into a new folder")
    spec = SweepSpec(meta["name"], meta["base"] or {}, meta["grid"] or {}, meta.get("kind", "train"))
    _check_spec(spec)  # bounded like a spec: a record edited by hand cannot expand to millions of cells
    keys = list(spec.grid)
    steps, runs = [], []
    for config in (resolve({**spec.base, **dict(zip(keys, combo))}, spec.kind)
                   for combo in itertools.product(*spec.grid.values())):
        cid = cell_id(config, spec.kind)
        folder = out / "cells" / cid
        if not (folder / "summary.json").is_file():
            continue
        grid = {"cell_id": cid, **{k: _column(config[k]) for k in keys}}
        table = pd.read_parquet(folder / "steps.parquet")
        table = table.drop(columns=[k for k in grid if k in table.columns])
        steps.append(pd.concat([pd.DataFrame(grid, index=table.index), table], axis=1))
        summary = load_json(folder / "summary.json", "sweep cell summary")
        if not isinstance(summary, dict):
            raise LabError(f"{folder}/summary.json is not a cell summary; remove the cell folder and rerun the sweep")
        row = {_RENAMED.get(k, k): v for k, v in summary.items()
               if k not in grid and k != "study" and not isinstance(v, (dict, list))}
        row["collapsed"] = summary.get("first_collapse_update") is not None
        runs.append({**grid, **row})
    head = ["cell_id", *keys]
    steps_df = pd.concat(steps, ignore_index=True) if steps else pd.DataFrame(columns=head)
    runs_df = pd.DataFrame(runs) if runs else pd.DataFrame(columns=[*head, "final_reward", "best_reward",
                                                                     "first_collapse", "collapsed"])
    if "first_collapse" in runs_df and len(runs_df):
        runs_df["first_collapse"] = runs_df["first_collapse"].astype("Int64")
    return steps_df, runs_df
