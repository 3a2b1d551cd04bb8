"""The trainer/sampler mismatch numbers that the frameworks put on their own dashboards, per step, with each
framework's definition, so that the lab's tables can be matched to a user's plots.

All are computed on the ``mismatch`` pair, d_t = log pi_old(y_t) - log mu(y_t) (trainer minus sampler), over the
step's loss-masked tokens with finite log-probs (``valid``), from per-step and per-sequence sums accumulated in the
streaming pass. Per sequence i: n_i valid tokens, L_i = sum_t d_t. Each metric is the framework's value for one
step computed on one process (frameworks that average per-rank values across data-parallel ranks differ by that
averaging). Sources:

- verl ``trainer/ppo/rollout_corr_helper.py`` (0.9.1): ``compute_offpolicy_metrics`` and ``compute_is_metrics``
  with token-level TIS at its default threshold 2 (SAFETY_BOUND = 20).
- TRL ``GRPOTrainer._generate_and_score_completions`` (1.16): ``sampling/*`` with its defaults
  (``vllm_importance_sampling_mode = "sequence_mask"``, clip max 3, no clip min).
- prime-rl ``trainer/rl/train.py`` + ``loss.compute_importance_ratio_and_mismatch_kl``: ``mismatch_kl/all/mean``.
- slime ``backends/megatron_utils/loss.py`` (``vanilla_tis_function``, ``get_sum_of_sample_mean``): per-sample
  token means averaged over the step's samples, ``--tis-clip 2``, ``--tis-clip-low 0``.
"""
from __future__ import annotations

import numpy as np

from lab.diagnose.corrections import LOG_W_BOUND

SAFETY_BOUND = LOG_W_BOUND  # verl's clamp of log-ratios, 20: the corrections' own
VERL_TIS = 2.0       # verl rollout_is_threshold default
TRL_CLIP_MAX = 3.0   # TRL vllm_importance_sampling_clip_max default
SLIME_TIS = 2.0      # slime --tis-clip default

# metric -> (framework, definition); the order is the table's
METRICS = {
    "rollout_corr/kl": ("verl", "mean_t(-d_t): KL(mu||pi_old) direct estimator, token mean over the step"),
    "rollout_corr/k3_kl": ("verl", "mean_t(e^d_t - d_t - 1), token mean"),
    "rollout_corr/chi2_token": ("verl", "mean_t(e^(2 clamp(d_t, +-20))) - 1"),
    "rollout_corr/chi2_seq": ("verl", "mean_i(e^(2 clamp(L_i, +-20))) - 1, over sequences"),
    "rollout_corr/training_ppl": ("verl", "mean_i exp(-mean_t log pi_old), over sequences"),
    "rollout_corr/rollout_ppl": ("verl", "mean_i exp(-mean_t log mu), over sequences"),
    "rollout_corr/log_ppl_diff": ("verl", "mean_i(-L_i / n_i)"),
    "rollout_corr/log_ppl_abs_diff": ("verl", "mean_i |L_i / n_i|"),
    "rollout_corr/ppl_ratio": ("verl", "mean_i e^(-L_i / n_i)"),
    "rollout_corr/rollout_is_mean": ("verl", "mean_t w_t, w_t = min(e^clamp(d_t, +-20), 2) (token TIS)"),
    "rollout_corr/rollout_is_std": ("verl", "sqrt(mean_t w_t^2 - (mean_t w_t)^2) of the truncated w_t"),
    "rollout_corr/rollout_is_eff_sample_size": ("verl", "1 / mean_t (w_t / (mean_t w_t + 1e-8))^2: the ESS of the "
                                                        "truncated token weights normalised to mean 1 (a fraction)"),
    "rollout_corr/rollout_is_ratio_fraction_high": ("verl", "share of tokens with e^d_t > 2"),
    "rollout_corr/rollout_is_ratio_fraction_low": ("verl", "share of tokens with e^d_t < 1/2"),
    "sampling/sampling_logp_difference/mean": ("TRL", "mean_t |d_t|"),
    "sampling/sampling_logp_difference/max": ("TRL", "max_t |d_t|"),
    "sampling/importance_sampling_ratio/min": ("TRL", "min_i r_i, r_i = e^L_i, set to 0 when above 3 "
                                                      "(sequence_mask)"),
    "sampling/importance_sampling_ratio/mean": ("TRL", "mean_i r_i over the step's sequences"),
    "sampling/importance_sampling_ratio/max": ("TRL", "max_i r_i"),
    "mismatch_kl/all/mean": ("prime-rl", "mean_t(e^d_t - d_t - 1), token mean"),
    "train_rollout_logprob_abs_diff": ("slime", "mean_i (sum_t |d_t| / max(n_i, 1)): per-sample mean, averaged "
                                                "over samples"),
    "tis": ("slime", "mean_i of the per-sample token mean of e^d_t"),
    "tis_abs": ("slime", "mean_i of the per-sample token mean of |e^d_t - 1|"),
    "tis_clipfrac": ("slime", "mean_i of the per-sample share of tokens with e^d_t outside [0, 2]"),
}

_TOKEN = ("rho2", "w", "w2", "hi", "lo")  # beyond the mismatch pair's own per-step moments (n, sum, k3, abs, max)
_SEQ = ("exp", "exp_abs", "clip", "old", "samp")


