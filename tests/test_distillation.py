"""The on-policy distillation family: hand-computed values, exact expectations by enumeration, the variance study."""
import math

import matplotlib.colors as mcolors
import numpy as np
import pytest
import torch
from torch.func import grad, vmap

import toy_envs
from lab import estimators
from lab.engine.estimator import Estimator
from lab.engine.exact import exact_support
from lab.engine.metrics import gram_metrics
from lab.errors import LabError
from lab.policies import init_params, make_policy, sequence_log_probs
from lab.reports import distillation as report
from lab.studies.distillation import Config as DistillationConfig
from lab.studies.distillation import (
    expected_estimate,
    isometric_coordinates,
    per_token_target,
    sequence_kl,
    sequence_target,
    variants,
)
from lab.studies.distillation import run as run_study

NAMES = ("opd", "vopd", "vopd_topk", "kl_full", "kl_topk")

# ---- one response of T = 2 tokens over V = 3, every probability chosen by hand ----------------------------------
P = torch.tensor([[[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]]], dtype=torch.float64)  # student pi_S(.|s_t), [1, 2, 3]
Q = torch.tensor([[[0.25, 0.25, 0.5], [0.2, 0.4, 0.4]]], dtype=torch.float64)  # teacher pi_T(.|s_t)
Y = torch.tensor([[1, 2]])  # sampled tokens
MASK = torch.ones(1, 2, dtype=torch.float64)
LN = math.log
R = [LN(0.25 / 0.5), LN(0.4 / 0.3)]  # r_t = log pi_T(y_t) - log pi_S(y_t) = [-ln 2, ln 4/3]
KL = [0.2 * LN(0.2 / 0.25) + 0.5 * LN(0.5 / 0.25) + 0.3 * LN(0.3 / 0.5),  # KL_0 = 0.1487...
      0.6 * LN(0.6 / 0.2) + 0.1 * LN(0.1 / 0.4) + 0.3 * LN(0.3 / 0.4)]  # KL_1 = 0.4342...
# top-2 of the student: t=0 {1, 2}: p^ = (5/8, 3/8), q^ = (1/3, 2/3); t=1 {0, 2}: p^ = (2/3, 1/3), q^ = (1/3, 2/3)
KL2 = [5 / 8 * LN((5 / 8) / (1 / 3)) + 3 / 8 * LN((3 / 8) / (2 / 3)),  # 0.1771...
       2 / 3 * LN(2) + 1 / 3 * LN(1 / 2)]  # = ln(2) / 3


def hand_call(name, loss_agg_mode="token-mean", **hyper):
    """Loss, d loss / d log pi(y_t), d loss / d logits and metrics on the hand-made response."""
    logits = torch.log(P).clone().requires_grad_(True)
    log_prob = torch.log_softmax(logits, -1).gather(-1, Y[..., None]).squeeze(-1)
    lp_leaf = log_prob.detach().requires_grad_(True)
    teacher_logits = torch.log(Q)
    inputs = {"teacher_log_prob": torch.log(Q).gather(-1, Y[..., None]).squeeze(-1), "logits": logits,
              "teacher_logits": teacher_logits}
    info = estimators.info(name)
    named = {k: inputs[k] for k in info.inputs}
    loss, metrics = info.fn(lp_leaf, lp_leaf.detach(), torch.zeros(1, 2, dtype=torch.float64), MASK,
                            loss_agg_mode=loss_agg_mode, **hyper, **named)
    c_lp, c_logits = torch.autograd.grad(loss, [lp_leaf, logits], allow_unused=True)
    c_lp = torch.zeros(1, 2, dtype=torch.float64) if c_lp is None else c_lp
    c_logits = torch.zeros_like(P) if c_logits is None else c_logits
    return float(loss.detach()), c_lp, c_logits, metrics


