"""Parity with the two trainers that are not on PyPI, restated from their source and checked by hand.

prime-rl's default loss: ``src/prime_rl/trainer/rl/loss.py`` (PrimeIntellect-ai/prime-rl e48a538, 2026-07-01),
``default_loss_fn`` per sample and ``compute_loss`` over the packed samples (each sample's per-token loss summed, the
total divided by the global number of loss tokens, ``rl_scale``); defaults from ``DefaultLossConfig``
(packages/prime-rl-configs/src/prime_rl/configs/trainer.py, 29e4222): dppo_mask_low = dppo_mask_high = 0.2,
adv_tau = 1, kl_tau = 1e-3. The lab's ``dppo_prime`` with token-mean is that loss.

slime's off-policy sequence masking: ``slime/utils/ppo_utils.py`` ``compute_opsm_mask`` and ``compute_policy_loss``
(THUDM/slime 2c6323b), applied in ``slime/backends/megatron_utils/loss.py`` (pg_loss * opsm_mask, then the
per-sample token mean of ``get_sum_of_sample_mean``, here averaged over the batch's samples); ``--opsm-delta`` 1e-4,
``--eps-clip`` 0.2 (eps_clip_high defaults to it), no dual clip. The lab's ``opsm_slime`` is that loss.

The restatements run sample by sample as the trainers do (1-D tensors), with ragged rows, an empty row and both
advantage signs; loss and gradient agree to 1e-9. Hand-computed numbers pin the formulas on a two-row batch.
"""
import math

import pytest
import torch

from lab import estimators

B, T = 6, 5
LENGTHS = [5, 2, 0, 4, 1, 3]


def _batch():
    g = torch.Generator().manual_seed(17)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    lp = -2.5 * torch.rand(B, T, generator=g, dtype=torch.float64)
    mu = (lp + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0], dtype=torch.float64)
    adv = (signs * (0.3 + torch.rand(B, generator=g, dtype=torch.float64)))[:, None].expand(B, T).clone()
    return mask, lp, mu, adv


MASK, LP, MU, ADV = _batch()


def grad_of(f):
    x = LP.clone().requires_grad_(True)
    loss = f(x)
    return loss.detach(), torch.autograd.grad(loss, x)[0]


# ------------------------------------------------------------------------------------------ prime-rl
def prime_sample_loss(trainer, inference, advantages, loss_mask, low=0.2, high=0.2, adv_tau=1.0, kl_tau=1e-3):
    """default_loss_fn for one sample (1-D tensors), as prime-rl writes it."""
    log_ratio = trainer - inference
    ratio = torch.exp(log_ratio)
    probs_diff = torch.exp(trainer) - torch.exp(inference)
    invalid = torch.where(advantages > 0, probs_diff > high, probs_diff < -low)
    keep = loss_mask & ~invalid
    pg = keep * (adv_tau * advantages) * ratio
    kl = loss_mask * log_ratio ** 2
    return (-pg + kl_tau * kl).sum()


def prime_loss(x, **kw):
    total = x[0].sum() * 0.0
    for i in range(B):  # compute_loss: one loss_fn call per packed sample
        n = int(MASK[i].sum())
        total = total + prime_sample_loss(x[i, :n], MU[i, :n], ADV[i, :n], MASK[i, :n].bool(), **kw)
    return total / max(int(MASK.sum()), 1)  # rl_scale: the global loss-token count


@pytest.mark.parametrize("kw,hyper", [({}, {}), ({"low": 0.05, "high": 0.3, "kl_tau": 0.1, "adv_tau": 2.0},
                                               {"dppo_mask_low": 0.05, "dppo_mask_high": 0.3, "kl_tau": 0.1,
                                                "adv_tau": 2.0})])
def test_dppo_prime_equals_prime_rl_default_loss(kw, hyper):
    theirs = grad_of(lambda x: prime_loss(x, **kw))
    ours = grad_of(lambda x: estimators.get("dppo_prime")(x, MU, ADV, MASK, loss_agg_mode="token-mean", **hyper)[0])
    assert float((ours[0] - theirs[0]).abs()) <= 1e-9 and float((ours[1] - theirs[1]).abs().max()) <= 1e-9
    # with the sampler passed as rollout_log_probs (a three-policy batch) pi_old is not used: prime-rl has none
    other = grad_of(lambda x: estimators.get("dppo_prime")(x, LP.detach(), ADV, MASK, rollout_log_probs=MU,
                                                           **hyper)[0])
    assert torch.allclose(other[1], theirs[1], rtol=0, atol=1e-12)


