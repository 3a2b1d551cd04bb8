"""On-policy distillation from a real teacher: a small student transformer trained on its own samples against a
frozen, larger teacher transformer, with any estimator of the distillation family (``lab.estimators.distillation``:
vanilla OPD, vOPD with the full or top-k baseline, the full-vocabulary and the top-k KL losses).

Setting. A task env (``toy_envs.tasks``; chain sums of ``difficulty`` steps by default, T = 2 answer tokens) whose
response vocabulary is widened to V = 10 + ``distractors`` tokens that no answer holds (see ``toy_envs.tasks``:
the prompt's symbols, then fresh ids; the transformer's embedding grows to fit): V changes what the baselines and
the KL losses sum over, and what they cost, while the task, its answers and the teacher's skill stay the same. The
teacher is a ``teacher_size`` transformer given a supervised warm start to an exact accuracy of ``teacher_accuracy``
on the training prompts (``lab.pretrain``: accuracy = mean_x pi(a*(x) | x)); trained on the widened vocabulary, it
learns to put almost no mass on the distractors. The student is a smaller ``student_size`` transformer warm-started
the same way to ``student_accuracy`` (the student-teacher gap), or drawn at random (``student_accuracy`` = 0, logits
of scale ``init_scale``). Warm starts are trained on the CPU and cached per user, whatever ``device`` the run uses.

One step (one row of the table): ``batch_size`` prompts drawn uniformly from the training prompts, one response each
sampled from the current student (``TransformerPolicy.generate``, float32, KV cache), the teacher's logits at every
visited state, the estimator's loss (``loss_agg_mode``, verl's token-mean by default) and one Adam step (``lr``).
Columns, by what they describe:

- the batch, at the parameters that sampled it (before the update): ``kl_token``, the reverse KL per token
  mean_t KL(pi_S(.|s_t) || pi_T(.|s_t)), exact at each visited state over the full vocabulary; the sampled-token
  reward r_t = log pi_T(y_t|s_t) - log pi_S(y_t|s_t) decomposed exactly per state: ``reward_m2`` = mean_t E[r_t^2|s_t],
  ``reward_var_within`` = mean_t Var(r_t|s_t) = mean_t (E[r_t^2|s_t] - KL_t^2) and ``value_share`` = mean_t KL_t^2 /
  mean_t E[r_t^2|s_t], the share of the reward's second moment that is the state's value V(s_t) = -KL_t (what vOPD's
  baseline removes; 1 / (1 - value_share) is the factor by which it shrinks the coefficient's second moment);
  ``distractor_mass`` and ``teacher_distractor_mass``, the probability on the distractors, ``topk_mass``, the
  student's probability on its own top-``top_k`` tokens, and ``kl_topk_token``, the KL between student and teacher
  both renormalised there (the top-k baseline's estimate of KL_t, exact per state); ``loss``, ``grad_norm``
  and the estimator's own metrics (``est_<name>``);
- the parameters after the update: ``accuracy`` and ``greedy_accuracy`` on the training prompts and
  ``heldout_accuracy`` (exact, ``lab.pretrain.accuracies``); every ``eval_every`` updates (and at the last), the
  sequence-level reverse KL(pi_S(y|x) || pi_T(y|x)) averaged over the first ``eval_prompts`` held-out prompts,
  ``kl_seq`` with a 95% interval [``kl_seq_lo``, ``kl_seq_hi``], and the same over as many training prompts
  (``kl_seq_train*``: what the run optimises, beside what generalises): exact by enumerating the response prefixes
  when eval_prompts x V^(T-1) <= ``enum_limit`` (``kl_seq_exact`` true on every row, lo = hi; ``sequence_kl``), else
  ``eval_samples`` responses per prompt from the student, each scored by sum_t KL_t along it (the chain rule makes
  it unbiased for the sequence KL, with less variance than log pi_S(y) - log pi_T(y)), with a normal interval
  stratified by prompt;
- gradient noise, at updates grad_every, 2 grad_every, ... at the parameters before the update (not at the start,
  which runs of every estimator with the same seed share): ``probe_size`` fresh responses
  (their own random stream, so the training trajectory does not depend on it) and, for every estimator in
  ``probe_estimators`` on the SAME responses, per-response gradients of its loss (``lab.engine.gradients``: vmap of
  grad over responses with torch.func). With fixed-length responses every aggregation mode averages per-response
  terms, so the variance of a training batch's gradient is ``gvar_<name>`` = tr Cov(g_i) / batch_size, tr Cov the
  unbiased sample covariance trace over the probe; ``gnorm2_<name>`` = ||mean g||^2 - tr Cov / probe_size is an
  unbiased estimate of the squared norm of its expectation (the signal). ``gvar`` is the trained estimator's;
- wall-clock seconds: ``sample_s`` (the student's sampler), ``teacher_s`` (the teacher's forward pass), ``update_s``
  (the student's forward, the loss, backward and Adam) and ``step_s``, their sum (probes and evaluation excluded).

Every column but the wall-clock ones (``*_s``) is identical for the same config and seed on the CPU; ``device``
cuda runs the networks on the GPU (the sampler's uniforms still come from the CPU generator).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import pandas as pd
import torch

import toy_envs
from lab.configs import check_types, check_unique
from lab.runs import check_cache_dir
from lab.engine.batches import Batch
from lab.engine.estimator import Estimator
from lab.engine.gradients import replicate_gradients
from lab.engine.training import TrainResult
from lab.errors import LabError
from lab.estimators.aggregation import check_mode
from lab.estimators.distillation import topk_reverse_kl
from lab.policies import check_device, init_params, log_probs_of
from lab.policies.transformer import SIZES, TransformerPolicy
from lab.pretrain import accuracies, pretrain
from lab.progress import bar
from lab.seeding import generator

FAMILY = ("opd", "vopd", "vopd_topk", "kl_full", "kl_topk")  # the distillation family, in the report's order
TOPK = ("vopd_topk", "kl_topk")
TIME_COLUMNS = ("sample_s", "teacher_s", "update_s", "step_s")  # wall clock: the only columns seeds do not fix
DIGITS = 10  # the tasks' answer tokens: ids 0..9; ids from 10 on are distractors
Z95 = 1.959963984540054


@dataclass
class DistillConfig:
    """One on-policy distillation run. Every field has a default: ``distil(DistillConfig())`` runs in seconds once
    its warm starts are cached."""

    env: str = "chain3"
    """task env preset (chain, sorting or addition; see `lab envs`)"""
    difficulty: int = 2
    """the task's difficulty (chain: steps, = the response length T)"""
    n_prompts: int = 256
    """training prompts (chain sums of 2 steps have 1,000 problems; 64 are held out)"""
    distractors: int = 0
    """wrong tokens added to the response vocabulary: V = 10 + distractors (toy_envs.tasks)"""
    teacher_size: str = "medium"
    """the teacher's transformer size (lab.policies.transformer.SIZES)"""
    teacher_accuracy: float = 0.95
    """the teacher's supervised warm start: exact accuracy mean_x pi(a*|x) on the training prompts"""
    student_size: str = "small"
    """the student's transformer size"""
    student_accuracy: float = 0.3
    """the student's warm start accuracy (the student-teacher gap); 0: a random student"""
    init_scale: float = 1.0
    """a random student's logit scale (lab.policies.transformer init_params)"""
    pretrain_seed: int = 0
    """seed of both warm starts (cached per user)"""
    estimator: str = "vopd"
    """the trained estimator: opd | vopd | vopd_topk | kl_full | kl_topk"""
    hyper: dict = field(default_factory=dict, metadata={"parse": "pairs"})
    """the trained estimator's hyper-parameters over its registry defaults (e.g. return_to_go=true for opd)"""
    top_k: int = 4
    """k of vopd_topk and kl_topk, trained or probed (the vOPD release's 100 is a tiny share of its vocabulary)"""
    loss_agg_mode: str = "token-mean"
    """loss aggregation mode of every estimator"""
    batch_size: int = 128
    """responses per step (prompts drawn uniformly with replacement, one response each)"""
    steps: int = 40
    """optimiser steps"""
    lr: float = 1e-3
    """Adam learning rate (betas 0.9 / 0.999)"""
    grad_every: int = 10
    """measure the gradient variance every this many steps (0: never)"""
    probe_size: int = 64
    """responses of a gradient-variance probe"""
    probe_estimators: list = field(default_factory=lambda: list(FAMILY), metadata={"parse": "list"})
    """estimators whose gradient variance each probe measures on the same responses"""
    eval_every: int = 10
    """held-out sequence KL every this many steps (and after the last)"""
    eval_prompts: int = 16
    """held-out prompts of the sequence KL (the task's first ones)"""
    eval_samples: int = 16
    """responses per held-out prompt when the sequence KL is sampled"""
    enum_limit: int = 4096
    """largest eval_prompts x V^(T-1) (response prefixes) for which the sequence KL is exact by enumeration"""
    device: str = "cpu"
    """where the networks run: cpu | cuda"""
    seed: int = 0
    """seed of the run's sampling, probes and a random student's init"""

    def make_env(self):
        return toy_envs.make(self.env, difficulty=self.difficulty, n_prompts=self.n_prompts,
                             distractors=self.distractors)

    def hyper_of(self, name: str) -> dict:
        """The hyper-parameters ``name`` runs with: top_k for the top-k estimators, ``hyper`` for the trained one."""
        out = {"k": self.top_k} if name in TOPK else {}
        return {**out, **self.hyper} if name == self.estimator else out

    def resolved(self, name: str | None = None) -> Estimator:
        name = name or self.estimator
        return Estimator.resolve(name, self.hyper_of(name), self.loss_agg_mode)

    def validate(self) -> None:
        """Check every field; raises LabError with one sentence for bad input."""
        check_types(self)
        check_cache_dir()  # the teacher and the student start from cached warm starts
        if not isinstance(toy_envs.make(self.env), toy_envs.Task):
            raise LabError(f"env {self.env!r} is not a task env; distillation needs one of "
                           f"{', '.join(toy_envs.tasks.names())}")
        env = self.make_env()
        for name in ("teacher_size", "student_size"):
            if getattr(self, name) not in SIZES:
                raise LabError(f"unknown {name.replace('_', ' ')} {getattr(self, name)!r}; choose one of "
                               f"{', '.join(SIZES)}")
        if not 0 < self.teacher_accuracy < 1:
            raise LabError(f"teacher_accuracy must lie strictly between 0 and 1, got {self.teacher_accuracy}")
        if not 0 <= self.student_accuracy < 1:
            raise LabError(f"student_accuracy must lie in [0, 1) (0: a random student), got {self.student_accuracy}")
        if not (math.isfinite(self.init_scale) and self.init_scale >= 0):
            raise LabError(f"init_scale must be a finite non-negative number, got {self.init_scale}")
        self._validate_estimators()
        for name in ("batch_size", "steps", "eval_every", "eval_prompts", "eval_samples"):
            if getattr(self, name) < 1:
                raise LabError(f"{name} must be a positive whole number, got {getattr(self, name)}")
        if self.grad_every < 0 or self.probe_size < 2 or self.enum_limit < 0:
            raise LabError("grad_every and enum_limit must be non-negative and probe_size at least 2")
        if self.eval_prompts > env.n_heldout:
            raise LabError(f"eval_prompts {self.eval_prompts} exceeds the task's {env.n_heldout} held-out or "
                           f"{env.n_prompts} training prompts")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise LabError(f"learning rate must be a positive number, got {self.lr}")
        check_device(self.device)

    def _validate_estimators(self) -> None:
        for name in [self.estimator, *self.probe_estimators]:
            if name not in FAMILY:
                raise LabError(f"estimator {name!r} is not a distillation estimator; choose one of {', '.join(FAMILY)}")
        check_unique("probe_estimators", self.probe_estimators)
        if isinstance(self.top_k, bool) or self.top_k < 1:
            raise LabError(f"top_k must be a positive whole number, got {self.top_k!r}")
        check_mode(self.loss_agg_mode)
        for name in {self.estimator, *self.probe_estimators}:
            self.resolved(name)


