"""The on-policy distillation variance study: bias against two exact targets, variance, and what a baseline buys.

Setting: a tabular student pi_S and a frozen tabular teacher pi_T over an enumerable toy env (vocabulary V, length T).
The distillation objective is the reverse KL of the student from the teacher on the student's own rollouts
(lab.estimators.distillation). Two exact targets, by enumerating every response (float64):

    per-token   g_tok = grad_theta sum_y sg[pi_S(y)] sum_t m_t KL_t(theta)        (visitation held fixed)
    sequence    g_seq = grad_theta KL(pi_S(y) || pi_T(y)) = grad_theta E_{pi_S}[sum_t KL_t]   (adds the state term)

with KL_t = KL(pi_S(.|s_t) || pi_T(.|s_t)), averaged over prompts. Estimators return ascent directions -grad loss,
whose on-policy mean is -c g_tok (or -c g_seq), c = 1 for seq-mean-token-sum and 1/T for the per-token normalised
modes (fixed length); estimates are compared with -c g.

The study draws M replicate batches of B responses from the behaviour policy (the student itself, or with
``behaviour_lag`` a snapshot that many steps behind on the student's distillation trajectory), evaluates every
estimator on the same batches (torch.func vmap over replicates: lab.gradients.replicate_gradients), and reports,
against both targets, bias / variance / MSE with bootstrap intervals (lab.variance.gram_metrics), the exact bias
by enumeration (the estimator's expectation over every response, weighted by the behaviour policy), and the
variance reduction factor of each baseline, Var(opd) / Var(vopd) with a percentile interval from resampling
replicate indices jointly for both estimators (one bootstrap counts matrix shared by every estimator).

Teacher construction (``teacher``): ``trained`` = the student's initial policy after ``teacher_steps`` Adam steps on
the env's exact reward gradient (a teacher that knows the task); ``perturbed`` = the initial logits plus
``teacher_noise`` * N(0, 1) noise. Either is then tempered: teacher logits / ``teacher_temperature``.
The student is the initial policy after ``student_steps`` Adam steps of exact sequence-level distillation toward the
teacher (0: the initial policy).

Each estimator's gradients [M, D] are reduced to exact low-dimensional coordinates before any statistics: every
statistic here is an inner product, so the M estimates and the two targets are replaced by their coordinates in an
orthonormal basis of their span (an eigendecomposition of their (M+2) x (M+2) Gram matrix). One Gram product per
estimator instead of three; the numbers are the same up to float64 rounding.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import NullLocator
from torch.func import vmap
from tqdm import tqdm

import toy_envs
from lab import estimators, stats
from lab.errors import LabError
from lab.estimators.aggregation import check_mode, target_scale
from lab.estimators.distillation import reverse_kl, topk_reverse_kl
from lab.exact import Support, exact_support
from lab.gradients import replicate_gradients
from lab.policies import init_params, make_policy, sequence_log_probs, token_log_probs
from lab.staleness import optimisation_trajectory
from lab.variance import check_gradient_memory, draw_batches, gram_metrics

ESTIMATORS = ("opd", "opd_rtg", "vopd", "vopd_topk", "kl_full", "kl_topk")  # opd_rtg: opd with return_to_go=True
TOPK = ("vopd_topk", "kl_topk")
SAMPLED_TOKEN = ("opd", "opd_rtg", "vopd", "vopd_topk")  # the ones that accept importance_weights
TEACHERS = ("trained", "perturbed")
TARGETS = ("per_token", "sequence")
UNBIASED_TOL = 1e-6  # exact relative bias below this counts as unbiased (float64 rounding is ~1e-14)


@dataclass
class DistillationConfig:
    """One distillation variance study. Every field has a default: ``DistillationConfig()`` runs in seconds."""

    env: str = "small_dense"  # toy_envs preset; its reward only trains the teacher
    vocab_size: int = 32  # V (overrides the preset)
    length: int = 3  # T (overrides the preset)
    n_prompts: int = 1  # prompts (overrides the preset)
    policy: str = "prefix"  # tabular policy of student and teacher: prefix | markov
    teacher: str = "trained"  # trained (Adam on the env's reward) | perturbed (noisy copy of the initial logits)
    teacher_steps: int = 10  # Adam steps of the trained teacher
    teacher_lr: float = 0.3  # its learning rate
    teacher_noise: float = 1.5  # std of the perturbed teacher's logit noise
    teacher_temperature: float = 1.0  # teacher logits are divided by this
    init_scale: float = 1.0  # the student's initial logits ~ N(0, init_scale^2)
    student_steps: int = 0  # Adam steps of exact sequence-level distillation before the study (0: initial policy)
    student_lr: float = 0.05  # their learning rate
    behaviour_lag: int = 0  # sample from the student snapshot this many steps back (0: on-policy)
    importance_weights: bool = False  # sampled-token estimators multiply by sg[pi_S / mu] per token
    estimators: list = field(default_factory=lambda: list(ESTIMATORS))
    k_values: list = field(default_factory=lambda: [2, 4, 8, 16])  # top-k sizes for vopd_topk and kl_topk
    loss_agg_mode: str = "token-mean"
    batch_size: int = 32  # B responses per batch
    replicates: int = 300  # M independent batches
    enum_limit: int = toy_envs.DEFAULT_ENUM_LIMIT
    n_boot: int = 1000
    ci: float = 0.95
    seed: int = 0

    def make_env(self):
        return toy_envs.make(self.env, vocab_size=self.vocab_size, length=self.length, n_prompts=self.n_prompts)

    def validate(self):
        env = self.make_env()
        policy = make_policy(self.policy, env)
        env.check_enumerable(self.enum_limit)
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
        if not self.estimators:
            raise LabError("give at least one estimator")
        unknown = [e for e in self.estimators if e not in ESTIMATORS]
        if unknown:
            raise LabError(f"unknown distillation estimator(s) {', '.join(unknown)}; choose from {', '.join(ESTIMATORS)}")
        if any(e in TOPK for e in self.estimators):
            if not self.k_values:
                raise LabError("give at least one top-k size in k_values for the top-k estimators")
            for k in self.k_values:
                if not (isinstance(k, int) and not isinstance(k, bool) and k >= 1):
                    raise LabError(f"top-k sizes must be positive whole numbers, got {k!r}")
        check_mode(self.loss_agg_mode)
        if env.eos and self.loss_agg_mode != "seq-mean-token-sum":
            raise LabError(f"with variable-length responses ({self.env} has an end token) only seq-mean-token-sum "
                           f"estimates a fixed multiple of the targets; set loss_agg_mode to seq-mean-token-sum")
        if self.batch_size < 1:
            raise LabError(f"batch size must be at least 1, got {self.batch_size}")
        if self.replicates < 2:
            raise LabError(f"replicates must be at least 2 to measure a variance, got {self.replicates}")
        if not 0 < self.ci < 1 or self.n_boot < 10:
            raise LabError("ci must lie in (0, 1) and n_boot be at least 10")
        check_gradient_memory(self.replicates, policy)
        return env


def config_dict(cfg: DistillationConfig) -> dict:
    return asdict(cfg)


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


# ---- estimator variants ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Variant:
    label: str  # unique name in the results (e.g. vopd_top4)
    name: str  # registry name
    hyper: dict
    k: int | None = None


def variants(cfg: DistillationConfig) -> list[Variant]:
    """The estimator variants of a study, in a fixed order: top-k estimators once per k."""
    iw = {"importance_weights": True} if cfg.importance_weights else {}
    out = []
    for e in cfg.estimators:
        if e == "opd_rtg":
            out.append(Variant("opd_rtg", "opd", {"return_to_go": True, **iw}))
        elif e in TOPK:
            short = "vopd_top" if e == "vopd_topk" else "kl_top"
            extra = iw if e in SAMPLED_TOKEN else {}
            out += [Variant(f"{short}{k}", e, {"k": int(k), **extra}, int(k)) for k in sorted(set(cfg.k_values))]
        else:
            out.append(Variant(e, e, dict(iw) if e in SAMPLED_TOKEN else {}))
    return out


def pretty(label: str) -> str:
    """Display name of a variant label."""
    fixed = {"opd": "OPD", "opd_rtg": "OPD (reward-to-go)", "vopd": "vOPD", "kl_full": "full-vocab KL"}
    if label in fixed:
        return fixed[label]
    if label.startswith("vopd_top"):
        return f"vOPD top-{label[8:]}"
    if label.startswith("kl_top"):
        return f"top-{label[6:]} KL"
    return label


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


def expected_estimate(policy, theta_s, theta_t, support_mu: Support, name: str, hyper: dict,
                      loss_agg_mode: str = "token-mean", theta_mu=None) -> torch.Tensor:
    """E_mu[-grad loss] of estimator ``name`` for one response per batch, exactly (float64, flat).

    Every response of ``support_mu`` (mu's exact distribution) is its own batch of one; the per-response losses
    (vmap over responses) are weighted by mu(y) and differentiated once. For fixed-length responses every
    aggregation mode averages per-response terms, so this is also the mean of the B-response batch estimate.
    ``theta_mu`` gives the behaviour log-probs passed as ``old_log_prob`` (default: the student's own).
    """
    s = support_mu
    info = estimators.info(name)
    theta = theta_s.detach().double().requires_grad_(True)
    tt = theta_t.detach().double()
    prompts, tokens, mask = s.prompts[:, None], s.tokens[:, None], s.mask[:, None]
    logits = policy.logits(theta, prompts, tokens)
    log_prob = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1) * mask
    with torch.no_grad():
        t_logits = policy.logits(tt, prompts, tokens)
        t_log_prob = torch.log_softmax(t_logits, -1).gather(-1, tokens[..., None]).squeeze(-1) * mask
        old = (log_prob.detach() if theta_mu is None
               else token_log_probs(policy, theta_mu.double(), prompts, tokens) * mask)
    extras = {"teacher_log_prob": t_log_prob, "logits": logits, "teacher_logits": t_logits}
    named = {k: v for k, v in extras.items() if k in set(info.inputs) | set(info.optional_inputs)}

    def one(lp, old_lp, m, kw):
        return info.fn(lp, old_lp, torch.zeros_like(lp), m, loss_agg_mode=loss_agg_mode, **hyper, **kw)[0]

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


# ---- the study ------------------------------------------------------------------------------------------------------

@dataclass
class Setup:
    env: object
    policy: object
    theta_student: torch.Tensor  # float64
    theta_teacher: torch.Tensor  # float64, tempered
    theta_behaviour: torch.Tensor  # float64
    student_trajectory: list  # sequence KL along the student's distillation steps


def make_setup(cfg: DistillationConfig) -> Setup:
    """Student, teacher and behaviour parameters (float64), deterministic given ``cfg.seed``."""
    env = cfg.validate()
    policy = make_policy(cfg.policy, env)
    gen = torch.Generator().manual_seed(_seed(cfg.seed, 0))
    theta0 = init_params(policy, cfg.init_scale, gen)
    if cfg.teacher == "trained":
        traj = optimisation_trajectory(env, policy, theta0, cfg.teacher_steps, cfg.teacher_lr, "exact",
                                       cfg.enum_limit, 0, gen)
        theta_t = traj.current.clone()
    else:
        theta_t = theta0 + cfg.teacher_noise * torch.randn(theta0.shape, generator=gen, dtype=torch.float64)
    theta_t = theta_t / cfg.teacher_temperature
    theta = theta0.clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=cfg.student_lr)
    snaps, kls = [theta0.clone()], []
    for _ in range(cfg.student_steps):
        support = exact_support(env, policy, theta.detach(), cfg.enum_limit)
        kls.append(sequence_kl(policy, theta.detach(), theta_t, support))
        theta.grad = sequence_target(policy, theta.detach(), theta_t, support).reshape(theta.shape)
        opt.step()
        snaps.append(theta.detach().clone())
    theta_s = snaps[-1]
    return Setup(env, policy, theta_s, theta_t, snaps[-1 - cfg.behaviour_lag], kls)


def isometric_coordinates(grads: torch.Tensor, *targets: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Coordinates [M, r] and [r] with the same inner products as ``grads`` [M, D] and each target [D] (float64)."""
    X = torch.cat([grads.double(), torch.stack([t.double() for t in targets])])
    gram = X @ X.T
    evals, evecs = torch.linalg.eigh(gram)
    keep = evals > evals.max().clamp(min=1e-300) * 1e-13
    Y = evecs[:, keep] * evals[keep].sqrt()
    M = grads.shape[0]
    return Y[:M], [Y[M + i] for i in range(len(targets))]


def variance_resamples(coords: torch.Tensor, counts: np.ndarray) -> np.ndarray:
    """tr Cov of the estimates for the sample itself and each bootstrap resample: [1 + n_boot].

    The same ``counts`` for every estimator resamples replicate indices jointly, so ratios of these series are
    bootstrap draws of the variance ratio.
    """
    g = coords.double()
    M = g.shape[0]
    gram = (g @ g.T).numpy()
    C = np.vstack([np.ones(M), counts])
    q = ((C @ gram) * C).sum(1)
    return (C @ np.diag(gram) - q / M) / (M - 1)


@dataclass
class DistillationResult:
    config: DistillationConfig
    results: pd.DataFrame  # tidy: one row per (estimator variant, target, metric)
    summary: dict


def run_study(cfg: DistillationConfig, progress: bool | None = None) -> DistillationResult:
    """Run one distillation variance study; deterministic given ``cfg.seed``."""
    setup = make_setup(cfg)
    env, policy = setup.env, setup.policy
    th_s, th_t, th_mu = setup.theta_student, setup.theta_teacher, setup.theta_behaviour
    support_s = exact_support(env, policy, th_s, cfg.enum_limit)
    support_mu = support_s if cfg.behaviour_lag == 0 else exact_support(env, policy, th_mu, cfg.enum_limit)
    targets = {"per_token": per_token_target(policy, th_s, th_t, support_s),
               "sequence": sequence_target(policy, th_s, th_t, support_s)}
    c = target_scale(cfg.loss_agg_mode, env.length)
    ascent = {k: -c * v for k, v in targets.items()}  # what the estimators' means estimate
    kl_seq = sequence_kl(policy, th_s, th_t, support_s)
    mean_len = float((support_s.weights * support_s.mask.sum(-1)).sum())

    rows = []
    key = dict(env=env.name, vocab_size=env.vocab_size, length=env.length, policy=cfg.policy, teacher=cfg.teacher,
               behaviour_lag=cfg.behaviour_lag, seed=cfg.seed)

    def add(variant, metric, v, lo=None, hi=None, target="-", k=None):
        k = k if variant is None else variant.k
        rows.append({**key, "estimator": "-" if variant is None else variant.name,
                     "variant": "-" if variant is None else variant.label,
                     "k": float("nan") if k is None else float(k),
                     "target": target, "metric": metric, "value": float(v),
                     "lo": float(v if lo is None else lo), "hi": float(v if hi is None else hi)})

    norms = {k: float(v.norm()) for k, v in ascent.items()}
    add(None, "kl_seq", kl_seq)
    add(None, "kl_token", kl_seq / mean_len)
    for t in TARGETS:
        add(None, "target_norm", norms[t], target=t)
    cos_ab = float(targets["per_token"] @ targets["sequence"] / (targets["per_token"].norm()
                                                                  * targets["sequence"].norm()))
    add(None, "targets_cos", cos_ab)
    add(None, "targets_rel_gap", float((ascent["per_token"] - ascent["sequence"]).norm()) / norms["sequence"])
    ks = sorted(set(cfg.k_values)) if any(e in TOPK for e in cfg.estimators) else []
    for k in ks:
        add(None, "student_topk_mass", topk_mass(policy, th_s, support_s, k), k=k)

    gen = torch.Generator().manual_seed(_seed(cfg.seed, 2))
    M, B = cfg.replicates, cfg.batch_size
    batch = draw_batches(env, policy, th_mu, M, B, 1, gen)
    counts = stats.bootstrap_counts(M, cfg.n_boot, np.random.default_rng(_seed(cfg.seed, 3)))
    with torch.no_grad():
        t_logits = policy.logits(th_t.float(), batch.prompts, batch.tokens)
        t_log_prob = torch.log_softmax(t_logits, -1).gather(-1, batch.tokens[..., None]).squeeze(-1) * batch.mask
    extras = {"teacher_log_prob": t_log_prob, "teacher_logits": t_logits}
    adv = torch.zeros_like(batch.mask)
    theta32 = th_s.float()

    quiet = os.environ.get("CI") or os.environ.get("LAB_QUIET")
    vs = variants(cfg)
    bar = tqdm(total=len(vs), desc="distillation", disable=bool(quiet) or progress is False)
    var_series, per_variant = {}, {}
    for v in vs:
        info = estimators.info(v.name)
        need = {k: extras[k] for k in info.inputs if k in extras}
        grads, metrics = replicate_gradients(policy, theta32, batch, adv, v.name, cfg.loss_agg_mode, v.hyper, need)
        coords, (t_tok, t_seq) = isometric_coordinates(grads, ascent["per_token"], ascent["sequence"])
        del grads
        expected = expected_estimate(policy, th_s, th_t, support_mu, v.name, v.hyper, cfg.loss_agg_mode,
                                     None if cfg.behaviour_lag == 0 else th_mu)
        entry = {}
        for target, tc in (("per_token", t_tok), ("sequence", t_seq)):
            res = gram_metrics(coords, tc, counts, cfg.ci)
            exact_bias = float((expected - ascent[target]).norm())
            res["exact_bias_norm"] = (exact_bias,) * 3
            res["exact_rel_bias"] = (exact_bias / norms[target],) * 3
            for metric, (val, lo, hi) in res.items():
                if metric == "variance":
                    continue
                add(v, metric, val, lo, hi, target)
            entry[target] = {m: r[0] for m, r in res.items() if m != "variance"}
        series = variance_resamples(coords, counts)
        var_series[v.label] = series
        add(v, "variance", series[0], *stats.percentile_interval(series[1:], cfg.ci))
        add(v, "rel_variance", series[0] / norms["per_token"] ** 2,
            *(x / norms["per_token"] ** 2 for x in stats.percentile_interval(series[1:], cfg.ci)))
        for metric, values in metrics.items():
            add(v, metric, *stats.mean_interval(values.double().numpy(), counts, cfg.ci))
        entry["variance"] = float(series[0])
        per_variant[v.label] = entry
        bar.update(1)
    bar.close()

    reduction = {}
    for ref, metric in (("opd", "variance_reduction"), ("kl_full", "variance_vs_kl_full")):
        if ref not in var_series:
            continue
        for v in vs:
            if v.label == ref or v.label not in var_series:
                continue
            with np.errstate(divide="ignore", invalid="ignore"):  # a zero-variance estimator (top-1 KL)
                ratio = (var_series[ref] / var_series[v.label]) if metric == "variance_reduction" \
                    else (var_series[v.label] / var_series[ref])
            val, (lo, hi) = float(ratio[0]), stats.percentile_interval(ratio[1:], cfg.ci)
            add(v, metric, val, lo, hi)
            if metric == "variance_reduction" and v.name.startswith("vopd"):
                reduction[v.label] = {"value": val, "lo": lo, "hi": hi, "k": v.k}
    results = pd.DataFrame(rows)
    summary = _summary(cfg, results, reduction, per_variant, kl_seq, mean_len, norms, cos_ab, setup)
    return DistillationResult(cfg, results, summary)


def _iv(results: pd.DataFrame, variant: str, metric: str, target: str = "-") -> dict:
    r = results[(results["variant"] == variant) & (results["metric"] == metric) & (results["target"] == target)]
    if r.empty:
        return {}
    r = r.iloc[0]
    return {"value": float(r["value"]), "lo": float(r["lo"]), "hi": float(r["hi"])}


def unbiased_targets(results: pd.DataFrame, variant: str) -> list[str]:
    """The targets for which the variant's exact expectation equals the target (relative bias < 1e-6)."""
    out = []
    for t in TARGETS:
        r = _iv(results, variant, "exact_rel_bias", t)
        if r and r["value"] < UNBIASED_TOL:
            out.append(t)
    return out


def _summary(cfg, results, reduction, per_variant, kl_seq, mean_len, norms, cos_ab, setup) -> dict:
    labels = list(per_variant)
    bias = {}
    for lab in labels:
        bias[lab] = {t: {"exact_rel_bias": _iv(results, lab, "exact_rel_bias", t)["value"],
                         "sampled_bias_norm": _iv(results, lab, "bias_norm", t),
                         "rel_mse": _iv(results, lab, "rel_mse", t)} for t in TARGETS}
        bias[lab]["unbiased_for"] = unbiased_targets(results, lab)
    vs_full = {lab: _iv(results, lab, "variance_vs_kl_full") for lab in labels if lab != "kl_full"}
    summary = {
        "study": "opd_variance",
        "headline": headline(results, reduction),
        "env": setup.env.name, "vocab_size": setup.env.vocab_size, "length": setup.env.length,
        "kl_seq": kl_seq, "kl_token": kl_seq / mean_len,
        "target_norms": norms, "targets_cos": cos_ab,
        "variance_reduction": reduction,
        "variance_vs_kl_full": {k: v for k, v in vs_full.items() if v},
        "bias": bias,
        "variance": {lab: per_variant[lab]["variance"] for lab in labels},
        "student_trajectory_kl": setup.student_trajectory,
    }
    return summary


def kept_share(reduction_k: float, reduction_full: float) -> float:
    """The share of the variance the full baseline removes that a top-k baseline removes: (1 - 1/r_k) / (1 - 1/r)."""
    return (1 - 1 / reduction_k) / (1 - 1 / reduction_full)


def headline(results: pd.DataFrame, reduction: dict) -> str:
    """One line: vOPD's variance reduction, the smallest top-k baseline keeping 90% of it, the top-k KL loss's bias."""
    parts = []
    full = reduction.get("vopd")
    if full:
        parts.append(f"vOPD cuts vanilla OPD's gradient variance {full['value']:.2g}x "
                     f"[{full['lo']:.2g}, {full['hi']:.2g}]"
                     + (" at no bias" if "per_token" in unbiased_targets(results, "vopd") else ""))
    tops = sorted((v for k, v in reduction.items() if k.startswith("vopd_top")), key=lambda r: r["k"])
    if tops and full and full["value"] > 1:
        good = [r for r in tops if kept_share(r["value"], full["value"]) >= 0.9]
        r = good[0] if good else tops[-1]
        parts.append(f"a top-{r['k']} baseline keeps {r['value']:.2g}x")
    kl_tops = sorted({lab for lab in results["variant"] if lab.startswith("kl_top")}, key=lambda s: int(s[6:]))
    if kl_tops:
        b = _iv(results, kl_tops[-1], "exact_rel_bias", "per_token")["value"]
        parts.append(f"the top-{kl_tops[-1][6:]} KL loss is {b:.0%} biased")
    return "; ".join(parts) if parts else "distillation variance study"


# ---- what the report shows ------------------------------------------------------------------------------------------

def _val(results, variant, metric, target="-"):
    r = _iv(results, variant, metric, target)
    return r["value"] if r else float("nan")


def _fmt(r: dict, fmt: str = "{:.3g}") -> str:
    return f"{fmt.format(r['value'])} [{fmt.format(r['lo'])}, {fmt.format(r['hi'])}]" if r else "–"


def answer(results: pd.DataFrame, summary: dict, config: dict | None = None) -> str:
    """Markdown: does vOPD beat vanilla OPD, does it match full-vocabulary KL, what top-k keeps, who is biased."""
    config = config or {}
    labels = _labels(results)
    V, T = summary["vocab_size"], summary["length"]
    lines = [f"**Setup.** `{summary['env']}` with V = {V}, T = {T}; a `{config.get('policy', 'prefix')}` student and a "
             f"`{config.get('teacher', 'trained')}` teacher, KL(π_S‖π_T) = {summary['kl_seq']:.3g} nats per response "
             f"({summary['kl_token']:.3g} per token); {config.get('replicates')} replicate batches of "
             f"{config.get('batch_size')} responses"
             + (f", sampled from the student {config['behaviour_lag']} steps stale" if config.get("behaviour_lag")
                else ", on-policy") + f", `{config.get('loss_agg_mode', 'token-mean')}`.", ""]
    red = summary["variance_reduction"]
    if "vopd" in red:
        r = red["vopd"]
        verdict = "beats" if r["lo"] > 1 else ("does not beat" if r["hi"] < 1 else "is not distinguishable from")
        b = summary["bias"]["vopd"]
        bias_note = ("with no bias (its exact expectation is the per-token target, like OPD's)"
                     if "per_token" in b["unbiased_for"] else
                     f"but off-policy its exact expectation misses the per-token target by "
                     f"{b['per_token']['exact_rel_bias']:.0%}")
        lines.append(f"- **vOPD {verdict} vanilla OPD**: the closed-form baseline divides the gradient variance by "
                     f"**{_fmt(r, '{:.2f}')}**, {bias_note}.")
    if "vopd" in summary["variance_vs_kl_full"]:
        r = summary["variance_vs_kl_full"]["vopd"]
        rm_v, rm_f = _val(results, "vopd", "rel_mse", "per_token"), _val(results, "kl_full", "rel_mse", "per_token")
        verdict = ("is noisier than" if r["lo"] > 1 else "is less noisy than" if r["hi"] < 1 else "matches")
        lines.append(f"- **Per batch, vOPD {verdict} full-vocabulary KL**: its variance is {_fmt(r, '{:.3g}')}× full "
                     f"KL's (MSE ÷ ‖target‖² {rm_v:.3g} vs {rm_f:.3g}). Full KL removes the sampled token's noise "
                     f"entirely, at O(V) cost per token; what it keeps is the noise of which states a batch visits. "
                     f"(The paper's \"matches\" is about accuracy after training, which this report does not measure.)")
    tops = sorted((v for v in red if v.startswith("vopd_top")), key=lambda s: red[s]["k"])
    if tops and "vopd" in red:
        full = red["vopd"]["value"]
        keep = "; ".join(f"top-{red[t]['k']}: {_fmt(red[t], '{:.2f}')}×"
                         + (f" ({kept_share(red[t]['value'], full):.0%})" if full > 1 else "") for t in tops)
        lines.append(f"- **Top-k baselines** (Var(OPD) ÷ Var, and in brackets the share of the variance the full "
                     f"baseline removes that they remove): {keep}. On-policy every k is unbiased: a baseline only "
                     f"moves the variance.")
    per_tok = [pretty(l) for l in labels if "per_token" in summary["bias"][l]["unbiased_for"]]
    seq = [pretty(l) for l in labels if "sequence" in summary["bias"][l]["unbiased_for"]]
    neither = [pretty(l) for l in labels if not summary["bias"][l]["unbiased_for"]]
    lines.append(f"- **Bias (exact, by enumeration).** Unbiased for the per-token target: {', '.join(per_tok) or 'none'}."
                 f" Unbiased for the sequence-level target: {', '.join(seq) or 'none'}."
                 + (f" Biased for both: {', '.join(neither)}." if neither else ""))
    kl_tops = sorted((l for l in labels if l.startswith("kl_top")), key=lambda s: int(s[6:]))
    if kl_tops:
        b = ", ".join(f"top-{l[6:]}: {summary['bias'][l]['per_token']['exact_rel_bias']:.0%}" for l in kl_tops)
        lines.append(f"- **Top-k KL losses are biased** (‖E g − target‖ ÷ ‖target‖, per-token target): {b}.")
    gap = _val(results, "-", "targets_rel_gap")
    lines.append(f"- The two targets differ by {gap:.0%} of the sequence-level gradient (cosine "
                 f"{summary['targets_cos']:.2f}): immediate-reward OPD drops the reward-to-go term.")
    return "\n".join(lines)


def results_table(results: pd.DataFrame) -> pd.DataFrame:
    """One row per estimator variant: exact relative bias against both targets, variance and variance reduction."""
    labels = _labels(results)
    rows = []
    for lab in labels:
        vr = _iv(results, lab, "variance_reduction")
        rows.append({
            "estimator": pretty(lab),
            "bias vs per-token (exact)": f"{_val(results, lab, 'exact_rel_bias', 'per_token'):.1%}",
            "bias vs sequence (exact)": f"{_val(results, lab, 'exact_rel_bias', 'sequence'):.1%}",
            "variance ÷ ‖g_tok‖²": _fmt(_iv(results, lab, "rel_variance")),
            "Var(OPD) ÷ Var": _fmt(vr, "{:.2f}") if vr else "–",
            "MSE ÷ ‖g_tok‖²": _fmt(_iv(results, lab, "rel_mse", "per_token")),
        })
    return pd.DataFrame(rows)


# ---- figures (one function per figure, matplotlib Figure without pyplot) --------------------------------------------

FAMILY_COLORS = {"opd": "#7f7f7f", "opd_rtg": "#17becf", "vopd": "#1f77b4", "vopd_top": "#2ca02c",
                 "kl_full": "#9467bd", "kl_top": "#d62728"}


def _color(label: str) -> str:
    for prefix in ("vopd_top", "kl_top", "opd_rtg", "kl_full", "vopd", "opd"):
        if label.startswith(prefix):
            return FAMILY_COLORS[prefix]
    return "#444444"


def _labels(results: pd.DataFrame) -> list[str]:
    return [lab for lab in pd.unique(results["variant"]) if lab != "-"]


def bias_figure(results: pd.DataFrame) -> Figure:
    """Relative bias ‖E g − target‖ ÷ ‖target‖ of every variant against both targets: exact (bars) and sampled
    (debiased estimate with its 95% interval)."""
    labels = _labels(results)
    fig = Figure(figsize=(12, 3.9), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    y = np.arange(len(labels))
    for ax, target, title in zip(axes, TARGETS, ("per-token target (states held fixed)",
                                                 "sequence-level target  ∇ KL(π_S(y) ‖ π_T(y))")):
        norm = _val(results, "-", "target_norm", target)
        exact = np.array([_val(results, lab, "exact_rel_bias", target) for lab in labels])
        sampled = [_iv(results, lab, "bias_norm", target) for lab in labels]
        right = max(1.0, float(np.nanmax(exact)) * 1.18, max(r["hi"] / norm for r in sampled) * 1.1)
        ax.barh(y, exact, color=[_color(lab) for lab in labels], alpha=0.75, label="exact (enumeration)")
        for i, r in enumerate(sampled):
            ax.errorbar(r["value"] / norm, i, xerr=[[max(r["value"] - r["lo"], 0) / norm],
                                                    [max(r["hi"] - r["value"], 0) / norm]],
                        fmt="o", color="black", ms=3.5, lw=1, capsize=2,
                        label="sampled, 95% interval" if i == 0 else None)
            ax.text(max(exact[i], r["hi"] / norm) + 0.015 * right, i, f"{exact[i]:.0%}", va="center", fontsize=8,
                    color="#333333")
        ax.set_title(title, fontsize=10.5)
        ax.set_xlabel("‖E g − target‖ ÷ ‖target‖  (labels: exact)")
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_xlim(0, right)
    axes[0].set_yticks(y, [pretty(lab) for lab in labels])
    axes[0].invert_yaxis()
    axes[1].legend(frameon=False, fontsize=8, loc="lower right")
    fig.suptitle("Which estimators are biased, for which target?", fontsize=11)
    return fig


def variance_figure(results: pd.DataFrame) -> Figure:
    """Variance tr Cov(g) of one batch's gradient and MSE against the per-token target, in units of ‖g_tok‖²."""
    labels = _labels(results)
    fig = Figure(figsize=(12, 3.9), dpi=100, layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    y = np.arange(len(labels))
    norm2 = _val(results, "-", "target_norm", "per_token") ** 2
    panels = [("variance", "-", "variance  tr Cov(g) ÷ ‖g_tok‖²"),
              ("mse", "per_token", "MSE against the per-token target ÷ ‖g_tok‖²")]
    for ax, (metric, target, title) in zip(axes, panels):
        for i, lab in enumerate(labels):
            r = _iv(results, lab, metric, target)
            v, lo, hi = r["value"] / norm2, r["lo"] / norm2, r["hi"] / norm2
            ax.barh(i, v, color=_color(lab), alpha=0.75)
            ax.errorbar(v, i, xerr=[[max(v - lo, 0)], [max(hi - v, 0)]], fmt="none", color="black", lw=1, capsize=2)
        ax.set_xscale("log")
        ax.set_title(title, fontsize=10.5)
        ax.grid(True, axis="x", alpha=0.3, which="both")
    axes[0].set_yticks(y, [pretty(lab) for lab in labels])
    axes[0].invert_yaxis()
    fig.suptitle("How noisy is one batch's gradient? (log scale; bars: 95% bootstrap intervals)", fontsize=11)
    return fig


def variance_reduction_figure(results: pd.DataFrame) -> Figure:
    """Var(OPD) ÷ Var(vOPD top-k) against k, with the full-vocabulary baseline as a band and 1 (no gain) marked;
    right: the student's probability mass inside its top-k (what the truncated baseline sees)."""
    rows = results[(results["metric"] == "variance_reduction") & results["variant"].str.startswith("vopd_top")]
    rows = rows.sort_values("k")
    fig = Figure(figsize=(12, 3.9), dpi=100, layout="constrained")
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    V = int(results["vocab_size"].iloc[0])
    full = _iv(results, "vopd", "variance_reduction")
    top = max([1.0, *rows["hi"], *([full["hi"]] if full else [])]) * 1.15
    if full:
        ax.axhline(full["value"], color=_color("vopd"), lw=1.6, label=f"vOPD, full vocabulary (k = V = {V})")
        ax.axhspan(full["lo"], full["hi"], color=_color("vopd"), alpha=0.12, lw=0)
    if not rows.empty:
        ax.plot(rows["k"], rows["value"], "-o", color=_color("vopd_top"), lw=1.8, ms=4, label="vOPD top-k baseline")
        ax.fill_between(rows["k"], rows["lo"], rows["hi"], color=_color("vopd_top"), alpha=0.15, lw=0)
    if full:
        ax.plot([V], [full["value"]], "*", color=_color("vopd"), ms=11)
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="1 = no reduction (vanilla OPD)")
    ks = sorted({*rows["k"], V}) if not rows.empty else [V]
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.set_xticks(ks, [f"{int(k)}" for k in ks])
        a.xaxis.set_minor_locator(NullLocator())
        a.grid(True, alpha=0.3)
    ax.set_xlabel("k (student's top-k tokens used for the baseline)")
    ax.set_ylabel("Var(OPD) ÷ Var(estimator)")
    ax.set_title("variance reduction factor (95% bootstrap interval, joint resampling)", fontsize=10.5)
    ax.legend(frameon=False, fontsize=8.5, loc="lower right")
    ax.set_ylim(0, top)
    mass = results[results["metric"] == "student_topk_mass"].sort_values("k")
    ax2.plot([*mass["k"], V], [*mass["value"], 1.0], "-s", color="#444444", lw=1.6, ms=4)
    ax2.set_ylim(0, 1.05)
    ax2.set_xlabel("k")
    ax2.set_title("student's probability mass in its top-k (exact)", fontsize=10.5)
    fig.suptitle("What does a top-k baseline keep?", fontsize=11)
    return fig
