"""Why sequence importance weights explode with length.

A response y = (y_1..y_T) sampled from a stale policy mu is corrected by the sequence weight
W = pi(y)/mu(y) = prod_t rho_t, rho_t = pi(y_t|s_t)/mu(y_t|s_t). When every state has the same per-token
divergences (positions drawn independently from one pi/mu pair, as here; or any autoregressive pair whose per-state
chi2 is the same everywhere), the moments multiply:

    E_mu[W^2] = prod_t E_mu[rho_t^2] = (1 + chi2_tok)^T         chi2_seq = (1 + chi2_tok)^T - 1
    population Kish ESS fraction = (E_mu W)^2 / E_mu[W^2] = (1 + chi2_tok)^-T      (E_mu W = 1)
    KL_seq(mu||pi) = T KL_tok,   Var_mu(log W) = T Var_mu(log rho)

so the log-weight spreads only like sqrt(T) while chi2 and 1/ESS grow exponentially in T: a small per-token
divergence is harmless for one token and fatal for a thousand (Kong 1992 for the ESS; Owen 2013, "Monte Carlo theory,
methods and examples", ch. 9; "When Speed Kills Stability" (2025): sequence IS variance O((1 + chi2_max)^T)).

A batch of B sequences is measured with the lab's diagnostics (lab.diagnostics: Kish ESS, max-weight share, PSIS
k-hat). Once (1 + chi2_tok)^T exceeds B, the batch rarely contains the rare sequences that carry the weight, and the
batch ESS is optimistic: it can read 20 % while the population ESS is 10^-6. k-hat > 0.7 is the warning
(Vehtari et al. 2024).
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import torch

from lab import diagnostics
from lab.errors import LabError
from lab.teach import tokens
from lab.teach.exercises import Exercise
from lab.threads import single_threaded
from dataclasses import dataclass

from lab.configs import SEED_MAX
from lab.typed import knob


@dataclass
class Config:
    """The lesson's settings (its report's parameters)."""

    kls: list[float] = knob([0.001, 0.01, 0.05, 0.2], gt=0, le=10)
    """per-token KL(mu || pi) settings"""
    lengths: list[int] = knob([1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024], ge=1, le=100_000)
    """response lengths T"""
    vocab: int = knob(32, ge=2, le=100_000)
    """next-token vocabulary size V"""
    batch: int = knob(256, ge=2, le=1_000_000)
    """sequences per sampled batch"""
    replicates: int = knob(8, ge=1, le=10_000)
    """sampled batches per (KL, length)"""
    sharpness: float = knob(2.0, ge=0, le=100)
    """logit scale of pi (larger: more peaked)"""
    seed: int = knob(0, ge=0, le=SEED_MAX)
    """seed of pi, mu and the draws"""
    live_controls: bool = True
    """build the ipywidgets controls (needs a widget frontend to be seen)"""

DEFAULT_LENGTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


def token_stats(log_pi: np.ndarray, log_mu: np.ndarray) -> dict:
    """Per-token divergences of the stale pair (vectorised over leading axes of ``log_mu``).

    kl_mu_pi = KL(mu||pi), kl_pi_mu = KL(pi||mu), chi2 = E_mu[rho^2] - 1, var_log_rho = Var_mu(log rho).
    """
    log_rho = log_pi - log_mu
    mu = np.exp(log_mu)
    mean = (mu * log_rho).sum(-1)
    return {"kl_mu_pi": -mean, "kl_pi_mu": tokens.kl(np.broadcast_to(log_pi, log_mu.shape), log_mu),
            "chi2": np.exp(np.minimum(log_mu + 2 * log_rho, 700.0)).sum(-1) - 1.0,  # E_mu[rho^2] = sum pi^2/mu
            "var_log_rho": np.maximum((mu * log_rho**2).sum(-1) - mean**2, 0.0)}


def sequence_stats(chi2_tok, kl_tok, var_log_rho, lengths) -> dict:
    """Exact sequence-level quantities for lengths T (broadcasting): kl_seq, chi2_seq, ess_frac, var_log_w."""
    T = np.asarray(lengths, dtype=np.float64)
    log_m2 = T * np.log1p(np.asarray(chi2_tok, dtype=np.float64))  # log E_mu[W^2]
    return {"kl_seq": T * kl_tok, "chi2_seq": np.expm1(log_m2), "ess_frac": np.exp(-log_m2),
            "var_log_w": T * var_log_rho}


def ess_fraction(chi2_tok, length):
    """Population Kish ESS fraction (1 + chi2_tok)^-T."""
    return np.exp(-np.asarray(length, dtype=np.float64) * np.log1p(chi2_tok))


def length_for_ess(chi2_tok: float, fraction: float) -> int:
    """The shortest length T at which (1 + chi2_tok)^-T <= fraction: ceil(log(1/fraction) / log(1 + chi2_tok))."""
    if not (chi2_tok > 0 and 0 < fraction < 1):
        raise LabError("length_for_ess needs chi2_tok > 0 and a fraction strictly between 0 and 1")
    # a tiny relative slack keeps exact powers (fraction = (1 + c)^-n) at n despite rounding
    return int(math.ceil(math.log(1 / fraction) / math.log1p(chi2_tok) * (1 - 1e-12)))


def sample_log_weights(log_pi, log_mu, length: int, batch: int, replicates: int = 1, seed: int = 0) -> np.ndarray:
    """[replicates, batch] sequence log-weights log W = sum_v n_v log rho_v, n ~ Multinomial(T, mu) per sequence
    (the token counts of T independent draws from mu carry everything log W depends on)."""
    if length < 1 or batch < 2 or replicates < 1:
        raise LabError("sampling needs length >= 1, batch >= 2 and replicates >= 1")
    rng = np.random.default_rng(seed)
    mu = np.exp(log_mu)
    counts = rng.multinomial(int(length), mu / mu.sum(), size=(int(replicates), int(batch)))
    return counts @ (log_pi - log_mu)


@single_threaded
def batch_diagnostics(log_w: np.ndarray) -> dict:
    """The lab's weight diagnostics of each batch (rows of ``log_w``): ESS fraction, max-weight share, k-hat."""
    lw = torch.as_tensor(np.atleast_2d(log_w), dtype=torch.float64)
    return {"ess_frac": diagnostics.kish_ess_fraction(lw).numpy(),
            "max_weight_share": diagnostics.max_weight_share(lw).numpy(),
            "khat": diagnostics.psis_khat(lw.numpy())}


