"""Sweeps (lab/engine/sweep.py): cells, resuming after a SIGKILL, executors agree, results tables, bad input."""
import fcntl
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lab.errors import LabError
from lab.engine.sweep import LATER_FIELDS, SweepSpec, _write_cell, cell_id, expand, load_results, load_spec, run_sweep
from lab.engine.training import TrainConfig
from lab.runs import marker

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(env="tiny_target", steps=2, rollout_batch=16, group_size=4)  # a cell trains in well under a second
SPEC = SweepSpec("t", dict(TINY, steps=60),  # 8 cells of ~0.15-0.7 s each (60 or 240 updates)
                 {"estimator": ["reinforce", "ppo_clip"], "minibatches": [1, 4], "seed": [0, 1]})


def sorted_steps(steps):
    return steps.sort_values(["cell_id", "update"]).reset_index(drop=True)


def cell_dirs(out):
    return sorted(p.name for p in (Path(out) / "cells").iterdir())


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """SPEC run once, uninterrupted, on the local pool: (out_dir, steps, runs)."""
    out = tmp_path_factory.mktemp("ref") / "sweep"
    assert run_sweep(SPEC, out, "local", workers=2) == {"done": 8, "skipped": 0, "total": 8}
    return (out, *load_results(out))


# ------------------------------------------------------------------------------------------ cells
def test_cell_id_is_sha256_of_the_canonical_resolved_config():
    full = asdict(TrainConfig(seed=3))
    hashed = {k: v for k, v in full.items() if k not in LATER_FIELDS["train"]}  # fields added later, at defaults
    canonical = json.dumps(hashed, sort_keys=True, separators=(",", ":"))
    assert cell_id(full) == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    # defaults filled in, key order and int-for-float do not matter; any changed field does
    assert cell_id({"seed": 3}) == cell_id(dict(reversed(list(full.items())))) == cell_id(full)
    assert cell_id({"seed": 3, "lr": 1}) == cell_id({"seed": 3, "lr": 1.0})
    assert cell_id({"seed": 3}) != cell_id({"seed": 4})
    assert cell_id({"seed": 3, "hyper": {"clip_ratio": 0.2}}) != cell_id({"seed": 3})


def test_expand_is_the_grid_product_in_spec_order_with_unique_ids():
    cells = expand(SPEC)
    assert len(cells) == 2 * 2 * 2 and cells == expand(SPEC)
    assert [(c["estimator"], c["minibatches"], c["seed"]) for c in cells[:3]] == [
        ("reinforce", 1, 0), ("reinforce", 1, 1), ("reinforce", 4, 0)]
    assert all(c["steps"] == 60 and c["rollout_batch"] == 16 and c["lr"] == 0.1 for c in cells)  # base + defaults
    assert set(cells[0]) == set(asdict(TrainConfig()))
    assert len({cell_id(c) for c in cells}) == 8


def test_load_spec_reads_yaml_and_the_example_spec_is_valid(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nbase: {estimator: ppo_clip, lr: 1e-2}\ngrid:\n  seed: [0, 1]\n"
                    "  hyper: [{}, {clip_ratio_low: 0.1}]\n")
    spec = load_spec(path)
    assert spec.name == "s" and spec.grid == {"seed": [0, 1], "hyper": [{}, {"clip_ratio_low": 0.1}]}
    assert expand(spec)[0]["lr"] == 0.01  # YAML reads 1e-2 as a string; a float field makes it a float
    example = load_spec(ROOT / "sweeps" / "example.yaml")
    assert len(expand(example)) == 4 * 3 * 2