# ---- the pieces ---------------------------------------------------------------------------------------------------

@dataclass
class Setup:
    """The env, the frozen teacher and the student's starting point, all on ``device``."""

    env: toy_envs.Task
    teacher: TransformerPolicy
    theta_teacher: torch.Tensor
    student: TransformerPolicy
    theta0: torch.Tensor
    info: dict  # warm-start accuracies and sizes, for the summary


def make_setup(cfg: DistillConfig, progress=None) -> Setup:
    """Warm-start (or read from the cache) the teacher and the student, and place both on the run's device."""
    env, dev = cfg.make_env(), torch.device(cfg.device)
    t_ck = pretrain(env, cfg.teacher_size, cfg.teacher_accuracy, seed=cfg.pretrain_seed, progress=progress)
    teacher = TransformerPolicy.for_env(env, cfg.teacher_size)
    student = TransformerPolicy.for_env(env, cfg.student_size)
    info = {"teacher_params": teacher.n_params, "student_params": student.n_params,
            "teacher_accuracy": t_ck.accuracy, "teacher_heldout_accuracy": t_ck.heldout_accuracy}
    if cfg.student_accuracy > 0:
        s_ck = pretrain(env, cfg.student_size, cfg.student_accuracy, seed=cfg.pretrain_seed, progress=progress)
        theta0 = s_ck.theta
    else:
        theta0 = init_params(student, cfg.init_scale, generator(cfg.seed, 0), dtype=torch.float32)
    return Setup(env, teacher, t_ck.theta.float().to(dev), student, theta0.float().to(dev), info)


