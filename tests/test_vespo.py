"""VESPO against values computed by hand from the paper (Shen et al., arXiv 2602.10693) and the authors' code
(github.com/FloyedShen/VESPO), Proposition 3.1 checked exactly by enumeration, and what the vespo_bound report says."""
import json
import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.optimize import minimize_scalar

import toy_envs
from lab import estimators
from lab.engine.exact import exact_support
from lab.errors import LabError
from lab.estimators import vespo as V
from lab.policies import init_params, make_policy, sample, token_log_probs
from lab.reports import style
from lab.reports import vespo_bound as report
from lab.runs import write_json
from lab.studies import variance
from lab.studies import vespo_bound as vb

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


# ---- Proposition 3.1, exact ------------------------------------------------------------------------------------

def test_bound_terms_by_hand_and_tightness():
    # mu puts all its mass on W = (k-1)/lambda = 1/3 for (2, 3): phi(1/3) = K/3, so E[phi^2] = Z K C exactly
    L = torch.tensor([math.log(1 / 3)], dtype=torch.float64)
    t = vb.bound_terms(L, torch.ones(1, dtype=torch.float64), 2.0, 3.0)
    assert t["ratio"] == pytest.approx(1.0, rel=1e-12) and t["C"] == pytest.approx(1 / 3)
    # two points W = 1, 2 with mu = 1/2 each, (2, 3): phi = 1 and 0.1991
    L = torch.log(torch.tensor([1.0, 2.0], dtype=torch.float64))
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    t = vb.bound_terms(L, w, 2.0, 3.0)
    p2 = 4 * math.exp(-3)
    assert t["Z"] == pytest.approx((1 + p2) / 2)
    assert t["phi2"] == pytest.approx((1 + p2**2) / 2)
    assert t["C"] == pytest.approx((1 + 2 * p2) / (1 + p2))
    assert t["bound"] == pytest.approx(math.e**2 / 3 * (1 + 2 * p2) / 2)  # K E_mu[phi W] = Z K C
    assert t["ratio"] == pytest.approx((1 + p2**2) / (math.e**2 / 3 * (1 + 2 * p2)))
    assert t["w2"] == pytest.approx(2.5)
    t = vb.bound_terms(L, w, 0.5, 1.0)  # k < 1: no bound
    assert t["K"] == math.inf and math.isnan(t["ratio"])


def _random_pairs():
    """(env, policy, theta_pi, theta_mu) over envs, policy sharpness and distances, plus sampler temperatures."""
    for env in (toy_envs.make("tiny_target", length=3), toy_envs.make("small_eos", length=3, n_prompts=2)):
        policy = make_policy("prefix", env)
        for i, scale in enumerate((0.5, 1.5, 3.0)):
            g = torch.Generator().manual_seed(100 + i)
            pi = init_params(policy, scale, g)
            z = torch.randn(pi.shape, generator=g, dtype=torch.float64)
            for s in (0.0, 0.3, 1.0, 3.0):
                yield env, policy, pi, pi + s * z
            for temp in (0.5, 2.0):
                yield env, policy, pi, pi / temp


def test_bound_never_violated_on_random_policies():
    kernels = [(2.0, 3.0), (3.0, 2.0), (1.0, 1.0), (1.0, 3.0), (1.5, 1.0), (4.0, 2.0), (2.0, 0.5), (8.0, 8.0)]
    ratios = {kern: [] for kern in kernels}
    for env, policy, pi, mu in _random_pairs():
        support = exact_support(env, policy, mu, toy_envs.DEFAULT_ENUM_LIMIT)
        L = vb.sequence_log_weights((policy, pi), (policy, mu), support)
        assert support.weights.sum() == pytest.approx(1.0)
        for k, lam in kernels:
            t = vb.bound_terms(L, support.weights, k, lam)
            assert t["phi2"] <= t["bound"] * (1 + vb.TOLERANCE), (env.name, k, lam, t)
            ratios[(k, lam)].append(t["ratio"])
    # on-policy (s = 0): W = 1, the ratio is phi(1)^2 / (K phi(1) 1) = 1/K exactly: tight for (3, 2), 3/e^2 for (2, 3)
    assert ratios[(3.0, 2.0)][0] == pytest.approx(1.0, rel=1e-12)
    assert ratios[(2.0, 3.0)][0] == pytest.approx(3 / math.e**2, rel=1e-12)
    # the check is not vacuous: ratios reach close to 1 and spread widely
    assert max(max(r) for r in ratios.values()) > 0.99 and min(min(r) for r in ratios.values()) < 0.1


