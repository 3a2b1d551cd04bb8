"""Estimators against values computed by hand from the published formulas (each estimator's docstring cites its paper
and the authors' code)."""
import math

import pytest
import torch
from torch.func import grad, vmap

from lab import advantages, estimators
from lab.errors import LabError
from lab.estimators.aggregation import agg_loss

LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]], dtype=torch.float64)
OLD = torch.tensor([[-1.2, -1.5, -0.5], [-0.3, -2.0, -4.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
ADV = torch.tensor([[1.5], [-0.5]], dtype=torch.float64).expand(2, 3)


def coefficients(name, loss_agg_mode="seq-mean-token-sum", **hyper):
    """d loss / d log pi(y_t|s_t) per token (what multiplies grad log pi)."""
    lp = LOGP.clone().requires_grad_(True)
    loss, metrics = estimators.get(name)(lp, OLD, ADV, MASK, loss_agg_mode=loss_agg_mode, **hyper)
    (c,) = torch.autograd.grad(loss, lp)
    return loss.detach(), c, metrics


def test_aggregation_modes_by_hand():
    l = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    assert agg_loss(l, m, "token-mean") == pytest.approx(15 / 5)
    assert agg_loss(l, m, "seq-mean-token-sum") == pytest.approx((6 + 9) / 2)
    assert agg_loss(l, m, "seq-mean-token-mean") == pytest.approx((2 + 4.5) / 2)
    assert agg_loss(l, m, "seq-mean-token-sum-norm") == pytest.approx(15 / 6)
    assert torch.isfinite(agg_loss(l, torch.zeros_like(m), "seq-mean-token-mean"))  # empty rows: no NaN
    with pytest.raises(LabError, match="loss_agg_mode"):
        agg_loss(l, m, "sum")


def test_group_advantages_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    assert advantages.group_advantages(r, "reward").tolist() == r.tolist()
    assert torch.allclose(advantages.group_advantages(r, "drgrpo"), torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
    # rloo: R_i - mean of the others: 1 - 1/3, 0 - 2/3
    assert torch.allclose(advantages.group_advantages(r, "rloo"), torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))
    std = math.sqrt(1 / 3)  # Bessel-corrected std of (1, 0, 0, 1)
    assert torch.allclose(advantages.group_advantages(r, "grpo"), torch.tensor([[0.5, -0.5, -0.5, 0.5]]) / (std + 1e-6))
    assert torch.equal(advantages.group_advantages(torch.ones(1, 4), "grpo"), torch.zeros(1, 4))  # all equal: 0
    with pytest.raises(LabError, match="at least 2"):
        advantages.group_advantages(torch.ones(3, 1), "rloo")


def test_reinforce_coefficient_is_minus_advantage_over_batch():
    _, c, _ = coefficients("reinforce")
    assert torch.allclose(c, -ADV * MASK / 2)


def test_seq_is_uses_the_product_of_token_ratios():
    loss, c, _ = coefficients("seq_is")
    W = torch.tensor([math.exp(-1.0 + 1.2 - 2.0 + 1.5 + 0.0), math.exp(0.0 + 0.8)], dtype=torch.float64)
    assert torch.allclose(c, -(W[:, None] * ADV) * MASK / 2)
    # no division by length: the weight is a plain sum in log space
    assert float(c[0, 0]) == pytest.approx(-1.5 * math.exp(-0.3) / 2)


def test_token_is_coefficient_is_the_token_ratio():
    loss, c, _ = coefficients("token_is")
    rho = torch.exp(LOGP - OLD)
    assert torch.allclose(c, -ADV * rho * MASK / 2)
    assert float(loss) == pytest.approx(float(-(ADV * rho * MASK).sum() / 2))


def test_ppo_clip_by_hand():
    # rho row 0: e^{0.2}=1.221 (A>0: clipped at 1.2 -> no gradient), e^{-0.5}=0.607 (passes), 1 (passes)
    # rho row 1: 1 (A<0 passes), e^{0.8}=2.226 (A<0: max picks the unclipped ratio -> passes), masked
    loss, c, metrics = coefficients("ppo_clip")
    rho = torch.exp(LOGP - OLD)
    expected = -ADV * rho * MASK / 2
    expected[0, 0] = 0.0
    assert torch.allclose(c, expected)
    by_hand = (-1.5 * 1.2 - 1.5 * rho[0, 1] - 1.5 * 1.0 + 0.5 * 1.0 + 0.5 * rho[1, 1]) / 2
    assert float(loss) == pytest.approx(float(by_hand))
    assert float(metrics["clipfrac"]) == pytest.approx(1 / 5)


def test_ppo_dual_clip_caps_negative_advantage_tokens():
    # with c = 2: rho = 2.226 > c and A < 0 -> loss -A c, no gradient
    loss, c, metrics = coefficients("ppo_clip", clip_ratio_c=2.0)
    assert float(c[1, 1]) == 0.0
    assert float(metrics["clipfrac_lower"]) == pytest.approx(1 / 5)
    rho = torch.exp(LOGP - OLD)
    by_hand = (-1.5 * 1.2 - 1.5 * rho[0, 1] - 1.5 * 1.0 + 0.5 * 1.0 + 0.5 * 2.0) / 2
    assert float(loss) == pytest.approx(float(by_hand))


@pytest.mark.parametrize("name", ["reinforce", "seq_is", "token_is", "ppo_clip"])
def test_coefficient_function_matches_autograd(name):
    info = estimators.info(name)
    _, c, _ = coefficients(name)
    if name == "seq_is":
        ratio = torch.exp(((LOGP - OLD) * MASK).sum(-1, keepdim=True)).expand(2, 3)
    else:
        ratio = torch.exp(LOGP - OLD)
    coef = info.coefficient(ratio, ADV)
    assert torch.allclose(c, -coef * ADV * MASK / 2)


PLAIN = [n for n in estimators.names() if not estimators.info(n).inputs]  # the rest: test_estimator_properties


@pytest.mark.parametrize("name", PLAIN)
def test_extreme_log_ratios_stay_finite(name):
    lp = torch.tensor([[-1e4, -0.1, 0.0], [0.0, -3e3, -1.0]], requires_grad=True)
    old = torch.tensor([[0.0, -1e4, -2e3], [-1e4, 0.0, 0.0]])
    loss, metrics = estimators.get(name)(lp, old, torch.ones(2, 3), torch.ones(2, 3), loss_agg_mode="token-mean")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", PLAIN)
def test_estimators_run_under_vmap(name):
    lp = torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(0)).clamp(max=0)
    old = lp + 0.1 * torch.randn(5, 4, 3, generator=torch.Generator().manual_seed(1))
    adv, mask = torch.randn(5, 4, 1).expand(5, 4, 3), torch.ones(5, 4, 3)
    fn = estimators.get(name)
    g = vmap(grad(lambda a, b, c, d: fn(a, b, c, d, loss_agg_mode="token-mean")[0]))(lp, old, adv, mask)
    loop = torch.stack([grad(lambda a: fn(a, old[i], adv[i], mask[i], loss_agg_mode="token-mean")[0])(lp[i])
                        for i in range(5)])
    assert torch.allclose(g, loop, atol=1e-6)


def test_registry_metadata_and_errors():
    for name in estimators.names():
        i = estimators.info(name)
        assert i.family and i.source and i.unbiased_for and i.description
        assert i.label and i.paper and i.unbiased in estimators.registry.UNBIASED, name
    labels = [estimators.info(n).label for n in estimators.names()]
    assert len(set(labels)) == len(labels)  # one display name per estimator
    assert (estimators.info("seq_is").label, estimators.info("ppo_clip").label) == ("Seq IS", "PPO clip")
    assert estimators.info("ppo_clip").defaults == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": None}
    with pytest.raises(LabError, match="unknown estimator"):
        estimators.get("vespo2")
    with pytest.raises(LabError, match="no hyper-parameter"):
        estimators.check_hyper("ppo_clip", {"eps": 0.1})
