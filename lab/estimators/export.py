"""Carry an estimator into verl: ``to_verl(name)`` returns a policy loss with verl's exact signature.

verl (0.9.1) calls a registered policy loss as ``fn(old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights) -> (loss, metrics)``: the OLD log-probs first, ``response_mask`` often
bool, ``config`` the actor config (verl.workers.config.ActorConfig), ``rollout_is_weights`` the rollout
correction's detached weights or None. The lab's own estimators take ``(log_prob, old_log_prob, advantages,
response_mask, loss_agg_mode, **hyper)``. Usage::

    from verl.trainer.ppo.core_algos import register_policy_loss
    register_policy_loss("lab_vespo")(lab.estimators.to_verl("vespo"))
    # then actor_rollout_ref.actor.policy_loss.loss_mode=lab_vespo

Hyper-parameters (read from ``config`` at every call; values passed to ``to_verl(name, **hyper)`` are fixed and
win over the config):

    lab hyper-parameter   verl config field (ActorConfig), as verl's own losses read them
    clip_ratio_low        config.clip_ratio_low, or config.clip_ratio when that is None
    clip_ratio_high       config.clip_ratio_high, or config.clip_ratio when that is None
    clip_ratio_c          config.clip_ratio_c (ActorConfig default 3.0: the exported ppo_clip has verl's dual clip)
    tau_pos, tau_neg      config.tau_pos, config.tau_neg
    any other             config.policy_loss.<name>.<key>, e.g. policy_loss.vespo.k_pos (the key VESPO's reference
                          code reads) or policy_loss.tis_token.cap; absent: the lab's default

Aggregation reproduces verl's ``core_algos.agg_loss`` with ``config.global_batch_info`` (dp_size,
batch_num_tokens, global_batch_size, loss_scale_factor), which verl's trainer fills for every micro-batch:
token-mean divides by batch_num_tokens, the seq-mean-* modes by global_batch_size (every sequence of the mini-batch),
seq-mean-token-sum-norm also by loss_scale_factor (default: the padded length T), all times dp_size; "token-sum" is
supported. Without that information (a loss called on its own), as verl: token-mean divides by the micro-batch's
tokens and the seq-mean-* modes by its NON-EMPTY rows. One difference: an all-masked micro-batch gives 0, where
verl's token-mean gives 0/0.

``rollout_is_weights`` (verl's decoupled-mode correction) are applied as verl's losses apply them, by multiplying
the per-token loss; where that loss is positively homogeneous in the advantage (``EstimatorInfo.homogeneous``) the
weights scale the advantages (exact); the others (DRO's penalty, BAPO's and the covariance rules' A-dependent
selections, VCPO, M2PO's clip) refuse them. GMPO takes their geometric mean per sequence as verl's geo_mean does;
VESPO folds log w into its sequence log-weight as VESPO's reference code does (rollout_log_probs =
old_log_prob - log max(w, 1e-8)). Metrics come back as floats: ``actor/ppo_kl``, ``actor/pg_clipfrac``,
``actor/pg_clipfrac_lower`` where the estimator has them, the rest as ``<name>/<metric>``.

Mask replay (a sampler with top-p / top-k / min-p): pass ``kept_log_mass`` = log pi(S_t), the trainer's
log-probability of the sampler's recorded kept set at each position ([B, T], computed from the actor's logits and
the dumped kept ids with ``lab.policies.truncation.kept_log_mass``, carrying the gradient), as a keyword; the loss
then scores log_prob - kept_log_mass (lab.estimators.contract). verl's own trainer does not pass it: call the
exported loss from an actor that does, and renormalise a recomputed old_log_prob the same way.

The two-policy estimators (tis_*, mis_*, seq_is) compute their weight from log_prob and old_log_prob themselves:
use them with verl's bypass mode, where old_log_prob is the sampler's. Estimators that need inputs verl's policy-loss
signature does not carry (GVPO's rewards, the KL penalties' reference, the distillation family's teacher) are
refused.
"""
from __future__ import annotations

from typing import Callable

from lab.lazy import torch

from lab.errors import LabError
from lab.estimators.registry import check_hyper, info

VERL_FIELDS = {"clip_ratio_low": ("clip_ratio_low", "clip_ratio"), "clip_ratio_high": ("clip_ratio_high", "clip_ratio"),
               "clip_ratio_c": ("clip_ratio_c",), "tau_pos": ("tau_pos",), "tau_neg": ("tau_neg",)}
VERL_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
METRIC_NAMES = {"ppo_kl": "actor/ppo_kl", "clipfrac": "actor/pg_clipfrac", "clipfrac_lower": "actor/pg_clipfrac_lower"}
_MISSING = object()


def _get(obj, key):
    """obj.key or obj[key] (verl configs are dataclasses with a dict-like ``get``; DictConfig and dict work too)."""
    if obj is None:
        return _MISSING
    if isinstance(obj, dict):
        return obj.get(key, _MISSING)
    value = getattr(obj, key, _MISSING)
    if value is _MISSING and hasattr(obj, "get"):
        try:
            value = obj.get(key, _MISSING)
        except Exception:  # noqa: BLE001 - a config object whose get() refuses unknown keys
            value = _MISSING
    return value


