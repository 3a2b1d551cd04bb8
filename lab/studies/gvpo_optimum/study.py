"""The gvpo_optimum study: GVPO's Theorems 1 and 2 made measurable; train to the KL-constrained optimum and watch the
distance shrink.

GVPO (Zhang et al., arXiv 2504.19599, NeurIPS 2025; the authors' verl recipe ``compute_policy_loss_gvpo``).
Setting: a tabular prefix-tree policy (it can represent any sequence distribution, so the optimum is reachable) on an
enumerable toy env with deterministic rewards, and a fixed reference pi_ref (random logits). The KL-constrained
reward-maximisation problem max_pi E_pi[R] - beta KL(pi || pi_ref) has the closed-form solution

    pi*(y|x) = pi_ref(y|x) exp(R(x, y) / beta) / Z(x),

computed here exactly by enumeration (float64). Every method starts at pi_ref, takes Adam steps on sampled groups of
k responses per prompt, and after each step the study records the exact total-variation distance
TV(pi, pi*) = mean over prompts of 1/2 sum_y |pi(y|x) - pi*(y|x)| and KL(pi || pi*) (= the gap to the optimal
KL-regularised objective, divided by beta).

Samplers (where the groups come from):
- ``on_policy``: the current policy pi_theta (Theorem 1).
- ``reference``: pi_ref itself, fixed (a frozen set of rollouts from the starting policy).
- ``tempered``: pi_ref at temperature ``temperature`` (logits / temperature), fixed.
- ``uniform``: uniform over responses, fixed.
The fixed samplers cover pi_ref's support, so Theorem 2 says GVPO still converges to pi*, without importance weights.

Methods (all aim at the same KL-regularised objective):
- ``gvpo``: the registry's gvpo with pi_ref' = pi_ref HELD FIXED (old_log_prob = log pi_ref). In the paper and the
  authors' code pi_ref' is the previous-step / rollout policy: each update is then pulled toward
  pi_old exp(R/beta)/Z, a moving target (Theorem 3: an n-step trust region that drifts toward argmax R).
  Freezing it is what makes Theorem 1's fixed point a single distribution to measure against.
- any sampled-token estimator of the registry (``seq_is``, ``ppo_clip``, ``reinforce``, ...), trained on the same
  samples with the sampler's token log-probs as old_log_prob and advantage A_i = r_i - mean_{j != i} r_j
  (``lab.advantages.leave_one_out``, unbiased under importance sampling as well), where r = R - beta log(pi/pi_ref)
  is the KL-regularised reward (detached; its score-function gradient is exactly grad [J - beta KL] since
  E_pi[grad log pi] = 0). ``reinforce`` (no correction) is not in the default list because with this reward and a
  group baseline it IS GVPO's update up to a positive constant (w_i = r_i - mean r; tests/test_gvpo.py checks it).

Vectorised, and tabular by nature: every (method, sampler, seed) run is a block of one stacked parameter tensor
[n_runs, P, nodes, V] whose rows ARE the prefix-tree policy's logits, so the log-prob of every enumerated response of
every run is one log-softmax over that table and one gather (``policy.rows``). One Adam step updates every run
independently (Adam is per-coordinate and each run's loss only touches its own block; each method's loss is restored
to one run's scale, so the runs do not share a normaliser).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import pandas as pd
import torch

import toy_envs
from lab import estimators, stats
from lab.advantages import leave_one_out
from lab.configs import SEED_MAX, check_types, to_dict
from lab.engine.estimator import Estimator
from lab.errors import LabError
from lab.estimators.aggregation import AGG_MODES
from lab.policies import init_params, make_policy, sequence_log_probs, token_log_probs
from lab.progress import bar
from lab.seeding import generator
from lab.studies import StudyResult
from lab.typed import build, knob

SCHEDULES = ("constant", "cosine")
SAMPLERS = ("on_policy", "reference", "tempered", "uniform")


@dataclass
class Config:
    """One optimum study. Every field has a default: ``Config()`` runs in about half a minute."""

    env: str = "small_dense"
    """toy env preset with deterministic rewards (target, parity or dense)"""
    env_overrides: dict = knob({"n_prompts": 2, "vocab_size": 4, "length": 4}, flag="--set", parse="pairs")
    """env fields to change"""
    methods: list[str] = knob(["gvpo", "seq_is", "ppo_clip"])
    """gvpo and sampled-token estimators (seq_is, ppo_clip, reinforce, ...)"""
    samplers: list[Literal[SAMPLERS]] = knob(["on_policy", "reference", "uniform"])
    """where the groups come from: on_policy | reference | tempered | uniform"""
    beta: float = knob(0.1, gt=0, le=1e3)
    """KL coefficient of the objective, and GVPO's beta"""
    group_size: int = knob(4, ge=2, le=4096)
    """k responses per prompt"""
    groups_per_step: int = knob(32, ge=1, le=100_000)
    """prompts (groups) per Adam step and run"""
    steps: int = knob(800, ge=1, le=1_000_000)
    """Adam steps"""
    lr: float = knob(0.1, gt=0, le=1e3)
    """Adam learning rate, the same for every method"""
    schedule: Literal[SCHEDULES] = "constant"
    """constant | cosine (decays the learning rate to 0 at the last step)"""
    ref_scale: float = knob(1.0, ge=0, le=100)
    """pi_ref logits ~ N(0, ref_scale^2), drawn per seed"""
    temperature: float = knob(3.0, gt=0, le=100)
    """the tempered sampler: softmax(logits_ref / temperature)"""
    loss_agg_mode: Literal[AGG_MODES] = knob("seq-mean-token-sum", flag="--agg")
    """aggregation of the sampled-token methods (GVPO's loss is sequence-level)"""
    seeds: list[int] = knob([0, 1, 2, 3, 4], ge=0, le=SEED_MAX)
    """each seed: its own pi_ref and samples"""
    n_boot: int = knob(1000, ge=10, le=1_000_000)
    """bootstrap resamples over seeds"""
    ci: float = knob(0.95, gt=0, lt=1)
    """interval coverage"""
    enum_limit: int = knob(2**16, ge=1, le=2**31)
    """largest number of (prompt, response) pairs to enumerate"""

    def make_env(self):
        return toy_envs.make(self.env, **self.env_overrides)

    def resolved(self) -> list[Estimator]:
        """The methods as estimators, resolved once; GVPO with this study's beta."""
        return [Estimator.resolve(m, {"beta": self.beta} if m == "gvpo" else {}, self.loss_agg_mode)
                for m in self.methods]

    def validate(self) -> None:
        check_types(self)
        env = self.make_env()
        if env.reward == "bernoulli":
            raise LabError("the optimum study needs deterministic rewards (target, parity or dense), not bernoulli")
        env.check_enumerable(self.enum_limit)
        make_policy("prefix", env)
        self._validate_methods()
        estimators.gvpo.check_groups(self.group_size * self.groups_per_step, self.group_size)
        if not self.seeds:
            raise LabError("give at least one seed")

    def _validate_methods(self) -> None:
        if not self.methods:
            raise LabError("give at least one method")
        if not self.samplers:
            raise LabError(f"give at least one sampler: {', '.join(SAMPLERS)}")
        if len(set(self.methods)) != len(self.methods) or len(set(self.samplers)) != len(self.samplers):
            raise LabError("methods and samplers must not repeat")
        for est in self.resolved():
            if est.name != "gvpo" and est.info.inputs:
                raise LabError(f"method {est.name!r} needs extra inputs ({', '.join(est.info.inputs)}); the optimum "
                               f"study trains gvpo and sampled-token estimators such as seq_is, ppo_clip, reinforce")


