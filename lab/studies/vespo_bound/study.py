"""The vespo_bound study: VESPO's variance bound (Proposition 3.1, ``bound.py``) checked exactly, and VESPO against
sequence IS as rollouts go stale.

The bound check is exact: every (prompt, response) pair is enumerated with its probability mu(y)/P in float64.
Staleness comes from ``lab.engine.staleness``: lag (snapshots of the Adam trajectory the variance study uses, same
seeds), per-token KL targets and sampler temperature.

The second half runs the variance study (``lab.studies.variance``) on VESPO, sequence IS, PPO clip and REINFORCE at
each lag, once more with advantage "reward" for each estimator's exact expected-gradient bias, and splits that
expected gradient into direction (cosine) and size. ``run`` returns one tidy table whose ``part`` column says which
half a row comes from: bound | variance | exact_bias | exact_direction.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass
from typing import Literal

import pandas as pd

import toy_envs
from lab.advantages import ADVANTAGES
from lab.configs import SEED_MAX, check_types
from lab.engine.estimator import Estimator
from lab.engine.exact import Problem, divergence, policy_gradient
from lab.engine.gradients import expected_gradient, separable
from lab.engine.staleness import behaviour, check_value, optimisation_trajectory
from lab.errors import LabError
from lab.estimators import vespo
from lab.estimators.aggregation import AGG_MODES
from lab.policies import init_params, make_policy
from lab.seeding import generator
from lab.studies import StudyResult
from lab.studies.variance import study as variance
from lab.studies.vespo_bound.bound import bound_summary, bound_terms, kernel_label, sequence_log_weights, tidy_bound
from lab.typed import build, knob

DEFAULT_KERNELS = ([2.0, 3.0], [3.0, 2.0], [1.0, 1.0], [1.0, 3.0], [1.5, 1.0], [2.0, 1.0], [4.0, 2.0], [0.5, 1.0])
ESTIMATORS = ("vespo", "seq_is", "ppo_clip", "reinforce")
KNOBS = (("lag", "lags"), ("kl", "kl_targets"), ("temperature", "temperatures"))  # staleness kind, Config field


@dataclass
class Config:
    """The vespo_bound study: the exact bound check and the variance comparison. ``Config()`` is the full report."""

    env: str = "tiny_target"
    """toy env preset (must be enumerable)"""
    env_overrides: dict = knob({}, flag="--set", parse="pairs")
    """env fields to change, e.g. length=3"""
    policy: Literal["prefix", "markov"] = "prefix"
    """prefix (any sequence distribution) | markov"""
    lags: list[int] = knob([0, 1, 2, 4, 8, 16, 32, 64], ge=0, le=1_000_000)
    """optimiser steps between mu and pi (bound check and variance study)"""
    kl_targets: list[float] = knob([0.01, 0.03, 0.1, 0.3, 1.0], ge=0, le=100)
    """per-token KL(mu||pi) targets (bound check)"""
    temperatures: list[float] = knob([0.5, 0.7, 1.5, 2.0], ge=0.01, le=100)
    """sampler temperatures (bound check)"""
    kernels: list[list[float]] = knob([list(k) for k in DEFAULT_KERNELS], ge=0, le=1000)
    """[k, lambda] pairs of the kernel phi(W) = W^k e^(lambda (1 - W)) (bound check)"""
    bound_seeds: list[int] = knob([0, 1, 2], ge=0, le=SEED_MAX)
    """one random initial policy and Adam trajectory each (bound check)"""
    trajectory_steps: int = knob(64, ge=0, le=1_000_000)
    """length of pi's Adam trajectory; lags must not exceed it"""
    init_scale: float = knob(1.0, ge=0, le=100)
    """initial logits ~ N(0, init_scale^2)"""
    lr: float = knob(0.05, gt=0, le=1e3)
    """Adam learning rate of the trajectory"""
    replicates: int = knob(500, ge=2, le=1_000_000)
    """replicate batches per lag (variance study)"""
    batch_size: int = knob(64, ge=1, le=1_000_000)
    """B responses per batch"""
    group_size: int = knob(8, ge=1, le=4096)
    """G responses per prompt"""
    advantage: Literal[ADVANTAGES] = "rloo"
    """advantages of the variance study (the exact-bias study always uses reward)"""
    loss_agg_mode: Literal[AGG_MODES] = knob("token-mean", flag="--agg")
    """loss aggregation mode: VESPO's (and verl's) default token-mean"""
    seed: int = knob(0, ge=0, le=SEED_MAX)
    """seed of the variance study and of the exact directions"""

    def make_env(self):
        return toy_envs.make(self.env, **self.env_overrides)

    def problem(self) -> Problem:
        env = self.make_env()
        return Problem(env, make_policy(self.policy, env))

    def settings(self) -> list[tuple[str, float]]:
        """The bound check's (staleness kind, value) settings, lags first."""
        return [(kind, float(v)) for kind, name in KNOBS for v in getattr(self, name)]

    def variance_configs(self) -> tuple[variance.Config, variance.Config]:
        """(main, exact-bias) variance studies over the lags: the second with advantage "reward", so the engine
        computes each estimator's exact expected gradient E_mu[g] (``exact_bias_norm``); its sampled rows are
        throwaway (2 replicates)."""
        common = dict(env=self.env, env_overrides=dict(self.env_overrides), policy=self.policy, staleness="lag",
                      values=list(self.lags), estimators=list(ESTIMATORS), batch_size=self.batch_size,
                      group_size=self.group_size, loss_agg_mode=self.loss_agg_mode, init_scale=self.init_scale,
                      trajectory_steps=self.trajectory_steps, lr=self.lr, seed=self.seed)
        return (variance.Config(advantage=self.advantage, replicates=self.replicates, **common),
                variance.Config(advantage="reward", replicates=2, n_boot=10, **common))

    def validate(self) -> None:
        check_types(self)
        self._validate_bound()
        for cfg in self.variance_configs():
            cfg.validate()
        env = self.make_env()
        for name in ESTIMATORS:
            if not separable(Estimator.resolve(name, {}, self.loss_agg_mode).loss_agg_mode, env):
                raise LabError(f"loss_agg_mode {self.loss_agg_mode!r} is not separable on {self.env!r}; no exact "
                               f"expectation")

    def _validate_bound(self) -> None:
        problem = self.problem()
        problem.check()
        if not self.kernels:
            raise LabError("give at least one (k, lambda) kernel")
        for kern in self.kernels:
            if len(kern) != 2:
                raise LabError(f"a kernel is a pair [k, lambda], got {kern!r}")
            vespo.check_kernel(float(kern[0]), float(kern[1]))
        for kind, value in self.settings():
            check_value(kind, value, self.trajectory_steps)
        if not self.settings():
            raise LabError("give at least one staleness setting (lags, kl_targets or temperatures)")
        if not self.lags:
            raise LabError("give at least one lag: the variance comparison runs along the lag trajectory")
        if not self.bound_seeds:
            raise LabError("give at least one bound seed")


