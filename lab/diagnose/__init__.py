"""``lab diagnose``: importance-weight diagnostics on a training run's own rollout logs.

- neutral format: ``schema`` (columns, metadata, validation), ``neutral`` (writers, streaming reader)
- adapters from framework dumps: ``adapters`` (prime-rl token exports, slime --dump-details, SkyRL dumped data)
- the streaming pass and its tables: ``streaming.diagnose`` -> ``Diagnostics`` (tables, summary, verdict)
- the training simulator's per-batch metrics from a log: ``lab_metrics.lab_weight_metrics``
- synthetic logs: ``synthetic``; figures for the report: ``figures``; the command: ``cli``
"""
from lab.diagnose.streaming import Diagnostics, diagnose
from lab.diagnose.neutral import NeutralLogWriter, RolloutLog, RolloutLogWriter, open_log
from lab.diagnose.schema import make_meta


def __getattr__(name):  # lab_metrics works on torch tensors: imported on first use, not by `lab diagnose`
    if name in ("lab_weight_metrics", "weight_metrics_tensors"):
        from lab.diagnose import lab_metrics

        return getattr(lab_metrics, name)
    raise AttributeError(f"module 'lab.diagnose' has no attribute {name!r}")

__all__ = ["Diagnostics", "NeutralLogWriter", "RolloutLog", "RolloutLogWriter", "diagnose", "lab_weight_metrics",
           "make_meta", "open_log", "weight_metrics_tensors"]
