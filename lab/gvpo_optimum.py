"""GVPO's Theorems 1 and 2 made measurable: train to the KL-constrained optimum and watch the distance shrink.

Setting. A tabular prefix-tree policy (it can represent any sequence distribution) on an enumerable toy env with
deterministic rewards, and a fixed reference pi_ref (random logits). The KL-constrained reward-maximisation
problem max_pi E_pi[R] - beta KL(pi || pi_ref) has the closed-form solution

    pi*(y|x) = pi_ref(y|x) exp(R(x, y) / beta) / Z(x),

computed here exactly by enumeration (float64). Every method starts at pi_ref, takes Adam steps on sampled groups
of k responses per prompt, and after each step we record the exact total-variation distance
TV(pi, pi*) = mean over prompts of 1/2 sum_y |pi(y|x) - pi*(y|x)| and KL(pi || pi*) (= the gap to the optimal
KL-regularised objective, divided by beta).

Samplers (where the groups come from):
- ``on_policy``: the current policy pi_theta (Theorem 1).
- ``reference``: pi_ref itself, fixed (a frozen set of rollouts from the starting policy).
- ``tempered``: pi_ref at temperature ``temperature`` (logits / temperature), fixed.
- ``uniform``: uniform over responses, fixed.
The fixed samplers cover pi_ref's support, so Theorem 2 says GVPO still converges to pi*, without importance weights.

Methods (all aim at the same KL-regularised objective):
- ``gvpo``: lab.estimators gvpo with pi_ref' = pi_ref HELD FIXED (old_log_prob = log pi_ref). In the paper and the
  official code pi_ref' is the previous-step / rollout policy: each update is then pulled toward
  pi_old exp(R/beta)/Z, a moving target (Theorem 3: an n-step trust region that drifts toward argmax R).
  Freezing it is what makes Theorem 1's fixed point a single distribution we can measure against.
- any sampled-token estimator of the registry (``seq_is``, ``ppo_clip``, ``reinforce``, ...), trained on the same
  samples with the sampler's token log-probs as old_log_prob and advantage A_i = r_i - mean_{j != i} r_j (RLOO,
  unbiased under importance sampling as well), where r = R - beta log(pi/pi_ref) is the KL-regularised reward
  (detached; its score-function gradient is exactly grad [J - beta KL] since E_pi[grad log pi] = 0).
  ``seq_is`` is the unbiased IS-corrected alternative, ``ppo_clip`` the token-clipped one. ``reinforce`` (no
  correction) is not in the default list because with this reward and a group baseline it IS GVPO's update up to
  a positive constant (w_i = r_i - mean r; tests/test_gvpo.py checks it), so it shares GVPO's fixed point.

Everything is vectorised: every (method, sampler, seed) run is a block of prompts of one big prefix-tree policy,
so one Adam step on one tensor updates every run independently (Adam is per-coordinate and each run's loss only
touches its own block; each run's loss is restored to its own scale, so the runs do not share a normaliser).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, NullFormatter

import toy_envs
from lab import estimators, stats
from lab.errors import LabError
from lab.estimators.aggregation import check_mode
from lab.policies import init_params, make_policy, sequence_log_probs, token_log_probs

SCHEDULES = ("constant", "cosine")
SAMPLERS = ("on_policy", "reference", "tempered", "uniform")
SAMPLER_LABELS = {"on_policy": "on-policy (π_θ)", "reference": "π_ref (fixed)",
                  "tempered": "tempered π_ref (fixed)", "uniform": "uniform (fixed)"}
METHOD_COLORS = {"gvpo": "#2ca02c", "seq_is": "#1f77b4", "ppo_clip": "#ff7f0e", "reinforce": "#d62728",
                 "token_is": "#9467bd"}
FALLBACK_COLORS = ["#8c564b", "#e377c2", "#17becf", "#7f7f7f", "#bcbd22"]


@dataclass
class OptimumConfig:
    """One optimum study. Every field has a default: ``OptimumConfig()`` runs in about half a minute."""

    env: str = "small_dense"  # toy_envs preset (deterministic rewards: target, parity or dense)
    env_overrides: dict = field(default_factory=lambda: {"n_prompts": 2, "vocab_size": 4, "length": 4})
    methods: list = field(default_factory=lambda: ["gvpo", "seq_is", "ppo_clip"])
    samplers: list = field(default_factory=lambda: ["on_policy", "reference", "uniform"])
    beta: float = 0.1  # KL coefficient of the objective, and GVPO's beta
    group_size: int = 4  # k responses per prompt
    groups_per_step: int = 32  # prompts (groups) per Adam step and run
    steps: int = 800  # Adam steps
    lr: float = 0.1  # Adam learning rate, the same for every method
    schedule: str = "constant"  # constant | cosine (decays the learning rate to 0 at the last step)
    ref_scale: float = 1.0  # pi_ref logits ~ N(0, ref_scale^2) (drawn per seed)
    temperature: float = 3.0  # the tempered sampler: softmax(logits_ref / temperature)
    loss_agg_mode: str = "seq-mean-token-sum"  # for the sampled-token baselines (GVPO is sequence-level)
    seeds: list = field(default_factory=lambda: [0, 1, 2, 3, 4])  # each seed: its own pi_ref and samples
    n_boot: int = 1000  # bootstrap resamples over seeds
    ci: float = 0.95
    enum_limit: int = 2**16

    def validate(self):
        env = toy_envs.make(self.env, **self.env_overrides)
        if env.reward == "bernoulli":
            raise LabError("the optimum study needs deterministic rewards (target, parity or dense), not bernoulli")
        env.check_enumerable(self.enum_limit)
        make_policy("prefix", env)
        if not self.methods:
            raise LabError("give at least one method")
        if len(set(self.methods)) != len(self.methods) or len(set(self.samplers)) != len(self.samplers):
            raise LabError("methods and samplers must not repeat")
        for m in self.methods:
            if m != "gvpo" and estimators.info(m).inputs:
                raise LabError(f"method {m!r} needs extra inputs ({', '.join(estimators.info(m).inputs)}); the optimum "
                               f"study trains gvpo and sampled-token estimators such as seq_is, ppo_clip, reinforce")
        unknown = [s for s in self.samplers if s not in SAMPLERS]
        if unknown or not self.samplers:
            raise LabError(f"unknown sampler(s) {', '.join(unknown) or '(none given)'}; "
                           f"choose from {', '.join(SAMPLERS)}")
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise LabError(f"beta must be a positive number, got {self.beta}")
        estimators.gvpo.check_groups(self.group_size * max(self.groups_per_step, 1), self.group_size)
        if self.groups_per_step < 1 or self.steps < 1:
            raise LabError("groups_per_step and steps must be at least 1")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise LabError(f"the learning rate must be a positive number, got {self.lr}")
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise LabError(f"the sampler temperature must be a positive number, got {self.temperature}")
        if not (math.isfinite(self.ref_scale) and self.ref_scale >= 0):
            raise LabError(f"ref_scale must be a finite non-negative number, got {self.ref_scale}")
        check_mode(self.loss_agg_mode)
        if self.schedule not in SCHEDULES:
            raise LabError(f"unknown learning-rate schedule {self.schedule!r}; choose one of {', '.join(SCHEDULES)}")
        if not self.seeds:
            raise LabError("give at least one seed")
        if not 0 < self.ci < 1 or self.n_boot < 10:
            raise LabError("ci must lie in (0, 1) and n_boot be at least 10")
        return env


def config_dict(cfg: OptimumConfig) -> dict:
    return asdict(cfg)


def _seed(*parts: int) -> int:
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def reference_params(env, seed: int, scale: float) -> torch.Tensor:
    """pi_ref's logits (float64) for one seed: N(0, scale^2) per prefix-tree node."""
    return init_params(make_policy("prefix", env), scale, torch.Generator().manual_seed(_seed(seed, 0)))


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


