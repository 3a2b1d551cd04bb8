"""VESPO's variance bound (Proposition 3.1) checked exactly, and VESPO against sequence IS as rollouts go stale.

Proposition 3.1 (Shen et al., arXiv 2602.10693; code github.com/FloyedShen/VESPO). For a reshaping kernel phi with
K = sup_w phi(w)/w < inf and the implicit proposal Q = mu phi(W) / Z, Z = E_mu[phi(W)]:

    E_mu[phi(W)^2] <= Z K C,   C = E_Q[W] = E_mu[phi(W) W] / Z,   so  Z K C = K E_mu[phi(W) W].

Proof in one line: phi(w) <= K w pointwise; multiply by phi(w) >= 0 and take E_mu. It holds for ANY mu and pi, so a
violation can only come from an implementation that does not evaluate phi and W consistently. The ratio
E_mu[phi^2] / (Z K C) in (0, 1] measures tightness: 1 when mu puts all its mass where phi(w)/w peaks,
w = (k-1)/lambda; on-policy (W = 1) it is 1/K.

The check is exact: every (prompt, response) pair is enumerated with its probability mu(y)/P in float64, and W uses
the estimator's own numerics (``lab.estimators.vespo.sequence_log_weight``: token log-ratios clamped to [-20, 20],
summed, L clamped to [-20, 20]; ``sequence_coefficient``: the authors' log-space phi). Staleness comes from
``lab.engine.staleness``: lag (snapshots of the Adam trajectory the variance study uses, same seeds), per-token KL
targets and sampler temperature. The estimator's phi can leave the bound only through the authors' floor
log W >= log 1e-8 with k = 1 (phi(w)/w > e^lambda for L < -18.42): ``floor_mass`` = mu(L < -18.42) is reported with
every setting. Kernels with k < 1 have no K (phi(w)/w -> inf as w -> 0): K = inf and no ratio.

The second half runs the variance study (``lab.studies.variance``) on VESPO, sequence IS, PPO clip and REINFORCE at
each lag, once more with advantage "reward" for each estimator's exact expected-gradient bias, and splits that
expected gradient into direction (cosine) and size. ``run`` returns one tidy table whose ``part`` column says which
half a row comes from: bound | variance | exact_bias | exact_direction.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

import toy_envs
from lab.engine.estimator import Estimator
from lab.engine.exact import Problem, divergence, policy_gradient
from lab.engine.gradients import expected_gradient, separable
from lab.engine.staleness import behaviour, check_value, optimisation_trajectory
from lab.errors import LabError
from lab.estimators import vespo
from lab.policies import init_params, make_policy, token_log_probs
from lab.seeding import generator
from lab.studies import StudyResult
from lab.studies import variance

DEFAULT_KERNELS = ([2.0, 3.0], [3.0, 2.0], [1.0, 1.0], [1.0, 3.0], [1.5, 1.0], [2.0, 1.0], [4.0, 2.0], [0.5, 1.0])
TOLERANCE = 1e-9  # float64 rounding: a ratio above 1 + TOLERANCE counts as a violation
ESTIMATORS = ("vespo", "seq_is", "ppo_clip", "reinforce")
BOUND_METRICS = ("Z", "C", "K", "phi2", "bound", "ratio", "w2", "floor_mass", "kl_token", "chi2_seq")
BOUND_KEYS = ("env", "policy", "seed", "staleness_kind", "staleness", "k", "lam", "kernel")
KNOBS = (("lag", "lags"), ("kl", "kl_targets"), ("temperature", "temperatures"))  # staleness kind, Config field


def kernel_label(k: float, lam: float) -> str:
    return f"k={k:g}, λ={lam:g}"


@dataclass
class Config:
    """The vespo_bound report: the exact bound check and the variance comparison. ``Config()`` is the full report."""

    env: str = "tiny_target"
    """toy env preset (must be enumerable)"""
    env_overrides: dict = field(default_factory=dict, metadata={"flag": "--set", "parse": "pairs"})
    """env fields to change, e.g. length=3"""
    policy: str = "prefix"
    """prefix (any sequence distribution) | markov"""
    lags: list = field(default_factory=lambda: [0, 1, 2, 4, 8, 16, 32, 64], metadata={"parse": "list"})
    """optimiser steps between mu and pi (bound check and variance study)"""
    kl_targets: list = field(default_factory=lambda: [0.01, 0.03, 0.1, 0.3, 1.0], metadata={"parse": "list"})
    """per-token KL(mu||pi) targets (bound check)"""
    temperatures: list = field(default_factory=lambda: [0.5, 0.7, 1.5, 2.0], metadata={"parse": "list"})
    """sampler temperatures (bound check)"""
    kernels: list = field(default_factory=lambda: [list(k) for k in DEFAULT_KERNELS])
    """[k, lambda] pairs of the kernel phi(W) = W^k e^(lambda (1 - W)) (bound check)"""
    bound_seeds: list = field(default_factory=lambda: [0, 1, 2], metadata={"parse": "list"})
    """one random initial policy and Adam trajectory each (bound check)"""
    trajectory_steps: int = 64
    """length of pi's Adam trajectory; lags must not exceed it"""
    init_scale: float = 1.0
    """initial logits ~ N(0, init_scale^2)"""
    lr: float = 0.05
    """Adam learning rate of the trajectory"""
    replicates: int = 500
    """replicate batches per lag (variance study)"""
    batch_size: int = 64
    """B responses per batch"""
    group_size: int = 8
    """G responses per prompt"""
    advantage: str = "rloo"
    """reward | rloo | grpo | drgrpo (variance study; the exact-bias study always uses reward)"""
    loss_agg_mode: str = field(default="token-mean", metadata={"flag": "--agg"})
    """loss aggregation mode: VESPO's (and verl's) default token-mean"""
    seed: int = 0
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