def random_setup(cfg: DistillConfig) -> Setup:
    """Teacher and student at random initial parameters (logit scale ``init_scale``), no warm start: what a step
    costs does not depend on the weights, so timings need no pretraining."""
    env, dev = cfg.make_env(), torch.device(cfg.device)
    teacher = TransformerPolicy.for_env(env, cfg.teacher_size)
    student = TransformerPolicy.for_env(env, cfg.student_size)
    thetas = [init_params(p, cfg.init_scale, generator(cfg.seed, 0, i), dtype=torch.float32).to(dev)
              for i, p in enumerate((teacher, student))]
    return Setup(env, teacher, thetas[0], student, thetas[1], {"teacher_params": teacher.n_params,
                                                               "student_params": student.n_params})


def state_terms(logits: torch.Tensor, teacher_logits: torch.Tensor, k: int = 1) -> dict:
    """Exact per-state quantities at visited states [..., V] (float64): KL_t, E[r_t^2|s_t], the student's mass on the
    distractors and on its top-k tokens, the teacher's mass on the distractors."""
    lp, lq = torch.log_softmax(logits.double(), -1), torch.log_softmax(teacher_logits.double(), -1)
    p, r = lp.exp(), lq - lp
    return {"kl": -(p * r).sum(-1), "m2": (p * r * r).sum(-1), "distractor_mass": p[..., DIGITS:].sum(-1),
            "topk_mass": p.topk(min(k, p.shape[-1]), dim=-1).values.sum(-1),
            "kl_topk": topk_reverse_kl(lp, lq, k)[0], "teacher_distractor_mass": lq[..., DIGITS:].exp().sum(-1)}