def test_bound_study_along_staleness_knobs():
    cfg = vb.Config(lags=[0, 2, 8], kl_targets=[0.05, 1.0], temperatures=[0.5, 2.0], bound_seeds=[0],
                    trajectory_steps=8, kernels=[[2, 3], [3, 2], [1, 1], [0.5, 1]])
    bound = vb.bound_table(cfg)
    assert len(bound) == 7 * 4
    s = vb.bound_summary(bound)
    assert s["violations"] == 0 and s["settings_checked"] == 21 and s["settings_without_bound"] == 7
    assert s["max_bound_ratio"] == pytest.approx(1.0)  # (3, 2) at lag 0
    assert s["per_kernel"]["k=0.5, λ=1"]["max_ratio"] is None
    on = bound[(bound["staleness"] == 0) & (bound["staleness_kind"] == "lag")]
    assert np.allclose(on["Z"], 1.0) and np.allclose(on["C"], 1.0)
    assert np.allclose(bound.loc[bound["staleness_kind"] == "kl"].groupby("staleness")["kl_token"].first(),
                       [0.05, 1.0], rtol=1e-6)
    with pytest.raises(LabError, match="lag 16 exceeds"):
        vb.bound_table(vb.Config(lags=[16], trajectory_steps=8))
    with pytest.raises(LabError, match="lambda"):
        vb.bound_table(vb.Config(kernels=[[2, 0]]))


def test_sampled_phi_mean_estimates_the_exact_Z():
    # the estimator's phi on sampled batches against Z = E_mu[phi] by enumeration (4 standard errors, fixed seed)
    env = toy_envs.make("tiny_target")
    policy = make_policy("prefix", env)
    g = torch.Generator().manual_seed(7)
    pi = init_params(policy, 1.0, g)
    mu = pi + 0.8 * torch.randn(pi.shape, generator=g, dtype=torch.float64)
    support = exact_support(env, policy, mu, toy_envs.DEFAULT_ENUM_LIMIT)
    t = vb.bound_terms(vb.sequence_log_weights((policy, pi), (policy, mu), support), support.weights, 2.0, 3.0)
    n = 20000
    prompts = torch.randint(env.n_prompts, (n,), generator=g)
    tokens, mask, logp_mu = sample(policy, mu, env, prompts, g)
    logp_pi = token_log_probs(policy, pi, prompts, tokens) * mask
    ones = torch.ones_like(mask)
    coef = torch.autograd.grad(estimators.get("vespo")(logp_pi.requires_grad_(True), logp_mu, ones, mask,
                                                       loss_agg_mode="seq-mean-token-sum")[0], logp_pi)[0]
    phis = -coef[:, 0] * n  # d loss / d log pi = -phi / n
    se = float(phis.std()) / math.sqrt(n)
    assert abs(float(phis.mean()) - t["Z"]) < 4 * se
    assert abs(float((phis**2).mean()) - t["phi2"]) < 4 * float((phis**2).std()) / math.sqrt(n)


