"""Train/inference mismatch, measured: the log-probs a sampler records against the ones a trainer recomputes.

Any policy with the mismatch contract (``generate`` / ``score``; ``lab.policies.transformer`` and
``lab.policies.hf``) is run as an inference engine in a sampler SETTING and as a trainer (float32, full sequence,
its own routing). A setting is written ``DTYPE[+kv][+head32]``: the weights in bf16 (bfloat16), fp16 or fp32, with
incremental decoding from a key-value cache (``+kv``) or a full recomputation at every step, optionally with the
output head in float32 (``+head32``; Hugging Face models). For every sampled token y_t,

    delta_t = log p_sampler(y_t | s_t) - log p_trainer(y_t | s_t),

and, with rho_t = exp(-delta_t) = p_trainer / p_sampler and the response mask m_t,

    |delta| summaries   mean, quantiles 50 / 90 / 99, max, RMS, signed mean, over real tokens;
    by probability      mean |delta| in bins of the trainer's probability p_t (p < 0.1, 0.1-0.5, 0.5-0.9, > 0.9),
                        each bin's share of tokens and of total |delta|; ``low_high_ratio`` = mean |delta| on
                        p < 0.1 over mean |delta| on p > 0.9;
    KL (k3)             mean_t (rho_t - 1 - log rho_t), an unbiased, non-negative estimate of KL(sampler || trainer)
                        per token under the sampler's draws (Schulman 2020, "Approximating KL divergence");
    correlation         Pearson correlation of p_sampler and p_trainer over sampled tokens (MiniMax-M1,
                        arXiv 2506.13585, reports 0.9 -> 0.99 with an fp32 head);
    sequence            L = sum_t m_t delta_t, the sequence log-weight log(p_sampler(y) / p_trainer(y)); its prefix
                        L_t after t tokens; ``growth_rate`` = least-squares slope through the origin of mean |L_t|
                        against t (nats per token), ``growth_exponent`` = slope of log mean |L_t| on log t (1: the
                        deltas accumulate linearly, as "|delta| x length" assumes; 0.5: a random walk of deltas
                        with random signs); ``abs_L_ref`` = mean |L_t| at t = 100 (or the longest length
                        measured, ``ref_length``) beside ``linear_prediction_ref`` = mean |delta| x t;
                        ``seq_var_ratio`` = sum_n L_n^2 / sum_n sum_t delta_nt^2: 1 when the deltas of a response
                        are uncorrelated, above 1 when they share a sign (drift), below 1 when they cancel;
    routing (MoE)       ``route_disagreement`` = share of (response position, layer) routing decisions whose chosen
                        expert SET differs between the sampler and a free trainer pass; with the sampler's routes
                        replayed in the trainer (R3, arXiv 2510.11370) KL and |delta| are measured again, and
                        ``replay_kl_reduction`` = 1 - KL_replay / KL_free (``replay_abs_reduction`` likewise).

How often the usual corrections act on it: ``tis_truncated`` = share of tokens with rho_t > 2 (token TIS, C = 2),
``icepop_masked`` = share outside [0.5, 5] (IcePop), ``seq_mis_masked`` = share of sequences whose weight
exp(-L) lies outside [0.5, 2] (sequence MIS).

Intervals are percentile bootstrap intervals over sequences (tokens of one sequence are resampled together).
``three_policy_batch`` turns a measured batch into the (pi, pi_old, sampler) log-probs that the estimators taking
``rollout_log_probs`` consume (TIS, MIS / IcePop, VESPO; verl's decoupled three-policy batch).
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

import numpy as np
import torch

from lab import stats
from lab.errors import LabError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PROB_BINS = (0.0, 0.1, 0.5, 0.9, 1.0)  # the trainer-probability bins of the summary
PROB_BIN_NAMES = ("p<0.1", "0.1-0.5", "0.5-0.9", "p>0.9")
FINE_BINS = np.array([0.0, 1e-3, 1e-2, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 0.97, 0.99, 1.0])  # for figures
REFERENCE_LENGTH = 100  # tokens: the practitioners' "0.012 x 100 tokens"

# Figures practitioners report, placed beside the lab's measurements (sources in ``source``).
PRACTITIONERS = {
    "abs_delta_range": {"value": [0.01, 0.04],
                        "what": "per-token |delta log p| between a bf16 inference engine and the fp32 trainer",
                        "source": "practitioners' reports for vLLM/SGLang samplers against FSDP/Megatron trainers "
                                  "(see Yao et al. 2025, 'Your efficient RL framework secretly brings you off-policy "
                                  "RL training')"},
    "seq_log_ratio_100": {"value": 1.2, "what": "sequence log-ratio after 100 tokens (0.012 x 100, a ratio near "
                                                "exp(1.2))", "source": "the same linear accumulation argument"},
    "low_prob_dominates": {"value": True, "what": "low-probability tokens carry most of the mismatch",
                           "source": "IcePop (Ring-1T, arXiv 2510.18855); MiniMax-M1 (arXiv 2506.13585)"},
    "moe_route_disagreement": {"value": 0.10, "what": "share of router decisions that differ between engines",
                               "source": "R3, Rollout Routing Replay (arXiv 2510.11370)"},
    "replay_kl_reduction": {"value": 0.5, "what": "replaying the sampler's routes roughly halves the train/"
                                                  "inference KL", "source": "R3 (arXiv 2510.11370)"},
    "prob_corr": {"value": [0.9, 0.99], "what": "train/inference probability correlation with a bf16 head, then "
                                                "with an fp32 LM head", "source": "MiniMax-M1 (arXiv 2506.13585)"},
}


@dataclass(frozen=True)
class Setting:
    """A sampler setting: weights in ``dtype``, KV cache or full recomputation, optionally an fp32 output head."""

    name: str
    dtype: torch.dtype
    kv_cache: bool
    head32: bool = False


def parse_setting(text: str) -> Setting:
    """``bf16+kv``, ``fp32``, ``bf16+kv+head32``, ... (see the module doc)."""
    parts = str(text).strip().split("+")
    if parts[0] not in DTYPES or len(set(parts[1:])) != len(parts) - 1 or not set(parts[1:]) <= {"kv", "head32"}:
        raise LabError(f"unknown sampler setting {text!r}; write DTYPE[+kv][+head32] with DTYPE one of "
                       f"{', '.join(DTYPES)}, e.g. bf16+kv")
    return Setting(str(text).strip(), DTYPES[parts[0]], "kv" in parts[1:], "head32" in parts[1:])


@dataclass
class Draw:
    """One measured batch of one setting: sampled tokens, sampler and trainer log-probs (float32, [N, T])."""

    setting: str
    prompts: torch.Tensor  # [N] prompt ids
    tokens: torch.Tensor  # [N, T]
    mask: torch.Tensor  # [N, T] float32, 1 on real tokens
    sampler: torch.Tensor  # log p_sampler of the sampled tokens
    trainer: torch.Tensor  # log p_trainer (fp32, full sequence, own routing)
    trainer_replay: torch.Tensor | None = None  # with the sampler's routes replayed (MoE)
    route_diff: torch.Tensor | None = None  # [N, layers, T] bool: the chosen expert sets differ (MoE)

    @property
    def delta(self) -> torch.Tensor:
        return (self.sampler - self.trainer) * self.mask


def draw(policy, theta, prompts: torch.Tensor, setting: Setting | str, generator: torch.Generator,
         temperature: float = 1.0, trainer_dtype=torch.float32) -> Draw:
    """Sample one response per prompt id in ``setting`` and score it as the trainer does."""
    s = parse_setting(setting) if isinstance(setting, str) else setting
    if temperature != 1.0:  # the trainer scores at temperature 1; compare like with like
        raise LabError("mismatch is measured at temperature 1 (the trainer's log-probs are at temperature 1)")
    extra = {}
    if s.head32:
        if "head_dtype" not in inspect.signature(policy.generate).parameters:
            raise LabError(f"setting {s.name!r}: this policy cannot run its output head in float32 alone")
        extra["head_dtype"] = torch.float32
    tokens, lp_s, routes = policy.generate(theta, prompts, generator, dtype=s.dtype, kv_cache=s.kv_cache,
                                           temperature=temperature, **extra)
    lp_t = policy.score(theta, prompts, tokens, dtype=trainer_dtype)
    mask_of = getattr(policy, "mask_of", None)
    mask = mask_of(tokens) if mask_of is not None else torch.ones(tokens.shape)
    out = Draw(s.name, prompts.cpu(), tokens.cpu(), mask.float().cpu(), lp_s.float().cpu(), lp_t.float().cpu())
    if routes is not None:
        out.trainer_replay = policy.score(theta, prompts, tokens, dtype=trainer_dtype, routes=routes).float().cpu()
        own = policy.routes(theta, prompts, tokens, dtype=trainer_dtype)
        P, T = policy.prompt_length, tokens.shape[1]
        a, b = routes[:, :, P - 1:P - 1 + T].sort(-1).values, own[:, :, P - 1:P - 1 + T].sort(-1).values
        out.route_diff = (a != b).any(-1).cpu()
    return out


# ---- summaries ----------------------------------------------------------------------------------------------------
def _weighted_quantile(x: np.ndarray, w: np.ndarray, qs) -> np.ndarray:
    order = np.argsort(x)
    cw = np.cumsum(w[order])
    return np.array([x[order][min(np.searchsorted(cw, q * cw[-1]), len(x) - 1)] for q in qs])


def _growth(absL: np.ndarray, alive: np.ndarray, counts: np.ndarray) -> dict:
    """Mean |L_t| per t with its bootstrap rows, the slope through the origin and the log-log exponent.

    absL, alive: [N, T]; counts: [B, N]. Positions where fewer than a quarter of the sequences are alive are left
    out of the fits."""
    N, T = absL.shape
    t = np.arange(1, T + 1, dtype=np.float64)
    num, den = absL * alive, alive.astype(np.float64)
    keep = den.sum(0) >= max(2, 0.25 * N)
    point = num.sum(0) / np.maximum(den.sum(0), 1)
    boot = (counts @ num) / np.maximum(counts @ den, 1)  # [B, T]

    def fits(curve):  # curve [..., T] -> (slope, exponent)
        c = curve[..., keep]
        tk = t[keep]
        slope = (c * tk).sum(-1) / (tk**2).sum()
        w = (c > 0).astype(np.float64)  # log-log fit over the positions where |L_t| > 0
        lt, lc = np.log(tk), np.log(np.where(c > 0, c, 1.0))
        n = w.sum(-1)
        mt = (w * lt).sum(-1) / np.maximum(n, 1)
        mc = (w * lc).sum(-1) / np.maximum(n, 1)
        dt = lt - mt[..., None]
        var = (w * dt**2).sum(-1)
        exponent = np.where((n >= 2) & (var > 0), (w * dt * (lc - mc[..., None])).sum(-1) / np.where(var > 0, var, 1),
                            np.nan)
        return slope, exponent

    s0, e0 = fits(point)
    sb, eb = fits(boot)
    return {"t": t, "keep": keep, "curve": point, "curve_boot": boot, "alive": den.sum(0),
            "slope": (float(s0), sb), "exponent": (float(e0), eb)}


def summarize(d: Draw, n_boot: int = 1000, ci: float = 0.95, seed: int = 0) -> tuple[dict, list[dict]]:
    """(summary {metric: [value, lo, hi]}, curve rows) of one draw; see the module doc for every metric."""
    m = d.mask.double().numpy()
    delta = d.delta.double().numpy()
    absd = np.abs(delta)
    p_t = np.exp(d.trainer.double().numpy())
    p_s = np.exp(d.sampler.double().numpy())
    N, T = m.shape
    if m.sum() == 0:
        raise LabError(f"setting {d.setting!r}: no response has a real token; raise the response length")
    rng = np.random.default_rng(seed)
    counts = stats.bootstrap_counts(N, n_boot, rng)  # [B, N] sequences resampled together with their tokens
    n_tok = m.sum(1)  # [N]

    def ratio(num_seq, den_seq):  # sum over sequences of num / sum of den, with its bootstrap interval
        v = num_seq.sum() / den_seq.sum() if den_seq.sum() > 0 else math.nan
        b = (counts @ num_seq) / np.where(counts @ den_seq > 0, counts @ den_seq, np.nan)
        return [float(v), *stats.percentile_interval(b, ci)]

    def per_seq(x):
        return (x * m).sum(1)

    out = {"tokens": [float(m.sum())] * 3, "sequences": [float(N)] * 3,
           "mean_length": ratio(n_tok, np.ones(N)),
           "abs_mean": ratio(per_seq(absd), n_tok), "signed_mean": ratio(per_seq(delta), n_tok),
           "rms": [math.sqrt(x) if x == x else x for x in ratio(per_seq(delta**2), n_tok)]}
    flat, wflat = absd[m > 0], np.ones(int(m.sum()))
    qs = (0.5, 0.9, 0.99)
    point_q = _weighted_quantile(flat, wflat, qs)
    seq_id = np.nonzero(m > 0)[0]  # the sequence of every token of ``flat`` (row-major order)
    n_q = min(n_boot, 200)  # quantile intervals: fewer resamples (each sorts every token)
    boot_q = np.array([_weighted_quantile(flat, counts[b][seq_id], qs) for b in range(n_q)])
    for i, q in enumerate(qs):
        out[f"abs_q{int(q * 100)}"] = [float(point_q[i]), *stats.percentile_interval(boot_q[:, i], ci)]
    out["abs_max"] = [float(flat.max())] * 3
    # by trainer probability
    bins = np.digitize(p_t, PROB_BINS[1:-1])  # 0..3
    for k, name in enumerate(PROB_BIN_NAMES):
        inbin = (bins == k) * m
        out[f"abs_mean[{name}]"] = ratio((absd * inbin).sum(1), inbin.sum(1))
        out[f"token_share[{name}]"] = ratio(inbin.sum(1), n_tok)
        out[f"abs_share[{name}]"] = ratio((absd * inbin).sum(1), per_seq(absd))
    lo, hi = (bins == 0) * m, (bins == 3) * m
    num = (counts @ (absd * lo).sum(1)) / np.maximum(counts @ lo.sum(1), 1e-300)
    den = (counts @ (absd * hi).sum(1)) / np.maximum(counts @ hi.sum(1), 1e-300)
    point = (out[f"abs_mean[{PROB_BIN_NAMES[0]}]"][0] / out[f"abs_mean[{PROB_BIN_NAMES[3]}]"][0]
             if lo.sum() > 0 and hi.sum() > 0 and out[f"abs_mean[{PROB_BIN_NAMES[3]}]"][0] > 0 else math.nan)
    boot_r = np.where((counts @ lo.sum(1) > 0) & (den > 0), num / np.where(den > 0, den, 1.0), np.nan)
    out["low_high_ratio"] = [float(point), *stats.percentile_interval(boot_r, ci)]
    # how often the usual corrections act on this mismatch (rho_t = p_trainer / p_sampler = exp(-delta_t))
    rho = np.exp(np.clip(-delta, -20, 20))
    out["tis_truncated"] = ratio(per_seq((rho > 2.0).astype(float)), n_tok)  # TIS, C = 2
    out["icepop_masked"] = ratio(per_seq(((rho < 0.5) | (rho > 5.0)).astype(float)), n_tok)  # IcePop [0.5, 5]
    W = np.exp(np.clip(-delta.sum(1), -20, 20))
    out["seq_mis_masked"] = ratio(((W < 0.5) | (W > 2.0)).astype(float), np.ones(N))  # sequence MIS [0.5, 2]
    # KL (k3) and probability correlation
    log_rho = np.clip(-delta, -20, 20)  # verl's bound on log-ratios
    k3 = np.expm1(log_rho) - log_rho
    out["kl_k3"] = ratio(per_seq(k3), n_tok)
    sel = m > 0
    out["prob_corr"] = [_corr(p_s[sel], p_t[sel])] * 3
    corr_b = [_corr(p_s[sel], p_t[sel], counts[b][seq_id]) for b in range(n_q)]
    out["prob_corr"][1:] = list(stats.percentile_interval(np.array(corr_b), ci))
    # the sequence log-weight and its growth with length
    L = np.cumsum(delta, axis=1)  # L_t after t tokens (masked deltas are 0)
    alive = m > 0
    g = _growth(np.abs(L), alive, counts)
    out["seq_abs_L"] = ratio(np.abs(L[:, -1]), np.ones(N))
    out["seq_L"] = ratio(L[:, -1], np.ones(N))
    out["seq_var_ratio"] = ratio(L[:, -1] ** 2, per_seq(delta**2))
    out["growth_rate"] = [g["slope"][0], *stats.percentile_interval(g["slope"][1], ci)]
    out["growth_exponent"] = [g["exponent"][0], *stats.percentile_interval(g["exponent"][1], ci)]
    t_ref = min(REFERENCE_LENGTH, int(np.nonzero(g["keep"])[0].max()) + 1 if g["keep"].any() else T)
    out["abs_L_ref"] = [float(g["curve"][t_ref - 1]),
                        *stats.percentile_interval(g["curve_boot"][:, t_ref - 1], ci)]
    out["ref_length"] = [float(t_ref)] * 3
    out["linear_prediction_ref"] = [v * t_ref for v in out["abs_mean"]]
    # routing (MoE)
    if d.route_diff is not None:
        rd = d.route_diff.double().numpy()  # [N, layers, T]
        layers = rd.shape[1]
        out["route_disagreement"] = ratio((rd * m[:, None]).sum((1, 2)), n_tok * layers)
        delta_r = (d.sampler - d.trainer_replay).double().numpy() * m
        log_rho_r = np.clip(-delta_r, -20, 20)
        out["kl_k3_replay"] = ratio(per_seq(np.expm1(log_rho_r) - log_rho_r), n_tok)
        out["abs_mean_replay"] = ratio(per_seq(np.abs(delta_r)), n_tok)
        for key, free, rep in (("replay_kl_reduction", per_seq(k3), per_seq(np.expm1(log_rho_r) - log_rho_r)),
                               ("replay_abs_reduction", per_seq(absd), per_seq(np.abs(delta_r)))):
            v = 1 - rep.sum() / free.sum() if free.sum() > 0 else math.nan
            b = 1 - (counts @ rep) / np.where(counts @ free > 0, counts @ free, np.nan)
            out[key] = [float(v), *stats.percentile_interval(b, ci)]
        out["abs_L_replay"] = ratio(np.abs(delta_r.sum(1)), np.ones(N))
    curves = _curve_rows(absd, p_t, m, counts, ci, g)
    return out, curves


def _corr(x: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> float:
    w = np.ones_like(x) if w is None else w
    if w.sum() <= 0:
        return math.nan
    mx, my = np.average(x, weights=w), np.average(y, weights=w)
    vx, vy = np.average((x - mx) ** 2, weights=w), np.average((y - my) ** 2, weights=w)
    return float(np.average((x - mx) * (y - my), weights=w) / math.sqrt(vx * vy)) if vx > 0 and vy > 0 else math.nan


def _curve_rows(absd, p_t, m, counts, ci, g) -> list[dict]:
    """Rows for the figures: mean |delta| per fine trainer-probability bin, and mean |L_t| against t."""
    rows = []
    bins = np.clip(np.digitize(p_t, FINE_BINS[1:-1]), 0, len(FINE_BINS) - 2)
    for k in range(len(FINE_BINS) - 1):
        inbin = (bins == k) * m
        n = inbin.sum()
        if n == 0:
            continue
        v = (absd * inbin).sum() / n
        b = (counts @ (absd * inbin).sum(1)) / np.where(counts @ inbin.sum(1) > 0, counts @ inbin.sum(1), np.nan)
        centre = float(np.sqrt(max(FINE_BINS[k], 1e-4) * FINE_BINS[k + 1]))
        rows.append({"metric": "abs_delta_by_prob", "x": centre, "value": float(v),
                     **dict(zip(("lo", "hi"), stats.percentile_interval(b, ci))), "n": float(n)})
    for i in np.nonzero(g["keep"])[0]:
        rows.append({"metric": "abs_L_by_length", "x": float(g["t"][i]), "value": float(g["curve"][i]),
                     **dict(zip(("lo", "hi"), stats.percentile_interval(g["curve_boot"][:, i], ci))),
                     "n": float(g["alive"][i])})
    return rows


def measure(policy, theta, prompts: torch.Tensor, settings: list, generator_of, model: str, n_boot: int = 1000,
            ci: float = 0.95, seed: int = 0, on_setting=None) -> tuple[list[dict], dict, dict]:
    """Every setting on the same prompts: (tidy rows, {setting: summary}, {setting: Draw}).

    ``generator_of(i)`` gives the generator of setting i; using the same seed for every setting gives every setting
    the same uniforms (common random numbers: the sampled tokens coincide wherever the settings' probabilities
    agree). Rows: model, setting, metric, x (NaN for scalars), value, lo, hi, n."""
    rows, summaries, draws = [], {}, {}
    for i, name in enumerate(settings):
        s = parse_setting(name)
        d = draw(policy, theta, prompts, s, generator_of(i))
        summary, curves = summarize(d, n_boot, ci, seed)
        for metric, (v, lo, hi) in summary.items():
            rows.append({"model": model, "setting": s.name, "metric": metric, "x": math.nan, "value": v, "lo": lo,
                         "hi": hi, "n": summary["tokens"][0]})
        rows += [{"model": model, "setting": s.name, **r} for r in curves]
        L = d.delta.double().sum(1).numpy()
        lengths = d.mask.sum(1).numpy()
        rows += [{"model": model, "setting": s.name, "metric": "seq_log_weight", "x": float(n), "value": float(v),
                  "lo": float(v), "hi": float(v), "n": 1.0} for n, v in zip(lengths, L)]
        summaries[s.name], draws[s.name] = summary, d
        if on_setting:
            on_setting()
    return rows, summaries, draws


# ---- three-policy batches -------------------------------------------------------------------------------------------
def three_policy_batch(policy, theta, d: Draw, theta_pi: torch.Tensor | None = None) -> dict:
    """The decoupled three-policy batch of a measured draw, as the estimators take it:

    ``log_prob`` = log pi at ``theta_pi`` (default ``theta``; differentiable when theta_pi requires grad),
    ``old_log_prob`` = the trainer's recomputed log pi_old (float32, full sequence: ``d.trainer``),
    ``rollout_log_probs`` = the sampler's (``d.sampler``), ``response_mask``; all [N, T], masked. With
    theta_pi = theta, pi / pi_old = 1 on every token and only the sampler's mismatch remains, as in the first
    mini-batch of a verl/slime step.
    """
    from lab.policies import token_log_probs

    th = theta if theta_pi is None else theta_pi
    mask = d.mask
    log_prob = token_log_probs(policy, th.float() if th.dtype != torch.float32 else th, d.prompts, d.tokens)
    return {"log_prob": log_prob.cpu() * mask, "old_log_prob": d.trainer * mask, "rollout_log_probs": d.sampler * mask,
            "response_mask": mask, "prompts": d.prompts, "tokens": d.tokens}


__all__ = ["DTYPES", "Draw", "PRACTITIONERS", "PROB_BIN_NAMES", "Setting", "draw", "measure", "parse_setting",
           "summarize", "three_policy_batch"]
