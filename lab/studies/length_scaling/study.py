"""The length study: every correction's bias, variance and MSE, and the weight diagnostics, as T grows.

For each response length T, the env (a Markov bandit, ``long_*``) is rebuilt at that length with the ``markov``
policy; pi is the end of a short Adam ascent on the exact objective; the truth is the exact grad J by dynamic
programming (``lab.engine.dp``), and so are the divergences of mu. Each regime fixes one divergence as T grows:
``token`` the per-token KL(mu||pi) (= ``kl_token``), ``sequence`` the sequence KL (= ``kl_seq``), by moving mu's
logits along one fixed noise direction (``Perturbed``; the scale found by Brent's method on the DP value). The
variance engine (``lab.engine.variance.measure``) samples the replicate batches and measures every estimator on the
same batches against the DP grad J; the DP also gives the exact expected gradient of token-level IS and of
uncorrected REINFORCE (with the leave-one-out baseline's expectation E_mu[R | x] subtracted for rloo), and their
first-order
prediction s * d/ds E_{mu_s}[g] at s = 0 (central difference), s the perturbation scale.

Fits per regime (least squares over the lengths; ``fit_rate``, ``power_exponent``):
- theory_rate: slope in T of T log(1 + chi2_token), the log second moment of the sequence weight were tokens
  independent (E_mu[W^2] = (1 + chi2_token)^T);
- dp_rate: slope in T of the exact log E_mu[W^2];
- measured_rate: slope in T of log(Var seq_is / Var reinforce) from the sampled variances of the same batches,
  with an interval from their bootstrap intervals (weighted least squares);
- bias_exponent / first_order_exponent: slopes of log relative bias against log T, exact and first-order.

On a transformer (``staleness``, the summary's ``staleness`` section): the staleness table of the
real_staleness_training study (RL under mini-batch staleness N and async lag, final held-out accuracy over seeds)
repeated on the copy task at several answer lengths, and the pairs of corrections whose order flips with length.
It runs at ``staleness_lengths`` or is read from finished sweeps (``results``); by default neither, since it takes
hours of CPU at T = 256 (the full tables: ``sweeps/length_transformer_{sync,async}.yaml``; the table run on a GPU:
``sweeps/length_transformer_{sync,async}_gpu.yaml``).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal

import numpy as np
import pandas as pd
import torch
from scipy.optimize import brentq
from scipy.special import erfinv

import toy_envs
from lab import advantages as adv_mod
from lab import estimators
from lab.configs import SEED_MAX, check_types, check_unique
from lab.engine import dp
from lab.engine.estimator import Estimator
from lab.engine.exact import Problem
from lab.engine.metrics import streamed_memory
from lab.engine.variance import PROVIDED_INPUTS, Sampling, measure
from lab.errors import LabError
from lab.estimators.aggregation import AGG_MODES
from lab.policies import Perturbed, init_params, make_policy
from lab.progress import bar
from lab.seeding import derive_seed, generator
from lab.studies import StudyResult
from lab.studies.length_scaling import staleness
from lab.typed import knob
from toy_envs.tasks import COPY_MAX

DEFAULT_ESTIMATORS = ("reinforce", "seq_is", "token_is", "ppo_clip", "gspo", "vespo")
REGIMES = ("token", "sequence")
EXACT = ("token_is", "reinforce")  # estimators whose exact expectation the DP gives
BATCH_MEMORY_BUDGET = 4 * 2**30  # bytes for the replicate batches, their gathered logits and the bootstrap counts
FD_STEP = 1e-4  # the central difference's step in the perturbation scale (first-order prediction)


@dataclass
class Config:
    """One length study. Every field has a default: ``Config()`` builds the gallery's report in about a minute."""

    env: str = "long_dense"
    """Markov bandit preset (long_dense, long_parity, long_eos; see `lab envs`): its length is set per point"""
    env_overrides: dict = knob({}, flag="--set", parse="pairs")
    """env fields to change besides the length, e.g. vocab_size=6"""
    lengths: list[int] = knob([8, 32, 128, 512], ge=2, le=100_000)
    """response lengths T"""
    regimes: list[Literal[REGIMES]] = knob(list(REGIMES))
    """what stays fixed as T grows: token (the per-token KL) and/or sequence (the sequence KL)"""
    kl_token: float = knob(0.005, gt=0, le=10)
    """per-token KL(mu||pi) of the token regime, nats"""
    kl_seq: float = knob(0.5, gt=0, le=1000)
    """sequence KL(mu||pi) of the sequence regime, nats"""
    estimators: list[str] = knob(list(DEFAULT_ESTIMATORS))
    """estimator names (see `lab estimators`); reinforce and seq_is give the measured variance growth, token_is and
    reinforce the exact bias"""
    hyper: dict = knob({}, parse="estimator_pairs")
    """hyper-parameter overrides, e.g. ppo_clip.clip_ratio_c=3.0"""
    advantage: Literal["reward", "rloo"] = "rloo"
    """reward | rloo: advantages whose expectation the DP states exactly (rloo: R - E_mu[R | x])"""
    group_size: int = knob(8, ge=2, le=4096)
    """G responses per prompt"""
    batch_size: int = knob(32, ge=2, le=1_000_000)
    """B responses per batch (a multiple of G)"""
    replicates: int = knob(100, ge=2, le=1_000_000)
    """M independent batches per point"""
    loss_agg_mode: Literal[(*AGG_MODES, "native")] = knob("seq-mean-token-sum", flag="--agg")
    """loss aggregation mode, or native (each estimator's own)"""
    init_scale: float = knob(1.0, ge=0, le=100)
    """initial logits ~ N(0, init_scale^2)"""
    trajectory_steps: int = knob(8, ge=0, le=100_000)
    """Adam steps on the exact objective from the initial policy to pi"""
    lr: float = knob(0.05, gt=0, le=1e3)
    """Adam learning rate of that trajectory"""
    n_boot: int = knob(400, ge=10, le=1_000_000)
    """bootstrap resamples"""
    ci: float = knob(0.95, gt=0, lt=1)
    """interval coverage"""
    seed: int = knob(0, ge=0, le=SEED_MAX)
    """seed of every random stream of the study"""
    memory_budget: float = knob(2.0, gt=0, le=4096)
    """GiB of gradient estimates held at once (M x D float32 for the markov table)"""
    staleness_lengths: list[int] = knob([], ge=1, le=COPY_MAX)
    """the transformer staleness table: answer lengths T at which it trains ([]: the table only from ``results``;
    the full table is sweeps/length_transformer_{sync,async}.yaml)"""
    staleness_env: str = "copy6"
    """staleness table: the task family, rebuilt at each T through its difficulty (copy: T digits)"""
    staleness_estimators: list[str] = knob(["reinforce", "ppo_clip", "gspo", "vespo", "seq_is"])
    """staleness table: the estimators trained, one run per estimator, setting, T and seed"""
    staleness_baseline: str | None = "ppo_clip"
    """staleness table: probability of improvement against this estimator (none: not measured)"""
    staleness_minibatches: list[int] = knob([1, 16], ge=1, le=100_000)
    """staleness table, sync: N mini-batches per rollout ([] leaves the sync table out)"""
    staleness_etas: list[int] = knob([], ge=0, le=10_000)
    """staleness table, async: staleness bounds eta ([] leaves the async table out)"""
    staleness_seeds: list[int] = knob([0, 1, 2], ge=0, le=SEED_MAX)
    """staleness table: seeds per cell; intervals are over seeds"""
    staleness_size: str = "small"
    """staleness table: transformer size (lab.policies.transformer.SIZES)"""
    staleness_warm_start: float = knob(0.3, ge=0, lt=1)
    """staleness table: supervised warm start to this exact-match accuracy at each T (`lab pretrain`)"""
    staleness_steps: int = knob(6, ge=1, le=1_000_000)
    """staleness table: rollouts per run"""
    staleness_rollout_batch: int = knob(256, ge=1, le=1_000_000)
    """staleness table: responses per rollout"""
    staleness_group_size: int = knob(4, ge=1, le=4096)
    """staleness table: responses per prompt"""
    staleness_lr: float = knob(5e-4, gt=0, le=1e3)
    """staleness table: Adam learning rate (real_staleness_training's)"""
    staleness_async_n: int = knob(4, ge=1, le=100_000)
    """staleness table, async: N during consumption"""
    staleness_lag_max: int = knob(8, ge=0, le=10_000)
    """staleness table, async: lags drawn uniformly on 0..lag_max"""
    staleness_device: str = "cpu"
    """staleness table: where the transformer trains (cpu | cuda)"""
    workers: int | None = knob(None, ge=1, le=4096)
    """staleness table: parallel runs (none: every core)"""
    sweep_dir: str | None = None
    """staleness table: keep its sweeps here (subfolders sync, async) and resume from them (none: a temporary
    folder)"""
    results: str | None = None
    """staleness table: read the finished sweeps in this folder (subfolders sync, async, e.g. of
    sweeps/length_transformer_*.yaml) instead of running them"""

    def env_at(self, length: int):
        return toy_envs.make(self.env, **{**self.env_overrides, "length": int(length)})

    def sampling(self) -> Sampling:
        return Sampling(self.replicates, self.batch_size, self.group_size, self.advantage, self.ci, self.n_boot,
                        memory_budget=int(self.memory_budget * 2**30))

    def resolved(self) -> list[Estimator]:
        return [Estimator.resolve(n, self.hyper.get(n, {}), self.loss_agg_mode) for n in self.estimators]

    def validate(self) -> None:
        check_types(self)
        if not self.lengths:
            raise LabError("give at least one response length")
        if not self.regimes:
            raise LabError("give at least one regime: token and/or sequence")
        check_unique("lengths", [int(t) for t in self.lengths])
        check_unique("regimes", list(self.regimes))
        if "length" in self.env_overrides:
            raise LabError("set the response lengths with lengths=[...], not the env's length")
        for T in self.lengths:
            env = self.env_at(T)
            dp.check(env, make_policy("markov", env))
        self._validate_estimators()
        adv_mod.check(self.advantage, self.group_size)
        if self.batch_size % self.group_size:
            raise LabError(f"batch size {self.batch_size} must be a multiple of the group size {self.group_size}")
        self._validate_memory()
        if self.results is not None:
            staleness.check_results(self.results)
        elif self.staleness_lengths:
            self.staleness_table().validate()

    def staleness_table(self) -> staleness.Table:
        """The transformer staleness table's sweeps (``lab.studies.length_scaling.staleness``)."""
        return staleness.Table(self.staleness_env, [int(t) for t in self.staleness_lengths],
                               list(self.staleness_estimators), self.staleness_baseline,
                               list(self.staleness_minibatches), list(self.staleness_etas), list(self.staleness_seeds),
                               self.staleness_size, self.staleness_warm_start, self.staleness_steps,
                               self.staleness_rollout_batch, self.staleness_group_size, self.staleness_lr,
                               self.staleness_async_n, self.staleness_lag_max,
                               device=self.staleness_device)

    def _validate_estimators(self) -> None:
        if not self.estimators:
            raise LabError("give at least one estimator")
        check_unique("estimators", self.estimators)
        for name in self.estimators:
            info = estimators.info(name)
            if info.family in ("distillation", "kl-penalty") or not set(info.inputs) <= set(PROVIDED_INPUTS):
                raise LabError(f"estimator {name!r} does not estimate grad J from these batches (a {info.family} "
                               f"estimator); leave it out of the length study")
            Estimator.resolve(name, self.hyper.get(name, {}), self.loss_agg_mode).check_inputs(PROVIDED_INPUTS)
        unknown = set(self.hyper) - set(self.estimators)
        if unknown:
            raise LabError(f"hyper-parameters given for estimator(s) not in the study: {', '.join(sorted(unknown))}")

    def _validate_memory(self) -> None:
        """Refuse, before any work, a request whose longest point does not fit: the replicate batches and their
        gathered logits and gradients (M B T (20 + 8 V) bytes), the bootstrap counts, the M x D estimates of the
        markov table and their Gram matrix (``lab.engine.metrics.streamed_memory``), and the DP's tables."""
        env = self.env_at(max(self.lengths))
        M, B, T, V = self.replicates, self.batch_size, env.length, env.vocab_size
        batch = M * B * T * (20 + 8 * V)
        if batch > BATCH_MEMORY_BUDGET:
            raise LabError(f"{M} replicates x {B} responses x {T} tokens need about {batch / 2**30:.1f} GiB "
                           f"(budget {BATCH_MEMORY_BUDGET / 2**30:.0f} GiB); use fewer replicates, a smaller batch or "
                           f"shorter lengths")
        if self.n_boot * M * 16 > BATCH_MEMORY_BUDGET:
            raise LabError(f"n_boot {self.n_boot} x {M} replicates needs {self.n_boot * M * 16 / 2**30:.1f} GiB of "
                           f"bootstrap counts; use fewer resamples")
        D = int(np.prod(make_policy("markov", env).shape))
        budget = self.sampling().memory_budget
        need = streamed_memory(M, D, M, budget)
        if M * D * 4 > budget or need["gram"] > budget:
            raise LabError(f"{M} replicates x {D:,} parameters at T = {T} need {M * D * 4 / 2**30:.2g} GiB of "
                           f"gradient estimates (budget {budget / 2**30:.3g} GiB); use fewer replicates, shorter "
                           f"lengths or raise --memory-budget")
        if dp.dp_memory(env) > budget:
            raise LabError(f"the dynamic program at T = {T} needs {dp.dp_memory(env) / 2**30:.2g} GiB (budget "
                           f"{budget / 2**30:.3g} GiB); use shorter lengths")


