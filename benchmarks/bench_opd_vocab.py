#!/usr/bin/env python
"""Benchmark: the cost of the on-policy distillation estimators against vocabulary size.

    .venv/bin/python benchmarks/bench_opd_vocab.py    # V = 256 .. 32768, B x T = 8 x 256 (2-4 min, 2 busy cores)
    .venv/bin/python benchmarks/bench_opd_vocab.py --threads 1   # the same, steadier on a shared machine
    .venv/bin/python benchmarks/bench_opd_vocab.py --quick       # smoke test (a few seconds); exit 1 on a failed check
    .venv/bin/python benchmarks/bench_opd_vocab.py --json out.json --vocab 1024 8192 --k 100

What one batch costs a trainer that already holds the student's logits [B, T, V] (float32, requiring grad) and the
teacher's outputs: the student's sampled-token log-probs (a selective log-softmax: gather minus logsumexp), the
estimator's loss from lab.estimators (``opd``, ``vopd``, ``vopd_topk``, ``kl_full``, ``kl_topk``, token-mean), and
the backward pass to the student logits. The model's forward and backward, and the teacher's forward, are the same
for every estimator and are left out, so the ratios here are upper bounds on the end-to-end overhead.

Inputs are random: student and teacher logits ~ N(0, 2^2), tokens sampled from the student. Vanilla OPD needs only
the teacher's log-prob of each sampled token ([B, T]); vOPD and the analytic KL losses need the teacher's
distribution at each sampled state ([B, T, V] here; the top-k variants could make do with the teacher's log-probs at
the student's top-k ids, [B, T, k]). The "teacher input" column gives those sizes: in a distributed trainer moving
them can cost more than the arithmetic timed here.

Printed: time per batch (median of ``--repeats`` calls after a warm-up, and the slowest/fastest spread) for each
estimator and V, and, measured in the same run on the same tensors, the ratios vOPD / OPD (the baseline's overhead),
vOPD top-k / OPD, full-vocabulary KL / OPD and top-k KL / OPD. Checks (any failure exits 1): every loss and gradient
finite; with k >= V the top-k estimators reproduce their full-vocabulary versions; vOPD's and OPD's gradients differ
exactly by the baseline term.
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

from benchmarks.common import finish, load, sync  # noqa: E402

from lab import estimators  # noqa: E402
from lab.estimators.distillation import reverse_kl  # noqa: E402

ESTIMATORS = ("opd", "vopd", "vopd_topk", "kl_full", "kl_topk")
FULL_VOCABS = (256, 1024, 4096, 16384, 32768)
QUICK_VOCABS = (256, 4096)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke test: V in {256, 4096}, B x T = 4 x 64, 3 repeats")
    p.add_argument("--vocab", type=int, nargs="+", help=f"vocabulary sizes (default {' '.join(map(str, FULL_VOCABS))})")
    p.add_argument("--batch", type=int, help="B sequences per batch (default 8; quick 4)")
    p.add_argument("--seq", type=int, help="T tokens per sequence (default 256; quick 64)")
    p.add_argument("--k", type=int, default=100,
                   help="top-k size for vopd_topk and kl_topk (default 100, the release's)")
    p.add_argument("--repeats", type=int, help="timed calls per cell after one warm-up (default 5; quick 3)")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's; quick: 1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the numbers to this file")
    a = p.parse_args(argv)
    a.vocab = a.vocab or list(QUICK_VOCABS if a.quick else FULL_VOCABS)
    a.batch = a.batch or (4 if a.quick else 8)
    a.seq = a.seq or (64 if a.quick else 256)
    a.repeats = a.repeats or (3 if a.quick else 5)
    if a.threads is None and a.quick:
        a.threads = 1
    if min(a.vocab) < 2 or a.k < 1 or a.batch < 1 or a.seq < 1 or a.repeats < 1:
        p.error("vocabulary sizes must be >= 2 and k, batch, seq and repeats >= 1")
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("--device cuda asked for, but torch sees no GPU")
    return a


def make_inputs(B: int, T: int, V: int, seed: int, device: str) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(B, T, V, generator=g)
    teacher_logits = 2.0 * torch.randn(B, T, V, generator=g)
    tokens = torch.multinomial(torch.softmax(logits.reshape(-1, V), -1), 1, generator=g).reshape(B, T)
    teacher_log_prob = torch.log_softmax(teacher_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    out = {"logits": logits, "teacher_logits": teacher_logits, "tokens": tokens, "teacher_log_prob": teacher_log_prob,
           "mask": torch.ones(B, T)}
    return {k: v.to(device) for k, v in out.items()}


def step(name: str, data: dict, hyper: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch: selective log-softmax of the sampled tokens, the estimator's loss, backward to the logits."""
    logits = data["logits"].detach().requires_grad_(True)
    tok = data["tokens"][..., None]
    log_prob = (logits.gather(-1, tok) - torch.logsumexp(logits, -1, keepdim=True)).squeeze(-1)
    info = estimators.info(name)
    extra = {"teacher_log_prob": data["teacher_log_prob"], "logits": logits, "teacher_logits": data["teacher_logits"]}
    loss, _ = info.fn(log_prob, log_prob.detach(), torch.zeros_like(log_prob), data["mask"],
                      loss_agg_mode="token-mean", **hyper, **{k: extra[k] for k in info.inputs})
    (g,) = torch.autograd.grad(loss, logits)
    return loss.detach(), g


def timed(name: str, data: dict, hyper: dict, repeats: int, device: str) -> list[float]:
    step(name, data, hyper)  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        step(name, data, hyper)
        sync(device)
        times.append(time.perf_counter() - t0)
    return times