def test_hand_kl_values():
    from lab.estimators.distillation import reverse_kl, topk_reverse_kl

    assert torch.allclose(reverse_kl(torch.log(P), torch.log(Q)), torch.tensor([KL], dtype=torch.float64))
    kl2, mass = topk_reverse_kl(torch.log(P), torch.log(Q), 2)
    assert torch.allclose(kl2, torch.tensor([KL2], dtype=torch.float64))
    assert torch.allclose(mass, torch.tensor([[0.8, 0.9]], dtype=torch.float64))  # 0.5 + 0.3, 0.6 + 0.3
    assert KL2[1] == pytest.approx(LN(2) / 3)


def test_opd_by_hand():
    # token-mean over 2 tokens: loss = -(r_0 log p(y_0) + r_1 log p(y_1)) / 2, coefficient -r_t / 2
    loss, c, c_logits, metrics = hand_call("opd")
    assert c.tolist()[0] == pytest.approx([-R[0] / 2, -R[1] / 2])
    assert loss == pytest.approx(-(R[0] * LN(0.5) + R[1] * LN(0.3)) / 2)
    assert torch.count_nonzero(c_logits) == 0  # the gradient reaches the student through log pi(y_t) only
    assert float(metrics["reverse_kl_k1"]) == pytest.approx(-(R[0] + R[1]) / 2)
    # reward-to-go: coefficients -(r_0 + r_1) / 2 and -r_1 / 2 (ln 2 - ln 4/3 = ln 3/2 on the first token)
    _, c, _, _ = hand_call("opd", return_to_go=True)
    assert c.tolist()[0] == pytest.approx([-(R[0] + R[1]) / 2, -R[1] / 2])
    assert -(R[0] + R[1]) / 2 == pytest.approx(LN(1.5) / 2)
    # seq-mean-token-sum with B = 1: no division
    _, c, _, _ = hand_call("opd", loss_agg_mode="seq-mean-token-sum")
    assert c.tolist()[0] == pytest.approx([-R[0], -R[1]])


def test_vopd_by_hand():
    # A_t = r_t + KL_t: A_0 = -0.6931 + 0.1487 = -0.5445, A_1 = 0.2877 + 0.4342 = 0.7219; coefficient -A_t / 2
    _, c, c_logits, metrics = hand_call("vopd")
    assert c.tolist()[0] == pytest.approx([-(R[0] + KL[0]) / 2, -(R[1] + KL[1]) / 2])
    assert c.tolist()[0] == pytest.approx([0.5445 / 2, -0.7219 / 2], abs=1e-4)
    assert torch.count_nonzero(c_logits) == 0  # the baseline is detached
    assert float(metrics["reverse_kl_full"]) == pytest.approx((KL[0] + KL[1]) / 2)


def test_vopd_topk_by_hand():
    _, c, c_logits, metrics = hand_call("vopd_topk", k=2)
    assert c.tolist()[0] == pytest.approx([-(R[0] + KL2[0]) / 2, -(R[1] + KL2[1]) / 2])
    assert torch.count_nonzero(c_logits) == 0
    assert float(metrics["student_topk_mass"]) == pytest.approx((0.8 + 0.9) / 2)
    # k = 1: a renormalised single token has KL 0, so the baseline vanishes and vopd_topk is vanilla OPD
    _, c1, _, _ = hand_call("vopd_topk", k=1)
    assert c1.tolist()[0] == pytest.approx([-R[0] / 2, -R[1] / 2])
    # k >= V: the full-vocabulary baseline
    _, c3, _, _ = hand_call("vopd_topk", k=3)
    _, cv, _, _ = hand_call("vopd")
    assert torch.allclose(c3, cv)


def test_kl_full_by_hand():
    # d KL_t / d logit_v = p_v (ln(p_v / q_v) - KL_t); token-mean halves it
    loss, c, c_logits, metrics = hand_call("kl_full")
    assert loss == pytest.approx((KL[0] + KL[1]) / 2)
    assert torch.count_nonzero(c) == 0  # no sampled-token term
    expected = P * (torch.log(P / Q) - torch.tensor(KL, dtype=torch.float64)[None, :, None]) / 2
    assert torch.allclose(c_logits, expected)
    # t = 0, token 1 by hand: 0.5 (ln 2 - 0.1487) / 2 = 0.1361
    assert float(c_logits[0, 0, 1]) == pytest.approx(0.5 * (LN(2) - KL[0]) / 2)


