"""VESPO against values computed by hand from the paper (Shen et al., arXiv 2602.10693) and the authors' code
(github.com/FloyedShen/VESPO): the kernel, its constants and the estimator. Proposition 3.1 checked exactly, and the
report on it, are the vespo_bound study's (lab/studies/vespo_bound/tests)."""
import math

import numpy as np
import pytest
import torch
from scipy.optimize import minimize_scalar

from lab import estimators
from lab.errors import LabError
from lab.estimators import vespo as V

# two sequences of two tokens; row 0 has A = +1 (kernel k=2, lambda=3), row 1 has A = -2 (kernel k=3, lambda=2)
LOGP = torch.tensor([[-1.0, -2.0], [-0.5, -1.5]], dtype=torch.float64)
OLD = torch.tensor([[-1.5, -2.0], [-0.5, -1.0]], dtype=torch.float64)
MASK = torch.ones(2, 2, dtype=torch.float64)
ADV = torch.tensor([[1.0], [-2.0]], dtype=torch.float64).expand(2, 2)


def run(log_prob=LOGP, old=OLD, adv=ADV, mask=MASK, loss_agg_mode="token-mean", **kw):
    lp = log_prob.clone().requires_grad_(True)
    loss, metrics = estimators.get("vespo")(lp, old, adv, mask, loss_agg_mode=loss_agg_mode, **kw)
    (c,) = torch.autograd.grad(loss, lp)
    return loss.detach(), c, metrics


# ---- the kernel ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("w, k, lam, expected", [(0.5, 2, 3, 1.120), (2.0, 2, 3, 0.199), (0.5, 3, 2, 0.340),
                                                 (2.0, 3, 2, 1.083)])
def test_published_check_values(w, k, lam, expected):
    assert V.phi(w, k, lam) == pytest.approx(expected, abs=5e-4)
    # by hand: 0.5^2 e^{3 * 0.5} = 0.25 * 4.4817 = 1.1204
    assert V.phi(0.5, 2, 3) == pytest.approx(0.25 * math.exp(1.5), rel=1e-12)


def test_phi_is_normalised_and_takes_every_input_kind():
    for k, lam in [(2, 3), (3, 2), (1, 1), (0.5, 4)]:
        assert V.phi(1.0, k, lam) == pytest.approx(1.0, rel=1e-14)
    w = np.array([0.0, 0.5, 2.0])
    assert np.allclose(V.phi(w, 2, 3), [0.0, 1.120422, 0.199148], atol=1e-6)
    t = V.phi(torch.tensor([0.0, 0.5, 2.0], dtype=torch.float64), 2, 3)
    assert torch.is_tensor(t) and torch.allclose(t, torch.from_numpy(V.phi(w, 2, 3)))
    assert V.log_phi(0.5, 2, 3) == pytest.approx(3 + 2 * math.log(0.5) - 1.5)  # lambda + k log W - lambda W


def test_maxima_match_numerical_maximisation():
    assert V.phi_max(2, 3) == pytest.approx(1.208, abs=5e-4)  # (2/3)^2 e^{3-2} = 0.4444 * 2.7183
    assert V.phi_max(3, 2) == pytest.approx(1.242, abs=5e-4)  # (3/2)^3 e^{2-3} = 3.375 * 0.3679
    for k, lam in [(2, 3), (3, 2), (1, 1), (1.5, 2), (4, 2), (0.5, 0.25)]:
        res = minimize_scalar(lambda w: -V.phi(w, k, lam), bounds=(1e-9, 50), method="bounded",
                              options={"xatol": 1e-10})
        assert res.x == pytest.approx(k / lam, rel=1e-5) and V.argmax_phi(k, lam) == k / lam
        assert -res.fun == pytest.approx(V.phi_max(k, lam), rel=1e-10)


