"""The real_model_variance study: the variance study on the lab's own transformer, beside a prefix-tree table that
starts at exactly the same distribution, against lag and response length (exact by enumeration)."""
from lab.studies import Report, Study

STUDY = Study(
    "real_model_variance", rank=60,
    reports=(
        Report("real_model_variance", "The variance study on the lab's own transformer beside a table holding the "
                                      "same starting distribution: bias, variance and MSE of each correction against "
                                      "lag and response length, exact by enumeration.",
               smoke={"lengths": [2], "model": "test", "values": [0, 2], "replicates": 30, "trajectory_steps": 2,
                      "estimators": ["reinforce", "seq_is", "token_is"]}),
    ),
)