def test_kl_topk_by_hand():
    loss, _, c_logits, metrics = hand_call("kl_topk", k=2)
    assert loss == pytest.approx((KL2[0] + KL2[1]) / 2)
    # gradient only on the top-2 logits: p^_v (ln(p^_v / q^_v) - KL2_t) / 2; zero on the token left out
    p_hat = [[0.0, 5 / 8, 3 / 8], [2 / 3, 0.0, 1 / 3]]
    q_hat = [[1.0, 1 / 3, 2 / 3], [1 / 3, 1.0, 2 / 3]]  # 1.0 where unused
    for t in range(2):
        for v in range(3):
            want = 0.0 if p_hat[t][v] == 0 else p_hat[t][v] * (LN(p_hat[t][v] / q_hat[t][v]) - KL2[t]) / 2
            assert float(c_logits[0, t, v]) == pytest.approx(want, abs=1e-12)
    assert float(metrics["student_topk_mass"]) == pytest.approx(0.85)
    # k >= V is the full-vocabulary loss
    full = hand_call("kl_full")
    assert torch.allclose(hand_call("kl_topk", k=5)[2], full[2])


def test_importance_weights_use_the_sampler_log_probs():
    # rho_t = exp(log pi - log mu) multiplies the coefficient; with mu = pi it is 1
    lp = torch.tensor([[-0.5, -1.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.7, -0.4]], dtype=torch.float64)
    tlp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64)
    loss, _ = estimators.get("opd")(lp, old, torch.zeros(1, 2), torch.ones(1, 2), loss_agg_mode="seq-mean-token-sum",
                                    teacher_log_prob=tlp, importance_weights=True)
    (c,) = torch.autograd.grad(loss, lp)
    r = [-1.0 + 0.5, -2.0 + 1.0]
    rho = [math.exp(-0.5 + 0.7), math.exp(-1.0 + 0.4)]
    assert c.tolist()[0] == pytest.approx([-rho[0] * r[0], -rho[1] * r[1]])


def test_registry_metadata_and_bad_k():
    for name in NAMES:
        i = estimators.info(name)
        assert i.family == "distillation" and i.source and i.unbiased_for and i.description
        assert "logits" in i.inputs or "teacher_log_prob" in i.inputs
    assert "biased" in estimators.info("kl_topk").unbiased_for
    assert estimators.info("vopd_topk").defaults == {"k": 100, "importance_weights": False}
    assert estimators.info("opd").defaults == {"return_to_go": False, "importance_weights": False}
    with pytest.raises(LabError, match="positive whole number"):
        hand_call("vopd_topk", k=0)


