"""The real_distillation study: on-policy distillation from a real teacher transformer, each estimator of the family
training a small student across vocabulary sizes and student-teacher gaps; where vOPD's baseline cuts the gradient
variance and why, the reverse KL over training, and the cost per step. Its full grid is a sweep
(sweeps/real_distillation.yaml, kind distill)."""
from lab.studies import Report, Study

STUDY = Study(
    "real_distillation", rank=90,
    reports=(
        Report("real_distillation", "On-policy distillation from a real teacher transformer: where vOPD's baseline "
                                    "cuts the gradient variance and why; reverse KL over steps, gradient variance "
                                    "along training and cost per step of vanilla OPD, vOPD, full-vocabulary and top-k "
                                    "KL across vocabulary sizes and student-teacher gaps (or a sweep's results).",
               smoke={"vocab_sizes": [10], "student_accuracies": [0.0], "seeds": [0, 1], "steps": 4, "grad_every": 2,
                      "probe_size": 8, "batch_size": 16, "teacher_size": "small", "teacher_accuracy": 0.5,
                      "student_size": "test"}),
    ),
)
