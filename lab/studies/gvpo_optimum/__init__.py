"""The gvpo_optimum study: does GVPO (Zhang et al., arXiv 2504.19599) reach the KL-constrained optimum
pi_ref exp(R/beta)/Z, on-policy and from fixed samplers, against importance-sampling-corrected alternatives?"""
from lab.studies import Report, Study

STUDY = Study(
    "gvpo_optimum", rank=20,
    reports=(
        Report("gvpo_optimum", "GVPO converges to the KL-constrained optimum pi_ref exp(R/beta)/Z, on-policy and from "
                               "other sampling distributions, against IS-corrected alternatives.",
               smoke={"steps": 60, "seeds": [0, 1], "groups_per_step": 8}),
    ),
)
