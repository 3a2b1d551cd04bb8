"""Estimators: pure functions of tensors in one registry. ``names()``, ``get(name)``, ``info(name)``."""
from lab.estimators import (  # noqa: F401  (modules register on import)
    clipping,
    distillation,
    gated,
    gvpo,
    kl_penalty,
    policy_gradient,
    sequence_ratio,
    truncation,
    vespo,
)
from lab.estimators.aggregation import AGG_MODES, agg_loss
from lab.estimators.registry import EstimatorInfo, check_hyper, get, info, names, register

__all__ = ["AGG_MODES", "EstimatorInfo", "agg_loss", "check_hyper", "get", "info", "names", "register"]
