"""Sweep throughput in cells per minute: the local process pool against Ray, with 1 and 2 workers.

Every configuration runs the same spec (tiny_target, a few estimators x mini-batch counts x seeds) into a fresh
folder, in the same run, against a serial baseline (``train`` called in a loop in this process, one torch thread).
``total`` includes starting the executor (the process pool, or a local Ray instance and its workers); ``steady``
is the rate between the first and the last finished cell (from the cell folders' times), i.e. without start-up.
The results of every configuration must be identical to the serial ones; the script exits 1 if not.

    .venv/bin/python benchmarks/bench_sweep.py            # 16 cells of 120-480 updates, ~2-3 min on 2 busy cores
    .venv/bin/python benchmarks/bench_sweep.py --quick    # 8 small cells, a smoke run of about a minute
    .venv/bin/python benchmarks/bench_sweep.py --json sweep.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

os.environ.setdefault("LAB_QUIET", "1")

from lab.engine.sweep import SweepSpec, cell_id, expand, load_results, run_sweep  # noqa: E402
from lab.engine.training import TrainConfig, train  # noqa: E402


def spec_for(quick: bool) -> SweepSpec:
    if quick:  # cells of ~0.05 s: start-up dominates
        base = dict(env="tiny_target", rollout_batch=32, group_size=4, steps=10)
        return SweepSpec("bench", base, {"estimator": ["reinforce", "ppo_clip"], "minibatches": [1, 4], "seed": [0, 1]})
    base = dict(env="tiny_target", rollout_batch=64, group_size=8, steps=30)  # cells of ~0.5-2 s (120-480 updates)
    return SweepSpec("bench", base, {"estimator": ["reinforce", "ppo_clip"], "minibatches": [4, 16],
                                     "seed": [0, 1, 2, 3]})


def serial(spec: SweepSpec) -> tuple[float, dict]:
    torch.set_num_threads(1)
    train(TrainConfig(**dict(spec.base, steps=1)), progress=False)  # first-call start-up, paid once per worker too
    tables = {}
    t0 = time.perf_counter()
    for config in expand(spec):
        tables[cell_id(config)] = train(TrainConfig(**config), progress=False).table
    return time.perf_counter() - t0, tables


def timed_sweep(spec: SweepSpec, executor: str, workers: int, root: Path) -> tuple[float, float, pd.DataFrame]:
    out = root / f"{executor}-{workers}"
    t0 = time.perf_counter()
    run_sweep(spec, out, executor, workers=workers, progress=False)
    total = time.perf_counter() - t0
    stamps = sorted((out / "cells" / d).stat().st_mtime for d in os.listdir(out / "cells"))
    span = stamps[-1] - stamps[0]
    steady = (len(stamps) - 1) / span * 60 if span > 0 else float("nan")
    return total, steady, load_results(out)[0]


def same(steps: pd.DataFrame, tables: dict) -> bool:
    for cid, table in tables.items():
        got = steps[steps["cell_id"] == cid].reset_index(drop=True)
        cols = list(table.columns)
        if not got[cols].equals(table[cols]):
            return False
    return len(steps) == sum(len(t) for t in tables.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 small cells: a smoke run")
    ap.add_argument("--json", help="also write every number to this file")
    args = ap.parse_args(argv)
    spec = spec_for(args.quick)
    n = len(expand(spec))
    print(f"sweep of {n} cells ({spec.base}); {os.cpu_count()} CPUs, load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    base_s, tables = serial(spec)
    base_rate = n / base_s * 60
    rows = [{"executor": "serial", "workers": 1, "total_s": base_s, "cells_per_min": base_rate,
             "steady_cells_per_min": base_rate, "vs_serial": 1.0, "identical": True}]
    with tempfile.TemporaryDirectory() as tmp:
        for executor in ("local", "ray"):
            for workers in (1, 2):
                total, steady, steps = timed_sweep(spec, executor, workers, Path(tmp))
                rows.append({"executor": executor, "workers": workers, "total_s": total,
                             "cells_per_min": n / total * 60,
                             "steady_cells_per_min": steady, "vs_serial": base_s / total,
                             "identical": same(steps, tables)})
    print(f"{'executor':<9}{'workers':>8}{'total s':>9}{'cells/min':>11}{'steady/min':>12}{'vs serial':>11}"
          f"  identical")
    for r in rows:
        print(f"{r['executor']:<9}{r['workers']:>8}{r['total_s']:>9.1f}{r['cells_per_min']:>11.1f}"
              f"{r['steady_cells_per_min']:>12.1f}{r['vs_serial']:>10.2f}x  {r['identical']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cells": n, "base": spec.base, "grid": spec.grid, "rows": rows},
                                              indent=2) + "\n")
    ok = all(r["identical"] for r in rows)
    if not ok:
        print("FAIL: an executor's results differ from the serial run", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
