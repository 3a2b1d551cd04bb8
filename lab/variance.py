"""The variance engine: bias, variance and MSE of every estimator on the same replicate batches.

For each staleness setting: build mu, draw M independent batches of B responses from it (B/G prompts drawn
uniformly, G responses each), evaluate every estimator on the same batches (vmap over replicates), and
compare the M gradient estimates g_m with the target c * grad J (c = 1 for seq-mean-token-sum, 1/T for the
per-token normalised modes; exact by enumeration, or a large on-policy Monte Carlo reference). Estimators whose
on-policy gradient is a multiple of grad J (GVPO: beta) are divided by that multiple first. Extra inputs a study
provides: group rewards and the group size.

    bias2      = ||mean_m g_m - g*||^2 - variance / M  (unbiased for ||E g - g*||^2; bias_norm = sqrt(max(bias2, 0)))
    variance   = trace Cov(g_m) (divisor M - 1)       mse = mean_m ||g_m - g*||^2
    cos_mean   = cos(mean_m g_m, g*)                  cos_single = mean_m cos(g_m, g*)
    exact_bias_norm = ||E_mu[g] - g*||  (by enumeration, advantage 'reward', separable losses only)

Intervals: percentile bootstrap over replicates; every vector statistic is a quadratic form in the Gram
matrix of the estimates, so a bootstrap resample costs O(M^2), not O(M D).
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import torch
from scipy.special import erfinv
from tqdm import tqdm

import toy_envs
from lab import advantages as adv_mod
from lab import diagnostics, estimators, stats
from lab.batch import Batch
from lab.errors import LabError
from lab.estimators.aggregation import check_mode, target_scale
from lab.exact import divergence, make_support, policy_gradient
from lab.gradients import check_inputs, expected_gradient, replicate_gradients
from lab.policies import init_params, make_policy, sample, token_log_probs
from lab.staleness import KINDS, behaviour_params, check_value, optimisation_trajectory

DEFAULT_ESTIMATORS = ("reinforce", "seq_is", "token_is", "ppo_clip")
STUDY_INPUTS = ("rewards", "group_size", "logits")  # extra estimator inputs a study provides
GRADIENT_MEMORY_BUDGET = 2 * 2**30  # bytes for the [M, D] float32 estimates of one estimator


@dataclass
class VarianceConfig:
    """One variance study. Every field has a default: ``VarianceConfig()`` runs in seconds."""

    env: str = "tiny_target"  # toy_envs preset name
    env_overrides: dict = field(default_factory=dict)  # preset fields to change, e.g. {"length": 6}
    policy: str = "prefix"  # tabular policy: prefix (any distribution) or markov
    staleness: str = "lag"  # lag | kl | temperature
    values: list = field(default_factory=lambda: [0, 1, 2, 4, 8, 16, 32, 64])  # staleness settings
    estimators: list = field(default_factory=lambda: list(DEFAULT_ESTIMATORS))
    hyper: dict = field(default_factory=dict)  # {estimator: {hyper: value}} overrides of registry defaults
    advantage: str = "rloo"  # reward | rloo | grpo | drgrpo
    group_size: int = 8  # G responses per prompt
    batch_size: int = 64  # B responses per batch (a multiple of G)
    replicates: int = 500  # M independent batches per setting
    loss_agg_mode: str = "seq-mean-token-sum"  # or "native": each estimator's own default
    reference: str = "exact"  # exact (enumeration) | mc (Monte Carlo reference for large spaces)
    mc_samples: int = 65536  # samples behind each Monte Carlo expectation
    enum_limit: int = toy_envs.DEFAULT_ENUM_LIMIT
    init_scale: float = 1.0  # initial logits ~ N(0, init_scale^2)
    trajectory_steps: int = 64  # Adam steps from the initial policy to pi (the lag knob's trajectory)
    lr: float = 0.05  # Adam learning rate of that trajectory
    n_boot: int = 1000  # bootstrap resamples
    ci: float = 0.95  # interval coverage
    seed: int = 0

    def validate(self):
        env = toy_envs.make(self.env, **self.env_overrides)
        make_policy(self.policy, env)
        if self.staleness not in KINDS:
            raise LabError(f"unknown staleness kind {self.staleness!r}; choose one of {', '.join(KINDS)}")
        if not self.values:
            raise LabError("give at least one staleness value")
        for v in self.values:
            check_value(self.staleness, float(v), self.trajectory_steps)
        if not self.estimators:
            raise LabError("give at least one estimator")
        for name in self.estimators:
            if estimators.info(name).family == "distillation":
                raise LabError(f"estimator {name!r} distils a teacher and has its own target; use the distillation "
                               f"study (`lab report opd_variance`)")
            check_inputs(name, STUDY_INPUTS)
            if not applicable(name):
                raise LabError(f"estimator {name!r} is a KL penalty: its gradient targets a divergence, not grad J; "
                               f"leave it out of variance studies")
            estimators.check_hyper(name, self.hyper.get(name, {}))
            if "group_size" in estimators.info(name).inputs and self.group_size < 2:
                raise LabError(f"estimator {name!r} needs groups of at least 2 responses per prompt; "
                               f"raise --group-size")
        unknown = set(self.hyper) - set(self.estimators)
        if unknown:
            raise LabError(f"hyper-parameters given for estimator(s) not in the study: {', '.join(sorted(unknown))}")
        if self.loss_agg_mode != "native":
            check_mode(self.loss_agg_mode)
        if self.batch_size < 1:
            raise LabError(f"batch size must be at least 1, got {self.batch_size}")
        if self.replicates < 2:
            raise LabError(f"replicates must be at least 2 to measure a variance, got {self.replicates}")
        adv_mod.check(self.advantage, self.group_size)
        if self.batch_size % self.group_size:
            raise LabError(f"batch size {self.batch_size} must be a multiple of the group size {self.group_size}")
        if self.reference not in ("exact", "mc"):
            raise LabError(f"unknown reference {self.reference!r}; choose exact or mc")
        if self.reference == "exact":
            env.check_enumerable(self.enum_limit)
        if not (math.isfinite(self.init_scale) and self.init_scale >= 0):
            raise LabError(f"init scale must be a finite non-negative number, got {self.init_scale}")
        if self.trajectory_steps < 0 or self.lr <= 0 or not math.isfinite(self.lr):
            raise LabError("trajectory steps must be >= 0 and the learning rate a positive number")
        if not 0 < self.ci < 1 or self.n_boot < 10:
            raise LabError("ci must lie in (0, 1) and n_boot be at least 10")
        check_gradient_memory(self.replicates, make_policy(self.policy, env))
        return env


def best_by_mse(per_estimator: dict) -> str | None:
    """The lowest-MSE estimator, or None when none beats a zero update (relative MSE >= 1)."""
    best = min(per_estimator, key=lambda n: per_estimator[n]["rel_mse"])
    return best if per_estimator[best]["rel_mse"] < 1 else None


def agg_mode(name: str, mode: str) -> str:
    """The aggregation an estimator runs with in a study: the study's, or with "native" (or when its loss fixes
    its own aggregation, as GVPO's does) its own default."""
    info = estimators.info(name)
    return info.loss_agg_mode if mode == "native" or info.fixed_agg else mode


