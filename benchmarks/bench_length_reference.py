#!/usr/bin/env python
"""Benchmark: the dynamic-programming reference (``lab.engine.dp``) against a Monte Carlo reference at matched
standard error, and its memory at T = 1024.

    .venv/bin/python benchmarks/bench_length_reference.py              # T = 64, 256, 1024
    .venv/bin/python benchmarks/bench_length_reference.py --quick      # T = 64, 256; exits 1 on disagreement
    .venv/bin/python benchmarks/bench_length_reference.py --json out.json

Env ``long_dense`` (2 prompts, V = 4) at each T with the ``markov`` policy at a random pi (logits ~ N(0, 1)) and a
behaviour mu = pi + 0.1 z (``Perturbed``). For grad J: the DP's cost (one forward-backward pass, exact to float64
rounding) against the Monte Carlo reference of ``lab.engine.exact`` (``mc_support`` + ``reference_gradient``, the
engine's own, with its stated standard error): a pilot of N0 samples is timed and gives tr Cov of one sample's
R grad log pi, so the samples a relative standard error of 1 % needs are n = tr Cov / (0.01 ||grad J||)^2 and
their cost is the pilot's time x n / N0 (sampling and the gradient passes are linear in n). The same for the
sequence KL (``divergence_intervals``' CLT error). Checks (exit 1 on failure): the pilot's grad J agrees with the
DP's within 4 stated standard errors along the DP's direction and in norm; its KL interval (widened to 4 SE) covers
the DP's; the DP's peak memory at T = 1024, measured in a fresh process as the growth of its peak resident set
(Linux: the peak is reset after the imports through /proc/self/clear_refs; the growth at T = 16, the runtime's own
code pages and allocator, is shown beside it), stays within the study's budget; a length study beyond the budget is
refused in one line before any work.
"""
from __future__ import annotations

import argparse
import math
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.common import finish_checks, load  # noqa: E402

import toy_envs  # noqa: E402
from lab.engine import dp  # noqa: E402
from lab.engine.exact import divergence_intervals, mc_support, reference_gradient  # noqa: E402
from lab.errors import LabError  # noqa: E402
from lab.policies import Perturbed, init_params, make_policy  # noqa: E402

PILOT, REL_SE, NOISE = 4096, 0.01, 0.1
MEMORY_PROBE = """
import sys, torch
sys.path.insert(0, {root!r})
import toy_envs
from lab.engine import dp
from lab.policies import Perturbed, init_params, make_policy
env = toy_envs.make("long_dense", length={T})
policy = make_policy("markov", env)
g = torch.Generator().manual_seed(0)
theta = init_params(policy, 1.0, g)
mu = (Perturbed(policy, policy.noise_table(g), 0.1), theta)
def status(key):
    return int(next(line for line in open("/proc/self/status") if line.startswith(key)).split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # reset the peak resident set (VmHWM) to the current one
before = status("VmRSS:")
dp.policy_gradient(env, policy, theta); dp.weight_moments((policy, theta), mu, env)
dp.token_is_gradient(env, policy, theta, mu)
print(status("VmHWM:") - before)
"""


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def case(T: int) -> tuple[dict, list]:
    env = toy_envs.make("long_dense", length=T)
    policy = make_policy("markov", env)
    g = torch.Generator().manual_seed(0)
    theta = init_params(policy, 1.0, g)
    mu = (Perturbed(policy, policy.noise_table(g), NOISE), theta)
    grad, t_grad = timed(lambda: dp.policy_gradient(env, policy, theta).reshape(-1))
    moments, t_mom = timed(lambda: dp.weight_moments((policy, theta), mu, env))
    support, t_sample = timed(lambda: mc_support(env, policy, theta, PILOT, torch.Generator().manual_seed(1)))
    (mc_grad, var), t_ref = timed(lambda: reference_gradient(env, policy, theta, support))
    mc_grad = mc_grad.reshape(-1)
    se = math.sqrt(var)
    n_grad = var * PILOT / (REL_SE * float(grad.norm())) ** 2  # tr Cov(x) / (1 % of ||grad J||)^2
    support_mu, t_mu = timed(lambda: mc_support(env, *mu, PILOT, torch.Generator().manual_seed(2)))
    kl, t_kl = timed(lambda: divergence_intervals((policy, theta), mu, support_mu)["kl_seq"])
    kl_se = (kl[2] - kl[1]) / (2 * 1.959964)
    n_kl = kl_se**2 * PILOT / (REL_SE * moments["kl_seq"]) ** 2
    u = grad / grad.norm()
    z_dir = float((mc_grad - grad) @ u) / se  # the error along one direction has sd <= sqrt(tr Cov)
    row = {"T": T, "dp_grad_s": t_grad, "dp_moments_s": t_mom, "mc_pilot_grad_s": t_sample + t_ref,
           "mc_grad_samples_1pct": n_grad, "mc_grad_s_1pct": (t_sample + t_ref) * n_grad / PILOT,
           "mc_kl_samples_1pct": n_kl, "mc_kl_s_1pct": (t_mu + t_kl) * n_kl / PILOT,
           "grad_rel_se_pilot": se / float(grad.norm()), "z_direction": z_dir,
           "norm_gap_se": abs(float((mc_grad - grad).norm() ** 2) - var) / var, "log_m2": moments["log_m2"],
           "kl_seq": moments["kl_seq"], "dp_memory_count": dp.dp_memory(env)}
    checks = [(f"T={T}: MC grad J agrees with DP along its direction (|z| < 4)", abs(z_dir) < 4),
              (f"T={T}: MC squared error is its stated tr Cov (within 4 x)", 0.25 < float(
                  (mc_grad - grad).norm() ** 2) / var < 4),
              (f"T={T}: MC KL interval (4 SE) covers the DP KL",
               kl[0] - 4 * kl_se <= moments["kl_seq"] <= kl[0] + 4 * kl_se)]
    return row, checks


