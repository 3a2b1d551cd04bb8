#!/usr/bin/env python
"""Benchmark: one on-policy distillation step of each estimator against vocabulary size, as ratios to vanilla OPD.

    .venv/bin/python benchmarks/bench_real_distillation.py             # V = 10 .. 16384 (about a minute, 1 thread)
    .venv/bin/python benchmarks/bench_real_distillation.py --quick     # smoke test (seconds); exit 1 on a failed check
    .venv/bin/python benchmarks/bench_real_distillation.py --device cuda --vocab 1024 32768 --json out.json

A step is exactly what ``lab.engine.distill.distil`` runs (``Run.step``, its own timers): the student samples B
responses (KV cache, float32), the teacher scores every visited state (its logits [B, T, V]), then the student's
forward pass, the estimator's loss (token-mean), the backward pass and Adam. The task is 2-step chain sums (T = 2)
with V - 10 distractor tokens; teacher and student are the lab's "medium" and "small" transformers at random
initial parameters (a step's cost does not depend on the weights), their embeddings grown to V.

The five estimators (``opd``, ``vopd``, ``vopd_topk``, ``kl_full``, ``kl_topk``, top-k size ``--k``) are timed in the
same process, interleaved (one step of each in turn, ``--repeats`` rounds after ``--warmup`` rounds), so load on a
shared machine hits them alike. Printed per V: the median step time of each, and step and update times as ratios to
vanilla OPD's. In a local trainer OPD computes the teacher's full logits too (the sampled token's log-prob needs
their logsumexp), so the teacher's forward pass costs every estimator the same; what differs is the update.

Checks (any failure exits 1): every step's loss and gradient norm are finite; with k >= V the top-k estimators take
the same gradient as their full-vocabulary versions on the same batch (to float32 rounding).
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.common import finish, load  # noqa: E402

from lab.engine.distill import DIGITS, FAMILY, DistillConfig, Run, random_setup  # noqa: E402

FULL_VOCABS = (10, 256, 1024, 4096, 16384)
QUICK_VOCABS = (10, 256)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke test: V in {10, 256}, B = 32, 3 rounds")
    p.add_argument("--vocab", type=int, nargs="+", help=f"vocabulary sizes (default {' '.join(map(str, FULL_VOCABS))})")
    p.add_argument("--batch", type=int, help="B responses per step (default 128, as the study; quick 32)")
    p.add_argument("--k", type=int, default=4, help="top-k size of vopd_topk and kl_topk (default 4, as the study)")
    p.add_argument("--teacher", default="medium", help="teacher size (default medium)")
    p.add_argument("--student", default="small", help="student size (default small)")
    p.add_argument("--repeats", type=int, help="timed rounds (default 10; quick 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--json", help="write the numbers to this file")
    a = p.parse_args(argv)
    a.vocab = a.vocab or list(QUICK_VOCABS if a.quick else FULL_VOCABS)
    a.batch = a.batch or (32 if a.quick else 128)
    a.repeats = a.repeats or (3 if a.quick else 10)
    if min(a.vocab) < DIGITS or a.k < 1 or a.batch < 1 or a.repeats < 1 or a.warmup < 0:
        p.error(f"vocabulary sizes must be >= {DIGITS} and k, batch, repeats >= 1")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda asked for, but torch sees no GPU")
    return a


def config(p, V: int, estimator: str, k: int | None = None) -> DistillConfig:
    return DistillConfig(distractors=V - DIGITS, teacher_size=p.teacher, student_size=p.student, estimator=estimator,
                         top_k=k or p.k, batch_size=p.batch, steps=10**9, grad_every=0, eval_every=10**9,
                         device=p.device)


def runs_for(p, V: int, k: int | None = None) -> dict:
    """One Run per estimator, every one from the same random networks and seed."""
    setup = random_setup(config(p, V, "opd"))
    return {e: Run(config(p, V, e, k), setup) for e in FAMILY}


def checks(p) -> list[tuple[str, bool, str]]:
    """At the smallest V with k = V: the top-k estimators' gradient equals the full ones' (same batch, same seed)."""
    V = min(p.vocab)
    runs = runs_for(p, V, k=V)
    for r in runs.values():
        r.step(1)
    out = [(f"{e}: loss and gradient norm finite (V={V})",
            all(map(lambda x: torch.isfinite(torch.tensor(x)).item(), (r.rows[0]["loss"], r.rows[0]["grad_norm"]))),
            "") for e, r in runs.items()]
    for topk, full in (("vopd_topk", "vopd"), ("kl_topk", "kl_full")):
        g, g_full = runs[topk].theta.grad, runs[full].theta.grad  # float32: compare gradients, not Adam's steps
        err = float((g - g_full).norm() / g_full.norm())
        out.append((f"{topk} with k = V has {full}'s gradient", err <= 1e-5, f"relative difference {err:.1e}"))
    return out


def measure(p, V: int) -> dict:
    runs = runs_for(p, V)
    times = {e: {"step_s": [], "update_s": [], "sample_s": [], "teacher_s": []} for e in FAMILY}
    for u in range(1, p.warmup + p.repeats + 1):
        for e, r in runs.items():  # interleaved: one step of each in turn
            r.step(u)
            if u > p.warmup:
                for key in times[e]:
                    times[e][key].append(r.rows[-1][key])
        for r in runs.values():
            r.rows.clear()
    cell = {"V": V, "student_params": runs["opd"].setup.student.n_params,
            "teacher_params": runs["opd"].setup.teacher.n_params}
    for e in FAMILY:
        cell[e] = {k: statistics.median(v) for k, v in times[e].items()}
        cell[e]["spread"] = max(times[e]["step_s"]) / min(times[e]["step_s"])
    cell["step_ratio"] = {e: cell[e]["step_s"] / cell["opd"]["step_s"] for e in FAMILY[1:]}
    cell["update_ratio"] = {e: cell[e]["update_s"] / cell["opd"]["update_s"] for e in FAMILY[1:]}
    return cell


def main(argv=None) -> int:
    p = parse(argv)
    torch.set_num_threads(p.threads)
    t_start = time.perf_counter()
    meta = {"mode": "quick" if p.quick else "full", "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "device": p.device, "cpu_count": os.cpu_count(),
            "threads": torch.get_num_threads(), "load_start": load(), "B": p.batch, "T": 2, "k": p.k,
            "teacher": p.teacher, "student": p.student, "repeats": p.repeats, "warmup": p.warmup}
    print(f"bench_real_distillation ({meta['mode']}): torch {meta['torch']}, python {meta['python']}, "
          f"{meta['platform']}")
    print(f"device {p.device}; torch threads {meta['threads']}, os.cpu_count() = {meta['cpu_count']}; load average at "
          f"start: {meta['load_start']}")

    print("\n1. checks")
    check_rows = checks(p)
    for label, ok, note in check_rows:
        print(f"  {'ok  ' if ok else 'FAIL'} {label}{'  (' + note + ')' if note else ''}")
    all_ok = all(ok for _, ok, _ in check_rows)

    print(f"\n2. one step (sample + teacher + update), B = {p.batch} responses of T = 2 tokens, teacher {p.teacher}, "
          f"student {p.student}, k = {p.k}; median of {p.repeats} interleaved rounds")
    print(f"  {'V':>6} {'student':>9} " + " ".join(f"{e:>10}" for e in FAMILY) + "   step ÷ opd: "
          + " ".join(f"{e:>9}" for e in FAMILY[1:]) + "   update ÷ opd: " + " ".join(f"{e:>9}" for e in FAMILY[1:]))
    rows = []
    for V in p.vocab:
        cell = measure(p, V)
        rows.append(cell)
        print(f"  {V:>6} {cell['student_params']:>9,} "
              + " ".join(f"{1e3 * cell[e]['step_s']:>7.1f} ms" for e in FAMILY) + "              "
              + " ".join(f"{cell['step_ratio'][e]:>9.2f}" for e in FAMILY[1:]) + "                "
              + " ".join(f"{cell['update_ratio'][e]:>9.2f}" for e in FAMILY[1:]), flush=True)
    big = rows[-1]
    share = {k: big["opd"][k] / big["opd"]["step_s"] for k in ("sample_s", "teacher_s", "update_s")}
    print(f"\n  at V = {big['V']}: vOPD {big['step_ratio']['vopd']:.2f}x vanilla OPD per step, its top-{p.k} baseline "
          f"{big['step_ratio']['vopd_topk']:.2f}x, full-vocabulary KL {big['step_ratio']['kl_full']:.2f}x, top-{p.k} "
          f"KL {big['step_ratio']['kl_topk']:.2f}x; OPD's step is {share['sample_s']:.0%} sampling, "
          f"{share['teacher_s']:.0%} teacher, {share['update_s']:.0%} update")
    return finish(meta, t_start, check_rows, rows, p.json, all_ok)


if __name__ == "__main__":
    sys.exit(main())