def applicable(name: str) -> bool:
    """Whether an estimator is a policy-gradient estimator this study can run (inputs provided, not a penalty)."""
    info = estimators.info(name)
    return info.family != "kl-penalty" and set(info.inputs) <= set(STUDY_INPUTS)


def grad_scale(name: str, hyper: dict) -> float:
    """c with E[-grad loss] = c * grad J on-policy (GVPO: beta); estimates are divided by it before comparison."""
    info = estimators.info(name)
    return 1.0 if info.grad_scale is None else float(info.grad_scale({**info.defaults, **hyper}))


def check_gradient_memory(replicates: int, policy) -> None:
    """Refuse a study whose [M, D] float32 gradient estimates would not fit the budget."""
    D = int(np.prod(policy.shape))
    need = replicates * D * 4
    if need > GRADIENT_MEMORY_BUDGET:
        raise LabError(f"{replicates} replicates x {D:,} parameters need {need / 2**30:.1f} GiB of gradient "
                       f"estimates (budget {GRADIENT_MEMORY_BUDGET / 2**30:.0f} GiB); use fewer replicates or "
                       f"the markov policy")


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def draw_batches(env, policy, theta_mu, M, B, G, generator) -> Batch:
    """M replicate batches [M, B, ...] from mu; B/G prompts per batch drawn uniformly, G responses each."""
    prompts = torch.randint(env.n_prompts, (M, B // G), generator=generator).repeat_interleave(G, dim=-1)
    tokens, mask, logp = sample(policy, theta_mu.float(), env, prompts.reshape(-1), generator)
    rewards = env.sample_reward(prompts.reshape(-1), tokens, mask, generator).float()
    T = env.length
    return Batch(prompts, tokens.reshape(M, B, T), mask.reshape(M, B, T), logp.reshape(M, B, T),
                 rewards.reshape(M, B), G)


def gram_metrics(grads: torch.Tensor, target: torch.Tensor, counts: np.ndarray, ci: float) -> dict:
    """Bias, variance, MSE and cosines of estimates [M, D] against ``target`` [D], with bootstrap intervals.

    ||mean g - g*||^2 overstates the squared bias by variance / M, so the bias and the cosine of the mean use
    the debiased forms (bias2 = ||mean g - g*||^2 - variance/M; ||mean g||^2 - variance/M in the cosine's norm,
    NaN where that debiased squared norm is not positive: the mean is lost in the noise)
    with normal bootstrap intervals (point -/+ z sd of the resampled statistic): a percentile interval would
    inherit the resamples' upward shift. The variance and the means over replicates (mse, cos_single) use
    percentile intervals.
    """
    g = grads.double()
    M = g.shape[0]
    gram = (g @ g.T).numpy()
    h = (g @ target.double()).numpy()
    diag = np.diag(gram).copy()
    tt = float(target.double() @ target.double())
    C = np.vstack([np.ones(M), counts])  # row 0: the sample itself, then the bootstrap resamples
    q = ((C @ gram) * C).sum(1)  # c^T G c
    ch, cd = C @ h, C @ diag
    variance = (cd - q / M) / (M - 1)
    mean_sq = q / M**2 - variance / M  # debiased ||E g||^2
    bias2 = mean_sq - 2 * ch / M + tt
    with np.errstate(divide="ignore", invalid="ignore"):
        cos_mean = np.where(mean_sq > 0, np.clip((ch / M) / np.sqrt(np.abs(mean_sq) * tt), -1.0, 1.0), np.nan)
        cos_single = h / np.sqrt(diag * tt)
    z = float(np.sqrt(2.0) * erfinv(ci))
    out = {}
    out["variance"] = (float(variance[0]), *stats.percentile_interval(variance[1:], ci))
    for key, series in {"bias2": bias2, "cos_mean": cos_mean}.items():
        boot = series[1:][np.isfinite(series[1:])]
        sd = float(np.std(boot, ddof=1)) if boot.size > 1 else float("nan")
        out[key] = (float(series[0]), float(series[0]) - z * sd, float(series[0]) + z * sd)
    out["cos_mean"] = tuple(float(np.clip(v, -1.0, 1.0)) for v in out["cos_mean"])
    out["bias_norm"] = tuple(float(np.sqrt(max(v, 0.0))) for v in out["bias2"])
    out["mse"] = stats.mean_interval(diag - 2 * h + tt, counts, ci)
    out["rel_mse"] = tuple(v / tt if tt > 0 else float("nan") for v in out["mse"])
    out["cos_single"] = stats.mean_interval(cos_single, counts, ci)
    return out


def weight_diagnostics(batch: Batch, log_prob_pi: torch.Tensor, counts: np.ndarray, ci: float) -> dict:
    """Sampled weight diagnostics per replicate, summarised with bootstrap intervals over replicates."""
    delta = (log_prob_pi - batch.behaviour_log_probs) * batch.mask  # [M, B, T]
    L = delta.sum(-1).double()  # [M, B]
    tokens = batch.mask.sum((-2, -1)).double()
    per_rep = {
        "ess_frac": diagnostics.kish_ess_fraction(L),
        "max_weight_share": diagnostics.max_weight_share(L),
        "chi2_seq_sampled": diagnostics.chi2(L),
        "k1_seq": diagnostics.kl_k1(L).mean(-1),
        "k3_seq": diagnostics.kl_k3(L).mean(-1),
        "k1_token": (diagnostics.kl_k1(delta.double()) * batch.mask).sum((-2, -1)) / tokens,
        "k3_token": (diagnostics.kl_k3(delta.double()) * batch.mask).sum((-2, -1)) / tokens,
        "khat": torch.from_numpy(diagnostics.psis_khat(L.numpy())),
    }
    return {k: stats.mean_interval(v.numpy(), counts, ci) for k, v in per_rep.items()}


@dataclass
class StudyResult:
    config: VarianceConfig
    results: pd.DataFrame  # tidy: one row per (staleness, estimator, metric)
    summary: dict


def run_study(cfg: VarianceConfig, progress: bool | None = None) -> StudyResult:
    """Run one variance study; deterministic given ``cfg.seed``."""
    env = cfg.validate()
    policy = make_policy(cfg.policy, env)
    torch_gen = torch.Generator().manual_seed(_seed(cfg.seed, 0))
    theta0 = init_params(policy, cfg.init_scale, torch_gen)
    traj = optimisation_trajectory(env, policy, theta0, cfg.trajectory_steps, cfg.lr, cfg.reference,
                                   cfg.enum_limit, cfg.mc_samples, torch_gen)
    theta_pi = traj.current
    support_pi = make_support(env, policy, theta_pi, cfg.reference, cfg.enum_limit, cfg.mc_samples,
                              torch.Generator().manual_seed(_seed(cfg.seed, 1)))
    grad_j = policy_gradient(env, policy, theta_pi, support_pi).reshape(-1)
    agg = {name: agg_mode(name, cfg.loss_agg_mode) for name in cfg.estimators}
    g_star = {name: target_scale(agg[name], env.length) * grad_j for name in cfg.estimators}
    rows, per_value = [], []
    key = dict(env=env.name, policy=cfg.policy, staleness_kind=cfg.staleness, seed=cfg.seed, reference=cfg.reference)
    quiet = os.environ.get("CI") or os.environ.get("LAB_QUIET")
    bar = tqdm(total=len(cfg.values) * len(cfg.estimators), desc="variance", disable=quiet or progress is False)

    def add(value, estimator, metric, v, lo=None, hi=None):
        rows.append({**key, "staleness": float(value), "estimator": estimator, "metric": metric, "value": float(v),
                     "lo": float(v if lo is None else lo), "hi": float(v if hi is None else hi)})

    grads = None  # the [M, D] estimates, one buffer reused by every estimator and setting
    for i, value in enumerate(cfg.values):
        gen = torch.Generator().manual_seed(_seed(cfg.seed, 2, i))
        theta_mu = behaviour_params(cfg.staleness, float(value), traj, env, policy, gen, cfg.reference,
                                    cfg.enum_limit, cfg.mc_samples)
        support_mu = make_support(env, policy, theta_mu, cfg.reference, cfg.enum_limit, cfg.mc_samples, gen)
        div = divergence(policy, theta_pi, theta_mu, support_mu)
        for metric, v in div.items():
            add(value, "-", metric, v)
        batch = draw_batches(env, policy, theta_mu, cfg.replicates, cfg.batch_size, cfg.group_size, gen)
        M, B, G = cfg.replicates, cfg.batch_size, cfg.group_size
        adv = adv_mod.group_advantages(batch.rewards.reshape(M, B // G, G), cfg.advantage).reshape(M, B)
        adv = adv[..., None] * batch.mask
        counts = stats.bootstrap_counts(M, cfg.n_boot, np.random.default_rng(_seed(cfg.seed, 3, i)))
        theta32 = theta_pi.float()
        with torch.no_grad():
            lp_pi = token_log_probs(policy, theta32, batch.prompts, batch.tokens) * batch.mask
        extras = {"rewards": batch.rewards}
        for metric, (v, lo, hi) in weight_diagnostics(batch, lp_pi, counts, cfg.ci).items():
            add(value, "-", metric, v, lo, hi)
        add(value, "-", "mean_reward_sampled", *stats.mean_interval(batch.rewards.mean(-1).numpy(), counts, cfg.ci))
        entry = {"staleness": float(value), **div, "estimators": {}}
        for name in cfg.estimators:
            hyper = cfg.hyper.get(name, {})
            grads, metrics = replicate_gradients(policy, theta32, batch, adv, name, agg[name], hyper,
                                                 extras, {"group_size": G}, out=grads)
            scale = grad_scale(name, hyper)
            res = gram_metrics(grads if scale == 1 else grads / scale, g_star[name].float(), counts, cfg.ci)
            if cfg.reference == "exact" and cfg.advantage == "reward" and not estimators.info(name).inputs:
                expected = expected_gradient(env, policy, theta_pi, theta_mu, support_mu, name, agg[name], hyper)
                if expected is not None:
                    res["exact_bias_norm"] = (float((expected / scale - g_star[name]).norm()),) * 3
            for metric, m_values in metrics.items():
                res[metric] = stats.mean_interval(m_values.double().numpy(), counts, cfg.ci)
            for metric, (v, lo, hi) in res.items():
                add(value, name, metric, v, lo, hi)
            entry["estimators"][name] = {m: v[0] for m, v in res.items()}
            bar.update(1)
        per_value.append(entry)
    bar.close()
    summary = {
        "study": "variance",
        "env": env.name,
        "staleness": cfg.staleness,
        "target_grad_norm": float(grad_j.norm()),
        "loss_agg_modes": agg,
        "objective": float((support_pi.weights * env.expected_reward(support_pi.prompts, support_pi.tokens,
                                                                        support_pi.mask)).sum()),
        "best_by_mse": {str(e["staleness"]): best_by_mse(e["estimators"]) for e in per_value},
        "per_value": per_value,
    }
    return StudyResult(cfg, pd.DataFrame(rows), summary)


def config_dict(cfg: VarianceConfig) -> dict:
    return asdict(cfg)