class Accumulator:
    """Per-step token sums and per-sequence sums of the mismatch pair, added chunk by chunk."""

    def __init__(self, n_seq: int, n_steps: int):
        self.tok = {k: np.zeros(n_steps) for k in _TOKEN}
        self.seq = {k: np.zeros(n_seq) for k in _SEQ}

    def add(self, d, raw, old, samp, k) -> None:
        """``d``: the chunk's delta (0 on rows that are not valid tokens); ``raw`` = e^clamp(d, +-20); ``k``: the
        chunk's runs (lab.diagnose.streaming._Chunk: per-run sums ``red``, per-sequence ``add``, ``per_step``)."""
        valid = None if k.invalid is None else k.valid.astype(np.float64)
        keep = (lambda x: x) if valid is None else (lambda x: x * valid)  # noqa: E731
        with np.errstate(over="ignore", invalid="ignore"):
            w = np.minimum(raw, VERL_TIS)
            e = raw if float(np.abs(d).max()) <= SAFETY_BOUND else np.exp(d)  # slime does not clamp
            token = {"rho2": keep(raw * raw), "w": keep(w), "w2": keep(w * w), "hi": keep(raw > VERL_TIS),
                     "lo": keep(raw < 1.0 / VERL_TIS)}
            per_seq = {"exp": keep(e), "exp_abs": np.abs(e - 1.0), "clip": keep(e > SLIME_TIS)}
        for key, v in token.items():
            k.per_step(self.tok[key], k.red(v))
        for key, v in per_seq.items():
            k.add(self.seq[key], k.red(v))
        for key, x in (("old", old), ("samp", samp)):
            x = x.astype(np.float64)
            if valid is not None:
                x[k.invalid] = 0.0
            k.add(self.seq[key], k.red(x))


def table(st):
    """One row per (step, metric): run, step, framework, metric, value, definition (NaN where a step has no valid
    token), a pandas DataFrame."""
    import pandas as pd

    acc = getattr(st, "dash", None)
    cols = ["run", "step", "framework", "metric", "value", "definition"]
    if acc is None:
        return pd.DataFrame(columns=cols)
    m = st.mom["mismatch"]
    t = {"n": m["n"], "sum_d": m["sum"], "k3": m["k3"], "abs": m["abs"], **acc.tok}
    s = acc.seq
    n_seq = st.n_valid
    L = st.L["mismatch"]
    order = np.argsort(st.seq_step, kind="stable")
    bounds = np.searchsorted(st.seq_step[order], np.arange(st.S + 1))
    rows = []
    for g, (run, step) in enumerate(zip(st.step_groups["run"], st.step_groups["step"])):
        members = order[bounds[g]:bounds[g + 1]]
        vals = _step_values({k: v[g] for k, v in t.items()}, m["max"][g], L[members], n_seq[members],
                            st.S_abs["mismatch"][members], {k: v[members] for k, v in s.items()})
        for metric, (fw, definition) in METRICS.items():
            rows.append((run, int(step), fw, metric, vals[metric], definition))
    return pd.DataFrame(rows, columns=cols)


def _step_values(t: dict, max_abs: float, L, n, s_abs, s: dict) -> dict:
    nan = float("nan")
    N = t["n"]
    tm = (lambda x: x / N) if N else (lambda x: nan)
    has = n > 0  # verl's and TRL's sequence means: sequences with a valid token
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        mean_d = L[has] / n[has]
        w_mean = tm(t["w"])
        out = {
            "rollout_corr/kl": tm(-t["sum_d"]), "rollout_corr/k3_kl": tm(t["k3"]),
            "rollout_corr/chi2_token": tm(t["rho2"]) - 1.0,
            "rollout_corr/chi2_seq": _mean(np.exp(2.0 * np.clip(L[has], -SAFETY_BOUND, SAFETY_BOUND))) - 1.0,
            "rollout_corr/training_ppl": _mean(np.exp(-s["old"][has] / n[has])),
            "rollout_corr/rollout_ppl": _mean(np.exp(-s["samp"][has] / n[has])),
            "rollout_corr/log_ppl_diff": _mean(-mean_d), "rollout_corr/log_ppl_abs_diff": _mean(np.abs(mean_d)),
            "rollout_corr/ppl_ratio": _mean(np.exp(-mean_d)),
            "rollout_corr/rollout_is_mean": w_mean,
            "rollout_corr/rollout_is_std": float(np.sqrt(max(tm(t["w2"]) - w_mean ** 2, 0.0))) if N > 1 else
            (0.0 if N else nan),
            "rollout_corr/rollout_is_eff_sample_size": 1.0 / (tm(t["w2"]) / (w_mean + 1e-8) ** 2) if N else nan,
            "rollout_corr/rollout_is_ratio_fraction_high": tm(t["hi"]),
            "rollout_corr/rollout_is_ratio_fraction_low": tm(t["lo"]),
            "sampling/sampling_logp_difference/mean": tm(t["abs"]),
            "sampling/sampling_logp_difference/max": float(max_abs) if N else nan,
            "mismatch_kl/all/mean": tm(t["k3"]),
        }
        r = np.exp(L[has])
        r = np.where(r > TRL_CLIP_MAX, 0.0, r)
        out.update({"sampling/importance_sampling_ratio/min": float(r.min()) if r.size else nan,
                    "sampling/importance_sampling_ratio/mean": _mean(r),
                    "sampling/importance_sampling_ratio/max": float(r.max()) if r.size else nan})
        denom = np.maximum(n, 1.0)
        out.update({"train_rollout_logprob_abs_diff": _mean(s_abs / denom), "tis": _mean(s["exp"] / denom),
                    "tis_abs": _mean(s["exp_abs"] / denom), "tis_clipfrac": _mean(s["clip"] / denom)})
    return {k: float(v) for k, v in out.items()}


def _mean(x) -> float:
    return float(np.mean(x)) if np.size(x) else float("nan")


__all__ = ["Accumulator", "METRICS", "table"]
