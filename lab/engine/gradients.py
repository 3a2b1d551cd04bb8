"""Gradients of estimator losses with respect to policy parameters.

- ``replicate_gradients``: one gradient estimate per replicate batch, as ascent directions -grad loss, [M, D].
  Two backends, chosen by the policy's ``gradient_backend``:
  * "rows" (tabular policies): every parameter a batch touches is a gathered row of logits, so torch.func takes
    vmap over replicates of grad with respect to those gathered logits [B, T, V], and one ``index_add_`` scatters
    them into the parameter table: the same numbers as differentiating with respect to theta, without
    materialising a dense [D] gradient per replicate more than once;
  * "functional" (networks, and any policy): vmap over replicates of grad of the loss through
    ``policy.logits(theta, ...)`` with respect to theta itself, in chunks of replicates. The default chunk comes
    from a memory budget (``budget_chunk``), so the [chunk, D] block one call yields is bounded whatever M.
- ``loop_gradients``: the same numbers with ordinary backward passes, one per sample (the tests' reference) or one
  batched pass per replicate (the benchmarks' strongest baseline).
- ``expected_gradient``: the exact expectation under mu of a per-batch estimate, by enumeration, for estimators
  whose batch loss is an average of per-sequence terms given fixed advantages (A = R, no group coupling).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import grad, vmap

from lab.engine.estimator import Estimator
from lab.engine.exact import chunks, pullback
from lab.policies import masked, token_log_probs
from lab.policies.truncation import replayed, sampler_kept

GRADIENT_MEMORY_BUDGET = 2 * 2**30  # bytes of gradient estimates held at once (default chunk, streamed statistics)
ROW_BYTES = 8  # bytes per coordinate of an estimate as the statistics hold it (float64)


def budget_chunk(D: int, budget: int = GRADIENT_MEMORY_BUDGET) -> int:
    """Replicates per vmap call of the functional backend within ``budget`` bytes:

        chunk = max(1, budget // (8 D))

    (8 bytes per coordinate: float64, the precision in which ``lab.engine.metrics.streamed_metrics`` holds and
    multiplies the estimates), so the [chunk, D] block of estimates stays within the budget whatever M."""
    return max(1, int(budget) // (ROW_BYTES * max(int(D), 1)))


def replicate_gradients(policy, theta, batch, advantages, est: Estimator, extras=None, static=None, out=None,
                        chunk: int | None = None, budget: int = GRADIENT_MEMORY_BUDGET):
    """Ascent-direction estimates [M, D] and metrics {key: [M]} for every replicate of ``batch`` ([M, B, ...]).

    ``extras`` maps extra input names to tensors with the replicate axis first; ``static`` to plain values.
    ``out``, an [M, D] tensor from an earlier call, is zeroed and reused (a fresh M x D block costs more to
    fault in than the arithmetic). ``chunk``: replicates per vmap call of the functional backend (None:
    ``budget_chunk(D, budget)``). The [M, D] result itself is the caller's to afford; ``stream_gradients`` and
    ``lab.engine.metrics.streamed_metrics`` never build it.
    """
    M = batch.prompts.shape[0]
    chunks = list(stream_gradients(policy, theta, batch, advantages, est, extras, static, chunk, out, budget))
    if len(chunks) == 1:  # the rows backend's own buffer, or one vmap call
        return chunks[0][1], chunks[0][2]
    out = _buffer(out, M, chunks[0][1].shape[1], theta.dtype)
    for rows, g, _ in chunks:
        out[rows] = g.to(out.device)
    return out, {k: torch.cat([c[2][k] for c in chunks]) for k in chunks[0][2]}


def stream_gradients(policy, theta, batch, advantages, est: Estimator, extras=None, static=None, chunk=None,
                     out=None, budget: int = GRADIENT_MEMORY_BUDGET):
    """Yield (replicate rows, estimates [c, D] on theta's device, metrics) chunk by chunk (see replicate_gradients).

    The rows backend yields all M replicates at once (into ``out`` when given; a study bounds M D for it before
    running); the functional backend yields ``chunk`` replicates per vmap call (None: ``budget_chunk(D,
    budget)``), so only [chunk, D] estimates exist at a time.
    """
    extras = extras or {}
    est.check_inputs([*extras, *(static or {})])
    loss = est.ascent_loss(static)
    if policy.gradient_backend == "rows":
        g, metrics = _rows_backend(policy, theta, batch, advantages, loss, extras, out)
        yield slice(0, g.shape[0]), g, metrics
        return
    yield from _functional_backend(policy, theta, batch, advantages, loss, extras,
                                   chunk or budget_chunk(theta.numel(), budget))


def _buffer(out, M: int, D: int, dtype) -> torch.Tensor:
    if out is None or out.shape != (M, D) or out.dtype != dtype:
        return torch.zeros(M, D, dtype=dtype)
    return out.zero_()


def _rows_backend(policy, theta, batch, advantages, loss, extras, out):
    V = policy.vocab_size
    table = theta.reshape(-1, V)
    M, R = batch.prompts.shape[0], table.shape[0]
    rows = policy.rows(batch.prompts, batch.tokens)  # [M, B, T]
    logits = F.embedding(rows, table)  # [M, B, T, V]: the only way the loss depends on theta
    g, metrics = vmap(grad(loss, has_aux=True))(logits, batch.tokens, batch.mask, batch.behaviour_log_probs,
                                                advantages, extras)
    out = _buffer(out, M, R * V, theta.dtype)
    index = (rows + torch.arange(M)[:, None, None] * R).reshape(-1)
    out.view(M * R, V).index_add_(0, index, g.reshape(-1, V))
    return out, metrics


def _functional_backend(policy, theta, batch, advantages, loss, extras, chunk: int):
    """vmap over replicates of grad through ``policy.logits`` w.r.t. theta itself, on theta's device, ``chunk``
    replicates per call."""
    def per_batch(th, prompts, tokens, mask, old, adv, ex):
        return loss(policy.logits(th, prompts, tokens), tokens, mask, old, adv, ex)

    per_replicate = vmap(grad(per_batch, has_aux=True), in_dims=(None, 0, 0, 0, 0, 0, 0))
    dev, th = theta.device, theta.detach()
    M = batch.prompts.shape[0]
    for s in range(0, M, chunk):
        sl = slice(s, min(s + chunk, M))
        g, m = per_replicate(th, batch.prompts[sl].to(dev), batch.tokens[sl].to(dev), batch.mask[sl].to(dev),
                             batch.behaviour_log_probs[sl].to(dev), advantages[sl].to(dev),
                             {k: v[sl].to(dev) for k, v in extras.items()})
        yield sl, g.reshape(g.shape[0], -1), {k: v.cpu() for k, v in m.items()}


def loop_gradients(policy, theta, batch, advantages, est: Estimator, extras=None, static=None, per: str = "sample"):
    """The same estimates as ``replicate_gradients``, with a Python loop of ordinary backward passes.

    ``per="replicate"``: one batched backward pass per replicate batch (what a researcher writes first, and the
    strongest obvious alternative to the engine). ``per="sample"``: one backward pass per sample, the reference the
    tests compare the engine with: every estimator's batch loss but GVPO's is an aggregate of per-sequence terms
    (``agg_loss``), so each sample's loss is computed on a one-sample batch and weighted by its share of the batch
    loss (its token count over the batch's for token-mean, 1/B for the other modes). GVPO's loss couples the
    samples of a group, so estimators that need groups always get one pass per replicate. The logits, when the
    estimator reads them, come from theta.
    """
    extras = extras or {}
    est.check_inputs([*extras, *(static or {})])
    ascent_loss = est.ascent_loss(static)
    M, B = batch.prompts.shape
    whole = per == "replicate" or est.needs_groups
    out = torch.zeros(M, theta.numel(), dtype=theta.dtype)
    for m in range(M):
        th = theta.detach().clone().requires_grad_(True)  # the sample gradients accumulate in th.grad
        n_tokens = batch.mask[m].sum().clamp(min=1.0).to(theta.device)
        for part in [slice(0, B)] if whole else [slice(i, i + 1) for i in range(B)]:
            dev = th.device
            mask, tokens = batch.mask[m, part].to(dev), batch.tokens[m, part].to(dev)
            logits = policy.logits(th, batch.prompts[m, part].to(dev), tokens)
            value, _ = ascent_loss(logits, tokens, mask, batch.behaviour_log_probs[m, part].to(dev),
                                   advantages[m, part].to(dev), {k: v[m, part].to(dev) for k, v in extras.items()})
            if whole:
                weight = 1.0
            elif est.loss_agg_mode == "token-mean":
                weight = mask.sum() / n_tokens
            else:
                weight = 1.0 / B
            (weight * value).backward()
        out[m] = th.grad.reshape(-1)
    return out


def separable(loss_agg_mode: str, env) -> bool:
    """Whether the batch loss is a fixed-weight average of per-sequence terms (so enumeration gives its mean)."""
    return loss_agg_mode != "token-mean" or not env.eos


def expected_gradient(env, policy, theta_pi, mu: tuple, support_mu, est: Estimator):
    """E_mu[estimate] exactly (float64), advantages A = E[R | x, y]; None when the loss is not separable.

    ``mu`` is the behaviour (policy, theta) and ``support_mu`` its distribution. The per-token coefficients
    c = d loss / d log pi on the enumerated batch of N pairs are (1/N) times each sequence's own coefficients;
    reweighting them by N mu(y) and pulling back through log pi gives the mean. For Bernoulli rewards A = E[R|x,y]
    is exact because every estimator here is linear in A for A >= 0.
    """
    if not separable(est.loss_agg_mode, env):
        return None
    s = support_mu
    parts = chunks(policy, s.prompts.shape[0], s.tokens.shape[1])
    with torch.no_grad():
        old = masked(torch.cat([token_log_probs(mu[0], mu[1].double(), s.prompts[c], s.tokens[c]) for c in parts]),
                     s.mask)
        kept = None
        if est.mask_replay and sampler_kept(mu[0]) is not None:  # the sampler's kept sets, as it records them
            kept = torch.cat([torch.isfinite(mu[0].logits(mu[1].double(), s.prompts[c], s.tokens[c])).cpu()
                              for c in parts])
    adv = env.expected_reward(s.prompts, s.tokens, s.mask)[:, None] * s.mask
    if kept is not None:
        return _expected_replayed(policy, theta_pi, s, old, adv, kept, est, parts)
    if policy.gradient_backend == "rows":  # one pass: the tabular numbers exactly as they always were
        theta = theta_pi.detach().double().requires_grad_(True)
        log_prob = (token_log_probs(policy, theta, s.prompts, s.tokens) * s.mask)
        lp_leaf = log_prob.detach().requires_grad_(True)
        loss, _ = est.loss_on_log_probs(lp_leaf, old, adv, s.mask)
        (coef,) = torch.autograd.grad(loss, lp_leaf)
        coef = coef * s.weights[:, None] * s.weights.shape[0]
        (g,) = torch.autograd.grad((coef.detach() * log_prob).sum(), theta)
        return -g.reshape(-1)
    with torch.no_grad():  # networks: the coefficients on the log-probs, then one chunked pull-back
        lp = torch.cat([token_log_probs(policy, theta_pi.double(), s.prompts[c], s.tokens[c])
                        for c in chunks(policy, s.prompts.shape[0], s.tokens.shape[1])]) * s.mask
    lp_leaf = lp.requires_grad_(True)
    loss, _ = est.loss_on_log_probs(lp_leaf, old, adv, s.mask)
    (coef,) = torch.autograd.grad(loss, lp_leaf)
    coef = coef * s.mask * s.weights[:, None] * s.weights.shape[0]
    return -pullback(policy, theta_pi, s.prompts, s.tokens, coef.detach()).reshape(-1)


def replayed_log_probs(policy, theta, prompts, tokens, kept) -> torch.Tensor:
    """log pi(y_t) - log pi(S_t): the trainer's log-probs renormalised over the kept sets ``kept`` [..., T, V]
    (``lab.policies.truncation.replayed``)."""
    return replayed(policy.logits(theta, prompts, tokens), tokens, kept).to(tokens.device)


def _expected_replayed(policy, theta_pi, s, old, adv, kept, est: Estimator, parts) -> torch.Tensor:
    """expected_gradient with mask replay: the coefficients c = d loss / d log_prob on the replayed log-probs,
    pulled back through log pi(y_t) - log pi(S_t) (kept sets fixed), chunk by chunk."""
    with torch.no_grad():
        lp = torch.cat([replayed_log_probs(policy, theta_pi.double(), s.prompts[c], s.tokens[c], kept[c])
                        for c in parts])
    lp_leaf = masked(lp, s.mask).requires_grad_(True)
    loss, _ = est.loss_on_log_probs(lp_leaf, old, adv, s.mask)
    (coef,) = torch.autograd.grad(loss, lp_leaf)
    coef = (coef * s.mask * s.weights[:, None] * s.weights.shape[0]).detach()
    return -replayed_pullback(policy, theta_pi, s.prompts, s.tokens, kept, coef).reshape(-1)


def replayed_pullback(policy, theta, prompts, tokens, kept, coef: torch.Tensor) -> torch.Tensor:
    """grad_theta sum_{n, t} coef[n, t] (log pi(y_t) - log pi(S_t)) with the kept sets S fixed ([N, T, V]) and
    detached coefficients [N, T] (0 on padding), float64, one backward pass per chunk of pairs."""
    theta = theta.detach().double().requires_grad_(True)
    total = torch.zeros_like(theta)
    for c in chunks(policy, prompts.shape[0], tokens.shape[1]):
        lp_c = replayed_log_probs(policy, theta, prompts[c], tokens[c], kept[c])
        (g,) = torch.autograd.grad(masked(coef[c] * lp_c, coef[c] != 0).sum(), theta)
        total += g
    return total


def exact_direction(env, policy, theta_pi, mu: tuple, support_mu, est: Estimator, grad_j: torch.Tensor) -> dict | None:
    """The exact expected gradient (advantage = R, by enumeration) against the estimator's target c grad J:
    relative bias ||E g - c grad J|| / ||c grad J||, cos(E g, grad J) and size ||E g|| / ||c grad J||. A shorter
    gradient that points the right way has cosine 1 and size < 1: its bias is a step size, not a direction. None
    when the loss is not separable or needs inputs beyond the samples (group rewards)."""
    if est.info.inputs:
        return None
    g = expected_gradient(env, policy, theta_pi, mu, support_mu, est)
    return None if g is None else direction(g, est, grad_j, env.length)


def direction(g: torch.Tensor, est: Estimator, grad_j: torch.Tensor, length: int) -> dict:
    """``exact_direction``'s numbers for a given exact expected gradient ``g`` (flat, before the estimator's scale)."""
    g = g / est.grad_scale
    target = est.target_scale(length) * grad_j.reshape(-1).to(g.device)
    norm = float(target.norm())
    return {"exact_rel_bias": float((g - target).norm()) / norm,
            "exact_cos": float(g @ target) / (float(g.norm()) * norm) if float(g.norm()) > 0 else float("nan"),
            "exact_size": float(g.norm()) / norm}
