"""The sampling_truncation study: an engine samples with top-p / top-k, the trainer scores the full policy. How wrong
is each correction's gradient, against which truth (the full policy's or the deployed truncated one's), and does
mask replay fix it?"""
from lab.studies import Report, Study

STUDY = Study(
    "sampling_truncation", rank=12,
    reports=(
        Report("sampling_truncation", "My engine samples with top-p / top-k: how wrong is each correction's gradient, "
                                      "against which truth, and does mask replay fix it?",
               smoke={"replicates": 20, "top_p": [1.0, 0.8], "top_k": [2], "n_boot": 100,
                      "estimators": ["seq_is", "token_is", "ppo_clip"]}),
    ),
)