SMOKE = {"lengths": [8, 32], "replicates": 30, "n_boot": 100, "trajectory_steps": 2}  # seconds: what the tests build


@dataclass
class Point:
    """One (regime, length): mu's exact divergences (DP), the sampled weight diagnostics [value, lo, hi], per estimator
    its metrics and intervals (relative ones against c ||grad J||: rel_bias, rel_noise, rel_mse), and for the
    estimators in EXACT the exact relative bias and its first-order prediction."""

    regime: str
    length: int
    scale: float  # the perturbation scale s of mu's logits
    kl_token: float
    kl_seq: float
    chi2_token: float
    chi2_seq: float
    log_m2: float  # log E_mu[W^2] (finite where chi2_seq overflows)
    logw_var: float
    mean_len: float
    objective: float
    grad_norm: float  # ||grad J||
    ess_frac: list[float]
    khat: list[float]
    estimators: dict[str, dict[str, float]]
    intervals: dict[str, dict[str, list[float]]]
    exact: dict[str, dict[str, float]]  # name -> {rel_bias, first_order}


@dataclass
class Fit:
    """Growth with T in one regime (module docstring)."""

    regime: str
    theory_rate: float
    dp_rate: float
    measured_rate: list[float]  # [value, lo, hi]; NaN without reinforce and seq_is
    bias_exponent: dict[str, float] = field(default_factory=dict)
    first_order_exponent: dict[str, float] = field(default_factory=dict)