def batch_metrics(logits: torch.Tensor, teacher_logits: torch.Tensor, k: int) -> dict:
    """Token means of ``state_terms`` over a batch: kl_token, the reward's second moment split into the state's
    value and the within-state variance, value_share = mean KL_t^2 / mean E[r_t^2|s_t], and the masses."""
    s = state_terms(logits, teacher_logits, k)
    m2, kl2 = float(s["m2"].mean()), float((s["kl"] ** 2).mean())
    return {"kl_token": float(s["kl"].mean()), "reward_m2": m2, "reward_var_within": m2 - kl2,
            "value_share": kl2 / m2 if m2 > 0 else math.nan,
            "kl_topk_token": float(s["kl_topk"].mean()), "distractor_mass": float(s["distractor_mass"].mean()),
            "topk_mass": float(s["topk_mass"].mean()),
            "teacher_distractor_mass": float(s["teacher_distractor_mass"].mean())}


@torch.no_grad()
def sequence_kl(cfg: DistillConfig, setup: Setup, theta: torch.Tensor, table: torch.Tensor,
                gen: torch.Generator) -> tuple[float, float, float, bool]:
    """KL(pi_S(y|x) || pi_T(y|x)) averaged over the prompts ``table`` [n, P], with a 95% interval: (value, lo, hi,
    exact). By the chain rule KL_seq(x) = sum_t E_{y_<t ~ pi_S}[KL_t(x, y_<t)], so enumerating the V^(T-1) prefixes
    y_<T (the last token is never conditioned on) gives it exactly: every state at depth t is shared by V^(T-t) of
    them, weighted pi_S(y_<t) / V^(T-t). Exact when n V^(T-1) <= enum_limit (networks in float32, sums in float64),
    else sum_t KL_t along ``eval_samples`` sampled responses per prompt, with a normal interval stratified by prompt."""
    n, V, T = table.shape[0], setup.env.vocab_size, setup.env.length
    student, teacher = setup.student.with_prompts(table), setup.teacher.with_prompts(table)
    if n * V ** (T - 1) <= cfg.enum_limit:
        free = torch.cartesian_prod(*[torch.arange(V)] * (T - 1)).reshape(-1, T - 1) if T > 1 else \
            torch.zeros(1, 0, dtype=torch.long)
        grid = torch.cat([free, torch.zeros(free.shape[0], 1, dtype=torch.long)], 1)  # the last token: a dummy
        prompts, tokens = torch.arange(n).repeat_interleave(grid.shape[0]), grid.repeat(n, 1)
        share = float(V) ** (T - 1 - torch.arange(T, dtype=torch.float64))  # V^(T-t) for t = 1..T
        kl = 0.0
        for c in torch.arange(prompts.shape[0]).split(4096):  # bounded memory
            logits = student.logits(theta, prompts[c], tokens[c])
            kl_t = state_terms(logits, teacher.logits(setup.theta_teacher, prompts[c], tokens[c]))["kl"].cpu()
            lp = log_probs_of(logits, tokens[c]).double().cpu()
            prefix = torch.cat([torch.zeros(lp.shape[0], 1, dtype=torch.float64), lp[:, :-1].cumsum(-1)], 1)
            kl += float((prefix.exp() * kl_t / share).sum())
        return kl / n, kl / n, kl / n, True
    m = cfg.eval_samples
    prompts = torch.arange(n).repeat_interleave(m)
    tokens, _, _ = student.generate(theta, prompts, gen)
    per = state_terms(student.logits(theta, prompts, tokens),
                      teacher.logits(setup.theta_teacher, prompts, tokens))["kl"].sum(-1).cpu().reshape(n, m)
    mean = float(per.mean())
    se = float(per.var(dim=1).sum().sqrt()) / (n * math.sqrt(m))
    return mean, mean - Z95 * se, mean + Z95 * se, False


