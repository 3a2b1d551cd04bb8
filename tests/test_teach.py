"""The teaching cores against independent computations (enumeration, finite differences, the lab's estimators), the
exercise checkers (right answers accepted, plausible wrong ones refused) and the live controls."""
from __future__ import annotations

import base64
import math
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from lab import estimators
from lab.errors import LabError
from lab.estimators import vespo
from lab.teach import (clip_mask, exercises, gvpo_zero_sum, hashrng, sampler_truncation, tokens, vespo_kernel,
                       vopd_baseline, weight_explosion)

ROOT = Path(__file__).resolve().parent.parent
LESSON_MODULES = (weight_explosion, clip_mask, vespo_kernel, gvpo_zero_sum, vopd_baseline, sampler_truncation)


# ---- shared pieces ---------------------------------------------------------------------------------------------

def _lowbias32(x: int) -> int:  # plain-int reference of the hash, independent of the numpy code
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_hashrng_matches_a_plain_integer_reference_and_is_uniform():
    for seed in (0, 1, 12345, 2**32 - 1):
        u = hashrng.uniforms(seed, 5, offset=7)
        key = _lowbias32(seed)
        ref = [(_lowbias32((key + 7 + i) & 0xFFFFFFFF) + 0.5) / 2**32 for i in range(5)]
        assert u.tolist() == ref
    u = hashrng.uniforms(3, 200_000)
    assert 0 < u.min() and u.max() < 1 and abs(u.mean() - 0.5) < 0.003 and abs(u.var() - 1 / 12) < 0.002
    z = hashrng.normals(4, 200_000)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01 and abs(np.mean(z**3)) < 0.03
    assert not np.array_equal(hashrng.normals(0, 10), hashrng.normals(1, 10))


@pytest.mark.parametrize("vocab", [2, 5, 64])
def test_stale_pair_reaches_the_kl_target(vocab):
    targets = np.array([0.0, 1e-4, 0.01, 0.1, 0.5])
    log_pi, log_mu = tokens.stale_pair(vocab, targets, seed=1)
    assert np.allclose(tokens.achieved_kl(log_pi, log_mu), targets, atol=1e-10)
    assert np.allclose(np.exp(log_mu).sum(-1), 1)
    sup = tokens.achieved_kl(*tokens.stale_pair(vocab, 1e6, seed=1))  # beyond the supremum: the closest approach
    assert np.isfinite(sup) and sup < 1e6
    with pytest.raises(LabError):
        tokens.stale_pair(vocab, -0.1)
    with pytest.raises(LabError):
        tokens.stale_pair(1, 0.1)


# ---- weight explosion -----------------------------------------------------------------------------------------

def test_sequence_moments_match_enumeration():
    log_pi, log_mu = tokens.stale_pair(3, 0.2, seed=2)
    tok = weight_explosion.token_stats(log_pi, log_mu)
    for T in (1, 3, 6):
        log_mu_seq, log_w = vespo_kernel.enumerate_log_weights(log_pi, log_mu, T)
        mu = np.exp(log_mu_seq)
        exact = weight_explosion.sequence_stats(tok["chi2"], tok["kl_mu_pi"], tok["var_log_rho"], T)
        assert np.isclose((mu * np.exp(2 * log_w)).sum() - 1, exact["chi2_seq"], rtol=1e-10)
        assert np.isclose(-(mu * log_w).sum(), exact["kl_seq"], rtol=1e-10)
        var = (mu * log_w**2).sum() - (mu * log_w).sum() ** 2
        assert np.isclose(var, exact["var_log_w"], rtol=1e-9)
        assert np.isclose(1 / (mu * np.exp(2 * log_w)).sum(), exact["ess_frac"], rtol=1e-10)


@pytest.mark.parametrize("chi2,fraction", [(0.02, 0.1), (0.05, 0.01), (0.3, 0.5), (0.01, 1.01 ** -50)])
def test_length_for_ess_is_the_first_length_below(chi2, fraction):
    T = weight_explosion.length_for_ess(chi2, fraction)
    assert weight_explosion.ess_fraction(chi2, T) <= fraction * (1 + 1e-9)
    assert weight_explosion.ess_fraction(chi2, T - 1) > fraction * (1 + 1e-9)


def test_batch_ess_is_optimistic_for_long_responses_and_k_hat_warns():
    table = weight_explosion.curves([0.05], [4, 512], vocab=16, batch=128, replicates=4)
    cell = table.set_index(["length", "metric"])["value"]
    assert 0.5 < cell[(4, "batch_ess_frac")] / cell[(4, "ess_frac")] < 2  # short: the batch is about right
    assert cell[(512, "batch_ess_frac")] > 1e6 * cell[(512, "ess_frac")]  # long: far too optimistic
    assert cell[(512, "batch_khat")] > 0.7 > cell[(4, "batch_khat")]


