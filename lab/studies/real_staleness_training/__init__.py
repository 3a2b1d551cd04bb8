"""The real_staleness_training study: VESPO's staleness table in miniature on the lab's transformer, RL from a
supervised warm start under mini-batch staleness, async lag, a real bf16 / MoE sampler and a top-p sampler, over
seeds."""
from lab.studies import Report, Study

STUDY = Study(
    "real_staleness_training", rank=80,
    reports=(
        Report("real_staleness_training", "VESPO's staleness table in miniature on the lab's transformer: final "
                                          "held-out accuracy and collapse rate of each correction as mini-batch "
                                          "staleness N grows to 64, under async lag, a real bf16 / MoE sampler and a "
                                          "top-p sampler with and without mask replay.",
               smoke={"env": "chain3", "size": "test", "estimators": ["reinforce", "ppo_clip", "vespo"],
                      "minibatches": [1, 4], "seeds": [0, 1], "steps": 2, "rollout_batch": 32, "group_size": 4,
                      "etas": [0, 2], "sampler_dtypes": ["bfloat16"], "replay": [False, True], "top_ps": [0.8],
                      "truncation_estimators": ["ppo_clip", "vespo"], "truncation_seeds": [0, 1], "n_boot": 200}),
    ),
)
