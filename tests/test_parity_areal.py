"""Parity with AReaL 1.0.4's own code: its decoupled PPO loss (``areal/utils/functional/functional.py``
``ppo_actor_loss_fn`` with ``apply_rejection_sampling``), its M2PO mask (``areal/trainer/ppo/actor.py``
``_apply_m2po_masking``) and its log-linear proximal approximation (A-3PO, ``compute_prox_logp_approximations``),
run from the installed wheel (tests/shipped_code.py) on the same tensors as the lab's estimators.

AReaL's ``grpo_loss_fn`` glues them together (resolve the proximal log-probs, apply the M2PO mask to the loss mask,
call ``ppo_actor_loss_fn``); that glue is restated here in three lines, from actor.py. Every case has ragged rows, an
empty row, both advantage signs, a sampler mu different from pi_prox and ratios that clip and get rejected, and
compares loss and d loss / d log pi to 1e-6. Needs areal installed without dependencies (.ci/run).
"""
import pytest
import torch

from lab import estimators
from shipped_code import load

TOL = 1e-6
B, T = 8, 6
LENGTHS = [6, 3, 0, 4, 1, 6, 2, 5]


@pytest.fixture(scope="module")
def areal():
    constants = load("areal", "utils/constants.py")
    cli = load("areal", "api/cli_args.py", ["RejectionSamplingConfig"])
    functional = load("areal", "utils/functional/functional.py",
                      ["RejectionSamplingResult", "_check_bounds", "apply_rejection_sampling",
                       "_compute_sequence_level_ratio_and_advantages", "ppo_actor_loss_fn"],
                      {"RejectionSamplingConfig": cli["RejectionSamplingConfig"]})
    actor = load("areal", "trainer/ppo/actor.py",
                 ["_apply_m2po_masking", "_get_m2po_loss_mask", "compute_prox_logp_approximations"], constants)
    return {**functional, **actor, "RejectionSamplingConfig": cli["RejectionSamplingConfig"], **constants}


def _batch(seed=11):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    lp = -2.0 * torch.rand(B, T, generator=g, dtype=torch.float64)
    prox = (lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    mu = (prox + 0.6 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    mu[0, 1] = prox[0, 1] - 2.5  # pi_prox / mu = e^2.5 > 5 on a real token: the behaviour mask binds
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    adv = (signs * (0.2 + torch.rand(B, generator=g, dtype=torch.float64)))[:, None].expand(B, T).clone()
    lag = torch.tensor([1, 2, 3, 4, 2, 8, 1, 3], dtype=torch.float64)[:, None].expand(B, T).clone()
    return mask, lp, prox, mu, adv, lag


MASK, LP, PROX, MU, ADV, LAG = _batch()


def both(f):
    x = LP.clone().requires_grad_(True)
    loss = f(x)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


def assert_same(ours, theirs, what):
    assert float((ours[0] - theirs[0]).abs()) <= TOL, f"{what}: loss {float(ours[0])} vs {float(theirs[0])}"
    assert float((ours[1] - theirs[1]).abs().max()) <= TOL, f"{what}: gradient"


def areal_loss(a, x, prox=PROX, loss_mask=None, eps=0.4, eps_high=None, c_clip=None, upper=5.0, action="mask"):
    rs = None if upper is None else a["RejectionSamplingConfig"](level="token", action=action, metric="ratio",
                                                                  upper=upper)
    loss, _ = a["ppo_actor_loss_fn"](logprobs=x, proximal_logprobs=prox, old_logprobs=MU, advantages=ADV,
                                     eps_clip=eps, loss_mask=MASK.bool() if loss_mask is None else loss_mask,
                                     eps_clip_higher=eps_high, c_clip=c_clip, rejection_sampling=rs)
    return loss


def lab(name, **hyper):
    return both(lambda x: estimators.get(name)(x, PROX, ADV, MASK, loss_agg_mode="token-mean",
                                               rollout_log_probs=MU, **hyper)[0])


DECOUPLED = [  # (AReaL's settings, the lab's hyper-parameters)
    ({}, {}),  # the lab's defaults: AReaL's examples/math/gsm8k_grpo.yaml
    ({"eps": 0.2, "upper": None}, {"eps_clip": 0.2, "behave_upper": None}),  # PPOActorConfig's own defaults
    ({"eps": 0.2, "eps_high": 0.28, "c_clip": 3.0}, {"eps_clip": 0.2, "eps_clip_higher": 0.28, "c_clip": 3.0}),
    ({"action": "clamp", "upper": 2.0}, {"behave_mode": "clamp", "behave_upper": 2.0}),
]


@pytest.mark.parametrize("theirs,hyper", DECOUPLED)
def test_decoupled_ppo_equals_areal_ppo_actor_loss(areal, theirs, hyper):
    assert_same(lab("decoupled_ppo", **hyper), both(lambda x: areal_loss(areal, x, **theirs)), f"decoupled {theirs}")


def test_a3po_loglinear_proximal_equals_areal_approximation(areal):
    current = 10
    versions = (current - LAG).long()

    def theirs(x):
        prox = areal["compute_prox_logp_approximations"](old_logp=MU, logprobs=x.detach(), versions=versions,
                                                         current_version=current, method="loglinear")["loglinear"]
        return areal_loss(areal, x, prox=prox)

    ours = both(lambda x: estimators.get("decoupled_ppo")(x, PROX, ADV, MASK, rollout_log_probs=MU, lag=LAG,
                                                          proximal="loglinear")[0])
    assert_same(ours, both(theirs), "A-3PO")
    assert not torch.allclose(ours[1], lab("decoupled_ppo")[1])  # the interpolated pi_prox is not the recomputed one


@pytest.mark.parametrize("threshold", [0.04, 0.1, 1e-3])
def test_m2po_equals_areal_mask_then_ppo_actor_loss(areal, threshold):
    kept = areal["_apply_m2po_masking"](MU, PROX, MASK.bool(), threshold)
    assert 0 < int(kept.sum()) < int(MASK.sum())  # the mask binds, and keeps some
    theirs = both(lambda x: areal_loss(areal, x, loss_mask=kept, eps=0.0))
    assert_same(lab("m2po", m2_threshold=threshold), theirs, f"m2po {threshold}")
    ours_mask = estimators.decoupled.m2_keep((MU - PROX) ** 2, MASK, threshold)
    assert torch.equal(ours_mask.bool(), kept)


def test_m2po_defaults_are_areal_examples():
    d = estimators.info("m2po").defaults
    assert (d["eps_clip"], d["behave_upper"], d["m2_threshold"]) == (0.0, 5.0, 0.04)
    assert estimators.info("decoupled_ppo").defaults["eps_clip"] == 0.4


def test_the_batch_exercises_the_rejection_and_both_signs(areal):
    w = torch.exp(PROX - MU)
    assert bool(((w > 5) & (MASK > 0)).any()) and bool(((w < 5) & (MASK > 0)).any())
    assert (ADV[:, 0] > 0).any() and (ADV[:, 0] < 0).any() and (MASK.sum(-1) == 0).any()