def test_dppo_prime_by_hand():
    # one token with A = 1: pi = 0.5, mu = 0.25: p - q = 0.25 > 0.2 -> masked; only the penalty 1e-3 (log 2)^2 is left
    # one token with A = -1: pi = 0.5, mu = 0.6: p - q = -0.1 >= -0.2 -> kept: -(-1) * 0.5/0.6 + 1e-3 (log(5/6))^2
    lp = torch.tensor([[math.log(0.5)], [math.log(0.5)]], dtype=torch.float64, requires_grad=True)
    mu = torch.tensor([[math.log(0.25)], [math.log(0.6)]], dtype=torch.float64)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    loss, m = estimators.get("dppo_prime")(lp, mu, adv, torch.ones(2, 1, dtype=torch.float64))
    by_hand = (1e-3 * math.log(2) ** 2 + (0.5 / 0.6 + 1e-3 * math.log(5 / 6) ** 2)) / 2
    assert float(loss.detach()) == pytest.approx(by_hand, rel=1e-12)
    (g,) = torch.autograd.grad(loss, lp)
    # d/dlog pi: penalty 2e-3 log(rho); kept token also -A rho = +rho
    assert float(g[0, 0]) == pytest.approx(2e-3 * math.log(2) / 2, rel=1e-12)
    assert float(g[1, 0]) == pytest.approx((0.5 / 0.6 + 2e-3 * math.log(5 / 6)) / 2, rel=1e-12)
    assert float(m["clipfrac"]) == pytest.approx(0.5)


# ------------------------------------------------------------------------------------------ slime
def slime_loss(x, delta=1e-4, eps=0.2, eps_high=0.2):
    total = x[0].sum() * 0.0
    for i in range(B):
        n = int(MASK[i].sum())
        lp, old, adv, loss_mask = x[i, :n], MU[i, :n], ADV[i, :n], MASK[i, :n]
        # compute_opsm_mask
        seq_kl = ((old - lp) * loss_mask).sum() / torch.clamp_min(loss_mask.sum(), 1)
        opsm = 1 - ((adv < 0) & (seq_kl > delta)).double()
        # compute_policy_loss with ppo_kl = old - log_prob, no dual clip
        ratio = (-(old - lp)).exp()
        pg = torch.maximum(-ratio * adv, -ratio.clamp(1 - eps, 1 + eps_high) * adv) * opsm
        total = total + (pg * loss_mask).sum() / torch.clamp_min(loss_mask.sum(), 1)  # sum_of_sample_mean
    return total / B


@pytest.mark.parametrize("delta", [1e-4, 0.3])
def test_opsm_slime_equals_slime(delta):
    theirs = grad_of(lambda x: slime_loss(x, delta))
    ours = grad_of(lambda x: estimators.get("opsm_slime")(x, MU, ADV, MASK, delta=delta)[0])
    assert float((ours[0] - theirs[0]).abs()) <= 1e-9 and float((ours[1] - theirs[1]).abs().max()) <= 1e-9


def test_opsm_thresholds_by_hand_and_the_two_defaults_differ():
    # a negative-advantage sequence whose mean log(mu/pi) is 0.01: slime (1e-4) drops it, TRL's docs (0.5) keep it
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    mu = lp.detach() + 0.01
    adv = torch.full((1, 2), -1.0, dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    slime, _ = estimators.get("opsm_slime")(lp, mu, adv, mask)
    trl, _ = estimators.get("opsm")(lp, mu, adv, mask)
    assert float(slime.detach()) == 0.0 and float(torch.autograd.grad(slime, lp)[0].abs().sum()) == 0.0
    ratio = math.exp(-0.01)
    assert float(trl.detach()) == pytest.approx(ratio, rel=1e-12)  # -A rho, inside the clip, token-mean
    assert estimators.info("opsm_slime").defaults["delta"] == 1e-4 and estimators.info("opsm").defaults["delta"] == 0.5
