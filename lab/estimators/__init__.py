"""Estimators: pure functions of tensors in one registry. ``names()``, ``get(name)``, ``info(name)``,
``check_hyper(name, hyper)``, ``check_inputs(name, ...)``, ``to_verl(name)`` (a policy loss for verl's registry).
The argument order and the input contract every estimator is held to: lab.estimators.registry.

Modules register on import, in this order (the order listings and reports use): REINFORCE and importance
sampling, PPO clipping, truncated and masked IS, gated (CISPO, SAPO), sequence-ratio (GSPO, GMPO), VESPO, GVPO,
KL penalties, on-policy distillation; then the corrections the trainers shipped in 2026 and the papers beside them:
divergence trust regions (DPPO, prime-rl), sequence rejection (verl's Geo/K3/Seq-RS, SkyRL's geometric mask, OPSM),
decoupled PPO (AReaL, A-3PO, M2PO), covariance selection (Clip-Cov, KL-Cov), REINFORCE-form losses (DRO, GPG),
rescaled sequence ratios (LUSPO, GEPO), adaptive clipping (BAPO, ASPO, CTPO) and VCPO's baseline. verl's
rollout-correction presets resolve by name as ``verl:NAME`` (lab.estimators.presets).
"""
# isort: off
from lab.estimators import policy_gradient  # noqa: F401
from lab.estimators import clipping  # noqa: F401
from lab.estimators import truncation  # noqa: F401
from lab.estimators import gated  # noqa: F401
from lab.estimators import sequence_ratio  # noqa: F401
from lab.estimators import vespo  # noqa: F401
from lab.estimators import gvpo  # noqa: F401
from lab.estimators import kl_penalty  # noqa: F401
from lab.estimators import distillation  # noqa: F401
from lab.estimators import trust_region  # noqa: F401
from lab.estimators import rejection  # noqa: F401
from lab.estimators import decoupled  # noqa: F401
from lab.estimators import covariance  # noqa: F401
from lab.estimators import regularized  # noqa: F401
from lab.estimators import group_sequence  # noqa: F401
from lab.estimators import adaptive_clip  # noqa: F401
from lab.estimators import baselines  # noqa: F401
# isort: on
from lab.estimators.aggregation import AGG_MODES, agg_loss
from lab.estimators.export import to_verl
from lab.estimators.registry import EstimatorInfo, check_hyper, check_inputs, get, info, names, register

__all__ = ["AGG_MODES", "EstimatorInfo", "agg_loss", "check_hyper", "check_inputs", "get", "info", "names", "register",
           "to_verl"]
