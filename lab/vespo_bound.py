"""VESPO's variance bound (Proposition 3.1) checked exactly, and VESPO against sequence IS as rollouts go stale.

Proposition 3.1 (Shen et al., arXiv 2602.10693). For a reshaping kernel phi with K = sup_w phi(w)/w < inf and the
implicit proposal Q = mu phi(W) / Z, Z = E_mu[phi(W)]:

    E_mu[phi(W)^2] <= Z K C,   C = E_Q[W] = E_mu[phi(W) W] / Z,   so  Z K C = K E_mu[phi(W) W].

Proof in one line: phi(w) <= K w pointwise, multiply by phi(w) >= 0 and take E_mu. It holds for ANY mu and pi,
so a violation can only come from an implementation that does not evaluate phi and W consistently. The ratio
E_mu[phi^2] / (Z K C) in (0, 1] measures tightness: 1 when mu puts all its mass where phi(w)/w peaks,
w = (k-1)/lambda (for the (3, 2) kernel that is w = 1: on-policy the bound holds with equality).

Everything here is exact: the toy env's (prompt, response) pairs are enumerated with their probabilities
mu(y)/P in float64, and W uses the estimator's own numerics (``lab.estimators.vespo.sequence_log_weight``: token
log-ratios clamped to [-20, 20], summed, L clamped to [-20, 20]; ``sequence_coefficient``: the reference's
log-space phi), so the check is of the function the estimator applies. Staleness knobs come from
``lab.staleness``: lag (snapshots of a real Adam trajectory, as in the variance engine, same seeds), per-token KL
targets and sampler temperature. The only way the estimator's phi can leave the bound is the reference's floor
log W >= log 1e-8 with k = 1 (phi(w)/w > e^lambda for L < -18.42): ``floor_mass`` = mu(L < -18.42) is reported
with every setting. For k < 1 there is no K (phi(w)/w -> inf as w -> 0): those kernels are reported
with K = inf and no ratio.

The second half runs the variance engine (``lab.variance.run_study``) on sequence IS, VESPO, PPO clip and REINFORCE
at lags up to 64, plus one study with advantage "reward" for VESPO's exact expected-gradient bias, and draws
the report's figures (one function per figure, each returning a ``matplotlib.figure.Figure``).
"""
from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import torch
from matplotlib.figure import Figure

import toy_envs
from lab.errors import LabError
from lab.figures import KIND_LABELS, staleness_axis
from lab.estimators import vespo as V
from lab.estimators.aggregation import target_scale
from lab.exact import divergence, exact_support, policy_gradient
from lab.gradients import expected_gradient
from lab.policies import init_params, make_policy, token_log_probs
from lab.staleness import behaviour_params, check_value, optimisation_trajectory
from lab.variance import VarianceConfig, _seed, grad_scale, run_study

DEFAULT_KERNELS = ([2.0, 3.0], [3.0, 2.0], [1.0, 1.0], [1.0, 3.0], [1.5, 1.0], [2.0, 1.0], [4.0, 2.0], [0.5, 1.0])
TOLERANCE = 1e-9  # float64 rounding: a ratio above 1 + TOLERANCE counts as a violation
VARIANCE_ESTIMATORS = ("vespo", "seq_is", "ppo_clip", "reinforce")  # this order gives lab.figures' colours below
COLORS = {"vespo": "#1f77b4", "seq_is": "#d62728", "ppo_clip": "#2ca02c", "reinforce": "#ff7f0e"}
POS_COLOR, NEG_COLOR = "#1f77b4", "#ff7f0e"


def kernel_label(k: float, lam: float) -> str:
    return f"k={k:g}, λ={lam:g}"


# ---- exact second moments ---------------------------------------------------------------------------------

def sequence_log_weights(policy, theta_pi, theta_mu, support_mu) -> torch.Tensor:
    """L(y) for every pair of mu's support, with the estimator's clamps (float64, [N])."""
    with torch.no_grad():
        lp_pi = token_log_probs(policy, theta_pi.double(), support_mu.prompts, support_mu.tokens) * support_mu.mask
        lp_mu = token_log_probs(policy, theta_mu.double(), support_mu.prompts, support_mu.tokens) * support_mu.mask
        L, _ = V.sequence_log_weight(lp_pi, lp_mu, support_mu.mask)
    return L[:, 0]


def bound_terms(L: torch.Tensor, weights: torch.Tensor, k: float, lam: float) -> dict:
    """Proposition 3.1's terms for sequence log-weights ``L`` with probabilities ``weights`` under mu (exact).

    Returns Z = E_mu[phi], C = E_Q[W], K, phi2 = E_mu[phi^2], bound = Z K C, ratio = phi2 / bound (NaN where K =
    inf), w2 = E_mu[W^2] (sequence IS's second moment, for scale) and floor_mass = mu(L < log 1e-8), the mass
    where the reference's floor inside log W is active.
    """
    V.check_kernel(k, lam)
    L, w = L.double(), weights.double()
    W = torch.exp(L)
    ph = V.sequence_coefficient(L, k, lam)
    Z = float((w * ph).sum())
    phiW = float((w * ph * W).sum())
    phi2 = float((w * ph**2).sum())
    K = V.bound_constant(k, lam)
    bound = K * phiW if math.isfinite(K) else math.inf
    return {"Z": Z, "C": phiW / Z if Z > 0 else math.nan, "K": K, "phi2": phi2, "bound": bound,
            "ratio": phi2 / bound if math.isfinite(bound) and bound > 0 else math.nan,
            "w2": float((w * W**2).sum()), "floor_mass": float(w[L < V.LOG_W_FLOOR].sum())}