def test_bound_constant_matches_numerical_supremum():
    assert V.bound_constant(2, 3) == pytest.approx(math.e**2 / 3) and V.bound_constant(2, 3) == pytest.approx(2.463,
                                                                                                            abs=5e-4)
    assert V.bound_constant(3, 2) == pytest.approx(1.0)  # ((3-1)/2)^2 e^{2-3+1} = 1
    for k, lam in [(2, 3), (3, 2), (1.5, 1), (4, 2), (2, 1), (6, 0.5)]:
        res = minimize_scalar(lambda w: -V.phi(w, k, lam) / w, bounds=(1e-9, 100), method="bounded",
                              options={"xatol": 1e-10})
        assert res.x == pytest.approx((k - 1) / lam, rel=1e-4) and V.argmax_bound(k, lam) == (k - 1) / lam
        assert -res.fun == pytest.approx(V.bound_constant(k, lam), rel=1e-9)
        grid = np.logspace(-8, 3, 20001)
        assert (V.phi(grid, k, lam) / grid).max() <= V.bound_constant(k, lam) * (1 + 1e-12)
    # k = 1: phi(w)/w = e^{lambda(1-w)} decreases towards e^lambda as w -> 0 (not attained)
    for lam in (1, 3):
        ratios = [V.phi(w, 1, lam) / w for w in (1e-1, 1e-4, 1e-10)]
        assert ratios == sorted(ratios) and ratios[-1] == pytest.approx(math.exp(lam), rel=1e-8)
        assert V.bound_constant(1, lam) == pytest.approx(math.exp(lam))
    # k < 1: no bound; phi(w)/w grows without limit as w -> 0
    assert V.bound_constant(0.5, 1) == math.inf
    assert V.phi(1e-12, 0.5, 1) / 1e-12 > 1e5


def test_surrogate_derivative_gives_phi():
    for k, lam in [(2, 3), (3, 2), (1, 1), (0.5, 2)]:
        w = np.array([0.1, 0.5, 1.0, 2.0, 5.0])
        h = 1e-6
        fprime = (V.surrogate(w + h, k, lam) - V.surrogate(w - h, k, lam)) / (2 * h)
        assert np.allclose(w * fprime, V.phi(w, k, lam), rtol=1e-6)
        assert V.surrogate(0.0, k, lam) == 0.0
    # (2, 3) in closed form: f(W) = e^3 / 9 * (1 - (1 + 3W) e^{-3W})  (gamma_lower(2, x) = 1 - (1 + x) e^{-x})
    assert V.surrogate(1.0, 2, 3) == pytest.approx(math.exp(3) / 9 * (1 - 4 * math.exp(-3)))


def test_bad_kernel_parameters_raise():
    with pytest.raises(LabError, match="lambda must be a finite positive"):
        V.phi(1.0, 2, 0)
    with pytest.raises(LabError, match="k must be a finite number >= 0"):
        V.bound_constant(-1, 2)
    with pytest.raises(LabError, match="W >= 0"):
        V.phi(-0.5, 2, 3)
    with pytest.raises(LabError, match="diverges for k = 0"):
        V.surrogate(1.0, 0, 3)
    with pytest.raises(LabError, match="lambda"):
        run(lambda_neg=-1.0)


# ---- the estimator ---------------------------------------------------------------------------------------------

def test_registry_entry():
    info = estimators.info("vespo")
    assert info.defaults == {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}
    assert info.optional_inputs == ("rollout_log_probs",) and info.inputs == ()
    assert info.unbiased_for.startswith("biased") and "Q" in info.unbiased_for
    assert info.coefficient is V.vespo_coefficient and info.grad_scale is None and info.ratio == "sequence"
    assert "VESPO" in info.source and "FloyedShen/VESPO" in info.source