# ---- clipping and masking -------------------------------------------------------------------------------------

def test_coefficients_follow_the_published_rules():
    """The registry's coefficients, read through clip_mask.coefficient, against the papers' rules written out here."""
    rho = np.exp(np.linspace(-3, 3, 61))
    for sign in (1.0, -1.0):
        adv = np.full_like(rho, sign)
        s = 1 / (1 + np.exp(-(1.0 if sign > 0 else 1.05) * (rho - 1)))
        rules = {"token_is": rho,
                 "ppo_clip": np.where((rho < 1.2) if sign > 0 else (rho > 0.8), rho, 0.0),
                 "tis_token": np.minimum(rho, 2.0),
                 "mis_token": np.where((rho >= 0.5) & (rho <= 5.0), rho, 0.0),
                 "cispo": np.clip(rho, 0.0, 5.0),
                 "sapo": 4 * s * (1 - s) * rho}
        for name, want in rules.items():
            assert np.allclose(clip_mask.coefficient(name, rho, adv), want), (name, sign)
    assert clip_mask.coefficient("ppo_clip", [1.5], [1.0], clip_ratio_high=0.6)[0] == 1.5  # overrides pass through


def test_expected_updates_against_the_exact_gradient():
    log_pi, log_mu, adv = clip_mask.setting(16, np.array([0.0, 0.3]), seed=4)
    pi = np.exp(log_pi)
    truth = pi * adv - pi * (pi * adv).sum()  # E_pi[A (e_y - pi)]
    ratio = clip_mask.ratios(log_pi, log_mu)
    assert np.allclose(clip_mask.expected_gradient(log_pi, log_mu, adv, ratio), truth)
    table = clip_mask.compare(16, [0.0, 0.3], seed=4).pivot_table(index=["method", "kl_target"], columns="metric",
                                                                  values="value")
    assert np.allclose(table.loc["token_is"][["cos", "norm_ratio"]], 1)
    assert np.allclose(table.loc["token_is"]["rel_bias"], 0)
    on_policy = table.xs(0.0, level="kl_target")
    assert np.allclose(on_policy["cos"], 1) and np.allclose(on_policy["mass_lost"], 0, atol=1e-12)
    stale = table.xs(0.3, level="kl_target")
    assert stale.loc["ppo_clip", "zeroed"] > 0.05 and stale.loc["ppo_clip", "cos"] < 0.99
    # PPO's dropped mass, recomputed by hand from its clip rule
    rho, mu = ratio[1], np.exp(log_mu[1])
    dropped = np.where(adv >= 0, rho >= 1.2, rho <= 0.8)
    assert np.isclose(stale.loc["ppo_clip", "zeroed"], mu[dropped].sum())
    lost = stale.loc["ppo_clip"]
    assert np.isclose(lost["rel_bias"] ** 2, lost["lost_along"] ** 2 + lost["lost_across"] ** 2)


# ---- VESPO ------------------------------------------------------------------------------------------------------

def test_proposal_summaries_against_plain_sums():
    log_mu_seq, log_w = vespo_kernel.setting(3, 4, 0.2, seed=1)
    mu, W = np.exp(log_mu_seq), np.exp(log_w)
    for k, lam in ((2.0, 3.0), (3.0, 2.0), (1.0, 1.0)):
        phi = vespo.phi(W, k, lam)
        s = vespo_kernel.proposal(log_mu_seq, log_w, k, lam)
        Z = (mu * phi).sum()
        q = mu * phi / Z
        assert np.isclose(s["Z"], Z) and np.isclose(s["C"], (q * W).sum())
        assert np.isclose(s["phi2"], (mu * phi**2).sum())
        assert np.isclose(s["kl_q_mu"], (q * np.log(q / mu)).sum()) and np.isclose(s["mean_logw_q"], (q * log_w).sum())
        assert s["phi2"] <= s["bound"] * (1 + 1e-12) and np.isclose(s["ratio"], s["phi2"] / s["bound"])
        h = vespo_kernel.histograms(log_mu_seq, log_w, k, lam, np.linspace(-3, 3, 13))
        assert all(np.isclose(v.sum(), 1) for v in h.values())


