"""The variance study: bias, variance and MSE of every off-policy correction, on the same replicate batches, against
the exact policy gradient, as the behaviour policy goes stale (lag, KL or temperature)."""
from lab.studies import Report, Study

STUDY = Study(
    "variance", rank=0,
    reports=(
        Report("variance", "How wrong and how noisy is the policy gradient under each off-policy correction as "
                           "rollouts go stale.", smoke={"replicates": 40, "values": [0, 4]},
               formerly=("estimator_variance",)),
        Report("variance_zoo", "Every estimator side by side: its effective coefficient on grad log pi, and bias, "
                               "variance and MSE on the same batches across staleness.",
               defaults={"values": [0, 2, 8, 32, 64], "estimators": ["all"], "replicates": 300},
               smoke={"replicates": 30, "values": [0, 8]}, formerly=("estimator_zoo",)),
    ),
)