SMOKE = {"lags": [0, 4], "kl_targets": [0.1], "temperatures": [2.0], "bound_seeds": [0], "replicates": 40,
         "trajectory_steps": 4, "kernels": [[2, 3], [3, 2], [1, 1], [0.5, 1]]}  # seconds: what the tests build


@dataclass
class Tightest:
    """The setting with the largest ratio E_mu[phi^2] / (Z K C)."""

    kernel: str
    staleness_kind: str
    staleness: float
    seed: int
    ratio: float


@dataclass
class KernelBound:
    """One kernel of the bound check. K is inf for k < 1 (no bound), and every number below None there; summary.json
    stores inf and NaN as null."""

    k: float
    lam: float
    K: float | None
    peak_w: float | None  # where phi(w)/w peaks, (k - 1)/lambda (0 for k <= 1, approached)
    on_policy_ratio: float | None  # 1/K: the ratio when W = 1 everywhere
    max_ratio: float | None
    median_ratio: float | None
    min_ratio: float | None


@dataclass
class Lag:
    """VESPO against sequence IS at one lag: [value, lo, hi] of MSE and variance ÷ ‖∇J‖², the verdict (the lower MSE
    where the 95% intervals do not overlap: "VESPO lower", "seq IS lower", "equal" or "unresolved"), and per
    estimator its exact expected gradient (advantage = R) against ∇J: bias ‖E g − ∇J‖ ÷ ‖∇J‖, cosine and size
    ‖E g‖ ÷ ‖∇J‖ (a cosine is NaN, null in summary.json, where E g = 0)."""

    kl_token: float
    ess_frac: float
    verdict: str
    vespo_rel_mse: list[float]
    vespo_variance: list[float]
    seq_is_rel_mse: list[float]
    seq_is_variance: list[float]
    vespo_exact_bias: float | None = None
    vespo_exact_cos: float | None = None
    vespo_exact_size: float | None = None
    seq_is_exact_bias: float | None = None
    seq_is_exact_cos: float | None = None
    seq_is_exact_size: float | None = None
    ppo_clip_exact_bias: float | None = None
    ppo_clip_exact_cos: float | None = None
    ppo_clip_exact_size: float | None = None
    reinforce_exact_bias: float | None = None
    reinforce_exact_cos: float | None = None
    reinforce_exact_size: float | None = None


