"""The rollout_diagnostics study: importance-weight diagnostics of a training run's own rollout log (``lab
diagnose``'s library, lab.diagnose), or of a simulated bf16/async run."""
from lab.studies import Report, Study

STUDY = Study(
    "rollout_diagnostics", rank=50,
    reports=(
        Report("rollout_diagnostics", "Importance-weight diagnostics of a training run's own rollout log (or a "
                                      "simulated bf16/async run): sampler/trainer log-ratios by token probability and "
                                      "length, ESS and k-hat per step, staleness, and what each correction would clip "
                                      "or mask.",
               smoke={"simulate_steps": 3, "simulate_batch": 32, "simulate_vocab": 32, "simulate_mean_len": 20,
                      "simulate_lag_max": 2, "simulate_drift": 0.05}),
    ),
)
