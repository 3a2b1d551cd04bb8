"""The sampling_truncation study: every ratio-based correction under a top-p / top-k sampler, against two exact
truths, with and without mask replay.

pi is the end of a short Adam trajectory on the exact objective (enough entropy left for truncation to cut). For
each sampler setting (top_p = p or top_k = k; ``lab.policies.truncation``, vLLM's semantics) the sampler is
q = pi truncated and renormalised, at pi's own parameters: the only mismatch is the truncation. Per setting:

- the two truths by enumeration (``lab.engine.truncation``): grad J(pi) ("full") and grad J(q) with the kept sets
  held fixed ("deployed"), and their gap ||grad J(q) - grad J(pi)|| / ||grad J(pi)||, which no correction closes;
- the kept mass: exact E_q[pi(S_t)] per token, and on the sampled batches the trainer-to-sampler token ratio
  pi(y_t)/q(y_t) (its mean and its share outside [0.9, 1.1]), without and with renormalising the trainer over the
  recorded kept sets;
- per estimator, without and with mask replay, on the same replicate batches (``lab.engine.variance.measure``):
  bias, variance and MSE against each truth (the "@full" metrics against grad J(pi)), and for estimators whose
  expectation enumerates (separable loss, A = R) the exact relative bias against each truth.

Tidy rows: (kind, level, estimator, replay, metric, value, lo, hi), level the setting's p or k; setting-level rows
have estimator "-".
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import pandas as pd
import torch

import toy_envs
from lab import estimators
from lab.advantages import ADVANTAGES
from lab.configs import SEED_MAX, check_types, check_unique
from lab.engine.batches import draw_batches
from lab.engine.estimator import Estimator
from lab.engine.exact import Problem, exact_support
from lab.engine.gradients import expected_gradient, separable
from lab.engine.staleness import optimisation_trajectory
from lab.engine.truncation import deployed_gradient, full_gradient, kept_mass, sampler_kept_sets
from lab.engine.variance import PROVIDED_INPUTS, Sampling, measure
from lab.errors import LabError
from lab.policies import Truncated, init_params, make_policy, masked
from lab.policies.truncation import check_truncation, replayed
from lab.progress import bar
from lab.seeding import derive_seed, generator
from lab.studies import StudyResult
from lab.typed import knob

BAND = (0.9, 1.1)  # the ratio band of the published measurement (TRL PR 7269)


def ratio_based() -> list[str]:
    """Every estimator with an importance ratio this study can run with mask replay (not REINFORCE, not a penalty,
    not a distillation loss; inputs the variance engine provides)."""
    out = []
    for n in estimators.names():
        i = estimators.info(n)
        if i.mask_replay and i.family not in ("on-policy", "kl-penalty") and set(i.inputs) <= set(PROVIDED_INPUTS):
            out.append(n)
    return out


@dataclass
class Config:
    """One sampling_truncation study. Every field has a default: ``Config()`` runs in about a minute."""

    env: str = "small_dense"
    """toy env preset (see `lab envs`)"""
    policy: Literal["prefix", "markov", "transformer"] = "markov"
    """prefix | markov | transformer (the lab's own, size ``model``)"""
    model: str = "test"
    """transformer size (policy transformer): test | small | medium | moe | 1m"""
    top_p: list[float] = knob([1.0, 0.95, 0.9, 0.8], gt=0, le=1)
    """top-p settings of the sampler (1: none)"""
    top_k: list[int] = knob([4, 2], ge=1, le=10_000_000)
    """top-k settings of the sampler (at most the vocabulary size)"""
    estimators: list[str] = knob(["all"])
    """estimator names, or all: every ratio-based estimator (with an importance ratio and mask replay)"""
    advantage: Literal[ADVANTAGES] = "rloo"
    """advantages of the sampled batches: reward | rloo | grpo | drgrpo (the exact biases use A = R)"""
    group_size: int = knob(4, ge=2, le=4096)
    """G responses per prompt"""
    batch_size: int = knob(32, ge=2, le=1_000_000)
    """B responses per batch (a multiple of G)"""
    replicates: int = knob(60, ge=2, le=1_000_000)
    """M independent batches per setting"""
    init_scale: float = knob(1.0, ge=0, le=100)
    """initial logits ~ N(0, init_scale^2)"""
    trajectory_steps: int = knob(8, ge=0, le=1_000_000)
    """Adam steps from the initial policy to pi (few: pi keeps the entropy that truncation cuts)"""
    lr: float = knob(0.05, gt=0, le=1e3)
    """Adam learning rate of that trajectory"""
    n_boot: int = knob(400, ge=10, le=1_000_000)
    """bootstrap resamples"""
    ci: float = knob(0.95, gt=0, lt=1)
    """interval coverage"""
    seed: int = knob(0, ge=0, le=SEED_MAX)
    """seed of every random stream of the study"""

    def make_env(self):
        return toy_envs.make(self.env)

    def settings(self) -> list[tuple[str, float]]:
        """(kind, value) of every sampler setting: the top-p values, then the top-k values."""
        return [("top_p", float(p)) for p in self.top_p] + [("top_k", int(k)) for k in self.top_k]

    def names(self) -> list[str]:
        return ratio_based() if self.estimators == ["all"] else list(self.estimators)

    def validate(self) -> None:
        check_types(self)
        env = self.make_env()
        env.check_enumerable(toy_envs.DEFAULT_ENUM_LIMIT)
        if not self.settings():
            raise LabError("give at least one top_p or top_k setting")
        check_unique("top_p", [float(p) for p in self.top_p])
        check_unique("top_k", [int(k) for k in self.top_k])
        for p in self.top_p:
            check_truncation(top_p=float(p), vocab_size=env.vocab_size)
        for k in self.top_k:
            check_truncation(top_k=int(k), vocab_size=env.vocab_size)
        if not self.estimators:
            raise LabError("give at least one estimator")
        check_unique("estimators", self.estimators)
        allowed = set(ratio_based()) | {"reinforce"}
        for name in self.names():
            estimators.info(name)
            if name not in allowed:
                raise LabError(f"estimator {name!r} has no importance ratio to replay the kept set in (or needs inputs "
                               f"this study does not provide); choose among {', '.join(sorted(allowed))}")
        if self.batch_size % self.group_size:
            raise LabError(f"batch size {self.batch_size} must be a multiple of the group size {self.group_size}")


SMOKE = {"replicates": 20, "top_p": [1.0, 0.8], "top_k": [2], "n_boot": 100,
         "estimators": ["seq_is", "token_is", "ppo_clip"]}  # seconds: what the tests build


@dataclass
class Setting:
    """One sampler setting. ``estimators[name]["plain" | "replay"][metric]`` (value) with ``intervals`` alike
    ([lo, hi]); relative metrics: bias / ||truth||, sqrt(variance) / ||truth||, MSE / ||truth||^2."""

    kind: str  # top_p | top_k
    value: float
    kept_mass: float  # exact E_q[pi(S_t)] per real token
    mean_ratio: list[float]  # sampled mean of pi(y_t)/q(y_t) over real tokens, without replay [value, lo, hi]
    outside_band: list[float]  # sampled share of those ratios outside BAND, without replay
    mean_ratio_replay: list[float]  # the same with the trainer renormalised over the kept sets
    outside_band_replay: list[float]
    truth_gap: float  # ||grad J(q) - grad J(pi)|| / ||grad J(pi)||: what no correction recovers
    estimators: dict[str, dict[str, dict[str, float]]]
    intervals: dict[str, dict[str, dict[str, list[float]]]]


@dataclass
class Summary:
    """What a sampling_truncation study found (summary.json)."""

    study: str
    env: str
    policy: str
    vocab_size: int
    response_length: int
    full_grad_norm: float  # ||grad J(pi)||
    objective: float  # J(pi)
    per_setting: list[Setting]
    config: dict  # the sampling settings behind every setting


def _token_stats(ratio: torch.Tensor, mask: torch.Tensor, counts, ci) -> tuple[list, list]:
    """Per-replicate mean ratio and share outside BAND over real tokens, with bootstrap intervals."""
    from lab import stats

    real = mask > 0
    n = real.sum((-2, -1)).double()
    mean = torch.where(real, ratio, 0.0).sum((-2, -1)).double() / n
    out = (torch.where(real, (ratio < BAND[0]) | (ratio > BAND[1]), False)).sum((-2, -1)).double() / n
    return (list(stats.mean_interval(mean.numpy(), counts, ci)), list(stats.mean_interval(out.numpy(), counts, ci)))


def run(cfg: Config, progress: bool | None = None) -> StudyResult:
    """(tidy results, summary); deterministic given ``cfg.seed``."""
    from lab import stats

    cfg.validate()
    env = cfg.make_env()
    policy = make_policy(cfg.policy, env, cfg.model)
    problem = Problem(env, policy)
    names = cfg.names()
    plain = [Estimator.resolve(n, {}, "seq-mean-token-sum") for n in names]
    replay = [Estimator.resolve(n, {}, "seq-mean-token-sum", mask_replay=True) for n in names]
    g0 = generator(cfg.seed, 0)
    traj = optimisation_trajectory(problem, init_params(policy, cfg.init_scale, g0), cfg.trajectory_steps, cfg.lr, g0)
    pi = traj.current
    support_pi = exact_support(env, policy, pi, toy_envs.DEFAULT_ENUM_LIMIT)
    full = full_gradient(env, policy, pi, toy_envs.DEFAULT_ENUM_LIMIT)
    if not (torch.isfinite(full).all() and full.norm() > 0):
        raise LabError("the policy gradient of pi is zero or not finite; lower --trajectory-steps or --lr")
    sampling = Sampling(cfg.replicates, cfg.batch_size, cfg.group_size, cfg.advantage, cfg.ci, cfg.n_boot)
    rows, per_setting = [], []
    bars = bar(len(cfg.settings()) * 2 * len(names), "sampling_truncation", progress)
    for i, (kind, value) in enumerate(cfg.settings()):
        sampler = Truncated(policy, **{kind: value})
        mu = (sampler, pi)
        support_q = exact_support(env, sampler, pi, toy_envs.DEFAULT_ENUM_LIMIT)
        deployed = deployed_gradient(env, sampler, pi, toy_envs.DEFAULT_ENUM_LIMIT)
        kept = sampler_kept_sets(sampler, pi, support_q.prompts, support_q.tokens)
        m = kept_mass(policy, pi, support_q.prompts, support_q.tokens, kept)
        w = support_q.weights[:, None] * support_q.mask
        exact_mass = float((w * m).sum() / w.sum())
        truth_gap = float((deployed - full).norm() / full.norm())
        setting = {"kind": kind, "level": float(value)}

        def add(estimator, mode, metric, v, lo=None, hi=None):
            rows.append({**setting, "estimator": estimator, "replay": mode, "metric": metric, "value": float(v),
                         "lo": float(v if lo is None else lo), "hi": float(v if hi is None else hi)})

        # the token ratios a trainer logs, on the replicate batches (drawn again inside measure with the same seed)
        batch = draw_batches(env, mu, cfg.replicates, cfg.batch_size, cfg.group_size, generator(cfg.seed, 2, i))
        counts = stats.bootstrap_counts(cfg.replicates, cfg.n_boot, np.random.default_rng(derive_seed(cfg.seed, 4, i)))
        with torch.no_grad():
            logits = policy.logits(pi.float(), batch.prompts, batch.tokens)
            lp = torch.log_softmax(logits, -1).gather(-1, batch.tokens[..., None]).squeeze(-1)
            lp_replay = replayed(logits, batch.tokens, batch.kept)
        ratio = torch.exp(masked(lp - batch.behaviour_log_probs, batch.mask))
        ratio_replay = torch.exp(masked(lp_replay - batch.behaviour_log_probs, batch.mask))
        mean_ratio, outside = _token_stats(ratio, batch.mask, counts, cfg.ci)
        mean_ratio_r, outside_r = _token_stats(ratio_replay, batch.mask, counts, cfg.ci)
        for metric, v in [("kept_mass", [exact_mass] * 3), ("mean_ratio", mean_ratio), ("outside_band", outside),
                          ("truth_gap", [truth_gap] * 3)]:
            add("-", "plain", metric, *v)
        add("-", "replay", "mean_ratio", *mean_ratio_r)
        add("-", "replay", "outside_band", *outside_r)
        points, intervals = {}, {}
        for mode, ests in (("plain", plain), ("replay", replay)):
            measured, pts, ivs = measure(problem, pi, mu, support_q, ests, deployed, sampling,
                                         generator(cfg.seed, 2, i), np.random.default_rng(derive_seed(cfg.seed, 3, i)),
                                         on_estimator=lambda: bars.update(1), targets={"full": full})
            for est in ests:
                exact = {}
                if not est.info.inputs and separable(est.loss_agg_mode, env):
                    e = expected_gradient(env, policy, pi, mu, support_q, est)
                    if e is not None:
                        e = e / est.grad_scale
                        exact = {"exact_bias": float((e - deployed).norm() / deployed.norm()),
                                 "exact_bias@full": float((e - full).norm() / full.norm())}
                res = {k: v for k, v in pts[est.name].items()}
                iv = {k: v for k, v in ivs[est.name].items()}
                norm2 = {"": float(deployed @ deployed), "@full": float(full @ full)}
                for suffix, n2 in norm2.items():
                    res["rel_bias" + suffix] = res["bias_norm" + suffix] / math.sqrt(n2)
                    iv["rel_bias" + suffix] = [x / math.sqrt(n2) for x in iv["bias_norm" + suffix]]
                    res["rel_noise" + suffix] = math.sqrt(max(res["variance" + suffix], 0.0) / n2)
                    iv["rel_noise" + suffix] = [math.sqrt(max(x, 0.0) / n2) for x in iv["variance" + suffix]]
                res.update(exact)
                iv.update({k: [v, v] for k, v in exact.items()})
                keep = [k for k in res if k.split("@")[0] in ("rel_bias", "rel_noise", "rel_mse", "bias_norm",
                                                             "variance", "mse", "exact_bias")]
                points.setdefault(est.name, {})[mode] = {k: res[k] for k in keep}
                intervals.setdefault(est.name, {})[mode] = {k: list(iv[k]) for k in keep}
                for k in keep:
                    add(est.name, mode, k, res[k], *iv[k])
            del measured
        per_setting.append(Setting(kind, float(value), exact_mass, mean_ratio, outside, mean_ratio_r, outside_r,
                                   truth_gap, points, intervals))
    bars.close()
    R = env.expected_reward(support_pi.prompts, support_pi.tokens, support_pi.mask)
    summary = Summary(study="sampling_truncation", env=env.name, policy=cfg.policy, vocab_size=env.vocab_size,
                      response_length=env.length, full_grad_norm=float(full.norm()),
                      objective=float((support_pi.weights * R).sum()), per_setting=per_setting,
                      config={k: getattr(cfg, k) for k in ("batch_size", "group_size", "advantage", "replicates")})
    return StudyResult(pd.DataFrame(rows), asdict(summary))