@dataclass
class Summary:
    """What a length study found (summary.json)."""

    study: str
    env: str
    policy: str
    lengths: list[int]
    regimes: list[str]
    kl_token: float
    kl_seq: float
    loss_agg_modes: dict[str, str]
    points: list[Point]
    fits: list[Fit]
    config: dict  # the sampling settings behind every point
    staleness: staleness.Staleness | None = None  # the transformer staleness table across lengths, when run or read


def trajectory(env, policy, theta0: torch.Tensor, steps: int, lr: float) -> torch.Tensor:
    """pi: Adam (beta 0.9/0.999) ascent on the exact J for ``steps`` steps, grad J by DP."""
    theta = theta0.detach().double().clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=lr)
    for _ in range(steps):
        theta.grad = -dp.policy_gradient(env, policy, theta.detach())
        opt.step()
    return theta.detach()


def behaviour_at(env, policy, theta, noise, metric: str, target: float):
    """(mu, s): mu = Perturbed(policy, noise, s) with the exact (DP) ``metric`` of mu from pi equal to ``target``."""
    def value(s):
        return dp.weight_moments((policy, theta), (Perturbed(policy, noise, s), theta), env)[metric]

    lo, hi = 0.0, 0.25
    while value(hi) < target:
        lo, hi = hi, 2 * hi
        if hi > 2**12:
            raise LabError(f"{metric} = {target} is out of reach of logit perturbations at T = {env.length}; use a "
                           f"smaller value")
    s = brentq(lambda s: value(s) / target - 1.0, lo, hi, rtol=1e-10, xtol=1e-12)
    return Perturbed(policy, noise, s), s