# ------------------------------------------------------------------------------------------ resume
@pytest.mark.slow
def test_sweep_killed_at_a_random_point_resumes_without_losing_or_duplicating_cells(tmp_path, reference):
    out = tmp_path / "sweep"
    code = (f"from lab.engine.sweep import SweepSpec, run_sweep; "
            f"run_sweep(SweepSpec({SPEC.name!r}, {SPEC.base!r}, {SPEC.grid!r}), {str(out)!r}, 'local', workers=1)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, start_new_session=True,
                            env={**os.environ, "LAB_QUIET": "1"}, stderr=subprocess.PIPE)
    cells = out / "cells"
    deadline = time.monotonic() + 60
    while not (cells.is_dir() and any(p.name[0] != "." for p in cells.iterdir())):  # first cell written
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the sweep wrote no cell within 60 s"
        time.sleep(0.02)
    delay = random.Random(1234).uniform(0.0, 0.3)  # then kill it at a random (fixed-seed) moment
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGKILL)  # the sweep and its pool workers, as a job kill would
    proc.wait()
    finished = [n for n in cell_dirs(out) if not n.startswith(".")]
    print(f"killed after {delay:.2f} s with {len(finished)} of 8 cells written")
    assert 0 < len(finished) < 8  # interrupted part-way: the test exercises a real resume
    # every cell present is complete
    assert all(sorted(os.listdir(cells / n)) == [".lab", "config.json", "steps.parquet", "summary.json"]
               for n in finished)

    status = run_sweep(SPEC, out, "local", workers=2, progress=False)
    assert status == {"done": 8 - len(finished), "skipped": len(finished), "total": 8}
    assert cell_dirs(out) == sorted(cell_id(c) for c in expand(SPEC))  # all cells, once, no hidden leftovers
    steps, runs = load_results(out)
    ref_out, ref_steps, ref_runs = reference
    pd.testing.assert_frame_equal(sorted_steps(steps), sorted_steps(ref_steps), check_exact=True)
    assert run_sweep(SPEC, out, "local", workers=2) == {"done": 0, "skipped": 8, "total": 8}


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.slow
def test_leftovers_of_a_killed_write_are_removed_and_a_failed_write_leaves_nothing(tmp_path, reference):
    out = tmp_path / "sweep"
    left = out / "cells" / ".0123456789abcdef.lab-x1y2z3"  # what a kill -9 mid-write leaves: a marked staging folder
    left.mkdir(parents=True)
    (left / ".lab").write_text(json.dumps({**marker("cell", staging=True), "pid": _dead_pid(), "start": None}))
    (left / "config.json").write_text("{")
    (out / "cells" / ".git").mkdir()  # a hidden folder the lab did not write: never touched
    (out / ".lab").write_text(json.dumps(marker("sweep")))  # (the sweep folder itself is the lab's)
    spec = SweepSpec("one", TINY, {"seed": [0]})
    assert run_sweep(spec, out, workers=1) == {"done": 1, "skipped": 0, "total": 1}
    assert cell_dirs(out) == sorted([".git", cell_id(expand(spec)[0])])

    class Broken:
        def to_parquet(self, path, index=False):
            Path(path).write_bytes(b"PAR1")  # half a file, then the disk fills
            raise OSError("No space left on device")

    with pytest.raises(OSError):
        _write_cell(out / "cells", "feedfacefeedface", {}, {"table": Broken(), "summary": {}}, {})
    assert cell_dirs(out) == sorted([".git", cell_id(expand(spec)[0])])


@pytest.mark.slow
def test_growing_a_spec_runs_only_the_new_cells(tmp_path):
    out = tmp_path / "sweep"
    small = SweepSpec("g", TINY, {"seed": [0]})
    assert run_sweep(small, out, workers=1)["done"] == 1
    grown = SweepSpec("g", TINY, {"seed": [0, 1]})
    assert run_sweep(grown, out, workers=1) == {"done": 1, "skipped": 1, "total": 2}
    assert list(load_results(out)[1]["seed"]) == [0, 1]


# ------------------------------------------------------------------------------------------ executors
@pytest.mark.slow
def test_ray_and_local_executors_give_identical_results(tmp_path, reference):
    out = tmp_path / "ray"
    assert run_sweep(SPEC, out, "ray", workers=2) == {"done": 8, "skipped": 0, "total": 8}  # local Ray, num_cpus=2
    import ray

    assert not ray.is_initialized()  # the instance it started is shut down
    steps, runs = load_results(out)
    _, ref_steps, ref_runs = reference
    pd.testing.assert_frame_equal(sorted_steps(steps), sorted_steps(ref_steps), check_exact=True)
    pd.testing.assert_frame_equal(runs, ref_runs, check_exact=True)


