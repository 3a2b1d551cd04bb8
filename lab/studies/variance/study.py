"""The variance study: bias, variance and MSE of every estimator as the behaviour policy goes stale.

pi is the end of an Adam trajectory on the exact objective; each staleness setting builds mu (``lab.engine.staleness``),
measures its exact divergence from pi, and runs the variance engine (``lab.engine.variance.measure``) on the same
replicate batches for every estimator. Results: tidy rows keyed by (env, policy, staleness_kind, staleness, seed,
reference, estimator, metric); divergence rows have estimator "-".

The reference is stated: "exact" (enumeration; every divergence and grad J exact, intervals are points), "dp" (the
same exact numbers by dynamic programming over positions, ``lab.engine.dp``: a Markov policy on a bandit with a
reward accumulated along the response, at any length; exact bias for token IS and REINFORCE, and every other
estimator's bias from its replicates against the exact grad J) or "mc" (``mc_samples`` on-policy samples): the
divergences then carry CLT intervals, grad J its standard error (``target_grad_se`` = sqrt(tr Cov), a row per
setting and in the summary), and the statistics against it remove that error from ||g*||^2
(``lab.engine.metrics``). "auto", the default, is exact where the enumeration fits, else dp where it applies.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import pandas as pd
import torch

import toy_envs
from lab import advantages as adv_mod
from lab import estimators
from lab.advantages import ADVANTAGES
from lab.configs import SEED_MAX, check_types, check_unique
from lab.estimators.aggregation import AGG_MODES
from lab.engine.estimator import Estimator
from lab.engine import dp
from lab.engine.exact import REFERENCES, Problem, divergence_intervals, reference_gradient
from lab.engine.gradients import budget_chunk, direction, exact_direction
from lab.engine.metrics import streamed_memory
from lab.engine.staleness import KINDS, behaviour, check_value, optimisation_trajectory, truncate
from lab.engine.variance import PROVIDED_INPUTS, Sampling, measure
from lab.errors import LabError
from lab.policies import KINDS as POLICY_KINDS
from lab.policies import check_device, init_params, make_policy
from lab.policies.truncation import check_truncation
from lab.progress import bar
from lab.seeding import derive_seed, generator
from lab.runs import check_cache_dir
from lab.studies import StudyResult
from lab.typed import knob

DEFAULT_ESTIMATORS = ("reinforce", "seq_is", "token_is", "ppo_clip")
BATCH_MEMORY_BUDGET = 4 * 2**30  # bytes for the replicate batches and the bootstrap counts
ENUM_LOGITS_LIMIT = 2**31  # logits in one pass over an exact reference's enumeration (16 GiB of float64, in chunks)


@dataclass
class Config:
    """One variance study. Every field has a default: ``Config()`` runs in seconds."""

    env: str = "tiny_target"
    """toy env preset (see `lab envs`)"""
    env_overrides: dict = knob({}, flag="--set", parse="pairs")
    """env fields to change, e.g. length=6"""
    policy: Literal[tuple(POLICY_KINDS)] = "prefix"
    """prefix (any sequence distribution) | markov | transformer | hf (a local causal LM at --model)"""
    model: str = "small"
    """transformer size (policy transformer): test | small | medium | moe | 1m; policy hf: the model's path (a
    save_pretrained folder or a .gguf file) whose vocabulary holds the env's token ids"""
    params: str = "last:1"
    """trainable subset of an hf policy (theta): last:k (the last k blocks), lm_head, lora:r=R, or a regex over
    parameter names (lab.policies.hf)"""
    warm_start: float = knob(0.0, ge=0, lt=1)
    """start from the supervised warm start of a transformer of size ``model`` at this exact-match accuracy (0: the
    policy's random init); a prefix policy copies that transformer's distribution"""
    staleness: Literal[KINDS] = "lag"
    """lag | kl | temperature | top_p | top_k | min_p (a truncating sampler: lab.policies.truncation)"""
    values: list[float] = knob([0, 1, 2, 4, 8, 16, 32, 64], ge=0, le=1e6)
    """staleness settings"""
    top_p: float = knob(1.0, gt=0, le=1)
    """the sampler's top-p on top of the staleness kind (1: none)"""
    top_k: int | None = knob(None, ge=1, le=10_000_000)
    """the sampler's top-k on top of the staleness kind (none: off; at most the vocabulary size)"""
    min_p: float = knob(0.0, ge=0, lt=1)
    """the sampler's min-p on top of the staleness kind (0: none)"""
    mask_replay: bool = False
    """replay the sampler's recorded kept sets in every estimator (the trainer's log-probs renormalised over them;
    lab.estimators.contract); a no-op without truncation"""
    estimators: list[str] = knob(list(DEFAULT_ESTIMATORS))
    """estimator names (see `lab estimators`; verl:NAME for a verl preset), or all: every policy-gradient estimator
    this study can run"""
    hyper: dict = knob({}, parse="estimator_pairs")
    """hyper-parameter overrides, e.g. ppo_clip.clip_ratio_c=3.0"""
    advantage: Literal[ADVANTAGES] = "rloo"
    """reward | rloo | grpo | drgrpo"""
    group_size: int = knob(8, ge=1, le=4096)
    """G responses per prompt"""
    batch_size: int = knob(64, ge=1, le=1_000_000)
    """B responses per batch (a multiple of G)"""
    replicates: int = knob(500, ge=2, le=1_000_000)
    """M independent batches per setting"""
    loss_agg_mode: Literal[(*AGG_MODES, "native")] = knob("seq-mean-token-sum", flag="--agg")
    """loss aggregation mode, or native (each estimator's own)"""
    reference: Literal[("auto", *REFERENCES)] = "auto"
    """auto (exact where the enumeration fits, else dp where it applies) | exact (enumeration) | dp (dynamic
    programming: the markov policy on a target, parity or dense bandit, any length) | mc (Monte Carlo reference for
    large spaces)"""
    mc_samples: int = knob(65536, ge=2, le=100_000_000)
    """samples behind each Monte Carlo expectation"""
    enum_limit: int = knob(toy_envs.DEFAULT_ENUM_LIMIT, ge=1, le=2**31)
    """largest number of (prompt, response) pairs to enumerate"""
    init_scale: float = knob(1.0, ge=0, le=100)
    """initial logits ~ N(0, init_scale^2)"""
    trajectory_steps: int = knob(64, ge=0, le=1_000_000)
    """Adam steps from the initial policy to pi (the lag knob's trajectory)"""
    lr: float = knob(0.05, gt=0, le=1e3)
    """Adam learning rate of that trajectory"""
    exact_directions: bool = False
    """also the exact expected gradient of each estimator with advantage R (by enumeration; with the dp reference,
    token IS and REINFORCE by dynamic programming): relative bias, cosine and size against grad J (not with mc)"""
    n_boot: int = knob(1000, ge=10, le=1_000_000)
    """bootstrap resamples"""
    ci: float = knob(0.95, gt=0, lt=1)
    """interval coverage"""
    seed: int = knob(0, ge=0, le=SEED_MAX)
    """seed of every random stream of the study"""
    device: str = "cpu"
    """where the policy's forward and backward passes run: cpu | cuda (network policies)"""
    chunk: int = knob(0, ge=0, le=1_000_000)
    """replicates per vmap call of a network policy's gradients (0: from the memory budget, budget / (8 D))"""
    memory_budget: float = knob(2.0, gt=0, le=4096)
    """GiB of gradient estimates held at once (the default chunk and the streamed Gram's block follow from it, so
    memory stays bounded whatever the replicates and parameters)"""

    def make_env(self):
        return toy_envs.make(self.env, **self.env_overrides)

    def problem(self) -> Problem:
        env = self.make_env()
        policy = make_policy(self.policy, env, self.model, trainable=self.params, device=self.device)
        return Problem(env, policy, self.reference_for(env, policy), self.enum_limit, self.mc_samples)

    def reference_for(self, env, policy) -> str:
        """The reference this study runs: ``reference``, or for "auto" exact where the enumeration fits (pairs
        within ``enum_limit``, logits within ENUM_LOGITS_LIMIT), else dp where it applies (``lab.engine.dp.check``:
        a Markov policy, no truncating sampler), else exact, which then refuses in one line."""
        if self.reference != "auto":
            return self.reference
        fits = (env.num_pairs <= self.enum_limit
                and env.num_pairs * env.length * env.vocab_size <= ENUM_LOGITS_LIMIT)
        if not fits and not self._truncating(policy.vocab_size) and dp.applies(env, policy):
            return "dp"
        return "exact"

    def _truncating(self, vocab_size: int) -> bool:
        """Whether the sampler truncates (a truncation staleness kind, or top-p / top-k / min-p on top)."""
        return (self.staleness in ("top_p", "top_k", "min_p") or self.top_p != 1 or self.min_p != 0
                or (self.top_k is not None and self.top_k < vocab_size))

    def sampling(self) -> Sampling:
        return Sampling(self.replicates, self.batch_size, self.group_size, self.advantage, self.ci, self.n_boot,
                        chunk=self.chunk or None, memory_budget=int(self.memory_budget * 2**30))

    def initial(self, problem: Problem, generator: torch.Generator, progress: bool | None = None) -> torch.Tensor:
        """pi's starting point: the policy's initial parameters, or the supervised warm start of a transformer of
        size ``model`` (cached; ``lab.pretrain``). A prefix-tree policy with a warm start starts at exactly that
        transformer's sequence distribution, so the two kinds of policy can be compared from the same pi_0."""
        if self.warm_start <= 0:
            return init_params(problem.policy, self.init_scale, generator)
        from lab.pretrain import warm_start

        theta = warm_start(problem.env, self.model, self.warm_start, seed=self.seed, device=self.device,
                           progress=progress).double()
        if self.policy == "transformer":
            return theta
        net = make_policy("transformer", problem.env, self.model)
        support = problem.support(theta.to(self.device), policy=net)  # every pair with its probability
        log_p = torch.log(support.weights * problem.env.n_prompts).reshape(problem.env.n_prompts, -1)
        return problem.policy.params_for(problem.env, log_p)

    def names(self) -> list[str]:
        """The estimator names, ``all`` expanded to every applicable registered estimator."""
        if self.estimators == ["all"]:
            return [n for n in estimators.names() if applicable(n)]
        return list(self.estimators)

    def resolved(self) -> list[Estimator]:
        """The estimators, resolved once (registry entry, hyper-parameters, aggregation)."""
        return [Estimator.resolve(n, self.hyper.get(n, {}), self.loss_agg_mode, self.mask_replay)
                for n in self.names()]

    def validate(self) -> None:
        check_types(self)
        problem = self.problem()
        if not self.values:
            raise LabError("give at least one staleness value")
        check_unique("values", [float(v) for v in self.values])
        V = problem.policy.vocab_size
        check_truncation(self.top_p, self.top_k, self.min_p, V)
        for v in self.values:
            check_value(self.staleness, float(v), self.trajectory_steps, V)
        on_top = {"top_p": self.top_p != 1, "top_k": self.top_k is not None, "min_p": self.min_p != 0}
        if on_top.get(self.staleness):
            raise LabError(f"--staleness {self.staleness} sweeps {self.staleness} itself; leave "
                           f"--{self.staleness.replace('_', '-')} at its default")
        self._validate_estimators()
        adv_mod.check(self.advantage, self.group_size)
        if self.batch_size % self.group_size:
            raise LabError(f"batch size {self.batch_size} must be a multiple of the group size {self.group_size}")
        problem.check()
        if problem.reference == "dp" and self._truncating(V):
            raise LabError("the dynamic-programming reference does not cover a truncating sampler (top-p, top-k, "
                           "min-p); use --reference exact or mc")
        if self.warm_start:
            check_cache_dir()  # before the warm start is trained
        if self.warm_start and self.policy not in ("transformer", "prefix"):
            raise LabError("warm_start applies to the transformer policy (or a prefix-tree copy of its distribution)")
        if self.warm_start and problem.reference != "exact" and self.policy == "prefix":
            raise LabError("a prefix-tree policy copies the warm start's distribution by enumeration: use --reference "
                           "exact")
        check_device(self.device)
        self._validate_memory(problem)

    def _validate_memory(self, problem: Problem) -> None:
        """Refuse, before any work, a study whose batches, bootstrap, gradient estimates or Gram matrix would not fit
        (``lab.engine.metrics.streamed_memory`` counts them): the tabular backend holds all M x D estimates
        (float32, 4 M D bytes) at once; a network's are streamed, one chunk of c replicates at a time (8 c D bytes
        as float64); both build the M x M Gram (8 M^2). Each must fit the memory budget."""
        env, policy = problem.env, problem.policy
        if problem.reference == "exact":  # every pass over the enumeration computes pairs x T x V logits (chunked)
            cells = env.num_pairs * env.length * env.vocab_size
            if cells > ENUM_LOGITS_LIMIT:
                raise LabError(f"the exact reference computes {env.num_pairs:,} pairs x {env.length} positions x "
                               f"{env.vocab_size:,} tokens = {cells:,} logits per pass over the enumeration (at most "
                               f"{ENUM_LOGITS_LIMIT:,}); use --reference mc, a smaller vocabulary or a shorter length")
        batch = self.replicates * self.batch_size * env.length * (8 + 3 * 4)  # tokens, mask, log-probs, advantages
        if policy.gradient_backend == "rows":
            batch += self.replicates * self.batch_size * env.length * env.vocab_size * 4 * 2  # gathered logits, grads
        if problem.reference == "dp" and dp.dp_memory(env) > BATCH_MEMORY_BUDGET:
            raise LabError(f"the dynamic program at T = {env.length} needs {dp.dp_memory(env) / 2**30:.1f} GiB "
                           f"(budget {BATCH_MEMORY_BUDGET / 2**30:.0f} GiB); use a shorter length or fewer prompts")
        if problem.reference == "mc":  # the reference sample, drawn with every position's logits at once
            ref = self.mc_samples * env.length * (env.vocab_size + 4) * 8
            if ref > BATCH_MEMORY_BUDGET:
                raise LabError(f"a Monte Carlo reference of {self.mc_samples:,} samples needs about "
                               f"{ref / 2**30:.1f} GiB (budget {BATCH_MEMORY_BUDGET / 2**30:.0f} GiB); use fewer "
                               f"--mc-samples")
        if batch > BATCH_MEMORY_BUDGET:
            raise LabError(f"{self.replicates} replicates x {self.batch_size} responses need about "
                           f"{batch / 2**30:.1f} GiB (budget {BATCH_MEMORY_BUDGET / 2**30:.0f} GiB); use fewer "
                           f"replicates or a smaller batch")
        if self.n_boot * self.replicates * 8 * 2 > BATCH_MEMORY_BUDGET:
            raise LabError(f"n_boot {self.n_boot} x {self.replicates} replicates needs "
                           f"{self.n_boot * self.replicates * 16 / 2**30:.1f} GiB of bootstrap counts; use fewer "
                           f"resamples (1000 is plenty for 95% intervals)")
        M, D, budget = self.replicates, int(np.prod(policy.shape)), self.sampling().memory_budget
        gib = f"{budget / 2**30:.3g} GiB"
        rows = policy.gradient_backend == "rows"
        if rows and M * D * 4 > budget:
            raise LabError(f"{M} replicates x {D:,} parameters need {M * D * 4 / 2**30:.1f} GiB of gradient "
                           f"estimates (budget {gib}); use fewer replicates or the markov policy")
        chunk = M if rows else self.sampling().chunk_for(D)
        need = streamed_memory(M, D, chunk, budget)
        total = f"{sum(need.values()) / 2**30:.3g} GiB in all"
        if not rows and need["chunk"] > budget:
            hint = (f"use --chunk {budget_chunk(D, budget)} or less (0: from the budget)" if 8 * D <= budget
                    else "raise --memory-budget")
            raise LabError(f"a chunk of {min(chunk, M)} replicates x {D:,} parameters needs "
                           f"{need['chunk'] / 2**30:.3g} GiB of gradient estimates (budget {gib}, {total}); {hint}")
        if need["gram"] > budget:
            raise LabError(f"{M} replicates need a {M} x {M} Gram matrix of {need['gram'] / 2**30:.3g} GiB (budget "
                           f"{gib}, {total}); use fewer replicates or raise --memory-budget")

    def _validate_estimators(self) -> None:
        if not self.estimators:
            raise LabError("give at least one estimator")
        check_unique("estimators", self.estimators)
        for name in self.names():
            info = estimators.info(name)
            if info.family == "distillation":
                raise LabError(f"estimator {name!r} distils a teacher and has its own target; use the distillation "
                               f"study (`lab report distillation`)")
            Estimator.resolve(name, self.hyper.get(name, {}), self.loss_agg_mode).check_inputs(PROVIDED_INPUTS)
            if not applicable(name):
                raise LabError(f"estimator {name!r} is a KL penalty: its gradient targets a divergence, not grad J; "
                               f"leave it out of variance studies")
            if "group_size" in info.inputs and self.group_size < 2:
                raise LabError(f"estimator {name!r} needs groups of at least 2 responses per prompt; "
                               f"raise --group-size")
        unknown = set(self.hyper) - set(self.names())
        if unknown:
            raise LabError(f"hyper-parameters given for estimator(s) not in the study: {', '.join(sorted(unknown))}")


