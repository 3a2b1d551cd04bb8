"""Sampler truncation: what top-p, top-k and min-p do to the ratio pi/mu and to the expected one-token update.

One state, V next tokens, the trainer's policy pi = softmax(z) (lab.teach.tokens). The inference engine samples from
its own logits z' after temperature tau, keeps the set S = kept_set(z'/tau) of top-p, top-k or min-p in vLLM's order
(``lab.policies.truncation.kept_set``), and draws from what is left, renormalised:

    mu(y) = softmax(z'/tau)(y) 1[y in S] / softmax(z'/tau)(S),   z' = z, or z moved to a per-token KL d (``kl``).

The kept mass is m = pi(S) (``lab.policies.truncation.kept_log_mass``). Taught here:

1. The ratio averages the kept mass. Under the sampler, E_mu[pi(y)/mu(y)] = sum_{y in S} pi(y) = m, at any
   temperature or staleness. With tau = 1 and z' = z every sampled token has pi(y)/mu(y) = m exactly: a ratio
   below 1 that tracks the kept mass, not staleness.
2. Mask replay (DeepSeek-V3.2's keep-sampling-mask; slime PR 2102; TRL PR 7269): the trainer renormalises its
   log-softmax over the recorded S, log pi_S(y) = log pi(y) - log m, and its ratio becomes pi_S(y)/mu(y) (exactly 1
   at tau = 1, z' = z). Measured: the share of sampled tokens whose ratio lies outside [0.9, 1.1] (TRL PR 7269's
   band, the sampling_truncation study's ``BAND``), sum_{y in S} mu(y) 1[ratio outside], without and with replay.
3. Two truths (``lab.engine.truncation``): the full gradient g_full = E_pi[R grad_z log pi(y)] and the deployed one
   g_dep = E_{pi_S}[R grad_z log pi_S(y)], S held fixed. A token-level correction with the registry's coefficient
   c(rho, A) (``lab.teach.clip_mask.coefficient``) has the expected update (with respect to z)

       without replay  g = a - pi sum(a),     a_y = mu_y c(pi_y / mu_y, A_y) A_y     (grad_z log pi(y) = e_y - pi)
       with replay     g = a - pi_S sum(a),   a_y = mu_y c(pi_S(y) / mu_y, A_y) A_y  (grad_z log pi_S = e_y - pi_S)

   with A_y = R_y - E_mu[R] (the sampler's mean reward, what a group mean estimates). With replay, importance
   sampling (c = rho) gives a = pi_S A and g = g_dep exactly. Nothing gives g_full: tokens outside S are never
   drawn, and the gap ||g_dep - g_full|| / ||g_full|| is the price of truncation that no correction removes.
   Reported: the bias ||g - g*|| against either truth in units of ||g_full|| (the deployed gradient vanishes when S
   holds one token, so it cannot be the unit).

Rewards R_y are the clip_mask lesson's (hashrng stream clip_mask.REWARD_STREAM + seed); the JavaScript twin
(lab.teach.jscore, ``samplerTruncation``) computes the same numbers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pandas as pd
import torch

from lab.configs import SEED_MAX
from lab.errors import LabError
from lab.estimators import info as estimator_info
from lab.policies.truncation import check_truncation, kept_log_mass, kept_set
from lab.teach import clip_mask, hashrng, tokens
from lab.teach.exercises import Exercise
from lab.typed import knob

KINDS = ("top_p", "top_k", "min_p")
METHODS = ("token_is", "ppo_clip", "tis_token")
LABELS = {n: estimator_info(n).label for n in METHODS}  # the registry's display names
KIND_LABELS = {"top_p": "top-p", "top_k": "top-k", "min_p": "min-p"}
BAND = (0.9, 1.1)  # TRL PR 7269's band (lab.studies.sampling_truncation.study.BAND; a test keeps them equal)
TRUTHS = ("full", "deployed")
REPLAY = {False: "plain", True: "replay"}


@dataclass
class Config:
    """The lesson's settings (its report's parameters)."""

    vocab: int = knob(64, ge=2, le=1 << 16)
    """next-token vocabulary size V"""
    kind: Literal["top_p", "top_k", "min_p"] = "top_p"
    """the sampler of the detailed look: top_p | top_k | min_p"""
    top_p: float = knob(0.8, gt=0, le=1)
    """p of the detailed look (kind top_p)"""
    top_k: int = knob(8, ge=1, le=100_000)
    """k of the detailed look (kind top_k; at most V)"""
    min_p: float = knob(0.05, ge=0, lt=1)
    """threshold of the detailed look (kind min_p)"""
    top_ps: list[float] = knob([1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5], gt=0, le=1)
    """top-p sweep (from 1: no truncation)"""
    temperature: float = knob(1.0, ge=0.01, le=100)
    """the sampler's temperature (the kept set is chosen after it)"""
    kl: float = knob(0.0, ge=0, le=10)
    """per-token KL(sampler's logits || pi) before truncation (0: the sampler runs pi's own logits)"""
    sharpness: float = knob(2.0, ge=0, le=100)
    """logit scale of pi"""
    batch: int = knob(4096, ge=2, le=10_000_000)
    """sampled tokens of the Monte Carlo check of the mean ratio"""
    seed: int = knob(0, ge=0, le=SEED_MAX)
    """draw of pi, the staleness direction, the rewards and the sampled batch"""
    live_controls: bool = True
    """build the ipywidgets controls (needs a widget frontend to be seen)"""

    def validate(self) -> None:
        """The detailed look's sampler must fit the vocabulary (checked before the notebook starts)."""
        if self.kind == "top_k":
            knobs("top_k", self.top_k, self.vocab)


