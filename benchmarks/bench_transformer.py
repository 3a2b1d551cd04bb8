#!/usr/bin/env python
"""Benchmark: the lab's transformer through the variance engine, its sampler, and its training step.

    .venv/bin/python benchmarks/bench_transformer.py                    # CPU, "small" and "1m"
    .venv/bin/python benchmarks/bench_transformer.py --device cuda      # the same on a GPU
    .venv/bin/python benchmarks/bench_transformer.py --quick            # smoke test; exits 1 on disagreement

1. Per-replicate gradients: ``lab.engine.gradients.replicate_gradients`` (torch.func vmap over replicates of grad
   through the network, in chunks) against ``loop_gradients(per="replicate")``, one batched backward pass per
   replicate: the strongest obvious alternative. Same numbers to 1e-6 (relative to the largest entry); the ratio is
   loop time / engine time; peak memory of each, measured in a fresh process (CPU: maximum resident set; CUDA:
   torch.cuda.max_memory_allocated).
2. Sampling: tokens per second of ``generate`` with and without the KV cache, float32 and bfloat16.
3. Training step: one Adam step on a batch (forward, backward, update) as achieved FLOP/s, 6 x parameters x tokens
   (Kaplan et al. 2020), against the machine's float32 matrix-multiply rate measured in the same run.
Read ratios, not absolute times.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.common import matmul_rate, sync  # noqa: E402

import toy_envs  # noqa: E402
from lab import advantages as adv_mod  # noqa: E402
from lab.engine.batches import draw_batches  # noqa: E402
from lab.engine.estimator import Estimator  # noqa: E402
from lab.engine.gradients import loop_gradients, replicate_gradients  # noqa: E402
from lab.policies import make_policy  # noqa: E402

TOL = 1e-6
ENV = "add2"


def timed(fn, device: str, repeats: int = 3) -> float:
    """Median seconds of ``repeats`` calls after a warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def setup(size: str, M: int, B: int, device: str, seed: int = 0):
    env = toy_envs.make(ENV)
    policy = make_policy("transformer", env, size)
    g = torch.Generator().manual_seed(seed)
    theta = policy.init_params(1.0, g, torch.float32)
    batch = draw_batches(env, (policy, theta), M, B, 8, g)
    adv = adv_mod.group_advantages(batch.rewards.reshape(M, B // 8, 8), "rloo").reshape(M, B)[..., None] * batch.mask
    return policy, theta.to(device), batch, adv


def gradients_once(size, M, B, device, chunk, which) -> dict:
    """One timed run of the engine or the loop (called in a fresh process for its peak memory)."""
    policy, theta, batch, adv = setup(size, M, B, device)
    est = Estimator.resolve("seq_is", {}, "seq-mean-token-sum")
    if which == "engine":
        fn = lambda: replicate_gradients(policy, theta, batch, adv, est, chunk=chunk)[0]  # noqa: E731
    else:
        fn = lambda: loop_gradients(policy, theta, batch, adv, est, per="replicate")  # noqa: E731
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    seconds = timed(fn, device, repeats=2)
    peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else \
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"seconds": seconds, "peak_bytes": peak, "D": policy.n_params}


def gradients(p, results) -> bool:
    ok = True
    print(f"\n1. Per-replicate gradients, {ENV}, seq_is, M x B = {p.M} x {p.B}, chunk {p.chunk}: engine (vmap of grad) "
          f"against one batched backward pass per replicate")
    print(f"{'size':<8}{'D':>11}{'engine s':>11}{'loop s':>10}{'loop/engine':>13}{'engine peak':>13}{'loop peak':>12}"
          f"{'max rel diff':>14}")
    for size in p.sizes:
        policy, theta, batch, adv = setup(size, min(p.M, 16), p.B, p.device)
        est = Estimator.resolve("seq_is", {}, "seq-mean-token-sum")
        a = replicate_gradients(policy, theta, batch, adv, est, chunk=p.chunk)[0].cpu()
        b = loop_gradients(policy, theta, batch, adv, est, per="replicate").cpu()
        diff = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
        ok &= diff <= TOL
        runs = {}
        for which in ("engine", "loop"):
            out = subprocess.run([sys.executable, __file__, "--child", which, "--size", size, "--M", str(p.M), "--B",
                                  str(p.B), "--device", p.device, "--chunk", str(p.chunk), "--threads",
                                  str(torch.get_num_threads())], capture_output=True, text=True, check=True)
            runs[which] = json.loads(out.stdout.strip().splitlines()[-1])
        e, lp = runs["engine"], runs["loop"]
        ratio = lp["seconds"] / e["seconds"]
        results["gradients"].append({"size": size, "D": e["D"], "engine": e, "loop": lp, "ratio": ratio,
                                     "max_rel_diff": diff})
        print(f"{size:<8}{e['D']:>11,}{e['seconds']:>11.3f}{lp['seconds']:>10.3f}{ratio:>12.2f}x"
              f"{e['peak_bytes'] / 2**20:>11.0f}Mi{lp['peak_bytes'] / 2**20:>10.0f}Mi{diff:>14.1e}"
              + ("" if diff <= TOL else "  FAIL"))
    return ok


def sampling(p, results) -> None:
    print(f"\n2. Sampling: tokens per second of generate(), {ENV} prompts, batch {p.gen_batch}")
    print(f"{'size':<8}{'dtype':<10}{'KV cache':>12}{'recompute':>12}{'cache/recompute':>17}")
    for size in p.sizes:
        policy, theta, _, _ = setup(size, 2, 8, p.device)
        prompts = torch.arange(p.gen_batch) % policy.prompt_tokens.shape[0]
        for dtype in (torch.float32, torch.bfloat16):
            rates = {}
            for kv in (True, False):
                t = timed(lambda: policy.generate(theta, prompts, torch.Generator().manual_seed(0), dtype=dtype,
                                                  kv_cache=kv), p.device)
                rates[kv] = p.gen_batch * policy.length / t
            results["sampling"].append({"size": size, "dtype": str(dtype), "kv_tokens_s": rates[True],
                                        "recompute_tokens_s": rates[False]})
            print(f"{size:<8}{str(dtype).split('.')[-1]:<10}{rates[True]:>12,.0f}{rates[False]:>12,.0f}"
                  f"{rates[True] / rates[False]:>16.2f}x")


def training(p, results) -> None:
    peak = matmul_rate(p.device, 4096 if p.device.startswith("cuda") else 1024)
    print(f"\n3. Training step (forward, backward, Adam) on {p.train_batch} responses; float32 matmul rate of this "
          f"machine: {peak / 1e9:,.1f} GFLOP/s")
    print(f"{'size':<8}{'D':>11}{'step ms':>10}{'tokens/s':>12}{'GFLOP/s':>10}{'share of matmul':>17}")
    for size in p.sizes:
        policy, theta, batch, adv = setup(size, 1, p.train_batch, p.device)
        theta = theta.clone().requires_grad_(True)
        opt = torch.optim.Adam([theta], lr=1e-3)
        loss_fn = Estimator.resolve("seq_is", {}, "seq-mean-token-sum").ascent_loss()
        dev = p.device
        args = [x[0].to(dev) for x in (batch.tokens, batch.mask, batch.behaviour_log_probs, adv)]

        def step():
            logits = policy.logits(theta, batch.prompts[0].to(dev), args[0])
            value, _ = loss_fn(logits, *args, {})
            opt.zero_grad(set_to_none=True)
            (-value).backward()
            opt.step()

        t = timed(step, dev, repeats=5)
        tokens = p.train_batch * (policy.prompt_length + policy.length - 1)
        flops = 6 * policy.n_params * tokens / t
        results["training"].append({"size": size, "D": policy.n_params, "step_s": t, "tokens_s": tokens / t,
                                    "flops": flops, "matmul_flops": peak, "share": flops / peak})
        print(f"{size:<8}{policy.n_params:>11,}{t * 1e3:>10.1f}{tokens / t:>12,.0f}{flops / 1e9:>10.2f}"
              f"{flops / peak:>16.1%}")


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--sizes", default="small,1m")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--size", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--M", type=int, default=None)
    ap.add_argument("--B", type=int, default=None)
    ap.add_argument("--chunk", type=int, default=None)
    p = ap.parse_args(argv)
    p.sizes = ["test"] if p.quick else p.sizes.split(",")
    p.M = p.M or (16 if p.quick else 200)
    p.B = p.B or (16 if p.quick else 64)
    p.chunk = p.chunk if p.chunk is not None else (8 if p.quick else 25)
    p.gen_batch = 64 if p.quick else 512
    p.train_batch = 64 if p.quick else 256
    return p


def main(argv=None) -> int:
    p = parse(argv)
    if p.threads:
        torch.set_num_threads(p.threads)
    if p.child:
        print(json.dumps(gradients_once(p.size, p.M, p.B, p.device, p.chunk, p.child)))
        return 0
    if p.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is available", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name() if p.device.startswith("cuda") else f"{os.cpu_count()} CPUs"
    print(f"bench_transformer: torch {torch.__version__}, {p.device} ({name}), {torch.get_num_threads()} thread(s)")
    results = {"meta": {"device": p.device, "name": name, "torch": torch.__version__}, "gradients": [],
               "sampling": [], "training": []}
    ok = gradients(p, results)
    sampling(p, results)
    training(p, results)
    if p.json:
        Path(p.json).write_text(json.dumps(results, indent=1))
    print("\nall agreement checks passed" if ok else f"\nFAIL: engine and loop disagree beyond {TOL:g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