@dataclass
class BoundConfig:
    """The exact bound check: every (seed, staleness setting, kernel). Defaults build in seconds."""

    env: str = "tiny_target"  # toy_envs preset (must be enumerable)
    env_overrides: dict = field(default_factory=dict)
    policy: str = "prefix"
    kernels: list = field(default_factory=lambda: [list(k) for k in DEFAULT_KERNELS])  # [k, lambda] pairs
    lags: list = field(default_factory=lambda: [0, 1, 2, 4, 8, 16, 32, 64])
    kl_targets: list = field(default_factory=lambda: [0.01, 0.03, 0.1, 0.3, 1.0])
    temperatures: list = field(default_factory=lambda: [0.5, 0.7, 1.5, 2.0])
    seeds: list = field(default_factory=lambda: [0, 1, 2])  # one random initial policy and trajectory each
    init_scale: float = 1.0
    trajectory_steps: int = 64
    lr: float = 0.05

    def validate(self):
        env = toy_envs.make(self.env, **self.env_overrides)
        env.check_enumerable()
        make_policy(self.policy, env)
        if not self.kernels:
            raise LabError("give at least one (k, lambda) kernel")
        for kern in self.kernels:
            if len(kern) != 2:
                raise LabError(f"a kernel is a pair [k, lambda], got {kern!r}")
            V.check_kernel(float(kern[0]), float(kern[1]))
        for kind, values in (("lag", self.lags), ("kl", self.kl_targets), ("temperature", self.temperatures)):
            for v in values:
                check_value(kind, float(v), self.trajectory_steps)
        if not (self.lags or self.kl_targets or self.temperatures):
            raise LabError("give at least one staleness setting (lags, kl_targets or temperatures)")
        if not self.seeds:
            raise LabError("give at least one seed")
        return env


def bound_study(cfg: BoundConfig) -> pd.DataFrame:
    """Wide table: one row per (seed, staleness kind, value, kernel) with the exact terms of ``bound_terms``."""
    env = cfg.validate()
    policy = make_policy(cfg.policy, env)
    rows = []
    for seed in cfg.seeds:
        gen = torch.Generator().manual_seed(_seed(seed, 0))  # the variance engine's trajectory for this seed
        theta0 = init_params(policy, cfg.init_scale, gen)
        traj = optimisation_trajectory(env, policy, theta0, cfg.trajectory_steps, cfg.lr, "exact",
                                       toy_envs.DEFAULT_ENUM_LIMIT, 0, gen)
        pi = traj.current
        settings = [("lag", v) for v in cfg.lags] + [("kl", v) for v in cfg.kl_targets] + \
                   [("temperature", v) for v in cfg.temperatures]
        for i, (kind, value) in enumerate(settings):
            g = torch.Generator().manual_seed(_seed(seed, 5, i))
            mu = behaviour_params(kind, float(value), traj, env, policy, g, "exact", toy_envs.DEFAULT_ENUM_LIMIT, 0)
            support = exact_support(env, policy, mu, toy_envs.DEFAULT_ENUM_LIMIT)
            div = divergence(policy, pi, mu, support)
            L = sequence_log_weights(policy, pi, mu, support)
            for k, lam in cfg.kernels:
                terms = bound_terms(L, support.weights, float(k), float(lam))
                rows.append({"env": env.name, "policy": cfg.policy, "seed": seed, "staleness_kind": kind,
                             "staleness": float(value), "k": float(k), "lam": float(lam),
                             "kernel": kernel_label(float(k), float(lam)), **terms,
                             "kl_token": div["kl_token"], "chi2_seq": div["chi2_seq"]})
    return pd.DataFrame(rows)


def bound_summary(bound: pd.DataFrame) -> dict:
    """Largest ratio over every setting with a finite K, the violation count and the tightest setting per kernel."""
    finite = bound[np.isfinite(bound["ratio"])]
    worst = finite.loc[finite["ratio"].idxmax()]
    per_kernel = {}
    for label, g in bound.groupby("kernel", sort=False):
        ok = g[np.isfinite(g["ratio"])]
        per_kernel[label] = {"K": float(g["K"].iloc[0]),
                             "max_ratio": float(ok["ratio"].max()) if len(ok) else None,
                             "median_ratio": float(ok["ratio"].median()) if len(ok) else None,
                             "min_ratio": float(ok["ratio"].min()) if len(ok) else None}
    off = finite[finite["kl_token"] > 0]
    return {
        "max_bound_ratio": float(finite["ratio"].max()),
        "max_bound_ratio_off_policy": float(off["ratio"].max()) if len(off) else None,
        "violations": int((finite["ratio"] > 1 + TOLERANCE).sum()),
        "settings_checked": int(len(finite)),
        "settings_without_bound": int((~np.isfinite(bound["K"])).sum()),
        "tightest": {"kernel": worst["kernel"], "staleness_kind": worst["staleness_kind"],
                     "staleness": float(worst["staleness"]), "seed": int(worst["seed"]),
                     "ratio": float(worst["ratio"])},
        "per_kernel": per_kernel,
        "max_floor_mass": float(bound["floor_mass"].max()),
    }


