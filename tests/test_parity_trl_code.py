"""Parity with TRL's own code: GRPOTrainer._compute_loss of TRL 1.16, run on the same tensors as the lab's estimators.

The trainer needs a model only to compute the per-token log-probs; here a trainer object is made without its
constructor, its log-prob method returns the test's log-probs, and every setting is TRL's own default (read from the
GRPOConfig dataclass) unless the case sets it. The loss, its aggregation and its clipping are TRL's code. The vLLM
importance-sampling ratio is computed at generation time in TRL (outside the loss), so it enters as an input restated
in tests/test_parity_trl.py. Needs trl, which installs without its dependencies plus `datasets`:
pip install --no-deps trl==1.16.0 && pip install datasets.
"""
import dataclasses
import types
from collections import defaultdict

import pytest
import torch

grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="trl is not importable: pip install --no-deps "
                                                              "trl==1.16.0 && pip install datasets")
from trl import GRPOConfig  # noqa: E402

from test_parity_trl import (ADV, B, CASES, MASK, OLD, SAMPLER, T, TOL, VLLM_CASES, both, lab,  # noqa: E402
                              vllm_ratio)

DEFAULTS = {f.name: f.default for f in dataclasses.fields(GRPOConfig) if f.default is not dataclasses.MISSING}


def trainer(loss_type, level="token", eps_low=0.2, eps_high=0.2, vllm=False, opsm=None):
    t = grpo.GRPOTrainer.__new__(grpo.GRPOTrainer)
    args = types.SimpleNamespace(**{**DEFAULTS, "steps_per_generation": 1})
    t.__dict__.update(
        args=args, loss_type=loss_type, importance_sampling_level=level, epsilon_low=eps_low, epsilon_high=eps_high,
        beta=0.0, top_entropy_quantile=1.0, off_policy_mask_threshold=opsm, aux_loss_enabled=False,
        use_vllm=vllm, vllm_importance_sampling_correction=vllm, max_completion_length=T,
        current_gradient_accumulation_steps=1, _entropy_bonus_enabled=False,
        _metrics=defaultdict(lambda: defaultdict(list)),
        model=types.SimpleNamespace(training=True),
        accelerator=types.SimpleNamespace(num_processes=1, gather=lambda x: x,
                                          reduce=lambda x, reduction: x))
    return t


def trl_code_loss(x, loss_type, level="token", eps_low=0.2, eps_high=0.2, tau_pos=1.0, tau_neg=1.05, vllm=None,
                  opsm=None, opsm_sampler=None):
    t = trainer(loss_type, level, eps_low, eps_high, vllm is not None, opsm)
    assert (t.args.sapo_temperature_pos, t.args.sapo_temperature_neg) == (tau_pos, tau_neg)  # TRL's defaults
    t._get_per_token_logps_and_entropies = lambda *a, **k: (x, torch.zeros_like(x), None)
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": MASK,
              "advantages": ADV[:, 0], "old_per_token_logps": OLD, "num_items_in_batch": MASK.sum()}
    if vllm is not None:
        inputs["importance_sampling_ratio"] = vllm
    if opsm_sampler is not None:
        inputs["sampling_per_token_logps"] = opsm_sampler
    return t._compute_loss(None, inputs)


@pytest.mark.parametrize("loss_type,trl,name,mode,hyper", CASES)
def test_estimator_equals_trl_own_compute_loss(loss_type, trl, name, mode, hyper):
    theirs = both(lambda x: trl_code_loss(x, loss_type, **trl))
    ours = lab(name, mode, **hyper)
    assert float((ours[0] - theirs[0]).abs()) <= TOL, (loss_type, float(ours[0]), float(theirs[0]))
    assert float((ours[1] - theirs[1]).abs().max()) <= TOL, loss_type


@pytest.mark.parametrize("vllm_mode,name,hyper", VLLM_CASES)
def test_three_policy_corrections_equal_trl_own_loss_with_its_vllm_ratio(vllm_mode, name, hyper):
    theirs = both(lambda x: trl_code_loss(x, "dapo", eps_high=0.28, vllm=vllm_ratio(vllm_mode)))
    ours = lab(name, "token-mean", rollout_log_probs=SAMPLER, clip_ratio_high=0.28, clip_ratio_c=None, **hyper)
    assert float((ours[0] - theirs[0]).abs()) <= TOL and float((ours[1] - theirs[1]).abs().max()) <= TOL


def test_off_policy_sequence_mask_with_the_sampler_equals_trl_own_loss():
    for delta in (0.5, 0.05):
        theirs = both(lambda x: trl_code_loss(x, "dapo", eps_high=0.28, vllm=vllm_ratio("sequence_mask"), opsm=delta,
                                              opsm_sampler=SAMPLER))
        ours = lab("opsm", "token-mean", delta=delta, rollout_log_probs=SAMPLER)
        assert float((ours[0] - theirs[0]).abs()) <= TOL and float((ours[1] - theirs[1]).abs().max()) <= TOL


def test_trl_defaults_are_the_ones_the_cases_assume():
    assert DEFAULTS["loss_type"] == "dapo" and DEFAULTS["epsilon"] == 0.2
    assert (DEFAULTS["vespo_k_pos"], DEFAULTS["vespo_lambda_pos"], DEFAULTS["vespo_k_neg"],
            DEFAULTS["vespo_lambda_neg"]) == (2.0, 3.0, 3.0, 2.0)