def test_proposition_holds_over_a_grid_and_is_tight_on_policy_for_3_2():
    table = vespo_kernel.bound_table([(2, 3), (3, 2), (1, 1), (1.5, 0.5), (4, 1), (0.5, 1)], [0.0, 0.05, 0.3],
                                     [1, 3], vocab=3, seeds=(0, 1))
    finite = table[np.isfinite(table["K"])]
    assert (finite["ratio"] <= 1 + 1e-12).all() and (table.loc[~np.isfinite(table["K"]), "ratio"] == 0).all()
    on = table[table.kl_target == 0.0].set_index(["k", "lam"])["ratio"]
    assert np.allclose(on.loc[(3.0, 2.0)], 1) and np.allclose(on.loc[(2.0, 3.0)], 1 / vespo.bound_constant(2, 3))
    far = vespo_kernel.proposal(*vespo_kernel.setting(4, 6, 0.3, seed=0, sharpness=1.0), 3.0, 2.0)
    assert 0.2 < far["position"] < 0.8 and far["ess_vespo"] > far["ess_is"]  # between mu and pi; a larger ESS
    near = vespo_kernel.proposal(*vespo_kernel.setting(4, 2, 0.02, seed=0, sharpness=1.0), 2.0, 3.0)
    assert near["position"] < 0  # near on-policy (2, 3) sits beyond mu


def test_enumeration_limit():
    log_pi, log_mu = tokens.stale_pair(8, 0.1)
    with pytest.raises(LabError, match="cannot enumerate"):
        vespo_kernel.enumerate_log_weights(log_pi, log_mu, 7)


# ---- GVPO -------------------------------------------------------------------------------------------------------

def test_weights_are_the_labs_and_sum_to_zero_under_any_shift():
    rng = np.random.default_rng(1)
    r, ell = rng.normal(size=5), rng.normal(size=5)
    w = gvpo_zero_sum.group_weights(r, ell, 0.3)
    assert np.allclose(w, gvpo_zero_sum.lab_group_weights(r, ell, 0.3)) and abs(w.sum()) < 1e-12
    for c in (-7.0, 0.3, 1e3):
        assert np.allclose(gvpo_zero_sum.lab_group_weights(r + c, ell, 0.3), w)
        assert np.allclose(gvpo_zero_sum.lab_group_weights(r, ell + c, 0.3), w)


def test_expected_group_loss_is_half_the_variance_with_the_labs_loss():
    """E over all ordered pairs (k = 2) drawn from mu of the lab's gvpo loss equals 1/2 Var_mu(beta l - R)."""
    log_ref, reward = gvpo_zero_sum.problem(4, seed=3)
    theta = log_ref + np.random.default_rng(0).normal(size=4)
    mu = np.array([0.1, 0.2, 0.3, 0.4])
    beta = 0.7
    i, j = np.meshgrid(np.arange(4), np.arange(4), indexing="ij")
    y = torch.as_tensor(np.stack([i.ravel(), j.ravel()], 1).ravel())
    lp = torch.log_softmax(torch.as_tensor(theta), -1)[y][:, None]
    ones = torch.ones_like(lp)
    fn = estimators.get("gvpo")
    per_group = torch.stack([fn(lp[2 * g:2 * g + 2], torch.as_tensor(log_ref)[y][2 * g:2 * g + 2, None],
                                torch.zeros_like(ones[:2]), ones[:2], beta=beta,
                                rewards=torch.as_tensor(reward)[y][2 * g:2 * g + 2], group_size=2)[0]
                             for g in range(16)]).numpy()
    expected = (np.outer(mu, mu).ravel() * per_group).sum()
    loss, grad = gvpo_zero_sum.loss_gradient(theta, log_ref, reward, mu, beta)
    assert np.isclose(expected, loss)
    eps = 1e-6
    numeric = [(gvpo_zero_sum.loss_gradient(theta + eps * e, log_ref, reward, mu, beta)[0]
                - gvpo_zero_sum.loss_gradient(theta - eps * e, log_ref, reward, mu, beta)[0]) / (2 * eps)
               for e in np.eye(4)]
    assert np.allclose(numeric, grad, atol=1e-8)
    numeric = [(gvpo_zero_sum.loss_gradient(theta + eps * e, log_ref, reward, mu, beta, False)[0]
                - gvpo_zero_sum.loss_gradient(theta - eps * e, log_ref, reward, mu, beta, False)[0]) / (2 * eps)
               for e in np.eye(4)]
    assert np.allclose(numeric, gvpo_zero_sum.loss_gradient(theta, log_ref, reward, mu, beta, False)[1], atol=1e-8)


