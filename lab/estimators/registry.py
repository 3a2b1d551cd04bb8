"""One registry, one decorator, one signature (after verl's policy-loss registry).

Sampled-token estimators: ``fn(log_prob, old_log_prob, advantages, response_mask,
loss_agg_mode="token-mean", **hyper) -> (loss, metrics)``. All tensors are [B, T]; ``log_prob`` carries the
gradient, the others are data. Metrics are 0-dim tensors so that every estimator runs under ``torch.func.vmap``.

Estimators that need more than that (group rewards for GVPO, full-vocabulary logits or a teacher for the
distillation family, a reference policy for KL penalties, the sampler's log-probs in a decoupled three-policy
batch) name those extra inputs as keyword-only arguments and list them in ``inputs=``; callers pass them by
name. Known extra inputs (all [B, T] unless said): ``rewards`` [B], ``group_size`` (int), ``logits`` [B, T, V]
(the current policy's, carrying the gradient), ``teacher_log_prob``, ``teacher_logits`` [B, T, V],
``ref_log_prob``, ``rollout_log_probs``.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

from lab.errors import LabError


@dataclass(frozen=True)
class EstimatorInfo:
    name: str
    fn: Callable
    family: str  # on-policy | importance-sampling | clipping | ...
    source: str  # the paper or system the formula and defaults come from
    unbiased_for: str  # what its expectation equals, or "biased" with the reason
    description: str  # one line
    coefficient: Callable | None = None  # effective coefficient on grad log pi, as a plain function
    defaults: dict = field(default_factory=dict)  # hyper-parameters and their defaults
    inputs: tuple = ()  # extra named inputs, required (see the module docstring)
    optional_inputs: tuple = ()  # extra named inputs it uses when given (e.g. rollout_log_probs)
    grad_scale: Callable | None = None  # hyper -> c: on-policy, E[-grad loss] = c * grad J (None: c = 1)
    ratio: str = "token"  # its coefficient's ratio: token rho_t, sequence W = pi(y)/mu(y), geometric W^(1/|y|)
    loss_agg_mode: str = "token-mean"  # its own default aggregation (the one its source runs)
    fixed_agg: bool = False  # True: its loss defines its own aggregation and ignores loss_agg_mode (GVPO)


_REGISTRY: dict[str, EstimatorInfo] = {}


def register(name: str, *, family: str, source: str, unbiased_for: str, coefficient: Callable | None = None,
             inputs: tuple = (), optional_inputs: tuple = (), grad_scale: Callable | None = None,
             ratio: str = "token", fixed_agg: bool = False):
    """Decorator: add ``fn`` to the registry; its keyword defaults (other than the named inputs) become the
    registry's hyper-parameter defaults."""

    def wrap(fn):
        signature = inspect.signature(fn).parameters
        params = signature.values()
        agg = signature["loss_agg_mode"].default if "loss_agg_mode" in signature else "token-mean"
        skip = {"loss_agg_mode", *inputs, *optional_inputs}
        defaults = {p.name: p.default for p in params if p.default is not inspect._empty and p.name not in skip}
        doc = (fn.__doc__ or "").strip().splitlines()
        _REGISTRY[name] = EstimatorInfo(name, fn, family, source, unbiased_for, doc[0] if doc else "", coefficient,
                                        defaults, tuple(inputs), tuple(optional_inputs), grad_scale, ratio, agg, fixed_agg)
        return fn

    return wrap


def names() -> list[str]:
    return list(_REGISTRY)


def info(name: str) -> EstimatorInfo:
    if name not in _REGISTRY:
        raise LabError(f"unknown estimator {name!r}; known estimators: {', '.join(_REGISTRY)} (see `lab estimators`)")
    return _REGISTRY[name]


def get(name: str) -> Callable:
    return info(name).fn


def check_hyper(name: str, hyper: dict) -> None:
    unknown = set(hyper) - set(info(name).defaults)
    if unknown:
        raise LabError(f"estimator {name!r} has no hyper-parameter(s) {', '.join(sorted(unknown))}; "
                       f"it takes {', '.join(info(name).defaults) or 'none'}")
