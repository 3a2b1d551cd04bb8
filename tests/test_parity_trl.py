"""Parity with TRL's GRPOTrainer loss (TRL 1.16, trl/trainer/grpo_trainer.py, _compute_loss and get_gamma_weights).

TRL's loss is a method of a trainer that needs a model; it is restated here from its definition, term by term (so
these checks run without TRL), and tests/test_parity_trl_code.py runs TRL's own code on the same tensors. The lab's
estimators are compared with it on a batch with ragged lengths, an empty row and both advantage
signs, to 1e-6 in loss and gradient:

    log_ratio = logp - old; coef = exp(log_ratio) per token, or exp(masked mean of log_ratio) per sequence
    grpo / bnpo / dr_grpo / dapo: -min(coef A, clamp(coef, 1 - eps_low, 1 + eps_high) A)  (no dual clip)
    cispo: -sg[clamp(coef, max=epsilon_high)] A logp;  sapo: -sigmoid(tau (coef - 1)) 4 / tau A, tau by A > 0
    vespo: -phi(W) A logp, log W = clamp(sum_t m_t clamp(log_ratio, -20, 20), log 1e-8, 20)
    vLLM correction: the per-token loss times pi_old / pi_sampler (per token, or per sequence as exp of the sum),
                     zeroed outside [clip_min, clip_max] (*_mask) or clamped to it (*_truncate)
    aggregation: grpo, sapo: mean over ALL rows of the per-row token mean (length clamped at 1);
                 bnpo: token mean; dr_grpo: sum / (B max_completion_length);
                 dapo, cispo, vespo: sum / num_items_in_batch (the tokens of the batch, one process);
                 luspo: (per-token loss x mask) summed per row, mean over rows (GSPO's loss times the length)
    off-policy sequence mask (off_policy_mask_threshold = delta): the per-token loss times
                 1[A >= 0 or mean_t(log mu - sg[logp]) <= delta], mu the sampler's log-probs (else old's)
"""
import math

import pytest
import torch

from lab import estimators

TOL = 1e-6
B, T = 6, 5  # T = max_completion_length: the batch is padded to it, as dr_grpo's constant assumes
LENGTHS = [5, 2, 0, 4, 1, 3]


def _batch():
    g = torch.Generator().manual_seed(5)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    lp = -2.0 * torch.rand(B, T, generator=g, dtype=torch.float64)
    old = (lp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    sampler = (old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    sampler[0, 0] = old[0, 0] - 1.5  # pi_old / pi_sampler = e^1.5 > 3 on a real token: the bands bind
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, -1.0], dtype=torch.float64)
    adv = (signs * (0.3 + torch.rand(B, generator=g, dtype=torch.float64)))[:, None]  # TRL: [B] -> [B, 1]
    return mask, lp, old, sampler, adv


MASK, LP, OLD, SAMPLER, ADV = _batch()


def aggregate(per_token, loss_type):
    m = MASK
    if loss_type in ("grpo", "sapo"):
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "luspo":
        return (per_token * m).sum(-1).mean()
    if loss_type == "bnpo":
        return (per_token * m).sum() / m.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return (per_token * m).sum() / (B * T)
    return (per_token * m).sum() / m.sum().clamp(min=1.0)  # dapo, cispo, vespo: num_items_in_batch


def vllm_ratio(mode, clip_min=None, clip_max=3.0):
    diff = (OLD - SAMPLER) * MASK
    ratio = torch.exp(diff.sum(-1, keepdim=True) if mode.startswith("sequence") else diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def opsm_mask(logp, delta, sampler=None):
    mu = OLD if sampler is None else sampler
    kl = ((mu - logp.detach()) * MASK).sum(-1, keepdim=True) / MASK.sum(-1, keepdim=True).clamp(min=1.0)
    return ((ADV >= 0) | (kl <= delta)).double()


def trl_loss(logp, loss_type, level="token", eps_low=0.2, eps_high=0.2, tau_pos=1.0, tau_neg=1.05, vllm=None,
             opsm=None, opsm_sampler=None):
    log_ratio = logp - OLD
    if level == "token":
        coef = torch.exp(log_ratio)
    else:
        coef = torch.exp((log_ratio * MASK).sum(-1) / MASK.sum(-1).clamp(min=1.0))[:, None]
    if loss_type == "cispo":
        per_token = -torch.clamp(coef, max=eps_high).detach() * ADV * logp
    elif loss_type == "sapo":
        tau = torch.where(ADV > 0, tau_pos, tau_neg)
        per_token = -torch.sigmoid(tau * (coef - 1)) * 4 / tau * ADV
    elif loss_type == "vespo":
        log_w = torch.clamp((torch.clamp(log_ratio, -20.0, 20.0) * MASK).sum(-1, keepdim=True), math.log(1e-8), 20.0)
        k = torch.where(ADV >= 0, 2.0, 3.0)
        lam = torch.where(ADV >= 0, 3.0, 2.0)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w)).detach()
        per_token = -phi * ADV * logp
    else:
        clipped = torch.clamp(coef, 1 - eps_low, 1 + eps_high)
        per_token = -torch.min(coef * ADV, clipped * ADV)
    if opsm is not None:
        per_token = per_token * opsm_mask(logp, opsm, opsm_sampler)
    if vllm is not None:
        per_token = per_token * vllm
    return aggregate(per_token, loss_type)