def verl_hyper(name: str, config, fixed: dict | None = None) -> dict:
    """The estimator's hyper-parameters read from a verl actor config (see the module docstring), checked."""
    i = info(name)
    fixed = dict(fixed or {})
    section = _get(_get(config, "policy_loss"), name)
    hyper = {}
    for key, default in i.defaults.items():
        if key in fixed:
            hyper[key] = fixed[key]
            continue
        value = _MISSING
        for field in VERL_FIELDS.get(key, ()):
            value = _get(config, field)
            if value is not _MISSING and value is not None:
                break
        if (value is _MISSING or value is None) and key not in VERL_FIELDS:
            value = _get(section, key)
        hyper[key] = default if value is _MISSING or (value is None and key in VERL_FIELDS) else value
    check_hyper(name, hyper)
    return hyper


def _scale(mode: str, mask: torch.Tensor, batch_info: dict):
    """(the lab mode to run, the factor turning its loss into verl's agg_loss under ``batch_info``)."""
    dp = batch_info.get("dp_size") or 1
    rows_total = batch_info.get("global_batch_size")
    tokens_total = batch_info.get("batch_num_tokens")
    horizon = batch_info.get("loss_scale_factor")
    if dp > 1 and ((mode in ("token-mean",) and tokens_total is None)
                   or (mode.startswith("seq-mean") and rows_total is None)):
        raise LabError(f"loss_agg_mode {mode!r} with dp_size {dp} needs global batch information "
                       f"(config.global_batch_info), as verl's agg_loss does")
    B, T = mask.shape
    tokens = mask.sum().clamp(min=1.0)
    rows = (mask.sum(-1) > 0).sum().clamp(min=1).to(mask.dtype)
    rows_den = rows if rows_total is None else float(rows_total)
    if mode == "token-mean":
        return "token-mean", tokens / (tokens if tokens_total is None else float(tokens_total)) * dp
    if mode == "token-sum":
        return "token-mean", tokens * dp
    if mode in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return mode, B / rows_den * dp
    return mode, B * T / (rows_den * (T if horizon is None else float(horizon))) * dp


def to_verl(name: str, **hyper) -> Callable:
    """A policy loss with verl's signature ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
    config, rollout_is_weights) -> (loss, metrics)`` computing the lab's estimator ``name``; ``hyper`` fixes
    hyper-parameters (the rest are read from verl's config). See the module docstring for the mapping."""
    i = info(name)
    if i.inputs:
        raise LabError(f"estimator {name!r} needs {', '.join(i.inputs)}, which verl's policy-loss signature does not "
                       f"carry; it cannot be exported with to_verl")
    if i.fixed_agg:
        raise LabError(f"estimator {name!r} defines its own aggregation; it cannot be exported with to_verl")
    check_hyper(name, hyper)
    fn = i.fn

    def policy_loss(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                    response_mask: torch.Tensor, loss_agg_mode: str = i.loss_agg_mode, config=None,
                    rollout_is_weights: torch.Tensor | None = None, kept_log_mass: torch.Tensor | None = None):
        if loss_agg_mode not in VERL_MODES:
            raise LabError(f"unknown loss_agg_mode {loss_agg_mode!r}; verl knows {', '.join(VERL_MODES)}")
        dtype = log_prob.dtype if log_prob.dtype not in (torch.float16, torch.bfloat16) else torch.float32
        mask = response_mask.to(dtype)
        params = verl_hyper(name, config, hyper)
        named = {}
        adv = advantages
        if rollout_is_weights is not None and not i.homogeneous and name not in ("vespo", "gmpo"):
            raise LabError(f"estimator {name!r} is not linear in the advantage (its selection or penalty depends on "
                           f"A's size), so verl's rollout_is_weights cannot be folded into it; use verl's bypass mode "
                           f"(no weights) or an estimator that takes rollout_log_probs")
        if rollout_is_weights is not None:
            w = rollout_is_weights.detach().to(dtype)
            if name == "vespo":
                named["rollout_log_probs"] = old_log_prob.detach().to(dtype) - torch.log(w.clamp(min=1e-8))
            elif name == "gmpo":  # verl geo_mean: exp(mean_t log(w + 1e-10)) per sequence
                length = mask.sum(-1)
                log_w = torch.where(mask > 0, torch.log(w + 1e-10), torch.zeros((), dtype=dtype))
                adv = advantages * torch.exp(log_w.sum(-1) / (length + 1e-8))[:, None]
            else:
                adv = advantages * w
        if kept_log_mass is not None:
            named["kept_log_mass"] = kept_log_mass  # the contract refuses it where mask replay does not apply
        batch_info = dict(_get(config, "global_batch_info") or {}) if config is not None else {}
        mode, factor = _scale(loss_agg_mode, mask, batch_info)
        loss, metrics = fn(log_prob, old_log_prob, adv, mask, loss_agg_mode=mode, **params, **named)
        out = {METRIC_NAMES.get(k, f"{name}/{k}"): float(v) for k, v in metrics.items()}
        return loss * factor, out

    policy_loss.__name__ = f"lab_{name}"
    policy_loss.__qualname__ = f"lab_{name}"
    policy_loss.__doc__ = f"The lab's {name!r} estimator with verl's policy-loss signature (lab.estimators.to_verl)."
    return policy_loss


__all__ = ["to_verl", "verl_hyper"]
