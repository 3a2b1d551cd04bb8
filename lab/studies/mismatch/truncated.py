"""What a truncating sampler (top-p, top-k) does to the trainer/sampler token ratio, measured on a real network.

The sampler (an inference engine: weights in a DTYPE, KV cache, ``measure.parse_setting``) draws y_t from its
truncated, renormalised distribution q(a) = p_s(a) 1[a in S_t] / p_s(S_t), with S_t its kept set
(``lab.policies.truncation.kept_set``, vLLM's order), and records S_t. The trainer (float32, full sequence) scores
the same tokens with the full softmax pi. Per real token,

    ratio          rho_t = pi(y_t) / q(y_t)
    kept mass      pi(S_t) = sum_{a in S_t} pi(a)   (the trainer's mass on the sampler's kept set)
    renormalised   rho'_t = pi(y_t) / (pi(S_t) q(y_t)): the trainer's log-softmax restricted to S_t
                   (``truncation.replayed``; slime's sampling-mask replay, DeepSeek-V3.2's keep-sampling-mask)

and over tokens: ``ratio_mean`` and ``renorm_mean`` (mean ratio), ``ratio_outside`` and ``renorm_outside`` (share
of tokens with the ratio outside [0.9, 1.1]), ``kept_mass`` (mean pi(S_t)), ``ratio_minus_mass`` (mean of
rho_t - pi(S_t)), ``kept_size`` (mean |S_t|), ``entropy`` (the trainer's mean next-token entropy
H(pi(. | s_t)) in nats, which sets how much mass a top-p / top-k cut leaves out). Where sampler and trainer agree
(p_s = pi), E_q[rho_t | s_t] = sum_{a in S_t} pi(a) = pi(S_t): the mean ratio is the mean kept mass, and the
renormalised ratio is 1 up to the dtype mismatch alone. Per token, by definition, rho_t = pi(S_t) rho'_t: where the
renormalised ratio is 1 the ratio IS the kept mass, token by token. Intervals are percentile bootstrap intervals over
sequences.

Published figures (``measure.PRACTITIONERS["truncation"]``): TRL PR 7269 on Qwen2.5-1.5B. A smaller model has a
different next-token entropy, so its kept mass, and hence its mean ratio, differ; the identity mean ratio = mean kept
mass is what carries over.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from lab.errors import LabError
from lab.policies.truncation import active, check_truncation, kept_log_mass, kept_set, replayed
from lab.studies.mismatch import measure

BAND = (0.9, 1.1)  # the ratio band of the published share "outside [0.9, 1.1]"
METRICS = ("ratio_mean", "ratio_outside", "kept_mass", "ratio_minus_mass", "renorm_mean", "renorm_outside",
           "kept_size", "entropy", "tokens")


@dataclass(frozen=True)
class Truncation:
    """A sampler truncation: ``top_p`` (1: off) and ``top_k`` (None: off); ``name`` as written."""

    name: str
    top_p: float = 1.0
    top_k: int | None = None

    def kept(self, logits: torch.Tensor) -> torch.Tensor:
        return kept_set(logits, self.top_k, self.top_p)


def parse_truncation(text: str, vocab_size: int | None = None) -> Truncation:
    """``top_p=P``, ``top_k=K`` or both joined by a comma (``top_p=0.9,top_k=50``); bad values are one LabError."""
    knobs = {}
    for part in str(text).replace(" ", "").split(","):
        key, _, val = part.partition("=")
        if key not in ("top_p", "top_k") or not val or key in knobs:
            raise LabError(f"unknown sampler truncation {text!r}; write top_p=P, top_k=K or top_p=P,top_k=K")
        try:
            knobs[key] = float(val) if key == "top_p" else (int(val) if float(val) == int(float(val)) else float(val))
        except ValueError:
            raise LabError(f"sampler truncation {text!r}: {key} must be a number, got {val!r}") from None
    check_truncation(knobs.get("top_p", 1.0), knobs.get("top_k"), 0.0, vocab_size)
    return Truncation(str(text).replace(" ", ""), knobs.get("top_p", 1.0), knobs.get("top_k"))


@dataclass
class TruncatedDraw:
    """One truncated sampler's batch: tokens, log q (the sampler's renormalised log-probs), the trainer's log pi,
    log pi(S_t) and the trainer's renormalised log-probs, and |S_t|; all [N, T] (float32; mask 1 on real tokens)."""

    setting: str
    truncation: str
    prompts: torch.Tensor
    tokens: torch.Tensor
    mask: torch.Tensor
    sampler: torch.Tensor  # log q(y_t)
    trainer: torch.Tensor  # log pi(y_t)
    log_kept_mass: torch.Tensor  # log pi(S_t)
    trainer_renorm: torch.Tensor  # log pi(y_t) - log pi(S_t)
    kept_size: torch.Tensor  # |S_t|
    entropy: torch.Tensor  # H(pi(. | s_t)), nats