# ------------------------------------------------------------------------------------------ results
@pytest.mark.slow
def test_load_results_shapes(reference):
    out, steps, runs = reference
    # 8 cells; a cell makes steps x minibatches updates: 60 x 1 or 60 x 4 rows
    assert len(steps) == 4 * 60 + 4 * 240 and len(runs) == 8
    assert list(steps.columns[:4]) == ["cell_id", "estimator", "minibatches", "seed"]
    assert steps.groupby("cell_id")["update"].max().sort_index().tolist() == \
        runs.set_index("cell_id").sort_index()["minibatches"].mul(60).tolist()
    assert list(runs.columns[:4]) == ["cell_id", "estimator", "minibatches", "seed"]
    assert runs["cell_id"].is_unique and set(runs["cell_id"]) == set(cell_dirs(out))
    for col in ("final_reward", "best_reward", "collapsed", "first_collapse", "final_kl_to_init"):
        assert col in runs
    assert runs["collapsed"].dtype == bool and str(runs["first_collapse"].dtype) == "Int64"
    assert (runs["best_reward"] >= runs["final_reward"]).all()
    last = steps.sort_values("update").groupby("cell_id")["expected_reward"].last()
    assert (runs.set_index("cell_id")["final_reward"] == last.reindex(runs["cell_id"]).values).all()