def evaluate(cfg: DistillConfig, setup: Setup, theta: torch.Tensor, gen: torch.Generator) -> dict:
    """The sequence KL on the first eval_prompts held-out prompts (kl_seq*) and training prompts (kl_seq_train*)."""
    env, n = setup.env, cfg.eval_prompts
    out = {}
    for key, table in (("kl_seq", env.heldout_prompt_tokens[:n]), ("kl_seq_train", env.prompt_tokens[:n])):
        value, lo, hi, exact = sequence_kl(cfg, setup, theta, table, gen)
        out.update({key: value, f"{key}_lo": lo, f"{key}_hi": hi})
    return out


def gradient_probe(cfg: DistillConfig, setup: Setup, theta: torch.Tensor, gen: torch.Generator) -> dict:
    """gvar_<name> = tr Cov(per-response gradient) / batch_size and gnorm2_<name> = ||mean||^2 - tr Cov / M for every
    probe estimator, on the same M = probe_size fresh responses from the student at ``theta``."""
    env, M, T = setup.env, cfg.probe_size, setup.env.length
    prompts = torch.randint(env.n_prompts, (M,), generator=gen)
    tokens, lp_mu, _ = setup.student.generate(theta, prompts, gen)
    with torch.no_grad():
        t_logits = setup.teacher.logits(setup.theta_teacher, prompts, tokens).cpu()
    tokens, mask = tokens.cpu(), torch.ones(M, T)
    batch = Batch(prompts[:, None], tokens[:, None], mask[:, None], lp_mu.cpu()[:, None], torch.zeros(M, 1), 1)
    extras = {"teacher_log_prob": log_probs_of(t_logits, tokens)[:, None], "teacher_logits": t_logits[:, None]}
    out = {}
    for name in cfg.probe_estimators:
        g, _ = replicate_gradients(setup.student, theta.detach(), batch, torch.zeros(M, 1, T), cfg.resolved(name),
                                   extras)
        g = g.double()
        mean = g.mean(0)
        tr_cov = float(((g - mean) ** 2).sum()) / (M - 1)
        out[f"gvar_{name}"] = tr_cov / cfg.batch_size
        out[f"gnorm2_{name}"] = float(mean @ mean) - tr_cov / M
    return out


