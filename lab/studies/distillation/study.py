"""The distillation study: bias against two exact targets, variance, and what a baseline buys.

Setting: a student pi_S and a frozen teacher pi_T (same policy kind) over an enumerable toy env (vocabulary V,
length T). The distillation objective is the reverse KL of the student from the teacher on the student's own rollouts
(``lab.estimators.distillation``: vanilla OPD, Thinking Machines 2025; vOPD, Oh et al. 2026, arXiv 2605.07865, and
its release's top-k forms; the full-vocabulary KL of GKD, Agarwal et al. 2024). Two exact targets by enumerating
every response (``lab.studies.distillation.exact``, float64): the per-token target g_tok (the states the student
visits held fixed) and the sequence-level target g_seq = grad KL(pi_S(y) || pi_T(y)) (the state term added).
Estimators return ascent directions -grad loss, whose on-policy mean is -c g_tok (or -c g_seq), c = 1 for
seq-mean-token-sum and 1/T for the per-token normalised modes (fixed length); estimates are compared with -c g.

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
orthonormal basis of their span (``exact.isometric_coordinates``); the numbers are the same up to float64 rounding.

Where the baseline helps (``grid_*``): with ``grid_vocab_sizes`` given, the study also measures Var(OPD) / Var(vOPD)
in one small study per (response length, V, teacher perturbation) (``reduction_grid``) and adds it to the results
(``part`` = reduction_grid) and the summary.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import pandas as pd
import torch

import toy_envs
from lab import stats
from lab.configs import SEED_MAX, check_types, check_unique
from lab.engine.batches import Batch, draw_batches
from lab.engine.estimator import Estimator
from lab.engine.exact import Problem, Support
from lab.engine.gradients import replicate_gradients
from lab.engine.metrics import gram_metrics, variance_resamples
from lab.engine.staleness import optimisation_trajectory
from lab.engine.variance import GRADIENT_MEMORY_BUDGET
from lab.errors import LabError
from lab.estimators.aggregation import AGG_MODES, check_mode, target_scale
from lab.policies import init_params, log_probs_of, make_policy
from lab.progress import bar
from lab.seeding import derive_seed, generator
from lab.studies import StudyResult
from lab.studies.distillation.exact import (expected_estimate, isometric_coordinates, per_token_target,
                                            sequence_kl, sequence_target, topk_mass)
from lab.typed import knob

ESTIMATORS = ("opd", "opd_rtg", "vopd", "vopd_topk", "kl_full", "kl_topk")  # opd_rtg: opd with return_to_go=True
TOPK = ("vopd_topk", "kl_topk")
SAMPLED_TOKEN = ("opd", "opd_rtg", "vopd", "vopd_topk")  # the ones that accept importance_weights
TEACHERS = ("trained", "perturbed")
TARGETS = ("per_token", "sequence")
UNBIASED_TOL = 1e-6  # exact relative bias below this counts as unbiased (float64 rounding is ~1e-14)


@dataclass
class Config:
    """One distillation study. Every field has a default: ``Config()`` runs in seconds (no grid)."""

    env: str = "small_dense"
    """toy env preset (see `lab envs`); its reward only trains the teacher"""
    vocab_size: int = knob(32, ge=2, le=1_000_000)
    """V (overrides the preset)"""
    length: int = knob(3, ge=1, le=64)
    """T (overrides the preset)"""
    n_prompts: int = knob(1, ge=1, le=1_000_000)
    """prompts (overrides the preset)"""
    policy: Literal["prefix", "markov"] = "prefix"
    """policy of student and teacher: prefix | markov"""
    teacher: Literal[TEACHERS] = "trained"
    """trained (Adam on the env's reward) | perturbed (noisy copy of the initial logits)"""
    teacher_steps: int = knob(10, ge=0, le=1_000_000)
    """Adam steps of the trained teacher"""
    teacher_lr: float = knob(0.3, gt=0, le=1e3)
    """the trained teacher's learning rate"""
    teacher_noise: float = knob(1.5, ge=0, le=1e3, only=("teacher", "perturbed"))
    """std of the perturbed teacher's logit noise"""
    teacher_temperature: float = knob(1.0, gt=0, le=1e3)
    """teacher logits are divided by this"""
    init_scale: float = knob(1.0, ge=0, le=100)
    """the student's initial logits ~ N(0, init_scale^2)"""
    student_steps: int = knob(0, ge=0, le=1_000_000)
    """Adam steps of exact sequence-level distillation before the study (0: the initial policy)"""
    student_lr: float = knob(0.05, gt=0, le=1e3)
    """their learning rate"""
    behaviour_lag: int = knob(0, ge=0, le=1_000_000)
    """sample from the student snapshot this many steps back (0: on-policy; at most student_steps)"""
    importance_weights: bool = False
    """sampled-token estimators multiply by sg[pi_S / mu] per token"""
    estimators: list[Literal[ESTIMATORS]] = knob(list(ESTIMATORS))
    """estimators: opd, opd_rtg (opd with reward-to-go), vopd, vopd_topk, kl_full, kl_topk"""
    k_values: list[int] = knob([2, 4, 8, 16], ge=1, le=1_000_000)
    """top-k sizes for vopd_topk and kl_topk"""
    loss_agg_mode: Literal[AGG_MODES] = "token-mean"
    """loss aggregation mode of every estimator"""
    batch_size: int = knob(32, ge=1, le=1_000_000)
    """B responses per batch"""
    replicates: int = knob(300, ge=2, le=1_000_000)
    """M independent batches"""
    enum_limit: int = knob(toy_envs.DEFAULT_ENUM_LIMIT, ge=1, le=2**31)
    """largest number of (prompt, response) pairs to enumerate"""
    n_boot: int = knob(1000, ge=10, le=1_000_000)
    """bootstrap resamples"""
    ci: float = knob(0.95, gt=0, lt=1)
    """interval coverage"""
    seed: int = knob(0, ge=0, le=SEED_MAX)
    """seed of every random stream of the study"""
    grid_vocab_sizes: list[int] = knob([], ge=2, le=1_000_000)
    """where the baseline helps: vocabulary sizes of the reduction grid (empty: no grid)"""
    grid_teacher_noises: list[float] = knob([0.25, 1.0, 3.0], ge=0, le=1e3)
    """... and teacher perturbations (the student-teacher divergence; a perturbed teacher in every grid setting)"""
    grid_lengths: list[int] = knob([2, 3], ge=1, le=64)
    """... and response lengths"""
    grid_replicates: int = knob(200, ge=2, le=1_000_000)
    """M independent batches per grid setting"""

    def make_env(self):
        return toy_envs.make(self.env, vocab_size=self.vocab_size, length=self.length, n_prompts=self.n_prompts)

    def problem(self) -> Problem:
        env = self.make_env()
        return Problem(env, make_policy(self.policy, env), "exact", self.enum_limit)

    def validate(self) -> None:
        check_types(self)
        for name in ("estimators", "grid_vocab_sizes", "grid_teacher_noises", "grid_lengths"):
            check_unique(name, getattr(self, name))
        self._validate_one()
        if self.grid_vocab_sizes:
            if not self.grid_teacher_noises or not self.grid_lengths:
                raise LabError("the reduction grid needs at least one teacher noise and one response length")
            for T in self.grid_lengths:  # every grid setting's enumeration, before any of them runs
                for V in self.grid_vocab_sizes:
                    try:
                        grid_cell(self, V, T, self.grid_teacher_noises[0])._validate_one()
                    except LabError as e:
                        raise LabError(f"reduction grid setting V = {V}, T = {T}: {e}") from None

    def _validate_one(self) -> None:
        problem = self.problem()
        problem.check()
        if not self.estimators:
            raise LabError("give at least one estimator")
        if self.behaviour_lag > self.student_steps:
            raise LabError(f"behaviour lag {self.behaviour_lag} exceeds the student's trajectory "
                           f"({self.student_steps} steps); raise student_steps")
        if any(e in TOPK for e in self.estimators) and not self.k_values:
            raise LabError("give at least one top-k size in k_values for the top-k estimators")
        check_mode(self.loss_agg_mode)
        if problem.env.eos and self.loss_agg_mode != "seq-mean-token-sum":
            raise LabError(f"with variable-length responses ({self.env} has an end token) only seq-mean-token-sum "
                           f"estimates a fixed multiple of the targets; set loss_agg_mode to seq-mean-token-sum")
        need = self.replicates * int(np.prod(problem.policy.shape)) * 4  # the [M, D] float32 estimates of a variant
        if need > GRADIENT_MEMORY_BUDGET:
            raise LabError(f"{self.replicates} replicates x {need // (4 * self.replicates):,} parameters need "
                           f"{need / 2**30:.1f} GiB of gradient estimates (budget "
                           f"{GRADIENT_MEMORY_BUDGET / 2**30:.0f} GiB); use fewer replicates or the markov policy")

    def topk_sizes(self) -> list[int]:
        """The distinct top-k sizes the study measures (none without a top-k estimator)."""
        return sorted(set(self.k_values)) if any(e in TOPK for e in self.estimators) else []


SMOKE = {"vocab_size": 8, "length": 2, "replicates": 40, "k_values": [2], "teacher_steps": 3, "n_boot": 200,
         "grid_vocab_sizes": [3, 8], "grid_teacher_noises": [1.0], "grid_replicates": 40, "grid_lengths": [2]}


def grid_cell(cfg: Config, vocab_size: int, length: int, teacher_noise: float) -> Config:
    """One setting of the reduction grid: OPD and vOPD, on-policy, against a perturbed teacher, no grid of its own."""
    return dataclasses.replace(cfg, vocab_size=vocab_size, length=length, teacher="perturbed",
                               teacher_noise=teacher_noise, estimators=["opd", "vopd"], replicates=cfg.grid_replicates,
                               student_steps=0, behaviour_lag=0, importance_weights=False, grid_vocab_sizes=[])


# ---- the summary's shape --------------------------------------------------------------------------------------------

@dataclass
class Interval:
    """A number with its interval."""

    value: float
    lo: float
    hi: float


@dataclass
class Reduction(Interval):
    """Var(OPD) / Var(a vOPD variant) with its interval, and the variant's top-k size (None: the full baseline)."""

    k: int | None = None


@dataclass
class TargetBias:
    """One variant against one target: the exact relative bias ‖E g − c g‖ ÷ ‖c g‖, the sampled bias norm and MSE ÷
    ‖target‖²."""

    exact_rel_bias: float
    sampled_bias_norm: Interval
    rel_mse: Interval


@dataclass
class Bias:
    per_token: TargetBias
    sequence: TargetBias
    unbiased_for: list[str]  # the targets its exact expectation equals (relative bias < UNBIASED_TOL)


@dataclass
class Variant:
    """Per variant: registry name, k, variance ÷ ‖g_tok‖², Var(OPD) ÷ Var and, for top-k baselines when the full one
    helps, the share of the full baseline's variance reduction it keeps, (1 − 1/r_k) ÷ (1 − 1/r)."""

    estimator: str
    k: int | None
    rel_variance: Interval
    variance_reduction: Interval | None
    kept_share: float | None = None


@dataclass
class GridCell:
    length: int
    vocab_size: int
    teacher_noise: float
    kl_token: float
    ratio: float  # Var(OPD) / Var(vOPD)
    lo: float
    hi: float
    verdict: str  # helps (lo > 1) | hurts (hi < 1) | unresolved


@dataclass
class Grid:
    """Where the baseline helps: Var(OPD) ÷ Var(vOPD) per (T, V, teacher noise)."""

    cells: list[GridCell]
    helps: int
    hurts: int
    unresolved: int
    replicates: int
    lengths: list[int]


@dataclass
class Summary:
    """What a distillation study found (summary.json); variant labels key the mappings (e.g. vopd_top4)."""

    study: str
    env: str
    vocab_size: int
    length: int
    kl_seq: float  # KL(pi_S(y) || pi_T(y)) per response
    kl_token: float  # ... per token
    target_norms: dict[str, float]  # target -> ‖c g‖
    targets_cos: float  # cos(g_tok, g_seq)
    targets_rel_gap: float  # ‖g_tok − g_seq‖ ÷ ‖g_seq‖
    variance_reduction: dict[str, Reduction]  # vOPD variants: Var(OPD) ÷ Var
    variance_vs_kl_full: dict[str, Interval]  # Var(variant) ÷ Var(full-vocabulary KL)
    bias: dict[str, Bias]
    variance: dict[str, float]
    variants: dict[str, Variant]
    student_topk_mass: dict[str, float]  # k -> the student's exact mass in its top-k
    student_trajectory_kl: list[float]  # sequence KL before each of the student's distillation steps
    config: dict  # the sampling settings
    reduction_grid: Grid | None = None


# ---- estimator variants ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Run:
    """One estimator as the study runs it: a unique label (e.g. vopd_top4), the resolved estimator, its top-k size."""

    label: str
    est: Estimator
    k: int | None = None

    @property
    def name(self) -> str:
        return self.est.name


def variants(cfg: Config) -> list[Run]:
    """The estimator variants of a study, in a fixed order: top-k estimators once per k."""
    iw = {"importance_weights": True} if cfg.importance_weights else {}

    def make(label, name, hyper, k=None):
        return Run(label, Estimator.resolve(name, hyper, cfg.loss_agg_mode), k)

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

def _row(key: dict, metric: str, value, lo=None, hi=None, variant: Run | None = None, target: str = "-",
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


def measure_variant(cfg: Config, setup: Setup, targets: Targets, reps: Replicates, v: Run, key: dict):
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


def variance_ratios(cfg: Config, vs: list[Run], series: dict, key: dict) -> tuple[list[dict], dict]:
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


def _interval(r: dict) -> Interval | None:
    return Interval(r["value"], r["lo"], r["hi"]) if r else None


def _bias(results: pd.DataFrame, lab: str) -> Bias:
    per = {t: TargetBias(lookup(results, lab, "exact_rel_bias", t)["value"],
                         _interval(lookup(results, lab, "bias_norm", t)), _interval(lookup(results, lab, "rel_mse", t)))
           for t in TARGETS}
    return Bias(per["per_token"], per["sequence"], unbiased_targets(results, lab))


def _variant_entry(results: pd.DataFrame, v: Run, reduction: dict) -> Variant:
    """Per variant: registry name, k, variance ÷ ‖g_tok‖², Var(OPD) ÷ Var and, for top-k baselines, the share of
    the full baseline's variance reduction they keep."""
    full = reduction.get("vopd", {}).get("value")
    kept = kept_share(reduction[v.label]["value"], full) if v.label.startswith("vopd_top") and full and full > 1 \
        else None
    return Variant(v.name, v.k, _interval(lookup(results, v.label, "rel_variance")),
                   _interval(lookup(results, v.label, "variance_reduction")), kept)


def summarise(cfg: Config, setup: Setup, targets: Targets, results: pd.DataFrame, reduction: dict,
              vs: list[Run]) -> Summary:
    """summary.json: every number the report's text and table print."""
    labs = [v.label for v in vs]
    vs_full = {lab: lookup(results, lab, "variance_vs_kl_full") for lab in labs if lab != "kl_full"}
    return Summary(
        study="distillation", env=setup.env.name, vocab_size=setup.env.vocab_size, length=setup.env.length,
        kl_seq=targets.kl_seq, kl_token=targets.kl_seq / targets.mean_len, target_norms=targets.norms,
        targets_cos=targets.cos, targets_rel_gap=targets.rel_gap,
        variance_reduction={lab: Reduction(r["value"], r["lo"], r["hi"], r["k"]) for lab, r in reduction.items()},
        variance_vs_kl_full={k: _interval(v) for k, v in vs_full.items() if v},
        bias={lab: _bias(results, lab) for lab in labs},
        variance={lab: lookup(results, lab, "variance")["value"] for lab in labs},
        variants={v.label: _variant_entry(results, v, reduction) for v in vs},
        student_topk_mass=_topk_mass(results), student_trajectory_kl=setup.student_trajectory,
        config={k: getattr(cfg, k) for k in ("policy", "teacher", "replicates", "batch_size", "behaviour_lag",
                                             "importance_weights", "loss_agg_mode", "seed")})


# ---- the study ------------------------------------------------------------------------------------------------------

def run(cfg: Config, progress: bool | None = None) -> StudyResult:
    """(tidy results, summary) of one distillation study, and its reduction grid when ``grid_vocab_sizes`` is given;
    deterministic given ``cfg.seed``."""
    cfg.validate()
    results, summary = measure(cfg, progress)
    if cfg.grid_vocab_sizes:
        grid, summary.reduction_grid = reduction_grid(cfg, progress)
        results = pd.concat([results, tidy_grid(grid)], ignore_index=True)
    return StudyResult(results, asdict(summary))


def measure(cfg: Config, progress: bool | None = None) -> tuple[pd.DataFrame, Summary]:
    """(tidy results, Summary) of the study's one setting (no grid); ``cfg`` is validated."""
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
    return results, summarise(cfg, setup, targets, results, reduction, vs)


# ---- where does the baseline help? ----------------------------------------------------------------------------------

def reduction_grid(cfg: Config, progress: bool | None = None) -> tuple[pd.DataFrame, Grid]:
    """vOPD's variance reduction Var(OPD) / Var(vOPD) with its interval, against vocabulary size, the student-teacher
    divergence and response length (``cfg.grid_*``): one study per (T, V, teacher noise), a perturbed teacher
    (initial logits + noise N(0, 1)), OPD and vOPD on the same batches (``grid_cell``). A ratio below 1 (interval
    excluding 1) means the state-value baseline RAISES the variance: -KL_t is the conditional mean of the reward, but
    the product of the centred reward with the score grad log pi(y_t) can correlate with it, and with few tokens the
    cross term dominates. Returns one row per cell (the ratio, its interval, the exact KL per token, the verdict)
    and the Grid summary: where the baseline helps, where it hurts, where the interval contains 1."""
    rows = []
    cells = [(int(T), int(V), float(noise)) for T in cfg.grid_lengths for V in cfg.grid_vocab_sizes
             for noise in cfg.grid_teacher_noises]
    with bar(len(cells), "reduction grid", progress) as bars:
        for T, V, noise in cells:
            results, summary = measure(grid_cell(cfg, V, T, noise), progress=False)
            r = summary.variance_reduction["vopd"]
            rows.append({"length": T, "vocab_size": V, "teacher_noise": noise,
                         "kl_token": lookup(results, "-", "kl_token")["value"], "ratio": r.value, "lo": r.lo,
                         "hi": r.hi})
            bars.update(1)
    grid = pd.DataFrame(rows)
    verdict = np.where(grid["lo"] > 1, "helps", np.where(grid["hi"] < 1, "hurts", "unresolved"))
    grid["verdict"] = verdict
    summary = Grid([GridCell(**c) for c in grid.to_dict("records")], int((verdict == "helps").sum()),
                   int((verdict == "hurts").sum()), int((verdict == "unresolved").sum()), cfg.grid_replicates,
                   [int(T) for T in cfg.grid_lengths])
    return grid, summary


def tidy_grid(grid: pd.DataFrame) -> pd.DataFrame:
    """The grid as tidy rows keyed like the study's: the ratio (variance_reduction) and the KL per token per cell."""
    base = grid.assign(estimator="vopd", variant="vopd", target="-", part="reduction_grid")
    ratio = base.assign(metric="variance_reduction", value=base["ratio"])
    kl = base.assign(metric="kl_token", value=base["kl_token"], lo=base["kl_token"], hi=base["kl_token"])
    cols = ["length", "vocab_size", "teacher_noise", "estimator", "variant", "target", "metric", "value", "lo", "hi",
            "part"]
    return pd.concat([ratio[cols], kl[cols]], ignore_index=True)