def exact_biases(env, policy, theta, noise, s: float, grad_j: torch.Tensor, names: list[str],
                 baseline: bool) -> dict:
    """For token_is and reinforce among ``names``: the exact relative bias ||E g - grad J|| / ||grad J|| under
    mu_s, and its first-order prediction s ||d/ds E_{mu_s}[g]|| / ||grad J|| (central difference at s = 0).
    ``baseline``: advantages R - E_mu[R | x], what a leave-one-out baseline gives in expectation (it moves
    REINFORCE's mean off-policy, not token IS's)."""
    out, norm = {}, float(grad_j.norm())
    for name in [n for n in EXACT if n in names]:
        weighted = name == "token_is"

        def mean(scale):
            mu = (Perturbed(policy, noise, scale), theta)
            return dp.expected_token_gradient(env, policy, theta, mu, weighted, baseline).reshape(-1)

        slope = (mean(FD_STEP) - mean(-FD_STEP)) / (2 * FD_STEP)
        out[name] = {"rel_bias": float((mean(s) - grad_j).norm()) / norm,
                     "first_order": s * float(slope.norm()) / norm}
    return out


def fit_rate(x, y, se=None) -> list[float]:
    """[slope, lo, hi] of y against x by (weighted, 1 / se^2) least squares; the interval is normal with the slope's
    standard error (from ``se`` when given, else from the residuals); NaN with fewer than two usable points."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    w = np.ones_like(x) if se is None else 1.0 / np.asarray(se, float) ** 2
    ok = np.isfinite(x) & np.isfinite(y) & np.isfinite(w) & (w > 0)
    x, y, w = x[ok], y[ok], w[ok]
    if len(x) < 2 or np.ptp(x) == 0:
        return [math.nan] * 3
    xm, ym = np.average(x, weights=w), np.average(y, weights=w)
    sxx = float(np.sum(w * (x - xm) ** 2))
    b = float(np.sum(w * (x - xm) * (y - ym)) / sxx)
    if se is not None:
        sd = math.sqrt(1.0 / sxx)
    elif len(x) > 2:
        sd = math.sqrt(float(np.sum((y - ym - b * (x - xm)) ** 2)) / (len(x) - 2) / sxx)
    else:
        sd = math.nan
    return [b, b - 1.96 * sd, b + 1.96 * sd]


def power_exponent(lengths, values) -> float:
    """Slope of log value against log T (least squares)."""
    v = np.asarray(values, float)
    ok = v > 0
    return fit_rate(np.log(np.asarray(lengths, float)[ok]), np.log(v[ok]))[0] if ok.sum() >= 2 else math.nan


def fits(points: list[Point], regime: str, ci: float) -> Fit:
    pts = sorted([p for p in points if p.regime == regime], key=lambda p: p.length)
    T = [p.length for p in pts]
    theory = fit_rate(T, [p.mean_len * math.log1p(p.chi2_token) for p in pts])[0]
    dp_rate = fit_rate(T, [p.log_m2 for p in pts])[0]
    measured = [math.nan] * 3
    if pts and {"seq_is", "reinforce"} <= set(pts[0].estimators):
        z = float(math.sqrt(2.0) * erfinv(ci))
        y, se = [], []
        for p in pts:
            v = {n: (p.estimators[n]["variance"], *p.intervals[n]["variance"]) for n in ("seq_is", "reinforce")}
            y.append(math.log(v["seq_is"][0] / v["reinforce"][0]) if min(v["seq_is"][0], v["reinforce"][0]) > 0
                     else math.nan)
            widths = [(math.log(hi) - math.log(lo)) / (2 * z) if lo > 0 else math.inf for _, lo, hi in v.values()]
            se.append(math.hypot(*widths))
        measured = fit_rate(T, y, se)
    names = sorted({n for p in pts for n in p.exact})
    return Fit(regime, theory, dp_rate, measured,
               {n: power_exponent(T, [p.exact[n]["rel_bias"] for p in pts]) for n in names},
               {n: power_exponent(T, [p.exact[n]["first_order"] for p in pts]) for n in names})


def _relative(res: dict, norm: float) -> dict:
    """rel_bias = bias_norm / norm, rel_noise = sqrt(variance) / norm ([value, lo, hi] each)."""
    return {"rel_bias": tuple(v / norm for v in res["bias_norm"]),
            "rel_noise": tuple(math.sqrt(max(v, 0.0)) / norm for v in res["variance"])}


def run_staleness(cfg: Config, progress: bool | None = None) -> tuple[pd.DataFrame, dict] | None:
    """The transformer staleness table (``staleness``): read from ``results``, or run at ``staleness_lengths``;
    (tidy table, summary section), or None when neither is given."""
    if cfg.results is not None:
        sweeps, source = staleness.load(cfg.results), f"the sweeps in {cfg.results}"
    elif cfg.staleness_lengths:
        sweeps = staleness.run_sweeps(cfg.staleness_table(), "local", cfg.workers, cfg.sweep_dir, progress)
        source = "the report's own sweeps"
    else:
        return None
    ests = {e for _, r in sweeps.values() for e in r["estimator"]}
    baseline = cfg.staleness_baseline if cfg.staleness_baseline in ests else None
    table = staleness.summarise(sweeps, baseline, cfg.n_boot)
    return table, staleness.section(source, sweeps, table, baseline)


def run(cfg: Config, progress: bool | None = None) -> StudyResult:
    """(tidy results, summary) of one length study; deterministic given ``cfg.seed``."""
    cfg.validate()
    ests, sampling = cfg.resolved(), cfg.sampling()
    rows, points = [], []
    bars = bar(len(cfg.lengths) * len(cfg.regimes), "length_scaling", progress)
    for i, T in enumerate(cfg.lengths):
        env = cfg.env_at(T)
        policy = make_policy("markov", env)
        gen = generator(cfg.seed, 0, i)
        theta = trajectory(env, policy, init_params(policy, cfg.init_scale, gen), cfg.trajectory_steps, cfg.lr)
        grad_j = dp.policy_gradient(env, policy, theta).reshape(-1)
        if not (torch.isfinite(grad_j).all() and grad_j.norm() > 0):
            raise LabError(f"the exact gradient of pi at T = {T} is zero or not finite; lower --init-scale or --lr")
        J = dp.objective(env, policy, theta)
        noise = policy.noise_table(gen)
        problem = Problem(env, policy, reference="mc")  # batches only: the truth is the DP's, passed in
        for j, regime in enumerate(cfg.regimes):
            metric, target = ("kl_token", cfg.kl_token) if regime == "token" else ("kl_seq", cfg.kl_seq)
            mu, s = behaviour_at(env, policy, theta, noise, metric, target)
            div = dp.weight_moments((policy, theta), (mu, theta), env)
            rgen = generator(cfg.seed, 1, i, j)
            measured, pts, ivs = measure(problem, theta, (mu, theta), None, ests, grad_j, sampling, rgen,
                                         np.random.default_rng(derive_seed(cfg.seed, 2, i, j)))
            key = dict(env=env.name, policy="markov", regime=regime, length=int(T), seed=cfg.seed)
            rows += [{**key, "estimator": "-", "metric": m, "value": v, "lo": v, "hi": v}
                     for m, v in {**div, "scale": s, "objective": J, "grad_norm": float(grad_j.norm())}.items()]
            rows += [{**key, **r} for r in measured]
            for est in ests:
                norm = est.target_scale(T) * float(grad_j.norm())
                res = {m: (pts[est.name][m], *ivs[est.name][m]) for m in pts[est.name]}
                for m, (v, lo, hi) in _relative(res, norm).items():
                    rows.append({**key, "estimator": est.name, "metric": m, "value": v, "lo": lo, "hi": hi})
                    pts[est.name][m], ivs[est.name][m] = v, [lo, hi]
            exact = exact_biases(env, policy, theta, noise, s, grad_j, cfg.estimators, cfg.advantage == "rloo")
            rows += [{**key, "estimator": n, "metric": f"exact_{m}", "value": v, "lo": v, "hi": v}
                     for n, e in exact.items() for m, v in e.items()]
            diag = {r["metric"]: [r["value"], r["lo"], r["hi"]] for r in measured if r["estimator"] == "-"}
            points.append(Point(regime, int(T), s, div["kl_token"], div["kl_seq"], div["chi2_token"],
                                div["chi2_seq"], div["log_m2"], div["logw_var"], div["mean_len"], J,
                                float(grad_j.norm()), diag["ess_frac"], diag["khat"], pts, ivs, exact))
            bars.update(1)
    bars.close()
    summary = Summary(
        study="length_scaling", env=cfg.env, policy="markov", lengths=[int(t) for t in cfg.lengths],
        regimes=list(cfg.regimes), kl_token=cfg.kl_token, kl_seq=cfg.kl_seq,
        loss_agg_modes={e.name: e.loss_agg_mode for e in ests}, points=points,
        fits=[fits(points, r, cfg.ci) for r in cfg.regimes],
        config={k: getattr(cfg, k) for k in ("batch_size", "group_size", "advantage", "loss_agg_mode", "replicates",
                                             "trajectory_steps")})
    results, out = pd.DataFrame(rows), asdict(summary)
    tf = run_staleness(cfg, progress)
    if tf is not None:  # the transformer's rows beside the markov ones: policy "transformer", column study
        table, out["staleness"] = tf
        results = pd.concat([results, table.assign(policy="transformer")], ignore_index=True)
    return StudyResult(results, out)