# ---- exact second moments ---------------------------------------------------------------------------------

def sequence_log_weights(pi: tuple, mu: tuple, support_mu) -> torch.Tensor:
    """L(y) = log pi(y)/mu(y) for every pair of mu's support, with the estimator's clamps (float64, [N]).

    ``pi`` and ``mu`` are (policy, theta) pairs, as everywhere in the engine."""
    s = support_mu
    with torch.no_grad():
        lp_pi = token_log_probs(pi[0], pi[1].double(), s.prompts, s.tokens) * s.mask
        lp_mu = token_log_probs(mu[0], mu[1].double(), s.prompts, s.tokens) * s.mask
        L, _ = vespo.sequence_log_weight(lp_pi, lp_mu, s.mask)
    return L[:, 0]


def bound_terms(L: torch.Tensor, weights: torch.Tensor, k: float, lam: float) -> dict:
    """Proposition 3.1's terms for sequence log-weights ``L`` with probabilities ``weights`` under mu (exact).

    Z = E_mu[phi], C = E_Q[W], K, phi2 = E_mu[phi^2], bound = Z K C, ratio = phi2 / bound (NaN where K = inf),
    w2 = E_mu[W^2] (sequence IS's second moment, for scale) and floor_mass = mu(L < log 1e-8), the mass where the
    authors' floor inside log W is active.
    """
    vespo.check_kernel(k, lam)
    L, w = L.double(), weights.double()
    W = torch.exp(L)
    ph = vespo.sequence_coefficient(L, k, lam)
    Z = float((w * ph).sum())
    phiW = float((w * ph * W).sum())
    phi2 = float((w * ph**2).sum())
    K = vespo.bound_constant(k, lam)
    bound = K * phiW if math.isfinite(K) else math.inf
    return {"Z": Z, "C": phiW / Z if Z > 0 else math.nan, "K": K, "phi2": phi2, "bound": bound,
            "ratio": phi2 / bound if math.isfinite(bound) and bound > 0 else math.nan,
            "w2": float((w * W**2).sum()), "floor_mass": float(w[L < vespo.LOG_W_FLOOR].sum())}


def trajectory(cfg: Config, seed: int):
    """(problem, Adam trajectory) for one seed: the variance study's own (same seed, same generator)."""
    problem = cfg.problem()
    gen = generator(seed, 0)
    theta0 = init_params(problem.policy, cfg.init_scale, gen)
    return problem, optimisation_trajectory(problem, theta0, cfg.trajectory_steps, cfg.lr, gen)


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