def test_training_reaches_the_optimum_only_from_covering_samplers():
    log_ref, reward = gvpo_zero_sum.problem()
    out = gvpo_zero_sum.train_expected(log_ref, reward, 0.5, gvpo_zero_sum.SAMPLERS, steps=400)
    final = dict(zip(gvpo_zero_sum.SAMPLERS, out["tv"][-1]))
    assert max(final[s] for s in ("on-policy", "reference", "uniform", "low-reward")) < 1e-3
    assert final["partial"] > 0.05
    naive = dict(zip(gvpo_zero_sum.SAMPLERS,
                     gvpo_zero_sum.train_expected(log_ref, reward, 0.5, gvpo_zero_sum.SAMPLERS, 400,
                                                  centred=False)["tv"][-1]))
    assert naive["on-policy"] < 1e-3 and min(naive["uniform"], naive["low-reward"]) > 0.05
    sampled = gvpo_zero_sum.train_sampled(log_ref, reward, 0.5, "uniform", steps=100)
    assert sampled[-1] < 0.01 < sampled[0]


# ---- vOPD -------------------------------------------------------------------------------------------------------

def test_variance_formula_against_enumeration():
    log_p, log_q = vopd_baseline.random_pairs(5, 3, seed=2)
    m = vopd_baseline.state_moments(log_p, log_q)
    for d in range(3):
        p, r = np.exp(log_p[d]), log_q[d] - log_p[d]
        score = np.eye(5) - p  # row y: e_y - p

        def var(b):
            g = (r - b)[:, None] * score
            mean = p @ g
            return float(p @ ((g - mean) ** 2).sum(1)), mean

        v0, mean0 = var(0.0)
        vv, meanv = var(m["value"][d])
        assert np.isclose(v0, m["var_opd"][d]) and np.isclose(vv, m["var_vopd"][d]) and np.allclose(mean0, meanv)
        grid = np.linspace(-5, 5, 20001)
        assert abs(grid[np.argmin(vopd_baseline.variance_curve(log_p[d], log_q[d], grid))] - m["b_star"][d]) < 1e-3
        assert m["helps"][d] == (min(0, 2 * m["b_star"][d]) < m["value"][d] < max(0, 2 * m["b_star"][d]))


@pytest.mark.slow
def test_sampled_with_the_labs_estimators_matches_the_formula():
    log_p, log_q = vopd_baseline.random_pairs(4, 1, seed=5)
    m = {k: float(v[0]) for k, v in vopd_baseline.state_moments(log_p, log_q).items()}
    mc = vopd_baseline.sampled_variances(log_p[0], log_q[0], samples=3000, seed=1, n_boot=300)
    for name, key in (("opd", "var_opd"), ("vopd", "var_vopd")):
        v, lo, hi = mc[name]["variance"]
        assert lo < m[key] < hi and mc[name]["mean_error"] < 0.1


def test_small_vocabularies_are_where_the_baseline_hurts():
    t = vopd_baseline.helps_table([3, 64], draws=300).set_index("vocab")
    assert t.loc[3, "helps_hi"] < 0.5 < t.loc[64, "helps_lo"]  # most random teachers: worse at V = 3, better at 64
    assert t.loc[3, "ratio_median"] > 1 > t.loc[64, "ratio_median"]


# ---- sampler truncation -------------------------------------------------------------------------------------------

def _no_truncation(vocab=32, seed=2, kl=0.0, temperature=1.0) -> dict:
    """The same state sampled without any truncation, built here from the plain softmax."""
    z, z_sampler = sampler_truncation.sampler_logits(vocab, seed, 2.0, kl)
    return {"log_pi": tokens.log_softmax(z), "log_mu": tokens.log_softmax(z_sampler / temperature),
            "kept": np.ones(vocab, dtype=bool), "log_m": 0.0,
            "reward": hashrng.normals(clip_mask.REWARD_STREAM + seed, vocab)}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("kl,temperature", [(0.0, 1.0), (0.2, 1.4)])
