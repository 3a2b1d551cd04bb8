#!/usr/bin/env python
"""Benchmark: training-simulator throughput (optimiser updates per second) for each estimator, against REINFORCE.

    .venv/bin/python benchmarks/bench_training.py               # medium_target, markov and prefix policies
    .venv/bin/python benchmarks/bench_training.py --threads 1   # the same, steadier on a shared machine
    .venv/bin/python benchmarks/bench_training.py --quick       # smoke test, a few seconds
    .venv/bin/python benchmarks/bench_training.py --json out.json

Each timing is one ``lab.engine.training.train`` run (sync, rollout batch 64, group size 8, N = 4 mini-batches, so
``steps * 4`` optimiser updates) after a one-rollout warm-up run per estimator; estimators are timed round-robin,
``--repeats`` rounds, and the median is reported as updates per second. Every update includes sampling (once per
rollout), the estimator's loss and backward pass, the Adam step, the sampled weight diagnostics and the exact metrics
(J, KL to init, entropy by enumerating every response: 131,072 pairs on medium_target), so the ratio to REINFORCE
measured in the same process shows what an estimator adds to a whole simulated training step, not to its loss alone.
Read ratios, not absolute times.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.common import load  # noqa: E402

from lab.engine.training import TrainConfig, train  # noqa: E402

ESTIMATORS = ["reinforce", "ppo_clip", "seq_is", "token_is", "tis_token", "mis_seq", "cispo", "gspo", "gmpo",
              "sapo", "vespo", "gvpo"]


def time_run(cfg: TrainConfig) -> float:
    t0 = time.perf_counter()
    res = train(cfg, progress=False)
    dt = time.perf_counter() - t0
    return res.summary["updates"] / dt


def bench(env: str, policy: str, estimators: list, steps: int, repeats: int) -> list[dict]:
    base = dict(env=env, policy=policy, rollout_batch=64, group_size=8, minibatches=4, lr=0.1, steps=steps)
    for name in estimators:  # warm-up: enumeration caches, allocator, each estimator's first call
        train(TrainConfig(**{**base, "steps": 1}, estimator=name), progress=False)
    rates = {name: [] for name in estimators}
    for r in range(repeats):  # round-robin, so that a change in machine load hits every estimator alike
        for name in estimators:
            rates[name].append(time_run(TrainConfig(**base, estimator=name, seed=r)))
    rows = [{"env": env, "policy": policy, "estimator": name, "updates_per_s": statistics.median(rates[name]),
             "spread": max(rates[name]) / min(rates[name]), "rates": rates[name]} for name in estimators]
    ref = next(r["updates_per_s"] for r in rows if r["estimator"] == "reinforce")
    for r in rows:
        r["vs_reinforce"] = r["updates_per_s"] / ref  # < 1: slower than REINFORCE
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny_target, 3 estimators, 1 repeat: a smoke test")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's; --quick: 1)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per estimator (median reported)")
    ap.add_argument("--steps", type=int, default=5, help="rollouts per timed run (x 4 updates)")
    ap.add_argument("--json", metavar="PATH", help="also write every number to PATH")
    p = ap.parse_args(argv)
    os.environ.setdefault("LAB_QUIET", "1")
    if p.quick:
        p.threads = p.threads or 1
        cases, ests, p.repeats, p.steps = [("tiny_target", "prefix")], ["reinforce", "ppo_clip", "vespo"], 1, 3
    else:
        cases, ests = [("medium_target", "markov"), ("medium_target", "prefix")], ESTIMATORS
    if p.threads:
        torch.set_num_threads(p.threads)
    meta = {"torch": torch.__version__, "platform": platform.platform(), "threads": torch.get_num_threads(),
            "cpus": os.cpu_count(), "load_start": load(), "steps": p.steps, "repeats": p.repeats}
    print(f"bench_training: torch {meta['torch']}, {meta['threads']} torch thread(s), {meta['cpus']} CPUs, load "
          f"average {meta['load_start']}; sync, rollout 64, G 8, N 4, {p.steps} rollouts per run, median of "
          f"{p.repeats}")
    rows = []
    for env, policy in cases:
        t0 = time.perf_counter()
        part = bench(env, policy, ests, p.steps, p.repeats)
        rows += part
        print(f"\n{env} / {policy} policy ({time.perf_counter() - t0:.0f} s, load average {load()})")
        print(f"  {'estimator':<10} {'updates/s':>10} {'vs reinforce':>13} {'spread':>7}")
        for r in part:
            print(f"  {r['estimator']:<10} {r['updates_per_s']:>10.1f} {r['vs_reinforce']:>12.2f}x "
                  f"{r['spread']:>7.2f}")
    ok = all(r["updates_per_s"] > 0 for r in rows)
    if p.json:
        Path(p.json).write_text(json.dumps({"meta": {**meta, "load_end": load()}, "rows": rows}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