SMOKE = {"replicates": 40, "values": [0, 4], "n_boot": 200}  # seconds: what the tests build


@dataclass
class Setting:
    """One staleness value: mu's exact (or Monte Carlo) divergence from pi, the weight diagnostics [value, lo, hi],
    and per estimator its metrics (``estimators[name][metric]``) with their intervals (``intervals``: [lo, hi])."""

    staleness: float
    kl_seq: float
    kl_token: float
    chi2_seq: float
    chi2_token: float
    logw_var: float
    mean_len: float
    ess_frac: list[float]
    khat: list[float]
    estimators: dict[str, dict[str, float]]
    intervals: dict[str, dict[str, list[float]]]
    divergence_intervals: dict[str, list[float]]

    def point(self, name: str, metric: str) -> tuple[float, float, float]:
        """(value, lo, hi) of an estimator's metric."""
        return (self.estimators[name][metric], *self.intervals[name][metric])


@dataclass
class Summary:
    """What a variance study found (summary.json)."""

    study: str
    env: str
    policy: str
    parameters: int  # D, the policy's parameter count
    response_length: int
    staleness: str  # the staleness kind
    reference: str  # exact | dp | mc (auto resolved)
    reference_pairs: int  # pairs enumerated or sampled (0: dynamic programming, which needs none)
    target_grad_norm: float
    target_grad_se: float  # the Monte Carlo reference's standard error (nan: exact)
    loss_agg_modes: dict[str, str]
    objective: float  # J(pi)
    best_by_mse: dict[str, str | None]  # staleness value -> the lowest-MSE estimator, None if none beats 0
    per_value: list[Setting]
    config: dict  # the sampling settings behind every setting