def tidy_bound(bound: pd.DataFrame) -> pd.DataFrame:
    """The wide bound table as tidy rows (one per setting x kernel x metric), keyed like the variance results."""
    metrics = ["Z", "C", "K", "phi2", "bound", "ratio", "w2", "floor_mass", "kl_token", "chi2_seq"]
    keys = ["env", "policy", "seed", "staleness_kind", "staleness", "k", "lam", "kernel"]
    long = bound.melt(id_vars=keys, value_vars=metrics, var_name="metric", value_name="value")
    return long.assign(part="bound", estimator="vespo", lo=long["value"], hi=long["value"])


# ---- VESPO against sequence IS (the variance engine) ------------------------------------------------------------

def variance_studies(env: str = "tiny_target", lags=(0, 1, 2, 4, 8, 16, 32, 64), replicates: int = 500,
                     batch_size: int = 64, group_size: int = 8, advantage: str = "rloo",
                     loss_agg_mode: str = "token-mean", seed: int = 0, estimators=VARIANCE_ESTIMATORS,
                     trajectory_steps: int = 64):
    """(main study, exact-bias study): the same lags and estimators; the second uses advantage "reward" so that
    the engine computes each estimator's exact expected gradient E_mu[g] (``exact_bias_norm``)."""
    common = dict(env=env, staleness="lag", values=list(lags), estimators=list(estimators), batch_size=batch_size,
                  group_size=group_size, loss_agg_mode=loss_agg_mode, seed=seed, trajectory_steps=trajectory_steps)
    with warnings.catch_warnings():
        # lab.variance.gram_metrics takes np.nanstd of bootstrap cosines that are all NaN when every batch's
        # gradient is 0 (no batch reached the sparse reward); the interval is NaN either way
        warnings.filterwarnings("ignore", message="Degrees of freedom <= 0", category=RuntimeWarning)
        main = run_study(VarianceConfig(advantage=advantage, replicates=replicates, **common), progress=False)
        with warnings.catch_warnings():  # only its exact_bias_norm is used; its sampled statistics are throwaway
            warnings.simplefilter("ignore", RuntimeWarning)
            exact = run_study(VarianceConfig(advantage="reward", replicates=2, n_boot=10, **common), progress=False)
    return main, exact


def exact_directions(env: str = "tiny_target", lags=(0, 1, 2, 4, 8, 16, 32, 64), seed: int = 0,
                     estimators=VARIANCE_ESTIMATORS, loss_agg_mode: str = "token-mean", policy: str = "prefix",
                     init_scale: float = 1.0, trajectory_steps: int = 64, lr: float = 0.05) -> pd.DataFrame:
    """Per lag and estimator, the exact expected gradient E_mu[g] (advantage = R, by enumeration) against the
    target c ∇J: relative bias ‖E g − c∇J‖ ÷ ‖c∇J‖ (the engine's exact_bias_norm, relative), cosine, and size
    ‖E g‖ ÷ ‖c∇J‖. A shrunken gradient that points the right way has cosine 1 and size < 1: its bias is a step
    size, not a direction. Uses the same trajectory as ``run_study`` with this seed (lag staleness)."""
    env_ = toy_envs.make(env)
    pol = make_policy(policy, env_)
    gen = torch.Generator().manual_seed(_seed(seed, 0))
    theta0 = init_params(pol, init_scale, gen)
    traj = optimisation_trajectory(env_, pol, theta0, trajectory_steps, lr, "exact", toy_envs.DEFAULT_ENUM_LIMIT, 0,
                                   gen)
    pi = traj.current
    g_star = target_scale(loss_agg_mode, env_.length) * policy_gradient(
        env_, pol, pi, exact_support(env_, pol, pi, toy_envs.DEFAULT_ENUM_LIMIT)).reshape(-1)
    rows = []
    for lag in lags:
        check_value("lag", float(lag), trajectory_steps)
        mu = traj.snapshots[trajectory_steps - int(lag)]
        support = exact_support(env_, pol, mu, toy_envs.DEFAULT_ENUM_LIMIT)
        for name in estimators:
            g = expected_gradient(env_, pol, pi, mu, support, name, loss_agg_mode, {})
            if g is None:
                raise LabError(f"loss_agg_mode {loss_agg_mode!r} is not separable on {env!r}; no exact expectation")
            g = g / grad_scale(name, {})
            rows.append({"lag": float(lag), "estimator": name,
                         "rel_bias": float((g - g_star).norm() / g_star.norm()),
                         "cos": float(g @ g_star / (g.norm() * g_star.norm())) if g.norm() > 0 else math.nan,
                         "size": float(g.norm() / g_star.norm())})
    return pd.DataFrame(rows)