def _inputs(seed, B=4, T=3, V=5, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(B, T, V, generator=g)
    teacher_logits = scale * torch.randn(B, T, V, generator=g)
    tokens = torch.randint(V, (B, T), generator=g)
    return logits, teacher_logits, tokens


def _call(name, logits, teacher_logits, tokens, mask, old=None, **hyper):
    log_prob = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    tlp = torch.log_softmax(teacher_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    inputs = {"teacher_log_prob": tlp, "logits": logits, "teacher_logits": teacher_logits}
    info = estimators.info(name)
    old = log_prob.detach() if old is None else old
    return info.fn(log_prob, old, torch.zeros_like(log_prob), mask, loss_agg_mode="token-mean", **hyper,
                   **{k: inputs[k] for k in info.inputs})


@pytest.mark.parametrize("name", NAMES)
def test_extreme_logits_stay_finite(name):
    logits, teacher_logits, tokens = _inputs(0, scale=1.0)
    logits = logits.clone()
    logits[0, 0] = torch.tensor([1e4, -1e4, 0.0, 3e3, -3e3])
    teacher_logits[0, 0] = torch.tensor([-1e4, 1e4, 0.0, -3e3, 3e3])  # the teacher puts ~0 mass on the student's mode
    teacher_logits[1] = -1e4
    teacher_logits[1, :, 2] = 1e4
    logits.requires_grad_(True)
    mask = torch.ones(4, 3)
    mask[3, 2] = 0.0
    for hyper in ({}, {"k": 2}) if "topk" in name else ({},):
        loss, metrics = _call(name, logits, teacher_logits, tokens, mask, **hyper)
        (g,) = torch.autograd.grad(loss, logits)
        assert torch.isfinite(loss) and torch.isfinite(g).all()
        assert all(torch.isfinite(v) and v.dim() == 0 for v in metrics.values())


@pytest.mark.parametrize("name", NAMES)
def test_run_under_vmap(name):
    logits, teacher_logits, tokens = _inputs(1)
    logits, teacher_logits, tokens = (x.reshape(2, 2, *x.shape[1:]) for x in (logits, teacher_logits, tokens))
    mask = torch.ones(2, 2, 3)
    hyper = {"k": 2} if "topk" in name else {}

    def loss(lg, tl, tk, m):
        return _call(name, lg, tl, tk, m, **hyper)[0]

    g = vmap(grad(loss))(logits, teacher_logits, tokens, mask)
    loop = torch.stack([grad(loss)(logits[i], teacher_logits[i], tokens[i], mask[i]) for i in range(2)])
    assert torch.allclose(g, loop, atol=1e-6)


# ---- exact targets and expectations by enumeration ------------------------------------------------------------

@pytest.fixture(scope="module", params=["prefix", "markov-eos"])
def toy(request):
    """A student and a perturbed teacher on an enumerable env (fixed length, or variable length with an end token)."""
    if request.param == "prefix":
        env = toy_envs.make("small_dense", vocab_size=4, length=3, n_prompts=2)
        policy = make_policy("prefix", env)
    else:
        env = toy_envs.make("small_eos", vocab_size=4, length=3, n_prompts=2)
        policy = make_policy("markov", env)
    g = torch.Generator().manual_seed(7)
    th_s = init_params(policy, 1.0, g)
    th_t = th_s + 1.5 * torch.randn(th_s.shape, generator=g, dtype=torch.float64)
    support = exact_support(env, policy, th_s, 10_000)
    return env, policy, th_s, th_t, support


def test_sequence_target_matches_finite_differences(toy):
    env, policy, th_s, th_t, support = toy
    g = sequence_target(policy, th_s, th_t, support)

    def kl(theta):
        return sequence_kl(policy, theta, th_t, exact_support(env, policy, theta, 10_000))

    gen = torch.Generator().manual_seed(3)
    for _ in range(4):  # central differences along random directions: error O(h^2)
        d = torch.randn(th_s.shape, generator=gen, dtype=torch.float64)
        h = 1e-5
        fd = (kl(th_s + h * d) - kl(th_s - h * d)) / (2 * h)
        assert float(g @ d.reshape(-1)) == pytest.approx(fd, rel=1e-6, abs=1e-9)
    # and it equals grad E_{pi_S}[sum_t KL_t] with the probabilities differentiated (the chain rule)
    theta = th_s.clone().requires_grad_(True)
    from lab.studies.distillation import kl_per_token

    ls = sequence_log_probs(policy, theta, support.prompts, support.tokens, support.mask)
    kl_t = kl_per_token(policy, theta, th_t, support.prompts, support.tokens)
    (g2,) = torch.autograd.grad((torch.exp(ls) / env.n_prompts * (kl_t * support.mask).sum(-1)).sum(), theta)
    assert torch.allclose(g, g2.reshape(-1), atol=1e-12)


def test_exact_expectations_equal_the_targets(toy):
    env, policy, th_s, th_t, support = toy
    g_tok = per_token_target(policy, th_s, th_t, support)
    g_seq = sequence_target(policy, th_s, th_t, support)
    assert (g_tok - g_seq).norm() > 0.05 * g_seq.norm()  # the targets really differ

    def mean(name, mode="seq-mean-token-sum", **hyper):
        return expected_estimate(policy, th_s, th_t, support, Estimator.resolve(name, hyper, mode))

    close = dict(atol=1e-10 * float(g_tok.norm()), rtol=0)
    assert torch.allclose(mean("opd"), -g_tok, **close)
    assert torch.allclose(mean("opd", return_to_go=True), -g_seq, **close)
    assert torch.allclose(mean("vopd"), -g_tok, **close)
    for k in (1, 2, 3):
        assert torch.allclose(mean("vopd_topk", k=k), -g_tok, **close)
    assert torch.allclose(mean("kl_full"), -g_tok, **close)
    # the top-k KL loss is biased (exactly, not by sampling): 2 of 4 tokens
    assert (mean("kl_topk", k=2) + g_tok).norm() > 0.1 * g_tok.norm()
    assert torch.allclose(mean("kl_topk", k=4), -g_tok, **close)  # k = V: the full loss
    if not env.eos:  # token-mean with fixed length T estimates g / T
        assert torch.allclose(mean("vopd", "token-mean"), -g_tok / env.length, **close)


def test_importance_weighted_opd_holds_the_behaviour_visitation(toy):
    # with a stale behaviour mu, token IS corrects each token but states still come from mu:
    # E_mu[-grad loss] = -grad sum_y sg[mu(y)] sum_t m_t KL_t(theta) (the per-token target under mu's visitation)
    env, policy, th_s, th_t, _ = toy
    th_mu = th_s + 0.5 * torch.randn(th_s.shape, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    support_mu = exact_support(env, policy, th_mu, 10_000)
    want = -per_token_target(policy, th_s, th_t, support_mu)
    for name in ("opd", "vopd"):
        got = expected_estimate(policy, th_s, th_t, support_mu,
                                Estimator.resolve(name, {"importance_weights": True}, "seq-mean-token-sum"),
                                theta_mu=th_mu)
        assert torch.allclose(got, want, atol=1e-10 * float(want.norm()), rtol=0)
    support_s = exact_support(env, policy, th_s, 10_000)
    assert (want + per_token_target(policy, th_s, th_t, support_s)).norm() > 0.01 * want.norm()  # biased off-policy


# ---- the study ------------------------------------------------------------------------------------------------

def test_isometric_coordinates_preserve_every_statistic():
    g = torch.Generator().manual_seed(0)
    grads = torch.randn(30, 200, generator=g) + 0.3
    t1, t2 = torch.randn(200, generator=g, dtype=torch.float64), torch.randn(200, generator=g, dtype=torch.float64)
    coords, (c1, c2) = isometric_coordinates(grads, t1, t2)
    assert coords.shape[1] <= 32
    counts = np.random.default_rng(0).multinomial(30, np.full(30, 1 / 30), size=50).astype(float)
    for t, c in ((t1, c1), (t2, c2)):
        raw, small = gram_metrics(grads, t, counts, 0.95), gram_metrics(coords, c, counts, 0.95)
        for key in raw:
            assert np.allclose(raw[key], small[key], rtol=1e-9, atol=1e-9), key


SMALL = dict(vocab_size=8, length=2, n_prompts=2, teacher_steps=5, replicates=200, batch_size=16, k_values=[2],
             n_boot=300, seed=0)


@pytest.fixture(scope="module")
def small_study():
    study = run_study(DistillationConfig(**SMALL), progress=False)
    study.summary["headline"] = report.headline(study.summary)  # the report's line, as the notebook writes it
    return study


def test_vopd_reduces_variance_with_an_interval_excluding_one(small_study):
    red = small_study.summary["variance_reduction"]
    assert red["vopd"]["lo"] > 1.0  # Var(opd) / Var(vopd), joint bootstrap over replicates, fixed seed
    assert red["vopd_top2"]["lo"] > 1.0
    # (no ordering between the two: -KL_t is the value function, not the variance-optimal baseline, and a
    # top-k baseline can come out ahead of it)
    r = small_study.results
    # the same interval, read from the tidy table
    row = r[(r["variant"] == "vopd") & (r["metric"] == "variance_reduction")].iloc[0]
    assert row["lo"] == pytest.approx(red["vopd"]["lo"]) and row["target"] == "-"


def test_study_bias_against_both_targets(small_study):
    bias = small_study.summary["bias"]
    for lab in ("opd", "vopd", "vopd_top2", "kl_full"):
        assert bias[lab]["unbiased_for"] == ["per_token"]
    assert bias["opd_rtg"]["unbiased_for"] == ["sequence"]
    assert bias["kl_top2"]["unbiased_for"] == []
    assert bias["kl_top2"]["per_token"]["exact_rel_bias"] > 0.05
    r = small_study.results
    # sampled bias of an unbiased estimator: the interval covers 0 ... and excludes it for the biased top-k loss
    b = r[(r["metric"] == "bias2") & (r["target"] == "per_token")].set_index("variant")
    assert b.loc["vopd", "lo"] <= 0 <= b.loc["vopd", "hi"]
    assert b.loc["kl_top2", "lo"] > 0
    assert {"env", "estimator", "variant", "metric", "value", "lo", "hi", "target", "k"} <= set(r.columns)
    assert small_study.summary["headline"].startswith("vOPD cuts vanilla OPD's gradient variance")


def test_study_is_deterministic_and_rejects_bad_configs():
    cfg = dict(SMALL, replicates=20, estimators=["opd", "vopd"], n_boot=20)
    a, b = run_study(DistillationConfig(**cfg)), run_study(DistillationConfig(**cfg))
    assert a.results["value"].equals(b.results["value"])
    assert [v.label for v in variants(DistillationConfig(k_values=[4, 2]))] == [
        "opd", "opd_rtg", "vopd", "vopd_top2", "vopd_top4", "kl_full", "kl_top2", "kl_top4"]
    for bad, match in [({"estimators": ["ppo"]}, "unknown distillation estimator"),
                       ({"behaviour_lag": 2}, "exceeds the student's trajectory"),
                       ({"k_values": [0]}, "positive whole numbers"),
                       ({"teacher": "oracle"}, "unknown teacher"),
                       ({"env": "small_eos", "vocab_size": 4}, "seq-mean-token-sum"),
                       ({"vocab_size": 64, "length": 4}, "enumeration limit"),
                       ({"replicates": 1}, "at least 2")]:
        with pytest.raises(LabError, match=match):
            DistillationConfig(**{**SMALL, **bad}).validate()


def test_stale_behaviour_study_runs_with_importance_weights():
    cfg = DistillationConfig(**{**SMALL, "replicates": 40, "n_boot": 50, "student_steps": 3, "behaviour_lag": 2,
                                "importance_weights": True, "estimators": ["opd", "vopd", "kl_full"]})
    res = run_study(cfg)
    assert res.summary["bias"]["opd"]["unbiased_for"] == []  # off-policy states: biased for both targets
    assert np.isfinite(res.results["value"]).all()
    assert len(res.summary["student_trajectory_kl"]) == 3


# ---- what the report says and draws ----------------------------------------------------------------------------

def _iv(value, lo, hi):
    return {"value": value, "lo": lo, "hi": hi}


def hand_summary():
    """A distillation summary with round numbers: vOPD divides OPD's variance by 1.25 [1.15, 1.33], a top-4 baseline
    keeps 95% of that, the top-2 KL loss is 83% biased, full KL is 10x less noisy than vOPD."""
    unb = {"opd": ["per_token"], "opd_rtg": ["sequence"], "vopd": ["per_token"], "vopd_top2": ["per_token"],
           "vopd_top4": ["per_token"], "kl_full": ["per_token"], "kl_top2": []}
    rel_bias = {"opd_rtg": 0.035, "kl_top2": 0.83}
    rel_mse = {"vopd": 0.201, "kl_full": 0.0189}
    bias = {lab: {t: {"exact_rel_bias": 0.0 if t in u else rel_bias.get(lab, 0.034),
                      "sampled_bias_norm": _iv(0, 0, 0.1), "rel_mse": _iv(rel_mse.get(lab, 0.25), 0.2, 0.3)}
                  for t in ("per_token", "sequence")} for lab, u in unb.items()}
    for lab, u in unb.items():
        bias[lab]["unbiased_for"] = u
    red = {"vopd": dict(_iv(1.25, 1.15, 1.33), k=None), "vopd_top2": dict(_iv(1.1, 1.02, 1.2), k=2),
           "vopd_top4": dict(_iv(1.24, 1.14, 1.32), k=4)}
    ks = {"vopd_top2": 2, "vopd_top4": 4, "kl_top2": 2}
    variants = {lab: {"estimator": lab, "k": ks.get(lab), "rel_variance": _iv(0.2, 0.15, 0.25),
                      "variance_reduction": red.get(lab)} for lab in unb}
    variants["vopd_top2"]["kept_share"], variants["vopd_top4"]["kept_share"] = 0.45, 0.95
    return {"env": "small_dense", "vocab_size": 8, "length": 2, "kl_seq": 0.614, "kl_token": 0.307,
            "targets_cos": 0.9994, "targets_rel_gap": 0.034, "variance_reduction": red,
            "variance_vs_kl_full": {"vopd": _iv(10.9, 9.54, 12.7)}, "bias": bias, "variants": variants,
            "config": {"policy": "prefix", "teacher": "trained", "replicates": 40, "batch_size": 32,
                       "behaviour_lag": 0, "importance_weights": False, "loss_agg_mode": "token-mean", "seed": 0}}


def test_answer_states_the_verdicts_with_the_summary_numbers():
    s = hand_summary()
    text = report.answer(s)
    assert "V = 8, T = 2" in text and "40 replicate batches of 32 responses, on-policy, `token-mean`" in text
    assert "**vOPD beats vanilla OPD**" in text and "**1.25 [1.15, 1.33]**" in text and "with no bias" in text
    assert "vOPD is noisier than full-vocabulary KL**: its variance is 10.9 [9.54, 12.7]×" in text
    assert "MSE ÷ ‖target‖² 0.201 vs 0.0189" in text
    assert "top-2: 1.10 [1.02, 1.20]× (45%); top-4: 1.24 [1.14, 1.32]× (95%)" in text
    assert "Every k is unbiased here" in text
    assert "Unbiased for the per-token target: OPD, vOPD, vOPD top-2, vOPD top-4, full-vocab KL." in text
    assert "Unbiased for the sequence-level target: OPD (reward-to-go). Biased for both: top-2 KL." in text
    assert "per-token target): top-2: 83%." in text and "differ by 3% of the sequence-level gradient" in text
    assert report.headline(s) == ("vOPD cuts vanilla OPD's gradient variance by a factor 1.2 [1.1, 1.3] at no bias; "
                                  "a top-4 baseline keeps 1.2x; the top-2 KL loss is 83% biased")


def test_answer_changes_with_the_numbers():
    s = hand_summary()
    s["variance_reduction"]["vopd"].update(_iv(1.05, 0.95, 1.12))
    s["variance_vs_kl_full"]["vopd"] = _iv(0.5, 0.4, 0.6)
    text = report.answer(s)
    assert "**vOPD is not distinguishable from vanilla OPD**" in text and "**1.05 [0.95, 1.12]**" in text
    assert "vOPD is less noisy than full-vocabulary KL" in text
    s["variance_reduction"]["vopd"].update(_iv(0.8, 0.7, 0.9))
    assert "**vOPD does not beat vanilla OPD**" in report.answer(s)
    assert report.headline(s).startswith("vOPD does not cut vanilla OPD's gradient variance: factor 0.8 [0.7, 0.9]")
    s["variance_reduction"]["vopd"].update(_iv(1.25, 1.15, 1.33))
    # a stale behaviour policy: vOPD and a top-k baseline miss the per-token target, and the text says so
    s["config"]["behaviour_lag"] = 2
    for lab in ("vopd", "vopd_top2"):
        s["bias"][lab]["unbiased_for"] = []
        s["bias"][lab]["per_token"]["exact_rel_bias"] = 0.12
    text = report.answer(s)
    assert "sampled from the student 2 steps stale" in text and "on-policy" not in text
    assert "misses the per-token target by 12% (the batches are off-policy)" in text
    assert "Biased for the per-token target here: vOPD, vOPD top-2." not in text  # vOPD itself is no top-k baseline
    assert "Biased for the per-token target here: vOPD top-2." in text and "Every k is unbiased" not in text
    assert "Biased for both: vOPD, vOPD top-2, top-2 KL." in text
    # no top-k baseline keeps 90%: the headline names the largest k
    s["variants"]["vopd_top4"]["kept_share"] = 0.6
    assert "a top-4 baseline keeps" in report.headline(s)
    s["variants"]["vopd_top2"]["kept_share"] = 0.92
    assert "a top-2 baseline keeps 1.1x" in report.headline(s)


def test_results_table_has_one_row_per_variant_from_the_summary():
    s = hand_summary()
    df = report.results_table(s).data
    assert list(df["estimator"]) == ["OPD", "OPD (reward-to-go)", "vOPD", "vOPD top-2", "vOPD top-4", "full-vocab KL",
                                     "top-2 KL"]
    row = df.set_index("estimator")
    assert row.loc["top-2 KL", "bias vs per-token (exact)"] == "83.0%"
    assert row.loc["vOPD", "Var(OPD) ÷ Var"] == "1.25 [1.15, 1.33]" and row.loc["OPD", "Var(OPD) ÷ Var"] == "–"


def test_figures_draw_the_study_numbers(small_study):
    from lab.reports.style import color

    r, s = small_study.results, small_study.summary
    labs = list(s["variants"])
    fig = report.bias_figure(r)
    for ax, target in zip(fig.axes[:2], ("per_token", "sequence")):
        bars = ax.patches
        assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [report.pretty(lab) for lab in labs]
        assert [b.get_width() for b in bars] == pytest.approx([s["bias"][lab][target]["exact_rel_bias"]
                                                               for lab in labs])
        assert [b.get_facecolor()[:3] for b in bars] == [pytest.approx(mcolors.to_rgb(color(lab))) for lab in labs]
    fig = report.variance_figure(r)
    norm2 = s["target_norms"]["per_token"] ** 2
    assert fig.axes[0].get_xscale() == "log"
    assert [b.get_width() for b in fig.axes[0].patches] == pytest.approx([s["variance"][lab] / norm2 for lab in labs])
    fig = report.variance_reduction_figure(r)
    ax, ax2 = fig.axes
    top = next(line for line in ax.lines if line.get_label() == "vOPD top-k baseline")
    assert list(top.get_xdata()) == [2] and list(top.get_ydata()) == [s["variance_reduction"]["vopd_top2"]["value"]]
    full = next(line for line in ax.lines if line.get_label().startswith("vOPD, full vocabulary"))
    assert full.get_ydata()[0] == pytest.approx(s["variance_reduction"]["vopd"]["value"])
    assert "k = V = 8" in full.get_label()
    assert list(ax2.lines[0].get_xdata()) == [2, 8] and ax2.lines[0].get_ydata()[-1] == 1.0
    assert ax2.lines[0].get_ydata()[0] == pytest.approx(s["student_topk_mass"]["2"])


def test_reduction_grid_finds_where_the_baseline_hurts_and_says_so():
    """On a 3-token vocabulary with 2-token responses the state-value baseline raises the variance (interval below
    1); with 32 tokens it lowers it. The text names both from the summary alone."""
    from lab.reports import distillation as report
    from lab.studies import distillation as study

    grid, summary = study.reduction_grid(study.Config(), [3, 32], [0.25], replicates=100, lengths=[2])
    by_v = grid.set_index("vocab_size")
    assert by_v.loc[3, "hi"] < 1 and by_v.loc[32, "lo"] > 1
    assert summary["hurts"] == 1 and summary["helps"] == 1
    text = report.grid_answer(summary)
    assert "raises the variance** in 1 setting(s): T = 2, V = 3" in text and "lowers the variance** in 1" in text
    tidy = study.tidy_grid(grid)
    assert set(tidy["metric"]) == {"variance_reduction", "kl_token"} and len(tidy) == 4
    fig = report.grid_figure(grid)
    ys = sorted(fig.axes[0].get_lines()[0].get_ydata())
    assert ys == pytest.approx(sorted(grid["ratio"]))
