#!/usr/bin/env python
"""Benchmark: the variance engine's vectorised per-replicate gradients against a per-sample Python loop.

    .venv/bin/python benchmarks/bench_variance_engine.py              # full run (2-7 minutes on 2 cores)
    .venv/bin/python benchmarks/bench_variance_engine.py --threads 1  # the same, steadier on a shared machine
    .venv/bin/python benchmarks/bench_variance_engine.py --quick      # smoke test (15-30 s); exit 1 on disagreement
    .venv/bin/python benchmarks/bench_variance_engine.py --json out.json --profile

Candidate: ``lab.gradients.replicate_gradients`` (torch.func vmap over replicates of grad of the estimator loss),
exactly as ``lab.variance.run_study`` calls it. Baseline: ``lab.gradients.loop_gradients`` (one backward pass per
sample), what a researcher would write first. Both see the same batches, built as the engine builds them
(``draw_batches`` from mu, group advantages broadcast over the mask, float32 theta).

Also measured, clearly labelled as a prototype that lives only in this file: ``scatter_gradients``, the same
estimates computed as vmap-grad with respect to the gathered logits [M, B, T, V] and one ``index_add_`` into the
[M, D] output (optionally a buffer reused across calls). See benchmarks/README.md for what it is for.

Sections printed:
  1. agreement of engine (and prototype) with a loop, for every registered estimator, nonzero advantages
     (dense rewards): loop_gradients where it applies; for estimators with extra inputs (teacher, reference
     policy, group rewards), which loop_gradients cannot pass, a per-replicate autograd loop in this file;
  2. speed ratio loop / engine at B x M = 64 x 1000 on tiny_target (prefix) and medium_target (prefix, markov),
     for the engine's default estimators (--estimators to change);
     the loop is timed on a subset of replicates and scaled linearly to M (said in the table);
  3. engine vs prototype on the same settings;
  4. how the engine's cost per replicate grows with V, T, B and M (one table each);
  5. where the engine's time goes on medium_target/prefix: ablations (and torch.profiler with --profile).
Every time is the median of a few repeats after a warm-up call (the loop: one timed run after a warm-up).
Baseline and candidate run in the same process on the same batches; read ratios, not absolute times.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.func import grad, vmap

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import toy_envs  # noqa: E402
from lab import advantages as adv_mod  # noqa: E402
from lab import estimators  # noqa: E402
from lab import gradients as lab_gradients  # noqa: E402
from lab.batch import Batch  # noqa: E402
from lab.gradients import loop_gradients, replicate_gradients  # noqa: E402
from lab.policies import init_params, make_policy  # noqa: E402
from lab.variance import draw_batches  # noqa: E402

TOL = 1e-6  # max |engine - loop| / max(1, max |loop|)
TARGET_RATIO = 50.0
NOISY_SPREAD = 1.5  # slowest / fastest repeat above this marks a scaling-table cell as contended
DEFAULT_MODE = "seq-mean-token-sum"  # the engine's default loss_agg_mode (VarianceConfig)
SPEED_ESTIMATORS = ("reinforce", "seq_is", "token_is", "ppo_clip")  # lab.variance.DEFAULT_ESTIMATORS
# replicate_gradients / loss_fn take the estimators' extra inputs (teacher, reference, group rewards) when this holds
EXTRAS_API = "static" in inspect.signature(lab_gradients.loss_fn).parameters
STATIC_INPUTS = ("group_size",)  # extra inputs that are plain values, not tensors with a replicate axis


# ---------------------------------------------------------------------------------------------------------------
# Prototype (not lab code): per-replicate gradients in logit space, scattered once into the [M, D] output.
# ---------------------------------------------------------------------------------------------------------------
class LogitsAsParameters:
    """Stand-in policy whose parameters are the gathered logits themselves, so that lab's own per-batch loss
    (lab.gradients.loss_fn: log_softmax, gather, mask, the estimator, its extra inputs) is differentiated with
    respect to the logits [B, T, V] instead of theta."""

    @staticmethod
    def logits(theta, prompts, tokens):
        return theta


def _loss(policy, name, loss_agg_mode, hyper, static):
    """lab.gradients.loss_fn, negated: the sign of the ascent direction is folded into the loss."""
    if EXTRAS_API:
        loss = lab_gradients.loss_fn(policy, name, loss_agg_mode, hyper, static)
    else:  # the signature before extra inputs existed
        loss = lab_gradients.loss_fn(policy, name, loss_agg_mode, hyper)

    def ascent_loss(*args):
        value, metrics = loss(*args)
        return -value, metrics

    return ascent_loss


def _data(batch, advantages, extras):
    data = (batch.prompts, batch.tokens, batch.mask, batch.behaviour_log_probs, advantages)
    return data + (extras or {},) if EXTRAS_API else data


def scatter_gradients(policy, theta, batch, advantages, name, loss_agg_mode, hyper, extras=None, static=None,
                      out=None):
    """Same result as ``replicate_gradients`` for tabular policies (logits = embedding(rows, theta.view(-1, V))).

    vmap(grad) is taken with respect to the gathered logits [B, T, V] of each replicate, so no per-replicate dense
    [D] gradient, no chunk concatenation and no negation copy is ever materialised; the [M, B, T, V] logit
    gradients are added into a single [M * R, V] table with one index_add_. ``out`` ([M, D], reused across
    calls) avoids page-faulting a fresh M x D allocation on every call. Every dependence of the loss on theta
    goes through the gathered logits, so this holds for estimators that use the full logits too.
    """
    V = policy.vocab_size
    table = theta.reshape(-1, V)
    R = table.shape[0]
    M = batch.prompts.shape[0]
    rows = policy.rows(batch.prompts, batch.tokens)  # [M, B, T]
    logits = F.embedding(rows, table)  # [M, B, T, V], plain data: the gradient is taken w.r.t. it
    ascent_loss = _loss(LogitsAsParameters(), name, loss_agg_mode, hyper, static)
    g, metrics = vmap(grad(ascent_loss, has_aux=True))(logits, *_data(batch, advantages, extras))
    if out is None:
        out = torch.zeros(M, R * V, dtype=theta.dtype)
    else:
        out.zero_()
    index = (rows + torch.arange(M)[:, None, None] * R).reshape(-1)
    out.view(M * R, V).index_add_(0, index, g.reshape(-1, V))
    return out, metrics


def generic_gradients(policy, theta, batch, advantages, name, loss_agg_mode, hyper, extras=None, static=None,
                      out=None, chunk_size=128):
    """Ablation of ``replicate_gradients`` that works for any policy (no tabular structure used).

    Same vmap(grad w.r.t. theta), but the sign is folded into the loss (no ``-grads`` copy of [M, D]) and, when
    ``out`` is given, each chunk's [chunk, D] gradients are copied into it instead of vmap's chunk concatenation
    (a fresh [M, D] tensor). Each chunk still materialises a dense [chunk, D] gradient (embedding backward).
    """
    data = _data(batch, advantages, extras)
    per_batch = grad(_loss(policy, name, loss_agg_mode, hyper, static), has_aux=True)
    in_dims = (None,) + (0,) * len(data)
    if out is None:
        g, metrics = vmap(per_batch, in_dims=in_dims, chunk_size=chunk_size)(theta, *data)
        return g.reshape(g.shape[0], -1), metrics
    M = batch.prompts.shape[0]
    parts = []
    for lo in range(0, M, chunk_size):
        chunk = [x[lo:lo + chunk_size] for x in data[:5]] + [{k: v[lo:lo + chunk_size] for k, v in x.items()}
                                                             for x in data[5:]]
        g, metrics = vmap(per_batch, in_dims=in_dims)(theta, *chunk)
        out[lo:lo + chunk_size] = g.reshape(g.shape[0], -1)
        parts.append(metrics)
    return out, {k: torch.cat([m[k] for m in parts]) for k in parts[0]}


def replicate_loop_gradients(policy, theta, batch, advantages, name, loss_agg_mode, hyper, extras, static):
    """Reference for estimators that need extra inputs, which ``loop_gradients`` cannot pass: a Python loop with
    one ordinary backward pass per replicate batch (no vmap, no torch.func), written from the registry contract."""
    info = estimators.info(name)
    wanted = set(info.inputs) | set(info.optional_inputs)
    M = batch.prompts.shape[0]
    out = torch.zeros(M, theta.numel(), dtype=theta.dtype)
    for m in range(M):
        th = theta.detach().clone().requires_grad_(True)
        logits = policy.logits(th, batch.prompts[m], batch.tokens[m])
        log_prob = torch.log_softmax(logits, -1).gather(-1, batch.tokens[m][..., None]).squeeze(-1) * batch.mask[m]
        named = {k: v[m] for k, v in extras.items()} | {"logits": logits} | dict(static)
        loss, _ = info.fn(log_prob, batch.behaviour_log_probs[m], advantages[m], batch.mask[m],
                          loss_agg_mode=loss_agg_mode, **hyper, **{k: v for k, v in named.items() if k in wanted})
        loss.backward()
        out[m] = -th.grad.reshape(-1)
    return out


# ---------------------------------------------------------------------------------------------------------------
# Batches, as the engine builds them
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Case:
    env: str
    policy: str
    overrides: dict = field(default_factory=dict)

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.overrides.items())
        return f"{self.env}[{extra}]/{self.policy}" if extra else f"{self.env}/{self.policy}"


@dataclass
class Setup:
    env: object
    policy: object
    theta: torch.Tensor  # float32 pi, as run_study passes it
    batch: Batch  # [M, B, ...]
    adv: torch.Tensor  # [M, B, T]

    @property
    def D(self) -> int:
        return self.theta.numel()


def make_setup(case: Case, M: int, B: int, G: int, seed: int, mu_noise: float, advantage: str = "rloo") -> Setup:
    env = toy_envs.make(case.env, **case.overrides)
    policy = make_policy(case.policy, env)
    gen = torch.Generator().manual_seed(seed)
    theta_pi = init_params(policy, 1.0, gen)  # float64 logits ~ N(0, 1)
    theta_mu = theta_pi + mu_noise * torch.randn(theta_pi.shape, generator=gen, dtype=theta_pi.dtype)
    batch = draw_batches(env, policy, theta_mu, M, B, G, gen)
    adv = adv_mod.group_advantages(batch.rewards.reshape(M, B // G, G), advantage).reshape(M, B)
    adv = adv[..., None] * batch.mask  # broadcast over the mask, as run_study does
    return Setup(env, policy, theta_pi.float(), batch, adv)


def make_extras(s: Setup, G: int, seed: int) -> tuple[dict, dict]:
    """Every extra input an estimator may require, for the batches of ``s`` (replicate axis first): a teacher
    (pi + N(0, 1) logit noise) and a reference policy (pi + N(0, 0.5^2)), as lab.distillation_variance builds
    its teacher tensors; the group rewards; the group size (static)."""
    gen = torch.Generator().manual_seed(seed + 1)
    b = s.batch
    noise = lambda scale: scale * torch.randn(s.theta.shape, generator=gen)  # noqa: E731
    with torch.no_grad():
        t_logits = s.policy.logits(s.theta + noise(1.0), b.prompts, b.tokens)
        t_log_prob = torch.log_softmax(t_logits, -1).gather(-1, b.tokens[..., None]).squeeze(-1) * b.mask
        r_logits = s.policy.logits(s.theta + noise(0.5), b.prompts, b.tokens)
        r_log_prob = torch.log_softmax(r_logits, -1).gather(-1, b.tokens[..., None]).squeeze(-1) * b.mask
    tensors = {"teacher_logits": t_logits, "teacher_log_prob": t_log_prob, "ref_log_prob": r_log_prob,
               "rewards": b.rewards}
    return tensors, {"group_size": G}


def needs(name: str) -> tuple[str, ...]:
    """Required extra inputs other than ``logits`` (which the loss computes from theta)."""
    return tuple(k for k in estimators.info(name).inputs if k != "logits")


def head(s: Setup, n: int) -> tuple[Batch, torch.Tensor]:
    b = s.batch
    return Batch(b.prompts[:n], b.tokens[:n], b.mask[:n], b.behaviour_log_probs[:n], b.rewards[:n], b.group_size), s.adv[:n]


# ---------------------------------------------------------------------------------------------------------------
# Timing and comparison helpers
# ---------------------------------------------------------------------------------------------------------------
def time_fast(fn, repeats: int):
    """Warm-up call, then the median of ``repeats`` timed calls. Returns (median s, all times, last output)."""
    out = fn()
    times = []
    for _ in range(repeats):
        del out
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times, out


def time_loop(s: Setup, n: int, name: str, mode: str):
    """Warm-up on one replicate, then one timed run of loop_gradients on the first ``n`` replicates."""
    b1, a1 = head(s, 1)
    loop_gradients(s.policy, s.theta, b1, a1, name, mode, {})
    bn, an = head(s, n)
    t0 = time.perf_counter()
    g = loop_gradients(s.policy, s.theta, bn, an, name, mode, {})
    return time.perf_counter() - t0, g


def compare(candidate: torch.Tensor, reference: torch.Tensor) -> dict:
    diff = float((candidate - reference).abs().max())
    scale = float(reference.abs().max())
    err = diff / max(1.0, scale)
    return {"max_abs_diff": diff, "grad_scale": scale, "err": err, "ok": bool(err <= TOL)}


def fmt_t(seconds: float) -> str:
    """Milliseconds with 3 significant figures."""
    ms = seconds * 1e3
    return f"{ms:.3g}" if ms < 1000 else f"{ms:,.0f}"


def fmt_x(ratio: float) -> str:
    return f"{ratio:,.0f}x" if ratio >= 100 else f"{ratio:.1f}x"


def table(title: str, header: list[str], rows: list[list], notes: list[str] = ()) -> None:
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(header)]
    line = "  ".join("-" * w for w in widths)
    print(f"\n{title}")
    print("  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(header, widths))))
    print(line)
    for r in cells:
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))))
    for n in notes:
        print(f"  {n}")
    sys.stdout.flush()


def load() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


# ---------------------------------------------------------------------------------------------------------------
# Sections
# ---------------------------------------------------------------------------------------------------------------
def agreement(p, results) -> bool:
    """Engine and prototype vs a loop reference, every registered estimator, nonzero advantages (dense rewards)."""
    dense = {"reward": "dense"}
    checks = [(Case("tiny_target", "prefix", dense), list(estimators.AGG_MODES)),
              (Case("tiny_target", "markov", dense), [DEFAULT_MODE]),
              (Case("medium_target", "prefix", dense), [DEFAULT_MODE]),
              (Case("medium_target", "markov", dense), [DEFAULT_MODE]),
              (Case("small_eos", "markov", dense), [DEFAULT_MODE, "seq-mean-token-mean"])]
    worst, all_ok = {}, True  # estimator -> summary over every (setting, mode)
    for case, modes in checks:
        s = make_setup(case, p.check_reps, p.B, p.G, p.seed, p.mu_noise)
        tensors, static = make_extras(s, p.G, p.seed)
        nonzero = float((s.adv != 0).float().mean())
        for mode in modes:
            for name in estimators.names():
                need = needs(name)
                args = (s.policy, s.theta, s.batch, s.adv, name, mode, {})
                if not need:
                    reference = "loop_gradients"
                    ref = loop_gradients(*args)
                    eng_g = replicate_gradients(*args)[0]
                    pro_g = scatter_gradients(*args)[0]
                elif not EXTRAS_API:
                    worst[name] = {"reference": f"none: lab cannot pass {', '.join(need)}"}
                    continue
                else:  # loop_gradients cannot pass extra inputs: one backward per replicate batch instead
                    reference = "per-replicate loop"
                    ex = {k: tensors[k] for k in need if k in tensors}
                    st = {k: static[k] for k in need if k in static}
                    ref = replicate_loop_gradients(*args, ex, st)
                    eng_g = replicate_gradients(*args, extras=ex, static=st)[0]
                    pro_g = scatter_gradients(*args, extras=ex, static=st)[0]
                eng, pro = compare(eng_g, ref), compare(pro_g, ref)
                all_ok &= eng["ok"] and pro["ok"]
                rec = {"setting": case.label, "D": s.D, "estimator": name, "loss_agg_mode": mode,
                       "reference": reference, "inputs": list(need), "replicates": p.check_reps,
                       "nonzero_adv_frac": nonzero, "engine": eng, "prototype": pro}
                results["agreement"].append(rec)
                w = worst.setdefault(name, {"reference": reference, "checks": 0, "scale": [], "eng": None,
                                            "pro": None, "fail": 0})
                w["checks"] += 1
                w["scale"].append(eng["grad_scale"])
                w["fail"] += not (eng["ok"] and pro["ok"])
                if w["eng"] is None or eng["err"] > w["eng"][0]["err"]:
                    w["eng"] = (eng, f"{case.label} {mode}")
                if w["pro"] is None or pro["err"] > w["pro"]["err"]:
                    w["pro"] = pro
    rows = []
    for name in estimators.names():
        w = worst[name]
        if "checks" not in w:
            rows.append([name, w["reference"], "", "", "", "", "", "", "skipped"])
            continue
        eng, where = w["eng"]
        rows.append([name, w["reference"], w["checks"], f"{min(w['scale']):.2g}-{max(w['scale']):.2g}",
                     f"{eng['max_abs_diff']:.1e}", f"{eng['err']:.1e}", f"{w['pro']['err']:.1e}",
                     where if eng["max_abs_diff"] > 0 else "(bit-identical everywhere)",
                     "ok" if not w["fail"] else f"FAIL x{w['fail']}"])
    n_settings = sum(len(m) for _, m in checks)
    table(f"1. Agreement with a loop reference: every registered estimator on {n_settings} (setting, loss_agg_mode) "
          f"pairs, {p.check_reps} replicates x B={p.B} each; tolerance {TOL:g}",
          ["estimator", "reference", "checks", "max|g|", "max|diff|", "err engine", "err proto", "worst case", ""],
          rows,
          [f"err = max|candidate - reference| / max(1, max|reference|) over all replicates and parameters; pass if "
           f"<= {TOL:g}. Columns show the",
           "worst (setting, mode) pair per estimator; every pair is in --json. Settings: tiny_target/prefix (all four "
           "modes), tiny_target/markov,",
           "medium_target/prefix and markov, small_eos/markov (variable length; two modes), all with reward=dense so "
           "the advantages are nonzero:",
           "with the exact-match presets and a random policy almost every reward is 0, and the check would be "
           "trivially 0 = 0.",
           f"mu = pi + N(0, {p.mu_noise}^2) logit noise, so importance weights, clipping and masking are exercised.",
           "reference: loop_gradients (one backward per sample) where it applies; for estimators with extra inputs "
           "(teacher, reference policy,",
           "group rewards), which loop_gradients cannot pass, a per-replicate loop in this file (one ordinary "
           "backward per batch, no torch.func)."])
    return all_ok


def speed(p, results) -> bool:
    cases = [Case("tiny_target", "prefix"), Case("medium_target", "prefix"), Case("medium_target", "markov")]
    rows, proto_rows, all_ok = [], [], True
    for case in cases:
        s = make_setup(case, p.M, p.B, p.G, p.seed, p.mu_noise)
        nonzero = float((s.adv != 0).float().mean())
        buffer = torch.empty(p.M, s.D, dtype=s.theta.dtype)
        for name in p.speed_estimators:
            args = (s.policy, s.theta, s.batch, s.adv, name, DEFAULT_MODE, {})
            t_eng, times_eng, (g_eng, _) = time_fast(lambda: replicate_gradients(*args), p.repeats)
            g_eng = g_eng[:p.loop_reps].clone()  # keep only what the loop is compared on
            t_pro, times_pro, _ = time_fast(lambda: scatter_gradients(*args), p.repeats)
            t_buf, times_buf, _ = time_fast(lambda: scatter_gradients(*args, out=buffer), p.repeats)
            t_loop_sub, g_loop = time_loop(s, p.loop_reps, name, DEFAULT_MODE)
            t_loop = t_loop_sub / p.loop_reps * p.M  # measured per-replicate time x M
            cmp = compare(g_eng, g_loop)
            all_ok &= cmp["ok"]
            ratio = t_loop / t_eng
            rec = {"setting": case.label, "D": s.D, "estimator": name, "M": p.M, "B": p.B, "G": p.G,
                   "nonzero_adv_frac": nonzero, "engine_s": t_eng, "engine_times_s": times_eng,
                   "loop_measured_replicates": p.loop_reps, "loop_measured_s": t_loop_sub, "loop_scaled_s": t_loop,
                   "ratio_loop_over_engine": ratio, "prototype_s": t_pro, "prototype_times_s": times_pro,
                   "prototype_buffer_s": t_buf, "prototype_buffer_times_s": times_buf, "agreement": cmp}
            results["speed"].append(rec)
            rows.append([case.label, f"{s.D:,}", f"{nonzero:.2f}", name, fmt_t(t_eng / p.M), f"{max(times_eng) / min(times_eng):.2f}",
                         fmt_t(t_loop_sub / p.loop_reps),
                         fmt_x(ratio), "" if ratio >= TARGET_RATIO else f"< {TARGET_RATIO:.0f}x",
                         f"{cmp['max_abs_diff']:.1e}", "ok" if cmp["ok"] else "FAIL"])
            proto_rows.append([case.label, name, fmt_t(t_eng / p.M), fmt_t(t_pro / p.M), fmt_t(t_buf / p.M),
                               fmt_x(t_eng / t_pro), fmt_x(t_eng / t_buf), fmt_x(t_loop / t_buf)])
        del buffer, s
    table(f"2. Speed: loop / engine at B x M = {p.B} x {p.M} (G={p.G}, {DEFAULT_MODE}, float32)",
          ["setting", "D", "adv!=0", "estimator", "engine ms/rep", "spread", "loop ms/rep", "loop/engine", "",
           "max|diff|", ""], rows,
          [f"engine: replicate_gradients on all {p.M} replicates, median of {p.repeats} calls after a warm-up; "
           "spread = slowest / fastest call.",
           f"loop: loop_gradients timed on the first {p.loop_reps} of the {p.M} replicates ({p.loop_reps * p.B:,} "
           f"backward passes) after a warm-up;",
           f"      loop time at M={p.M} = measured per-replicate time x {p.M} (replicates are independent).",
           f"max|diff|: engine vs loop on those {p.loop_reps} replicates. adv!=0: share of nonzero advantages; the "
           "presets' exact-match rewards",
           "are mostly 0 at a random policy (section 1 checks with nonzero advantages); the cost does not depend on "
           "the reward values."])
    table(f"3. Prototype (this file only): engine vs logit-space scatter, B x M = {p.B} x {p.M}",
          ["setting", "estimator", "engine ms/rep", "scatter", "scatter+buf", "engine/scatter", "engine/scatter+buf",
           "loop/scatter+buf"], proto_rows,
          ["scatter: vmap(grad) w.r.t. the gathered logits [B, T, V], sign folded into the loss, one index_add_ into a",
           "          fresh [M, D] zeros tensor. scatter+buf: the same into one [M, D] buffer reused across calls.",
           "Same numbers as the engine (section 1 checks the prototype against the loop too)."])
    return all_ok


def scaling(p, results) -> None:
    base = dict(V=4, T=4, B=p.B, M=p.M)
    sweeps = {"V": p.scale_V, "T": p.scale_T, "B": p.scale_B, "M": p.scale_M}
    name = p.scaling_estimator
    for i, (knob, values) in enumerate(sweeps.items()):
        per = {}  # (policy, value) -> (D, engine s/rep, prototype s/rep)
        for value in values:
            cfg = {**base, knob: value}
            for pol in ("prefix", "markov"):
                case = Case("tiny_target", pol, {"vocab_size": cfg["V"], "length": cfg["T"]})
                s = make_setup(case, cfg["M"], cfg["B"], p.G, p.seed, p.mu_noise)
                args = (s.policy, s.theta, s.batch, s.adv, name, DEFAULT_MODE, {})
                t_eng, times_eng, _ = time_fast(lambda: replicate_gradients(*args), p.repeats)
                t_pro, times_pro, _ = time_fast(lambda: scatter_gradients(*args), p.repeats)
                noisy = max(times_eng) / min(times_eng) > NOISY_SPREAD
                per[pol, value] = (s.D, t_eng / cfg["M"], t_pro / cfg["M"], noisy)
                results["scaling"].append({"vary": knob, "policy": pol, **cfg, "D": s.D, "estimator": name,
                                           "engine_s": t_eng, "engine_times_s": times_eng, "prototype_s": t_pro,
                                           "prototype_times_s": times_pro})
                del s
        rows = []
        for value in values:
            row = [str(value)]
            for pol in ("prefix", "markov"):
                D, t_eng, t_pro, noisy = per[pol, value]
                ref = per.get((pol, base[knob]))
                row += [f"{D:,}", fmt_t(t_eng) + ("*" if noisy else " "), f"{t_eng / ref[1]:.2f}" if ref else "",
                        fmt_t(t_pro)]
            rows.append(row)
        held = ", ".join(f"{k}={v}" for k, v in base.items() if k != knob)
        table(f"4{'abcd'[i]}. Engine cost per replicate vs {knob} (tiny_target overrides, {held}; {name})",
              [knob, "D prefix", "engine ms/rep", "x base", "scatter", "D markov", "engine ms/rep", "x base",
               "scatter"], rows,
              [f"ms/rep = median call time / M; 'x base' = engine time per replicate relative to {knob}={base[knob]};",
               "'scatter' = the prototype of section 3, for reference; * = slowest/fastest repeat above "
               f"{NOISY_SPREAD} (a contended measurement).",
               "A busy machine can also slow all repeats of one row alike, which no spread shows: compare a "
               "--threads 1 run."] if i == 0 else [])


def breakdown(p, results) -> None:
    """Where the engine's time goes on medium_target/prefix (D ~ 150k): ablations, then torch.profiler."""
    s = make_setup(Case("medium_target", "prefix"), p.M, p.B, p.G, p.seed, p.mu_noise)
    name = p.scaling_estimator
    args = (s.policy, s.theta, s.batch, s.adv, name, DEFAULT_MODE, {})
    buffer = torch.empty(p.M, s.D, dtype=s.theta.dtype)
    reference = replicate_gradients(*args)[0]
    variants = [
        ("engine: replicate_gradients (lab)", lambda: replicate_gradients(*args)),
        ("  fold the sign into the loss (no -grads copy)", lambda: generic_gradients(*args)),
        ("  + chunks copied into a reused [M, D] buffer (no cat)", lambda: generic_gradients(*args, out=buffer)),
        ("scatter: grad w.r.t. logits, one index_add_ (fresh zeros)", lambda: scatter_gradients(*args)),
        ("scatter into a reused [M, D] buffer", lambda: scatter_gradients(*args, out=buffer)),
    ]
    rows, t_ref = [], None
    for label, fn in variants:
        t, times, (g, _) = time_fast(fn, p.repeats)
        same = compare(g, reference)
        del g
        t_ref = t_ref or t
        results["breakdown"].append({"variant": label.strip(), "s": t, "times_s": times, "vs_engine": same})
        rows.append([label, fmt_t(t / p.M), f"{t_ref / t:.1f}x", f"{same['max_abs_diff']:.1e}"])
    gb = p.M * s.D * 4 / 2**30
    table(f"5. Where the engine's time goes: medium_target/prefix (D={s.D:,}), B x M = {p.B} x {p.M}, {name}",
          ["variant", "ms/rep", "speed-up", "max|diff| vs engine"], rows,
          [f"The [M, D] float32 output is {gb:.2f} GiB. The engine writes it (or [128, D] chunks of it) three times, "
           "each into a fresh",
           "allocation: the zero-fill of embedding_dense_backward per chunk, vmap's torch.cat of the chunks, and the "
           "-grads copy.",
           "A fresh large allocation costs page faults on first touch; rewriting warm memory is several times "
           "cheaper."])
    if not p.profile:
        return
    from torch.profiler import ProfilerActivity, profile
    for label, fn in [variants[0], variants[-1]]:
        fn()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
        ev = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        total = sum(e.self_cpu_time_total for e in ev)
        prow = [[e.key, e.count, f"{e.self_cpu_time_total / 1e3:.1f}", f"{100 * e.self_cpu_time_total / total:.0f}%"]
                for e in ev[:8]]
        results["profile"].append({"variant": label.strip(), "ops": [{"op": e.key, "calls": e.count,
                                                                       "self_ms": e.self_cpu_time_total / 1e3}
                                                                      for e in ev[:15]]})
        table(f"5'. torch.profiler, one call of: {label.strip()}", ["op", "calls", "self ms", "share"], prow)


