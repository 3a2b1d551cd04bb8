#!/usr/bin/env python
"""Benchmark: the variance engine's vectorised per-replicate gradients against a per-sample backward loop.

    .venv/bin/python benchmarks/bench_variance_engine.py              # full run (`make bench`)
    .venv/bin/python benchmarks/bench_variance_engine.py --threads 1  # the same, steadier on a shared machine
    .venv/bin/python benchmarks/bench_variance_engine.py --quick      # smoke test; exits 1 on disagreement
    .venv/bin/python benchmarks/bench_variance_engine.py --json out.json

Engine: ``lab.gradients.replicate_gradients``, called as ``lab.variance.run_study`` calls it (one [M, D] output
buffer reused across calls). Baseline: ``lab.gradients.loop_gradients``, one ordinary backward pass per sample
(per replicate batch for GVPO, whose loss couples a group's samples). Both see the same batches, built as the
engine builds them (``draw_batches`` from mu = pi + logit noise, group advantages broadcast over the mask, float32
theta), in the same process. Sections:
  1. agreement of engine and loop for every registered estimator, dense rewards (exit 1 beyond the tolerance);
  2. speed, loop / engine at B x M = 64 x 1000 (the loop timed on a subset of replicates and scaled to M);
  3. the engine's cost per replicate as V, T, B and M vary;
  4. where the engine's time goes (torch.profiler, one call).
Times are medians of a few calls after a warm-up. Read ratios, not absolute times.
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

import toy_envs  # noqa: E402
from lab import advantages as adv_mod  # noqa: E402
from lab import estimators  # noqa: E402
from lab.batch import Batch  # noqa: E402
from lab.gradients import loop_gradients, replicate_gradients  # noqa: E402
from lab.policies import init_params, make_policy, token_log_probs  # noqa: E402
from lab.variance import DEFAULT_ESTIMATORS, draw_batches  # noqa: E402

TOL = 1e-6  # max |engine - loop| / max(1, max |loop|)
TARGET_RATIO = 50.0
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
    static: dict

    def args(self, name, mode=MODE, n=None):
        """Positional arguments of replicate_gradients / loop_gradients for the first n replicates."""
        b, s = self.batch, slice(n)
        batch = Batch(b.prompts[s], b.tokens[s], b.mask[s], b.behaviour_log_probs[s], b.rewards[s], b.group_size)
        return self.policy, self.theta, batch, self.adv[s], name, mode, {}

    def inputs(self, name, optional=False):
        """extras= and static= for estimator ``name``: its required inputs (and its optional ones if asked)."""
        info = estimators.info(name)
        want = set(info.inputs) | (set(info.optional_inputs) if optional else set())
        return ({k: v for k, v in self.extras.items() if k in want},
                {k: v for k, v in self.static.items() if k in want})


def make_setup(env_name: str, policy_kind: str, M: int, b: int = B, **overrides) -> Setup:
    env = toy_envs.make(env_name, **overrides)
    policy = make_policy(policy_kind, env)
    gen = torch.Generator().manual_seed(SEED)
    theta_pi = init_params(policy, 1.0, gen)  # float64 logits ~ N(0, 1)
    noise = lambda scale: scale * torch.randn(theta_pi.shape, generator=gen, dtype=theta_pi.dtype)  # noqa: E731
    theta_mu = theta_pi + noise(MU_NOISE)
    batch = draw_batches(env, policy, theta_mu, M, b, G, gen)
    adv = adv_mod.group_advantages(batch.rewards.reshape(M, b // G, G), "rloo").reshape(M, b)
    adv = adv[..., None] * batch.mask  # broadcast over the mask, as run_study does
    # Extra inputs: a teacher (pi + N(0, 1) logit noise) and a reference policy (pi + N(0, 0.5^2)), as
    # lab.distillation_variance builds them; the sampler's log-probs (mu + N(0, 0.1^2)); the group rewards.
    p, t, mask = batch.prompts, batch.tokens, batch.mask
    with torch.no_grad():
        teacher = (theta_pi + noise(1.0)).float()
        extras = {"teacher_logits": policy.logits(teacher, p, t),
                  "teacher_log_prob": token_log_probs(policy, teacher, p, t) * mask,
                  "ref_log_prob": token_log_probs(policy, (theta_pi + noise(0.5)).float(), p, t) * mask,
                  "rollout_log_probs": token_log_probs(policy, (theta_mu + noise(0.1)).float(), p, t) * mask,
                  "rewards": batch.rewards}
    label = f"{env_name}[{','.join(f'{k}={v}' for k, v in overrides.items())}]" if overrides else env_name
    return Setup(f"{label}/{policy_kind}", policy, theta_pi.float(), batch, adv, extras, {"group_size": G})


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


def table(title: str, header: list, rows: list, notes=()) -> None:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(header)]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa
    print(f"\n{title}\n{fmt(header)}\n{'  '.join('-' * w for w in widths)}")
    print("\n".join(fmt(r) for r in cells))
    print("".join(f"  {n}\n" for n in notes), end="", flush=True)


# ---------------------------------------------------------------------------------------------------------------
def agreement(p, results) -> bool:
    """Engine vs loop for every registered estimator (and again with its optional inputs), dense rewards."""
    worst = {}  # row label -> summary over every (setting, mode)
    for env_name, policy_kind, modes in AGREEMENT_CASES:
        s = make_setup(env_name, policy_kind, p.check_reps, reward="dense")
        for mode in modes:
            for name in estimators.names():
                variants = [False] + ([True] if estimators.info(name).optional_inputs else [])
                for optional in variants:
                    extras, static = s.inputs(name, optional)
                    args = s.args(name, mode)
                    cmp = compare(replicate_gradients(*args, extras=extras, static=static)[0],
                                  loop_gradients(*args, extras=extras, static=static))
                    label = name + (" +" + ",".join(estimators.info(name).optional_inputs) if optional else "")
                    results["agreement"].append({"setting": s.label, "mode": mode, "estimator": label, **cmp})
                    w = worst.setdefault(label, {"name": name, "n": 0, "fail": 0, "scales": [], "cmp": None})
                    w["n"] += 1
                    w["fail"] += not cmp["ok"]
                    w["scales"].append(cmp["grad_scale"])
                    if w["cmp"] is None or cmp["err"] > w["cmp"]["err"]:
                        w["cmp"], w["where"] = cmp, f"{s.label} {mode}"
    rows = []
    for label, w in worst.items():
        info, cmp = estimators.info(w["name"]), w["cmp"]
        per = "replicate" if "group_size" in info.inputs else "sample"
        rows.append([label, ",".join(k for k in info.inputs if k != "group_size") or "-", per, w["n"],
                     f"{min(w['scales']):.2g}-{max(w['scales']):.2g}", f"{cmp['max_abs_diff']:.1e}",
                     f"{cmp['err']:.1e}", w["where"] if cmp["max_abs_diff"] > 0 else "(bit-identical)",
                     "ok" if not w["fail"] else f"FAIL x{w['fail']}"])
    n_pairs = sum(len(m) for *_, m in AGREEMENT_CASES)
    table(f"1. Agreement, engine vs loop_gradients: every registered estimator on {n_pairs} (setting, loss_agg_mode) "
          f"pairs, {p.check_reps} replicate(s) x B={B}; tolerance {TOL:g}",
          ["estimator", "extra inputs", "backward per", "checks", "max|g|", "max|diff|", "err", "worst case", ""],
          rows,
          [f"err = max|engine - loop| / max(1, max|loop|) over replicates and parameters (worst pair shown; every "
           "pair is in --json).",
           "Settings: tiny_target/prefix (all modes), tiny_target/markov, medium_target/prefix and markov, "
           "small_eos/markov (variable length),",
           f"all with reward=dense so the advantages are nonzero; mu = pi + N(0, {MU_NOISE}^2) logit noise. "
           "'+rollout_log_probs': the same estimator",
           "given its optional input (sampler log-probs from mu + N(0, 0.1^2)). Teacher = pi + N(0, 1), reference "
           "= pi + N(0, 0.5^2)."])
    return all(not w["fail"] for w in worst.values())


def speed(p, results) -> bool:
    rows, all_ok = [], True
    for env_name, policy_kind in SPEED_CASES:
        s = make_setup(env_name, policy_kind, p.M)
        nonzero = float((s.adv != 0).float().mean())
        buffer = None
        for name in DEFAULT_ESTIMATORS:
            def engine():
                nonlocal buffer
                buffer = replicate_gradients(*s.args(name), out=buffer)[0]
            t_eng, times = median_time(engine, p.repeats)
            loop_gradients(*s.args(name, n=1))  # warm-up
            t0 = time.perf_counter()
            g_loop = loop_gradients(*s.args(name, n=p.loop_reps))
            t_loop_sub = time.perf_counter() - t0
            t_loop = t_loop_sub / p.loop_reps * p.M  # replicates are independent: scale linearly to M
            cmp = compare(buffer[:p.loop_reps], g_loop)
            all_ok &= cmp["ok"]
            ratio = t_loop / t_eng
            results["speed"].append({"setting": s.label, "D": s.theta.numel(), "estimator": name, "M": p.M, "B": B,
                                     "engine_s": t_eng, "engine_times_s": times, "loop_replicates": p.loop_reps,
                                     "loop_measured_s": t_loop_sub, "loop_scaled_s": t_loop, "ratio": ratio, **cmp})
            rows.append([s.label, f"{s.theta.numel():,}", f"{nonzero:.2f}", name, ms(t_eng / p.M),
                         f"{max(times) / min(times):.2f}", ms(t_loop_sub / p.loop_reps), f"{ratio:,.0f}x",
                         "" if ratio >= TARGET_RATIO else f"< {TARGET_RATIO:.0f}x target",
                         f"{cmp['max_abs_diff']:.1e}", "ok" if cmp["ok"] else "FAIL"])
        del s, buffer
    table(f"2. Speed: loop / engine at B x M = {B} x {p.M} (G={G}, {MODE}, float32; target {TARGET_RATIO:.0f}x)",
          ["setting", "D", "adv!=0", "estimator", "engine ms/rep", "spread", "loop ms/rep", "loop/engine", "",
           "max|diff|", ""], rows,
          [f"engine: replicate_gradients on all {p.M} replicates into a reused [M, D] buffer, median of {p.repeats} "
           "calls after a warm-up; spread = slowest / fastest call.",
           f"loop: loop_gradients timed once on the first {p.loop_reps} of the {p.M} replicates "
           f"({p.loop_reps * B:,} backward passes) after a warm-up, and scaled by {p.M}/{p.loop_reps}.",
           f"max|diff|: engine vs loop on those {p.loop_reps} replicates. adv!=0: share of nonzero advantages (the "
           "exact-match rewards are mostly 0 at a",
           "random policy; section 1 checks with dense rewards; the cost does not depend on the values)."])
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
                del s, buffer
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
          [f"The [M, D] float32 output is {p.M * s.theta.numel() * 4 / 2**30:.2f} GiB: zeroing it and the index_add_ "
           "scatter are memory-bound; the rest is the vmapped loss and its gradient w.r.t. the gathered logits."])


# ---------------------------------------------------------------------------------------------------------------
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke test (exits 1 on disagreement too)")
    ap.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's; --quick: 1)")
    ap.add_argument("--json", metavar="PATH", help="also write every number (raw repeat times included) to PATH")
    p = ap.parse_args(argv)
    p.repeats = 3
    if p.quick:
        p.M, p.loop_reps, p.check_reps = 100, 1, 1
        p.sweeps = {"V": [2, 4], "T": [3, 4], "B": [16, 64], "M": [50, 100]}
        p.threads = p.threads or 1
    else:
        p.M, p.loop_reps, p.check_reps = 1000, 50, 4
        p.sweeps = {"V": [2, 4, 8, 16], "T": [2, 4, 6, 8], "B": [8, 16, 32, 64, 128, 256],
                    "M": [125, 250, 500, 1000, 2000]}
    return p


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main(argv=None) -> int:
    p = parse(argv)
    if p.threads:
        torch.set_num_threads(p.threads)
    t_start = time.perf_counter()
    meta = {"mode": "quick" if p.quick else "full", "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "load_start": load(), "M": p.M, "B": B, "G": G, "repeats": p.repeats, "loop_replicates": p.loop_reps,
            "tolerance": TOL}
    print(f"bench_variance_engine ({meta['mode']}): torch {meta['torch']}, python {meta['python']}, "
          f"{meta['platform']}\ntorch threads {meta['threads']}, {meta['cpu_count']} CPUs, load average "
          f"{meta['load_start']}")
    if os.getloadavg()[0] > (os.cpu_count() or 1) and meta["threads"] > 1:
        print("WARNING: the machine is busy and torch uses several threads: times will be inflated and noisy; "
              "prefer --threads 1.")
    results = {"meta": meta, "agreement": [], "speed": [], "scaling": [], "profile": []}
    ok = True
    for section in (agreement, speed, scaling, where_time_goes):
        t0 = time.perf_counter()
        ok &= section(p, results) is not False
        meta[f"{section.__name__}_wall_s"] = time.perf_counter() - t0
        print(f"  [{section.__name__}: {meta[f'{section.__name__}_wall_s']:.0f} s, load average {load()}]")
    meta["wall_s"], meta["all_agree"] = time.perf_counter() - t_start, ok
    print(f"\nwall time {meta['wall_s']:.0f} s; load average at end {load()}")
    if p.json:
        Path(p.json).parent.mkdir(parents=True, exist_ok=True)
        Path(p.json).write_text(json.dumps(results, indent=1))
        print(f"numbers written to {p.json}")
    if not ok:
        print(f"FAIL: engine and loop disagree beyond {TOL:g} (rows marked FAIL)")
        return 1
    print(f"all agreement checks passed (tolerance {TOL:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
