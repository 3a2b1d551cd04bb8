"""The training simulator: train a policy on a toy env with any registered estimator, under the staleness regimes
practitioners meet: synchronous mini-batching (VESPO's N), asynchronous lag bounded by eta (AReaL's
max_head_offpolicyness; TRL AsyncGRPO drops, tinker requeues) and a mismatched sampler (decoupled three-policy
batches).

One rollout = ``rollout_batch`` responses (``rollout_batch / group_size`` prompts drawn uniformly, ``group_size``
responses each), rewards, group advantages (lab.advantages) computed once over the whole rollout. The rollout is
then consumed in ``minibatches`` = N contiguous slices (no shuffling), each ONE optimiser step (Adam; one backward
pass on the batch loss of the slice), for ``epochs`` passes. ``steps`` counts rollouts, so a run makes
``steps * N * epochs`` optimiser updates; the parameters after u updates are "version u".

Regimes (what mu, pi_old and pi are):

- ``sync``: the rollout is sampled by the current version v; pi_old = mu = version v (the trainer's recomputed
  log-probs, identical to the sampler's). Mini-batch j of epoch e is updated at version v + e N + j: it is e N + j
  updates stale (VESPO's staleness N). Two-policy batch: the estimator sees old_log_prob = log mu.
- ``async``: every group of ``group_size`` responses carries the version that generated it. Its lag at the start of
  the rollout's consumption is drawn from ``lag_dist`` on 0..``lag_max`` (uniform, geometric with success
  probability ``lag_p`` truncated at lag_max, or constant lag_max) and cut to the versions that exist (at most v).
  A group whose lag exceeds ``eta`` (AReaL's max_head_offpolicyness) is over-stale; ``over_stale`` says what happens:
  ``drop`` discards it and draws a fresh group (new prompt, new lag) until the rollout is full (TRL AsyncGRPO),
  ``requeue`` regenerates its prompt with the current version, lag 0 (tinker), ``keep`` trains on it anyway.
  Two-policy batch: old_log_prob = the generating version's log-probs, so the estimator's ratio pi / mu corrects
  the lag; mini-batching adds e N + j on top.
- ``mismatch``: ``sync`` with a perturbed sampler (train/inference mismatch, decoupled three-policy batch). The
  sampler mu draws tokens from softmax(logits / ``sampler_temperature`` + ``logprob_noise`` z + f e) and records its
  own log-probs: z ~ N(0, 1) fresh for every (response, position, token) (other kernels / precision); f ~
  Bernoulli(``router_flip_p``) per (response, position) switches in an alternative "expert" e: the logits of the
  same policy at a second, random parameter set (``init_params(router_scale)``, drawn once per run; for tabular
  policies a fixed logit offset table ~ N(0, ``router_scale``^2)): MoE routing that flips. pi_old = the trainer's version v
  (recomputed log-probs), pi = the current parameters. Estimators that list ``rollout_log_probs`` in their
  ``optional_inputs`` (TIS, MIS, VESPO) receive mu's log-probs; the others see only pi / pi_old, as in a trainer that
  ignores the mismatch.

Per-update metrics (one row per optimiser update of the tidy table ``TrainResult.table``): the exact expected
reward J of the parameters after the update (float64, by enumeration), the sampled mean reward of the mini-batch,
KL(pi || pi_0) per prompt and the per-token entropy of pi (exact, float64), the loss and the gradient norm, the
version lag of the mini-batch (min / mean / max over responses), the sampled weight diagnostics of pi against the
sampler mu (Kish ESS fraction, ``chi2_seq_sampled`` = the batch's mean W^2 - 1 of the sequence weight, k3 token
KL, PSIS k-hat (NaN below 25 responses per mini-batch or with equal weights), mean |log pi_old - log mu|),
the estimator's own metrics as ``est_<name>`` (clip, truncation and mask fractions among them), and the collapse flag.

Collapse rule (``collapse_flags``), evaluated after every update u; J_lo, J_hi are the lowest and highest
achievable expected rewards (per prompt min / max of E[R|x, y] over responses, averaged over prompts):
  (a) non-finite: the loss, the gradient norm, a parameter or an exact metric is NaN or infinite; or
  (b) reward collapse: u >= ``collapse_warmup`` and J_best(u) - J(u) > ``collapse_drop`` (J_hi - J_lo), with J_best(u)
      the best J so far: the run gave back more than that fraction of the achievable range; or
  (c) entropy collapse: per-token entropy < ``entropy_floor`` log V while J(u) < J_lo + 1/2 (J_hi - J_lo): the policy
      became near-deterministic on a poor answer.
The summary gives the first collapsed update (1-based, as in the table's ``update`` column) or None. A run whose
parameters become non-finite stops after that update (``summary["stopped_early"]``): nothing can be sampled from them.

Identity that must hold: in ``sync`` with N = 1, one epoch and no mismatch, pi = pi_old = mu at every update
(delta_t = 0 exactly), so every ratio-based estimator's gradient equals REINFORCE's and, with the same seed, the
parameter trajectories agree (the tests check it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

import toy_envs
from lab import advantages as adv_mod
from lab import diagnostics
from lab.configs import check_types
from lab.engine.estimator import Estimator
from lab.engine.exact import Problem, Support, objective
from lab.errors import LabError
from lab.policies import init_params, make_policy, sample, sequence_log_probs, token_log_probs
from lab.progress import bar
from lab.seeding import generator

REGIMES = ("sync", "async", "mismatch")
LAG_DISTS = ("uniform", "geometric", "constant")
OVER_STALE = ("drop", "requeue", "keep")
PROVIDED_INPUTS = ("rewards", "group_size", "logits", "rollout_log_probs")  # extra estimator inputs training provides
MAX_DROP_DRAWS = 1000  # group draws per needed group before ``drop`` gives up


@dataclass
class TrainConfig:
    """One training run. Every field has a default: ``train(TrainConfig())`` runs in seconds."""

    env: str = "tiny_target"
    """toy env preset (see `lab envs`)"""
    env_overrides: dict = field(default_factory=dict, metadata={"flag": "--set", "parse": "pairs"})
    """env fields to change, e.g. length=3"""
    policy: str = "prefix"
    """prefix (any sequence distribution) | markov"""
    init_scale: float = 0.5
    """initial logits ~ N(0, init_scale^2)"""
    estimator: str = "reinforce"
    """any policy-gradient estimator (see `lab estimators`)"""
    hyper: dict = field(default_factory=dict, metadata={"parse": "estimator_pairs"})
    """the estimator's hyper-parameters over its registry defaults (flag: ESTIMATOR.KEY=VALUE)"""
    advantage: str = "rloo"
    """reward | rloo | grpo | drgrpo, over each rollout's groups"""
    group_size: int = 8
    """G responses per prompt"""
    rollout_batch: int = 64
    """responses per rollout (a multiple of G)"""
    minibatches: int = 1
    """N: the rollout is split into N mini-batches, one optimiser step each (N - 1 = max lag)"""
    epochs: int = 1
    """passes over the rollout's mini-batches"""
    lr: float = 0.1
    """Adam learning rate (betas 0.9 / 0.999)"""
    steps: int = 30
    """rollouts; the run makes steps * minibatches * epochs optimiser updates"""
    regime: str = "sync"
    """sync | async | mismatch"""
    lag_dist: str = "uniform"
    """async: distribution of a group's lag on 0..lag_max: uniform | geometric | constant"""
    lag_max: int = 4
    """async: largest lag the distribution draws"""
    lag_p: float = 0.5
    """async: success probability of the geometric lag distribution (P(lag = l) ~ (1-p)^l p)"""
    eta: int = 2
    """async: staleness bound (AReaL max_head_offpolicyness); groups with lag > eta are over-stale"""
    over_stale: str = "drop"
    """async: drop | requeue | keep over-stale groups"""
    logprob_noise: float = 0.0
    """mismatch: std of the sampler's per-token logit noise"""
    sampler_temperature: float = 1.0
    """mismatch: the sampler's temperature"""
    router_flip_p: float = 0.0
    """mismatch: probability, per token, that the sampler routes to the other expert"""
    router_scale: float = 1.0
    """mismatch: scale of the other expert's parameters"""
    loss_agg_mode: str = "token-mean"
    """verl aggregation for every estimator, or native: each one's own default"""
    dtype: str = "float32"
    """trained parameters: float32 | float64 (exact metrics are always float64)"""
    collapse_warmup: int = 5
    """updates before the reward-collapse rule (b) applies"""
    collapse_drop: float = 0.5
    """rule (b): fraction of the achievable reward range lost from the best so far"""
    entropy_floor: float = 0.05
    """rule (c): per-token entropy floor as a fraction of log V"""
    record_params: bool = False
    """keep the parameters after every update in TrainResult.params"""
    seed: int = 0
    """seed of every random stream of the run"""

    def make_env(self):
        return toy_envs.make(self.env, **self.env_overrides)

    def problem(self) -> Problem:
        env = self.make_env()
        return Problem(env, make_policy(self.policy, env))

    def resolved(self) -> Estimator:
        return Estimator.resolve(self.estimator, self.hyper, self.loss_agg_mode)

    def validate(self) -> None:
        """Check every field; raises LabError with one sentence for bad input."""
        check_types(self)
        problem = self.problem()
        env = problem.env
        if env.num_pairs > toy_envs.DEFAULT_ENUM_LIMIT:
            raise LabError(f"env {env.name!r} has {env.num_pairs:,} (prompt, response) pairs; training computes exact "
                           f"metrics by enumeration after every update (at most {toy_envs.DEFAULT_ENUM_LIMIT:,} pairs): "
                           f"choose a smaller env (see `lab envs`)")
        if self.regime not in REGIMES:
            raise LabError(f"unknown regime {self.regime!r}; choose one of {', '.join(REGIMES)}")
        self._validate_sizes(self._validate_estimator())
        self._validate_regime()
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise LabError(f"learning rate must be a positive number, got {self.lr}")
        if not (math.isfinite(self.init_scale) and self.init_scale >= 0):
            raise LabError(f"init scale must be a finite non-negative number, got {self.init_scale}")
        if self.dtype not in ("float32", "float64"):
            raise LabError(f"dtype must be float32 or float64, got {self.dtype!r}")
        if not isinstance(self.collapse_warmup, int) or self.collapse_warmup < 0:
            raise LabError(f"collapse_warmup must be a non-negative whole number, got {self.collapse_warmup!r}")
        if not 0 < self.collapse_drop <= 1 or not 0 <= self.entropy_floor < 1:
            raise LabError("collapse_drop must lie in (0, 1] and entropy_floor in [0, 1)")

    def _validate_estimator(self) -> Estimator:
        est = self.resolved()
        if est.info.family in ("distillation", "kl-penalty"):
            raise LabError(f"estimator {self.estimator!r} ({est.info.family}) does not estimate a reward gradient; "
                           f"train with a policy-gradient estimator (see `lab estimators`)")
        missing = [k for k in est.info.inputs if k not in PROVIDED_INPUTS]
        if missing:
            raise LabError(f"estimator {self.estimator!r} needs {', '.join(missing)}, which training does not provide")
        return est

    def _validate_sizes(self, est: Estimator) -> None:
        for name in ("group_size", "rollout_batch", "minibatches", "epochs", "steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LabError(f"{name} must be a positive whole number, got {value!r}")
        adv_mod.check(self.advantage, self.group_size)
        if self.rollout_batch % self.group_size:
            raise LabError(f"rollout batch {self.rollout_batch} must be a multiple of the group size {self.group_size}")
        if self.rollout_batch % self.minibatches:
            raise LabError(f"{self.minibatches} mini-batches do not divide the rollout batch {self.rollout_batch}; "
                           f"choose a divisor of it")
        mb = self.rollout_batch // self.minibatches
        if est.needs_groups:
            if self.group_size < 2:
                raise LabError(f"estimator {self.estimator!r} needs groups of at least 2 responses per prompt; "
                               f"raise group_size")
            if mb % self.group_size:
                raise LabError(f"estimator {self.estimator!r} needs whole groups in each mini-batch: mini-batch size "
                               f"{mb} is not a multiple of the group size {self.group_size}; use fewer mini-batches")

    def _validate_regime(self) -> None:
        if self.lag_dist not in LAG_DISTS:
            raise LabError(f"unknown lag distribution {self.lag_dist!r}; choose one of {', '.join(LAG_DISTS)}")
        if not isinstance(self.lag_max, int) or self.lag_max < 0:
            raise LabError(f"lag_max must be a non-negative whole number of versions, got {self.lag_max!r}")
        if not isinstance(self.eta, int) or self.eta < 0:
            raise LabError(f"eta (the staleness bound) must be a non-negative whole number, got {self.eta!r}")
        if not 0 < self.lag_p <= 1:
            raise LabError(f"lag_p must lie in (0, 1], got {self.lag_p}")
        if self.over_stale not in OVER_STALE:
            raise LabError(f"unknown over-stale policy {self.over_stale!r}; choose one of {', '.join(OVER_STALE)}")
        if not (math.isfinite(self.logprob_noise) and self.logprob_noise >= 0):
            raise LabError(f"logprob_noise must be a finite non-negative std, got {self.logprob_noise}")
        if not (math.isfinite(self.sampler_temperature) and self.sampler_temperature > 0):
            raise LabError(f"sampler temperature must be positive, got {self.sampler_temperature}")
        if not 0 <= self.router_flip_p <= 1:
            raise LabError(f"router_flip_p is a probability and must lie in [0, 1], got {self.router_flip_p}")
        if not (math.isfinite(self.router_scale) and self.router_scale >= 0):
            raise LabError(f"router_scale must be a finite non-negative std, got {self.router_scale}")
        if self.regime != "mismatch" and (self.logprob_noise or self.sampler_temperature != 1.0 or self.router_flip_p):
            raise LabError(f"sampler perturbations (logprob_noise, sampler_temperature, router_flip_p) apply only to "
                           f"regime 'mismatch', not {self.regime!r}")


@dataclass
class TrainResult:
    config: TrainConfig
    table: pd.DataFrame  # one row per optimiser update
    summary: dict
    params: torch.Tensor | None = None  # [updates + 1, D] parameters after each update (row 0: initial), if recorded


# ------------------------------------------------------------------------------------------------ pieces
def exact_metrics(env, policy, theta, lp0_enum) -> dict:
    """Exact (float64) J, KL(pi || pi_0) per prompt, per-token entropy of pi; ``lp0_enum``: log pi_0 on the support.

    Per-token entropy = H(pi(.|x)) / E_pi[|y|], averaged over prompts; at most log V.
    """
    prompts, tokens, mask = env.enumerate()
    with torch.no_grad():
        lp = sequence_log_probs(policy, theta.detach().double(), prompts, tokens, mask)
    w = torch.exp(lp) / env.n_prompts  # the Support weights of lab.engine.exact.exact_support
    safe = torch.where(w > 0, lp, torch.zeros_like(lp))  # 0 log 0 = 0
    mean_len = float((w * mask.sum(-1)).sum())
    return {"expected_reward": objective(env, Support(prompts, tokens, mask, w, True)),
            "kl_to_init": float((w * (safe - lp0_enum)).sum()),
            "entropy": float(-(w * safe).sum()) / max(mean_len, 1e-12)}


def reward_range(env) -> tuple[float, float]:
    """(J_lo, J_hi): per prompt min / max over responses of E[R|x, y], averaged over prompts (exact)."""
    prompts, tokens, mask = env.enumerate()
    r = env.expected_reward(prompts, tokens, mask).reshape(env.n_prompts, -1)
    return float(r.min(-1).values.mean()), float(r.max(-1).values.mean())


def collapse_flags(expected_reward, entropy, finite, j_lo: float, j_hi: float, vocab_size: int, warmup: int = 5,
                   drop: float = 0.5, entropy_floor: float = 0.05) -> np.ndarray:
    """The collapse rule of the module docstring, per update (arrays in update order): a boolean array."""
    J = np.asarray(expected_reward, dtype=np.float64)
    H = np.asarray(entropy, dtype=np.float64)
    ok = np.asarray(finite, dtype=bool) & np.isfinite(J) & np.isfinite(H)
    span = max(j_hi - j_lo, 1e-12)
    best = np.maximum.accumulate(np.where(ok, J, -np.inf)) if J.size else J
    u = np.arange(J.size)
    with np.errstate(invalid="ignore"):
        reward_collapse = (u >= warmup) & (best - J > drop * span)
        entropy_collapse = (H < entropy_floor * math.log(vocab_size)) & (J < j_lo + 0.5 * span)
    return ~ok | (ok & (reward_collapse | entropy_collapse))


def draw_lags(cfg: TrainConfig, n: int, generator: torch.Generator) -> torch.Tensor:
    """n lags on 0..lag_max from ``cfg.lag_dist`` (long)."""
    if cfg.lag_dist == "constant":
        return torch.full((n,), cfg.lag_max, dtype=torch.long)
    if cfg.lag_dist == "uniform":
        return torch.randint(cfg.lag_max + 1, (n,), generator=generator)
    l = torch.arange(cfg.lag_max + 1, dtype=torch.float64)
    probs = (1 - cfg.lag_p) ** l * cfg.lag_p  # geometric, truncated at lag_max and renormalised
    return torch.multinomial(probs / probs.sum(), n, replacement=True, generator=generator)


@torch.no_grad()
def sample_mismatched(policy, theta, env, prompts, generator, temperature, noise, flip_p, router_params):
    """The perturbed sampler mu: tokens [B, T], mask, mu's own token log-probs (masked), number of flipped tokens.

    ``router_params``: the other expert, the same policy at a second parameter set (its logits are added on a flip).
    """
    B, T = prompts.shape[0], env.length
    tokens = torch.zeros(B, T, dtype=torch.long)
    logp = torch.zeros(B, T, dtype=theta.dtype)
    flips = 0
    for t in range(T):  # autoregressive: position t needs the tokens before it
        logits = policy.logits(theta, prompts, tokens)[:, t] / temperature
        if noise > 0:
            logits = logits + noise * torch.randn(logits.shape, generator=generator, dtype=logits.dtype)
        if flip_p > 0:
            flip = torch.rand(B, generator=generator) < flip_p
            flips += int(flip.sum())
            logits = logits + flip[:, None] * policy.logits(router_params, prompts, tokens)[:, t]
        lp_t = torch.log_softmax(logits.double(), -1)
        tokens[:, t] = torch.multinomial(lp_t.exp(), 1, generator=generator)[:, 0]
        logp[:, t] = lp_t.gather(-1, tokens[:, t : t + 1])[:, 0].to(theta.dtype)
    mask = env.mask_of(tokens).to(theta.dtype)
    return tokens * mask.long(), mask, logp * mask, flips


def weight_metrics(lp_pi, lp_mu, lp_old, mask) -> dict:
    """Sampled diagnostics of pi against the sampler mu on one mini-batch (float64)."""
    delta = ((lp_pi - lp_mu) * mask).double()
    L = delta.sum(-1)
    n_tok = float(mask.sum().clamp(min=1.0))
    return {"ess_frac": float(diagnostics.kish_ess_fraction(L)),
            "chi2_seq_sampled": float(diagnostics.chi2(L)),
            "k3_token": float((diagnostics.kl_k3(delta) * mask).sum()) / n_tok,
            "khat": float(diagnostics.psis_khat(L.numpy())),
            "mismatch_abs_logprob": float(((lp_old - lp_mu).abs() * mask).sum()) / n_tok}


@dataclass
class Rollout:
    """One rollout batch: who generated it, what was sampled, and the log-probs the estimator sees."""

    prompts: torch.Tensor  # [B]
    gen_version: torch.Tensor  # [B] the version that generated each response
    tokens: torch.Tensor
    mask: torch.Tensor
    lp_mu: torch.Tensor  # the sampler's token log-probs
    lp_old: torch.Tensor  # pi_old's (= lp_mu unless the sampler is mismatched)
    rewards: torch.Tensor
    advantages: torch.Tensor  # [B, T]
    record: dict  # the rollouts table row


class _Run:
    """The state of one training run: parameters, optimiser, the versions samplers may use, and the tables."""

    def __init__(self, cfg: TrainConfig, progress: bool | None, log=None):
        self.cfg = cfg
        self.problem = cfg.problem()
        self.env, self.policy = self.problem.env, self.problem.policy
        self.est = cfg.resolved()
        self.dtype = torch.float32 if cfg.dtype == "float32" else torch.float64
        init_gen = generator(cfg.seed, 0)
        self.sample_gen, self.lag_gen = generator(cfg.seed, 1), generator(cfg.seed, 2)
        self.theta = init_params(self.policy, cfg.init_scale, init_gen, dtype=self.dtype).requires_grad_(True)
        self.router_params = init_params(self.policy, cfg.router_scale, init_gen, dtype=self.dtype)
        self.opt = torch.optim.Adam([self.theta], lr=cfg.lr)
        self.loss_fn = self.est.ascent_loss({"group_size": cfg.group_size})
        self.wants_rollout = "rollout_log_probs" in set(self.est.info.inputs) | set(self.est.info.optional_inputs)
        prompts, tokens, mask = self.env.enumerate()
        self.lp0_enum = sequence_log_probs(self.policy, self.theta.detach().double(), prompts, tokens, mask)
        self.j_lo, self.j_hi = reward_range(self.env)
        self.initial = exact_metrics(self.env, self.policy, self.theta, self.lp0_enum)
        self.snapshots = {0: self.theta.detach().clone()}  # version -> parameters (async keeps lag_max + 1)
        self.params = [self.theta.detach().reshape(-1).clone()] if cfg.record_params else None
        self.rows, self.rollouts = [], []
        self.version, self.finite = 0, True
        self.bar = bar(cfg.steps * cfg.minibatches * cfg.epochs, f"train {cfg.estimator}", progress)
        self.log = log  # a lab.diagnose RolloutLogWriter, or None

    # ---- which version generates each group
    def generating_lags(self) -> tuple[torch.Tensor, dict]:
        cfg, n_groups = self.cfg, self.cfg.rollout_batch // self.cfg.group_size
        counts = {"dropped": 0, "requeued": 0, "kept_over_stale": 0, "router_flips": 0}
        if cfg.regime != "async":
            return torch.zeros(n_groups, dtype=torch.long), counts
        lags, draws = [], 0
        while len(lags) < n_groups:
            need = n_groups - len(lags)
            draws += need
            for lag in torch.clamp(draw_lags(cfg, need, self.lag_gen), max=self.version).tolist():
                if lag <= cfg.eta:
                    lags.append(lag)
                elif cfg.over_stale == "drop":
                    counts["dropped"] += 1
                elif cfg.over_stale == "requeue":
                    counts["requeued"] += 1
                    lags.append(0)
                else:
                    counts["kept_over_stale"] += 1
                    lags.append(lag)
            if draws > MAX_DROP_DRAWS * n_groups:
                raise LabError(f"over-stale policy 'drop' cannot fill a rollout: lags from {cfg.lag_dist} on "
                               f"0..{cfg.lag_max} almost never fall within eta = {cfg.eta}; raise eta or lower lag_max")
        return torch.tensor(lags, dtype=torch.long), counts

    # ---- sample one rollout
    def rollout(self, r: int) -> Rollout:
        cfg, env, G, B = self.cfg, self.env, self.cfg.group_size, self.cfg.rollout_batch
        gen_lags, counts = self.generating_lags()
        prompts = torch.randint(env.n_prompts, (B // G,), generator=self.sample_gen).repeat_interleave(G)
        gen_version = (self.version - gen_lags).repeat_interleave(G)  # [B]
        tokens = torch.zeros(B, env.length, dtype=torch.long)
        mask = torch.zeros(B, env.length, dtype=self.dtype)
        lp_mu = torch.zeros(B, env.length, dtype=self.dtype)
        for v in sorted(set(gen_version.tolist())):
            idx = (gen_version == v).nonzero()[:, 0]
            if cfg.regime == "mismatch":
                t_, m_, l_, flips = sample_mismatched(self.policy, self.snapshots[v], env, prompts[idx],
                                                      self.sample_gen, cfg.sampler_temperature, cfg.logprob_noise,
                                                      cfg.router_flip_p, self.router_params)
                counts["router_flips"] += flips
            else:
                t_, m_, l_ = sample(self.policy, self.snapshots[v], env, prompts[idx], self.sample_gen)
            tokens[idx], mask[idx], lp_mu[idx] = t_, m_.to(self.dtype), l_.to(self.dtype)
        rewards = env.sample_reward(prompts, tokens, mask, self.sample_gen).to(self.dtype)
        adv = adv_mod.group_advantages(rewards.reshape(B // G, G), cfg.advantage).reshape(B)[:, None] * mask
        if cfg.regime == "mismatch":  # the trainer recomputes pi_old = version v; mu's log-probs ride along
            with torch.no_grad():
                lp_old = token_log_probs(self.policy, self.snapshots[self.version], prompts, tokens) * mask
        else:  # two-policy: old_log_prob = the generating version's (mu's) log-probs
            lp_old = lp_mu
        record = {"rollout": r, "version": self.version, "gen_lag_min": int(gen_lags.min()),
                  "gen_lag_max": int(gen_lags.max()), "gen_lag_mean": float(gen_lags.double().mean()),
                  "n_lag0_groups": int((gen_lags == 0).sum()), "n_over_stale_groups": int((gen_lags > cfg.eta).sum()),
                  **counts}
        return Rollout(prompts, gen_version, tokens, mask, lp_mu, lp_old, rewards, adv, record)

    # ---- one optimiser step on one mini-batch
    def update(self, ro: Rollout, sl: slice, r: int, e: int, j: int) -> None:
        theta = self.theta
        logits = self.policy.logits(theta, ro.prompts[sl], ro.tokens[sl])
        extras = {"rewards": ro.rewards[sl]}
        if self.cfg.regime == "mismatch" and self.wants_rollout:
            extras["rollout_log_probs"] = ro.lp_mu[sl]
        value, metrics = self.loss_fn(logits, ro.tokens[sl], ro.mask[sl], ro.lp_old[sl], ro.advantages[sl], extras)
        loss = -value
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = float(theta.grad.norm())
        with torch.no_grad():
            lp_pi = torch.log_softmax(logits.detach(), -1).gather(-1, ro.tokens[sl, :, None])[..., 0] * ro.mask[sl]
        wm = weight_metrics(lp_pi, ro.lp_mu[sl], ro.lp_old[sl], ro.mask[sl])
        self.opt.step()
        lag = (self.version - ro.gen_version[sl]).double()
        self.version += 1
        if self.log is not None:  # the mini-batch as the neutral rollout log holds it (lab.diagnose)
            B, G, mb = self.cfg.rollout_batch, self.cfg.group_size, sl.stop - sl.start
            self.log.add(self.version, torch.arange(sl.start, sl.stop) + r * B, ro.tokens[sl], ro.mask[sl],
                         ro.lp_mu[sl], ro.lp_old[sl], lp_pi, ro.gen_version[sl], ro.advantages[sl], ro.rewards[sl],
                         (torch.arange(B) // G)[sl] + r * (B // G), trainer_version=self.version - 1)
        self.finite = (math.isfinite(float(loss.detach())) and math.isfinite(grad_norm)
                       and bool(torch.isfinite(theta).all()))
        ex = exact_metrics(self.env, self.policy, theta, self.lp0_enum) if self.finite \
            else dict.fromkeys(self.initial, math.nan)
        self.rows.append({"update": self.version, "rollout": r, "epoch": e, "minibatch": j,
                          "lag_min": float(lag.min()), "lag_mean": float(lag.mean()), "lag_max": float(lag.max()),
                          **ex, "sampled_reward": float(ro.rewards[sl].double().mean()),
                          "loss": float(loss.detach()), "grad_norm": grad_norm, "finite": self.finite, **wm,
                          **{f"est_{k}": float(v) for k, v in metrics.items()}})
        self.snapshots[self.version] = theta.detach().clone()
        if self.params is not None:
            self.params.append(theta.detach().reshape(-1).clone())
        self.bar.update(1)

    def consume(self, ro: Rollout, r: int) -> bool:
        """epochs x N mini-batches, one optimiser step each; False once the parameters are non-finite."""
        cfg = self.cfg
        mb = cfg.rollout_batch // cfg.minibatches
        for e in range(cfg.epochs):
            for j in range(cfg.minibatches):
                self.update(ro, slice(j * mb, (j + 1) * mb), r, e, j)
                if not self.finite:  # nothing sensible can be sampled from non-finite parameters: stop, flagged
                    return False
        keep_from = self.version - (cfg.lag_max if cfg.regime == "async" else 0)
        self.snapshots = {v: th for v, th in self.snapshots.items() if v >= keep_from}
        return True

    def result(self, stopped_early: bool) -> TrainResult:
        cfg, env = self.cfg, self.env
        self.bar.close()
        table = pd.DataFrame(self.rows)
        for name, value in (("seed", cfg.seed), ("regime", cfg.regime), ("estimator", cfg.estimator),
                            ("env", env.name)):
            table.insert(0, name, value)
        table["collapsed"] = collapse_flags(table["expected_reward"], table["entropy"], table["finite"], self.j_lo,
                                            self.j_hi, env.vocab_size, cfg.collapse_warmup, cfg.collapse_drop,
                                            cfg.entropy_floor)
        params = torch.stack(self.params) if self.params is not None else None
        return TrainResult(cfg, table, summarise(cfg, self, table, stopped_early), params)


def summarise(cfg: TrainConfig, run: _Run, table: pd.DataFrame, stopped_early: bool) -> dict:
    """The run's headline numbers for summary.json."""
    first = table.loc[table["collapsed"], "update"]
    roll = pd.DataFrame(run.rollouts)
    J = table["expected_reward"]
    summary = {
        "study": "train",
        "env": run.env.name,
        "estimator": cfg.estimator,
        "regime": cfg.regime,
        "loss_agg_mode": run.est.loss_agg_mode,
        "updates": int(run.version),
        "initial_expected_reward": run.initial["expected_reward"],
        "final_expected_reward": float(J.iloc[-1]),
        "best_expected_reward": float(J.max()),
        "reward_range": [run.j_lo, run.j_hi],
        "final_kl_to_init": float(table["kl_to_init"].iloc[-1]),
        "final_entropy": float(table["entropy"].iloc[-1]),
        "first_collapse_update": None if first.empty else int(first.iloc[0]),
        "stopped_early": stopped_early,
        "max_lag": float(table["lag_max"].max()),
        "mean_lag": float(table["lag_mean"].mean()),
        "dropped_groups": int(roll["dropped"].sum()),
        "requeued_groups": int(roll["requeued"].sum()),
        "kept_over_stale_groups": int(roll["kept_over_stale"].sum()),
        "router_flips": int(roll["router_flips"].sum()),
        "rollouts": roll.to_dict("records"),
    }
    summary["headline"] = (f"{cfg.estimator} on {run.env.name} ({cfg.regime}, N={cfg.minibatches}): expected reward "
                           f"{summary['initial_expected_reward']:.3f} -> {summary['final_expected_reward']:.3f}"
                           + ("" if summary["first_collapse_update"] is None
                              else f", collapsed at update {summary['first_collapse_update']}"))
    return summary


def train(cfg: TrainConfig, progress: bool | None = None, rollout_log=None) -> TrainResult:
    """Run one training simulation; deterministic given ``cfg.seed``. With ``rollout_log`` (a folder path) every
    mini-batch is also written as a neutral rollout log (``lab.diagnose``): tokens, the sampler's, pi_old's and pi's
    log-probs, versions, advantages, rewards, groups; ``lab diagnose --from lab`` recomputes the table's weight
    diagnostics from it."""
    cfg.validate()
    if rollout_log is None:
        return _train(cfg, progress, None)
    from lab.diagnose.neutral import RolloutLogWriter

    with RolloutLogWriter(rollout_log, run=f"{cfg.env}-{cfg.estimator}-seed{cfg.seed}") as log:
        return _train(cfg, progress, log)


def _train(cfg: TrainConfig, progress, log) -> TrainResult:
    run = _Run(cfg, progress, log)
    for r in range(cfg.steps):
        ro = run.rollout(r)
        run.rollouts.append(ro.record)
        if not run.consume(ro, r):
            return run.result(stopped_early=True)
    return run.result(stopped_early=False)
