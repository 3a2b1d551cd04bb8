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
    "truncation": {"value": {"top_p=0.8": {"ratio_mean": 0.896, "ratio_outside": 0.518, "renorm_mean": 1.001,
                                           "renorm_outside": 0.043},
                             "top_k=20": {"ratio_mean": 0.965, "renorm_mean": 1.000}},
                   "what": "Qwen2.5-1.5B sampled with top_p 0.8 / top_k 20: the mean trainer/sampler token ratio and "
                           "the share of tokens outside [0.9, 1.1], without and with renormalising the trainer's "
                           "log-softmax over the sampler's kept set",
                   "source": "TRL PR 7269 (huggingface/trl)"},
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


@dataclass
class _Batch:
    """A draw's per-token arrays in float64 ([N, T], masked) and the bootstrap counts shared by every metric."""

    m: np.ndarray  # response mask
    delta: np.ndarray  # masked delta_t
    p_t: np.ndarray  # trainer probability of the sampled token
    p_s: np.ndarray  # sampler probability of the sampled token
    counts: np.ndarray  # [B, N] sequences resampled together with their tokens
    ci: float
    n_q: int  # resamples of the quantile and correlation intervals (each sorts every token)

    @property
    def absd(self) -> np.ndarray:
        return np.abs(self.delta)

    @property
    def N(self) -> int:
        return self.m.shape[0]

    @property
    def n_tok(self) -> np.ndarray:
        """[N] real tokens per sequence."""
        return self.m.sum(1)

    @property
    def seq_id(self) -> np.ndarray:
        """The sequence of every real token, in row-major order."""
        return np.nonzero(self.m > 0)[0]

    def per_seq(self, x: np.ndarray) -> np.ndarray:
        """sum_t m_t x_t per sequence."""
        return (x * self.m).sum(1)

    def interval(self, point, boot) -> list:
        """[point, lo, hi] with the percentile interval of the bootstrap replicates ``boot``."""
        return [float(point), *stats.percentile_interval(boot, self.ci)]

    def ratio(self, num_seq: np.ndarray, den_seq: np.ndarray) -> list:
        """sum_n num_n / sum_n den_n over sequences, with its bootstrap interval."""
        v = num_seq.sum() / den_seq.sum() if den_seq.sum() > 0 else math.nan
        b = (self.counts @ num_seq) / np.where(self.counts @ den_seq > 0, self.counts @ den_seq, np.nan)
        return self.interval(v, b)


def _batch(d: Draw, n_boot: int, ci: float, seed: int) -> _Batch:
    """The draw's arrays, checked to hold a real token, with ``n_boot`` bootstrap resamples drawn from ``seed``."""
    m = d.mask.double().numpy()
    delta = d.delta.double().numpy()
    p_t = np.exp(d.trainer.double().numpy())
    p_s = np.exp(d.sampler.double().numpy())
    if m.sum() == 0:
        raise LabError(f"setting {d.setting!r}: no response has a real token; raise the response length")
    rng = np.random.default_rng(seed)
    counts = stats.bootstrap_counts(m.shape[0], n_boot, rng)
    return _Batch(m, delta, p_t, p_s, counts, ci, min(n_boot, 200))


def _k3(delta: np.ndarray) -> np.ndarray:
    """k3 = rho - 1 - log rho with log rho = -delta clipped to [-20, 20] (verl's bound on log-ratios)."""
    log_rho = np.clip(-delta, -20, 20)
    return np.expm1(log_rho) - log_rho


def _size_and_mean(x: _Batch) -> dict:
    """Counts, mean length, and mean |delta|, signed mean and RMS of delta per real token."""
    N, n_tok = x.N, x.n_tok
    rms = x.ratio(x.per_seq(x.delta**2), n_tok)
    return {"tokens": [float(x.m.sum())] * 3, "sequences": [float(N)] * 3,
            "mean_length": x.ratio(n_tok, np.ones(N)),
            "abs_mean": x.ratio(x.per_seq(x.absd), n_tok), "signed_mean": x.ratio(x.per_seq(x.delta), n_tok),
            "rms": [math.sqrt(v) if v == v else v for v in rms]}