def test_settings_that_cut_nothing_equal_no_truncation(kl, temperature):
    plain = _no_truncation(kl=kl, temperature=temperature)
    want = sampler_truncation.measures(plain)
    for kind, level in (("top_p", 1.0), ("top_k", 32), ("min_p", 0.0)):
        s = sampler_truncation.setting(kind, level, 32, 2, 2.0, kl, temperature)
        assert s["kept"].all() and s["log_m"] == 0.0
        assert np.array_equal(s["log_mu"], torch.log_softmax(torch.as_tensor(plain["log_mu"]), -1).numpy())
        assert np.allclose(s["log_mu"], plain["log_mu"], rtol=0, atol=1e-15)
        got = sampler_truncation.measures(s)
        assert _flat(got) == pytest.approx(_flat(want), rel=1e-12, abs=1e-14), kind
    assert want["gap"] == 0 and want["kept_mass"] == 1
    for name in sampler_truncation.METHODS:  # no kept set: replay changes nothing
        assert want["bias"][name]["plain"] == pytest.approx(want["bias"][name]["replay"], abs=1e-15)
    if kl == 0 and temperature == 1:  # on-policy and untruncated: every correction is exact
        assert max(b for m in want["bias"].values() for r in m.values() for b in r.values()) < 1e-14


@pytest.mark.parametrize("kind,level", [("top_p", 0.8), ("top_p", 0.5), ("top_k", 3), ("min_p", 0.1)])
@pytest.mark.parametrize("kl,temperature", [(0.0, 1.0), (0.1, 0.7), (0.3, 1.6)])
def test_mean_ratio_is_the_kept_mass(kind, level, kl, temperature):
    s = sampler_truncation.setting(kind, level, 48, 1, 2.0, kl, temperature)
    m = sampler_truncation.measures(s)
    pi, kept = np.exp(s["log_pi"]), s["kept"]
    assert np.isclose(m["kept_mass"], pi[kept].sum(), rtol=1e-12) and m["kept_mass"] < 1
    assert np.isclose(m["mean_ratio"], m["kept_mass"], rtol=1e-12)
    assert np.isclose(m["mean_ratio_replay"], 1.0, rtol=1e-12)  # pi_S sums to one over S
    if kl == 0 and temperature == 1:  # every sampled token has ratio exactly m (and 1 with replay)
        table = sampler_truncation.token_table(kind, level, 48, 1)
        assert np.allclose(table.loc[table.kept, "ratio"], m["kept_mass"], rtol=1e-12)
        assert np.allclose(table.loc[table.kept, "ratio_replay"], 1.0, rtol=1e-12)
        assert np.isclose(m["share_out"], float(m["kept_mass"] < 0.9)) and m["share_out_replay"] == 0


def test_sampled_mean_ratio_agrees_with_the_kept_mass():
    """Monte Carlo under the sampler: the batch's mean ratio lies within 4 standard errors of m (fixed seeds)."""
    for seed, (kl, temperature) in enumerate(((0.2, 1.5), (0.05, 0.6), (0.4, 1.0))):
        s = sampler_truncation.setting("top_p", 0.7, 64, seed, 2.0, kl, temperature)
        m = sampler_truncation.measures(s)["kept_mass"]
        mean, se = sampler_truncation.sampled_mean_ratio(s, 20_000, seed)
        assert se > 0 and abs(mean - m) < 4 * se
        mean, se = sampler_truncation.sampled_mean_ratio(s, 20_000, seed, replay=True)
        assert abs(mean - 1) < 4 * se


def _expected_update(s, name, replay):
    """E_mu[c A grad_z log p(y)] written out token by token with autograd (p = pi, or pi_S with replay)."""
    z = torch.as_tensor(s["log_pi"], dtype=torch.float64)
    kept = torch.as_tensor(s["kept"])
    mu = np.where(s["kept"], np.exp(s["log_mu"]), 0.0)
    adv = s["reward"] - mu @ s["reward"]
    total = np.zeros(len(mu))
    for y in np.flatnonzero(s["kept"]):
        zz = z.clone().requires_grad_(True)
        logits = zz.masked_fill(~kept, -math.inf) if replay else zz
        log_p = torch.log_softmax(logits, -1)[y]
        ratio = math.exp(float(log_p.detach()) - s["log_mu"][y])
        coef = clip_mask.coefficient(name, [ratio], [adv[y]])[0]
        (g,) = torch.autograd.grad(log_p, zz)
        total += mu[y] * coef * adv[y] * g.numpy()
    return total


@pytest.mark.parametrize("kind,level,kl,temperature", [("top_p", 0.8, 0.0, 1.0), ("top_p", 0.6, 0.2, 1.3),
                                                       ("top_k", 4, 0.1, 0.8), ("min_p", 0.1, 0.0, 1.0)])