def _metric(results: pd.DataFrame, metric: str, estimator: str) -> pd.DataFrame:
    rows = results[(results["metric"] == metric) & (results["estimator"] == estimator)]
    return rows.set_index("staleness")[["value", "lo", "hi"]].sort_index()


def comparison(main: pd.DataFrame, exact: pd.DataFrame, directions: pd.DataFrame | None = None) -> pd.DataFrame:
    """Per lag: KL, ESS, VESPO's and sequence IS's relative MSE / variance with intervals, every estimator's exact
    bias (relative to ‖∇J‖; from ``exact``, the engine's advantage-"reward" study), its exact cosine and size
    (from ``directions``, if given) and the verdict: the lower MSE where the 95% intervals do not overlap."""
    kl, ess = _metric(main, "kl_token", "-"), _metric(main, "ess_frac", "-")
    norm2 = (_metric(main, "mse", "vespo")["value"] / _metric(main, "rel_mse", "vespo")["value"])
    out = []
    for s in kl.index:
        row = {"lag": s, "kl_token": kl.loc[s, "value"], "ess_frac": ess.loc[s, "value"]}
        for e in ("vespo", "seq_is"):
            for m in ("rel_mse", "variance", "cos_mean"):
                r = _metric(main, m, e).loc[s]
                scale = norm2.loc[s] if m == "variance" else 1.0
                row.update({f"{e}_{m}": r["value"] / scale, f"{e}_{m}_lo": r["lo"] / scale,
                            f"{e}_{m}_hi": r["hi"] / scale})
        for e in ("vespo", "seq_is", "ppo_clip", "reinforce"):
            eb = _metric(exact, "exact_bias_norm", e)
            if len(eb):
                row[f"{e}_exact_bias"] = eb.loc[s, "value"] / math.sqrt(norm2.loc[s])
            if directions is not None:
                d = directions[(directions["lag"] == s) & (directions["estimator"] == e)]
                if len(d):
                    row[f"{e}_exact_cos"], row[f"{e}_exact_size"] = float(d["cos"].iloc[0]), float(d["size"].iloc[0])
        if row["vespo_rel_mse_hi"] < row["seq_is_rel_mse_lo"]:
            row["verdict"] = "VESPO lower"
        elif row["seq_is_rel_mse_hi"] < row["vespo_rel_mse_lo"]:
            row["verdict"] = "seq IS lower"
        else:
            row["verdict"] = "equal" if row["vespo_rel_mse"] == row["seq_is_rel_mse"] else "unresolved"
        out.append(row)
    return pd.DataFrame(out)


def variance_summary(comp: pd.DataFrame) -> dict:
    """The headline numbers of the comparison for summary.json."""
    per_lag = {}
    for _, r in comp.iterrows():
        per_lag[f"{r['lag']:g}"] = {
            "kl_token": r["kl_token"], "ess_frac": r["ess_frac"], "verdict": r["verdict"],
            **{f"{e}_{m}": [r[f"{e}_{m}"], r[f"{e}_{m}_lo"], r[f"{e}_{m}_hi"]]
               for e in ("vespo", "seq_is") for m in ("rel_mse", "variance")},
            **{c: r[c] for c in comp.columns if c.endswith(("_exact_bias", "_exact_cos", "_exact_size"))}}
    last = comp.iloc[-1]
    return {"vespo_lower_mse_at_lags": [float(v) for v in comp.loc[comp["verdict"] == "VESPO lower", "lag"]],
            "seq_is_lower_mse_at_lags": [float(v) for v in comp.loc[comp["verdict"] == "seq IS lower", "lag"]],
            "max_lag": float(last["lag"]),
            "mse_ratio_vespo_over_seq_is_at_max_lag": float(last["vespo_rel_mse"] / last["seq_is_rel_mse"]),
            "per_lag": per_lag}


# ---- what the report shows ----------------------------------------------------------------------------------

def headline(bsum: dict, vsum: dict) -> str:
    last = vsum["per_lag"][f"{vsum['max_lag']:g}"]
    return (f"Prop. 3.1 never violated ({bsum['violations']} of {bsum['settings_checked']} exact settings; max "
            f"E[φ²]/(ZKC) = {bsum['max_bound_ratio']:.3f}); lag {vsum['max_lag']:g}: MSE÷‖∇J‖² VESPO "
            f"{last['vespo_rel_mse'][0]:.3g} vs seq IS {last['seq_is_rel_mse'][0]:.3g}") \
        if bsum["violations"] == 0 else \
        (f"Prop. 3.1 VIOLATED in {bsum['violations']} of {bsum['settings_checked']} settings "
         f"(max E[φ²]/(ZKC) = {bsum['max_bound_ratio']:.3f})")


