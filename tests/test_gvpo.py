"""GVPO against hand-computed values and its gradient-weight form. Its optimum (Theorems 1 and 2) by enumeration and
by training, and the report on it, are the gvpo_optimum study's (lab/studies/gvpo_optimum/tests)."""
import pytest
import torch
from torch.func import grad, vmap

from lab import estimators
from lab.advantages import leave_one_out
from lab.errors import LabError
from lab.estimators.gvpo import gvpo_weights

BETA = 0.1
# Two groups of three responses, T = 2; row 2's second token is padding (its log-probs differ but must not count).
# Sequence log-ratios ell = sum_t m_t (log pi - log pi_old):
#   group 1: row 0: (-1 + 2.5) + (-2 + 3.5) = 3;  row 1: 0;  row 2: -3 + 0 = -3 (padding -7 vs -1 ignored)
#   group 2: row 3: 0.5 + 0.5 = 1;  row 4: 0.5 + 0.5 = 1;  row 5: -1 - 1 = -2
LOGP = torch.tensor([[-1.0, -2.0], [-0.5, -0.5], [-3.0, -7.0], [-1.0, -1.0], [-0.2, -0.3], [-2.0, -2.0]],
                    dtype=torch.float64)
OLD = torch.tensor([[-2.5, -3.5], [-0.5, -0.5], [0.0, -1.0], [-1.5, -1.5], [-0.7, -0.8], [-1.0, -1.0]],
                   dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 3.0], dtype=torch.float64)
# Residuals e_i = (R_theta,i - mean R_theta) - (R_i - mean R), R_theta = 0.1 ell:
#   group 1: R_theta = (0.3, 0, -0.3), mean 0; R - mean R = (2/3, -1/3, -1/3) -> e = (-11/30, 10/30, 1/30)
#   group 2: R_theta = (0.1, 0.1, -0.2), mean 0; R - mean R = (-1, -1, 2)    -> e = (1.1, 1.1, -2.2)
RESIDUAL = torch.tensor([-11 / 30, 10 / 30, 1 / 30, 1.1, 1.1, -2.2], dtype=torch.float64)


def run(log_prob=LOGP, old=OLD, mask=MASK, rewards=REWARDS, group_size=3, **hyper):
    lp = log_prob.clone().requires_grad_(True)
    loss, metrics = estimators.get("gvpo")(lp, old, torch.zeros_like(old), mask, rewards=rewards,
                                           group_size=group_size, **hyper)
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g, metrics


def test_loss_by_hand():
    loss, _, metrics = run()
    # L_1 = 1/(k-1) * 1/2 * sum e^2 = 1/2 * 1/2 * (121 + 100 + 1)/900 = 222/3600
    # L_2 = 1/2 * 1/2 * (1.21 + 1.21 + 4.84) = 1.815;  the batch loss is the mean over the two groups
    assert float(loss) == pytest.approx((222 / 3600 + 1.815) / 2)
    assert float(metrics["seq_log_ratio_abs_max"]) == pytest.approx(3.0)
    assert float(metrics["residual_rms"]) == pytest.approx(float(RESIDUAL.pow(2).mean().sqrt()))


def test_gradient_by_hand():
    _, g, _ = run()
    # d loss / d log pi(y_i, t) = 1/G * 1/(k-1) * beta * e_i * m_t = 1/2 * 1/2 * 0.1 * e_i on every real token
    expected = 0.025 * RESIDUAL[:, None] * MASK
    assert torch.allclose(g, expected)
    assert g[2, 1] == 0.0  # padding gets no gradient
    assert float(g[0, 0]) == pytest.approx(0.025 * -11 / 30)


def test_beta_scales_the_prediction():
    # beta = 0.5: group 2's R_theta = (0.5, 0.5, -1), residual (1.5, 1.5, -3): L_2 = 1/4 * 13.5 = 3.375
    # group 1's R_theta = (1.5, 0, -1.5): residual (1.5 - 2/3, 1/3, -1.5 + 1/3) = (5/6, 1/3, -7/6)
    loss, _, _ = run(beta=0.5)
    L1 = 0.25 * ((5 / 6) ** 2 + (1 / 3) ** 2 + (7 / 6) ** 2)
    assert float(loss) == pytest.approx((L1 + 3.375) / 2)