LEVEL_TITLES = {"top_p": "top-p p", "top_k": "top-k k", "min_p": "min-p threshold"}


def level_range(kind: str, vocab: int) -> dict:
    """The range of the knob of sampler ``kind`` in the live controls and on the page, and its starting value."""
    return {"top_p": {"start": 0.5, "end": 1.0, "step": 0.01, "value": 0.8},
            "top_k": {"start": 1, "end": int(vocab), "step": 1, "value": min(8, int(vocab))},
            "min_p": {"start": 0.0, "end": 0.5, "step": 0.01, "value": 0.05}}[kind]


def level_grid(kind: str, vocab: int) -> list:
    """The knob's sweep, from no truncation to the strongest: p from 1 to 0.5, k from V to 1 (at most 40 values),
    min-p from 0 to 0.5."""
    if kind == "top_k":
        return [float(k) for k in np.unique(np.round(np.geomspace(1, vocab, 40)).astype(int))[::-1]]
    if kind == "min_p":
        return np.linspace(0.0, 0.5, 51).tolist()
    return np.linspace(1.0, 0.5, 51).tolist()


def knobs(kind: str, level, vocab: int) -> dict:
    """``kept_set``'s keyword arguments for sampler ``kind`` at ``level`` (p, k or the min-p threshold), checked."""
    if kind not in KINDS:
        raise LabError(f"sampler kind must be one of {', '.join(KINDS)}, got {kind!r}")
    kw = {"top_p": {"top_p": level}, "top_k": {"top_k": level}, "min_p": {"min_p": level}}[kind]
    check_truncation(**kw, vocab_size=vocab)
    return {k: (int(v) if k == "top_k" else float(v)) for k, v in kw.items()}


def sampler_logits(vocab: int, seed: int = 0, sharpness: float = 2.0, kl: float = 0.0):
    """(z, z'): pi's logits and the sampler's before temperature; z' = z at kl = 0, else z + s e with
    KL(softmax(z') || pi) = kl (lab.teach.tokens)."""
    z = tokens.logits(vocab, seed, sharpness)
    if float(tokens.check_kl(kl)) == 0:
        return z, z
    e = tokens.direction(vocab, seed)
    return z, z + float(tokens.behaviour_scale(z, e, kl)) * e