SMOKE = {"steps": 60, "seeds": [0, 1], "groups_per_step": 8}  # seconds: what the tests build


@dataclass
class FinalTV:
    """TV(pi, pi*) after the last step over seeds: mean, percentile-bootstrap interval, and each seed's."""

    mean: float
    lo: float
    hi: float
    per_seed: list[float]


@dataclass
class Summary:
    """What the optimum study found (summary.json): ``final_tv[method][sampler]``, the TV at the start (pi_ref to
    pi*, the same for every run of a seed; mean over runs), and the config the text quotes."""

    study: str
    env: str
    beta: float
    steps: int
    group_size: int
    seeds: list[int]
    tv_at_start: float
    final_tv: dict[str, dict[str, FinalTV]]
    policy: str
    config: dict


# ---- exact quantities ---------------------------------------------------------------------------------------

def reference_params(env, seed: int, scale: float) -> torch.Tensor:
    """pi_ref's logits (float64) for one seed: N(0, scale^2) per prefix-tree node."""
    return init_params(make_policy("prefix", env), scale, generator(seed, 0))


def optimum_log_probs(log_ref: torch.Tensor, rewards: torch.Tensor, beta: float) -> torch.Tensor:
    """log pi* = log pi_ref + R/beta - log Z over the last axis (one prompt's responses), float64."""
    z = log_ref.double() + rewards.double() / beta
    return z - torch.logsumexp(z, -1, keepdim=True)


