#!/usr/bin/env python
"""Benchmark: long responses (T = 64 .. 1024) on the CPU, each path against its strongest obvious alternative.

    .venv/bin/python benchmarks/bench_long_sequences.py                 # T = 64, 128, 256, 512, 1024
    .venv/bin/python benchmarks/bench_long_sequences.py --quick         # T = 16, 64; exits 1 on disagreement
    .venv/bin/python benchmarks/bench_long_sequences.py --json out.json --cap 300 --bound 60
    .venv/bin/python benchmarks/bench_long_sequences.py --sections sampling --paths kv_cache --lengths 1024

1. Sampling: ``TransformerPolicy.generate`` with the KV cache against the same sampler recomputing the whole
   sequence at every token (``kv_cache=False``), the "small" transformer (block size T + 1) on ``long_dense``.
2. Per-replicate gradients: ``lab.engine.gradients.replicate_gradients`` (vmap over replicates of grad, the rows
   backend) against ``loop_gradients(per="replicate")`` (one batched backward pass per replicate), token IS with RLOO
   advantages, the markov policy on ``long_dense`` (the policy the long envs run with: the DP needs it).
3. The reference: the dynamic program (``lab.engine.dp``: grad J and the weight moments) against the Monte Carlo
   reference at a matched 1 % relative standard error on grad J, its cost projected linearly from a timed pilot of
   4,096 samples (``mc_support`` + ``reference_gradient``, whose stated standard error gives the samples needed).

Every timing runs in a fresh process, which also reports its peak memory: the growth of its peak resident set
after the set-up (Linux: freed heap returned with glibc's malloc_trim, then the peak reset through
/proc/self/clear_refs; elsewhere the whole process's maximum resident set). Times are per 1,000 sequences
(sections 1 and 2) or per reference (3). A path whose time at the next length, projected from the last two measured
(a power law in T, at least linear), exceeds ``--cap`` seconds is not run there and is shown projected (marked *).
The "practical" line gives the longest T at which each path stays within ``--bound`` seconds per 1,000
sequences (per reference in section 3), measured, or projected beyond the lengths run. Checks (exit 1 on failure):
the engine equals the loop to 1e-6 of the largest entry; the KV-cache sampler draws the same tokens as the
recomputing one from the same uniforms (float32: at least 90 % of the sequences identical); the Monte Carlo pilot
agrees with the DP within 4 stated standard errors along grad J.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.common import finish_checks, load  # noqa: E402

import toy_envs  # noqa: E402
from lab import advantages as adv_mod  # noqa: E402
from lab.engine import dp  # noqa: E402
from lab.engine.batches import draw_batches  # noqa: E402
from lab.engine.estimator import Estimator  # noqa: E402
from lab.engine.exact import mc_support, reference_gradient  # noqa: E402
from lab.engine.gradients import loop_gradients, replicate_gradients  # noqa: E402
from lab.policies import Perturbed, init_params, make_policy  # noqa: E402
from lab.policies.transformer import TransformerPolicy, size_config  # noqa: E402

PILOT, REL_SE = 4096, 0.01
SECTIONS = {  # section: (path, alternative, unit)
    "sampling": ("kv_cache", "recompute", "s / 1,000 sequences"),
    "gradients": ("engine", "loop", "s / 1,000 sequences"),
    "reference": ("dp", "mc_1pct", "s / reference"),
}


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(key)).split()[1]) * 1024


def _reset_peak() -> int:
    """Return freed heap to the system (glibc's malloc_trim, so that the set-up's freed temporaries are not reused
    unseen), reset the peak resident set to the current one, and return that (0 where unsupported)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status("VmRSS:")
    except OSError:
        return 0


def _peak(before: int) -> int:
    try:
        return _status("VmHWM:") - before if before else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def sampler(T: int):
    env = toy_envs.make("long_dense", length=T)
    policy = TransformerPolicy.for_env(env, replace(size_config("small"), block_size=T + 1))
    theta = policy.init_params(1.0, torch.Generator().manual_seed(0), torch.float32)
    return env, policy, theta