def _kernel_facts(k: float, lam: float, K: float) -> dict:
    """K, where phi(w)/w peaks ((k-1)/lambda; 0 for k <= 1, approached) and the on-policy ratio 1/K (W = 1 everywhere:
    phi^2 / (K phi W) = 1/K); None for both where K = inf."""
    finite = math.isfinite(K)
    return {"k": k, "lam": lam, "K": K, "peak_w": vespo.argmax_bound(k, lam) if finite else None,
            "on_policy_ratio": 1.0 / K if finite else None}


def bound_summary(bound: pd.DataFrame) -> dict:
    """Largest ratio over every setting with a finite K, the violation count, the tightest setting, per kernel its
    K, where phi(w)/w peaks, its on-policy ratio 1/K and its largest / median / smallest measured ratio."""
    finite = bound[np.isfinite(bound["ratio"])]
    worst = finite.loc[finite["ratio"].idxmax()]
    per_kernel = {}
    for label, g in bound.groupby("kernel", sort=False):
        ok = g[np.isfinite(g["ratio"])]
        per_kernel[label] = {**_kernel_facts(float(g["k"].iloc[0]), float(g["lam"].iloc[0]), float(g["K"].iloc[0])),
                             "max_ratio": float(ok["ratio"].max()) if len(ok) else None,
                             "median_ratio": float(ok["ratio"].median()) if len(ok) else None,
                             "min_ratio": float(ok["ratio"].min()) if len(ok) else None}
    off = finite[finite["kl_token"] > 0]
    return {
        "max_bound_ratio": float(finite["ratio"].max()),
        "max_bound_ratio_off_policy": float(off["ratio"].max()) if len(off) else None,
        "violations": int((finite["ratio"] > 1 + TOLERANCE).sum()),
        "settings_checked": int(len(finite)),
        "settings_without_bound": int((~np.isfinite(bound["K"])).sum()),
        "tightest": {"kernel": worst["kernel"], "staleness_kind": worst["staleness_kind"],
                     "staleness": float(worst["staleness"]), "seed": int(worst["seed"]),
                     "ratio": float(worst["ratio"])},
        "per_kernel": per_kernel,
        "max_floor_mass": float(bound["floor_mass"].max()),
        "staleness_kinds": sorted(bound["staleness_kind"].unique()),
        "bound_seeds": int(bound["seed"].nunique()),
    }


def tidy_bound(bound: pd.DataFrame) -> pd.DataFrame:
    """The wide bound table as tidy rows (one per setting x kernel x metric), keyed like the variance results."""
    long = bound.melt(id_vars=list(BOUND_KEYS), value_vars=list(BOUND_METRICS), var_name="metric", value_name="value")
    return long.assign(part="bound", estimator="vespo", lo=long["value"], hi=long["value"])


def bound_rows(results: pd.DataFrame) -> pd.DataFrame:
    """The wide bound table back from ``run``'s tidy results (rows in the order the study computed them)."""
    tidy = results[results["part"] == "bound"]
    keys = list(BOUND_KEYS)
    wide = tidy.set_index([*keys, "metric"])["value"].unstack("metric").reset_index()
    out = tidy.drop_duplicates(keys)[keys].merge(wide, on=keys, how="left")
    return out[[*keys, *[m for m in BOUND_METRICS if m in out]]]


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
    summary (bound numbers, per-lag comparison, and what the report's text needs)."""
    cfg.validate()
    bound = bound_table(cfg)
    main, exact = _variance_results(cfg, progress)
    env_name = cfg.make_env().name
    results = pd.concat([tidy_bound(bound), main.assign(part="variance"), exact.assign(part="exact_bias"),
                         _tidy_directions(exact_directions(cfg), env_name, cfg.seed)], ignore_index=True)
    summary = {"study": "vespo_bound", "env": env_name, "policy": cfg.policy, **bound_summary(bound),
               **variance_summary(comparison(results)),
               "config": {k: getattr(cfg, k) for k in ("replicates", "batch_size", "group_size", "advantage",
                                                       "loss_agg_mode", "seed")}}
    return StudyResult(results, summary)