def applicable(name: str) -> bool:
    """Whether an estimator is a policy-gradient estimator this study can run (inputs provided, not a penalty)."""
    info = estimators.info(name)
    return info.family != "kl-penalty" and set(info.inputs) <= set(PROVIDED_INPUTS)


def best_by_mse(per_estimator: dict) -> str | None:
    """The lowest-MSE estimator, or None when none beats a zero update (relative MSE >= 1, or undefined: a Monte
    Carlo reference that does not resolve grad J)."""
    rel = {n: v["rel_mse"] if math.isfinite(v["rel_mse"]) else math.inf for n, v in per_estimator.items()}
    best = min(rel, key=rel.get)
    return best if rel[best] < 1 else None


def run(cfg: Config, progress: bool | None = None) -> StudyResult:
    """(tidy results, summary) of one variance study; deterministic given ``cfg.seed``."""
    cfg.validate()
    problem, ests = cfg.problem(), cfg.resolved()
    env = problem.env
    torch_gen = generator(cfg.seed, 0)
    theta0 = cfg.initial(problem, torch_gen, progress).to(cfg.device)
    traj = optimisation_trajectory(problem, theta0, cfg.trajectory_steps, cfg.lr, torch_gen)
    theta_pi = traj.current
    by_dp = problem.reference == "dp"
    if by_dp:  # exact, no support: grad J and J by dynamic programming
        support_pi, objective = None, dp.objective(env, problem.policy, theta_pi)
        grad_j, grad_j_var = dp.policy_gradient(env, problem.policy, theta_pi), 0.0
    else:
        support_pi = problem.support(theta_pi, generator(cfg.seed, 1))
        grad_j, grad_j_var = reference_gradient(env, problem.policy, theta_pi, support_pi)
        objective = float((support_pi.weights * env.expected_reward(support_pi.prompts, support_pi.tokens,
                                                                    support_pi.mask)).sum())
    grad_j = grad_j.reshape(-1)
    if not (torch.isfinite(grad_j).all() and grad_j.norm() > 0):
        what = "zero" if torch.isfinite(grad_j).all() else "not finite"
        if problem.reference == "mc" and torch.isfinite(grad_j).all():  # every sample scored the same reward
            raise LabError(f"the Monte Carlo estimate of grad J from {cfg.mc_samples:,} samples is zero (every sample "
                           f"scored the same reward), so errors relative to it are undefined; raise --mc-samples")
        raise LabError(f"the target gradient of pi is {what} (pi is deterministic or degenerate after the "
                       f"trajectory), so errors relative to it are undefined; lower --init-scale or --lr")
    sampling = cfg.sampling()
    grad_j_se = math.sqrt(grad_j_var) if grad_j_var == grad_j_var else float("nan")
    key = dict(env=env.name, policy=cfg.policy, staleness_kind=cfg.staleness, seed=cfg.seed,
               reference=problem.reference)
    rows, per_value = [], []
    bars = bar(len(cfg.values) * len(ests), "variance", progress)
    for i, value in enumerate(cfg.values):
        gen = generator(cfg.seed, 2, i)
        mu = truncate(behaviour(problem, cfg.staleness, float(value), traj, gen), cfg.top_p, cfg.top_k, cfg.min_p)
        if by_dp:  # exact: the intervals are points
            support_mu = None
            div_ci = {m: (v,) * 3 for m, v in problem.divergence((problem.policy, theta_pi), mu).items()}
        else:
            support_mu = problem.support(mu[1], gen, policy=mu[0])
            div_ci = divergence_intervals((problem.policy, theta_pi), mu, support_mu, cfg.ci)
        div = {m: v for m, (v, _, _) in div_ci.items()}
        setting = {**key, "staleness": float(value)}
        rows += [{**setting, "estimator": "-", "metric": m, "value": float(v), "lo": float(lo), "hi": float(hi)}
                 for m, (v, lo, hi) in div_ci.items()]
        if problem.reference == "mc":
            rows.append({**setting, "estimator": "-", "metric": "target_grad_se", "value": grad_j_se,
                         "lo": grad_j_se, "hi": grad_j_se})
        measured, points, intervals = measure(problem, theta_pi, mu, support_mu, ests, grad_j, sampling, gen,
                                              np.random.default_rng(derive_seed(cfg.seed, 3, i)),
                                              on_estimator=lambda: bars.update(1), grad_j_var=grad_j_var)
        rows += [{**setting, **r} for r in measured]
        if cfg.exact_directions and problem.reference != "mc":
            for est in ests:
                if by_dp:
                    g = dp.expected_estimate(env, problem.policy, theta_pi, mu, est, "reward", cfg.group_size)
                    found = None if g is None else direction(g, est, grad_j, env.length)
                else:
                    found = exact_direction(env, problem.policy, theta_pi, mu, support_mu, est, grad_j)
                for m, v in (found or {}).items():
                    rows.append({**setting, "estimator": est.name, "metric": m, "value": v, "lo": v, "hi": v})
                    points[est.name][m] = v
        diag = {r["metric"]: [r["value"], r["lo"], r["hi"]] for r in measured if r["estimator"] == "-"}
        per_value.append({"staleness": float(value), **div, "ess_frac": diag["ess_frac"], "khat": diag["khat"],
                          "estimators": points, "intervals": intervals,
                          "divergence_intervals": {m: [lo, hi] for m, (_, lo, hi) in div_ci.items()}})
    bars.close()
    summary = Summary(
        study="variance", env=env.name, policy=cfg.policy, parameters=int(np.prod(problem.policy.shape)),
        response_length=env.length, staleness=cfg.staleness, reference=problem.reference,
        reference_pairs=0 if by_dp else int(support_pi.prompts.shape[0]), target_grad_norm=float(grad_j.norm()),
        target_grad_se=grad_j_se, loss_agg_modes={e.name: e.loss_agg_mode for e in ests},
        objective=objective,
        best_by_mse={str(e["staleness"]): best_by_mse(e["estimators"]) for e in per_value},
        per_value=[Setting(**e) for e in per_value],
        config={k: getattr(cfg, k) for k in ("batch_size", "group_size", "advantage", "loss_agg_mode", "replicates",
                                             "top_p", "top_k", "min_p", "mask_replay")})
    return StudyResult(pd.DataFrame(rows), asdict(summary))
