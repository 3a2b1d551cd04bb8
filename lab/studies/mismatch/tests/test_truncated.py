"""The truncating sampler's ratio measurement (lab.studies.mismatch.truncated) on the lab's test transformer, with
every network connection refused."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from scipy import stats

import toy_envs
from lab.errors import LabError
from lab.policies.transformer import SIZES, TransformerPolicy
from lab.policies.truncation import kept_set
from lab.studies.mismatch import measure, truncated

pytestmark = pytest.mark.usefixtures("no_network", "one_thread")


@pytest.fixture(scope="module")
def inlab():
    """The dense test transformer over chain6's prompts, 16-token responses over 10 tokens, logit scale 2."""
    env = toy_envs.make("chain6")
    cfg = dataclasses.replace(SIZES["test"], block_size=32)
    policy = TransformerPolicy(cfg, env.prompt_tokens, length=16, vocab_size=10)
    theta = policy.init_params(2.0, torch.Generator().manual_seed(0), torch.float32)
    return policy, theta


def test_fp32_sampler_ratio_is_the_kept_mass_token_by_token_and_renormalising_gives_one(inlab):
    policy, theta = inlab
    prompts = torch.arange(64)
    d = truncated.draw(policy, theta, prompts, "fp32+kv", "top_p=0.8", torch.Generator().manual_seed(1))
    rho = (d.trainer - d.sampler).exp()
    assert torch.allclose(rho, d.log_kept_mass.exp(), atol=1e-5)  # rho_t = pi(S_t) when sampler = trainer
    assert (d.trainer_renorm - d.sampler).abs().max() < 1e-5
    logits = policy.logits(theta, prompts, d.tokens)
    S = kept_set(logits, top_p=0.8)
    assert S.gather(-1, d.tokens[..., None]).all()  # every sampled token lies in its kept set
    assert torch.equal(S.sum(-1).float(), d.kept_size)
    s = truncated.summarize(d, n_boot=200)
    assert s["kept_mass"][0] < 0.97 and s["ratio_outside"][0] > 0.05  # the truncation bites on this model
    assert abs(s["ratio_mean"][0] - s["kept_mass"][0]) < 1e-5 and abs(s["ratio_minus_mass"][0]) < 1e-5
    assert abs(s["renorm_mean"][0] - 1) < 1e-5 and s["renorm_outside"][0] == 0
    H = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert torch.allclose(d.entropy, H, atol=1e-5) and 0 < s["entropy"][0] < np.log(10)


def test_bf16_sampler_renormalised_ratio_carries_only_the_dtype_mismatch(inlab):
    policy, theta = inlab
    s = truncated.summarize(truncated.draw(policy, theta, torch.arange(64), "bf16+kv", "top_k=3",
                                           torch.Generator().manual_seed(2)), n_boot=200)
    assert s["kept_mass"][2] < 0.999 and s["kept_size"][0] >= 3  # ties with the 3rd logit are kept too
    assert s["ratio_minus_mass"][1] < 0.01 and s["ratio_minus_mass"][2] > -0.01
    assert s["renorm_mean"][1] < 1 < s["renorm_mean"][2] + 0.01 and abs(s["renorm_mean"][0] - 1) < 0.01
    assert s["renorm_outside"][0] < s["ratio_outside"][0]


def test_truncated_draws_follow_the_renormalised_distribution(inlab):
    """First tokens of 4000 draws of one prompt against q = pi restricted to the top-3 and renormalised (chi-square,
    fixed seed)."""
    policy, theta = inlab
    prompts = torch.zeros(4000, dtype=torch.long)
    d = truncated.draw(policy, theta, prompts, "fp32+kv", "top_k=3", torch.Generator().manual_seed(3), chunk=4000)
    z = policy.logits(theta, prompts[:1], d.tokens[:1])[0, 0].double()
    keep = kept_set(z, top_k=3)
    q = torch.softmax(z.masked_fill(~keep, -float("inf")), -1).numpy()
    counts = np.bincount(d.tokens[:, 0].numpy(), minlength=10)
    assert counts[~keep.numpy()].sum() == 0
    assert stats.chisquare(counts[keep.numpy()], 4000 * q[keep.numpy()]).pvalue > 0.01


def test_settings_that_cut_nothing_are_the_untruncated_sampler_bit_for_bit(inlab):
    policy, theta = inlab
    plain = measure.draw(policy, theta, torch.arange(16), "bf16+kv", torch.Generator().manual_seed(4))
    for off in ("top_p=1", "top_k=10", "top_p=1,top_k=10"):
        d = truncated.draw(policy, theta, torch.arange(16), "bf16+kv", off, torch.Generator().manual_seed(4))
        assert torch.equal(d.tokens, plain.tokens) and torch.equal(d.sampler, plain.sampler), off
        assert torch.equal(d.trainer, plain.trainer)
        assert torch.all(d.log_kept_mass == 0) and torch.all(d.kept_size == 10)


@pytest.mark.parametrize("text,match", [
    ("top_p=0", "top_p must be a number in \\(0, 1\\]"), ("top_p=1.5", "top_p must"), ("top_k=0", "top_k must"),
    ("top_k=2.5", "whole number"), ("top_k=11", "exceeds the vocabulary size 10"), ("top_q=0.9", "unknown"),
    ("top_p=0.9,top_p=0.8", "unknown"), ("top_p=", "unknown"), ("top_p=x", "must be a number"),
])
def test_bad_truncations_are_one_line(text, match):
    with pytest.raises(LabError, match=match):
        truncated.parse_truncation(text, 10)


def test_rows_and_the_combined_knobs(inlab):
    policy, theta = inlab
    res = truncated.measure_all(policy, theta, torch.arange(8), ["fp32+kv"], ["top_p=0.9,top_k=2"],
                                lambda: torch.Generator().manual_seed(5), n_boot=50)
    s = res["fp32+kv"]["top_p=0.9,top_k=2"]
    assert set(s) == set(truncated.METRICS) and s["kept_size"][0] <= 2
    rows = truncated.rows("m", res)
    assert len(rows) == len(truncated.METRICS) and rows[0]["metric"].startswith("trunc:top_p=0.9,top_k=2:")