def test_loss_and_gradient_by_hand():
    # row 0: L = (-1 + 1.5) + (-2 + 2) = 0.5, W = e^0.5 = 1.6487, A >= 0: phi = W^2 e^{3(1-W)} = e^{1 - 1.9462} = 0.3882
    # row 1: L = 0 + (-1.5 + 1.0) = -0.5, W = e^-0.5 = 0.6065, A < 0: phi = W^3 e^{2(1-W)} = e^{-1.5 + 0.7869} = 0.4901
    phi0 = math.exp(2 * 0.5 + 3 * (1 - math.exp(0.5)))
    phi1 = math.exp(3 * -0.5 + 2 * (1 - math.exp(-0.5)))
    assert phi0 == pytest.approx(0.3882, abs=1e-4) and phi1 == pytest.approx(0.4901, abs=1e-4)
    loss, c, metrics = run()
    # token-mean over 4 tokens of -phi A log pi: (0.3882*1 + 0.3882*2 - 0.4901*2*0.5 - 0.4901*2*1.5) / 4 = -0.1990
    by_hand = (-phi0 * 1 * -1.0 - phi0 * 1 * -2.0 - phi1 * -2 * -0.5 - phi1 * -2 * -1.5) / 4
    assert float(loss) == pytest.approx(by_hand, rel=1e-12) and by_hand == pytest.approx(-0.1990, abs=1e-4)
    # d loss / d log pi = -phi A / 4: no ratio in the graph, so the weight does not add a term of its own
    expected = torch.tensor([[-phi0 / 4, -phi0 / 4], [phi1 * 2 / 4, phi1 * 2 / 4]], dtype=torch.float64)
    assert torch.allclose(c, expected, rtol=1e-12)
    assert float(metrics["phi_max"]) == pytest.approx(max(phi0, phi1))
    assert float(metrics["seq_weight_mean"]) == pytest.approx((math.exp(0.5) + math.exp(-0.5)) / 2)
    # seq-mean-token-sum: 1/B instead of 1/(number of tokens)
    _, c2, _ = run(loss_agg_mode="seq-mean-token-sum")
    assert torch.allclose(c2, 2 * expected)


def test_coefficient_function_matches_autograd():
    _, c, _ = run()
    W = torch.exp(((LOGP - OLD) * MASK).sum(-1, keepdim=True)).expand(2, 2)
    coef = V.vespo_coefficient(W, ADV)
    assert torch.allclose(c, -coef * ADV * MASK / 4)