def setting(kind: str = "top_p", level=1.0, vocab: int = 64, seed: int = 0, sharpness: float = 2.0, kl: float = 0.0,
            temperature: float = 1.0) -> dict:
    """The state and its sampler: log pi [V], the sampler's log mu (-inf outside S), the kept set S (bool), log m and
    the rewards R [V]. ``level`` may be a list: then log mu and S are [L, V] and log m is [L], one row per level."""
    tokens.check_vocab(vocab)
    if not (math.isfinite(temperature) and temperature > 0):
        raise LabError(f"temperature must be a positive number, got {temperature!r}")
    levels = [level] if np.ndim(level) == 0 else list(level)
    z, z_sampler = sampler_logits(vocab, seed, sharpness, kl)
    tempered = torch.as_tensor(z_sampler / float(temperature), dtype=torch.float64)
    kept = torch.stack([kept_set(tempered, **knobs(kind, lv, vocab)) for lv in levels])
    log_mu = torch.log_softmax(tempered.masked_fill(~kept, -math.inf), -1).numpy()  # the engine's q
    log_m = kept_log_mass(torch.as_tensor(z, dtype=torch.float64).expand(len(levels), -1), kept).numpy()
    one = np.ndim(level) == 0
    return {"log_pi": tokens.log_softmax(z), "log_mu": log_mu[0] if one else log_mu,
            "kept": kept.numpy()[0] if one else kept.numpy(), "log_m": float(log_m[0]) if one else log_m,
            "reward": hashrng.normals(clip_mask.REWARD_STREAM + int(seed), vocab)}


def _outside(ratio: np.ndarray) -> np.ndarray:
    return (ratio < BAND[0]) | (ratio > BAND[1])


def _rel(g: np.ndarray, truth: np.ndarray, unit: np.ndarray):
    return np.linalg.norm(g - truth, axis=-1) / np.linalg.norm(unit, axis=-1)


def _value(x):
    return float(x) if np.ndim(x) == 0 else np.asarray(x, dtype=np.float64)


def measures(s: dict, methods=METHODS) -> dict:
    """Everything the lesson reports for one setting ``s`` (module docstring): kept mass and count, the mean ratio
    and the share outside the band without and with replay, the gap between the truths, and per method the bias of
    its expected update against each truth without ("plain") and with ("replay") mask replay, both in units of
    ||grad J(pi)||. Floats for one level; arrays [L] for a setting of L levels."""
    kept, log_pi = s["kept"], s["log_pi"]
    log_m = np.asarray(s["log_m"], dtype=np.float64)[..., None]
    pi = np.broadcast_to(np.exp(log_pi), kept.shape)
    mu = np.where(kept, np.exp(s["log_mu"]), 0.0)
    log_pi_s = np.where(kept, log_pi - log_m, -np.inf)
    pi_s = np.exp(log_pi_s)
    safe_mu = np.where(kept, s["log_mu"], 0.0)
    ratio = {False: np.where(kept, np.exp(log_pi - safe_mu), 1.0),  # outside S: never drawn (mu = 0)
             True: np.where(kept, np.exp(np.where(kept, log_pi_s, 0.0) - safe_mu), 1.0)}
    reward = s["reward"]

    def mean(w, x):  # sum over the tokens
        return (w * x).sum(-1)

    adv = reward - mean(mu, reward)[..., None]
    truth = {"full": pi * reward - pi * mean(pi, reward)[..., None],
             "deployed": pi_s * reward - pi_s * mean(pi_s, reward)[..., None]}
    out = {"kept_mass": _value(np.exp(log_m[..., 0])), "kept_count": _value(kept.sum(-1)),
           "mean_ratio": _value(mean(mu, ratio[False])), "mean_ratio_replay": _value(mean(mu, ratio[True])),
           "share_out": _value(mean(mu, _outside(ratio[False]))),
           "share_out_replay": _value(mean(mu, _outside(ratio[True]))),
           "gap": _value(_rel(truth["deployed"], truth["full"], truth["full"])), "bias": {}}
    for name in methods:
        out["bias"][name] = {}
        for replay, score in ((False, pi), (True, pi_s)):
            a = mu * clip_mask.coefficient(name, ratio[replay], np.broadcast_to(adv, kept.shape)) * adv
            g = a - score * a.sum(-1, keepdims=True)
            out["bias"][name][REPLAY[replay]] = {t: _value(_rel(g, truth[t], truth["full"])) for t in TRUTHS}
    return out


def sampled_mean_ratio(s: dict, batch: int, seed: int = 0, replay: bool = False) -> tuple[float, float]:
    """The mean trainer-to-sampler ratio over ``batch`` tokens drawn from the sampler (numpy, seed ``seed``) and its
    standard error: the Monte Carlo check of E_mu[pi/mu] = m."""
    mu = np.where(s["kept"], np.exp(s["log_mu"]), 0.0)
    y = np.random.default_rng(seed).choice(len(mu), size=int(batch), p=mu / mu.sum())
    log_pi = s["log_pi"] - (s["log_m"] if replay else 0.0)
    r = np.exp(log_pi[y] - s["log_mu"][y])
    return float(r.mean()), float(r.std(ddof=1) / math.sqrt(len(r)))


