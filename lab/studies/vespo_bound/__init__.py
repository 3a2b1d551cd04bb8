"""The vespo_bound study: VESPO's variance bound (Proposition 3.1, Shen et al., arXiv 2602.10693) checked exactly by
enumeration along three staleness knobs, and VESPO against sequence IS on the same batches as rollouts go stale."""
from lab.studies import Report, Study

STUDY = Study(
    "vespo_bound", rank=10,
    reports=(
        Report("vespo_bound", "VESPO's variance bound (Proposition 3.1) checked exactly by enumeration, and VESPO "
                              "against sequence IS up to 64x staleness.",
               smoke={"lags": [0, 4], "kl_targets": [0.1], "temperatures": [2.0], "bound_seeds": [0],
                      "replicates": 40, "trajectory_steps": 4, "kernels": [[2, 3], [3, 2], [1, 1], [0.5, 1]]}),
    ),
)