def rloo(values: torch.Tensor, k: int) -> torch.Tensor:
    """v_i - mean_{j != i} v_j within consecutive groups of k (last axis)."""
    g = values.reshape(*values.shape[:-1], -1, k)
    return ((g - g.mean(-1, keepdim=True)) * k / (k - 1)).reshape(values.shape)


def enumerated_log_probs(env, theta) -> torch.Tensor:
    """log pi(y|x) of every response, [P, N] in the enumeration's order (float64, differentiable in theta)."""
    prompts, tokens, mask = env.enumerate()
    lp = sequence_log_probs(make_policy("prefix", env), theta, prompts, tokens, mask)
    return lp.reshape(env.n_prompts, -1)


def prefix_tree_params(env, log_p: torch.Tensor) -> torch.Tensor:
    """Prefix-tree logits representing the sequence distribution exp(log_p) ([P, N], enumeration order) exactly.

    Each node's logits are the log marginal probabilities of its children (the node's own mass cancels in the
    softmax); nodes no response reaches get logits 0, children of zero mass -1000.
    """
    policy = make_policy("prefix", env)
    prompts, tokens, mask = env.enumerate()
    V = env.vocab_size
    index = (policy.rows(prompts, tokens) * V + tokens)[mask > 0]
    mass = log_p.double().reshape(-1).exp()[:, None].expand(tokens.shape)[mask > 0]
    table = torch.zeros(math.prod(policy.shape), dtype=torch.float64).index_add_(0, index, mass).reshape(-1, V)
    logits = torch.log(table).clamp(min=-1000.0)
    logits = torch.where((table > 0).any(-1, keepdim=True), logits, torch.zeros_like(logits))
    return logits.reshape(policy.shape)


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
    registered ``gvpo`` estimator with old_log_prob = log pi_ref (pi_ref' = ``theta_ref``): the estimator runs
    on the batch of all P N^k groups, and each group's coefficient on log pi is reweighted by its probability.
    float64, flattened like theta. For the on-policy case pass theta_ref = theta and log_q = log pi.
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
    loss, _ = estimators.get("gvpo")(leaf, old, torch.zeros_like(old), mask[pairs], rewards=reward[pairs],
                                     group_size=k, beta=beta)
    (coef,) = torch.autograd.grad(loss, leaf)  # (1 / n_groups) d L_group / d log pi
    coef = coef * group_weight.repeat_interleave(k)[:, None] * group_weight.shape[0]
    (g,) = torch.autograd.grad((coef * lp).sum(), theta)
    return g.reshape(-1)


@dataclass
class OptimumResult:
    config: OptimumConfig
    results: pd.DataFrame  # tidy: curves (metric tv / kl_to_opt per step) and final distributions (metric prob)
    summary: dict


def run_optimum(cfg: OptimumConfig) -> OptimumResult:
    """Train every (method, sampler, seed) run and record TV(pi, pi*) and KL(pi||pi*) after every step.

    Deterministic given the config. Runs single-threaded (these tensors are tiny: extra threads only add
    contention on a busy machine); the previous torch thread count is restored afterwards.
    """
    env = cfg.validate()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(cfg, env)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: OptimumConfig, env) -> OptimumResult:
    P, V, k = env.n_prompts, env.vocab_size, cfg.group_size
    policy = make_policy("prefix", env)
    runs = [(m, s, seed) for m in cfg.methods for s in cfg.samplers for seed in cfg.seeds]
    n_runs, G = len(runs), cfg.groups_per_step
    B = k * G

    # every response of every prompt, and where its tokens' log-probs sit in one run's flat log-softmax table
    ex_prompts, ex_tokens, ex_mask = env.enumerate(cfg.enum_limit)  # prompt-major: [P * N]
    N = ex_prompts.shape[0] // P
    ex_reward = env.expected_reward(ex_prompts, ex_tokens, ex_mask)  # [P * N]
    ex_index = policy.rows(ex_prompts, ex_tokens) * V + ex_tokens  # [P * N, T]

    def token_logp(theta):  # [n_runs, P * N, T]: log pi(y_t | x, y_<t) of every enumerated response, masked
        table = torch.log_softmax(theta, -1).reshape(n_runs, -1)
        return table[:, ex_index] * ex_mask

    def seq_logp(tok):  # [n_runs, P, N]
        return tok.sum(-1).reshape(n_runs, P, N)

    # pi_ref, the fixed samplers and the exact optimum, per run: theta is [n_runs, P, nodes, V]
    refs = {seed: reference_params(env, seed, cfg.ref_scale) for seed in cfg.seeds}
    theta_ref = torch.stack([refs[seed] for _, _, seed in runs])
    fixed = {"on_policy": lambda t: t, "reference": lambda t: t, "tempered": lambda t: t / cfg.temperature,
             "uniform": torch.zeros_like}
    theta_fixed = torch.stack([fixed[s](refs[seed]) for _, s, seed in runs])
    on_policy = torch.tensor([s == "on_policy" for _, s, _ in runs])
    with torch.no_grad():
        tok_ref, tok_fixed = token_logp(theta_ref), token_logp(theta_fixed)
        log_ref, log_fixed = seq_logp(tok_ref), seq_logp(tok_fixed)
        log_opt = optimum_log_probs(log_ref, ex_reward.reshape(1, P, N), cfg.beta)

    theta = theta_ref.clone().requires_grad_(True)
    opt = torch.optim.Adam([theta], lr=cfg.lr)
    sched = (torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=cfg.steps) if cfg.schedule == "cosine" else None)
    gen = torch.Generator().manual_seed(_seed(*cfg.seeds, 1))
    per_method = len(cfg.samplers) * len(cfg.seeds)  # runs are method-major: each method owns a block of runs
    run_index = torch.arange(n_runs)[:, None].expand(n_runs, B)
    tv_hist, kl_hist = [], []

    def record(tok):
        lp = seq_logp(tok.detach())
        tv_hist.append(total_variation(lp, log_opt))
        kl_hist.append(kl_divergence(lp, log_opt))
        return lp

    current = record(token_logp(theta.detach()))
    for _ in range(cfg.steps):
        # groups: G prompts per run drawn uniformly, k responses each from the run's sampler (exact inverse CDF)
        x = torch.randint(P, (n_runs, G), generator=gen).repeat_interleave(k, -1)  # [n_runs, B]
        log_mu_seq = torch.where(on_policy[:, None, None], current, log_fixed)  # [n_runs, P, N]
        cdf = torch.cumsum(log_mu_seq.exp(), -1)[run_index, x]  # [n_runs, B, N]
        u = torch.rand(n_runs, B, 1, generator=gen, dtype=cdf.dtype) * cdf[..., -1:]
        idx = torch.searchsorted(cdf, u).squeeze(-1).clamp(max=N - 1)
        pair = x * N + idx  # [n_runs, B] index into the enumeration
        tok = token_logp(theta)
        log_prob = tok[run_index, pair]  # [n_runs, B, T], carries the gradient
        with torch.no_grad():
            mask = ex_mask[pair]
            rewards = ex_reward[pair]
            ref_lp = tok_ref[run_index, pair]
            mu_lp = torch.where(on_policy[:, None, None], tok.detach()[run_index, pair], tok_fixed[run_index, pair])
            reg_reward = rewards - cfg.beta * (log_prob - ref_lp).sum(-1)  # R - beta log(pi/pi_ref)
            adv = rloo(reg_reward, k)[..., None] * mask
        total = 0.0
        for i, m in enumerate(cfg.methods):
            rows = slice(i * per_method, (i + 1) * per_method)

            def flat(t):
                return t[rows].reshape(per_method * B, *t.shape[2:])

            fn = estimators.get(m)
            if m == "gvpo":  # pi_ref' = pi_ref, frozen: old_log_prob is the reference's, not the sampler's
                loss, _ = fn(flat(log_prob), flat(ref_lp), flat(adv), flat(mask), rewards=flat(rewards),
                             group_size=k, beta=cfg.beta)
            else:
                loss, _ = fn(flat(log_prob), flat(mu_lp), flat(adv), flat(mask), loss_agg_mode=cfg.loss_agg_mode)
            total = total + loss * per_method  # each loss is a mean over its runs' rows: back to one run's scale
        opt.zero_grad()
        total.backward()
        opt.step()
        if sched is not None:
            sched.step()
        with torch.no_grad():
            current = record(token_logp(theta))

    tv = torch.stack(tv_hist).numpy()  # [steps + 1, n_runs]
    kl = torch.stack(kl_hist).numpy()
    frames = []
    for r, (m, s, seed) in enumerate(runs):
        for metric, arr in (("tv", tv), ("kl_to_opt", kl)):
            frames.append(pd.DataFrame({"method": m, "sampler": s, "seed": seed, "step": np.arange(cfg.steps + 1),
                                        "metric": metric, "value": arr[:, r]}))
    # the final distributions of the first seed, with pi* and pi_ref, for the distribution figure
    labels = ["".join(str(int(t)) for t in row) for row in ex_tokens[:N]]
    seed0 = cfg.seeds[0]
    dist_runs = [(r, m, s) for r, (m, s, seed) in enumerate(runs) if seed == seed0]
    r0 = dist_runs[0][0]
    frames.append(_dist_frame("pi*", "-", seed0, cfg.steps, log_opt[r0], labels))
    frames.append(_dist_frame("pi_ref", "-", seed0, 0, log_ref[r0], labels))
    for r, m, s in dist_runs:
        frames.append(_dist_frame(m, s, seed0, cfg.steps, current[r], labels))
    results = pd.concat(frames, ignore_index=True)
    results["prompt"] = results["prompt"].fillna(-1).astype(int)
    results["response"] = results["response"].fillna("")
    return OptimumResult(cfg, results, summarise(results, cfg))