@dataclass
class Summary:
    """What the vespo_bound study found (summary.json): the bound check over every setting and kernel, and the
    comparison per lag (``per_lag`` keyed by the lag, "%g")."""

    study: str
    env: str
    policy: str
    max_bound_ratio: float
    max_bound_ratio_off_policy: float | None  # over settings with KL(mu||pi) > 0
    violations: int  # settings with a ratio above 1 + TOLERANCE
    settings_checked: int  # settings with a finite K
    settings_without_bound: int  # settings of kernels with k < 1
    tightest: Tightest
    per_kernel: dict[str, KernelBound]
    max_floor_mass: float  # the largest mu-mass where the authors' floor inside log W is active
    staleness_kinds: list[str]
    bound_seeds: int
    vespo_lower_mse_at_lags: list[float]
    seq_is_lower_mse_at_lags: list[float]
    max_lag: float
    mse_ratio_vespo_over_seq_is_at_max_lag: float
    per_lag: dict[str, Lag]
    config: dict  # the variance study's sampling settings and seed


def trajectory(cfg: Config, seed: int):
    """(problem, Adam trajectory) for one seed: the variance study's own (same seed, same generator)."""
    problem = cfg.problem()
    gen = generator(seed, 0)
    theta0 = init_params(problem.policy, cfg.init_scale, gen)
    return problem, optimisation_trajectory(problem, theta0, cfg.trajectory_steps, cfg.lr, gen)


# ---- Proposition 3.1 along the staleness knobs ------------------------------------------------------------------

def _seed_rows(cfg: Config, seed: int) -> list[dict]:
    problem, traj = trajectory(cfg, seed)
    pi = (problem.policy, traj.current)
    rows = []
    for i, (kind, value) in enumerate(cfg.settings()):
        mu = behaviour(problem, kind, value, traj, generator(seed, 5, i))
        support = problem.support(mu[1], policy=mu[0])
        div = divergence(pi, mu, support)
        L = sequence_log_weights(pi, mu, support)
        for k, lam in cfg.kernels:
            terms = bound_terms(L, support.weights, float(k), float(lam))
            rows.append({"env": problem.env.name, "policy": cfg.policy, "seed": seed, "staleness_kind": kind,
                         "staleness": value, "k": float(k), "lam": float(lam),
                         "kernel": kernel_label(float(k), float(lam)), **terms,
                         "kl_token": div["kl_token"], "chi2_seq": div["chi2_seq"]})
    return rows


def bound_table(cfg: Config) -> pd.DataFrame:
    """Wide table: one row per (bound seed, staleness setting, kernel) with the exact terms of ``bound_terms``."""
    cfg._validate_bound()
    return pd.DataFrame([row for seed in cfg.bound_seeds for row in _seed_rows(cfg, seed)])


