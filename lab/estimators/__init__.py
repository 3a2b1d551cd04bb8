"""Estimators: pure functions of tensors in one registry. ``names()``, ``get(name)``, ``info(name)``."""
from lab.estimators import clipping, policy_gradient  # noqa: F401  (modules register on import)
from lab.estimators.aggregation import AGG_MODES, agg_loss
from lab.estimators.registry import EstimatorInfo, check_hyper, get, info, names, register

__all__ = ["AGG_MODES", "EstimatorInfo", "agg_loss", "check_hyper", "get", "info", "names", "register"]