@pytest.mark.filterwarnings("ignore:Degrees of freedom:RuntimeWarning")  # the engine's NaN cosine intervals
def test_exact_directions_match_the_engine_and_vanish_on_policy():
    d = vb.exact_directions(vb.Config(lags=[0, 8], trajectory_steps=8))
    on = d[d["lag"] == 0]
    assert np.allclose(on["rel_bias"], 0.0, atol=1e-12) and np.allclose(on["cos"], 1.0)
    off = d[(d["lag"] == 8)].set_index("estimator")
    assert off.loc["seq_is", "rel_bias"] < 1e-12 and off.loc["vespo", "rel_bias"] > 1e-3
    results, _ = variance.run(variance.Config(values=[8], estimators=["vespo", "seq_is"], advantage="reward",
                                              replicates=2, n_boot=10, loss_agg_mode="token-mean", trajectory_steps=8),
                              progress=False)
    res = results.set_index(["estimator", "metric"])["value"]
    norm = math.sqrt(res["vespo", "mse"] / res["vespo", "rel_mse"])  # the study's target norm ‖c ∇J‖
    assert res["vespo", "exact_bias_norm"] / norm == pytest.approx(off.loc["vespo", "rel_bias"], rel=1e-6)


# ---- what the vespo_bound report says ---------------------------------------------------------------------------

def _per_kernel(k, lam, max_ratio, median_ratio):
    K = V.bound_constant(k, lam)
    finite = math.isfinite(K)
    return {"k": k, "lam": lam, "K": K, "peak_w": V.argmax_bound(k, lam) if finite else None,
            "on_policy_ratio": 1 / K if finite else None, "max_ratio": max_ratio if finite else None,
            "median_ratio": median_ratio if finite else None, "min_ratio": 0.3 if finite else None}


def _lag(kl, ess, verdict, vespo, seq_is, bias, cos, size):
    """One per_lag entry: VESPO's and sequence IS's [MSE, lo, hi], VESPO's exact bias / cosine / size."""
    return {"kl_token": kl, "ess_frac": ess, "verdict": verdict, "vespo_rel_mse": vespo, "seq_is_rel_mse": seq_is,
            "vespo_variance": [v / 2 for v in vespo], "seq_is_variance": [v / 2 for v in seq_is],
            "vespo_exact_bias": bias, "vespo_exact_cos": cos, "vespo_exact_size": size, "seq_is_exact_bias": 1e-16,
            "seq_is_exact_cos": 1.0, "seq_is_exact_size": 1.0, "ppo_clip_exact_bias": bias / 2,
            "ppo_clip_exact_cos": 0.9, "ppo_clip_exact_size": 0.5, "reinforce_exact_bias": 0.7,
            "reinforce_exact_cos": 1.0, "reinforce_exact_size": 0.3}


def report_summary(violations=0, last_mse=1.02, cos=0.999, size=0.0):
    """A vespo_bound summary with known numbers: lags 0, 8, 64; VESPO lower at 8, sequence IS lower at nothing."""
    return {
        "max_bound_ratio": 1.0, "max_bound_ratio_off_policy": 0.93, "violations": violations, "settings_checked": 357,
        "settings_without_bound": 51,
        "tightest": {"kernel": "k=3, λ=2", "staleness_kind": "lag", "staleness": 0.0, "seed": 0, "ratio": 1.0},
        "per_kernel": {"k=2, λ=3": _per_kernel(2.0, 3.0, 0.52, 0.47), "k=3, λ=2": _per_kernel(3.0, 2.0, 1.0, 0.86),
                       "k=1, λ=1": _per_kernel(1.0, 1.0, 0.37, 0.35), "k=0.5, λ=1": _per_kernel(0.5, 1.0, 0, 0)},
        "max_floor_mass": 0.0, "staleness_kinds": ["kl", "lag", "temperature"], "bound_seeds": 3,
        "vespo_lower_mse_at_lags": [8.0], "seq_is_lower_mse_at_lags": [], "max_lag": 64.0,
        "per_lag": {"0": _lag(0.0, 1.0, "equal", [1.0, 0.9, 1.1], [1.0, 0.9, 1.1], 0.0, 1.0, 1.0),
                    "8": _lag(0.05, 0.8, "VESPO lower", [0.5, 0.4, 0.6], [3.0, 2.0, 4.0], 0.4, cos, 0.6),
                    "64": _lag(1.15, 0.12, "unresolved", [last_mse, 0.98, 1.05], [74.0, 0.5, 300.0], 1.0, math.nan,
                               size)},
    }