def total_variation(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """1/2 sum_y |p - q| over the last axis, then the mean over the prompt axis before it."""
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1).mean(-1)


def kl_divergence(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p || q) over the last axis, mean over prompts."""
    p = log_p.exp()
    return (p * (log_p - log_q)).where(p > 0, torch.zeros_like(p)).sum(-1).mean(-1)


def enumerated_log_probs(env, theta) -> torch.Tensor:
    """log pi(y|x) of every response, [P, N] in the enumeration's order (float64, differentiable in theta)."""
    prompts, tokens, mask = env.enumerate()
    lp = sequence_log_probs(make_policy("prefix", env), theta, prompts, tokens, mask)
    return lp.reshape(env.n_prompts, -1)


def prefix_tree_params(env, log_p: torch.Tensor) -> torch.Tensor:
    """Prefix-tree logits representing the sequence distribution exp(log_p) exactly
    (``PrefixTreePolicy.params_for``)."""
    return make_policy("prefix", env).params_for(env, log_p)


def population_loss(env, theta, theta_ref, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """GVPO's expected loss with groups drawn i.i.d. from a fixed q: mean over prompts of 1/2 Var_q(beta ell - R).

    For any group size k, E[1/(k-1) sum_i 1/2 (d_i - mean d)^2] = 1/2 Var(d) (the unbiased sample variance),
    d = beta log(pi/pi_ref) - R. It is 0 exactly when d is constant on q's support: pi = pi_ref exp(R/beta)/Z.
    """
    prompts, tokens, mask = env.enumerate()
    reward = env.expected_reward(prompts, tokens, mask).reshape(env.n_prompts, -1)
    d = beta * (enumerated_log_probs(env, theta) - enumerated_log_probs(env, theta_ref).detach()) - reward
    q = log_q.detach().exp()
    mean = (q * d).sum(-1, keepdim=True)
    return (0.5 * (q * (d - mean) ** 2).sum(-1)).mean()


def expected_gvpo_gradient(env, theta, theta_ref, log_q: torch.Tensor, group_size: int, beta: float,
                           limit: int = 2_000_000) -> torch.Tensor:
    """E[grad L_group] exactly, by enumerating every group of ``group_size`` responses per prompt.

    Groups are drawn i.i.d. from q (``log_q`` [P, N], enumeration order; prompts uniform) and scored by the
    registered ``gvpo`` estimator with old_log_prob = log pi_ref (pi_ref' = ``theta_ref``): the estimator runs on the
    batch of all P N^k groups, and each group's coefficient on log pi is reweighted by its probability. float64,
    flattened like theta. For the on-policy case pass theta_ref = theta and log_q = log pi.
    """
    policy = make_policy("prefix", env)
    P, N = log_q.shape
    k = estimators.gvpo.check_groups(group_size, group_size)
    if P * N**k * k > limit:
        raise LabError(f"enumerating every group means {P * N**k * k:,} responses (limit {limit:,}); use a smaller "
                       f"env or group size")
    prompts, tokens, mask = env.enumerate()
    reward = env.expected_reward(prompts, tokens, mask)
    combos = torch.cartesian_prod(*[torch.arange(N)] * k).reshape(-1, k)  # [N^k, k]
    pairs = (torch.arange(P)[:, None, None] * N + combos[None]).reshape(-1)  # [P * N^k * k], groups consecutive
    q = log_q.double().reshape(-1).exp()
    group_weight = q[pairs].reshape(-1, k).prod(-1) / P  # [P * N^k], sums to 1
    theta = theta.detach().double().requires_grad_(True)
    lp = token_log_probs(policy, theta, prompts[pairs], tokens[pairs]) * mask[pairs]
    with torch.no_grad():
        old = token_log_probs(policy, theta_ref.double(), prompts[pairs], tokens[pairs]) * mask[pairs]
    leaf = lp.detach().requires_grad_(True)
    gvpo = Estimator.resolve("gvpo", {"beta": beta})
    loss, _ = gvpo.loss_on_log_probs(leaf, old, torch.zeros_like(old), mask[pairs], rewards=reward[pairs], group_size=k)
    (coef,) = torch.autograd.grad(loss, leaf)  # (1 / n_groups) d L_group / d log pi
    coef = coef * group_weight.repeat_interleave(k)[:, None] * group_weight.shape[0]
    (g,) = torch.autograd.grad((coef * lp).sum(), theta)
    return g.reshape(-1)


# ---- training every run at once ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Responses:
    """Every enumerated response (prompt-major, [P * N]) and where its tokens' log-probs sit in one run's flat
    log-softmax table: the tabular shortcut that lets one gather score every response of every run."""

    n_runs: int
    P: int
    N: int
    tokens: torch.Tensor  # [P * N, T]
    mask: torch.Tensor  # [P * N, T]
    reward: torch.Tensor  # [P * N]
    index: torch.Tensor  # [P * N, T] into one run's flattened [P, nodes, V] log-softmax table

    @classmethod
    def of(cls, env, n_runs: int, enum_limit: int) -> "_Responses":
        prompts, tokens, mask = env.enumerate(enum_limit)
        index = make_policy("prefix", env).rows(prompts, tokens) * env.vocab_size + tokens
        return cls(n_runs, env.n_prompts, prompts.shape[0] // env.n_prompts, tokens, mask,
                   env.expected_reward(prompts, tokens, mask), index)

    def token_logp(self, theta: torch.Tensor) -> torch.Tensor:
        """[n_runs, P * N, T]: log pi(y_t | x, y_<t) of every enumerated response under each run's table, masked."""
        table = torch.log_softmax(theta, -1).reshape(self.n_runs, -1)
        return table[:, self.index] * self.mask

    def seq_logp(self, tok: torch.Tensor) -> torch.Tensor:
        """[n_runs, P, N]: log pi(y|x) from ``token_logp``."""
        return tok.sum(-1).reshape(self.n_runs, self.P, self.N)


@dataclass(frozen=True)
class _Start:
    """Per run: pi_ref's table, which runs sample on-policy, and the fixed quantities (token and sequence log-probs of
    pi_ref and of the fixed sampler, log pi*)."""

    theta_ref: torch.Tensor  # [n_runs, P, nodes, V]
    on_policy: torch.Tensor  # [n_runs] bool
    tok_ref: torch.Tensor  # [n_runs, P * N, T]
    tok_fixed: torch.Tensor
    log_ref: torch.Tensor  # [n_runs, P, N]
    log_fixed: torch.Tensor
    log_opt: torch.Tensor


def runs_of(cfg: Config) -> list[tuple[str, str, int]]:
    """(method, sampler, seed) of every run, method-major: each method owns one block of runs."""
    return [(m, s, seed) for m in cfg.methods for s in cfg.samplers for seed in cfg.seeds]


def _start(cfg: Config, env, runs: list, resp: _Responses) -> _Start:
    refs = {seed: reference_params(env, seed, cfg.ref_scale) for seed in cfg.seeds}
    # the tables' rows ARE the logits (the tabular shortcut above), so theta / t is exactly sampling at temperature t
    fixed = {"on_policy": lambda t: t, "reference": lambda t: t, "tempered": lambda t: t / cfg.temperature,
             "uniform": torch.zeros_like}
    theta_ref = torch.stack([refs[seed] for _, _, seed in runs])
    theta_fixed = torch.stack([fixed[s](refs[seed]) for _, s, seed in runs])
    with torch.no_grad():
        tok_ref, tok_fixed = resp.token_logp(theta_ref), resp.token_logp(theta_fixed)
        log_ref, log_fixed = resp.seq_logp(tok_ref), resp.seq_logp(tok_fixed)
        log_opt = optimum_log_probs(log_ref, resp.reward.reshape(1, resp.P, resp.N), cfg.beta)
    on_policy = torch.tensor([s == "on_policy" for _, s, _ in runs])
    return _Start(theta_ref, on_policy, tok_ref, tok_fixed, log_ref, log_fixed, log_opt)


def _draw_groups(cfg: Config, resp: _Responses, start: _Start, current: torch.Tensor, gen) -> torch.Tensor:
    """[n_runs, B] indices into the enumeration: G prompts per run drawn uniformly, k responses each from the run's
    sampler (``current`` log pi for on-policy runs), by exact inverse CDF."""
    n_runs, k, N = resp.n_runs, cfg.group_size, resp.N
    B = k * cfg.groups_per_step
    x = torch.randint(resp.P, (n_runs, cfg.groups_per_step), generator=gen).repeat_interleave(k, -1)  # [n_runs, B]
    log_mu_seq = torch.where(start.on_policy[:, None, None], current, start.log_fixed)  # [n_runs, P, N]
    cdf = torch.cumsum(log_mu_seq.exp(), -1)[torch.arange(n_runs)[:, None].expand(n_runs, B), x]  # [n_runs, B, N]
    u = torch.rand(n_runs, B, 1, generator=gen, dtype=cdf.dtype) * cdf[..., -1:]
    idx = torch.searchsorted(cdf, u).squeeze(-1).clamp(max=N - 1)
    return x * N + idx


def _loss(cfg: Config, ests: list[Estimator], resp: _Responses, start: _Start, theta, pair) -> torch.Tensor:
    """The sum over methods of each method's loss on its runs' groups, each back at one run's scale."""
    run_index = torch.arange(resp.n_runs)[:, None].expand_as(pair)
    tok = resp.token_logp(theta)
    log_prob = tok[run_index, pair]  # [n_runs, B, T], carries the gradient
    with torch.no_grad():
        mask, rewards = resp.mask[pair], resp.reward[pair]
        ref_lp = start.tok_ref[run_index, pair]
        mu_lp = torch.where(start.on_policy[:, None, None], tok.detach()[run_index, pair],
                            start.tok_fixed[run_index, pair])
        reg_reward = rewards - cfg.beta * (log_prob - ref_lp).sum(-1)  # R - beta log(pi/pi_ref)
        adv = leave_one_out(reg_reward, cfg.group_size)[..., None] * mask
    per_method = resp.n_runs // len(ests)
    total = 0.0
    for i, est in enumerate(ests):
        rows = slice(i * per_method, (i + 1) * per_method)

        def flat(t):
            return t[rows].reshape(-1, *t.shape[2:])

        if est.name == "gvpo":  # pi_ref' = pi_ref, frozen: old_log_prob is the reference's, not the sampler's
            loss, _ = est.loss_on_log_probs(flat(log_prob), flat(ref_lp), flat(adv), flat(mask),
                                            rewards=flat(rewards), group_size=cfg.group_size)
        else:
            loss, _ = est.loss_on_log_probs(flat(log_prob), flat(mu_lp), flat(adv), flat(mask))
        total = total + loss * per_method  # each loss is a mean over its runs' rows: back to one run's scale
    return total


def _train(cfg: Config, resp: _Responses, start: _Start, progress: bool | None):
    """Adam on every run at once. Returns TV and KL to pi* after every step ([steps + 1, n_runs] each) and the final
    log pi ([n_runs, P, N])."""
    ests = cfg.resolved()
    theta = start.theta_ref.clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=cfg.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps) if cfg.schedule == "cosine" else None
    gen = generator(*cfg.seeds, 1)
    tv, kl = [], []

    def record(tok):
        lp = resp.seq_logp(tok.detach())
        tv.append(total_variation(lp, start.log_opt))
        kl.append(kl_divergence(lp, start.log_opt))
        return lp

    current = record(resp.token_logp(theta.detach()))
    steps = bar(cfg.steps, "gvpo_optimum", progress)
    for _ in range(cfg.steps):
        pair = _draw_groups(cfg, resp, start, current, gen)
        loss = _loss(cfg, ests, resp, start, theta, pair)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        with torch.no_grad():
            current = record(resp.token_logp(theta))
        steps.update(1)
    steps.close()
    return torch.stack(tv).numpy(), torch.stack(kl).numpy(), current