@pytest.mark.slow
def test_load_results_of_a_sweep_with_no_finished_cells_and_of_a_dict_grid(tmp_path):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"name": "e", "base": TINY, "grid": {"seed": [0, 1]}}))
    steps, runs = load_results(out)
    assert steps.empty and runs.empty and list(runs.columns[:2]) == ["cell_id", "seed"]
    spec = SweepSpec("h", dict(TINY, estimator="ppo_clip"), {"hyper": [{}, {"clip_ratio_low": 0.1}]})
    run_sweep(spec, tmp_path / "h", workers=1)
    assert sorted(load_results(tmp_path / "h")[1]["hyper"]) == ['{"clip_ratio_low":0.1}', "{}"]


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("kwargs, message", [
    (dict(executor="dask"), "unknown executor 'dask'"),
    (dict(workers=0), "workers must be a positive whole number"),
    (dict(address="10.0.0.1:6379"), "use it with --executor ray"),
    (dict(executor="ray", address="127.0.0.1:1"), "no Ray cluster answers at 127.0.0.1:1"),
])
def test_bad_run_arguments(tmp_path, kwargs, message):
    with pytest.raises(LabError, match=message):
        run_sweep(SPEC, tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()


def test_a_local_ray_without_loopback_is_one_line_not_minutes_of_retries(tmp_path, monkeypatch):
    from lab.engine import sweep

    def unreachable(*args, **kwargs):
        raise OSError(101, "Network is unreachable")  # what 127.0.0.1 answers with the loopback interface down

    monkeypatch.setattr(sweep.socket, "create_connection", unreachable)
    assert not sweep.loopback_works()
    with pytest.raises(LabError, match="127.0.0.1, which does not answer here .*--executor local"):
        run_sweep(SPEC, tmp_path / "x", "ray", workers=1)
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("base, grid, message", [
    ({}, {"learning_rate": [0.1]}, "learning_rate are not TrainConfig fields"),
    ({"stepz": 2}, {"seed": [0]}, "base key.*stepz are not TrainConfig fields"),
    ({}, {"seed": 0}, "must map to a non-empty list"),
    ({}, {"seed": []}, "must map to a non-empty list"),
    ({"seed": 0}, {"seed": [1]}, "both base and grid"),
    ({}, {"seed": [0, 0]}, "same config; remove repeated grid values"),
    # every cell is checked before any runs: the bad one is the last of four (GVPO needs whole groups of 4 in a
    # mini-batch; 16 responses / 8 mini-batches = 2)
    (TINY, {"estimator": ["reinforce", "gvpo"], "minibatches": [1, 8]},
     r"cell 3 \(estimator='gvpo', minibatches=8\) is invalid: .*whole groups"),
    (TINY, {"estimator": ["nope"]}, "cell 0 .* is invalid: .*nope"),
])
def test_bad_specs_fail_before_anything_runs(tmp_path, base, grid, message):
    with pytest.raises(LabError, match=message):
        run_sweep(SweepSpec("bad", base, grid), tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("text, message", [
    ("name: [", "not valid YAML"),
    ("- 1\n- 2\n", "must be a mapping"),
    ("name: a\ngrid: {seed: [0]}\nextra: 1\n", "unknown keys extra"),
])
def test_bad_spec_files(tmp_path, text, message):
    path = tmp_path / "s.yaml"
    path.write_text(text)
    with pytest.raises(LabError, match=message):
        load_spec(path)
    with pytest.raises(LabError, match="does not exist"):
        load_spec(tmp_path / "missing.yaml")


def test_out_dir_that_is_not_a_sweep_or_is_locked_is_refused(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(LabError, match="is a folder the lab did not write"):
        run_sweep(SweepSpec("one", TINY, {"seed": [0]}), tmp_path / "other")
    with pytest.raises(LabError, match="is not a sweep folder"):
        load_results(tmp_path / "other")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "cells").mkdir()  # a folder that happens to hold cells/ is not the lab's either
    (tmp_path / "model" / "cells" / ".git").mkdir()
    with pytest.raises(LabError, match="is a folder the lab did not write"):
        run_sweep(SweepSpec("one", TINY, {"seed": [0]}), tmp_path / "model")
    assert (tmp_path / "model" / "cells" / ".git").is_dir()
    out = tmp_path / "busy"
    out.mkdir()
    (out / ".lab").write_text(json.dumps(marker("sweep")))
    with open(out / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another sweep holds it
        with pytest.raises(LabError, match="another sweep is writing"):
            run_sweep(SweepSpec("one", TINY, {"seed": [0]}), out)


@pytest.mark.slow
def test_a_cell_that_fails_at_run_time_does_not_stop_the_others(tmp_path):
    # async + drop with lags that almost never fall within eta passes validation but cannot fill a rollout
    base = dict(TINY, regime="async", lag_dist="geometric", lag_p=1e-6, lag_max=10_000, over_stale="drop", steps=8)
    spec = SweepSpec("f", base, {"eta": [10_000, 0]})
    with pytest.raises(LabError, match=r"1 of 2 sweep cells failed \(first: cell 1, eta=0: .*raise eta.*rerun"):
        run_sweep(spec, tmp_path / "f", workers=2)
    assert len(load_results(tmp_path / "f")[1]) == 1


def test_fields_added_later_keep_the_cell_ids_of_folders_written_before_them():
    """A train cell at the truncation knobs' defaults hashes as it did before those fields existed (the id below
    is the one earlier versions wrote), so such a sweep folder resumes; setting a knob makes another cell."""
    from lab.engine.sweep import LATER_FIELDS, cell_id

    cell = {"estimator": "vespo", "minibatches": 4, "seed": 1}
    assert cell_id(cell) == "b5afb347f87bfa6d"
    assert cell_id({**cell, "top_p": 1.0, "top_k": None, "min_p": 0.0, "mask_replay": False}) == cell_id(cell)
    for key, value in (("top_p", 0.9), ("top_k", 2), ("min_p", 0.1), ("mask_replay", True)):
        assert key in LATER_FIELDS["train"] and cell_id({**cell, key: value}) != cell_id(cell)


def test_summaries_serialise_numpy_scalars_and_non_finite_values(tmp_path):
    from lab.runs import write_json

    obj = {"a": np.float32(0.5), "b": np.int64(3), "c": [np.bool_(True), np.float64("nan"), float("inf")],
           "d": {np.int64(1): np.array(2.5)}}
    write_json(tmp_path / "s.json", obj)
    text = (tmp_path / "s.json").read_text()
    assert json.loads(text, parse_constant=lambda c: pytest.fail(c)) == {"a": 0.5, "b": 3, "c": [True, None, None],
                                                                          "d": {"1": 2.5}}