def _dist_frame(method, sampler, seed, step, log_p, labels) -> pd.DataFrame:
    P, N = log_p.shape
    return pd.DataFrame({"method": method, "sampler": sampler, "seed": seed, "step": step, "metric": "prob",
                         "value": log_p.exp().reshape(-1).numpy(), "prompt": np.repeat(np.arange(P), N),
                         "response": labels * P})


def final_values(results: pd.DataFrame, metric: str = "tv") -> pd.DataFrame:
    """One row per (method, sampler, seed): the metric after the last step."""
    rows = results[results["metric"] == metric]
    last = rows["step"].max()
    return rows[rows["step"] == last][["method", "sampler", "seed", "value"]]


def final_intervals(results: pd.DataFrame, ci: float = 0.95, n_boot: int = 1000) -> dict:
    """{method: {sampler: {mean, lo, hi, per_seed}}} of the final TV: percentile bootstrap over seeds (fixed rng,
    so the summary and the figure show the same intervals)."""
    fin = final_values(results, "tv")
    seeds = sorted(pd.unique(fin["seed"]))
    counts = stats.bootstrap_counts(len(seeds), n_boot, np.random.default_rng(0))
    out = {}
    for m in _methods(results):
        out[m] = {}
        for s in _samplers(results):
            v = fin[(fin["method"] == m) & (fin["sampler"] == s)].sort_values("seed")["value"].to_numpy()
            mean, lo, hi = stats.mean_interval(v, counts, ci)
            out[m][s] = {"mean": mean, "lo": lo, "hi": hi, "per_seed": [float(a) for a in v]}
    return out