def answer(bound: pd.DataFrame, bsum: dict, comp: pd.DataFrame) -> str:
    """The report's at-a-glance markdown."""
    n_kernels = bound[np.isfinite(bound["K"])]["kernel"].nunique()
    t = bsum["tightest"]
    kinds = ", ".join(sorted(bound["staleness_kind"].unique()))
    lines = ["**Is the bound ever violated?** "
             + ("**No.** " if bsum["violations"] == 0 else f"**Yes, {bsum['violations']} times.** ")
             + f"E_μ[φ(W)²] ≤ Z·K·C held in all {bsum['settings_checked']} exact settings ({n_kernels} kernels with "
               f"finite K × staleness knobs {kinds} × {bound['seed'].nunique()} random policies), computed by "
               f"enumerating every response in float64 with the estimator's own clamps.", "",
             f"**How tight is it?** The largest ratio E_μ[φ²]/(ZKC) is **{bsum['max_bound_ratio']:.4f}** "
             f"({t['kernel']}, {t['staleness_kind']} = {t['staleness']:g})"
             + (f"; off-policy (KL(μ‖π) > 0) it is {bsum['max_bound_ratio_off_policy']:.4f}"
                if bsum.get("max_bound_ratio_off_policy") is not None else "")
             + ". The bound is tight only when μ's "
             "weights sit where φ(w)/w peaks, w = (k−1)/λ: for the A<0 kernel (k=3, λ=2) that is w = 1, so it is "
             "exact on-policy and loosens as μ drifts; for the A≥0 kernel (k=2, λ=3) the peak is at w = 1/3 and the "
             "ratio starts at 1/K = 3/e² = 0.41.", ""]
    lines += ["| kernel | K | largest ratio | median ratio |", "|---|---|---|---|"]
    for label, v in bsum["per_kernel"].items():
        if v["max_ratio"] is None:
            lines.append(f"| {label} | ∞ | no bound (k < 1) | – |")
        else:
            lines.append(f"| {label} | {v['K']:.4g} | {v['max_ratio']:.4f} | {v['median_ratio']:.3f} |")
    lines.append("")
    better = comp[comp["verdict"] == "VESPO lower"]["lag"].tolist()
    worse = comp[comp["verdict"] == "seq IS lower"]["lag"].tolist()
    open_ = comp[comp["verdict"] == "unresolved"]["lag"].tolist()
    last = comp.iloc[-1]
    fmt = lambda xs: ", ".join(f"{x:g}" for x in xs) or "none"  # noqa: E731
    iv = lambda e: (f"{last[f'{e}_rel_mse']:.3g} [{last[f'{e}_rel_mse_lo']:.3g}, "  # noqa: E731
                    f"{last[f'{e}_rel_mse_hi']:.3g}]")
    lines += ["**Where does VESPO beat sequence IS?** MSE ÷ ‖∇J‖² on the same batches, lower where the 95% intervals "
              "do not overlap (details in the table below):", "",
              f"- VESPO lower at lags **{fmt(better)}**; sequence IS lower at lags **{fmt(worse)}**; not resolved at "
              f"lags {fmt(open_)}"
              + (" (lag 0 is on-policy: both are REINFORCE)." if 0 in comp["lag"].tolist() else "."),
              f"- At lag {last['lag']:g} (KL(μ‖π) {last['kl_token']:.2g} nats/token, ESS {last['ess_frac']:.0%}): "
              f"VESPO {iv('vespo')} against sequence IS {iv('seq_is')}."]
    if "vespo_exact_bias" in comp:
        c = comp.set_index("lag")
        lines.append("- **The price is bias.** VESPO's exact expected gradient (advantage = R) misses ∇J by "
                     + ", ".join(f"{v:.0%}" for v in c["vespo_exact_bias"]) + f" of its norm at lags {fmt(c.index)}; "
                     f"sequence IS by {c['seq_is_exact_bias'].abs().max():.0%} (unbiased up to the |log W| ≤ 20 "
                     "clamp).")
        mid = c[c["vespo_exact_bias"] > 0.05]
        if "vespo_exact_cos" in c and len(mid):
            cos = ", ".join("undefined" if np.isnan(v) else f"{v:.2f}" for v in mid["vespo_exact_cos"])
            lines.append(f"- **Mostly a shorter step, not a wrong direction**: where the bias exceeds 5% (lags "
                         f"{fmt(mid.index)}) cos(E g, ∇J) = {cos} and ‖E g‖ ÷ ‖∇J‖ = "
                         + ", ".join(f"{v:.2g}" for v in mid["vespo_exact_size"]) + ".")
            if (mid["vespo_exact_size"] == 0).any():
                lines[-1] += (" A size of 0 means every rewarded response has φ(W) below the smallest float64 "
                              "(its W is in the thousands): VESPO's expected update vanishes.")
    if last["vespo_rel_mse"] > 0.9:
        lines.append(f"- **At lag {last['lag']:g} VESPO's MSE is close to 1, the MSE of a zero update**: φ shrinks the "
                     f"rare high-weight responses that carry the gradient to almost nothing. It is stable because it "
                     f"barely moves, not because it finds ∇J.")
    return "\n".join(lines)


# ---- figures --------------------------------------------------------------------------------------------------