def _dist_frame(method, sampler, seed, step, log_p, labels) -> pd.DataFrame:
    P, N = log_p.shape
    return pd.DataFrame({"method": method, "sampler": sampler, "seed": seed, "step": step, "metric": "prob",
                         "value": log_p.exp().reshape(-1).numpy(), "prompt": np.repeat(np.arange(P), N),
                         "response": labels * P})


def _results(cfg: Config, runs: list, resp: _Responses, start: _Start, tv, kl, current) -> pd.DataFrame:
    """Tidy: TV and KL curves per run (metric tv / kl_to_opt per step), then the first seed's final distributions
    with pi* and pi_ref (metric prob, per prompt and response)."""
    frames = []
    for r, (m, s, seed) in enumerate(runs):
        for metric, arr in (("tv", tv), ("kl_to_opt", kl)):
            frames.append(pd.DataFrame({"method": m, "sampler": s, "seed": seed, "step": np.arange(cfg.steps + 1),
                                        "metric": metric, "value": arr[:, r]}))
    labels = ["".join(str(int(t)) for t in row) for row in resp.tokens[:resp.N]]
    seed0 = cfg.seeds[0]
    dist_runs = [(r, m, s) for r, (m, s, seed) in enumerate(runs) if seed == seed0]
    r0 = dist_runs[0][0]
    frames.append(_dist_frame("pi*", "-", seed0, cfg.steps, start.log_opt[r0], labels))
    frames.append(_dist_frame("pi_ref", "-", seed0, 0, start.log_ref[r0], labels))
    for r, m, s in dist_runs:
        frames.append(_dist_frame(m, s, seed0, cfg.steps, current[r], labels))
    results = pd.concat(frames, ignore_index=True)
    results["prompt"] = results["prompt"].fillna(-1).astype(int)
    results["response"] = results["response"].fillna("")
    return results