def summarise(results: pd.DataFrame, cfg: OptimumConfig) -> dict:
    """final_tv[method][sampler] = {mean, lo, hi, per_seed}, the TV at the start, and the one-line headline."""
    out = final_intervals(results, cfg.ci, cfg.n_boot)
    start = float(results[(results["metric"] == "tv") & (results["step"] == 0)]["value"].mean())
    return {"study": "gvpo_optimum", "env": cfg.env, "beta": cfg.beta, "steps": cfg.steps,
            "group_size": cfg.group_size, "seeds": list(cfg.seeds), "tv_at_start": start,
            "headline": headline(out, cfg), "final_tv": out}


def headline(final_tv: dict, cfg: OptimumConfig) -> str:
    """One line: GVPO's worst final TV over samplers, and the other methods' from the last fixed sampler."""
    fmt = "{:.2g}".format
    parts = []
    if "gvpo" in final_tv:
        worst = max(final_tv["gvpo"][s]["mean"] for s in cfg.samplers)
        parts.append(f"GVPO ends within TV {fmt(worst)} of π* from every sampler, with no importance weights")
    off = [s for s in cfg.samplers if s != "on_policy"]
    others = [m for m in final_tv if m != "gvpo"]
    if off and others:
        s = off[-1]
        gv = f"gvpo {fmt(final_tv['gvpo'][s]['mean'])}, " if "gvpo" in final_tv else ""
        parts.append(f"from {SAMPLER_WORDS.get(s, s)} samples: {gv}"
                     + ", ".join(f"{m} {fmt(final_tv[m][s]['mean'])}" for m in others))
    return f"{'; '.join(parts)} ({cfg.steps} steps, β = {cfg.beta:g})"


