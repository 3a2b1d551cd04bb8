"""Truncated sampling: the kept set (engines' semantics), the Truncated wrapper for every policy kind, bad values."""
import math

import pytest
import torch

import toy_envs
from lab.errors import LabError
from lab.engine.exact import exact_support
from lab.policies import Tempered, Truncated, init_params, make_policy, sample
from lab.policies.truncation import check_truncation, from_ids, kept_log_mass, kept_set, to_ids


def vllm_top_k_top_p(logits, k, p):
    """vLLM v1's apply_top_k_top_p_pytorch (vllm/v1/sample/ops/topk_topp_sampler.py), restated for a 2-D batch."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = logits_sort.gather(1, (logits_sort.size(1) - torch.full((logits.shape[0],), k)).unsqueeze(1))
        logits_sort = logits_sort.masked_fill(logits_sort < kth, -float("inf"))
    if p is not None:
        probs_sum = torch.cumsum(logits_sort.softmax(dim=-1), dim=-1)
        mask = probs_sum <= 1 - p
        mask[:, -1] = False
        logits_sort = logits_sort.masked_fill(mask, -float("inf"))
    return logits.clone().scatter_(-1, logits_idx, logits_sort)


def vllm_min_p(logits, min_p):
    """vLLM's MinPLogitsProcessor: remove tokens with probability < min_p * max probability."""
    probs = logits.softmax(-1)
    return logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), -float("inf"))


@pytest.mark.parametrize("k,p,m", [(None, 0.9, 0.0), (3, None, 0.0), (5, 0.7, 0.0), (None, 0.5, 0.05),
                                   (None, None, 0.2), (8, 0.95, 0.1), (1, 0.3, 0.0)])
def test_kept_set_equals_vllm_on_continuous_logits(k, p, m):
    z = torch.randn(400, 12, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    ref = vllm_min_p(z, m) if m > 0 else z
    ref = torch.isfinite(vllm_top_k_top_p(ref, k, p) if (k or p) else ref)
    got = kept_set(z, top_k=k, top_p=1.0 if p is None else p, min_p=m)
    assert torch.equal(got, ref)
    assert got.any(-1).all() and got.gather(-1, z.argmax(-1, keepdim=True)).all()  # the argmax is always kept
    assert (got.sum(-1) < 12).any()  # something was cut


def test_tie_rule_keeps_tie_classes_whole():
    z = torch.log(torch.tensor([[0.3, 0.3, 0.2, 0.2]], dtype=torch.float64))
    assert kept_set(z, top_k=1).tolist() == [[True, True, False, False]]  # ties with the k-th kept (vLLM, HF)
    assert kept_set(z, top_p=0.7).tolist() == [[True, True, True, True]]  # the 0.2 class (0.4) exceeds 1 - p
    assert kept_set(z, top_p=0.5).tolist() == [[True, True, False, False]]


def test_the_order_is_vllms_min_p_before_top_p():
    z = torch.log(torch.tensor([[0.4, 0.3, 0.2, 0.1]], dtype=torch.float64))
    # min_p 0.3 cuts 0.1; top_p 0.75 on the renormalised (4/9, 3/9, 2/9) then cuts 2/9 (<= 0.25)
    assert kept_set(z, min_p=0.3, top_p=0.75).tolist() == [[True, True, False, False]]
    assert kept_set(z, top_p=0.75).tolist() == [[True, True, True, False]]  # top-p first would keep three


def test_kept_log_mass_and_ids_round_trip():
    z = torch.randn(3, 4, 7, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    kept = kept_set(z, top_p=0.6)
    mass = (torch.softmax(z, -1) * kept).sum(-1)
    assert torch.allclose(kept_log_mass(z, kept), torch.log(mass), atol=1e-14)
    ids, offsets = to_ids(kept)
    assert len(offsets) == 13 and offsets[-1] == int(kept.sum())
    assert torch.equal(from_ids(ids, offsets, 7), kept.reshape(-1, 7))


@pytest.mark.parametrize("bad", [dict(top_p=0.0), dict(top_p=1.5), dict(top_p=math.nan), dict(top_k=0),
                                 dict(top_k=7), dict(top_k=2.5), dict(min_p=1.0), dict(min_p=-0.1),
                                 dict(min_p=math.inf)])
def test_bad_values_are_one_line(bad):
    with pytest.raises(LabError) as err:
        check_truncation(**bad, vocab_size=6)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("kind", ["prefix", "markov", "transformer"])
def test_truncated_wrapper_for_every_policy_kind(kind):
    env = toy_envs.make("small_dense")
    policy = make_policy(kind, env, "test")
    theta = init_params(policy, 1.0, torch.Generator().manual_seed(0)).double()
    prompts, tokens, mask = env.enumerate()
    prompts, tokens = prompts[:50], tokens[:50]
    for noop in (dict(top_p=1.0), dict(top_k=env.vocab_size), dict(min_p=0.0)):
        assert torch.equal(Truncated(policy, **noop).logits(theta, prompts, tokens),
                           policy.logits(theta, prompts, tokens))
    trunc = Truncated(Tempered(policy, 0.7), top_p=0.8, top_k=4)
    out = trunc.logits(theta, prompts, tokens)
    base = policy.logits(theta, prompts, tokens) / 0.7
    kept = torch.isfinite(out)
    assert torch.equal(kept, kept_set(base, top_k=4, top_p=0.8)) and (kept.sum(-1) <= 4).all()
    assert torch.equal(out[kept], base[kept])
    with pytest.raises(LabError):
        Truncated(policy, top_k=env.vocab_size + 1)


def test_sampling_stays_in_the_kept_set_and_records_it():
    env = toy_envs.make("small_eos")  # variable length: padding positions must not turn into NaN
    policy = make_policy("markov", env)
    theta = init_params(policy, 2.0, torch.Generator().manual_seed(0))
    trunc = Truncated(policy, top_p=0.7)
    prompts = torch.arange(env.n_prompts).repeat(500)
    tokens, mask, logp, kept = sample(trunc, theta, env, prompts, torch.Generator().manual_seed(1),
                                      record_kept=True)
    assert torch.isfinite(logp).all()
    inside = kept.gather(-1, tokens[..., None]).squeeze(-1)
    assert inside[mask > 0].all()
    forced = torch.isfinite(trunc.logits(theta, prompts, tokens))  # teacher-forced: the same sets where real
    assert torch.equal(kept[mask > 0], forced[mask > 0])
    assert (kept.sum(-1) < env.vocab_size).any()
    s = exact_support(env, trunc, theta, toy_envs.DEFAULT_ENUM_LIMIT)  # responses outside the kept paths dropped
    assert torch.isfinite(s.weights).all() and abs(float(s.weights.sum()) - 1) < 1e-12
    assert s.prompts.shape[0] < env.enumerate()[0].shape[0]