def part(results: pd.DataFrame, name: str) -> pd.DataFrame:
    """The rows of one part of ``run``'s results: bound | variance | exact_bias | exact_direction."""
    return results[results["part"] == name]


# ---- VESPO against sequence IS ----------------------------------------------------------------------------------

def exact_directions(cfg: Config) -> pd.DataFrame:
    """Per lag and estimator, the exact expected gradient E_mu[g] (advantage = R, by enumeration) against the target
    c ∇J: relative bias ‖E g − c∇J‖ ÷ ‖c∇J‖ (the engine's exact_bias_norm, relative), cosine, and size
    ‖E g‖ ÷ ‖c∇J‖. A shrunken gradient that points the right way has cosine 1 and size < 1: its bias is a step size,
    not a direction. Same trajectory as the variance study with ``cfg.seed``."""
    problem, traj = trajectory(cfg, cfg.seed)
    env, policy, pi = problem.env, problem.policy, traj.current
    grad_j = policy_gradient(env, policy, pi, problem.support(pi)).reshape(-1)
    ests = [Estimator.resolve(name, {}, cfg.loss_agg_mode) for name in ESTIMATORS]
    rows = []
    for lag in cfg.lags:
        mu = behaviour(problem, "lag", float(lag), traj, None)
        support = problem.support(mu[1], policy=mu[0])
        for est in ests:
            g_star = est.target_scale(env.length) * grad_j
            g = expected_gradient(env, policy, pi, mu, support, est) / est.grad_scale
            rows.append({"lag": float(lag), "estimator": est.name,
                         "rel_bias": float((g - g_star).norm() / g_star.norm()),
                         "cos": float(g @ g_star / (g.norm() * g_star.norm())) if g.norm() > 0 else math.nan,
                         "size": float(g.norm() / g_star.norm())})
    return pd.DataFrame(rows)


def _tidy_directions(directions: pd.DataFrame, env: str, seed: int) -> pd.DataFrame:
    dirs = directions.melt(id_vars=["lag", "estimator"], var_name="metric", value_name="value")
    return dirs.rename(columns={"lag": "staleness"}).assign(part="exact_direction", staleness_kind="lag", env=env,
                                                            seed=seed, lo=dirs["value"], hi=dirs["value"])


def _metric(results: pd.DataFrame, metric: str, estimator: str) -> pd.DataFrame:
    rows = results[(results["metric"] == metric) & (results["estimator"] == estimator)]
    return rows.set_index("staleness")[["value", "lo", "hi"]].sort_index()


def _verdict(row: dict) -> str:
    """The lower MSE where the 95% intervals do not overlap."""
    if row["vespo_rel_mse_hi"] < row["seq_is_rel_mse_lo"]:
        return "VESPO lower"
    if row["seq_is_rel_mse_hi"] < row["vespo_rel_mse_lo"]:
        return "seq IS lower"
    return "equal" if row["vespo_rel_mse"] == row["seq_is_rel_mse"] else "unresolved"


def _exact_columns(exact: pd.DataFrame, directions: pd.DataFrame, lag: float, norm: float) -> dict:
    row = {}
    for e in ESTIMATORS:
        eb = _metric(exact, "exact_bias_norm", e)
        if len(eb):
            row[f"{e}_exact_bias"] = eb.loc[lag, "value"] / norm
        d = directions[(directions["staleness"] == lag) & (directions["estimator"] == e)].set_index("metric")
        if len(d):
            row[f"{e}_exact_cos"], row[f"{e}_exact_size"] = float(d.loc["cos", "value"]), float(d.loc["size", "value"])
    return row


