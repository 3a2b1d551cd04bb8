"""The core the studies compose: exact supports and gradients (``exact``), staleness knobs (``staleness``), the Batch
record (``batches``), estimators resolved for a run (``estimator``), per-replicate gradients (``gradients``),
gradient statistics (``metrics``), the variance engine (``variance``), the training simulator (``training``) and
resumable sweeps (``sweep``). Nothing here imports a study or the report package."""
