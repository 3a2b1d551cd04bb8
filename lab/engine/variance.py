"""The variance engine: every estimator on the same replicate batches from one behaviour policy.

``measure`` draws M independent batches of B responses from mu (B/G prompts drawn uniformly, G responses each),
computes group advantages, evaluates every estimator on the same batches (per-replicate gradients, vmap over
replicates) and compares the M estimates with the target c * grad J of pi (c from the estimator's aggregation;
estimators whose on-policy gradient is a multiple of grad J, as GVPO's beta, are divided by it first). It returns
tidy rows: sampled weight diagnostics (estimator "-") and, per estimator, the statistics of
``lab.engine.metrics.gram_metrics``, the estimator's own metrics, and ``exact_bias_norm`` = ||E_mu[g] - g*|| where
the mean is known exactly: by enumeration (exact reference, advantage "reward"), or by dynamic programming (dp
reference: ``lab.engine.dp.expected_estimate``, token IS and REINFORCE with advantages reward, rloo, drgrpo); every
other estimator's bias is its replicates' mean against the exact g*, with its bootstrap interval. A sampled (Monte
Carlo) grad J comes with the trace of its covariance, which the statistics remove from ||g*||^2
(``lab.engine.metrics``).

Estimators' inputs (``estimator_batch``): every estimator sees old_log_prob = mu's log-probs (the sampler's) and
the group rewards, except that
- a three-policy estimator (``rollout_log_probs`` required: decoupled PPO, M2PO, verl's decoupled presets) sees the
  decoupled batch of a trainer that recomputes pi_old at the start of the update: old_log_prob = pi's own log-probs
  (the first mini-batch of the update, whose gradient the engine measures) and rollout_log_probs = mu's;
- ``selection_keys`` (Clip-Cov's random choice) are uniform numbers drawn once per staleness setting, after the
  batches, shared by every estimator;
- ``lag`` (A-3PO's interpolation) is the lag k of a "lag" staleness setting (the behaviour carries it).
Estimators that only accept ``rollout_log_probs`` as optional run the two-policy form, as before.

Memory: the estimates are streamed (``lab.engine.gradients.stream_gradients``), ``chunk`` replicates per vmap call
(default ``budget_chunk(D, memory_budget)``), into ``streamed_metrics``, which holds a few times ``memory_budget``
bytes of them at most (``lab.engine.metrics.streamed_memory`` counts them) plus the M x M Gram, whatever M and D.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from lab import advantages as adv_mod
from lab import stats
from lab.engine import dp
from lab.engine.batches import draw_batches
from lab.engine.exact import Problem, Support
from lab.engine.gradients import GRADIENT_MEMORY_BUDGET, budget_chunk, expected_gradient, stream_gradients
from lab.engine.batches import Batch
from lab.engine.metrics import gram_metrics, streamed_metrics, weight_diagnostics
from lab.errors import LabError
from lab.policies import token_log_probs
from lab.policies.truncation import replayed

PROVIDED_INPUTS = ("rewards", "group_size", "logits", "rollout_log_probs", "selection_keys", "lag")  # see the docstring


@dataclass(frozen=True)
class Sampling:
    """How the replicate batches are drawn, differentiated and summarised."""

    replicates: int  # M
    batch_size: int  # B
    group_size: int  # G
    advantage: str  # lab.advantages kind
    ci: float  # interval coverage
    n_boot: int  # bootstrap resamples
    chunk: int | None = None  # replicates per vmap call of the functional backend (None: from memory_budget)
    memory_budget: int = GRADIENT_MEMORY_BUDGET  # bytes of estimates held at once (beyond: a multi-pass exact Gram)

    def chunk_for(self, D: int) -> int:
        """Replicates per vmap call: the given chunk, else budget_chunk(D, memory_budget) = budget // (8 D)."""
        return self.chunk or budget_chunk(D, self.memory_budget)