def memory_at(T: int) -> int:
    root = str(Path(__file__).resolve().parents[1])
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE.format(root=root, T=T)], capture_output=True, text=True,
                         check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--quick", action="store_true", help="T = 64, 256 only")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    meta = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_start": load(), "max_rss_start": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}
    print(f"load average at start: {meta['load_start']}; torch threads {meta['threads']}")
    rows, checks = [], []
    lengths = [64, 256] if args.quick else [64, 256, 1024]
    print(f"{'T':>5} {'DP grad':>9} {'DP moments':>11} {'MC pilot':>9} {'MC n (1%)':>11} {'MC s (1%)':>10} "
          f"{'KL n (1%)':>10} {'KL s (1%)':>10} {'log E[W2]':>9}")
    for T in lengths:
        row, c = case(T)
        rows.append(row)
        checks += c
        print(f"{T:>5} {row['dp_grad_s']:>8.3f}s {row['dp_moments_s']:>10.3f}s {row['mc_pilot_grad_s']:>8.2f}s "
              f"{row['mc_grad_samples_1pct']:>11.3g} {row['mc_grad_s_1pct']:>9.3g}s {row['mc_kl_samples_1pct']:>10.3g} "
              f"{row['mc_kl_s_1pct']:>9.3g}s {row['log_m2']:>9.3g}")
    from lab.studies.length_scaling.study import Config

    T, T0 = max(lengths), 16
    peak, base = memory_at(T), memory_at(T0)
    count = dp.dp_memory(toy_envs.make("long_dense", length=T))
    count0 = dp.dp_memory(toy_envs.make("long_dense", length=T0))
    budget = int(Config().memory_budget * 2**30)
    rows.append({"T": T, "dp_peak_rss_growth": peak, "dp_peak_rss_growth_T16": base, "dp_memory_count": count,
                 "budget": budget})
    print(f"\nDP at T = {T}: peak resident growth {peak / 2**20:.1f} MiB, of which {(peak - base) / 2**20:.1f} MiB "
          f"grow with T (T = {T0}: {base / 2**20:.1f} MiB: the runtime's own); dp_memory counts "
          f"{(count - count0) / 2**20:.1f} MiB of tables; study budget {budget / 2**30:.0f} GiB")
    checks.append((f"DP memory at T={T} within the budget", peak < budget))
    try:
        t = time.perf_counter()
        Config(lengths=[100_000], replicates=1000, batch_size=512).validate()
        refused = ""
    except LabError as e:
        refused = str(e)
        print(f"beyond the budget, refused in {time.perf_counter() - t:.2f} s: {refused}")
    checks.append(("a length study beyond the budget is one line before any work", bool(refused)
                   and "\n" not in refused))
    return finish_checks(meta, t0, checks, rows, args.json)


if __name__ == "__main__":
    sys.exit(main())