SAMPLER_WORDS = {"on_policy": "on-policy", "reference": "π_ref", "tempered": "tempered π_ref", "uniform": "uniform"}


# ---- what the report shows ------------------------------------------------------------------------------------

def _iv(e: dict) -> str:
    return f"{e['mean']:.3f} [{e['lo']:.3f}, {e['hi']:.3f}]"


def answer(summary: dict, config: dict) -> str:
    """Markdown: final TV(pi, pi*) per method and sampler with intervals over seeds (lowest in bold), and bullets."""
    ft = summary["final_tv"]
    methods, samplers = list(ft), list(next(iter(ft.values())))
    overrides = config.get("env_overrides") or {}
    env = config["env"] + (f" ({', '.join(f'{k}={v}' for k, v in overrides.items())})" if overrides else "")
    lines = [f"**Setup.** `{env}`, a prefix-tree policy, β = {config['beta']:g}. Every method starts at π_ref and "
             f"takes {config['steps']} Adam steps (lr {config['lr']:g}, {config.get('schedule', 'constant')}) on "
             f"{config['groups_per_step']} groups of k = {config['group_size']} responses per step; "
             f"{len(summary['seeds'])} seeds, each with its own π_ref and samples. Truth: π* = π_ref exp(R/β)/Z by "
             f"enumeration; TV(π_ref, π*) = {summary['tv_at_start']:.2f} at the start.", "",
             "**Final TV(π, π*)**, mean over seeds [95% bootstrap interval]; 0 is the optimum, lowest per sampler in "
             "bold:", "",
             "| method | " + " | ".join(SAMPLER_LABELS.get(s, s) for s in samplers) + " |",
             "|---|" + "---:|" * len(samplers)]
    best = {s: min(methods, key=lambda m: ft[m][s]["mean"]) for s in samplers}
    for m in methods:
        cells = [(f"**{_iv(ft[m][s])}**" if best[s] == m else _iv(ft[m][s])) for s in samplers]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines.append("")
    if "gvpo" in ft:
        worst = max(ft["gvpo"][s]["hi"] for s in samplers)
        lines.append(f"- **GVPO lands on π* whichever distribution the groups came from** (upper interval bound "
                     f"{worst:.3f} over all samplers), with no importance weights: Theorems 1 and 2.")
        for s in [s for s in samplers if s != "on_policy"]:
            others = [m for m in methods if m != "gvpo"]
            if others:
                g = ft["gvpo"][s]
                text = ", ".join(f"{m} {ft[m][s]['mean']:.3f} ({ft[m][s]['mean'] / max(g['mean'], 1e-12):.0f}× "
                                 f"GVPO's)" for m in others)
                lines.append(f"- From {SAMPLER_WORDS.get(s, s)} samples the alternatives end at {text}.")
    if "on_policy" in samplers:
        on = [ft[m]["on_policy"]["mean"] for m in methods]
        lines.append(f"- On-policy every method is REINFORCE on the KL-regularised reward up to constants (all "
                     f"importance ratios are 1) and they end close together: {min(on):.3f} to {max(on):.3f}.")
    return "\n".join(lines).replace("π*", "π\\*")  # a bare * would open emphasis in markdown