def sweep(kind: str, levels, vocab: int = 64, seed: int = 0, sharpness: float = 2.0, kl: float = 0.0,
          temperature: float = 1.0, methods=METHODS) -> pd.DataFrame:
    """Tidy table (kind, level, method, replay, metric, value) over the sampler's ``levels``; the setting's own
    metrics (kept mass, mean ratio, share outside the band, gap) have method "-"."""
    levels = [float(x) for x in levels]
    m = measures(setting(kind, levels, vocab, seed, sharpness, kl, temperature), methods)
    rows = []
    for i, lv in enumerate(levels):
        rows += [(kind, lv, "-", False, k, float(m[k][i])) for k in ("kept_mass", "kept_count", "mean_ratio",
                                                                     "share_out", "gap")]
        rows += [(kind, lv, "-", True, k, float(m[f"{k}_replay"][i])) for k in ("mean_ratio", "share_out")]
        for name in methods:
            for replay in (False, True):
                rows += [(kind, lv, name, replay, f"bias_{t}", float(m["bias"][name][REPLAY[replay]][t][i]))
                         for t in TRUTHS]
    return pd.DataFrame(rows, columns=["kind", "level", "method", "replay", "metric", "value"])


def token_table(kind: str, level, vocab: int = 64, seed: int = 0, sharpness: float = 2.0, kl: float = 0.0,
                temperature: float = 1.0) -> pd.DataFrame:
    """One row per token, most probable under pi first: pi, mu, kept, and the ratio without and with replay (NaN
    outside S, where the sampler never draws)."""
    s = setting(kind, level, vocab, seed, sharpness, kl, temperature)
    kept = s["kept"]
    ratio = np.where(kept, np.exp(s["log_pi"] - np.where(kept, s["log_mu"], 0.0)), np.nan)
    out = pd.DataFrame({"token": np.arange(vocab), "pi": np.exp(s["log_pi"]), "mu": np.exp(s["log_mu"]),
                        "kept": kept, "ratio": ratio, "ratio_replay": ratio / math.exp(s["log_m"])})
    return out.sort_values("pi", ascending=False, kind="stable").reset_index(drop=True)


def _curves(table: pd.DataFrame) -> dict:
    def col(method, replay, metric):
        sel = table[(table.method == method) & (table.replay == replay) & (table.metric == metric)]
        return sel["value"].tolist()

    out = {k: col("-", False, k) for k in ("kept_mass", "kept_count", "mean_ratio", "share_out", "gap")}
    out["share_out_replay"] = col("-", True, "share_out")
    out["bias"] = {m: {REPLAY[r]: {t: col(m, r, f"bias_{t}") for t in TRUTHS} for r in (False, True)}
                   for m in METHODS}
    return out


def page_data(kind: str, level, vocab: int = 64, seed: int = 0, sharpness: float = 2.0, kl: float = 0.0,
              temperature: float = 1.0, grid=None) -> dict:
    """What the browser page shows (the JavaScript twin computes the same): per token pi, mu and the kept set (1/0),
    the measures at ``level`` and the curves along ``grid`` (levels of the same kind; default ``level_grid``)."""
    grid = level_grid(kind, vocab) if grid is None else [float(x) for x in grid]
    s = setting(kind, level, vocab, seed, sharpness, kl, temperature)
    return {"pi": np.exp(s["log_pi"]).tolist(), "mu": np.exp(s["log_mu"]).tolist(),
            "kept": s["kept"].astype(np.float64).tolist(), "at": measures(s), "grid": grid,
            "curves": _curves(sweep(kind, grid, vocab, seed, sharpness, kl, temperature))}


# ---- exercises ------------------------------------------------------------------------------------------------

THREE = np.log([0.5, 0.35, 0.15])  # the exercises' three-token pi