def gradient_batch(T: int, M: int, B: int, G: int = 8):
    env = toy_envs.make("long_dense", length=T)
    policy = make_policy("markov", env)
    g = torch.Generator().manual_seed(0)
    theta = init_params(policy, 1.0, g)
    mu = (Perturbed(policy, policy.noise_table(g), 0.1), theta)
    batch = draw_batches(env, mu, M, B, G, g)
    adv = adv_mod.group_advantages(batch.rewards.reshape(M, B // G, G), "rloo").reshape(M, B)[..., None] * batch.mask
    return policy, theta.float(), batch, adv, Estimator.resolve("token_is", {}, "seq-mean-token-sum")


def reference_world(T: int):
    env = toy_envs.make("long_dense", length=T)
    policy = make_policy("markov", env)
    g = torch.Generator().manual_seed(0)
    theta = init_params(policy, 1.0, g)
    return env, policy, theta, (Perturbed(policy, policy.noise_table(g), 0.1), theta)


def child(section: str, path: str, T: int, n: int, M: int) -> dict:
    """One timed run in this (fresh) process, after a warm-up of the same path at T = 8 (first calls pay one-off
    costs, torch.func's most): {seconds, per, peak_bytes, ...}."""
    if T > 8 and section != "reference":
        child(section, path, 8, 8 * M if section == "gradients" else 2, M)
    if section == "sampling":
        _, policy, theta = sampler(T)
        prompts = torch.arange(n) % 2
        before = _reset_peak()
        t = time.perf_counter()
        policy.generate(theta, prompts, torch.Generator().manual_seed(1), kv_cache=path == "kv_cache")
        seconds = time.perf_counter() - t
        return {"seconds": seconds, "per": seconds * 1000 / n, "peak_bytes": _peak(before), "n": n}
    if section == "gradients":
        policy, theta, batch, adv, est = gradient_batch(T, M, n // M)
        before = _reset_peak()
        t = time.perf_counter()
        if path == "engine":
            replicate_gradients(policy, theta, batch, adv, est)
        else:
            loop_gradients(policy, theta, batch, adv, est, per="replicate")
        seconds = time.perf_counter() - t
        return {"seconds": seconds, "per": seconds * 1000 / n, "peak_bytes": _peak(before), "n": n}
    env, policy, theta, mu = reference_world(T)
    if path == "dp":
        before = _reset_peak()
        t = time.perf_counter()
        grad = dp.policy_gradient(env, policy, theta)
        dp.weight_moments((policy, theta), mu, env)
        seconds = time.perf_counter() - t
        return {"seconds": seconds, "per": seconds, "peak_bytes": _peak(before), "grad_norm": float(grad.norm())}
    grad = dp.policy_gradient(env, policy, theta).reshape(-1)  # the truth the pilot is checked against
    before = _reset_peak()
    t = time.perf_counter()
    support = mc_support(env, policy, theta, PILOT, torch.Generator().manual_seed(1))
    mc_grad, var = reference_gradient(env, policy, theta, support)
    seconds = time.perf_counter() - t
    peak = _peak(before)
    samples = var * PILOT / (REL_SE * float(grad.norm())) ** 2  # tr Cov(one sample) / (1 % of ||grad J||)^2
    z = float((mc_grad.reshape(-1) - grad) @ grad) / float(grad.norm()) / math.sqrt(var)
    return {"seconds": seconds, "per": seconds * samples / PILOT, "peak_bytes": peak, "samples_1pct": samples,
            "pilot_z": z}


def spawn(args, section: str, path: str, T: int) -> dict:
    n = args.sizes[section][path]
    cmd = [sys.executable, __file__, "--child", section, path, str(T), str(n), str(args.M), "--threads",
           str(args.threads)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=args.cap * 3 + 120)
    except subprocess.TimeoutExpired:
        return {"seconds": math.inf, "per": math.inf, "peak_bytes": math.nan, "timed_out": True}
    if out.returncode:
        raise SystemExit(f"error: {' '.join(cmd[2:])} failed: {out.stderr.strip().splitlines()[-1]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def project(points: list[tuple[int, float]], T: int) -> float:
    """A power law in T through the last two measured (T, value) points, evaluated at T; never slower than linear
    (every path here touches each position at least once, so the short lengths' fixed costs do not extrapolate)."""
    return points[-1][1] * (T / points[-1][0]) ** _exponent(points)


def _exponent(points: list[tuple[int, float]]) -> float:
    (t0, v0), (t1, v1) = points[-2], points[-1]
    return max(1.0, math.log(v1 / v0) / math.log(t1 / t0)) if v0 > 0 and v1 > 0 and t1 != t0 else 1.0


def practical(points: list[tuple[int, float]], bound: float) -> str:
    """The longest T within ``bound``: the last measured length before the first that exceeds it, or projected."""
    if points[0][1] > bound:
        return f"none of these lengths (exceeds at T = {points[0][0]}, the shortest)"
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if v1 > bound:
            return f"up to T = {t0} (exceeds at T = {t1})"
    if len(points) < 2:
        return f"beyond T = {points[-1][0]}"
    k, (t1, v1) = _exponent(points), points[-1]
    return f"up to ~T = {t1 * (bound / v1) ** (1 / k):,.0f} (projected as T^{k:.2f})"


def section_run(args, section: str, rows: list) -> dict:
    main_path, alt, unit = SECTIONS[section]
    print(f"\n{section}: {main_path} against {alt} ({unit}; peak = growth of the resident set)")
    print(f"{'T':>6}{main_path:>14}{alt:>14}{'ratio':>9}{'peak ' + main_path:>18}{'peak ' + alt:>16}")
    measured = {main_path: [], alt: []}
    for T in args.lengths:
        res = {}
        for path in (main_path, alt):
            pts = measured[path]
            if path not in args.paths:
                res[path] = {"seconds": math.nan, "per": math.nan, "peak_bytes": math.nan, "skipped": True}
                continue
            guess = project([(t, r["seconds"]) for t, r in pts], T) if len(pts) >= 2 else 0.0
            if guess > args.cap:
                per = project([(t, r["per"]) for t, r in pts], T)
                res[path] = {"seconds": guess, "per": per, "peak_bytes": math.nan, "projected": True}
            else:
                res[path] = spawn(args, section, path, T)
                pts.append((T, res[path]))
        a, b = res[main_path], res[alt]
        ratio = b["per"] / a["per"]
        rows.append({"section": section, "T": T, main_path: a, alt: b, "ratio": ratio})

        def fmt(r):
            return f"{'-':>12} " if r.get("skipped") else f"{r['per']:>12.3g}{'*' if r.get('projected') else ' '}"

        def mib(r):
            return f"{r['peak_bytes'] / 2**20:>14.1f}Mi" if math.isfinite(r["peak_bytes"]) else f"{'-':>16}"
        print(f"{T:>6}{fmt(a):>14}{fmt(b):>14}{ratio:>8.3g}x{mib(a):>18}{mib(b):>16}")
    verdict = {p: practical([(t, r["per"]) for t, r in measured[p]], args.bound)
               for p in (main_path, alt) if measured[p]}
    for p, v in verdict.items():
        print(f"  {p}, practical (<= {args.bound:g} {unit}): {v}")
    return verdict


def checks_at(T: int, args) -> list:
    """Agreement at one length, in this process."""
    out = []
    policy, theta, batch, adv, est = gradient_batch(T, 4, 32)
    a = replicate_gradients(policy, theta, batch, adv, est)[0]
    b = loop_gradients(policy, theta, batch, adv, est, per="replicate")
    diff = float((a - b).abs().max() / b.abs().max().clamp(min=1e-30))
    out.append((f"T={T}: engine equals the per-replicate loop (max rel diff {diff:.1e} <= 1e-6)", diff <= 1e-6))
    _, pol, th = sampler(T)
    prompts = torch.arange(8) % 2
    kv = pol.generate(th, prompts, torch.Generator().manual_seed(1), kv_cache=True)[0]
    rc = pol.generate(th, prompts, torch.Generator().manual_seed(1), kv_cache=False)[0]
    same = float((kv == rc).all(-1).double().mean())
    out.append((f"T={T}: KV cache draws the recomputing sampler's tokens ({same:.0%} of sequences identical)",
                same >= 0.9))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--quick", action="store_true", help="T = 16, 64 and small batches")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: steadier on a shared machine)")
    p.add_argument("--cap", type=float, default=None, help="seconds one timed run may take (projected beyond)")
    p.add_argument("--bound", type=float, default=60.0, help="practical bound: seconds per 1,000 sequences")
    p.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ", ".join(SECTIONS))
    p.add_argument("--lengths", default=None, help="comma-separated response lengths (default 64,...,1024)")
    p.add_argument("--paths", default=None, help="run only these paths (comma-separated, e.g. kv_cache,engine)")
    p.add_argument("--json", default=None)
    p.add_argument("--child", nargs=5, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.child:
        section, path, T, n, M = args.child
        print(json.dumps(child(section, path, int(T), int(n), int(M))))
        return 0
    args.lengths = ([int(t) for t in args.lengths.split(",")] if args.lengths
                    else [16, 64] if args.quick else [64, 128, 256, 512, 1024])
    sections = args.sections.split(",")
    args.paths = args.paths.split(",") if args.paths else [q for v in SECTIONS.values() for q in v[:2]]
    if not set(sections) <= set(SECTIONS):
        p.error(f"unknown section in --sections {args.sections}; choose from {', '.join(SECTIONS)}")
    args.cap = args.cap or (20.0 if args.quick else 120.0)
    args.M = 4 if args.quick else 16
    args.sizes = {"sampling": {"kv_cache": 16 if args.quick else 256, "recompute": 4 if args.quick else 16},
                  "gradients": {"engine": 128 if args.quick else 1024, "loop": 128 if args.quick else 1024},
                  "reference": {"dp": 1, "mc_1pct": 1}}
    t0 = time.perf_counter()
    meta = {"python": platform.python_version(), "torch": torch.__version__, "threads": args.threads,
            "cpus": os.cpu_count(), "load_start": load(), "bound": args.bound, "cap": args.cap,
            "sizes": args.sizes, "M": args.M}
    print(f"bench_long_sequences: torch {torch.__version__}, {os.cpu_count()} CPUs, {args.threads} thread(s); load "
          f"average at start {meta['load_start']}; bound {args.bound:g} s per 1,000 sequences (per reference in 3), "
          f"cap {args.cap:g} s per timed run")
    print(f"sizes: sampling {args.sizes['sampling']['kv_cache']} (KV) and {args.sizes['sampling']['recompute']} "
          f"(recompute) sequences; gradients {args.M} replicates x {args.sizes['gradients']['engine'] // args.M}; "
          f"Monte Carlo pilot {PILOT:,} samples")
    rows, verdicts = [], {}
    for section in sections:
        verdicts[section] = section_run(args, section, rows)
    meta["practical"] = verdicts
    checks = checks_at(min(args.lengths[0], 64), args)
    for r in rows:
        if r["section"] == "reference" and "pilot_z" in r["mc_1pct"]:
            z = r["mc_1pct"]["pilot_z"]
            checks.append((f"T={r['T']}: MC pilot agrees with the DP along grad J (z = {z:.2f}, |z| < 4)", abs(z) < 4))
    return finish_checks(meta, t0, checks, rows, args.json)


if __name__ == "__main__":
    sys.exit(main())