# ---------------------------------------------------------------------------------------------------------------
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="small sizes (under a minute): a smoke test; like the full run, exits 1 on disagreement")
    ap.add_argument("--json", metavar="PATH", help="also write every number (raw repeat times included) to PATH")
    ap.add_argument("--profile", action="store_true",
                    help="add torch.profiler tables to section 5 (with --quick: run section 5, which --quick skips)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (default: torch's default; --quick: 1, so that the smoke test's run "
                         "time does not depend on how busy a shared machine is)")
    ap.add_argument("--replicates", type=int, help="M for sections 2, 3, 5 and the base of 4 (full 1000, quick 100)")
    ap.add_argument("--loop-replicates", type=int, help="replicates the loop is timed on (full 50, quick 1)")
    ap.add_argument("--repeats", type=int, help="timed calls per fast-path measurement (full 3, quick 3)")
    ap.add_argument("--estimators", nargs="+", metavar="NAME",
                    help="estimators timed in sections 2-3 (default: the engine's defaults "
                         f"{' '.join(SPEED_ESTIMATORS)}; 'all' = every one loop_gradients can run). Section 1 "
                         "always checks every registered estimator.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip", nargs="*", default=[], choices=["agreement", "speed", "scaling", "breakdown"],
                    help="sections to leave out")
    p = ap.parse_args(argv)
    p.B, p.G, p.mu_noise, p.scaling_estimator = 64, 8, 0.3, "seq_is"
    if p.quick:
        p.M, p.repeats_, p.loop_reps, p.check_reps = 100, 3, 1, 1
        p.scale_V, p.scale_T, p.scale_B, p.scale_M = [2, 4], [3, 4], [16, 64], [50, 100]
    else:
        p.M, p.repeats_, p.loop_reps, p.check_reps = 1000, 3, 50, 4
        p.scale_V, p.scale_T, p.scale_B = [2, 4, 8, 16], [2, 4, 6, 8], [8, 16, 32, 64, 128, 256]
        p.scale_M = [125, 250, 500, 1000, 2000]
    p.M = p.replicates or p.M
    p.repeats = p.repeats or p.repeats_
    p.loop_reps = min(p.loop_replicates or p.loop_reps, p.M)
    if p.M not in p.scale_M:
        p.scale_M = sorted({*p.scale_M, p.M})
    loopable = [n for n in estimators.names() if not needs(n)]
    if not p.estimators:
        p.speed_estimators = [n for n in SPEED_ESTIMATORS if n in loopable]
    elif p.estimators == ["all"]:
        p.speed_estimators = loopable
    else:
        bad = [n for n in p.estimators if n not in loopable]
        if bad:
            ap.error(f"cannot time {', '.join(bad)} against loop_gradients (unknown, or needs extra inputs); "
                     f"choose from {', '.join(loopable)}")
        p.speed_estimators = p.estimators
    if p.quick and p.threads is None:
        p.threads = 1
    if min(p.M, p.repeats, p.loop_reps) < 1:
        ap.error("--replicates, --loop-replicates and --repeats must be at least 1")
    return p


