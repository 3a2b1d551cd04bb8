"""A registered estimator resolved once for a study: its registry entry, hyper-parameters and aggregation.

Studies and the training simulator resolve each name here, once, when they validate their config; everything
downstream (gradients, targets, scales) reads the resolved object instead of the registry.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lab import estimators
from lab.errors import LabError
from lab.estimators.aggregation import check_mode, target_scale
from lab.estimators.registry import EstimatorInfo
from lab.policies import log_probs_of
from lab.policies.truncation import replayed


@dataclass(frozen=True)
class Estimator:
    name: str
    info: EstimatorInfo = field(repr=False)
    hyper: dict  # overrides of the registry defaults
    loss_agg_mode: str  # the aggregation it runs with
    mask_replay: bool = False  # renormalise the trainer's log-probs over the sampler's recorded kept sets

    @classmethod
    def resolve(cls, name: str, hyper: dict | None = None, loss_agg_mode: str = "native",
                mask_replay: bool = False) -> "Estimator":
        """Look ``name`` up, check ``hyper``, and fix the aggregation: the study's mode, or with "native" (or when
        the loss defines its own aggregation, as GVPO's does) the estimator's own default. ``mask_replay``: the
        sampler's kept sets (extra input ``kept``, [B, T, V] bool) are replayed (lab.estimators.contract)."""
        info = estimators.info(name)
        if mask_replay and not info.mask_replay:
            raise LabError(f"estimator {name!r} has no mask replay (it is not scored on the sampled tokens' "
                           f"log-probs alone); leave it out or turn mask replay off")
        hyper = dict(hyper or {})
        estimators.check_hyper(name, hyper)
        if loss_agg_mode != "native":
            check_mode(loss_agg_mode)
        mode = info.loss_agg_mode if loss_agg_mode == "native" or info.fixed_agg else loss_agg_mode
        return cls(name, info, hyper, mode, mask_replay)

    @property
    def grad_scale(self) -> float:
        """c with E[-grad loss] = c * grad J on-policy (GVPO: beta); estimates are divided by it before comparison."""
        return 1.0 if self.info.grad_scale is None else float(self.info.grad_scale({**self.info.defaults,
                                                                                       **self.hyper}))

    def target_scale(self, length: int) -> float:
        """The factor c such that the aggregated REINFORCE gradient estimates c * grad J (fixed-length responses)."""
        return target_scale(self.loss_agg_mode, length)

    @property
    def needs_groups(self) -> bool:
        return "group_size" in self.info.inputs

    @property
    def wanted(self) -> set:
        """Every extra input it reads (required or optional)."""
        return set(self.info.inputs) | set(self.info.optional_inputs)

    def needs_lag(self) -> bool:
        """A-3PO's log-linear proximal policy interpolates by the version lag (lab.estimators.decoupled)."""
        return {**self.info.defaults, **self.hyper}.get("proximal") == "loglinear"

    def check_inputs(self, available) -> None:
        """Refuse an estimator whose required extra inputs the caller does not provide (logits always are)."""
        missing = [k for k in self.info.inputs if k not in set(available) | {"logits"}]
        if missing:
            raise LabError(f"estimator {self.name!r} needs {', '.join(missing)}, which this study does not provide")

    def ascent_loss(self, static: dict | None = None):
        """(logits, tokens, mask, old_log_prob, advantages, extras) -> (-loss, metrics) for one batch.

        The loss is negated so that its gradient is the ascent direction. ``logits`` [B, T, V] are the current
        policy's (passed by name if the estimator declares them); ``extras`` holds its other extra tensor inputs
        (see lab.estimators.registry); ``static`` its non-tensor inputs (group_size).
        """
        static = static or {}
        wanted = self.wanted
        fn, mode, hyper = self.info.fn, self.loss_agg_mode, self.hyper

        replay = self.mask_replay

        def loss(logits, tokens, mask, old_log_prob, advantages, extras):
            if replay and extras.get("kept") is not None:  # the contract's kept_log_mass, computed as log q is
                log_prob = replayed(logits, tokens, extras["kept"]) * mask
            else:
                log_prob = log_probs_of(logits, tokens) * mask
            named = {k: v for k, v in {**extras, "logits": logits, **static}.items() if k in wanted}
            value, metrics = fn(log_prob, old_log_prob, advantages, mask, loss_agg_mode=mode, **hyper, **named)
            return -value, metrics

        return loss

    def loss_on_log_probs(self, log_prob: torch.Tensor, old_log_prob, advantages, mask, **named):
        """The estimator's (loss, metrics) on given log-probs (for exact expectations by enumeration)."""
        return self.info.fn(log_prob, old_log_prob, advantages, mask, loss_agg_mode=self.loss_agg_mode, **self.hyper,
                            **named)