def comparison(results: pd.DataFrame) -> pd.DataFrame:
    """Per lag, from ``run``'s tidy results: KL, ESS, VESPO's and sequence IS's relative MSE / variance (÷ ‖∇J‖²)
    with intervals, every estimator's exact bias (÷ ‖∇J‖), exact cosine and size, and the verdict."""
    main, exact, directions = part(results, "variance"), part(results, "exact_bias"), part(results, "exact_direction")
    kl, ess = _metric(main, "kl_token", "-"), _metric(main, "ess_frac", "-")
    norm2 = _metric(main, "mse", "vespo")["value"] / _metric(main, "rel_mse", "vespo")["value"]
    out = []
    for s in kl.index:
        row = {"lag": s, "kl_token": kl.loc[s, "value"], "ess_frac": ess.loc[s, "value"]}
        for e in ("vespo", "seq_is"):
            for m in ("rel_mse", "variance", "cos_mean"):
                r = _metric(main, m, e).loc[s]
                scale = norm2.loc[s] if m == "variance" else 1.0
                row.update({f"{e}_{m}": r["value"] / scale, f"{e}_{m}_lo": r["lo"] / scale,
                            f"{e}_{m}_hi": r["hi"] / scale})
        row.update(_exact_columns(exact, directions, s, math.sqrt(norm2.loc[s])))
        row["verdict"] = _verdict(row)
        out.append(row)
    return pd.DataFrame(out)


def variance_summary(comp: pd.DataFrame) -> dict:
    """The comparison's numbers for summary.json: per lag every column of ``comparison`` but the cosines of the mean."""
    per_lag = {}
    for _, r in comp.iterrows():
        per_lag[f"{r['lag']:g}"] = {
            "kl_token": r["kl_token"], "ess_frac": r["ess_frac"], "verdict": r["verdict"],
            **{f"{e}_{m}": [r[f"{e}_{m}"], r[f"{e}_{m}_lo"], r[f"{e}_{m}_hi"]]
               for e in ("vespo", "seq_is") for m in ("rel_mse", "variance")},
            **{c: r[c] for c in comp.columns if c.endswith(("_exact_bias", "_exact_cos", "_exact_size"))}}
    last = comp.iloc[-1]
    return {"vespo_lower_mse_at_lags": [float(v) for v in comp.loc[comp["verdict"] == "VESPO lower", "lag"]],
            "seq_is_lower_mse_at_lags": [float(v) for v in comp.loc[comp["verdict"] == "seq IS lower", "lag"]],
            "max_lag": float(last["lag"]),
            "mse_ratio_vespo_over_seq_is_at_max_lag": float(last["vespo_rel_mse"] / last["seq_is_rel_mse"]),
            "per_lag": per_lag}


def _variance_results(cfg: Config, progress: bool | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    main_cfg, exact_cfg = cfg.variance_configs()
    main, _ = variance.run(main_cfg, progress=progress)
    with warnings.catch_warnings():  # only its exact_bias_norm is used; its 2-replicate statistics are throwaway
        warnings.simplefilter("ignore", RuntimeWarning)
        exact, _ = variance.run(exact_cfg, progress=False)
    return main, exact


def run(cfg: Config, progress: bool | None = None) -> StudyResult:
    """The exact bound check over (bound_seeds x lags, KL targets, temperatures x kernels), the variance studies at
    ``lags`` (seed ``cfg.seed``) and the exact expected-gradient directions: one tidy table (column ``part``) and the
    summary (bound numbers and the per-lag comparison)."""
    cfg.validate()
    bound = bound_table(cfg)
    main, exact = _variance_results(cfg, progress)
    env_name = cfg.make_env().name
    results = pd.concat([tidy_bound(bound), main.assign(part="variance"), exact.assign(part="exact_bias"),
                         _tidy_directions(exact_directions(cfg), env_name, cfg.seed)], ignore_index=True)
    summary = build(Summary, {
        "study": "vespo_bound", "env": env_name, "policy": cfg.policy, **bound_summary(bound),
        **variance_summary(comparison(results)),
        "config": {k: getattr(cfg, k) for k in ("replicates", "batch_size", "group_size", "advantage", "loss_agg_mode",
                                                "seed")}})
    return StudyResult(results, asdict(summary))