def _quantiles(x: _Batch) -> dict:
    """Quantiles 50 / 90 / 99 of |delta| over real tokens (intervals from ``n_q`` resamples) and its max."""
    flat, wflat = x.absd[x.m > 0], np.ones(int(x.m.sum()))
    qs = (0.5, 0.9, 0.99)
    point_q = _weighted_quantile(flat, wflat, qs)
    seq_id = x.seq_id
    boot_q = np.array([_weighted_quantile(flat, x.counts[b][seq_id], qs) for b in range(x.n_q)])
    out = {f"abs_q{int(q * 100)}": x.interval(point_q[i], boot_q[:, i]) for i, q in enumerate(qs)}
    out["abs_max"] = [float(flat.max())] * 3
    return out


def _by_probability(x: _Batch) -> dict:
    """Per trainer-probability bin: mean |delta|, share of tokens, share of total |delta|; then ``low_high_ratio``."""
    m, absd, n_tok = x.m, x.absd, x.n_tok
    bins = np.digitize(x.p_t, PROB_BINS[1:-1])  # 0..3
    out = {}
    for k, name in enumerate(PROB_BIN_NAMES):
        inbin = (bins == k) * m
        out[f"abs_mean[{name}]"] = x.ratio((absd * inbin).sum(1), inbin.sum(1))
        out[f"token_share[{name}]"] = x.ratio(inbin.sum(1), n_tok)
        out[f"abs_share[{name}]"] = x.ratio((absd * inbin).sum(1), x.per_seq(absd))
    out["low_high_ratio"] = _low_high_ratio(x, bins, out[f"abs_mean[{PROB_BIN_NAMES[0]}]"][0],
                                            out[f"abs_mean[{PROB_BIN_NAMES[3]}]"][0])
    return out


def _low_high_ratio(x: _Batch, bins: np.ndarray, low: float, high: float) -> list:
    """mean |delta| on p < 0.1 over mean |delta| on p > 0.9 (``low`` / ``high``), with its bootstrap interval."""
    counts, absd = x.counts, x.absd
    lo, hi = (bins == 0) * x.m, (bins == 3) * x.m
    num = (counts @ (absd * lo).sum(1)) / np.maximum(counts @ lo.sum(1), 1e-300)
    den = (counts @ (absd * hi).sum(1)) / np.maximum(counts @ hi.sum(1), 1e-300)
    point = low / high if lo.sum() > 0 and hi.sum() > 0 and high > 0 else math.nan
    boot_r = np.where((counts @ lo.sum(1) > 0) & (den > 0), num / np.where(den > 0, den, 1.0), np.nan)
    return x.interval(point, boot_r)


def _correction_rates(x: _Batch) -> dict:
    """How often the usual corrections act, rho_t = exp(-delta_t): token share with rho > 2 (TIS, C = 2), outside
    [0.5, 5] (IcePop), and sequence share with exp(-L) outside [0.5, 2] (sequence MIS)."""
    rho = np.exp(np.clip(-x.delta, -20, 20))
    W = np.exp(np.clip(-x.delta.sum(1), -20, 20))
    return {"tis_truncated": x.ratio(x.per_seq((rho > 2.0).astype(float)), x.n_tok),
            "icepop_masked": x.ratio(x.per_seq(((rho < 0.5) | (rho > 5.0)).astype(float)), x.n_tok),
            "seq_mis_masked": x.ratio(((W < 0.5) | (W > 2.0)).astype(float), np.ones(x.N))}


