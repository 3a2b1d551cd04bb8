"""The staleness_training study: the training simulator under three kinds of staleness (N mini-batches per rollout,
asynchronous lag, a mismatched sampler), final reward and collapse over seeds per correction, beside VESPO's table."""
from lab.studies import Report, Study

STUDY = Study(
    "staleness_training", rank=40,
    reports=(
        Report("staleness_training", "Training under staleness: final reward, collapse rate and probability of "
                                     "improvement per correction as mini-batch staleness N, the async bound eta and "
                                     "sampler mismatch grow, beside VESPO's table.",
               smoke={"estimators": ["reinforce", "ppo_clip", "vespo"], "minibatches": [1, 4], "seeds": [0, 1],
                      "steps": 4, "etas": [0, 2], "noise_levels": [0.0, 0.5], "n_boot": 200}),
    ),
)