def kernel_figure(pos=(V.K_POS, V.LAMBDA_POS), neg=(V.K_NEG, V.LAMBDA_NEG)) -> Figure:
    """phi(W) for both advantage signs with its maximum and the line K·W that bounds it; log-scale tails against
    IS's W; the surrogates f(W) whose W f'(W) is phi."""
    fig = Figure(figsize=(13, 4.3), dpi=100, layout="constrained")
    axes = fig.subplots(1, 3)
    w = np.linspace(1e-4, 4.0, 800)
    wl = np.logspace(-4, 3, 600)
    for (k, lam), color, sign, dx in ((pos, POS_COLOR, "A ≥ 0", -4), (neg, NEG_COLOR, "A < 0", 4)):
        K, wm, ws = V.bound_constant(k, lam), V.argmax_phi(k, lam), V.argmax_bound(k, lam)
        ax = axes[0]
        ax.plot(w, V.phi(w, k, lam), color=color, lw=2, label=f"φ for {sign}: {kernel_label(k, lam)}")
        ax.plot(w, K * w, color=color, ls="--", lw=1, label=f"K·W, K = {K:.3g}")
        ax.plot([wm], [V.phi_max(k, lam)], "o", color=color, ms=6)
        ax.annotate(f"max {V.phi_max(k, lam):.3f}\nat W = {wm:.2g}", (wm, V.phi_max(k, lam)),
                    textcoords="offset points", xytext=(dx, 7), fontsize=8, color=color,
                    ha="right" if dx < 0 else "left")
        ax.plot([ws], [V.phi(ws, k, lam)], "s", mfc="white", color=color, ms=6, mew=1.5)
        axes[1].loglog(wl, np.maximum(V.phi(wl, k, lam), 1e-30), color=color, lw=2, label=f"φ for {sign}")
        axes[2].plot(w, V.surrogate(w, k, lam), color=color, lw=2, label=f"f for {sign}")
    ax = axes[0]
    ax.axvline(1, color="#999", lw=0.6)
    ax.set_ylim(0, 1.95)
    ax.set_xlabel("sequence weight W = π(y)/μ(y)")
    ax.set_title(r"the kernel $\varphi(W) = W^k\, e^{\lambda(1-W)}$, $\varphi(1) = 1$", fontsize=10.5)
    ax.plot([], [], "o", color="#555", label="maximum, at W = k/λ")
    ax.plot([], [], "s", mfc="white", color="#555", label="φ = K·W, at W = (k−1)/λ")
    ax.legend(frameon=False, fontsize=7.5, loc="upper right")
    ax = axes[1]
    ax.loglog(wl, wl, color=COLORS["seq_is"], lw=1.5, ls=":", label="sequence IS: W")
    ax.set_ylim(1e-12, 1e3)
    ax.set_xlabel("W (log scale)")
    ax.set_title("tails: φ vanishes at both ends, IS's W grows", fontsize=10.5)
    ax.legend(frameon=False, fontsize=8, loc="lower center")
    ax.grid(True, alpha=0.3)
    ax = axes[2]
    ax.plot(w, w, color=COLORS["seq_is"], lw=1.5, ls=":", label="sequence IS: f(W) = W")
    ax.set_xlabel("W")
    ax.set_title(r"surrogate $f$ with $\varphi = W f'(W)$: $e^\lambda \lambda^{-k} \gamma(k, \lambda W)$",
                 fontsize=10.5)
    ax.legend(frameon=False, fontsize=8)
    for ax in (axes[0], axes[2]):
        ax.grid(True, alpha=0.3)
    fig.suptitle("VESPO's reshaping kernel: the coefficient on A ∇log π as a function of the sequence weight",
                 fontsize=11)
    return fig


def bound_figure(bound: pd.DataFrame) -> Figure:
    """E_mu[phi²] / (Z K C) against each staleness knob, one line per kernel with finite K (median over random
    policies, band: min to max). Every point at or below 1 means the bound held."""
    kinds = [k for k in ("lag", "kl", "temperature") if k in set(bound["staleness_kind"])]
    fig = Figure(figsize=(13, 4.6), dpi=100, layout="constrained")
    axes = np.atleast_1d(fig.subplots(1, len(kinds), sharey=True))
    finite = bound[np.isfinite(bound["K"])]
    labels = list(dict.fromkeys(finite["kernel"]))
    cmap = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"]
    for ax, kind in zip(axes, kinds):
        sub = finite[finite["staleness_kind"] == kind]
        for i, label in enumerate(labels):
            g = sub[sub["kernel"] == label].groupby("staleness")["ratio"]
            med, lo, hi = g.median(), g.min(), g.max()
            default = label in (kernel_label(V.K_POS, V.LAMBDA_POS), kernel_label(V.K_NEG, V.LAMBDA_NEG))
            ax.plot(med.index, med.values, "-o" if default else "-", color=cmap[i % len(cmap)], ms=4,
                    lw=2.2 if default else 1.1, label=label + (" (VESPO)" if default else ""))
            ax.fill_between(med.index, lo.values, hi.values, color=cmap[i % len(cmap)], alpha=0.12, lw=0)
        ax.axhline(1.0, color="black", lw=1.2, ls="--")
        ax.text(0.01, 1.0, " bound: ratio = 1", transform=ax.get_yaxis_transform(), va="bottom", fontsize=8)
        staleness_axis(ax, sub["staleness"], kind)
        ax.set_title(KIND_LABELS[kind].split(" (")[0], fontsize=10)
    axes[0].set_ylabel("E_μ[φ(W)²] ÷ (Z·K·C)")
    axes[0].set_ylim(0, 1.12)
    fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=4, frameon=False, fontsize=8.5)
    fig.suptitle("Proposition 3.1 checked exactly: ratio ≤ 1 everywhere (1 = tight). Line: median over random "
                 "policies; band: min–max", fontsize=11)
    return fig