def test_biases_against_autograd_and_replayed_is_exact_for_the_deployed_policy(kind, level, kl, temperature):
    s = sampler_truncation.setting(kind, level, 24, 3, 2.0, kl, temperature)
    m = sampler_truncation.measures(s)
    z = torch.tensor(s["log_pi"], dtype=torch.float64, requires_grad=True)
    reward = torch.as_tensor(s["reward"])
    full = torch.autograd.grad((torch.softmax(z, -1) * reward).sum(), z)[0].numpy()
    kept = torch.as_tensor(s["kept"])
    deployed = torch.autograd.grad((torch.softmax(z.masked_fill(~kept, -math.inf), -1) * reward).sum(), z)[0].numpy()
    unit = np.linalg.norm(full)
    assert np.isclose(m["gap"], np.linalg.norm(deployed - full) / unit, rtol=1e-10) and m["gap"] > 0.01
    for name in sampler_truncation.METHODS:
        for replay, key in ((False, "plain"), (True, "replay")):
            g = _expected_update(s, name, replay)
            for truth, t in (("full", full), ("deployed", deployed)):
                assert np.isclose(m["bias"][name][key][truth], np.linalg.norm(g - t) / unit, rtol=1e-8, atol=1e-13)
    replayed_is = _expected_update(s, "token_is", True)
    assert np.allclose(replayed_is, deployed, rtol=0, atol=1e-14)  # replay: IS is the deployed gradient
    assert m["bias"]["token_is"]["replay"]["deployed"] < 1e-13
    assert m["bias"]["token_is"]["plain"]["deployed"] > 0.01  # without replay it is not
    assert np.isclose(m["bias"]["token_is"]["replay"]["full"], m["gap"], rtol=1e-10)


@pytest.mark.slow  # imports the study (about a second)
def test_truncation_band_is_the_studys():
    from lab.studies.sampling_truncation.study import BAND

    assert sampler_truncation.BAND == BAND


def test_truncation_kept_sets_are_the_labs():
    from lab.policies.truncation import kept_set

    z, _ = sampler_truncation.sampler_logits(40, 4)
    for kind, kw in (("top_p", {"top_p": 0.7}), ("top_k", {"top_k": 5}), ("min_p", {"min_p": 0.2})):
        s = sampler_truncation.setting(kind, list(kw.values())[0], 40, 4, temperature=0.8)
        assert np.array_equal(s["kept"], kept_set(torch.as_tensor(z / 0.8), **kw).numpy())
    p = np.sort(np.exp(tokens.log_softmax(z / 0.8)))[::-1]  # top-p: the smallest top set holding at least p
    n = int(sampler_truncation.measures(sampler_truncation.setting("top_p", 0.7, 40, 4, temperature=0.8))["kept_count"])
    assert p[:n].sum() >= 0.7 > p[:n - 1].sum()
    with pytest.raises(LabError, match="top_k"):
        sampler_truncation.setting("top_k", 50, 40)
    with pytest.raises(LabError, match="kind"):
        sampler_truncation.setting("top_q", 0.5, 40)
    with pytest.raises(LabError, match="temperature"):
        sampler_truncation.setting("top_p", 0.5, 40, temperature=0.0)
    with pytest.raises(LabError, match="top_p"):
        sampler_truncation.setting("top_p", 0.0, 40)


def test_truncation_report_refuses_a_top_k_beyond_the_vocabulary():
    from lab import reports
    from lab.reports.params import resolve

    spec = reports.catalog()["teach_sampler_truncation"]
    with pytest.raises(LabError, match="top_k 100 exceeds the vocabulary size 64"):
        resolve(spec, {"kind": "top_k", "top_k": 100})
    cfg, _ = resolve(spec, {"kind": "top_p", "top_k": 100})  # top_k is not used by a top-p look
    assert cfg.top_k == 100


def test_the_sweep_grows_the_gap_and_the_flagged_share():
    t = sampler_truncation.sweep("top_p", [1.0, 0.95, 0.8, 0.5], 64)
    cell = t[t.method == "-"].set_index(["level", "replay", "metric"])["value"]
    gaps = [cell[(p, False, "gap")] for p in (1.0, 0.95, 0.8, 0.5)]
    assert gaps[0] == 0 and all(a < b for a, b in zip(gaps, gaps[1:]))
    assert cell[(1.0, False, "share_out")] == 0 and np.isclose(cell[(0.5, False, "share_out")], 1)
    assert all(cell[(p, True, "share_out")] == 0 for p in (1.0, 0.95, 0.8, 0.5))
    tis = t[(t.method == "tis_token")].value.to_numpy()  # ratios m <= 1: TIS's cap never acts
    assert np.array_equal(tis, t[(t.method == "token_is")].value.to_numpy())


# ---- exercises --------------------------------------------------------------------------------------------------