def run(cfg: Config, progress: bool | None = None) -> StudyResult:
    """Train every (method, sampler, seed) run and record TV(pi, pi*) and KL(pi||pi*) after every step.

    Deterministic given the config. Runs single-threaded (these tensors are tiny: extra threads only add contention
    on a busy machine); the previous torch thread count is restored afterwards.
    """
    cfg.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        env, runs = cfg.make_env(), runs_of(cfg)
        resp = _Responses.of(env, len(runs), cfg.enum_limit)
        start = _start(cfg, env, runs, resp)
        tv, kl, current = _train(cfg, resp, start, progress)
        results = _results(cfg, runs, resp, start, tv, kl, current)
    finally:
        torch.set_num_threads(threads)
    return StudyResult(results, asdict(summarise(results, cfg)))


# ---- summary ----------------------------------------------------------------------------------------------------

def methods_of(results: pd.DataFrame) -> list:
    """Trained methods, in the study's order."""
    return list(pd.unique(results.loc[results["metric"] == "tv", "method"]))


def samplers_of(results: pd.DataFrame) -> list:
    """Samplers, in the study's order."""
    return list(pd.unique(results.loc[results["metric"] == "tv", "sampler"]))


def final_values(results: pd.DataFrame, metric: str = "tv") -> pd.DataFrame:
    """One row per (method, sampler, seed): the metric after the last step."""
    rows = results[results["metric"] == metric]
    last = rows["step"].max()
    return rows[rows["step"] == last][["method", "sampler", "seed", "value"]]


