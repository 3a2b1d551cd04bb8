#!/usr/bin/env python
"""Benchmark: RL training throughput of the lab's transformer, against the machine's measured matmul rate.

    .venv/bin/python benchmarks/bench_real_rl.py                  # chain6, "small" transformer, CPU
    .venv/bin/python benchmarks/bench_real_rl.py --size medium --device cuda
    .venv/bin/python benchmarks/bench_real_rl.py --quick          # smoke test, seconds

One ``lab.engine.training.train`` run (sync, rollout batch 256 in groups of 4, N = 4 mini-batches, a random init:
throughput does not depend on the weights) with its three phases timed in the same process:

- sampling: ``TransformerPolicy.generate`` with the KV cache (rollout tokens/s), and, as its baseline in the same
  run, the same sampler recomputing the whole sequence for every token (what a sampler without a cache does);
- updating: the estimator's loss, backward pass and Adam step (update tokens/s), and its arithmetic rate as a
  share of the machine's float32 matmul rate (a square matmul timed here), counting 6 x parameters FLOPs per
  token (forward 2, backward 4; attention's own FLOPs are small at these context lengths);
- metrics: the exact task metrics after every update (teacher-forced passes on the training and held-out answers)
  and the sampled weight diagnostics.

Shares are of the run's wall-clock. Read ratios, not absolute times.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.common import matmul_rate, sync  # noqa: E402

import lab.engine.training as training  # noqa: E402
from lab.policies.transformer import size_config, parameter_count  # noqa: E402


class Timers:
    """Wall-clock per phase, by wrapping the simulator's own functions (the run itself is unchanged)."""

    def __init__(self, device: str):
        self.device, self.seconds = device, {"sampling": 0.0, "metrics": 0.0}
        self.sampled_tokens = 0

    def wrap(self, owner, name: str, phase: str):
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            sync(self.device)
            t = time.perf_counter()
            out = fn(*args, **kwargs)
            sync(self.device)
            self.seconds[phase] += time.perf_counter() - t
            return out

        setattr(owner, name, timed)
        return fn


def run(size: str, device: str, steps: int, estimator: str) -> dict:
    cfg = training.TrainConfig(env="chain6", policy="transformer", size=size, device=device, estimator=estimator,
                               rollout_batch=256, group_size=4, minibatches=4, steps=steps, lr=5e-4)
    training.train(training.TrainConfig(**{**cfg.__dict__, "steps": 1}), progress=False)  # warm-up
    timers = Timers(device)
    originals = [(training._Run, "network_rollout", timers.wrap(training._Run, "network_rollout", "sampling")),
                 (training, "task_metrics", timers.wrap(training, "task_metrics", "metrics")),
                 (training, "weight_metrics", timers.wrap(training, "weight_metrics", "metrics"))]
    try:
        sync(device)
        t = time.perf_counter()
        res = training.train(cfg, progress=False)
        sync(device)
        total = time.perf_counter() - t
    finally:
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    env = cfg.make_env()
    tokens = cfg.rollout_batch * env.length
    update_s = total - timers.seconds["sampling"] - timers.seconds["metrics"]
    update_tokens = res.summary["updates"] * (cfg.rollout_batch // cfg.minibatches) * (env.prompt_length + env.length)
    return {"total_s": total, "sampling_s": timers.seconds["sampling"], "metrics_s": timers.seconds["metrics"],
            "update_s": update_s, "rollout_tokens_per_s": steps * tokens / timers.seconds["sampling"],
            "update_tokens_per_s": update_tokens / update_s, "updates": res.summary["updates"]}


def sampler_rate(size: str, device: str, kv_cache: bool, n: int = 256, repeats: int = 3) -> float:
    """Rollout tokens/s of the sampler alone, best of ``repeats``."""
    cfg = training.TrainConfig(env="chain6", policy="transformer", size=size, device=device)
    policy = cfg.problem().policy
    theta = policy.init_params(1.0, torch.Generator().manual_seed(0), torch.float32).to(device)
    prompts = torch.arange(n) % policy.prompt_tokens.shape[0]
    best = float("inf")
    for r in range(repeats + 1):  # the first is a warm-up
        sync(device)
        t = time.perf_counter()
        policy.generate(theta, prompts, torch.Generator().manual_seed(r), kv_cache=kv_cache)
        sync(device)
        if r:
            best = min(best, time.perf_counter() - t)
    return n * policy.length / best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--size", default="small")
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--estimator", default="vespo")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("LAB_QUIET", "1")
    steps = 1 if args.quick else args.steps
    params = parameter_count(size_config(args.size))
    rate = matmul_rate(args.device, 256 if args.quick else 1024)
    r = run(args.size, args.device, steps, args.estimator)
    kv, full = sampler_rate(args.size, args.device, True), sampler_rate(args.size, args.device, False)
    update_flops = 6 * params * r["update_tokens_per_s"]
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} "
          f"threads, device {args.device}; transformer {args.size} ({params:,} parameters), chain6 (P = 14, T = 6), "
          f"{args.estimator}, {r['updates']} updates")
    print(f"matmul rate (float32, measured):        {rate / 1e9:8.1f} GFLOP/s")
    print(f"sampling, KV cache:                     {kv:10,.0f} rollout tokens/s")
    print(f"sampling, recomputing the sequence:     {full:10,.0f} rollout tokens/s   (KV cache {kv / full:.2f}x)")
    print(f"updating (loss, backward, Adam):        {r['update_tokens_per_s']:10,.0f} tokens/s  = "
          f"{update_flops / 1e9:.2f} GFLOP/s, {update_flops / rate:.1%} of the matmul rate")
    print(f"time shares of the run ({r['total_s']:.1f} s): sampling {r['sampling_s'] / r['total_s']:.0%}, "
          f"updating {r['update_s'] / r['total_s']:.0%}, metrics {r['metrics_s'] / r['total_s']:.0%}")
    if args.json:
        Path(args.json).write_text(json.dumps({**r, "matmul_flops": rate, "kv_tokens_per_s": kv,
                                               "recompute_tokens_per_s": full, "parameters": params}, indent=1))


if __name__ == "__main__":
    main()
