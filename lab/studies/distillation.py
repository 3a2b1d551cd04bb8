"""The on-policy distillation variance study: bias against two exact targets, variance, and what a baseline buys.

Setting: a student pi_S and a frozen teacher pi_T (same policy kind) over an enumerable toy env (vocabulary V,
length T). The distillation objective is the reverse KL of the student from the teacher on the student's own rollouts
(``lab.estimators.distillation``: vanilla OPD, Thinking Machines 2025; vOPD, Oh et al. 2026, arXiv 2605.07865, and
its release's top-k forms; the full-vocabulary KL of GKD, Agarwal et al. 2024). Two exact targets, by enumerating every
response (float64):

    per-token   g_tok = grad_theta sum_y sg[pi_S(y)] sum_t m_t KL_t(theta)        (visitation held fixed)
    sequence    g_seq = grad_theta KL(pi_S(y) || pi_T(y)) = grad_theta E_{pi_S}[sum_t KL_t]   (adds the state term)

with KL_t = KL(pi_S(.|s_t) || pi_T(.|s_t)), averaged over prompts. Estimators return ascent directions -grad loss,
whose on-policy mean is -c g_tok (or -c g_seq), c = 1 for seq-mean-token-sum and 1/T for the per-token normalised
modes (fixed length); estimates are compared with -c g.

M replicate batches of B responses come from the behaviour policy (the student itself, or with ``behaviour_lag`` a
snapshot that many steps behind on the student's distillation trajectory); every estimator variant runs on the same
batches (``lab.engine.gradients.replicate_gradients``). Against both targets: bias / variance / MSE with bootstrap
intervals (``lab.engine.metrics.gram_metrics``), the exact bias by enumeration (the estimator's expectation over
every response, weighted by the behaviour policy), and the variance ratios Var(opd) / Var(variant) and
Var(variant) / Var(kl_full) with percentile intervals from resampling replicate indices jointly (one bootstrap counts
matrix shared by every variant: ``lab.engine.metrics.variance_resamples``).

Teacher (``teacher``): ``trained`` = the initial policy after ``teacher_steps`` Adam steps on the env's exact reward
gradient; ``perturbed`` = the initial logits plus ``teacher_noise`` * N(0, 1). Either is then tempered (logits /
``teacher_temperature``). The student is the initial policy after ``student_steps`` Adam steps of exact
sequence-level distillation toward the teacher (0: the initial policy).

Each variant's gradients [M, D] are reduced to exact low-dimensional coordinates before any statistics: every
statistic is an inner product, so the M estimates and the two targets are replaced by their coordinates in an
orthonormal basis of their span (an eigendecomposition of their (M+2) x (M+2) Gram matrix); the numbers are the same
up to float64 rounding.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from torch.func import vmap

import toy_envs
from lab import stats
from lab.engine.batches import Batch, draw_batches
from lab.engine.estimator import Estimator
from lab.engine.exact import Problem, Support
from lab.engine.gradients import replicate_gradients
from lab.engine.metrics import gram_metrics, variance_resamples
from lab.engine.staleness import optimisation_trajectory
from lab.engine.variance import GRADIENT_MEMORY_BUDGET
from lab.errors import LabError
from lab.estimators.aggregation import check_mode, target_scale
from lab.estimators.distillation import reverse_kl, topk_reverse_kl
from lab.policies import init_params, log_probs_of, make_policy, sequence_log_probs, token_log_probs
from lab.progress import bar
from lab.seeding import derive_seed, generator
from lab.studies import StudyResult

ESTIMATORS = ("opd", "opd_rtg", "vopd", "vopd_topk", "kl_full", "kl_topk")  # opd_rtg: opd with return_to_go=True
TOPK = ("vopd_topk", "kl_topk")
SAMPLED_TOKEN = ("opd", "opd_rtg", "vopd", "vopd_topk")  # the ones that accept importance_weights
TEACHERS = ("trained", "perturbed")
TARGETS = ("per_token", "sequence")
UNBIASED_TOL = 1e-6  # exact relative bias below this counts as unbiased (float64 rounding is ~1e-14)


@dataclass
class Config:
    """One distillation variance study. Every field has a default: ``Config()`` runs in seconds."""

    env: str = "small_dense"
    """toy env preset; its reward only trains the teacher"""
    vocab_size: int = 32
    """V (overrides the preset)"""
    length: int = 3
    """T (overrides the preset)"""
    n_prompts: int = 1
    """prompts (overrides the preset)"""
    policy: str = "prefix"
    """policy of student and teacher: prefix | markov"""
    teacher: str = "trained"
    """trained (Adam on the env's reward) | perturbed (noisy copy of the initial logits)"""
    teacher_steps: int = 10
    """Adam steps of the trained teacher"""
    teacher_lr: float = 0.3
    """the trained teacher's learning rate"""
    teacher_noise: float = 1.5
    """std of the perturbed teacher's logit noise"""
    teacher_temperature: float = 1.0
    """teacher logits are divided by this"""
    init_scale: float = 1.0
    """the student's initial logits ~ N(0, init_scale^2)"""
    student_steps: int = 0
    """Adam steps of exact sequence-level distillation before the study (0: the initial policy)"""
    student_lr: float = 0.05
    """their learning rate"""
    behaviour_lag: int = 0
    """sample from the student snapshot this many steps back (0: on-policy)"""
    importance_weights: bool = False
    """sampled-token estimators multiply by sg[pi_S / mu] per token"""
    estimators: list = field(default_factory=lambda: list(ESTIMATORS))
    """estimators: opd, opd_rtg (opd with reward-to-go), vopd, vopd_topk, kl_full, kl_topk"""
    k_values: list = field(default_factory=lambda: [2, 4, 8, 16])
    """top-k sizes for vopd_topk and kl_topk"""
    loss_agg_mode: str = "token-mean"
    """loss aggregation mode of every estimator"""
    batch_size: int = 32
    """B responses per batch"""
    replicates: int = 300
    """M independent batches"""
    enum_limit: int = toy_envs.DEFAULT_ENUM_LIMIT
    """largest number of (prompt, response) pairs to enumerate"""
    n_boot: int = 1000
    """bootstrap resamples"""
    ci: float = 0.95
    """interval coverage"""
    seed: int = 0
    """seed of every random stream of the study"""

    def make_env(self):
        return toy_envs.make(self.env, vocab_size=self.vocab_size, length=self.length, n_prompts=self.n_prompts)

    def problem(self) -> Problem:
        env = self.make_env()
        return Problem(env, make_policy(self.policy, env), "exact", self.enum_limit)

    def validate(self) -> None:
        problem = self.problem()
        problem.check()
        self._validate_setup()
        self._validate_estimators()
        check_mode(self.loss_agg_mode)
        if problem.env.eos and self.loss_agg_mode != "seq-mean-token-sum":
            raise LabError(f"with variable-length responses ({self.env} has an end token) only seq-mean-token-sum "
                           f"estimates a fixed multiple of the targets; set loss_agg_mode to seq-mean-token-sum")
        if self.batch_size < 1:
            raise LabError(f"batch size must be at least 1, got {self.batch_size}")
        if self.replicates < 2:
            raise LabError(f"replicates must be at least 2 to measure a variance, got {self.replicates}")
        if not 0 < self.ci < 1 or self.n_boot < 10:
            raise LabError("ci must lie in (0, 1) and n_boot be at least 10")
        need = self.replicates * int(np.prod(problem.policy.shape)) * 4  # the [M, D] float32 estimates of a variant
        if need > GRADIENT_MEMORY_BUDGET:
            raise LabError(f"{self.replicates} replicates x {need // (4 * self.replicates):,} parameters need "
                           f"{need / 2**30:.1f} GiB of gradient estimates (budget "
                           f"{GRADIENT_MEMORY_BUDGET / 2**30:.0f} GiB); use fewer replicates or the markov policy")

    def _validate_setup(self) -> None:
        if self.teacher not in TEACHERS:
            raise LabError(f"unknown teacher construction {self.teacher!r}; choose one of {', '.join(TEACHERS)}")
        for name in ("teacher_steps", "student_steps", "behaviour_lag"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise LabError(f"{name} must be a non-negative whole number, got {v!r}")
        if self.behaviour_lag > self.student_steps:
            raise LabError(f"behaviour lag {self.behaviour_lag} exceeds the student's trajectory "
                           f"({self.student_steps} steps); raise student_steps")
        for name in ("teacher_lr", "student_lr", "teacher_temperature"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise LabError(f"{name} must be a positive number, got {v}")
        for name in ("teacher_noise", "init_scale"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise LabError(f"{name} must be a finite non-negative number, got {v}")

    def _validate_estimators(self) -> None:
        if not self.estimators:
            raise LabError("give at least one estimator")
        unknown = [e for e in self.estimators if e not in ESTIMATORS]
        if unknown:
            raise LabError(f"unknown distillation estimator(s) {', '.join(unknown)}; "
                           f"choose from {', '.join(ESTIMATORS)}")
        if any(e in TOPK for e in self.estimators):
            if not self.k_values:
                raise LabError("give at least one top-k size in k_values for the top-k estimators")
            for k in self.k_values:
                if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
                    raise LabError(f"top-k sizes must be positive whole numbers, got {k!r}")

    def topk_sizes(self) -> list[int]:
        """The distinct top-k sizes the study measures (none without a top-k estimator)."""
        return sorted(set(self.k_values)) if any(e in TOPK for e in self.estimators) else []


# ---- estimator variants ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    """One estimator as the study runs it: a unique label (e.g. vopd_top4), the resolved estimator, its top-k size."""

    label: str
    est: Estimator
    k: int | None = None

    @property
    def name(self) -> str:
        return self.est.name


def variants(cfg: Config) -> list[Variant]:
    """The estimator variants of a study, in a fixed order: top-k estimators once per k."""
    iw = {"importance_weights": True} if cfg.importance_weights else {}

    def make(label, name, hyper, k=None):
        return Variant(label, Estimator.resolve(name, hyper, cfg.loss_agg_mode), k)

    out = []
    for e in cfg.estimators:
        if e == "opd_rtg":
            out.append(make("opd_rtg", "opd", {"return_to_go": True, **iw}))
        elif e in TOPK:
            short = "vopd_top" if e == "vopd_topk" else "kl_top"
            extra = iw if e in SAMPLED_TOKEN else {}
            out += [make(f"{short}{k}", e, {"k": int(k), **extra}, int(k)) for k in sorted(set(cfg.k_values))]
        else:
            out.append(make(e, e, dict(iw) if e in SAMPLED_TOKEN else {}))
    return out


# ---- exact quantities by enumeration --------------------------------------------------------------------------------

def kl_per_token(policy, theta_s, theta_t, prompts, tokens) -> torch.Tensor:
    """KL_t = KL(pi_S(.|s_t) || pi_T(.|s_t)) at every position of every response: [..., T] (mask it)."""
    return reverse_kl(policy.logits(theta_s, prompts, tokens), policy.logits(theta_t, prompts, tokens))


def sequence_kl(policy, theta_s, theta_t, support: Support) -> float:
    """KL(pi_S(y|x) || pi_T(y|x)) averaged over prompts, with ``support`` the student's exact distribution."""
    with torch.no_grad():
        ls = sequence_log_probs(policy, theta_s.double(), support.prompts, support.tokens, support.mask)
        lt = sequence_log_probs(policy, theta_t.double(), support.prompts, support.tokens, support.mask)
    return float((support.weights * (ls - lt)).sum())


def per_token_target(policy, theta_s, theta_t, support: Support) -> torch.Tensor:
    """(a) grad_theta sum_y sg[w(y)] sum_t m_t KL_t(theta): the visitation weights w held fixed. Float64, flat."""
    theta = theta_s.detach().double().requires_grad_(True)
    kl = kl_per_token(policy, theta, theta_t.detach().double(), support.prompts, support.tokens)
    objective = (support.weights.detach() * (kl * support.mask).sum(-1)).sum()
    (g,) = torch.autograd.grad(objective, theta)
    return g.reshape(-1)


def sequence_target(policy, theta_s, theta_t, support: Support) -> torch.Tensor:
    """(b) grad_theta KL(pi_S(y) || pi_T(y)) = grad sum_y pi_S(y) (log pi_S(y) - log pi_T(y)) / P, differentiating
    the probabilities too (the state-distribution term included). ``support`` only supplies the responses."""
    theta = theta_s.detach().double().requires_grad_(True)
    ls = sequence_log_probs(policy, theta, support.prompts, support.tokens, support.mask)
    with torch.no_grad():
        lt = sequence_log_probs(policy, theta_t.double(), support.prompts, support.tokens, support.mask)
    n_prompts = int(support.prompts.max()) + 1 if support.prompts.numel() else 1
    objective = (torch.exp(ls) * (ls - lt)).sum() / n_prompts
    (g,) = torch.autograd.grad(objective, theta)
    return g.reshape(-1)


def expected_estimate(policy, theta_s, theta_t, support_mu: Support, est: Estimator, theta_mu=None) -> torch.Tensor:
    """E_mu[-grad loss] of the resolved estimator ``est`` for one response per batch, exactly (float64, flat).

    Every response of ``support_mu`` (mu's exact distribution) is its own batch of one; the per-response losses
    (vmap over responses) are weighted by mu(y) and differentiated once. For fixed-length responses every
    aggregation mode averages per-response terms, so this is also the mean of the B-response batch estimate.
    ``theta_mu`` gives the behaviour log-probs passed as ``old_log_prob`` (default: the student's own).
    """
    s = support_mu
    theta = theta_s.detach().double().requires_grad_(True)
    prompts, tokens, mask = s.prompts[:, None], s.tokens[:, None], s.mask[:, None]
    logits = policy.logits(theta, prompts, tokens)
    log_prob = log_probs_of(logits, tokens) * mask
    with torch.no_grad():
        t_logits = policy.logits(theta_t.detach().double(), prompts, tokens)
        old = (log_prob.detach() if theta_mu is None
               else token_log_probs(policy, theta_mu.double(), prompts, tokens) * mask)
    extras = {"teacher_log_prob": log_probs_of(t_logits, tokens) * mask, "logits": logits, "teacher_logits": t_logits}
    wanted = set(est.info.inputs) | set(est.info.optional_inputs)
    named = {k: v for k, v in extras.items() if k in wanted}

    def one(lp, old_lp, m, kw):
        return est.loss_on_log_probs(lp, old_lp, torch.zeros_like(lp), m, **kw)[0]

    losses = vmap(one)(log_prob, old, mask, named)
    (g,) = torch.autograd.grad((s.weights * losses).sum(), theta)
    return -g.reshape(-1)


def topk_mass(policy, theta_s, support: Support, k: int) -> float:
    """E over the student's visited states (per real token) of the student's probability mass in its top-k."""
    with torch.no_grad():
        logits = policy.logits(theta_s.double(), support.prompts, support.tokens)
        _, mass = topk_reverse_kl(logits, logits, k)
    per_seq = (mass * support.mask).sum(-1)
    return float((support.weights * per_seq).sum() / (support.weights * support.mask.sum(-1)).sum())


def isometric_coordinates(grads: torch.Tensor, *targets: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Coordinates [M, r] and [r] with the same inner products as ``grads`` [M, D] and each target [D] (float64)."""
    X = torch.cat([grads.double(), torch.stack([t.double() for t in targets])])
    gram = X @ X.T
    evals, evecs = torch.linalg.eigh(gram)
    keep = evals > evals.max().clamp(min=1e-300) * 1e-13
    Y = evecs[:, keep] * evals[keep].sqrt()
    M = grads.shape[0]
    return Y[:M], [Y[M + i] for i in range(len(targets))]


# ---- student, teacher, behaviour ------------------------------------------------------------------------------------

@dataclass
class Setup:
    problem: Problem
    theta_student: torch.Tensor  # float64
    theta_teacher: torch.Tensor  # float64, tempered
    theta_behaviour: torch.Tensor  # float64
    student_trajectory: list  # sequence KL before each of the student's distillation steps

    @property
    def env(self):
        return self.problem.env

    @property
    def policy(self):
        return self.problem.policy


def teacher_params(cfg: Config, problem: Problem, theta0: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The teacher's logits before tempering: Adam on the exact reward gradient, or a noisy copy of theta0."""
    if cfg.teacher == "trained":
        return optimisation_trajectory(problem, theta0, cfg.teacher_steps, cfg.teacher_lr, gen).current.clone()
    return theta0 + cfg.teacher_noise * torch.randn(theta0.shape, generator=gen, dtype=torch.float64)


def distil_student(problem: Problem, theta0, theta_t, steps: int, lr: float) -> tuple[list, list]:
    """Adam on the exact sequence-level target from theta0: (snapshots theta_0..theta_steps, KL before each step)."""
    theta = theta0.clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=lr)
    snaps, kls = [theta0.clone()], []
    for _ in range(steps):
        support = problem.support(theta.detach())
        kls.append(sequence_kl(problem.policy, theta.detach(), theta_t, support))
        theta.grad = sequence_target(problem.policy, theta.detach(), theta_t, support).reshape(theta.shape)
        opt.step()
        snaps.append(theta.detach().clone())
    return snaps, kls


def make_setup(cfg: Config) -> Setup:
    """Student, teacher and behaviour parameters (float64), deterministic given ``cfg.seed``."""
    problem = cfg.problem()
    gen = generator(cfg.seed, 0)
    theta0 = init_params(problem.policy, cfg.init_scale, gen)
    # tabular policies (prefix | markov): the logits are rows of theta, so theta / t is the teacher at temperature t
    theta_t = teacher_params(cfg, problem, theta0, gen) / cfg.teacher_temperature
    snaps, kls = distil_student(problem, theta0, theta_t, cfg.student_steps, cfg.student_lr)
    return Setup(problem, snaps[-1], theta_t, snaps[-1 - cfg.behaviour_lag], kls)


# ---- the two targets ------------------------------------------------------------------------------------------------

@dataclass
class Targets:
    support_s: Support  # the student's exact distribution
    support_mu: Support  # the behaviour's
    ascent: dict  # target -> -c g (what the estimators' means estimate), float64 flat
    norms: dict  # target -> ||c g||
    kl_seq: float  # KL(pi_S(y) || pi_T(y)) per response
    mean_len: float  # E_{pi_S}|y|
    cos: float  # cos(g_tok, g_seq)
    rel_gap: float  # ||g_tok - g_seq|| / ||g_seq||


def exact_targets(cfg: Config, setup: Setup) -> Targets:
    """Both targets and the divergence of the student from the teacher, by enumeration."""
    policy, th_s, th_t = setup.policy, setup.theta_student, setup.theta_teacher
    support_s = setup.problem.support(th_s)
    support_mu = support_s if cfg.behaviour_lag == 0 else setup.problem.support(setup.theta_behaviour)
    g = {"per_token": per_token_target(policy, th_s, th_t, support_s),
         "sequence": sequence_target(policy, th_s, th_t, support_s)}
    c = target_scale(cfg.loss_agg_mode, setup.env.length)
    ascent = {k: -c * v for k, v in g.items()}
    norms = {k: float(v.norm()) for k, v in ascent.items()}
    cos = float(g["per_token"] @ g["sequence"] / (g["per_token"].norm() * g["sequence"].norm()))
    rel_gap = float((ascent["per_token"] - ascent["sequence"]).norm()) / norms["sequence"]
    kl_seq = sequence_kl(policy, th_s, th_t, support_s)
    mean_len = float((support_s.weights * support_s.mask.sum(-1)).sum())
    return Targets(support_s, support_mu, ascent, norms, kl_seq, mean_len, cos, rel_gap)


# ---- tidy rows ------------------------------------------------------------------------------------------------------

def _row(key: dict, metric: str, value, lo=None, hi=None, variant: Variant | None = None, target: str = "-",
         k=None) -> dict:
    k = k if variant is None else variant.k
    return {**key, "estimator": "-" if variant is None else variant.name,
            "variant": "-" if variant is None else variant.label,
            "k": float("nan") if k is None else float(k), "target": target, "metric": metric, "value": float(value),
            "lo": float(value if lo is None else lo), "hi": float(value if hi is None else hi)}


def setting_rows(cfg: Config, setup: Setup, targets: Targets, key: dict) -> list[dict]:
    """Rows of the setting itself (variant "-"): divergence, target norms, how the targets differ, top-k mass."""
    rows = [_row(key, "kl_seq", targets.kl_seq), _row(key, "kl_token", targets.kl_seq / targets.mean_len)]
    rows += [_row(key, "target_norm", targets.norms[t], target=t) for t in TARGETS]
    rows += [_row(key, "targets_cos", targets.cos), _row(key, "targets_rel_gap", targets.rel_gap)]
    rows += [_row(key, "student_topk_mass", topk_mass(setup.policy, setup.theta_student, targets.support_s, k), k=k)
             for k in cfg.topk_sizes()]
    return rows


# ---- replicate batches and one variant ------------------------------------------------------------------------------

@dataclass
class Replicates:
    batch: Batch  # [M, B, ...] from the behaviour policy
    extras: dict  # the teacher's log-probs of the sampled tokens and logits, [M, B, T(, V)]
    advantages: torch.Tensor  # zeros: the distillation losses build their own rewards
    counts: np.ndarray  # [n_boot, M] bootstrap counts shared by every variant


def draw_replicates(cfg: Config, setup: Setup) -> Replicates:
    """M batches of B responses from the behaviour policy, the teacher's view of them, and the bootstrap counts."""
    batch = draw_batches(setup.env, (setup.policy, setup.theta_behaviour), cfg.replicates, cfg.batch_size, 1,
                         generator(cfg.seed, 2))
    counts = stats.bootstrap_counts(cfg.replicates, cfg.n_boot, np.random.default_rng(derive_seed(cfg.seed, 3)))
    with torch.no_grad():
        t_logits = setup.policy.logits(setup.theta_teacher.float(), batch.prompts, batch.tokens)
        t_log_prob = log_probs_of(t_logits, batch.tokens) * batch.mask
    return Replicates(batch, {"teacher_log_prob": t_log_prob, "teacher_logits": t_logits},
                      torch.zeros_like(batch.mask), counts)


def measure_variant(cfg: Config, setup: Setup, targets: Targets, reps: Replicates, v: Variant, key: dict):
    """(rows, variance series [1 + n_boot]) of one variant: statistics against both targets, exact bias, variance,
    and the estimator's own metrics."""
    need = {k: reps.extras[k] for k in v.est.info.inputs if k in reps.extras}
    grads, metrics = replicate_gradients(setup.policy, setup.theta_student.float(), reps.batch, reps.advantages,
                                         v.est, need)
    coords, tc = isometric_coordinates(grads, targets.ascent["per_token"], targets.ascent["sequence"])
    del grads
    expected = expected_estimate(setup.policy, setup.theta_student, setup.theta_teacher, targets.support_mu, v.est,
                                 None if cfg.behaviour_lag == 0 else setup.theta_behaviour)
    rows = []
    for target, t_coords in zip(TARGETS, tc):
        res = gram_metrics(coords, t_coords, reps.counts, cfg.ci)
        exact_bias = float((expected - targets.ascent[target]).norm())
        res["exact_bias_norm"] = (exact_bias,) * 3
        res["exact_rel_bias"] = (exact_bias / targets.norms[target],) * 3
        rows += [_row(key, m, *r, variant=v, target=target) for m, r in res.items() if m != "variance"]
    series = variance_resamples(coords, reps.counts)
    lo, hi = stats.percentile_interval(series[1:], cfg.ci)
    norm2 = targets.norms["per_token"] ** 2
    rows += [_row(key, "variance", series[0], lo, hi, variant=v),
             _row(key, "rel_variance", series[0] / norm2, lo / norm2, hi / norm2, variant=v)]
    rows += [_row(key, m, *stats.mean_interval(x.double().numpy(), reps.counts, cfg.ci), variant=v)
             for m, x in metrics.items()]
    return rows, series


def variance_ratios(cfg: Config, vs: list[Variant], series: dict, key: dict) -> tuple[list[dict], dict]:
    """Var(opd) / Var(v) ("variance_reduction") and Var(v) / Var(kl_full) ("variance_vs_kl_full"), each a ratio of
    jointly resampled variances with its percentile interval. Returns (rows, {vopd label: reduction})."""
    rows, reduction = [], {}
    for ref, metric in (("opd", "variance_reduction"), ("kl_full", "variance_vs_kl_full")):
        if ref not in series:
            continue
        for v in (v for v in vs if v.label != ref):
            with np.errstate(divide="ignore", invalid="ignore"):  # a zero-variance estimator (top-1 KL)
                ratio = series[ref] / series[v.label] if ref == "opd" else series[v.label] / series[ref]
            val, (lo, hi) = float(ratio[0]), stats.percentile_interval(ratio[1:], cfg.ci)
            rows.append(_row(key, metric, val, lo, hi, variant=v))
            if ref == "opd" and v.name.startswith("vopd"):
                reduction[v.label] = {"value": val, "lo": lo, "hi": hi, "k": v.k}
    return rows, reduction


# ---- summary --------------------------------------------------------------------------------------------------------

def lookup(results: pd.DataFrame, variant: str, metric: str, target: str = "-") -> dict:
    """{value, lo, hi} of one row of the tidy table ({} when absent)."""
    r = results[(results["variant"] == variant) & (results["metric"] == metric) & (results["target"] == target)]
    if r.empty:
        return {}
    r = r.iloc[0]
    return {"value": float(r["value"]), "lo": float(r["lo"]), "hi": float(r["hi"])}


def labels(results: pd.DataFrame) -> list[str]:
    """The variant labels of a results table, in the order the study ran them."""
    return [lab for lab in pd.unique(results["variant"]) if lab != "-"]


def unbiased_targets(results: pd.DataFrame, variant: str) -> list[str]:
    """The targets for which the variant's exact expectation equals the target (relative bias < UNBIASED_TOL)."""
    return [t for t in TARGETS if (r := lookup(results, variant, "exact_rel_bias", t)) and r["value"] < UNBIASED_TOL]


def kept_share(reduction_k: float, reduction_full: float) -> float:
    """The share of the variance the full baseline removes that a top-k baseline removes: (1 - 1/r_k) / (1 - 1/r)."""
    return (1 - 1 / reduction_k) / (1 - 1 / reduction_full)


def _topk_mass(results: pd.DataFrame) -> dict:
    """{k: the student's exact probability mass in its top-k}, for the measured k."""
    rows = results[(results["metric"] == "student_topk_mass") & (results["variant"] == "-")]
    return {f"{k:g}": float(v) for k, v in zip(rows["k"], rows["value"])}


def _bias(results: pd.DataFrame, lab: str) -> dict:
    out = {t: {"exact_rel_bias": lookup(results, lab, "exact_rel_bias", t)["value"],
               "sampled_bias_norm": lookup(results, lab, "bias_norm", t),
               "rel_mse": lookup(results, lab, "rel_mse", t)} for t in TARGETS}
    out["unbiased_for"] = unbiased_targets(results, lab)
    return out


def _variant_entry(results: pd.DataFrame, v: Variant, reduction: dict) -> dict:
    """Per variant: registry name, k, variance ÷ ‖g_tok‖², Var(OPD) ÷ Var and, for top-k baselines, the share of
    the full baseline's variance reduction they keep."""
    entry = {"estimator": v.name, "k": v.k, "rel_variance": lookup(results, v.label, "rel_variance"),
             "variance_reduction": lookup(results, v.label, "variance_reduction") or None}
    full = reduction.get("vopd", {}).get("value")
    if v.label.startswith("vopd_top") and full and full > 1:
        entry["kept_share"] = kept_share(reduction[v.label]["value"], full)
    return entry


def summarise(cfg: Config, setup: Setup, targets: Targets, results: pd.DataFrame, reduction: dict,
              vs: list[Variant]) -> dict:
    """summary.json: every number the report's text and table print."""
    labs = [v.label for v in vs]
    vs_full = {lab: lookup(results, lab, "variance_vs_kl_full") for lab in labs if lab != "kl_full"}
    return {
        "study": "opd_variance",
        "env": setup.env.name, "vocab_size": setup.env.vocab_size, "length": setup.env.length,
        "kl_seq": targets.kl_seq, "kl_token": targets.kl_seq / targets.mean_len,
        "target_norms": targets.norms, "targets_cos": targets.cos, "targets_rel_gap": targets.rel_gap,
        "variance_reduction": reduction,
        "variance_vs_kl_full": {k: v for k, v in vs_full.items() if v},
        "bias": {lab: _bias(results, lab) for lab in labs},
        "variance": {lab: lookup(results, lab, "variance")["value"] for lab in labs},
        "variants": {v.label: _variant_entry(results, v, reduction) for v in vs},
        "student_topk_mass": _topk_mass(results),
        "student_trajectory_kl": setup.student_trajectory,
        "config": {k: getattr(cfg, k) for k in ("policy", "teacher", "replicates", "batch_size", "behaviour_lag",
                                                "importance_weights", "loss_agg_mode", "seed")},
    }


# ---- the study ------------------------------------------------------------------------------------------------------

def run(cfg: Config, progress: bool | None = None) -> StudyResult:
    """(tidy results, summary) of one distillation variance study; deterministic given ``cfg.seed``."""
    cfg.validate()
    setup = make_setup(cfg)
    targets = exact_targets(cfg, setup)
    env = setup.env
    key = dict(env=env.name, vocab_size=env.vocab_size, length=env.length, policy=cfg.policy, teacher=cfg.teacher,
               behaviour_lag=cfg.behaviour_lag, seed=cfg.seed)
    rows = setting_rows(cfg, setup, targets, key)
    reps = draw_replicates(cfg, setup)
    vs = variants(cfg)
    series = {}
    bars = bar(len(vs), "distillation", progress)
    for v in vs:
        measured, series[v.label] = measure_variant(cfg, setup, targets, reps, v, key)
        rows += measured
        bars.update(1)
    bars.close()
    ratio_rows, reduction = variance_ratios(cfg, vs, series, key)
    results = pd.DataFrame(rows + ratio_rows)
    return StudyResult(results, summarise(cfg, setup, targets, results, reduction, vs))


# ---- where does the baseline help? ------------------------------------------------------------------------------------

def reduction_grid(cfg: Config, vocab_sizes: list, teacher_noises: list, replicates: int = 200,
                   lengths: list | None = None, progress: bool | None = None) -> StudyResult:
    """vOPD's variance reduction Var(OPD) / Var(vOPD) with its interval, against vocabulary size and the student-
    teacher divergence (and response length, default the config's): one study per (V, teacher noise, T), a perturbed
    teacher (initial logits + noise N(0, 1)), OPD
    and vOPD on the same batches. A ratio below 1 (interval excluding 1) means the state-value baseline RAISES the
    variance: -KL_t is the conditional mean of the reward, but the product of the centred reward with the score
    grad log pi(y_t) can correlate with it, and with few tokens the cross term dominates. Results: one row per cell
    with the ratio, its interval and the exact KL per token; the summary lists the cells where the baseline helps,
    where it hurts and where the interval contains 1."""
    rows, lengths = [], lengths or [cfg.length]
    cells = [(int(T), int(V), float(noise)) for T in lengths for V in vocab_sizes for noise in teacher_noises]
    with bar(len(cells), "reduction grid", progress) as bars:
        for T, V, noise in cells:
            cell = dataclasses.replace(cfg, vocab_size=V, length=T, teacher="perturbed", teacher_noise=noise,
                                       estimators=["opd", "vopd"], replicates=replicates, student_steps=0,
                                       behaviour_lag=0, importance_weights=False)
            results, summary = run(cell, progress=False)
            r = summary["variance_reduction"]["vopd"]
            rows.append({"length": T, "vocab_size": V, "teacher_noise": noise,
                         "kl_token": lookup(results, "-", "kl_token")["value"], "ratio": r["value"], "lo": r["lo"],
                         "hi": r["hi"]})
            bars.update(1)
    grid = pd.DataFrame(rows)
    verdict = np.where(grid["lo"] > 1, "helps", np.where(grid["hi"] < 1, "hurts", "unresolved"))
    grid["verdict"] = verdict
    summary = {"cells": grid.to_dict("records"), "helps": int((verdict == "helps").sum()),
               "hurts": int((verdict == "hurts").sum()), "unresolved": int((verdict == "unresolved").sum()),
               "replicates": replicates, "lengths": [int(T) for T in lengths]}
    return StudyResult(grid, summary)


def tidy_grid(grid: pd.DataFrame) -> pd.DataFrame:
    """The grid as tidy rows keyed like the study's: the ratio (variance_reduction) and the KL per token per cell."""
    base = grid.assign(estimator="vopd", variant="vopd", target="-", part="reduction_grid")
    ratio = base.assign(metric="variance_reduction", value=base["ratio"])
    kl = base.assign(metric="kl_token", value=base["kl_token"], lo=base["kl_token"], hi=base["kl_token"])
    cols = ["length", "vocab_size", "teacher_noise", "estimator", "variant", "target", "metric", "value", "lo", "hi",
            "part"]
    return pd.concat([ratio[cols], kl[cols]], ignore_index=True)
