"""Gradients of estimator losses with respect to policy parameters.

- ``replicate_gradients``: one gradient estimate per replicate batch, returned as ascent directions -grad loss,
  [M, D]. For the tabular policies every parameter a batch touches is a gathered row of logits, so torch.func
  takes vmap over replicates of grad with respect to those gathered logits [B, T, V], and one ``index_add_``
  scatters them into the parameter table: the same numbers as differentiating with respect to theta, without
  materialising a dense [D] gradient per replicate more than once.
- ``expected_gradient``: the exact expectation under mu of a per-batch estimate, by enumeration, for estimators
  whose batch loss is an average of per-sequence terms given fixed advantages (A = R, no group coupling).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.func import grad, vmap

from lab import estimators
from lab.errors import LabError
from lab.policies import token_log_probs


def ascent_loss_fn(name: str, loss_agg_mode: str, hyper: dict, static: dict | None = None):
    """(logits, tokens, mask, old_log_prob, advantages, extras) -> (-loss, metrics) for one batch.

    The loss is negated so that its gradient is the ascent direction. ``logits`` [B, T, V] are the current
    policy's (the estimator reads them by name if it declares them); ``extras`` holds its other extra tensor
    inputs (see lab.estimators.registry); ``static`` its non-tensor inputs (group_size).
    """
    info = estimators.info(name)
    static = static or {}
    wanted = set(info.inputs) | set(info.optional_inputs)

    def loss(logits, tokens, mask, old_log_prob, advantages, extras):
        log_prob = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1) * mask
        named = {k: v for k, v in {**extras, "logits": logits, **static}.items() if k in wanted}
        value, metrics = info.fn(log_prob, old_log_prob, advantages, mask, loss_agg_mode=loss_agg_mode, **hyper,
                                 **named)
        return -value, metrics

    return loss


def check_inputs(name: str, available) -> None:
    """Refuse an estimator whose required extra inputs this study does not provide."""
    missing = [k for k in estimators.info(name).inputs if k not in set(available) | {"logits"}]
    if missing:
        raise LabError(f"estimator {name!r} needs {', '.join(missing)}, which this study does not provide")


def replicate_gradients(policy, theta, batch, advantages, name, loss_agg_mode, hyper, extras=None, static=None,
                        out=None):
    """Ascent-direction estimates [M, D] and metrics {key: [M]} for every replicate of ``batch`` ([M, B, ...]).

    ``extras`` maps extra input names to tensors with the replicate axis first; ``static`` to plain values.
    ``out``, an [M, D] tensor from an earlier call, is zeroed and reused (a fresh M x D block costs more to
    fault in than the arithmetic).
    """
    extras = extras or {}
    check_inputs(name, [*extras, *(static or {})])
    V = policy.vocab_size
    table = theta.reshape(-1, V)
    M, R = batch.prompts.shape[0], table.shape[0]
    rows = policy.rows(batch.prompts, batch.tokens)  # [M, B, T]
    logits = F.embedding(rows, table)  # [M, B, T, V]: the only way the loss depends on theta
    per_batch = grad(ascent_loss_fn(name, loss_agg_mode, hyper, static), has_aux=True)
    g, metrics = vmap(per_batch)(logits, batch.tokens, batch.mask, batch.behaviour_log_probs, advantages, extras)
    if out is None or out.shape != (M, R * V) or out.dtype != theta.dtype:
        out = torch.zeros(M, R * V, dtype=theta.dtype)
    else:
        out.zero_()
    index = (rows + torch.arange(M)[:, None, None] * R).reshape(-1)
    out.view(M * R, V).index_add_(0, index, g.reshape(-1, V))
    return out, metrics


def loop_gradients(policy, theta, batch, advantages, name, loss_agg_mode, hyper, extras=None, static=None):
    """The same estimates as ``replicate_gradients``, with a Python loop of ordinary backward passes (the
    benchmark's baseline, and the reference the tests compare the engine with).

    One backward pass per sample: every estimator's batch loss but GVPO's is an aggregate of per-sequence terms
    (``agg_loss``), so each sample's loss is computed on a one-sample batch and weighted by its share of the
    batch loss: its token count over the batch's for token-mean, 1/B for the other modes. GVPO's loss couples
    the samples of a group (group means of rewards and log-ratios), so estimators whose ``inputs`` include
    ``group_size`` get one backward pass per replicate batch instead. ``extras`` and ``static`` are as for
    ``replicate_gradients``; the logits, when the estimator reads them, are computed from theta.
    """
    extras = extras or {}
    check_inputs(name, [*extras, *(static or {})])
    ascent_loss = ascent_loss_fn(name, loss_agg_mode, hyper, static)
    whole_batch = "group_size" in estimators.info(name).inputs
    M, B = batch.prompts.shape
    out = torch.zeros(M, theta.numel(), dtype=theta.dtype)
    for m in range(M):
        th = theta.detach().clone().requires_grad_(True)  # the sample gradients accumulate in th.grad
        n_tokens = batch.mask[m].sum().clamp(min=1.0)
        parts = [slice(0, B)] if whole_batch else [slice(i, i + 1) for i in range(B)]
        for part in parts:
            mask = batch.mask[m, part]
            logits = policy.logits(th, batch.prompts[m, part], batch.tokens[m, part])
            value, _ = ascent_loss(logits, batch.tokens[m, part], mask, batch.behaviour_log_probs[m, part],
                                   advantages[m, part], {k: v[m, part] for k, v in extras.items()})
            if whole_batch:
                weight = 1.0
            elif loss_agg_mode == "token-mean":
                weight = mask.sum() / n_tokens
            else:
                weight = 1.0 / B
            (weight * value).backward()
        out[m] = th.grad.reshape(-1)
    return out


def separable(loss_agg_mode: str, env) -> bool:
    """Whether the batch loss is a fixed-weight average of per-sequence terms (so enumeration gives its mean)."""
    return loss_agg_mode != "token-mean" or not env.eos


def expected_gradient(env, policy, theta_pi, theta_mu, support_mu, name, loss_agg_mode, hyper):
    """E_mu[estimate] exactly (float64), advantages A = E[R | x, y]; None when the loss is not separable.

    The per-token coefficients c = d loss / d log pi on the enumerated batch of N pairs are (1/N) times each
    sequence's own coefficients; reweighting them by N mu(y) and pulling back through log pi gives the mean.
    For Bernoulli rewards A = E[R|x,y] is exact because every estimator here is linear in A for A >= 0.
    """
    if not separable(loss_agg_mode, env):
        return None
    s = support_mu
    with torch.no_grad():
        old = token_log_probs(policy, theta_mu.double(), s.prompts, s.tokens) * s.mask
    adv = env.expected_reward(s.prompts, s.tokens, s.mask)[:, None] * s.mask
    theta = theta_pi.detach().double().requires_grad_(True)
    log_prob = (token_log_probs(policy, theta, s.prompts, s.tokens) * s.mask)
    lp_leaf = log_prob.detach().requires_grad_(True)
    loss, _ = estimators.get(name)(lp_leaf, old, adv, s.mask, loss_agg_mode=loss_agg_mode, **hyper)
    (coef,) = torch.autograd.grad(loss, lp_leaf)
    coef = coef * s.weights[:, None] * s.weights.shape[0]
    (g,) = torch.autograd.grad((coef.detach() * log_prob).sum(), theta)
    return -g.reshape(-1)