WRONG = {  # plausible mistakes the checker must refuse
    "ess_at_length": [math.exp(-5), 1 / (1 + 100 * 0.05), 0.05, 1.05 ** 100],
    "length_for_10pct": [116, 115, 118, 0.1],
    "var_log_w_doubling": [4, math.e**2, 1],
    "trust_the_batch": ["a", "c", "the batch ESS"],
    "ppo_positive": [1.2, 1.5, 1],
    "ppo_negative": [0, 1.2, 0.8],
    "cispo_cap": [0, 8, 1.2],
    "one_token_unbiased": ["a", "b", "c", "d"],
    "zeroed_by_ppo": [0, 1, 0.2],
    "peak_neg": [2 / 3, 1, 3],
    "bound_constant": [math.exp(3), vespo.phi_max(2, 3), 1, math.exp(2)],
    "on_policy_ratio": [1, vespo.bound_constant(2, 3), 0],
    "no_bound": ["a", "c", "d"],
    "weight_sum": [1, -1, 0.5],
    "optimum_prob": [0.5, math.exp(2) / (math.exp(2) + 2), 1],
    "implied_offset": [0.5 * math.log(0.5 * math.exp(2) + 0.5), -math.log(0.5 * math.exp(2) + 0.5), 0],
    "which_sampler": ["a", "b", "d"],
    "baseline_mean": [0.37, 1, -0.37],
    "state_value": [0.2, -0.3, 0],
    "upper_end": [0.4, -0.4, 2 * 0.2],
    "does_it_help": ["a", "yes"],
    "sampled_ratio": [1, 0.8, 1 / 0.85, 0.5],
    "share_outside": ["a", "b", "c"],
    "exact_update": ["a", "c", "d"],
    "tis_change": [0.1, 1, -0.5],
    "truncation_gap": [0, 1, 0.2],
}


def _all_exercises():
    return [ex for module in LESSON_MODULES for ex in module.EXERCISES.values()]


def test_every_exercise_has_wrong_answers_listed():
    assert sorted(WRONG) == sorted(ex.key for ex in _all_exercises())


@pytest.mark.parametrize("ex", _all_exercises(), ids=lambda e: e.key)
def test_checker_accepts_right_and_refuses_wrong(ex):
    right = ex.answer()
    assert ex.check(right).ok is True
    assert ex.check(None).ok is None
    if ex.kind == "choice":
        assert ex.check(right.upper()).ok and ex.check(f" ({right}) ").ok
        assert ex.check(dict(ex.choices)[right]).ok  # the text of the right choice
        assert ex.check("z").ok is False
    else:
        if ex.kind == "number":
            close = right * (1 + ex.rtol / 4) if right else ex.atol / 4
            assert ex.check(close).ok  # within tolerance
        for junk in (float("nan"), float("inf"), "0.5", True):
            assert ex.check(junk).ok is False
    for wrong in WRONG[ex.key]:
        verdict = ex.check(wrong)
        assert verdict.ok is False, (ex.key, wrong)
        assert "not yet" in verdict._repr_markdown_()


def test_integer_exercises_refuse_fractions():
    ex = weight_explosion.EXERCISES["length_for_10pct"]
    assert ex.check(float(ex.answer())).ok and not ex.check(ex.answer() + 0.5).ok


def test_exercise_definitions_are_checked():
    with pytest.raises(LabError):
        exercises.Exercise("x", "?", lambda: 1, kind="essay")
    with pytest.raises(LabError):
        exercises.Exercise("x", "?", lambda: "a", kind="choice")


# ---- live controls ----------------------------------------------------------------------------------------------

LIVE = [("weight_explosion_ui", {"kl": 0.1, "length": 64, "vocab": 8, "batch": 64}),
        ("clip_mask_ui", {"kl": 0.5, "vocab": 16, "seed": 3, "eps": 0.1, "method": "mis_token"}),
        ("vespo_kernel_ui", {"k": 3.0, "lam": 2.0, "kl": 0.3, "length": 3}),
        ("gvpo_ui", {"beta": 0.2, "lr": 0.5, "steps": 100, "sampler": "partial"}),
        ("vopd_ui", {"vocab": 64, "sharpness": 2.5, "closeness": 0.5, "seed": 7}),
        pytest.param("sampler_truncation_ui", {"level": 0.6, "kind": "min_p", "temperature": 1.5, "kl": 0.2, "seed": 3},
                     marks=pytest.mark.slow)]  # seven redraws of three panels: several seconds