def _kl_and_correlation(x: _Batch) -> dict:
    """KL(sampler || trainer) per token as mean_t k3, and the Pearson correlation of p_sampler and p_trainer."""
    sel = x.m > 0
    seq_id = x.seq_id
    corr_b = [_corr(x.p_s[sel], x.p_t[sel], x.counts[b][seq_id]) for b in range(x.n_q)]
    return {"kl_k3": x.ratio(x.per_seq(_k3(x.delta)), x.n_tok),
            "prob_corr": x.interval(_corr(x.p_s[sel], x.p_t[sel]), np.array(corr_b))}


def _sequence_weight(x: _Batch, L: np.ndarray, g: dict, abs_mean: list) -> dict:
    """The sequence log-weight L = sum_t delta_t and its growth: |L|, L, seq_var_ratio = sum L^2 / sum delta^2,
    growth rate and exponent of mean |L_t|, and mean |L_t| at the reference length beside mean |delta| x t."""
    N, T = x.m.shape
    out = {"seq_abs_L": x.ratio(np.abs(L[:, -1]), np.ones(N)), "seq_L": x.ratio(L[:, -1], np.ones(N)),
           "seq_var_ratio": x.ratio(L[:, -1] ** 2, x.per_seq(x.delta**2)),
           "growth_rate": x.interval(g["slope"][0], g["slope"][1]),
           "growth_exponent": x.interval(g["exponent"][0], g["exponent"][1])}
    t_ref = min(REFERENCE_LENGTH, int(np.nonzero(g["keep"])[0].max()) + 1 if g["keep"].any() else T)
    out["abs_L_ref"] = x.interval(g["curve"][t_ref - 1], g["curve_boot"][:, t_ref - 1])
    out["ref_length"] = [float(t_ref)] * 3
    out["linear_prediction_ref"] = [v * t_ref for v in abs_mean]
    return out


def _routing(d: Draw, x: _Batch) -> dict:
    """MoE routing: share of (token, layer) decisions whose expert set differs, and KL, |delta| and |L| with the
    sampler's routes replayed; ``replay_*_reduction`` = 1 - replay / free."""
    rd = d.route_diff.double().numpy()  # [N, layers, T]
    delta_r = (d.sampler - d.trainer_replay).double().numpy() * x.m
    k3_r, abs_r = x.per_seq(_k3(delta_r)), x.per_seq(np.abs(delta_r))
    out = {"route_disagreement": x.ratio((rd * x.m[:, None]).sum((1, 2)), x.n_tok * rd.shape[1]),
           "kl_k3_replay": x.ratio(k3_r, x.n_tok), "abs_mean_replay": x.ratio(abs_r, x.n_tok)}
    for key, free, rep in (("replay_kl_reduction", x.per_seq(_k3(x.delta)), k3_r),
                           ("replay_abs_reduction", x.per_seq(x.absd), abs_r)):
        v = 1 - rep.sum() / free.sum() if free.sum() > 0 else math.nan
        b = 1 - (x.counts @ rep) / np.where(x.counts @ free > 0, x.counts @ free, np.nan)
        out[key] = x.interval(v, b)
    out["abs_L_replay"] = x.ratio(np.abs(delta_r.sum(1)), np.ones(x.N))
    return out


def summarize(d: Draw, n_boot: int = 1000, ci: float = 0.95, seed: int = 0) -> tuple[dict, list[dict]]:
    """(summary {metric: [value, lo, hi]}, curve rows) of one draw; see the module doc for every metric."""
    x = _batch(d, n_boot, ci, seed)
    L = np.cumsum(x.delta, axis=1)  # L_t after t tokens (masked deltas are 0)
    g = _growth(np.abs(L), x.m > 0, x.counts)
    out = {**_size_and_mean(x), **_quantiles(x), **_by_probability(x), **_correction_rates(x),
           **_kl_and_correlation(x)}
    out.update(_sequence_weight(x, L, g, out["abs_mean"]))
    if d.route_diff is not None:  # MoE
        out.update(_routing(d, x))
    return out, _curve_rows(x.absd, x.p_t, x.m, x.counts, ci, g)


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