def checks(p) -> list[tuple[str, bool, str]]:
    """Correctness checks at the smallest vocabulary (float64 for exact comparisons)."""
    V = min(p.vocab)
    data = {k: (v.double() if v.is_floating_point() else v)
            for k, v in make_inputs(2, 16, V, p.seed + 1, "cpu").items()}
    out = []
    res = {}
    for name in ESTIMATORS:
        hyper = {"k": p.k} if "topk" in name else {}
        loss, g = step(name, data, hyper)
        res[name] = g
        ok = bool(torch.isfinite(loss) and torch.isfinite(g).all())
        out.append((f"{name}: loss and gradient finite (V={V})", ok, ""))
    for topk, full in (("vopd_topk", "vopd"), ("kl_topk", "kl_full")):
        _, g = step(topk, data, {"k": V})
        err = float((g - res[full]).abs().max())
        out.append((f"{topk} with k = V equals {full}", err <= 1e-12, f"max |diff| {err:.1e}"))
    # vOPD - OPD gradient w.r.t. the logits: -KL_t / N times d log pi(y_t) / d logits = -KL_t / N (onehot - p)
    p_s = torch.softmax(data["logits"], -1)
    onehot = torch.nn.functional.one_hot(data["tokens"], V).double()
    kl = reverse_kl(data["logits"], data["teacher_logits"])
    want = -(kl / data["mask"].sum())[..., None] * (onehot - p_s)
    err = float((res["vopd"] - res["opd"] - want).abs().max())
    out.append(("vopd - opd gradient = the baseline term", err <= 1e-12, f"max |diff| {err:.1e}"))
    return out


def main(argv=None) -> int:
    p = parse(argv)
    if p.threads:
        torch.set_num_threads(p.threads)
    t_start = time.perf_counter()
    cpus = os.cpu_count()
    meta = {"mode": "quick" if p.quick else "full", "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "device": p.device, "cpu_count": cpus, "threads": torch.get_num_threads(),
            "load_start": load(), "B": p.batch, "T": p.seq, "k": p.k, "repeats": p.repeats, "dtype": "float32",
            "seed": p.seed}
    print(f"bench_opd_vocab ({meta['mode']}): torch {meta['torch']}, python {meta['python']}, {meta['platform']}")
    print(f"device {p.device}; threads: torch.get_num_threads() = {meta['threads']}, os.cpu_count() = {cpus}; "
          f"load average at start: {meta['load_start']}")
    try:
        if os.getloadavg()[0] > (cpus or 1) and torch.get_num_threads() > 1:
            print("WARNING: the machine is busy (1-min load average above the core count): times are inflated and "
                  "noisy; read the ratios, or rerun with --threads 1.")
    except OSError:
        pass

    print("\n1. checks")
    check_rows = checks(p)
    for label, ok, note in check_rows:
        print(f"  {'ok  ' if ok else 'FAIL'} {label}{'  (' + note + ')' if note else ''}")
    all_ok = all(ok for _, ok, _ in check_rows)

    print(f"\n2. time per batch: B x T = {p.batch} x {p.seq} = {p.batch * p.seq} tokens, float32, token-mean, "
          f"k = {p.k}; forward + backward to the student logits (median of {p.repeats}; spread = slowest/fastest)")
    head = f"  {'V':>6} " + " ".join(f"{n:>14}" for n in ESTIMATORS)
    print(head + "   " + " ".join(f"{n + '/opd':>14}" for n in ESTIMATORS[1:]))
    rows = []
    for V in p.vocab:
        data = make_inputs(p.batch, p.seq, V, p.seed, p.device)
        cell = {"V": V, "teacher_input_bytes": {}}
        for name in ESTIMATORS:
            hyper = {"k": p.k} if "topk" in name else {}
            times = timed(name, data, hyper, p.repeats, p.device)
            cell[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times)}
            needs_dist = "logits" in estimators.info(name).inputs
            cell["teacher_input_bytes"][name] = 4 * p.batch * p.seq * (V if needs_dist else 1)
        base = cell["opd"]["median_s"]
        cell["ratio_to_opd"] = {n: cell[n]["median_s"] / base for n in ESTIMATORS[1:]}
        rows.append(cell)
        tcol = " ".join(f"{1e3 * cell[n]['median_s']:>8.1f} ms x{cell[n]['max_s'] / cell[n]['min_s']:.1f}"
                        .rjust(14) for n in ESTIMATORS)
        rcol = " ".join(f"{cell['ratio_to_opd'][n]:>14.2f}" for n in ESTIMATORS[1:])
        print(f"  {V:>6} {tcol}   {rcol}", flush=True)
        del data
    big = rows[-1]
    mb = {n: big["teacher_input_bytes"][n] / 2**20 for n in ("opd", "vopd")}
    print(f"\n  teacher input per batch at V = {big['V']}: {mb['opd']:.3f} MiB for opd (log-prob of the sampled token) "
          f"vs {mb['vopd']:.0f} MiB for vopd / kl_full (full distribution, float32)")
    print(f"  at V = {big['V']}: vOPD costs {big['ratio_to_opd']['vopd']:.2f}x vanilla OPD, the top-{p.k} baseline "
          f"{big['ratio_to_opd']['vopd_topk']:.2f}x, full-vocabulary KL {big['ratio_to_opd']['kl_full']:.2f}x, "
          f"top-{p.k} KL {big['ratio_to_opd']['kl_topk']:.2f}x (estimator cost only, same run, same tensors)")
    return finish(meta, t_start, check_rows, rows, p.json, all_ok)


if __name__ == "__main__":
    sys.exit(main())
