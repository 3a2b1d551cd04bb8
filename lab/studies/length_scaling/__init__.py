"""The length study: bias, variance and MSE of the off-policy corrections and the importance-weight diagnostics as
the response grows from a few tokens to a thousand, at a fixed per-token KL and at a fixed sequence KL, against the
exact gradient by dynamic programming, with fitted growth rates beside the theory; and, on a transformer trained
under staleness, whether the corrections' order changes with the length of the answer."""
from lab.studies import Report, Study

STUDY = Study(
    "length_scaling", rank=5,
    reports=(
        Report("length_scaling", "How the corrections' bias and variance grow with response length, against "
                                 "(1 + χ²)^T and the first-order token-level bias.",
               smoke={"lengths": [8, 32], "replicates": 30, "n_boot": 100, "trajectory_steps": 2}),
    ),
)
