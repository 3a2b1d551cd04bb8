"""The peer corrections (TIS, MIS/IcePop, GSPO, GMPO, CISPO, SAPO, KL penalties) against values computed by hand.

Shared inputs (the same as tests/test_estimators.py):
    delta = LOGP - OLD = [[0.2, -0.5, 0.0], [0.0, 0.8, (masked)]]
    rho   = [[e^0.2 = 1.2214, e^-0.5 = 0.6065, 1], [1, e^0.8 = 2.2255, -]]
    L     = [0.2 - 0.5 + 0 = -0.3, 0 + 0.8 = 0.8],   W = [e^-0.3 = 0.7408, e^0.8 = 2.2255]
    A     = +1.5 on row 0, -0.5 on row 1.
Gradients are d loss / d log pi(y_t) from autograd; under seq-mean-token-sum (B = 2) an estimator with
coefficient c_t on A grad log pi has d loss / d log pi_t = -c_t A_t m_t / 2.
"""
import math

import pytest
import torch

import toy_envs
from lab import estimators
from lab.estimators.aggregation import AGG_MODES, target_scale
from lab.engine.estimator import Estimator
from lab.engine.exact import Problem, exact_support, policy_gradient
from lab.engine.gradients import expected_gradient
from lab.policies import init_params, make_policy
from lab.engine.staleness import behaviour, optimisation_trajectory

LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]], dtype=torch.float64)
OLD = torch.tensor([[-1.2, -1.5, -0.5], [-0.3, -2.0, -4.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
ADV = torch.tensor([[1.5], [-0.5]], dtype=torch.float64).expand(2, 3)
RHO = torch.exp(LOGP - OLD)
W = torch.exp(((LOGP - OLD) * MASK).sum(-1))  # [e^-0.3, e^0.8]
# a sampler mu for the three-policy tests: OLD - ROLL = [[-0.2, 0, -0.3], [0, 0.5, (masked)]]
ROLL = torch.tensor([[-1.0, -1.5, -0.2], [-0.3, -2.5, -4.0]], dtype=torch.float64)

PEERS = ["tis_token", "tis_seq", "mis_token", "mis_seq", "gspo", "gmpo", "cispo", "sapo"]
KLS = ["kl_k1", "kl_k2", "kl_k3"]
e = math.exp


def run(name, logp=LOGP, old=OLD, adv=ADV, mask=MASK, loss_agg_mode="seq-mean-token-sum", **kw):
    """(loss, d loss / d log pi, metrics)."""
    lp = logp.clone().requires_grad_(True)
    loss, metrics = estimators.get(name)(lp, old, adv, mask, loss_agg_mode=loss_agg_mode, **kw)
    (g,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), g, {k: float(v) for k, v in metrics.items()}


def approx(x, rel=1e-9, abs=1e-12):
    return pytest.approx(x, rel=rel, abs=abs)


# --------------------------------------------------------------------------------------------- TIS
def test_tis_token_truncates_each_token_ratio_at_two():
    loss, g, m = run("tis_token")
    w = [[e(0.2), e(-0.5), 1.0], [1.0, 2.0, 0.0]]  # e^0.8 = 2.2255 is truncated to C = 2
    by_hand = (-1.5 * (w[0][0] * -1.0 + w[0][1] * -2.0 + w[0][2] * -0.5) + 0.5 * (w[1][0] * -0.3 + w[1][1] * -1.2)) / 2
    assert loss == approx(by_hand)
    assert torch.allclose(g, -torch.tensor(w, dtype=torch.float64) * ADV * MASK / 2)
    assert m["is_trunc_frac"] == approx(1 / 5)
    assert m["is_ratio_max"] == approx(e(0.8))
    assert m["is_weight_mean"] == approx((e(0.2) + e(-0.5) + 1 + 1 + 2) / 5)
    assert m["ppo_kl"] == approx(-(0.2 - 0.5 + 0.0 + 0.0 + 0.8) / 5)


def test_tis_seq_truncates_the_sequence_weight():
    loss, g, m = run("tis_seq")
    w = torch.tensor([[e(-0.3)], [2.0]], dtype=torch.float64)  # min(W, 2): row 1's e^0.8 is truncated
    by_hand = (-1.5 * e(-0.3) * (-1.0 - 2.0 - 0.5) + 0.5 * 2.0 * (-0.3 - 1.2)) / 2
    assert loss == approx(by_hand)
    assert torch.allclose(g, -w * ADV * MASK / 2)
    assert m["is_trunc_frac"] == approx(1 / 2) and m["is_ratio_max"] == approx(e(0.8))
    assert m["is_weight_mean"] == approx((e(-0.3) + 2.0) / 2)
    # TRL's sequence_truncate mode (cap 3) keeps W = 2.2255
    _, g3, _ = run("tis_seq", cap=3.0)
    assert float(g3[1, 1]) == approx(-e(0.8) * -0.5 / 2)


# --------------------------------------------------------------------------------------------- MIS / IcePop
def test_mis_token_keeps_ratios_inside_the_band_and_zeroes_the_rest():
    _, g, m = run("mis_token")  # default [0.5, 5]: every ratio (0.61 .. 2.23) is kept
    assert torch.allclose(g, -RHO * ADV * MASK / 2) and m["is_mask_frac"] == 0.0
    # band [0.7, 2]: e^-0.5 = 0.6065 (row 0) and e^0.8 = 2.2255 (row 1) are masked
    loss, g, m = run("mis_token", lower=0.7, upper=2.0)
    w = RHO * MASK
    w[0, 1] = 0.0
    w[1, 1] = 0.0
    assert torch.allclose(g, -w * ADV / 2)
    assert loss == approx((-1.5 * (e(0.2) * -1.0 + 1.0 * -0.5) + 0.5 * (1.0 * -0.3)) / 2)
    assert m["is_mask_frac"] == approx(2 / 5)
    assert m["is_weight_mean"] == approx((e(0.2) + 1 + 1) / 5)


def test_mis_seq_drops_whole_sequences_outside_the_band():
    loss, g, m = run("mis_seq")  # default [0.5, 2]: W = 0.7408 kept, W = 2.2255 dropped
    assert torch.allclose(g[0], -e(-0.3) * 1.5 * MASK[0] / 2) and torch.equal(g[1], torch.zeros(3, dtype=g.dtype))
    assert loss == approx(-1.5 * e(-0.3) * (-3.5) / 2)
    assert m["is_mask_frac"] == approx(1 / 2) and m["is_weight_mean"] == approx(e(-0.3) / 2)
    # TRL's default sequence_mask (no lower bound, cap 3) keeps both: the gradient is sequence IS
    _, g_trl, m_trl = run("mis_seq", lower=0.0, upper=3.0)
    assert torch.allclose(g_trl, -W[:, None] * ADV * MASK / 2) and m_trl["is_mask_frac"] == 0.0


def test_masked_estimators_keep_masked_tokens_in_the_token_mean_denominator():
    # token-mean over 5 tokens even when sequence 1 is masked out (IcePop semantics, not verl's rollout_rs)
    _, g, _ = run("mis_seq", loss_agg_mode="token-mean")
    assert float(g[0, 0]) == approx(-e(-0.3) * 1.5 / 5)


# --------------------------------------------------------------------------------------------- three-policy
def test_three_policy_tis_token_weights_verl_ppo_loss_by_pi_old_over_mu():
    # w = min(pi_old/mu, 2) = [[e^-0.2, 1, e^-0.3], [1, e^0.5]]; r = pi/pi_old = RHO.
    # PPO (eps 0.2, dual clip 3): row 0 (A = 1.5): r = 1.2214 > 1.2 -> -1.5 * 1.2, no gradient; 0.6065 and 1 pass.
    # row 1 (A = -0.5): r = 1 passes; r = 2.2255: max(0.5 * 2.2255, 0.5 * 0.8) = 1.1128 < 0.5 * 3 -> passes.
    loss, g, m = run("tis_token", rollout_log_probs=ROLL)
    w = [[e(-0.2), 1.0, e(-0.3)], [1.0, e(0.5)]]
    by_hand = (w[0][0] * -1.5 * 1.2 + w[0][1] * -1.5 * e(-0.5) + w[0][2] * -1.5 * 1.0
               + w[1][0] * 0.5 * 1.0 + w[1][1] * 0.5 * e(0.8)) / 2
    assert loss == approx(by_hand)
    expected = torch.tensor([[0.0, w[0][1] * -1.5 * e(-0.5), w[0][2] * -1.5 * 1.0],
                             [w[1][0] * 0.5 * 1.0, w[1][1] * 0.5 * e(0.8), 0.0]], dtype=torch.float64) / 2
    assert torch.allclose(g, expected)
    assert m["clipfrac"] == approx(1 / 5) and m["clipfrac_lower"] == 0.0
    assert m["is_weight_mean"] == approx((e(-0.2) + 1 + e(-0.3) + 1 + e(0.5)) / 5)
    assert m["rollout_kl"] == approx((0.2 + 0.0 + 0.3 + 0.0 - 0.5) / 5)  # mean(log mu - log pi_old)


def test_three_policy_dual_clip_and_sequence_weight():
    # with c = 2 the dual clip caps row 1's r = 2.2255 (A < 0): loss -A c = 0.5 * 2 and no gradient
    loss, g, m = run("tis_seq", rollout_log_probs=ROLL, clip_ratio_c=2.0)
    w0, w1 = e(-0.2 + 0.0 - 0.3), e(0.0 + 0.5)  # sequence weights pi_old(y)/mu(y), both below C = 2
    assert loss == approx((w0 * (-1.5 * 1.2 - 1.5 * e(-0.5) - 1.5) + w1 * (0.5 * 1.0 + 0.5 * 2.0)) / 2)
    assert float(g[1, 1]) == 0.0 and float(g[0, 0]) == 0.0
    assert float(g[0, 1]) == approx(w0 * -1.5 * e(-0.5) / 2) and float(g[1, 0]) == approx(w1 * 0.5 / 2)
    assert m["clipfrac_lower"] == approx(1 / 5)
    # MIS seq: pi_old/mu = e^-0.5 = 0.6065 (kept) and e^0.5 = 1.6487 (kept) in [0.5, 2]; band [0.7, 2] drops row 0
    _, g, m = run("mis_seq", rollout_log_probs=ROLL, lower=0.7)
    assert torch.equal(g[0], torch.zeros(3, dtype=g.dtype)) and m["is_mask_frac"] == approx(1 / 2)
    assert float(g[1, 1]) == approx(e(0.5) * 0.5 * e(0.8) / 2)


def test_three_policy_weight_uses_pi_old_not_pi():
    # moving pi (log_prob) must not change the IS weight in a decoupled batch, only the PPO ratio
    _, _, m1 = run("mis_token", rollout_log_probs=ROLL)
    _, _, m2 = run("mis_token", logp=LOGP - 3.0, rollout_log_probs=ROLL)
    assert m1["is_weight_mean"] == m2["is_weight_mean"] == approx((e(-0.2) + 1 + e(-0.3) + 1 + e(0.5)) / 5)


# --------------------------------------------------------------------------------------------- GSPO
def test_gspo_by_hand():
    # s_i = exp(L_i / |y_i|): s_0 = e^(-0.3/3) = e^-0.1, s_1 = e^(0.8/2) = e^0.4.
    # A_0 = 1.5 with s_0 < 1 - 3e-4: max(-A s, -A (1 - 3e-4)) = -A s (unclipped, passes);
    # A_1 = -0.5 with s_1 > 1 + 4e-4: max(0.5 s, 0.5 (1 + 4e-4)) = 0.5 s (unclipped, passes).
    s0, s1 = e(-0.1), e(0.4)
    loss, g, m = run("gspo", loss_agg_mode="seq-mean-token-mean")
    assert loss == approx((-1.5 * s0 + 0.5 * s1) / 2)
    # per-token trick: the gradient lands on each token with the sequence's s_i, times 1/(B |y_i|)
    expected = torch.tensor([[-1.5 * s0 / 6] * 3, [0.5 * s1 / 4] * 2 + [0.0]], dtype=torch.float64)
    assert torch.allclose(g, expected)
    assert m["clipfrac"] == 0.0 and m["seq_ratio_mean"] == approx((s0 + s1) / 2)
    # flipped advantages: both sequences sit outside the trust region on the clipped side -> no gradient
    loss, g, m = run("gspo", adv=-ADV, loss_agg_mode="seq-mean-token-mean")
    assert torch.equal(g, torch.zeros_like(g)) and m["clipfrac"] == 1.0
    assert loss == approx((1.5 * (1 - 3e-4) - 0.5 * (1 + 4e-4)) / 2)


def test_gspo_clamps_the_log_ratio_at_ten_like_verl():
    old = OLD.clone()
    old[1] = torch.tensor([-25.0, -25.0, -4.0], dtype=torch.float64)  # L_1/|y_1| = (24.7 + 23.8)/2 > 10
    loss, g, _ = run("gspo", old=old, loss_agg_mode="seq-mean-token-mean")
    assert float(g[1].abs().sum()) == 0.0  # A < 0 would pass the PPO clip, but the clamp stops the gradient
    assert loss == approx((-1.5 * e(-0.1) + 0.5 * e(10.0)) / 2)


# --------------------------------------------------------------------------------------------- GMPO
def test_gmpo_by_hand():
    # A_0 > 0: only the upper side clips at 0.4 (none of 0.2, -0.5, 0 does) -> r_0 = e^(-0.3/3) = e^-0.1
    # A_1 < 0: only the lower side clips at -0.4 (none of 0, 0.8)            -> r_1 = e^(0.8/2)  = e^0.4
    loss, g, m = run("gmpo", loss_agg_mode="seq-mean-token-mean")
    r0, r1 = e(-0.1), e(0.4)
    assert loss == approx((-1.5 * r0 + 0.5 * r1) / 2)  # the mean over sequences of -A_i r_i
    expected = torch.tensor([[-1.5 * r0 / 6] * 3, [0.5 * r1 / 4] * 2 + [0.0]], dtype=torch.float64)
    assert torch.allclose(g, expected) and m["clipfrac"] == 0.0
    # flipped: A_0 < 0 clips delta = -0.5 up to -0.4; A_1 > 0 clips delta = 0.8 down to 0.4 (sign-aware)
    loss, g, m = run("gmpo", adv=-ADV, loss_agg_mode="seq-mean-token-mean")
    r0, r1 = e((0.2 - 0.4 + 0.0) / 3), e((0.0 + 0.4) / 2)
    assert loss == approx((1.5 * r0 - 0.5 * r1) / 2)
    expected = torch.tensor([[1.5 * r0 / 6, 0.0, 1.5 * r0 / 6], [-0.5 * r1 / 4, 0.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(g, expected) and m["clipfrac"] == approx(2 / 5)
    assert m["seq_ratio_mean"] == approx((r0 + r1) / 2)


def test_gmpo_other_modes_weight_the_sequence_loss_by_its_tokens():
    # seq-mean-token-sum: loss = (1/B) sum_i |y_i| (-A_i r_i), gradient -A_i r_i / B on unclipped tokens
    r0, r1 = e(-0.1), e(0.4)
    loss, g, _ = run("gmpo")
    assert loss == approx((3 * -1.5 * r0 + 2 * 0.5 * r1) / 2)
    assert float(g[0, 0]) == approx(-1.5 * r0 / 2) and float(g[1, 1]) == approx(0.5 * r1 / 2)


# --------------------------------------------------------------------------------------------- CISPO
def test_cispo_by_hand_and_its_cap():
    loss, g, m = run("cispo")  # every rho in [0, 5]: coefficient rho, nothing clipped
    assert torch.allclose(g, -RHO * ADV * MASK / 2) and m["clipfrac"] == 0.0
    assert loss == approx(float((-RHO * ADV * LOGP * MASK).sum()) / 2)
    old = OLD.clone()
    old[1, 1] = -3.0  # delta = 1.8, rho = 6.05 > 5: the coefficient is capped at 5 but the token keeps its gradient
    _, g, m = run("cispo", old=old)
    assert float(g[1, 1]) == approx(-5.0 * -0.5 / 2) and m["clipfrac"] == approx(1 / 5)


def test_cispo_trl_fallback_cap_shrinks_even_the_on_policy_gradient():
    # TRL clamps rho at epsilon_high and falls back to epsilon = 0.2 when it is unset: clip_ratio_high = -0.8 here
    _, g, _ = run("cispo", old=LOGP, clip_ratio_high=-0.8)
    _, g_reinforce, _ = run("reinforce", old=LOGP)
    assert torch.allclose(g, 0.2 * g_reinforce)


# --------------------------------------------------------------------------------------------- SAPO
def sigmoid(x):
    return 1 / (1 + e(-x))


def test_sapo_by_hand():
    # tau = 1 on row 0 (A > 0), 1.05 on row 1 (A <= 0); gate = sigmoid(tau (rho - 1)) 4 / tau
    rho = [[e(0.2), e(-0.5), 1.0], [1.0, e(0.8)]]
    gate = [[sigmoid(r - 1) * 4 for r in rho[0]], [sigmoid(1.05 * (r - 1)) * 4 / 1.05 for r in rho[1]]]
    loss, g, m = run("sapo")
    assert loss == approx((-1.5 * sum(gate[0]) + 0.5 * sum(gate[1])) / 2)
    # d gate / d log pi = 4 s (1 - s) rho
    w = [[4 * sigmoid(r - 1) * (1 - sigmoid(r - 1)) for r in rho[0]],
         [4 * sigmoid(1.05 * (r - 1)) * (1 - sigmoid(1.05 * (r - 1))) for r in rho[1]]]
    expected = torch.tensor([[-1.5 * w[0][t] * rho[0][t] / 2 for t in range(3)],
                             [0.5 * w[1][t] * rho[1][t] / 2 for t in range(2)] + [0.0]], dtype=torch.float64)
    assert torch.allclose(g, expected)
    assert m["gate_weight_mean"] == approx((sum(w[0]) + sum(w[1])) / 5)
    assert m["gate_weight_min"] == approx(min(w[0] + w[1]))


def test_sapo_on_policy_has_reinforce_gradient_but_not_its_loss_value():
    loss, g, _ = run("sapo", old=LOGP)
    loss_r, g_r, _ = run("reinforce", old=LOGP)
    assert torch.allclose(g, g_r)  # gate slope 4 sigmoid'(0) = 1 for either tau
    assert loss == approx((-1.5 * 3 * 2 / 1.0 + 0.5 * 2 * 2 / 1.05) / 2)  # -A * 2/tau per token


# --------------------------------------------------------------------------------------------- coefficients
def _sequence_ratio_by_token(name):
    if name in ("tis_seq", "mis_seq"):
        return W[:, None].expand(2, 3)
    if name == "gspo":
        return torch.exp(((LOGP - OLD) * MASK).sum(-1) / MASK.sum(-1))[:, None].expand(2, 3)
    return RHO


@pytest.mark.parametrize("adv_sign", [1.0, -1.0])
@pytest.mark.parametrize("name", PEERS)
def test_coefficient_function_matches_autograd(name, adv_sign):
    adv = adv_sign * ADV
    _, g, _ = run(name, adv=adv)
    ratio = _sequence_ratio_by_token(name)
    info = estimators.info(name)
    if name == "gmpo":  # seq_ratio: r_i from the sign-aware clipped log-ratios (see test_gmpo_by_hand)
        r = [e(-0.1), e(0.4)] if adv_sign > 0 else [e(-0.2 / 3), e(0.2)]
        coef = info.coefficient(ratio, adv, seq_ratio=torch.tensor(r, dtype=torch.float64)[:, None])
    else:
        coef = info.coefficient(ratio, adv, **info.defaults)
    assert torch.allclose(g, -coef * adv * MASK / 2), name


@pytest.mark.parametrize("name", PEERS + KLS)
def test_coefficient_defaults_are_the_estimator_defaults(name):
    # plots call coefficient(ratio, A) with no hyper-parameters: its defaults must be the estimator's
    info = estimators.info(name)
    r = torch.tensor([0.05, 0.3, 0.6, 0.9997, 1.0, 1.0003, 1.3, 1.6, 2.5, 4.0, 6.0, 1e5], dtype=torch.float64)
    for a in (1.0, -1.0):
        adv = torch.full_like(r, a)
        assert torch.equal(info.coefficient(r, adv), info.coefficient(r, adv, **info.defaults)), name


def test_coefficient_curves_have_the_documented_shapes():
    r = torch.tensor([0.3, 0.5, 1.0, 1.3, 1.6, 2.5, 6.0], dtype=torch.float64)
    one = torch.ones_like(r)
    assert torch.allclose(estimators.info("tis_token").coefficient(r, one), torch.clamp(r, max=2.0))
    assert torch.allclose(estimators.info("mis_token").coefficient(r, one),
                          torch.tensor([0.0, 0.5, 1.0, 1.3, 1.6, 2.5, 0.0], dtype=torch.float64))
    assert torch.allclose(estimators.info("mis_seq").coefficient(r, one),
                          torch.tensor([0.0, 0.5, 1.0, 1.3, 1.6, 0.0, 0.0], dtype=torch.float64))
    assert torch.allclose(estimators.info("cispo").coefficient(r, one), torch.clamp(r, max=5.0))
    # GMPO: e^0.4 = 1.49 is the cut for A > 0, e^-0.4 = 0.67 for A < 0
    assert torch.allclose(estimators.info("gmpo").coefficient(r, one),
                          torch.tensor([0.3, 0.5, 1.0, 1.3, 0.0, 0.0, 0.0], dtype=torch.float64))
    assert torch.allclose(estimators.info("gmpo").coefficient(r, -one),
                          torch.tensor([0.0, 0.0, 1.0, 1.3, 1.6, 2.5, 6.0], dtype=torch.float64))
    # SAPO: 4 s(1-s) rho is 1 on-policy, is NOT bounded by 1 (it peaks where (2s - 1) rho = 1: rho = 2.06,
    # coefficient 1.575 for tau = 1), then decays like rho e^(-tau (rho - 1))
    grid = torch.linspace(0.01, 10.0, 100001, dtype=torch.float64)
    sapo = estimators.info("sapo").coefficient(grid, torch.ones_like(grid))
    assert float(estimators.info("sapo").coefficient(torch.tensor(1.0), torch.tensor(1.0))) == 1.0
    assert 2.05 < float(grid[sapo.argmax()]) < 2.07 and sapo.max() == pytest.approx(1.5747, abs=1e-4)
    assert float(estimators.info("sapo").coefficient(torch.tensor(20.0), torch.tensor(1.0))) < 1e-5


# --------------------------------------------------------------------------------------------- on-policy
@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", PEERS)
def test_on_policy_gradient_is_exactly_reinforce(name, mode):
    _, g, _ = run(name, old=LOGP, loss_agg_mode=mode)
    _, g_r, _ = run("reinforce", old=LOGP, loss_agg_mode=mode)
    assert torch.allclose(g, g_r, rtol=1e-12, atol=1e-15), name


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", ["tis_token", "tis_seq", "mis_token", "mis_seq"])
def test_three_policy_on_policy_gradient_is_exactly_reinforce(name, mode):
    _, g, _ = run(name, old=LOGP, loss_agg_mode=mode, rollout_log_probs=LOGP)
    _, g_r, _ = run("reinforce", old=LOGP, loss_agg_mode=mode)
    assert torch.allclose(g, g_r, rtol=1e-12, atol=1e-15)
    # ... but only when the sampler agrees with pi_old: a stale sampler reweights even at pi = pi_old
    _, g_stale, _ = run(name, old=LOGP, loss_agg_mode=mode, rollout_log_probs=LOGP + 0.3 * MASK)
    assert not torch.allclose(g_stale, g_r)


# --------------------------------------------------------------------------------------------- exact, by enumeration
LIMIT = toy_envs.DEFAULT_ENUM_LIMIT


@pytest.fixture(scope="module")
def world():
    env = toy_envs.make("tiny_target")
    policy = make_policy("prefix", env)
    g = torch.Generator().manual_seed(0)
    traj = optimisation_trajectory(Problem(env, policy), init_params(policy, 1.0, g), 32, 0.05, g)
    pi = traj.current
    g_star = policy_gradient(env, policy, pi, exact_support(env, policy, pi, LIMIT)).reshape(-1)
    assert target_scale("seq-mean-token-sum", env.length) == 1.0

    def expected(name, lag, **hyper):
        mu = behaviour(Problem(env, policy), "lag", lag, traj, torch.Generator().manual_seed(1))
        return expected_gradient(env, policy, pi, mu, exact_support(env, *mu, LIMIT),
                                 Estimator.resolve(name, hyper, "seq-mean-token-sum"))

    return expected, g_star


@pytest.mark.slow
def test_peers_are_exact_at_zero_staleness_and_biased_when_stale(world):
    expected, g_star = world
    for name in PEERS:
        assert torch.allclose(expected(name, 0), g_star, atol=1e-12, rtol=1e-9), name
        assert float((expected(name, 16) - g_star).norm()) > 1e-3 * float(g_star.norm()), name


def test_sequence_corrections_are_unbiased_when_the_cap_never_binds(world):
    expected, g_star = world
    assert torch.allclose(expected("tis_seq", 16, cap=1e9), g_star, atol=1e-12, rtol=1e-8)
    assert torch.allclose(expected("mis_seq", 16, lower=0.0, upper=1e9), g_star, atol=1e-12, rtol=1e-8)


# --------------------------------------------------------------------------------------------- KL penalties
REF = torch.tensor([[-1.5, -2.0, -4.0], [0.0, -13.2, -9.0]], dtype=torch.float64)  # d = LOGP - REF


def test_kl_penalty_values_gradients_and_clamp_by_hand():
    # d = [[0.5, 0, 3.5], [-0.3, 12.0, (masked)]]
    d = [0.5, 0.0, 3.5, -0.3, 12.0]
    loss, g, m = run("kl_k1", ref_log_prob=REF, loss_agg_mode="token-mean")
    assert loss == approx(sum(d) / 5) and m["kl_mean"] == approx(sum(d) / 5)
    assert torch.allclose(g, MASK / 5)
    loss, g, m = run("kl_k2", ref_log_prob=REF, loss_agg_mode="token-mean")
    assert loss == approx(sum(x * x / 2 for x in d) / 5)
    assert torch.allclose(g, torch.tensor([[0.5, 0.0, 3.5], [-0.3, 12.0, 0.0]], dtype=torch.float64) / 5)
    # k3 = e^-d - 1 + d, capped at 10 (verl): d = 12 gives 11.000006 -> 10 and no gradient
    k3 = [e(-x) - 1 + x for x in d[:4]] + [10.0]
    loss, g, m = run("kl_k3", ref_log_prob=REF, loss_agg_mode="token-mean")
    assert loss == approx(sum(k3) / 5) and m["kl_mean"] == approx(sum(k3) / 5)
    expected = torch.tensor([[1 - e(-0.5), 0.0, 1 - e(-3.5)], [1 - e(0.3), 0.0, 0.0]], dtype=torch.float64) / 5
    assert torch.allclose(g, expected)
    # d = -3 (pi/pi_ref = 0.05): k3 = e^3 - 4 = 16.1 > 10 -> capped, the abandoned token is not pushed back
    _, g, _ = run("kl_k3", ref_log_prob=LOGP + 3.0, loss_agg_mode="token-mean")
    assert torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("name", KLS)
def test_kl_coefficient_matches_autograd(name):
    _, g, _ = run(name, ref_log_prob=REF)
    coef = estimators.info(name).coefficient(torch.exp(LOGP - REF))
    assert torch.allclose(g, coef * MASK / 2)


def test_kl_penalty_gradients_by_enumeration_on_a_categorical():
    """E_{a ~ pi}[grad_theta k(a)], summed over the 5 actions with weights pi(a), vs the analytic KL gradients."""
    theta = torch.tensor([0.3, -0.7, 1.1, 0.0, -0.2], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([0.1, 0.4, 0.2, -0.5, 0.3], dtype=torch.float64), -1)
    log_pi = torch.log_softmax(theta, -1)
    pi = log_pi.exp().detach()
    assert float((log_pi.detach() - ref).abs().max()) < 2.0  # inside k3's clamp

    def expected_grad(name):
        total = 0.0
        for a in range(5):  # one sampled token per "batch", weighted by pi(a): sampling is not differentiated
            one = torch.ones(1, 1, dtype=torch.float64)
            loss, _ = estimators.get(name)(log_pi[a].reshape(1, 1), log_pi[a].detach().reshape(1, 1), 0 * one, one,
                                           loss_agg_mode="seq-mean-token-sum", ref_log_prob=ref[a].reshape(1, 1))
            total = total + pi[a] * loss
        (grad,) = torch.autograd.grad(total, theta, retain_graph=True)
        return grad

    def grad_of(f):
        (grad,) = torch.autograd.grad(f(torch.log_softmax(theta, -1)), theta)
        return grad

    reverse_kl = grad_of(lambda lp: (lp.exp() * (lp - ref)).sum())  # KL(pi || pi_ref)
    forward_kl = grad_of(lambda lp: (ref.exp() * (ref - lp)).sum())  # KL(pi_ref || pi)
    assert torch.allclose(expected_grad("kl_k1"), torch.zeros(5, dtype=torch.float64), atol=1e-15)
    assert torch.allclose(expected_grad("kl_k2"), reverse_kl, rtol=1e-12, atol=1e-15)
    assert torch.allclose(expected_grad("kl_k3"), forward_kl, rtol=1e-12, atol=1e-15)
    assert not torch.allclose(forward_kl, reverse_kl, atol=1e-3)  # the two targets really differ here


# --------------------------------------------------------------------------------------------- registry
def test_registry_entries_for_the_peers():
    for name in PEERS + KLS:
        i = estimators.info(name)
        assert i.coefficient is not None and i.source and i.unbiased_for and i.description
    for name in ["tis_token", "tis_seq", "mis_token", "mis_seq"]:
        assert estimators.info(name).optional_inputs == ("rollout_log_probs",)
    for name in KLS:
        assert estimators.info(name).inputs == ("ref_log_prob",) and estimators.info(name).family == "kl-penalty"
    assert estimators.info("tis_token").defaults["cap"] == 2.0
    for name, band in [("mis_token", (0.5, 5.0)), ("mis_seq", (0.5, 2.0))]:
        assert (estimators.info(name).defaults["lower"], estimators.info(name).defaults["upper"]) == band
    assert estimators.info("gspo").defaults == {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}
    assert estimators.info("gmpo").defaults == {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}
    assert estimators.info("cispo").defaults == {"clip_ratio_low": 1.0, "clip_ratio_high": 4.0}
    assert estimators.info("sapo").defaults == {"tau_pos": 1.0, "tau_neg": 1.05}