def both(f):
    x = LP.clone().requires_grad_(True)
    loss = f(x)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


def lab(name, mode, **kw):
    return both(lambda x: estimators.get(name)(x, OLD, ADV, MASK, loss_agg_mode=mode, **kw)[0])


CASES = [
    ("grpo", {}, "ppo_clip", "seq-mean-token-mean", {}),
    ("bnpo", {}, "ppo_clip", "token-mean", {}),
    ("dr_grpo", {}, "ppo_clip", "seq-mean-token-sum-norm", {}),
    ("dapo", {"eps_high": 0.28}, "ppo_clip", "token-mean", {"clip_ratio_high": 0.28}),  # TRL's default loss_type
    ("grpo", {"level": "sequence", "eps_low": 3e-4, "eps_high": 4e-4}, "gspo", "seq-mean-token-mean", {}),  # GSPO
    ("sapo", {}, "sapo", "seq-mean-token-mean", {}),
    ("cispo", {"eps_high": 5.0}, "cispo", "token-mean", {}),  # TRL's recommended epsilon_high for cispo
    ("cispo", {"eps_high": 0.2}, "cispo", "token-mean", {"clip_ratio_high": -0.8}),  # its fallback to epsilon
    ("vespo", {}, "vespo", "token-mean", {}),
    ("luspo", {"level": "sequence", "eps_low": 2e-3, "eps_high": 2.5e-3}, "luspo", "seq-mean-token-sum", {}),
    ("luspo", {"level": "sequence"}, "luspo", "seq-mean-token-sum", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}),
    ("dapo", {"eps_high": 0.28, "opsm": 0.5}, "opsm", "token-mean", {}),  # TRL's docs' delta
    ("dapo", {"eps_high": 0.28, "opsm": 0.05}, "opsm", "token-mean", {"delta": 0.05}),  # a delta that binds
]


@pytest.mark.parametrize("loss_type,trl,name,mode,hyper", CASES)
def test_estimator_equals_trl_grpo_loss(loss_type, trl, name, mode, hyper):
    theirs = both(lambda x: trl_loss(x, loss_type, **trl))
    ours = lab(name, mode, **hyper)
    assert float((ours[0] - theirs[0]).abs()) <= TOL, (loss_type, float(ours[0]), float(theirs[0]))
    assert float((ours[1] - theirs[1]).abs().max()) <= TOL, loss_type


VLLM_CASES = [
    ("sequence_mask", "mis_seq", {"lower": 0.0, "upper": 3.0}),  # TRL's default correction
    ("token_mask", "mis_token", {"lower": 0.0, "upper": 3.0}),
    ("token_truncate", "tis_token", {"cap": 3.0}),
    ("sequence_truncate", "tis_seq", {"cap": 3.0}),
]


@pytest.mark.parametrize("vllm_mode,name,hyper", VLLM_CASES)
def test_three_policy_corrections_equal_trl_vllm_importance_sampling(vllm_mode, name, hyper):
    # TRL's default loss (dapo: PPO clip 0.2 / 0.28, no dual clip, token mean) times its vLLM IS ratio
    theirs = both(lambda x: trl_loss(x, "dapo", eps_high=0.28, vllm=vllm_ratio(vllm_mode)))
    ours = lab(name, "token-mean", rollout_log_probs=SAMPLER, clip_ratio_high=0.28, clip_ratio_c=None, **hyper)
    assert float((ours[0] - theirs[0]).abs()) <= TOL and float((ours[1] - theirs[1]).abs().max()) <= TOL
    raw = vllm_ratio(vllm_mode.replace("truncate", "mask"), clip_max=None)  # the ratio before its band
    assert bool(((raw > 3.0) & (MASK > 0)).any())  # the band binds on a real token


def test_off_policy_sequence_mask_with_the_sampler_equals_trl():
    # with vLLM log-probs TRL measures the KL against the sampler and multiplies its default vLLM correction in
    for delta in (0.5, 0.05):
        theirs = both(lambda x: trl_loss(x, "dapo", eps_high=0.28, opsm=delta, opsm_sampler=SAMPLER,
                                         vllm=vllm_ratio("sequence_mask")))
        ours = lab("opsm", "token-mean", delta=delta, rollout_log_probs=SAMPLER)
        assert float((ours[0] - theirs[0]).abs()) <= TOL and float((ours[1] - theirs[1]).abs().max()) <= TOL
    assert float(opsm_mask(LP, 0.05).sum()) < B  # the mask drops a sequence at delta 0.05


def test_trl_counts_empty_rows_in_the_sequence_mean_like_the_lab():
    # grpo on a batch whose every row is empty but the first: the mean runs over all B rows
    theirs = trl_loss(LP, "grpo")
    per_row = lab("ppo_clip", "seq-mean-token-mean")[0]
    assert float(theirs) == pytest.approx(float(per_row), rel=1e-12)
    assert (MASK.sum(-1) == 0).any()