def _sync(device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# ---- the run ------------------------------------------------------------------------------------------------------

class Run:
    """One run's state: the student's parameters, Adam, the random streams and the rows; ``step(u)`` is one update
    (what ``distil`` loops over, and what benchmarks/bench_real_distillation.py times)."""

    def __init__(self, cfg: DistillConfig, setup: Setup):
        self.cfg, self.setup, self.env = cfg, setup, setup.env
        self.dev = setup.theta0.device
        self.theta = setup.theta0.clone().requires_grad_(True)
        self.opt = torch.optim.Adam([self.theta], lr=cfg.lr)
        self.loss_fn = cfg.resolved().ascent_loss()
        self.sample_gen, self.probe_gen = generator(cfg.seed, 1), generator(cfg.seed, 3)
        self.rows = []

    def eval_gen(self, u: int) -> torch.Generator:
        return generator(self.cfg.seed, 4, u)  # one stream per evaluation: independent of how often it runs

    def accuracy(self) -> dict:
        env, th = self.env, self.theta.detach()
        acc, greedy = accuracies(self.setup.student, th, env.prompt_tokens, env.answers)
        held = accuracies(self.setup.student, th, env.heldout_prompt_tokens, env.heldout_answers)[0]
        return {"accuracy": acc, "greedy_accuracy": greedy, "heldout_accuracy": held}

    def step(self, u: int) -> None:
        cfg, s = self.cfg, self.setup
        row = {"update": u}
        if cfg.grad_every and u % cfg.grad_every == 0:
            row.update(gradient_probe(cfg, s, self.theta.detach(), self.probe_gen))
            row["gvar"] = row.get(f"gvar_{cfg.estimator}", math.nan)
        t0 = _sync(self.dev)
        prompts = torch.randint(self.env.n_prompts, (cfg.batch_size,), generator=self.sample_gen)
        tokens, lp_mu, _ = s.student.generate(self.theta.detach(), prompts, self.sample_gen)
        t1 = _sync(self.dev)
        with torch.no_grad():
            t_logits = s.teacher.logits(s.theta_teacher, prompts, tokens)
            t_lp = log_probs_of(t_logits, tokens)
        t2 = _sync(self.dev)
        mask = torch.ones(tokens.shape, device=self.dev)
        logits = s.student.logits(self.theta, prompts, tokens)
        value, metrics = self.loss_fn(logits, tokens, mask, lp_mu, torch.zeros_like(mask),
                                      {"teacher_log_prob": t_lp, "teacher_logits": t_logits})
        loss = -value
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(self.theta.grad.norm())
        self.opt.step()
        t3 = _sync(self.dev)
        row.update(batch_metrics(logits.detach(), t_logits, cfg.top_k))
        row.update(loss=float(loss.detach()), grad_norm=grad_norm, **{f"est_{k}": float(v) for k, v in metrics.items()})
        row.update(self.accuracy())
        if u % cfg.eval_every == 0 or u == cfg.steps:
            row.update(evaluate(cfg, s, self.theta.detach(), self.eval_gen(u)))
        row["kl_seq_exact"] = cfg.eval_prompts * self.env.vocab_size ** (self.env.length - 1) <= cfg.enum_limit
        row.update(sample_s=t1 - t0, teacher_s=t2 - t1, update_s=t3 - t2, step_s=t3 - t0)
        if not math.isfinite(row["loss"]) or not math.isfinite(grad_norm):
            raise LabError(f"{cfg.estimator} produced a non-finite loss or gradient at step {u}; lower the "
                           f"learning rate")
        self.rows.append(row)


def distil(cfg: DistillConfig, progress: bool | None = None) -> TrainResult:
    """Train the student on-policy against the frozen teacher; a TrainResult whose table has one row per step (see
    the module doc) and a summary of JSON scalars with a "headline". Deterministic given the config (wall-clock
    columns aside) on the CPU."""
    cfg.validate()
    setup = make_setup(cfg, progress)
    run = Run(cfg, setup)
    initial = {**run.accuracy(), **evaluate(cfg, setup, run.theta.detach(), run.eval_gen(0))}
    with bar(cfg.steps, f"distil {cfg.estimator} V={setup.env.vocab_size}", progress) as b:
        for u in range(1, cfg.steps + 1):
            run.step(u)
            b.update(1)
    table = pd.DataFrame(run.rows)
    for name, value in (("seed", cfg.seed), ("vocab_size", setup.env.vocab_size),
                        ("student_accuracy", cfg.student_accuracy), ("estimator", cfg.estimator),
                        ("env", setup.env.name)):
        table.insert(0, name, value)
    return TrainResult(cfg, table, summarise(cfg, setup, table, initial))


def summarise(cfg: DistillConfig, setup: Setup, table: pd.DataFrame, initial: dict) -> dict:
    """The run's headline numbers: JSON scalars and a "headline" line."""
    last = table.iloc[-1]
    probes = table.dropna(subset=["gvar"]) if "gvar" in table else table.iloc[:0]
    ratio = (probes["gvar_opd"] / probes["gvar_vopd"]) if {"gvar_opd", "gvar_vopd"} <= set(table) else None
    summary = {
        "study": "distill", "env": setup.env.name, "estimator": cfg.estimator, "seed": cfg.seed,
        "vocab_size": setup.env.vocab_size, "distractors": cfg.distractors, "student_accuracy": cfg.student_accuracy,
        "length": setup.env.length, "loss_agg_mode": cfg.resolved().loss_agg_mode, "updates": int(len(table)),
        "teacher_size": cfg.teacher_size, "student_size": cfg.student_size, **setup.info,
        "initial_accuracy": initial["accuracy"], "initial_heldout_accuracy": initial["heldout_accuracy"],
        "initial_kl_seq": initial["kl_seq"], "initial_kl_seq_train": initial["kl_seq_train"],
        "final_kl_seq_train": float(last["kl_seq_train"]), "final_accuracy": float(last["accuracy"]),
        "final_heldout_accuracy": float(last["heldout_accuracy"]), "final_kl_seq": float(last["kl_seq"]),
        "final_kl_seq_lo": float(last["kl_seq_lo"]), "final_kl_seq_hi": float(last["kl_seq_hi"]),
        "kl_seq_exact": bool(last["kl_seq_exact"]), "initial_kl_token": float(table["kl_token"].iloc[0]),
        "final_kl_token": float(last["kl_token"]), "mean_value_share": float(table["value_share"].mean()),
        "median_step_s": float(table["step_s"].median()), "median_update_s": float(table["update_s"].median()),
        "median_sample_s": float(table["sample_s"].median()),
        "median_teacher_s": float(table["teacher_s"].median()),
        "mean_gvar": float(probes["gvar"].mean()) if len(probes) else math.nan,
        "mean_gvar_ratio_opd_vopd": float(ratio.mean()) if ratio is not None and len(probes) else math.nan,
    }
    summary["headline"] = (f"{cfg.estimator} on {setup.env.name} (V = {setup.env.vocab_size}, student "
                           f"{cfg.student_size} from accuracy {initial['accuracy']:.2f}, teacher {cfg.teacher_size} "
                           f"at {setup.info['teacher_accuracy']:.2f}): held-out sequence KL {initial['kl_seq']:.3g} -> "
                           f"{summary['final_kl_seq']:.3g} in {len(table)} steps, "
                           f"{1e3 * summary['median_step_s']:.0f} ms per step")
    return summary