def _three(top_p: float = 0.8) -> dict:
    """The three-token state of the exercises, pi = (0.5, 0.35, 0.15), sampled by top-p at temperature 1."""
    kept = kept_set(torch.as_tensor(THREE), top_p=top_p)
    return {"log_pi": THREE, "log_mu": torch.log_softmax(torch.as_tensor(THREE).masked_fill(~kept, -math.inf),
                                                         -1).numpy(),
            "kept": kept.numpy(), "log_m": float(kept_log_mass(torch.as_tensor(THREE), kept)),
            "reward": np.array([1.0, 0.0, 0.5])}


def _sampled_ratio() -> float:
    s = _three()
    y = np.flatnonzero(s["kept"])[0]
    return float(np.exp(s["log_pi"][y] - s["log_mu"][y]))


SHARES = (("a", "0"), ("b", "0.15"), ("c", "0.85"), ("d", "1"))


def _share_choice() -> str:
    share = measures(_three())["share_out"]
    return next(letter for letter, text in SHARES if abs(float(text) - share) < 1e-9)


UPDATES = (("a", "importance sampling without replay"), ("b", "importance sampling with replay"),
           ("c", "PPO clip without replay"), ("d", "TIS (cap 2) without replay"))


def _exact_choice() -> str:
    bias = measures(setting("top_p", 0.8))["bias"]
    picks = {"a": bias["token_is"]["plain"], "b": bias["token_is"]["replay"], "c": bias["ppo_clip"]["plain"],
             "d": bias["tis_token"]["plain"]}
    (letter,) = [k for k, b in picks.items() if b["deployed"] < 1e-12]
    return letter


def _tis_change() -> float:
    s = measures(setting("top_p", 0.8))["bias"]
    return abs(s["tis_token"]["plain"]["deployed"] - s["token_is"]["plain"]["deployed"])


def _gap() -> float:
    return measures(setting("top_p", 0.8))["gap"]


EXERCISES = {ex.key: ex for ex in (
    Exercise("sampled_ratio",
             "pi = (0.5, 0.35, 0.15) over three tokens. The engine samples at temperature 1 with top-p 0.8 (vLLM's "
             "rule: drop the least likely tokens while their total stays at most 1 - p) from pi's own logits. A "
             "sampled token's ratio pi(y)/mu(y) in a trainer that does not replay the mask is?",
             _sampled_ratio, rtol=1e-6,
             hint="which tokens survive, and what does renormalising over them do to each probability?",
             explanation="the sampler keeps {0.5, 0.35}, so mu(y) = pi(y)/0.85 and every sampled token has ratio "
                         "m = 0.85: the mean ratio under the sampler is the kept mass"),
    Exercise("share_outside",
             "Same sampler. What share of the sampled tokens has a ratio outside [0.9, 1.1] without replay?",
             _share_choice, kind="choice", choices=SHARES,
             hint="every sampled token has the same ratio",
             explanation="all of them: a band check flags the whole batch, although the sampler runs the trainer's "
                         "own logits; with replay every ratio is exactly 1 and none is flagged"),
    Exercise("exact_update",
             "Default state (V = 64, seed 0), top-p 0.8. Which expected one-token update equals the deployed gradient "
             "grad J(pi_S) exactly?",
             _exact_choice, kind="choice", choices=UPDATES,
             hint="which trainer scores the same distribution the sampler drew from?",
             explanation="with replay the ratio is pi_S/mu and importance sampling is unbiased for the deployed "
                         "policy; without replay the ratio is the constant m and the score is grad log pi, not "
                         "grad log pi_S"),
    Exercise("tis_change",
             "Same setting. By how much does TIS (cap 2) change the bias of importance sampling without replay "
             "(the absolute difference of the two, in units of ||grad J(pi)||)?",
             _tis_change, rtol=0.0, atol=1e-9,
             hint="where does TIS's cap act, and where do the ratios of a truncating sampler lie?",
             explanation="not at all: truncation gives ratios m <= 1, and a cap on large ratios never acts; TIS "
                         "cannot fix a ratio that is too small"),
    Exercise("truncation_gap",
             "Same setting. What is ||grad J(pi_S) - grad J(pi)|| / ||grad J(pi)||, the bias against the full "
             "gradient that no correction removes? Use lab.teach.sampler_truncation.measures.",
             _gap, rtol=0.01,
             hint="read the 'gap' of measures(setting('top_p', 0.8))",
             explanation="tokens outside the kept set are never sampled, so no reweighting of sampled tokens can "
                         "restore their part of the full gradient"),
)}