def final_intervals(results: pd.DataFrame, ci: float = 0.95, n_boot: int = 1000) -> dict:
    """{method: {sampler: {mean, lo, hi, per_seed}}} of the final TV: percentile bootstrap over seeds (fixed rng)."""
    fin = final_values(results, "tv")
    seeds = sorted(pd.unique(fin["seed"]))
    counts = stats.bootstrap_counts(len(seeds), n_boot, np.random.default_rng(0))
    out = {}
    for m in methods_of(results):
        out[m] = {}
        for s in samplers_of(results):
            v = fin[(fin["method"] == m) & (fin["sampler"] == s)].sort_values("seed")["value"].to_numpy()
            mean, lo, hi = stats.mean_interval(v, counts, ci)
            out[m][s] = {"mean": mean, "lo": lo, "hi": hi, "per_seed": [float(a) for a in v]}
    return out


def summarise(results: pd.DataFrame, cfg: Config) -> Summary:
    """final_tv[method][sampler] = {mean, lo, hi, per_seed}, the TV at the start, and the config the text quotes."""
    out = final_intervals(results, cfg.ci, cfg.n_boot)
    start = float(results[(results["metric"] == "tv") & (results["step"] == 0)]["value"].mean())
    return build(Summary, {"study": "gvpo_optimum", "env": cfg.env, "beta": cfg.beta, "steps": cfg.steps,
                           "group_size": cfg.group_size, "seeds": list(cfg.seeds), "tv_at_start": start,
                           "final_tv": out, "policy": "prefix", "config": to_dict(cfg)})