def measure(problem: Problem, theta_pi, mu: tuple, support_mu: Support | None, ests: list, grad_j: torch.Tensor,
            sampling: Sampling, generator: torch.Generator, rng: np.random.Generator, on_estimator=None,
            grad_j_var: float = 0.0, targets: dict | None = None):
    """(rows, per-estimator point values, intervals) for one behaviour mu = (policy, theta).

    ``rows`` are dicts (estimator, metric, value, lo, hi); ``grad_j`` is the exact (or reference) grad J of pi,
    flat, and ``grad_j_var`` the trace of its covariance (0 when exact; a Monte Carlo reference's, from
    ``lab.engine.exact.reference_gradient``: the target c grad J then has c^2 grad_j_var); ``on_estimator`` is
    called after each estimator (progress). The same ``generator`` draws the batches and ``rng`` the bootstrap
    counts, shared by every estimator. ``targets`` ({name: exact gradient}, optional): the same statistics against
    each of these too, as metrics "<metric>@<name>" (the estimates must fit the memory budget at once).
    """
    env, policy = problem.env, problem.policy
    M, B, G = sampling.replicates, sampling.batch_size, sampling.group_size
    batch = draw_batches(env, mu, M, B, G, generator)
    adv = adv_mod.group_advantages(batch.rewards.reshape(M, B // G, G), sampling.advantage).reshape(M, B)
    adv = adv[..., None] * batch.mask
    counts = stats.bootstrap_counts(M, sampling.n_boot, rng)
    theta32 = theta_pi.float()
    with torch.no_grad():
        lp_pi = token_log_probs(policy, theta32, batch.prompts, batch.tokens) * batch.mask
        replayed_old = None
        if batch.kept is not None and any(e.mask_replay and e.info.three_policy for e in ests):
            logits = policy.logits(theta32, batch.prompts, batch.tokens)
            replayed_old = replayed(logits, batch.tokens, batch.kept).to(lp_pi.device) * batch.mask
    rows = []

    def add(estimator, metric, v, lo=None, hi=None):
        rows.append({"estimator": estimator, "metric": metric, "value": float(v),
                     "lo": float(v if lo is None else lo), "hi": float(v if hi is None else hi)})

    for metric, (v, lo, hi) in weight_diagnostics(batch, lp_pi, counts, sampling.ci).items():
        add("-", metric, v, lo, hi)
    add("-", "mean_reward_sampled", *stats.mean_interval(batch.rewards.mean(-1).numpy(), counts, sampling.ci))
    points, intervals = {}, {}
    buffer = None  # the [M, D] estimates of the exact path, one buffer reused by every estimator
    exact_bias = problem.reference == "exact" and sampling.advantage == "reward" and support_mu is not None
    D = int(np.prod(policy.shape))
    lag = getattr(mu, "lag", None)
    for est in ests:
        if est.needs_lag() and lag is None:
            raise LabError(f"estimator {est.name!r} with proximal='loglinear' (A-3PO) interpolates by the version lag, "
                           f"which only the 'lag' staleness knob defines; use --staleness lag or proximal='recompute'")
    keys = (torch.rand(batch.mask.shape, generator=generator, dtype=batch.mask.dtype)
            if any("selection_keys" in e.wanted for e in ests) else None)
    for est in ests:
        scale, c = est.grad_scale, est.target_scale(env.length)
        g_star = c * grad_j
        est_batch, extras = estimator_batch(batch, lp_pi, est, keys, lag, replayed_old)
        stream = _estimates(policy, theta32, est_batch, adv, est, extras, G, sampling.chunk_for(D), scale, buffer)
        res, metrics, buffer = streamed_metrics(stream, M, D, g_star, sampling.memory_budget, counts, sampling.ci,
                                                buffer, target_var=c**2 * grad_j_var)
        for tname, target in (targets or {}).items():
            if buffer is None:
                raise LabError(f"{M} replicates x {D:,} parameters do not fit the memory budget at once, which "
                               f"statistics against a second target need; use fewer replicates")
            res.update({f"{m}@{tname}": v for m, v in gram_metrics(buffer, (c * target).reshape(-1).float(), counts,
                                                                  sampling.ci).items()})
        expected = None
        if exact_bias and not est.info.inputs:
            expected = expected_gradient(env, policy, theta_pi, mu, support_mu, est)
        elif problem.reference == "dp":
            expected = dp.expected_estimate(env, policy, theta_pi, mu, est, sampling.advantage, G)
        if expected is not None:
            res["exact_bias_norm"] = (float((expected / scale - g_star).norm()),) * 3
        for metric, values in metrics.items():
            res[metric] = stats.mean_interval(values.double().numpy(), counts, sampling.ci)
        for metric, (v, lo, hi) in res.items():
            add(est.name, metric, v, lo, hi)
        points[est.name] = {m: v[0] for m, v in res.items()}
        intervals[est.name] = {m: [v[1], v[2]] for m, v in res.items()}
        if on_estimator:
            on_estimator()
    return rows, points, intervals


def estimator_batch(batch: Batch, lp_pi: torch.Tensor, est, keys=None, lag=None,
                    replayed_old: torch.Tensor | None = None) -> tuple[Batch, dict]:
    """(the batch whose behaviour_log_probs the estimator sees as old_log_prob, its extra tensor inputs), both with the
    replicate axis first (see the module docstring). With mask replay and a truncating sampler the kept sets go in
    as ``kept``, and a three-policy estimator's recomputed pi_old is renormalised over them too (``replayed_old``:
    log pi(y_t) - log pi(S_t))."""
    extras = {"rewards": batch.rewards}
    if est.mask_replay and batch.kept is not None:
        extras["kept"] = batch.kept
    if est.info.three_policy:
        extras["rollout_log_probs"] = batch.behaviour_log_probs
        old = lp_pi if replayed_old is None or "kept" not in extras else replayed_old
        batch = Batch(batch.prompts, batch.tokens, batch.mask, old.to(batch.behaviour_log_probs.dtype) * batch.mask,
                      batch.rewards, batch.group_size)
    if "selection_keys" in est.wanted and keys is not None:
        extras["selection_keys"] = keys
    if "lag" in est.wanted and lag is not None:
        extras["lag"] = torch.full(batch.mask.shape, float(lag), dtype=batch.mask.dtype)
    return batch, extras


def _estimates(policy, theta, batch: Batch, adv, est, extras: dict, G: int, chunk: int, scale: float, buffer):
    """stream(start): the estimates (divided by the estimator's on-policy scale) of replicates start..M-1, ``chunk``
    replicates at a time (functional backend)."""
    def stream(start: int):
        sub = Batch(batch.prompts[start:], batch.tokens[start:], batch.mask[start:],
                    batch.behaviour_log_probs[start:], batch.rewards[start:], batch.group_size)
        out = buffer if start == 0 else None
        for reps, g, m in stream_gradients(policy, theta, sub, adv[start:], est,
                                           {k: v[start:] for k, v in extras.items()}, {"group_size": G}, chunk,
                                           out=out):
            yield slice(reps.start + start, reps.stop + start), (g if scale == 1 else g / scale), m
    return stream