def curves(kls, lengths=DEFAULT_LENGTHS, vocab: int = 32, batch: int = 256, replicates: int = 8, seed: int = 0,
           sharpness: float = 2.0) -> pd.DataFrame:
    """Tidy table (kl_target, length, metric, value, lo, hi): the exact sequence quantities and the sampled batch
    diagnostics (median over replicate batches, with the 10 % and 90 % quantiles as lo/hi)."""
    kls = tokens.check_kl(kls)
    log_pi, log_mu = tokens.stale_pair(vocab, kls, seed, sharpness)
    tok = token_stats(log_pi, log_mu)
    rows = []
    for i, d in enumerate(kls):
        exact = sequence_stats(tok["chi2"][i], tok["kl_mu_pi"][i], tok["var_log_rho"][i], np.asarray(lengths))
        for j, T in enumerate(lengths):
            for metric in ("kl_seq", "chi2_seq", "ess_frac", "var_log_w"):
                v = float(exact[metric][j])
                rows.append((float(d), int(T), metric, v, v, v))
            diag = batch_diagnostics(sample_log_weights(log_pi, log_mu[i], T, batch, replicates, seed + 1000 * j))
            for metric, values in diag.items():
                values = values[np.isfinite(values)]
                if values.size:
                    q = np.quantile(values, [0.5, 0.1, 0.9])
                    rows.append((float(d), int(T), f"batch_{metric}", *map(float, q)))
    out = pd.DataFrame(rows, columns=["kl_target", "length", "metric", "value", "lo", "hi"])
    out["chi2_tok"] = out["kl_target"].map(dict(zip(map(float, kls), map(float, tok["chi2"]))))
    return out


