"""The frameworks' dashboard numbers in the dashboards table equal the frameworks' own: verl's rollout_corr_helper
called for real; TRL's, prime-rl's and slime's metric code restated statement by statement (they are inline in
their trainers), on the same step of a ragged log."""
from __future__ import annotations

import math

import pytest
import torch

from lab.diagnose import RolloutLogWriter, diagnose, make_meta

B, T = 12, 40


@pytest.fixture(scope="module")
def step(tmp_path_factory):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    mask[2, 0] = 0  # a tool token inside a response
    samp = (-torch.rand(B, T, generator=g) * 3).float()
    old = (samp + torch.randn(B, T, generator=g) * torch.linspace(0.05, 1.5, B)[:, None]).clamp(max=0).float()
    path = tmp_path_factory.mktemp("dash") / "log"
    meta = make_meta("t", {"sampler_logp": "mu", "old_logp": "old", "current_logp": None})
    with RolloutLogWriter(path, meta) as w:
        w.add(1, torch.arange(B), torch.zeros(B, T, dtype=torch.long), mask, sampler_logp=samp, old_logp=old)
    table = diagnose(path, progress=False).tables["dashboards"]
    ours = dict(zip(table["metric"], table["value"]))
    assert set(table["step"]) == {1} and table["definition"].str.len().min() > 5
    return old.double() * mask, samp.double() * mask, mask.double(), ours


def test_verl_rollout_corr_metrics(step):
    helper = pytest.importorskip("verl.trainer.ppo.rollout_corr_helper")
    old, samp, mask, ours = step
    theirs = helper.compute_offpolicy_metrics(old_log_prob=old, rollout_log_prob=samp, response_mask=mask)
    _, is_metrics = helper.compute_rollout_correction_weights(old - samp, mask, rollout_is="token",
                                                              rollout_is_threshold=2.0)
    theirs.update(is_metrics)
    checked = 0
    for key, value in theirs.items():
        name = f"rollout_corr/{key}"
        if name in ours:
            assert ours[name] == pytest.approx(float(value), rel=1e-6, abs=1e-9), name
            checked += 1
    assert checked == sum(m.startswith("rollout_corr/") for m in ours) == 14


def test_trl_sampling_metrics(step):
    """GRPOTrainer._generate_and_score_completions (TRL 1.16), default vllm_importance_sampling_mode
    sequence_mask with clip max 3, no clip min, one process."""
    old, samp, mask, ours = step
    old, samp = old.float(), samp.float()  # the trainer's tensors: float32, as the lab takes differences
    per_token_logps_diff = torch.nan_to_num((old - samp) * mask, nan=0.0)
    ratio = torch.exp(per_token_logps_diff.sum(dim=-1, keepdim=True))
    ratio = ratio.masked_fill((ratio < -math.inf) | (ratio > 3.0), value=0.0)
    delta = torch.abs(old - samp)[mask.bool()].double()
    flat = ratio.flatten()
    want = {"sampling/sampling_logp_difference/mean": delta.mean(),
            "sampling/sampling_logp_difference/max": delta.max(),
            "sampling/importance_sampling_ratio/min": flat.min(),
            "sampling/importance_sampling_ratio/mean": flat.mean(),
            "sampling/importance_sampling_ratio/max": flat.max()}
    for k, v in want.items():
        assert ours[k] == pytest.approx(float(v), rel=1e-9), k


def test_prime_rl_and_slime_metrics(step):
    old, samp, mask, ours = step
    log_ratio = (old.float() - samp.float()).double()  # prime-rl loss.compute_importance_ratio_and_mismatch_kl
    mismatch_kl = torch.exp(log_ratio) - log_ratio - 1
    assert ours["mismatch_kl/all/mean"] == pytest.approx(float(mismatch_kl[mask.bool()].mean()), rel=1e-9)
    # slime vanilla_tis_function + get_sum_of_sample_mean, divided by the step's sample count
    tis = torch.exp(log_ratio)
    metrics = {"tis": tis, "tis_abs": (tis - 1).abs(), "tis_clipfrac": (tis.clamp(min=0, max=2.0) != tis).float(),
               "train_rollout_logprob_abs_diff": log_ratio.abs()}
    for k, x in metrics.items():
        per_sample = [(x[i] * mask[i]).sum() / torch.clamp_min(mask[i].sum(), 1) for i in range(B)]
        assert ours[k] == pytest.approx(float(sum(per_sample) / B), rel=1e-9), k