def test_answer_states_the_verdict_the_kernels_and_the_comparison():
    text = report.answer(report_summary())
    assert "**No.** E_μ[φ(W)²] ≤ Z·K·C held in all 357 exact settings" in text
    assert "3 kernels with finite K × staleness knobs kl, lag, temperature × 3 random policies" in text
    assert "(k=3, λ=2, lag = 0); off-policy (KL(μ‖π) > 0) it is 0.9300" in text
    # computed from the kernels, not hard-coded: only (3, 2) peaks at w = 1; the table gives 1/K per kernel
    assert "For k=3, λ=2 the peak is at w = 1: the bound is an equality on-policy" in text
    assert f"| k=2, λ=3 | 2.463 | 0.333 | {3 / math.e**2:.3f} | 0.5200 | 0.470 |" in text
    assert "| k=1, λ=1 | 2.718 | → 0 | 0.368 |" in text and "| k=0.5, λ=1 | ∞ | – | – | no bound (k < 1) | – |" in text
    assert "VESPO lower at lags **8**; sequence IS lower at lags **none**; not resolved at lags 64" in text
    assert "(lag 0 is on-policy: both are REINFORCE)" in text
    assert "At lag 64 (KL(μ‖π) 1.1 nats/token, ESS 12%): VESPO 1.02 [0.98, 1.05] against sequence IS 74 [0.5, 300]" \
        in text
    assert "**The price is bias.** VESPO's exact expected gradient (advantage = R) misses ∇J by 0%, 40%, 100%" in text
    assert "**Mostly a shorter step, not a wrong direction**: where the bias exceeds 5% (lags 8, 64) cos(E g, ∇J) = " \
           "1.00, undefined and ‖E g‖ ÷ ‖∇J‖ = 0.6, 0." in text
    assert "A size of 0 means φ(W) underflows to 0" in text
    assert "**At lag 64 VESPO's MSE is close to 1, the MSE of a zero update**: its expected update is 0 of" in text
    assert report.headline(report_summary()) == ("Prop. 3.1 never violated (0 of 357 exact settings; max E[φ²]/(ZKC) = "
                                                 "1.000); lag 64: MSE÷‖∇J‖² VESPO 1.02 vs seq IS 74")


def test_answer_follows_the_numbers(tmp_path):
    base = report.answer(report_summary())
    # a violated bound is reported as violated, never as held
    bad = report.answer(report_summary(violations=3))
    assert "**Yes, 3 times.** E_μ[φ(W)²] exceeded Z·K·C in 3 of 357 exact settings" in bad and "held in all" not in bad
    assert report.headline(report_summary(violations=3)).startswith("Prop. 3.1 VIOLATED in 3 of 357 settings")
    # VESPO well below a zero update's MSE: no "close to 1" sentence; a bias that turns the direction is said so
    assert "close to 1" not in report.answer(report_summary(last_mse=0.4))
    turned = report.answer(report_summary(cos=0.5, size=0.2))
    assert "**Direction and step size**" in turned and "Mostly a shorter step" not in turned
    assert "A size of 0" not in turned and turned != base
    # summary.json stores NaN and inf as null: the text is the same from the file
    write_json(tmp_path / "summary.json", report_summary())
    assert report.answer(json.loads((tmp_path / "summary.json").read_text())) == base


def _wide_bound():
    """A bound table by hand: two kinds, three kernels (one without K), two seeds; ratios known."""
    rows = []
    for seed in (0, 1):
        for kind, values in (("lag", [0.0, 4.0]), ("temperature", [0.5, 2.0])):
            for i, v in enumerate(values):
                for k, lam in ((2.0, 3.0), (1.0, 1.0), (0.5, 1.0)):
                    K = V.bound_constant(k, lam)
                    ratio = 0.2 + 0.1 * i + 0.05 * seed + 0.3 * (k == 2.0) if math.isfinite(K) else math.nan
                    rows.append({"env": "tiny_target", "policy": "prefix", "seed": seed, "staleness_kind": kind,
                                 "staleness": v, "k": k, "lam": lam, "kernel": vb.kernel_label(k, lam), "Z": 1.0,
                                 "C": 1.0, "K": K, "phi2": 0.5 + i, "bound": 1.0 + 2 * i, "ratio": ratio,
                                 "w2": 1.0 + 10 * i, "floor_mass": 0.0, "kl_token": 0.1 * i, "chi2_seq": 10.0 * i})
    return pd.DataFrame(rows)


