#!/usr/bin/env python
"""Benchmark: the variance engine's vectorised per-replicate gradients against backward-pass loops.

    .venv/bin/python benchmarks/bench_variance_engine.py              # full run (`make bench`)
    .venv/bin/python benchmarks/bench_variance_engine.py --threads 1  # the same, steadier on a shared machine
    .venv/bin/python benchmarks/bench_variance_engine.py --quick      # smoke test; exits 1 on disagreement
    .venv/bin/python benchmarks/bench_variance_engine.py --json out.json

Engine: ``lab.engine.gradients.replicate_gradients``, called as the variance engine calls it (reusing one [M, D]
output). Baselines: ``lab.engine.gradients.loop_gradients`` with ``per="replicate"`` (one batched backward pass per
replicate batch: the strongest obvious alternative, what a researcher who knows torch writes) and ``per="sample"``
(one backward pass per sample; per replicate for GVPO). All run in this process on the same batches, built as the
variance study builds them. Sections: 1. agreement for every registered estimator (exit 1 beyond the tolerance);
2. speed at B x M = 64 x 1000: per-replicate loop / engine (the ratio to quote) and per-sample loop / engine; 3. the
engine's cost per replicate against V, T, B and M; 4. where its time goes (torch.profiler). Read ratios, not
absolute times.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.common import load  # noqa: E402

import toy_envs  # noqa: E402
from lab import advantages as adv_mod  # noqa: E402
from lab import estimators  # noqa: E402
from lab.engine.batches import Batch, draw_batches  # noqa: E402
from lab.engine.estimator import Estimator  # noqa: E402
from lab.engine.gradients import loop_gradients, replicate_gradients  # noqa: E402
from lab.policies import init_params, make_policy, token_log_probs  # noqa: E402
from lab.studies.variance.study import DEFAULT_ESTIMATORS  # noqa: E402

TOL = 1e-6  # max |engine - loop| / max(1, max |loop|)
TARGET_RATIO = 3.0  # against the per-replicate loop
MODE = "seq-mean-token-sum"  # the engine's default loss_agg_mode
B, G, MU_NOISE, SEED = 64, 8, 0.3, 0
SPEED_CASES = [("tiny_target", "prefix"), ("medium_target", "prefix"), ("medium_target", "markov")]
AGREEMENT_CASES = [("tiny_target", "prefix", estimators.AGG_MODES), ("tiny_target", "markov", [MODE]),
                   ("medium_target", "prefix", [MODE]), ("medium_target", "markov", [MODE]),
                   ("small_eos", "markov", [MODE, "seq-mean-token-mean"])]


@dataclass
class Setup:
    label: str
    policy: object
    theta: torch.Tensor  # float32 pi, as run_study passes it
    batch: Batch  # [M, B, ...]
    adv: torch.Tensor  # [M, B, T]
    extras: dict  # every extra tensor input an estimator may take, replicate axis first

    def args(self, name, mode=MODE, n=None):
        """Positional arguments of replicate_gradients / loop_gradients for the first n replicates."""
        b, s = self.batch, slice(n)
        batch = Batch(b.prompts[s], b.tokens[s], b.mask[s], b.behaviour_log_probs[s], b.rewards[s], b.group_size)
        return self.policy, self.theta, batch, self.adv[s], Estimator.resolve(name, {}, mode)


def make_setup(env_name: str, policy_kind: str, M: int, b: int = B, **overrides) -> Setup:
    env = toy_envs.make(env_name, **overrides)
    policy = make_policy(policy_kind, env)
    gen = torch.Generator().manual_seed(SEED)
    theta_pi = init_params(policy, 1.0, gen)  # float64 logits ~ N(0, 1)
    noise = lambda scale: scale * torch.randn(theta_pi.shape, generator=gen, dtype=theta_pi.dtype)  # noqa: E731
    theta_mu = theta_pi + noise(MU_NOISE)
    batch = draw_batches(env, (policy, theta_mu), M, b, G, gen)
    adv = adv_mod.group_advantages(batch.rewards.reshape(M, b // G, G), "rloo").reshape(M, b)
    adv = adv[..., None] * batch.mask  # broadcast over the mask, as run_study does
    # Extra inputs: a teacher (pi + N(0, 1) logit noise) and a reference policy (pi + N(0, 0.5^2)), as
    # the distillation study builds them; the sampler's log-probs (mu + N(0, 0.1^2)); the group rewards.
    p, t, mask = batch.prompts, batch.tokens, batch.mask
    with torch.no_grad():
        teacher = (theta_pi + noise(1.0)).float()
        extras = {"teacher_logits": policy.logits(teacher, p, t),
                  "teacher_log_prob": token_log_probs(policy, teacher, p, t) * mask,
                  "ref_log_prob": token_log_probs(policy, (theta_pi + noise(0.5)).float(), p, t) * mask,
                  "rollout_log_probs": token_log_probs(policy, (theta_mu + noise(0.1)).float(), p, t) * mask,
                  "rewards": batch.rewards}
    return Setup(f"{env_name}/{policy_kind}", policy, theta_pi.float(), batch, adv, extras)


def median_time(fn, repeats: int):
    """Warm-up call, then the median of ``repeats`` timed calls: (median s, all times)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def compare(candidate, reference) -> dict:
    diff, scale = float((candidate - reference).abs().max()), float(reference.abs().max())
    err = diff / max(1.0, scale)
    return {"max_abs_diff": diff, "grad_scale": scale, "err": err, "ok": err <= TOL}


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}" if seconds < 1 else f"{seconds * 1e3:,.0f}"