def test_sign_comes_from_the_first_token_and_zero_advantage_takes_the_positive_kernel():
    # A = 0 on the first token: the (2, 3) kernel (the loss term is 0 either way)
    adv = torch.tensor([[0.0, 0.0], [-2.0, -2.0]], dtype=torch.float64)
    _, _, m = run(adv=adv)
    assert float(m["phi_max"]) == pytest.approx(max(V.phi(math.exp(0.5), 2, 3), V.phi(math.exp(-0.5), 3, 2)))
    # swapping the kernels through the hyper-parameters swaps the coefficients
    _, c, _ = run(k_pos=3.0, lambda_pos=2.0, k_neg=2.0, lambda_neg=3.0)
    assert float(c[0, 0]) == pytest.approx(-V.phi(math.exp(0.5), 3, 2) / 4)
    assert float(c[1, 0]) == pytest.approx(2 * V.phi(math.exp(-0.5), 2, 3) / 4)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_on_policy_gradient_equals_reinforce(mode):
    lp = torch.tensor([[-1.0, -2.0, -0.3], [-0.5, -1.5, -4.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[0.7], [-1.3]], dtype=torch.float64).expand(2, 3)
    _, c_vespo, m = run(lp, lp.clone(), adv, mask, mode)  # W = 1, phi(1) = 1 for both kernels
    a = lp.clone().requires_grad_(True)
    (c_reinforce,) = torch.autograd.grad(estimators.get("reinforce")(a, lp, adv, mask, loss_agg_mode=mode)[0], a)
    assert torch.equal(c_vespo, c_reinforce)
    assert float(m["phi_min"]) == float(m["phi_max"]) == 1.0


def test_extreme_log_ratios_are_clamped_and_finite():
    lp = torch.tensor([[-1e4, -0.1], [0.0, -3e3], [-1.0, -1.0], [-0.5, -0.5]], requires_grad=True)
    old = torch.tensor([[0.0, -1e4], [-1e4, 0.0], [-30.0, -1.0], [-0.5 + 19.0, -0.5]])
    loss, m = estimators.get("vespo")(lp, old, torch.ones(4, 2), torch.ones(4, 2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all() and all(torch.isfinite(v) for v in m.values())
    # row 0: delta = (-20, +20) after the token clamp, L = 0: W = 1, phi = 1 (the clamp is per token first)
    # row 1: delta = (+20, -20): L = 0 too. row 2: delta_0 = 29 -> 20, L = 20: W = e^20, phi underflows to 0
    # row 3: L = -19 < log 1e-8: log W is floored at -18.42 inside the log, phi = e^{3 + 2 (-18.42) - 3 e^-19}
    g = -lp.grad * 8  # token-mean over 8 tokens, A = 1: d loss / d log pi = -phi / 8
    assert g[0].tolist() == pytest.approx([1.0, 1.0]) and g[1].tolist() == pytest.approx([1.0, 1.0])
    assert g[2].tolist() == [0.0, 0.0]
    assert float(g[3, 0]) == pytest.approx(math.exp(3 + 2 * math.log(1e-8) - 3 * math.exp(-19.0)), rel=1e-4)
    assert float(m["log_seq_weight_mean"]) == pytest.approx((0 + 0 + 20 - 19) / 4)


def test_a_nan_log_prob_is_never_dropped_silently():
    """The reference code turns a NaN phi into 0 and trains on; the lab's estimator contract refuses a NaN at a real
    position outside transforms, and under vmap (values unreadable) carries it into the loss and the gradient."""
    old = OLD.clone()
    old[1, 0] = float("nan")
    with pytest.raises(LabError, match="old_log_prob holds NaN"):
        run(old=old)
    fn = estimators.get("vespo")
    grads = torch.func.vmap(torch.func.grad(lambda lp, o: fn(lp, o, ADV, MASK)[0]))(LOGP[None], old[None])
    assert torch.isnan(grads).all()


def test_sampler_mismatch_is_folded_in_per_token():
    # three policies: pi (LOGP), pi_old (OLD), the sampler (ROLL); per-token log(pi_old / pi_sampler):
    roll = OLD - torch.tensor([[0.2, -0.1], [0.3, 0.3]], dtype=torch.float64)
    _, c, m = run(rollout_log_probs=roll)
    # W = pi/pi_sampler: row 0 L = 0.5 + (0.2 - 0.1) = 0.6; row 1 L = -0.5 + 0.6 = 0.1
    phi0, phi1 = V.phi(math.exp(0.6), 2, 3), V.phi(math.exp(0.1), 3, 2)
    assert float(c[0, 0]) == pytest.approx(-phi0 / 4) and float(c[1, 0]) == pytest.approx(2 * phi1 / 4)
    assert float(m["seq_log_tis_mean"]) == pytest.approx((0.1 + 0.6) / 2)
    # the same as treating the sampler as the behaviour policy directly (no clamp active)
    _, c_direct, _ = run(old=roll)
    assert torch.allclose(c, c_direct)
    # NOT the power-T bug: a sequence-level correction s broadcast to every token and summed gives T s
    # (row 0: 2 * 0.1 = 0.2, W = e^0.7 instead of e^0.6)
    buggy_phi0 = V.phi(math.exp(0.5 + 2 * 0.1), 2, 3)
    assert abs(float(c[0, 0]) + buggy_phi0 / 4) > 1e-3
    # per-token clamp of log(pi_old/pi_sampler) to [log 1e-8, 20], as the reference's log(max(w, 1e-8))
    _, _, m2 = run(rollout_log_probs=OLD + torch.tensor([[30.0, 0.0], [0.0, 0.0]], dtype=torch.float64))
    assert float(m2["seq_log_tis_mean"]) == pytest.approx(math.log(1e-8) / 2)


def test_long_sequences_do_not_raise_the_correction_to_the_power_T():
    # T = 50 tokens each with log(pi_old/pi_sampler) = 0.01: the sequence correction is e^0.5, not e^{50 * 0.5}
    T = 50
    lp = torch.full((1, T), -1.0, dtype=torch.float64)
    roll = lp - 0.01
    _, c, m = run(lp, lp.clone(), torch.ones(1, T, dtype=torch.float64), torch.ones(1, T, dtype=torch.float64),
                  rollout_log_probs=roll)
    assert float(m["seq_log_tis_mean"]) == pytest.approx(0.5)
    assert float(-c[0, 0] * T) == pytest.approx(V.phi(math.exp(0.5), 2, 3))  # 0.9405, not phi(e^25) = 0
