"""The mismatch study: how far an inference engine's log-probs sit from the trainer's, measured on real networks
(bf16 weights, KV cache, MoE routing with and without replay, a truncating sampler; the lab's transformer and
SmolLM2-135M)."""
from lab.studies import Report, Study

STUDY = Study(
    "mismatch", rank=70,
    reports=(
        Report("mismatch", "Train/inference mismatch measured on real networks: bf16 weights, KV cache and MoE "
                           "routing (with replay) of the lab's transformer and SmolLM2-135M, per token, against token "
                           "probability and along the response, and SmolLM2's ratio under a top-p / top-k sampler "
                           "(with and without renormalising), beside the figures practitioners report.",
               smoke={"inlab_sizes": ["test", "test_moe"], "inlab_init": "random", "lm": "none", "n_boot": 200},
               formerly=("mismatch_anatomy",)),
    ),
)