def _color(method: str, methods: list) -> str:
    if method in METHOD_COLORS:
        return METHOD_COLORS[method]
    return FALLBACK_COLORS[methods.index(method) % len(FALLBACK_COLORS)]


def _methods(results: pd.DataFrame) -> list:
    curves = results[results["metric"] == "tv"]
    return list(pd.unique(curves["method"]))


def _samplers(results: pd.DataFrame) -> list:
    curves = results[results["metric"] == "tv"]
    return list(pd.unique(curves["sampler"]))


def _log_y(ax) -> None:
    """Log y with plain-number tick labels (0.01, 0.2); minor ticks labelled too when the data span < 1 decade.

    Call after plotting (it reads the autoscaled limits)."""
    ax.set_yscale("log")
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    lo, hi = ax.get_ylim()
    ax.yaxis.set_major_formatter(plain)
    ax.yaxis.set_minor_formatter(plain if hi / lo < 10 else NullFormatter())


def final_tv_figure(results: pd.DataFrame, ci: float = 0.95, n_boot: int = 1000) -> Figure:
    """Final TV(pi, pi*) per sampler (x) and method (markers), mean over seeds with a bootstrap interval; log y."""
    methods, samplers = _methods(results), _samplers(results)
    table = final_intervals(results, ci, n_boot)
    fig = Figure(figsize=(9, 4.2), layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(methods)
    for j, m in enumerate(methods):
        for i, s in enumerate(samplers):
            e = table[m][s]
            xpos = i - 0.4 + width * (j + 0.5)
            ax.errorbar([xpos], [e["mean"]], yerr=[[e["mean"] - e["lo"]], [e["hi"] - e["mean"]]], fmt="o", ms=7,
                        color=_color(m, methods), capsize=4, label=m if i == 0 else None)
            ax.scatter(np.full(len(e["per_seed"]), xpos), e["per_seed"], s=10, color=_color(m, methods), alpha=0.35,
                       zorder=1)
    ax.set_xticks(range(len(samplers)), [SAMPLER_LABELS.get(s, s) for s in samplers])
    _log_y(ax)
    ax.set_ylabel("final TV(π, π*)  (log scale)")
    ax.set_xlabel("where the sampled groups came from")
    ax.grid(True, axis="y", alpha=0.3, which="both")
    ax.legend(title="method", loc="best", fontsize=9)
    ax.set_title("Distance to the KL-constrained optimum after training (dots: seeds; bars: 95% interval)")
    return fig


def tv_curves_figure(results: pd.DataFrame, metric: str = "tv") -> Figure:
    """TV(pi, pi*) (or KL) against Adam steps, one panel per sampler: median over seeds, band min to max; log y."""
    rows = results[results["metric"] == metric]
    methods, samplers = _methods(results), _samplers(results)
    fig = Figure(figsize=(4.2 * len(samplers), 3.8), layout="constrained")
    axes = fig.subplots(1, len(samplers), sharey=True, squeeze=False)[0]
    for ax, s in zip(axes, samplers):
        for m in methods:
            wide = rows[(rows["method"] == m) & (rows["sampler"] == s)].pivot(index="step", columns="seed",
                                                                              values="value")
            c = _color(m, methods)
            ax.plot(wide.index, wide.median(1), color=c, label=m, lw=1.6)
            ax.fill_between(wide.index, wide.min(1), wide.max(1), color=c, alpha=0.15, lw=0)
        ax.set_title(SAMPLER_LABELS.get(s, s))
        ax.set_xlabel("Adam step")
        ax.grid(True, alpha=0.3, which="both")
    for ax in axes:  # after every panel is drawn: the y limits are shared
        _log_y(ax)
    axes[0].set_ylabel("TV(π, π*)" if metric == "tv" else "KL(π ‖ π*)")
    axes[-1].legend(title="method", fontsize=9, loc="lower left")
    return fig


def distribution_figure(results: pd.DataFrame, prompt: int = 0, top: int = 12, sampler: str | None = None) -> Figure:
    """Learned pi(y|x) against the closed form pi*(y|x) for one prompt (first seed).

    Left: the ``top`` most likely responses under pi*, bars for pi* and pi_ref, one marker per method (trained on
    ``sampler``'s groups; default: the last fixed sampler). Right: every response, learned against pi* (log-log),
    with the diagonal where they agree.
    """
    d = results[(results["metric"] == "prob") & (results["prompt"] == prompt)]
    samplers = [s for s in _samplers(results)]
    sampler = sampler or ([s for s in samplers if s != "on_policy"] or samplers)[-1]
    opt = d[d["method"] == "pi*"].set_index("response")["value"]
    ref = d[d["method"] == "pi_ref"].set_index("response")["value"]
    order = opt.sort_values(ascending=False).index[:top]
    methods = _methods(results)
    fig = Figure(figsize=(12, 4.2), layout="constrained")
    ax, ax2 = fig.subplots(1, 2, width_ratios=[1.6, 1])
    xs = np.arange(len(order))
    ax.bar(xs - 0.2, opt[order], width=0.4, color="#444", alpha=0.8, label="π* (closed form)")
    ax.bar(xs + 0.2, ref[order], width=0.4, color="#bbb", label="π_ref (start)")
    for j, m in enumerate(methods):
        learned = d[(d["method"] == m) & (d["sampler"] == sampler)].set_index("response")["value"]
        ax.scatter(xs + (j - (len(methods) - 1) / 2) * 0.12, learned[order], color=_color(m, methods), zorder=3,
                   s=28, marker="o", edgecolor="white", linewidth=0.5, label=f"{m} (learned)")
        ax2.scatter(opt[learned.index], learned, color=_color(m, methods), s=10, alpha=0.7, label=m)
    ax.set_xticks(xs, list(order), rotation=45, ha="right", fontsize=8)
    ax.set_xlabel("response (tokens), the most likely under π* first")
    ax.set_ylabel(f"probability given prompt {prompt}")
    ax.set_title(f"Learned vs closed form, groups from {SAMPLER_LABELS.get(sampler, sampler)}")
    ax.legend(fontsize=8, ncol=2)
    ax.grid(True, axis="y", alpha=0.3)
    lo = max(float(opt.min()), 1e-12)
    ax2.plot([lo, 1], [lo, 1], color="k", lw=0.8, ls="--")
    ax2.set_xscale("log")
    ax2.set_yscale("log")
    ax2.set_xlabel("π*(y|x)")
    ax2.set_ylabel("learned π(y|x)")
    ax2.set_title("All responses (diagonal: exact agreement)")
    ax2.grid(True, alpha=0.3, which="both")
    return fig