def test_weight_form_matches_autograd():
    gen = torch.Generator().manual_seed(0)
    B, T, k = 12, 4, 3
    lp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    old = lp + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=gen) > 0.2).double()
    rewards = torch.randn(B, generator=gen, dtype=torch.float64)
    for beta in (0.1, 0.7):
        _, g, _ = run(lp, old, mask, rewards, k, beta=beta)
        w = gvpo_weights(rewards, ((lp - old) * mask).sum(-1), k, beta)
        # grad L_group = -beta/(k-1) sum_i w_i grad log pi(y_i); the batch averages G = B/k groups
        assert torch.allclose(g, -beta / ((k - 1) * (B // k)) * w[:, None] * mask)
        assert torch.allclose(w.reshape(-1, k).sum(-1), torch.zeros(B // k, dtype=torch.float64), atol=1e-12)
    # by hand on the fixed batch: w = -e
    assert torch.allclose(gvpo_weights(REWARDS, torch.tensor([3.0, 0, -3, 1, 1, -2]), 3, BETA), -RESIDUAL)


def full_mse(lp, old, mask, rewards, k, beta, centred_target=True):
    """The MSE with nothing detached (the paper's form); ``centred_target=False`` drops the target's centring."""
    r_theta = (beta * ((lp - old) * mask).sum(-1)).reshape(-1, k)
    target = rewards.reshape(-1, k)
    if centred_target:
        target = target - target.mean(-1, keepdim=True)
    return (0.5 * ((r_theta - r_theta.mean(-1, keepdim=True)) - target).pow(2).sum(-1) / (k - 1)).mean()


def test_detached_group_mean_gives_the_same_gradient():
    lp = LOGP.clone().requires_grad_(True)
    loss = full_mse(lp, OLD, MASK, REWARDS, 3, BETA)
    (g_full,) = torch.autograd.grad(loss, lp)
    official, g_official, _ = run()
    assert float(loss.detach()) == pytest.approx(float(official))
    assert torch.allclose(g_official, g_full)
    # the equivalence needs sum_i e_i = 0; with uncentred targets the residuals do not sum to 0 and the
    # detached and full gradients differ (here by mean_g(e) per group) - so the check above can fail
    lp2 = LOGP.clone().requires_grad_(True)
    (g_unc,) = torch.autograd.grad(full_mse(lp2, OLD, MASK, REWARDS, 3, BETA, centred_target=False), lp2)
    r_theta = (BETA * ((lp2.detach() - OLD) * MASK).sum(-1)).reshape(-1, 3)
    resid = (r_theta - r_theta.mean(-1, keepdim=True)) - REWARDS.reshape(-1, 3)
    g_detached = (0.5 * 0.5 * BETA * resid.reshape(-1))[:, None] * MASK  # what a detached mean would give
    assert not torch.allclose(g_unc, g_detached)


def test_gvpo_gradient_is_beta_times_reinforce_on_the_kl_regularised_reward():
    # w_i = r_i - mean r with r = R - beta * ell: REINFORCE with a group-mean baseline (RLOO = k/(k-1) * centred)
    ell = ((LOGP - OLD) * MASK).sum(-1)
    adv = leave_one_out(REWARDS - BETA * ell, 3)[:, None] * MASK
    lp = LOGP.clone().requires_grad_(True)
    loss, _ = estimators.get("reinforce")(lp, OLD, adv, MASK, loss_agg_mode="seq-mean-token-sum")
    (g_reinforce,) = torch.autograd.grad(loss, lp)
    _, g, _ = run()
    assert torch.allclose(g, BETA * g_reinforce)


def test_bad_groups_raise_one_clear_error():
    with pytest.raises(LabError, match="GVPO needs at least 2 responses per prompt"):
        run(group_size=1)
    with pytest.raises(LabError, match="not a multiple of group_size 4"):
        run(group_size=4)
    with pytest.raises(LabError, match="one reward per response"):
        run(rewards=REWARDS[:3])
    with pytest.raises(LabError, match="at least 2 responses per prompt"):
        gvpo_weights(torch.ones(3), torch.zeros(3), 1)
    with pytest.raises(LabError, match="loss_agg_mode"):
        estimators.get("gvpo")(LOGP, OLD, OLD, MASK, loss_agg_mode="sum", rewards=REWARDS, group_size=3)


def test_registry_entry():
    info = estimators.info("gvpo")
    assert info.inputs == ("rewards", "group_size") and info.defaults == {"beta": 0.1}
    assert info.grad_scale(info.defaults) == 0.1 and info.grad_scale({"beta": 0.3}) == 0.3
    assert info.coefficient is None  # the weight depends on the whole group: see gvpo_weights
    assert "GVPO" in info.description and "2504.19599" in info.source


def test_finite_on_extreme_log_ratios_and_under_vmap():
    lp = torch.tensor([[-1e4, -0.1, 0.0], [0.0, -3e3, -1.0], [-50.0, 0.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, -1e4, -2e3], [-1e4, 0.0, 0.0], [0.0, 0.0, -80.0], [-1e3, -1e3, -1e3]])
    loss, metrics = estimators.get("gvpo")(lp, old, torch.ones(4, 3), torch.ones(4, 3), rewards=torch.ones(4),
                                           group_size=2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    # -inf log-probs on padding (as some trainers leave them) must not leak into the loss: same value as with 0s
    padded = LOGP.clone()
    padded[2, 1] = -float("inf")
    old_padded = OLD.clone()
    old_padded[2, 1] = -float("inf")
    loss_inf, g_inf, metrics_inf = run(padded, old_padded)
    loss_ref, g_ref, metrics_ref = run()
    assert float(loss_inf) == float(loss_ref) and torch.equal(g_inf, g_ref)
    assert all(torch.equal(metrics_inf[key], metrics_ref[key]) for key in metrics_ref)
    # per-replicate gradients with torch.func equal a loop (the variance engine's path)
    gen = torch.Generator().manual_seed(1)
    lp = torch.randn(5, 6, 3, generator=gen).clamp(max=0)
    old = lp + 0.1 * torch.randn(5, 6, 3, generator=gen)
    rewards, mask = torch.randn(5, 6, generator=gen), torch.ones(5, 6, 3)
    fn = estimators.get("gvpo")

    def f(a, b, m, r):
        return fn(a, b, torch.zeros_like(b), m, rewards=r, group_size=3)[0]

    g = vmap(grad(f))(lp, old, mask, rewards)
    loop = torch.stack([grad(f)(lp[i], old[i], mask[i], rewards[i]) for i in range(5)])
    assert torch.allclose(g, loop, atol=1e-6)
