"""Gradients of estimator losses with respect to policy parameters.

- ``replicate_gradients``: one gradient estimate per replicate batch, vectorised with torch.func
  (vmap over replicates of grad of the loss), returned as ascent directions -grad loss, [M, D].
- ``expected_gradient``: the exact expectation under mu of a per-batch estimate, by enumeration, for estimators
  whose batch loss is an average of per-sequence terms given fixed advantages (A = R, no group coupling).
"""
from __future__ import annotations

import torch
from torch.func import grad, vmap

from lab import estimators
from lab.errors import LabError
from lab.policies import token_log_probs


def loss_fn(policy, name: str, loss_agg_mode: str, hyper: dict, static: dict | None = None):
    """(theta, prompts, tokens, mask, old_log_prob, advantages, extras) -> (loss, metrics) for one batch.

    ``extras`` holds the estimator's extra tensor inputs by name (see lab.estimators.registry); ``logits`` is
    computed here from theta so that it carries the gradient; ``static`` holds non-tensor inputs (group_size).
    """
    info = estimators.info(name)
    static = static or {}
    wanted = set(info.inputs) | set(info.optional_inputs)

    def loss(theta, prompts, tokens, mask, old_log_prob, advantages, extras):
        logits = policy.logits(theta, prompts, tokens)
        log_prob = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1) * mask
        named = {k: v for k, v in {**extras, "logits": logits, **static}.items() if k in wanted}
        return info.fn(log_prob, old_log_prob, advantages, mask, loss_agg_mode=loss_agg_mode, **hyper, **named)

    return loss


def check_inputs(name: str, available) -> None:
    """Refuse an estimator whose required extra inputs this study does not provide."""
    missing = [k for k in estimators.info(name).inputs if k not in set(available) | {"logits"}]
    if missing:
        raise LabError(f"estimator {name!r} needs {', '.join(missing)}, which this study does not provide")


def replicate_gradients(policy, theta, batch, advantages, name, loss_agg_mode, hyper, extras=None, static=None,
                        chunk_size=128):
    """Ascent-direction estimates [M, D] and metrics {key: [M]} for every replicate of ``batch`` ([M, B, ...]).

    ``extras`` maps extra input names to tensors with the replicate axis first; ``static`` to plain values.
    """
    extras = extras or {}
    check_inputs(name, [*extras, *(static or {})])
    per_batch = grad(loss_fn(policy, name, loss_agg_mode, hyper, static), has_aux=True)
    grads, metrics = vmap(per_batch, in_dims=(None, 0, 0, 0, 0, 0, 0), chunk_size=chunk_size)(
        theta, batch.prompts, batch.tokens, batch.mask, batch.behaviour_log_probs, advantages, extras)
    return -grads.reshape(grads.shape[0], -1), metrics


def loop_gradients(policy, theta, batch, advantages, name, loss_agg_mode, hyper):
    """The same estimates with a Python loop and one backward pass per sample (the benchmark's baseline).

    Valid for sequence-separable losses (every mode but token-mean with variable lengths): the batch loss is
    the sum of each sample's loss computed on a batch where the other samples' masks are zero.
    """
    fn = estimators.get(name)
    M, B = batch.prompts.shape
    out = torch.zeros(M, theta.numel(), dtype=theta.dtype)
    for m in range(M):
        for i in range(B):
            th = theta.detach().clone().requires_grad_(True)
            only_i = torch.zeros_like(batch.mask[m])
            only_i[i] = batch.mask[m, i]
            log_prob = token_log_probs(policy, th, batch.prompts[m], batch.tokens[m]) * only_i
            loss, _ = fn(log_prob, batch.behaviour_log_probs[m] * only_i, advantages[m], only_i,
                         loss_agg_mode=loss_agg_mode, **hyper)
            if loss_agg_mode == "token-mean":  # rescale to the full batch's token count
                loss = loss * only_i.sum() / batch.mask[m].sum()
            loss.backward()
            out[m] -= th.grad.reshape(-1)
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