def main(argv=None) -> int:
    p = parse(argv)
    if p.threads:
        torch.set_num_threads(p.threads)
    t_start = time.perf_counter()
    cpus = os.cpu_count()
    meta = {"mode": "quick" if p.quick else "full", "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": cpus, "threads": torch.get_num_threads(),
            "interop_threads": torch.get_num_interop_threads(), "load_start": load(), "M": p.M, "B": p.B, "G": p.G,
            "repeats": p.repeats, "loop_replicates": p.loop_reps, "mu_noise": p.mu_noise, "seed": p.seed,
            "tolerance": TOL, "estimators": estimators.names(),
            "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "")}
    print(f"bench_variance_engine ({meta['mode']}): torch {meta['torch']}, python {meta['python']}, "
          f"{meta['platform']}")
    print(f"threads: torch.get_num_threads() = {meta['threads']} (interop {meta['interop_threads']}), "
          f"os.cpu_count() = {cpus}; load average at start: {meta['load_start']}; "
          f"THP_MEM_ALLOC_ENABLE={meta['THP_MEM_ALLOC_ENABLE'] or 'unset'}")
    try:
        if os.getloadavg()[0] > (cpus or 1) and torch.get_num_threads() == 1:
            print("note: the machine is busy (1-min load average above the core count); with 1 torch thread the "
                  "times are still steady.")
        elif os.getloadavg()[0] > (cpus or 1):
            print("WARNING: the machine is busy (1-min load average above the core count). With more than one "
                  "torch thread,\n  every parallel op waits for a descheduled worker: times are inflated and noisy "
                  "(see the spread column).\n  On a shared machine prefer --threads 1.")
    except OSError:
        pass
    results = {"meta": meta, "agreement": [], "speed": [], "scaling": [], "breakdown": [], "profile": []}
    ok = True
    sections = {"agreement": agreement, "speed": speed, "scaling": scaling, "breakdown": breakdown}
    for key, section in sections.items():
        if key in p.skip or (key == "breakdown" and p.quick and not p.profile):
            continue
        t0 = time.perf_counter()
        ok &= section(p, results) is not False
        meta[f"{key}_wall_s"] = time.perf_counter() - t0
        print(f"  [{key}: {meta[f'{key}_wall_s']:.0f} s, load average {load()}]")
    meta["load_end"], meta["wall_s"], meta["all_agree"] = load(), time.perf_counter() - t_start, ok
    print(f"\nload average at end: {meta['load_end']}; wall time {meta['wall_s']:.0f} s")
    if p.json:
        Path(p.json).parent.mkdir(parents=True, exist_ok=True)
        Path(p.json).write_text(json.dumps(results, indent=1))
        print(f"numbers written to {p.json}")
    if not ok:
        print(f"FAIL: the vectorised gradients disagree with the loop baseline beyond {TOL:g} (rows marked FAIL)")
        return 1
    print(f"all agreement checks passed (tolerance {TOL:g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