def page_data(kl: float, vocab: int, length: int, seed: int = 0, sharpness: float = 2.0,
              lengths=tuple(int(2 ** (i / 4)) for i in range(41))) -> dict:
    """What the browser page shows (the JavaScript twin computes the same dict): token stats and the exact curves."""
    log_pi, log_mu = tokens.stale_pair(vocab, kl, seed, sharpness)
    tok = {k: float(v) for k, v in token_stats(log_pi, log_mu).items()}
    grid = np.unique(np.asarray(lengths, dtype=np.float64))
    seq = sequence_stats(tok["chi2"], tok["kl_mu_pi"], tok["var_log_rho"], grid)
    at = {k: float(v) for k, v in sequence_stats(tok["chi2"], tok["kl_mu_pi"], tok["var_log_rho"], length).items()}
    return {"token": tok, "lengths": grid.tolist(), "ess_frac": seq["ess_frac"].tolist(),
            "chi2_seq": seq["chi2_seq"].tolist(), "var_log_w": seq["var_log_w"].tolist(), "at_length": at}


# ---- exercises ------------------------------------------------------------------------------------------------

def _var_log_w_growth(kl: float, length: int, vocab: int = 32) -> float:
    """Var(log W) at 2T over Var(log W) at T for a stale pair at per-token KL ``kl``."""
    tok = token_stats(*tokens.stale_pair(vocab, kl))
    var = sequence_stats(tok["chi2"], tok["kl_mu_pi"], tok["var_log_rho"], [length, 2 * length])["var_log_w"]
    return float(var[1] / var[0])


EXERCISES = {ex.key: ex for ex in (
    Exercise("ess_at_length",
             "Every token has chi2 = E_mu[rho^2] - 1 = 0.05. What is the population ESS fraction of a 100-token "
             "response's sequence weight? (a number between 0 and 1)",
             lambda: float(ess_fraction(0.05, 100)), rtol=0.02,
             hint="the second moment of a product of independent ratios is the product of their second moments",
             explanation="(1 + chi2_tok)^-T = 1.05^-100: under 1 % of the batch is effectively used"),
    Exercise("length_for_10pct",
             "With chi2_tok = 0.02, at what length T does the population ESS fraction first drop to 10 % or below? "
             "(a whole number of tokens)",
             lambda: length_for_ess(0.02, 0.10), kind="integer",
             hint="solve (1 + chi2_tok)^-T <= 0.1 for the smallest whole T; log(1 + x) is not exactly x",
             explanation="T = ceil(log 10 / log 1.02)"),
    Exercise("var_log_w_doubling",
             "Hold the per-token divergence fixed and double the length T. By what factor does Var_mu(log W) grow?",
             lambda: _var_log_w_growth(0.05, 100), rtol=1e-6,
             hint="log W is a sum of T independent per-token log-ratios",
             explanation="variances of independent terms add: Var(log W) = T Var(log rho); the second moment "
                         "is squared instead: 1 + chi2_seq(2T) = (1 + chi2_seq(T))^2"),
    Exercise("trust_the_batch",
             "Suppose a batch of 256 sequences of 256 tokens reports a Kish ESS of 20 %, while (1 + chi2_tok)^-T "
             "= 10^-6 for the same pair of policies. Which one describes the estimator's variance?",
             lambda: "b", kind="choice",
             choices=(("a", "the batch ESS: it is measured, the formula is a model"),
                      ("b", "the population value: the batch has not seen the rare sequences that carry the weight"),
                      ("c", "both: they estimate different things and agree on average")),
             hint="ask what the batch ESS would read if the batch contained one of the rare high-weight sequences",
             explanation="sample ESS is optimistic under heavy tails; the lab reports the PSIS k-hat beside it "
                         "(k-hat > 0.7: unreliable)"),
)}