def second_moment_figure(bound: pd.DataFrame, kind: str = "lag") -> Figure:
    """Against one staleness knob: sequence IS's E_mu[W²] and, for VESPO's two kernels, E_mu[φ²] with its bound
    Z K C (seed 0 of the table, exact)."""
    sub = bound[(bound["staleness_kind"] == kind) & (bound["seed"] == bound["seed"].min())]
    if sub.empty:
        raise LabError(f"the bound table has no {kind!r} rows")
    fig = Figure(figsize=(7.5, 4.0), dpi=100, layout="constrained")
    ax = fig.subplots()
    first = sub.drop_duplicates("staleness").sort_values("staleness")
    ax.plot(first["staleness"], first["w2"], "-s", color=COLORS["seq_is"], lw=2, ms=4,
            label="sequence IS: E_μ[W²] = 1 + χ²")
    for (k, lam), color in (((V.K_POS, V.LAMBDA_POS), POS_COLOR), ((V.K_NEG, V.LAMBDA_NEG), NEG_COLOR)):
        g = sub[(sub["k"] == k) & (sub["lam"] == lam)].sort_values("staleness")
        if g.empty:
            continue
        ax.plot(g["staleness"], g["phi2"], "-o", color=color, lw=2, ms=4,
                label=f"VESPO E_μ[φ²], {kernel_label(k, lam)}")
        ax.plot(g["staleness"], g["bound"], "--", color=color, lw=1.2,
                label=f"its bound Z·K·C (K = {g['K'].iloc[0]:.3g})")
    ax.set_yscale("log")
    staleness_axis(ax, sub["staleness"], kind)
    ax.set_ylabel("second moment of the coefficient under μ")
    ax.legend(frameon=False, fontsize=8)
    ax.set_title("Second moments: the weight IS multiplies by, against VESPO's φ and its bound", fontsize=10.5)
    return fig


def comparison_figure(comp: pd.DataFrame) -> Figure:
    """VESPO against sequence IS per lag: MSE and variance ÷ ‖∇J‖² with 95% intervals; every estimator's exact bias
    ‖E g − ∇J‖ ÷ ‖∇J‖; and VESPO's exact expected gradient split into direction (cosine) and size (‖E g‖ ÷ ‖∇J‖)."""
    has_dir = "vespo_exact_cos" in comp
    fig = Figure(figsize=(14, 3.9), dpi=100, layout="constrained")
    axes = fig.subplots(1, 4 if has_dir else 3)
    x = comp["lag"].to_numpy()
    for ax, m, title in ((axes[0], "rel_mse", "MSE ÷ ‖∇J‖²"), (axes[1], "variance", "variance tr Cov(g) ÷ ‖∇J‖²")):
        for e, name in (("seq_is", "sequence IS"), ("vespo", "VESPO")):
            ax.plot(x, comp[f"{e}_{m}"], "-o", color=COLORS[e], lw=2, ms=4, label=name)
            ax.fill_between(x, comp[f"{e}_{m}_lo"], comp[f"{e}_{m}_hi"], color=COLORS[e], alpha=0.15, lw=0)
        ax.set_yscale("log")
        ax.set_title(title, fontsize=10)
    axes[0].axhline(1.0, color="black", lw=0.8, ls=":")
    axes[0].text(0.01, 1.0, " a zero update", transform=axes[0].get_yaxis_transform(), va="bottom", fontsize=8)
    ax = axes[2]
    for e in ("seq_is", "vespo", "ppo_clip", "reinforce"):
        col = f"{e}_exact_bias"
        if col in comp:
            ax.plot(x, comp[col], "-o", color=COLORS[e], lw=2 if e in ("vespo", "seq_is") else 1.2, ms=4, label=e)
    ax.set_ylim(-0.03, 1.1)
    ax.set_title("exact bias ‖E_μ g − ∇J‖ ÷ ‖∇J‖", fontsize=10)
    ax.legend(frameon=False, fontsize=8)
    if has_dir:
        ax = axes[3]
        for e, ls in (("vespo", "-"), ("ppo_clip", "--")):
            if f"{e}_exact_cos" in comp:
                ax.plot(x, comp[f"{e}_exact_cos"], ls, marker="o", color=COLORS[e], lw=1.8, ms=4,
                        label=f"{e}: cos(E g, ∇J)")
                ax.plot(x, comp[f"{e}_exact_size"], ls, marker="s", mfc="white", color=COLORS[e], lw=1.2, ms=4,
                        label=f"{e}: ‖E g‖ ÷ ‖∇J‖")
        ax.set_ylim(-0.05, 1.15)
        ax.set_title("is the bias a direction or a step size?", fontsize=10)
        ax.legend(frameon=False, fontsize=7.5, loc="lower left")
    for ax in axes:
        staleness_axis(ax, x, "lag")
        ax.set_xlabel("lag (optimiser steps)")
    axes[0].legend(frameon=False, fontsize=8)
    fig.suptitle("VESPO against sequence IS as rollouts go stale (shaded: 95% bootstrap interval over batches; "
                 "exact panels: advantage = R, by enumeration)", fontsize=11)
    return fig


