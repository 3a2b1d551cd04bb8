"""The on-policy distillation family (lab.estimators.distillation): hand-computed values, registry metadata, extreme
logits, vmap. Exact expectations by enumeration and the study are tested in lab/studies/distillation/tests/."""
import math

import pytest
import torch
from torch.func import grad, vmap

from lab import estimators
from lab.errors import LabError

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