def table(title: str, header: list, rows: list, notes=(), left=(0,)) -> None:
    """Print a table; columns whose index is in ``left`` are left-aligned, the others right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]
    fmt = lambda r: "  ".join(c.ljust(w) if i in left else c.rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    print(f"\n{title}\n{fmt(header)}\n{'  '.join('-' * w for w in widths)}")
    print("\n".join(fmt(r) for r in cells))
    print("".join(f"  {n}\n" for n in notes), end="", flush=True)


# ---------------------------------------------------------------------------------------------------------------
def agreement(p, results) -> bool:
    """Engine vs loop for every registered estimator (and again with its optional inputs), dense rewards."""
    checks = {}  # (estimator, extra inputs given) -> [(comparison, where)]
    for name in estimators.names():
        info = estimators.info(name)
        checks[name, info.inputs] = []
        if info.optional_inputs:
            checks[name, info.inputs + info.optional_inputs] = []
    for env_name, policy_kind, modes in AGREEMENT_CASES:
        s = make_setup(env_name, policy_kind, p.check_reps, reward="dense")
        for mode in modes:
            for (name, given), found in checks.items():
                extras = {k: v for k, v in s.extras.items() if k in given}  # "logits" come from theta
                static = {"group_size": G} if "group_size" in given else {}
                args = s.args(name, mode)
                cmp = compare(replicate_gradients(*args, extras=extras, static=static)[0],
                              loop_gradients(*args, extras=extras, static=static))
                found.append((cmp, f"{s.label} {mode}"))
                results["agreement"].append({"setting": s.label, "mode": mode, "estimator": name,
                                             "inputs": list(given), **cmp})
    rows = []
    for (name, given), found in checks.items():
        cmp, where = max(found, key=lambda c: c[0]["err"])
        fails = sum(not c["ok"] for c, _ in found)
        scales = [c["grad_scale"] for c, _ in found]
        rows.append([name, ",".join(given) or "-", "replicate" if "group_size" in given else "sample", len(found),
                     f"{min(scales):.2g}-{max(scales):.2g}", f"{cmp['max_abs_diff']:.1e}", f"{cmp['err']:.1e}",
                     where if cmp["max_abs_diff"] > 0 else "(bit-identical)", f"FAIL x{fails}" if fails else "ok"])
    table(f"1. Agreement, engine vs loop_gradients, every registered estimator: {p.check_reps} replicate(s) x B={B} "
          f"per (setting, mode); tolerance {TOL:g}",
          ["estimator", "extra inputs", "backward per", "checks", "max|g|", "max|diff|", "err", "worst case", ""],
          rows,
          ["err = max|engine - loop| / max(1, max|loop|); the worst (setting, mode) is shown, all are in --json. "
           "Settings: tiny_target/prefix (all",
           "modes), tiny_target/markov, medium_target/prefix and /markov, small_eos/markov (variable length; two "
           "modes), all with reward=dense",
           f"(nonzero advantages). mu = pi + N(0, {MU_NOISE}^2) logit noise; teacher pi + N(0, 1); reference "
           "pi + N(0, 0.5^2); rollout_log_probs",
           "(an optional input: checked without and with it) from mu + N(0, 0.1^2)."],
          left=(0, 1, 2, 7))
    return not any(row[-1] != "ok" for row in rows)


def speed(p, results) -> bool:
    rows, all_ok = [], True
    for env_name, policy_kind in SPEED_CASES:
        s = make_setup(env_name, policy_kind, p.M)
        D, nonzero = s.theta.numel(), float((s.adv != 0).float().mean())
        buffer = torch.empty(p.M, D)  # the variance engine reuses one output buffer across estimators
        for name in DEFAULT_ESTIMATORS:
            t_eng, times = median_time(lambda: replicate_gradients(*s.args(name), out=buffer), p.repeats)
            t_rep, _ = median_time(lambda: loop_gradients(*s.args(name, n=p.replicate_reps), per="replicate"), 1)
            loop_gradients(*s.args(name, n=1))  # warm-up
            t0 = time.perf_counter()
            g_loop = loop_gradients(*s.args(name, n=p.loop_reps))
            t_sub = time.perf_counter() - t0
            # replicates are independent: both loops scale linearly in M
            ratio_rep = t_rep / p.replicate_reps * p.M / t_eng
            ratio = t_sub / p.loop_reps * p.M / t_eng
            cmp = compare(buffer[:p.loop_reps], g_loop)
            all_ok &= cmp["ok"]
            results["speed"].append({"setting": s.label, "D": D, "estimator": name, "M": p.M, "B": B,
                                     "engine_s": t_eng, "engine_times_s": times,
                                     "replicate_loop_replicates": p.replicate_reps, "replicate_loop_s": t_rep,
                                     "ratio_per_replicate_loop": ratio_rep, "loop_replicates": p.loop_reps,
                                     "loop_measured_s": t_sub, "ratio": ratio, **cmp})
            rows.append([s.label, f"{D:,}", f"{nonzero:.2f}", name, ms(t_eng / p.M), f"{max(times) / min(times):.2f}",
                         ms(t_rep / p.replicate_reps), f"{ratio_rep:,.1f}x",
                         "" if ratio_rep >= TARGET_RATIO else "BELOW TARGET",
                         ms(t_sub / p.loop_reps), f"{ratio:,.0f}x", f"{cmp['max_abs_diff']:.1e}",
                         "ok" if cmp["ok"] else "FAIL"])
    table(f"2. Speed at B x M = {B} x {p.M} (G={G}, {MODE}, float32); target {TARGET_RATIO:.0f}x against the "
          f"per-replicate loop",
          ["setting", "D", "adv!=0", "estimator", "engine ms/rep", "spread", "rep-loop ms/rep", "rep-loop/engine", "",
           "sample-loop ms/rep", "sample-loop/engine", "max|diff|", ""], rows,
          [f"engine: all {p.M} replicates into a reused [M, D] buffer, median of {p.repeats} calls after a warm-up "
           "(spread = slowest / fastest call).",
           f"rep-loop: one batched backward pass per replicate (the strongest obvious alternative), timed on "
           f"{p.replicate_reps} replicates after a warm-up, scaled by {p.M}/{p.replicate_reps}.",
           f"sample-loop: one backward pass per sample, timed once on the first {p.loop_reps} replicates "
           f"({p.loop_reps * B:,} backward passes), scaled likewise; max|diff| is on those.",
           "adv!=0: share of nonzero advantages (exact-match rewards are mostly 0 at a random policy; the cost "
           "does not depend on the values)."],
          left=(0, 3, 8))
    return all_ok


def scaling(p, results) -> None:
    base = {"V": 4, "T": 4, "B": B, "M": p.M}
    name = "seq_is"
    for i, (knob, values) in enumerate(p.sweeps.items()):
        per = {}
        for value in values:
            cfg = {**base, knob: value}
            for policy_kind in ("prefix", "markov"):
                s = make_setup("tiny_target", policy_kind, cfg["M"], cfg["B"], vocab_size=cfg["V"], length=cfg["T"])
                buffer = torch.empty(cfg["M"], s.theta.numel())
                t, times = median_time(lambda: replicate_gradients(*s.args(name), out=buffer), p.repeats)
                per[policy_kind, value] = (s.theta.numel(), t / cfg["M"], max(times) / min(times) > 1.5)
                results["scaling"].append({"vary": knob, "policy": policy_kind, **cfg, "D": s.theta.numel(),
                                           "engine_s": t, "engine_times_s": times})
        rows = []
        for value in values:
            row = [value]
            for policy_kind in ("prefix", "markov"):
                D, t, noisy = per[policy_kind, value]
                ref = per.get((policy_kind, base[knob]))
                row += [f"{D:,}", ms(t) + ("*" if noisy else " "), f"{t / ref[1]:.2f}" if ref else ""]
            rows.append(row)
        held = ", ".join(f"{k}={v}" for k, v in base.items() if k != knob)
        table(f"3{'abcd'[i]}. Engine cost per replicate vs {knob} (tiny_target, {held}; {name})",
              [knob, "D prefix", "ms/rep", "x base", "D markov", "ms/rep", "x base"], rows,
              [f"ms/rep = median call time / M; 'x base' relative to {knob}={base[knob]}; * = slowest/fastest repeat "
               "above 1.5 (contended)."] if i == 0 else [])


def where_time_goes(p, results) -> None:
    from torch.profiler import ProfilerActivity, profile
    s = make_setup("medium_target", "prefix", p.M)
    buffer = replicate_gradients(*s.args("seq_is"))[0]  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        replicate_gradients(*s.args("seq_is"), out=buffer)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops)
    results["profile"] = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in ops[:15]]
    table(f"4. Where the engine's time goes: one call, {s.label} (D={s.theta.numel():,}), B x M = {B} x {p.M}, seq_is",
          ["op", "calls", "self ms", "share"],
          [[e.key, e.count, f"{e.self_cpu_time_total / 1e3:.1f}", f"{100 * e.self_cpu_time_total / total:.0f}%"]
           for e in ops[:6]],
          [f"scatter_add_: the index_add_ of the logit gradients into the [M, D] output "
           f"({p.M * s.theta.numel() * 4 / 2**30:.2f} GiB); fill_: zeroing it and vmap's buffers."])


# ---------------------------------------------------------------------------------------------------------------
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test (exits 1 on disagreement too)")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's; --quick: 1)")
    ap.add_argument("--json", metavar="PATH", help="also write every number (raw repeat times included) to PATH")
    p = ap.parse_args(argv)
    p.repeats = 3
    if p.quick:
        p.M, p.loop_reps, p.check_reps, p.replicate_reps = 100, 1, 1, 20
        p.sweeps = {"V": [2, 4], "T": [3, 4], "B": [16, 64], "M": [50, 100]}
        p.threads = p.threads or 1
    else:
        p.M, p.loop_reps, p.check_reps, p.replicate_reps = 1000, 50, 4, 200
        p.sweeps = {"V": [2, 4, 8, 16], "T": [2, 4, 6, 8], "B": [8, 16, 32, 64, 128, 256],
                    "M": [125, 250, 500, 1000, 2000]}
    return p


def main(argv=None) -> int:
    p = parse(argv)
    if p.threads:
        torch.set_num_threads(p.threads)
    meta = {"mode": "quick" if p.quick else "full", "torch": torch.__version__, "platform": platform.platform(),
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "load_start": load(), "M": p.M, "B": B,
            "G": G, "repeats": p.repeats, "loop_replicates": p.loop_reps, "tolerance": TOL}
    print(f"bench_variance_engine ({meta['mode']}): torch {meta['torch']}, {meta['platform']}; {meta['threads']} "
          f"torch thread(s), {meta['cpus']} CPUs, load average {meta['load_start']}")
    results = {"meta": meta, "agreement": [], "speed": [], "scaling": [], "profile": []}
    t_start, ok = time.perf_counter(), True
    for section in (agreement, speed, scaling, where_time_goes):
        t0 = time.perf_counter()
        ok &= section(p, results) is not False
        meta[f"{section.__name__}_s"] = time.perf_counter() - t0
        print(f"  [{section.__name__}: {meta[f'{section.__name__}_s']:.0f} s, load average {load()}]")
    meta["wall_s"], meta["all_agree"] = time.perf_counter() - t_start, ok
    print(f"\nwall time {meta['wall_s']:.0f} s")
    if p.json:
        Path(p.json).write_text(json.dumps(results, indent=1))
        print(f"numbers written to {p.json}")
    print(f"all agreement checks passed (tolerance {TOL:g})" if ok else
          f"FAIL: engine and loop disagree beyond {TOL:g} (rows marked FAIL)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