def test_bound_rows_undo_the_tidy_table():
    wide = _wide_bound()
    other = pd.DataFrame([{"env": "tiny_target", "policy": "prefix", "seed": 0, "staleness_kind": "lag",
                           "staleness": 0.0, "metric": "kl_token", "value": 0.0, "part": "variance", "estimator": "-",
                           "lo": 0.0, "hi": 0.0}])
    tidy = pd.concat([other, vb.tidy_bound(wide), other], ignore_index=True)
    assert vb.bound_rows(tidy).equals(wide)


def test_bound_figures_draw_the_table():
    wide = _wide_bound()
    fig = report.bound_figure(vb.tidy_bound(wide))
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["lag", "sampling temperature of μ"]
    assert "ratio ≤ 1 everywhere" in fig._suptitle.get_text()
    lines = [ln for ln in axes[0].get_lines() if not ln.get_label().startswith("_")]
    assert [ln.get_label() for ln in lines] == ["k=2, λ=3 (VESPO)", "k=1, λ=1"]  # k < 1 has no ratio: no line
    assert lines[0].get_color() == style.color("vespo")
    assert np.allclose(lines[0].get_ydata(), [0.525, 0.625]) and np.allclose(lines[1].get_ydata(), [0.225, 0.325])
    wide.loc[0, "ratio"] = 1.2  # one violation: the title says so and the axis shows it
    fig = report.bound_figure(vb.tidy_bound(wide))
    assert "violated" in fig._suptitle.get_text() and fig.axes[0].get_ylim()[1] >= 1.2
    fig = report.second_moment_figure(vb.tidy_bound(wide), "temperature")
    by_label = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    assert np.allclose(by_label["sequence IS: E_μ[W²] = 1 + χ²"].get_ydata(), [1.0, 11.0])
    assert np.allclose(by_label["VESPO E_μ[φ²], k=2, λ=3"].get_ydata(), [0.5, 1.5])
    assert by_label["sequence IS: E_μ[W²] = 1 + χ²"].get_color() == style.color("seq_is")
    fig = report.kernel_figure()
    k_line = [ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("K·W, K = 2.46")][0]
    x, y = k_line.get_xdata(), k_line.get_ydata()
    assert np.allclose(y / x, V.bound_constant(2, 3))


def test_comparison_figure_and_table_show_the_summary():
    fig = report.comparison_figure(report_summary())
    assert len(fig.axes) == 4
    mse = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    assert np.allclose(mse["VESPO"].get_ydata(), [1.0, 0.5, 1.02]) and mse["VESPO"].get_color() == style.color("vespo")
    assert np.allclose(mse["sequence IS"].get_ydata(), [1.0, 3.0, 74.0])
    assert mse["sequence IS"].get_color() == style.color("seq_is")
    bias = {ln.get_label(): ln for ln in fig.axes[2].get_lines()}
    assert set(bias) == {"seq_is", "vespo", "ppo_clip", "reinforce"}
    assert np.allclose(bias["vespo"].get_ydata(), [0.0, 0.4, 1.0]) and bias["ppo_clip"].get_color() == style.color(
        "ppo_clip")
    direction = {ln.get_label(): ln.get_ydata() for ln in fig.axes[3].get_lines()}
    assert np.allclose(direction["vespo: ‖E g‖ ÷ ‖∇J‖"], [1.0, 0.6, 0.0])
    shown = report.comparison_table(report_summary()).data
    assert shown["VESPO MSE"].tolist() == ["1 [0.9, 1.1]", "0.5 [0.4, 0.6]", "1.02 [0.98, 1.05]"]
    assert shown["verdict"].tolist() == ["equal", "VESPO lower", "unresolved"]
    assert shown["VESPO exact bias"].tolist() == ["0%", "40%", "100%"]
