"""The distillation study: on-policy distillation's estimators (vanilla OPD, vOPD with the full or a top-k baseline,
the full-vocabulary and top-k KL losses) against two exact targets on an enumerable toy vocabulary: bias, variance,
what a baseline buys, and where it helps."""
from lab.studies import Report, Study

STUDY = Study(
    "distillation", rank=40,
    reports=(
        Report("distillation", "On-policy distillation: vanilla OPD, vOPD (full and top-k baselines), full-vocabulary "
                               "and top-k KL: bias against both targets, variance, and where the baseline's variance "
                               "reduction holds (vocabulary size, student-teacher divergence).",
               defaults={"grid_vocab_sizes": [3, 8, 32]},
               smoke={"vocab_size": 8, "length": 2, "replicates": 40, "k_values": [2], "teacher_steps": 3,
                      "grid_vocab_sizes": [3, 8], "grid_teacher_noises": [1.0], "grid_replicates": 40,
                      "grid_lengths": [2]},
               formerly=("opd_variance",)),
    ),
)