def comparison_table(comp: pd.DataFrame):
    """Per lag: KL, ESS, MSE ÷ ‖∇J‖² of VESPO and sequence IS with intervals, VESPO's exact bias, the verdict."""
    rows = []
    for _, r in comp.iterrows():
        row = {"lag": f"{r['lag']:g}", "KL(μ‖π)/token": f"{r['kl_token']:.2g}", "ESS": f"{r['ess_frac']:.0%}"}
        for e, name in (("vespo", "VESPO"), ("seq_is", "seq IS")):
            row[f"{name} MSE"] = f"{r[f'{e}_rel_mse']:.3g} [{r[f'{e}_rel_mse_lo']:.3g}, {r[f'{e}_rel_mse_hi']:.3g}]"
        if "vespo_exact_bias" in comp:
            row["VESPO exact bias"] = f"{r['vespo_exact_bias']:.0%}"
        row["verdict"] = r["verdict"]
        rows.append(row)
    table = pd.DataFrame(rows)
    return (table.style.hide(axis="index").set_table_attributes('class="lab-headline"')
            .set_caption("MSE ÷ ‖∇J‖² [95% bootstrap interval]; verdict: the lower MSE where the intervals do not "
                         "overlap. Exact bias: ‖E_μ g − ∇J‖ ÷ ‖∇J‖ with advantage = R.")
            .set_table_styles([{"selector": "caption", "props": "caption-side: top; text-align: left; color: #555;"},
                               {"selector": "td, th", "props": "text-align: right; padding: 3px 10px;"}]))


def config_dict(cfg: BoundConfig) -> dict:
    return asdict(cfg)


# ---- the whole report in one call -----------------------------------------------------------------------------

@dataclass
class Built:
    """Everything the vespo_bound report shows, plus its run files (config, tidy results, summary)."""

    bound: pd.DataFrame  # wide: one row per (seed, staleness setting, kernel)
    bound_summary: dict
    main: object  # lab.variance.StudyResult (advantage as given)
    exact: object  # lab.variance.StudyResult (advantage "reward": exact_bias_norm)
    directions: pd.DataFrame  # exact cosine and size of E_mu[g] per lag and estimator
    comparison: pd.DataFrame  # per lag: VESPO against sequence IS
    config: dict
    results: pd.DataFrame  # tidy, with a ``part`` column: bound | variance | exact_bias | exact_direction
    summary: dict


def build(env: str = "tiny_target", lags=(0, 1, 2, 4, 8, 16, 32, 64), kl_targets=(0.01, 0.03, 0.1, 0.3, 1.0),
          temperatures=(0.5, 0.7, 1.5, 2.0), kernels=DEFAULT_KERNELS, bound_seeds=(0, 1, 2), replicates: int = 500,
          batch_size: int = 64, group_size: int = 8, advantage: str = "rloo", loss_agg_mode: str = "token-mean",
          seed: int = 0, trajectory_steps: int = 64) -> Built:
    """The exact bound check over (bound_seeds x lags, KL targets, temperatures x kernels), the variance studies
    at ``lags`` (seed ``seed``) and the exact expected-gradient directions, with the run files. Every lag is
    measured on an Adam trajectory of ``trajectory_steps`` exact steps (so lags must not exceed it)."""
    bcfg = BoundConfig(env=env, kernels=[[float(k), float(lam)] for k, lam in kernels], lags=list(lags),
                       kl_targets=list(kl_targets), temperatures=list(temperatures), seeds=list(bound_seeds),
                       trajectory_steps=trajectory_steps)
    bound = bound_study(bcfg)
    bsum = bound_summary(bound)
    main, exact = variance_studies(env, lags, replicates, batch_size, group_size, advantage, loss_agg_mode, seed,
                                   trajectory_steps=trajectory_steps)
    directions = exact_directions(env, lags, seed, loss_agg_mode=loss_agg_mode, trajectory_steps=trajectory_steps)
    comp = comparison(main.results, exact.results, directions)
    vsum = variance_summary(comp)
    summary = {"headline": headline(bsum, vsum), **bsum, **vsum}
    dirs = directions.melt(id_vars=["lag", "estimator"], var_name="metric", value_name="value")
    dirs = dirs.rename(columns={"lag": "staleness"}).assign(part="exact_direction", staleness_kind="lag", env=env,
                                                            seed=seed, lo=dirs["value"], hi=dirs["value"])
    results = pd.concat([tidy_bound(bound), main.results.assign(part="variance"),
                         exact.results.assign(part="exact_bias"), dirs], ignore_index=True)
    config = {"command": "report vespo_bound", "bound": config_dict(bcfg), "variance": asdict(main.config),
              "exact_bias": asdict(exact.config)}
    return Built(bound, bsum, main, exact, directions, comp, config, results, summary)