def draw(policy, theta, prompts: torch.Tensor, setting: str, truncation: Truncation | str,
         generator: torch.Generator, chunk: int = 8) -> TruncatedDraw:
    """Sample one response per prompt id with the truncating sampler in ``setting``, recording its kept sets, and
    score it with the trainer (float32, full sequence; ``chunk`` sequences at a time)."""
    s = measure.parse_setting(setting)
    tr = parse_truncation(truncation, policy.vocab_size) if isinstance(truncation, str) else truncation
    if s.head32:
        raise LabError(f"setting {s.name!r}: the truncation measurement runs without +head32")
    on = active(tr.top_p, tr.top_k, 0.0, policy.vocab_size)  # off: the untruncated sampler, bit for bit
    if on:  # the engine records its kept sets [N, T, V]
        tokens, lp_q, _, S = policy.generate(theta, prompts, generator, dtype=s.dtype, kv_cache=s.kv_cache,
                                             truncation={"top_p": tr.top_p, "top_k": tr.top_k})
        S = S.cpu()
    else:
        tokens, lp_q, _ = policy.generate(theta, prompts, generator, dtype=s.dtype, kv_cache=s.kv_cache)
        S = torch.ones(*tokens.shape, policy.vocab_size, dtype=torch.bool)
    th = theta.detach().float()
    parts = {"trainer": [], "log_kept_mass": [], "trainer_renorm": [], "entropy": []}
    with torch.no_grad():
        for i in range(0, prompts.shape[0], chunk):
            z = policy.logits(th, prompts[i:i + chunk], tokens[i:i + chunk]).float().cpu()
            y, k = tokens[i:i + chunk].cpu(), S[i:i + chunk]
            lp = torch.log_softmax(z, -1)
            parts["trainer"].append(lp.gather(-1, y[..., None]).squeeze(-1))
            parts["entropy"].append(-(lp.exp() * lp).nan_to_num().sum(-1))
            parts["log_kept_mass"].append(kept_log_mass(z, k))
            parts["trainer_renorm"].append(replayed(z, y, k))
    mask_of = getattr(policy, "mask_of", None)
    mask = mask_of(tokens) if mask_of is not None else torch.ones(tokens.shape)
    return TruncatedDraw(s.name, tr.name, prompts.cpu(), tokens.cpu(), mask.float().cpu(), lp_q.float().cpu(),
                         **{k: torch.cat(v).float() for k, v in parts.items()}, kept_size=S.sum(-1).float())


def summarize(d: TruncatedDraw, n_boot: int = 1000, ci: float = 0.95, seed: int = 0) -> dict:
    """{metric: [value, lo, hi]} over the real tokens (module doc), intervals over sequences."""
    base = measure.Draw(d.setting, d.prompts, d.tokens, d.mask, d.sampler, d.trainer)
    x = measure._batch(base, n_boot, ci, seed)
    m = x.m
    log_q = d.sampler.double().numpy()
    rho = np.exp(np.clip(d.trainer.double().numpy() - log_q, -20, 20))
    rho_r = np.exp(np.clip(d.trainer_renorm.double().numpy() - log_q, -20, 20))
    mass = np.exp(d.log_kept_mass.double().numpy())

    def outside(r):
        return ((r < BAND[0]) | (r > BAND[1])).astype(np.float64)

    per_token = {"ratio_mean": rho, "ratio_outside": outside(rho), "kept_mass": mass, "ratio_minus_mass": rho - mass,
                 "renorm_mean": rho_r, "renorm_outside": outside(rho_r), "kept_size": d.kept_size.double().numpy(),
                 "entropy": d.entropy.double().numpy()}
    out = {k: x.ratio(x.per_seq(v), x.n_tok) for k, v in per_token.items()}
    out["tokens"] = [float(m.sum())] * 3
    return out


def measure_all(policy, theta, prompts: torch.Tensor, settings: list, truncations: list, generator_of,
                n_boot: int = 1000, ci: float = 0.95, seed: int = 0, on_draw=None) -> dict:
    """{setting: {truncation: summary}} for every sampler setting and truncation, each on the same prompts and the
    uniforms of ``generator_of()`` (common random numbers)."""
    trs = [parse_truncation(t, policy.vocab_size) for t in truncations]
    out = {}
    for s in settings:
        out[s] = {}
        for tr in trs:
            out[s][tr.name] = summarize(draw(policy, theta, prompts, s, tr, generator_of()), n_boot, ci, seed)
            if on_draw:
                on_draw()
    return out


def rows(model: str, results: dict) -> list[dict]:
    """Tidy rows (model, setting, metric, x, value, lo, hi, n) with the metric ``trunc:<truncation>:<metric>``."""
    return [{"model": model, "setting": s, "metric": f"trunc:{t}:{k}", "x": math.nan, "value": v[0], "lo": v[1],
             "hi": v[2], "n": summ["tokens"][0]}
            for s, by in results.items() for t, summ in by.items() for k, v in summ.items()]


__all__ = ["BAND", "METRICS", "Truncation", "TruncatedDraw", "draw", "measure_all", "parse_truncation",
           "rows", "summarize"]