@pytest.mark.parametrize("builder,changes", LIVE, ids=[b.values[0] if hasattr(b, "marks") else b[0] for b in LIVE])
@pytest.mark.slow
def test_live_controls_redraw(builder, changes):
    """Every control redraws the picture and the numbers (how fast: benchmarks/bench_lessons.py)."""
    from lab.teach import live

    ui = getattr(live, builder)()
    assert set(ui.controls) == set(changes)
    for name, value in changes.items():
        png, text = ui.picture.outputs[0]["data"]["image/png"], ui.numbers.value
        ui.controls[name].value = value
        assert ui.elapsed > 0
        assert ui.picture.outputs[0]["data"]["image/png"] != png, name
        assert base64.b64decode(ui.picture.outputs[0]["data"]["image/png"])[:4] == b"\x89PNG"
        assert ui.numbers.value != text, name
    bundle = ui._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "make lab" in bundle["text/plain"]


def test_live_controls_carry_a_static_snapshot():
    from lab.teach import live

    ui = live.vopd_ui()
    bundle = ui._repr_mimebundle_()
    assert base64.b64decode(bundle["image/png"])[:4] == b"\x89PNG"
    assert 'href="vopd_baseline.html"' in bundle["text/html"] and "make lab" in bundle["text/html"]
    assert ui.numbers.value.split(":")[0].replace(">", "&gt;") in bundle["text/html"]


# ---- colours ------------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_estimator_series_take_the_labs_colours():
    """An estimator has one colour everywhere: the notebooks' figures, the live controls and the static pages use
    lab.reports.style.color, whatever the position of the estimator in a figure."""
    from matplotlib.colors import to_hex

    from lab.reports.style import ESTIMATOR_COLORS, color
    from lab.teach import live, pages, plots

    methods = clip_mask.METHODS
    fig = plots.coefficient_curves(methods, clip_mask.coefficient, clip_mask.LABELS)
    assert [to_hex(line.get_color()) for line in fig.axes[0].lines] == [color(m) for m in methods]
    fig = plots.coefficient_curves(methods[::-1], clip_mask.coefficient, clip_mask.LABELS)
    assert [to_hex(line.get_color()) for line in fig.axes[0].lines] == [color(m) for m in methods[::-1]]
    fig = plots.losses_against_kl(clip_mask.compare(16, [0.1, 0.5], 0), clip_mask.LABELS)
    assert [to_hex(line.get_color()) for line in fig.axes[0].lines] == [color(m) for m in methods]
    ui = live.vopd_ui()
    marks = {line.get_label(): to_hex(line.get_color()) for line in ui.figure.axes[0].lines[1:]}
    assert marks["OPD"] == color("opd") and marks["vOPD"] == color("vopd")
    page = next(p for p in pages.pages() if p.slug == "clip_mask")
    layout, _ = page.build(page)
    assert layout.select_one({"name": "curves"}).data["color"] == [color(m) for m in methods]
    assert len(set(ESTIMATOR_COLORS.values())) == len(ESTIMATOR_COLORS)
    assert color("vopd_topk") == color("vopd_top8") != color("vopd")
    assert color("kl_topk") == color("kl_top4") != color("kl_full")


@pytest.mark.slow  # builds the page (a few seconds)
def test_truncation_series_take_the_labs_colours():
    from matplotlib.colors import to_hex

    from lab.reports.style import color
    from lab.teach import pages, plots

    want = [color(m) for m in sampler_truncation.METHODS for _ in ("plain", "replay")]
    fig = plots.bias_against_level(sampler_truncation.sweep("top_p", [1.0, 0.7], 16), sampler_truncation.LABELS, "p")
    assert [to_hex(line.get_color()) for line in fig.axes[1].lines] == want
    page = next(p for p in pages.pages() if p.slug == "sampler_truncation")
    layout, _ = page.build(page)
    assert layout.select_one({"name": "bias_deployed"}).data["color"] == want


def test_token_panels_keep_their_legends_off_the_data():
    from lab.teach import plots

    fig = plots.token_panels(clip_mask.token_table(16, 0.3, 0), clip_mask.METHODS, clip_mask.LABELS)
    fig.draw_without_rendering()
    for ax in fig.axes[:len(clip_mask.METHODS)]:
        assert ax.get_legend().get_window_extent().y1 <= ax.get_window_extent().y0


# ---- dependencies -------------------------------------------------------------------------------------------------

def test_teaching_dependencies_are_declared():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["teach"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    for name in ("ipywidgets", "bokeh"):
        assert any(d.startswith(name) for d in deps) and any(d.startswith(name) for d in pip)
