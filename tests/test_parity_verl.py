"""Parity with verl 0.9.1's own functions, called here on the same tensors: its policy losses (vanilla, gspo, sapo,
geo_mean, cispo, bypass_mode), its decoupled rollout correction, its KL penalties and agg_loss, and the lab's
estimators exported with lab.estimators.to_verl and registered in verl's own policy-loss registry.

Every case runs on one batch with ragged lengths, an empty row, both advantage signs and ratios that clip, in every
aggregation mode verl supports for that loss, and compares the loss and d loss / d log_prob to 1e-6. Two aggregation
regimes: the trainer's (config.global_batch_info as verl 0.9.1's trainer fills it: global_batch_size = every
sequence of the mini-batch), under which the lab's estimators equal verl's directly, and a loss called on its own
(no global batch information: verl divides the seq-mean-* modes by the non-empty rows), which to_verl reproduces.

Needs verl, which installs without its dependencies: pip install --no-deps verl==0.9.1, then
pip install tensordict omegaconf "transformers>=5.5.3,<5.11" codetiming orjson.
"""
import math

import pytest
import torch

ca = pytest.importorskip(
    "verl.trainer.ppo.core_algos",
    reason="verl is not importable: pip install --no-deps verl==0.9.1 && "
           "pip install tensordict omegaconf 'transformers>=5.5.3,<5.11' codetiming orjson")
from verl.trainer.config import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: E402
from verl.workers.config import ActorConfig, PolicyLossConfig  # noqa: E402

from lab import estimators  # noqa: E402
from lab.errors import LabError  # noqa: E402
from lab.estimators.aggregation import AGG_MODES, agg_loss  # noqa: E402

TOL = 1e-6
B, T = 8, 6
LENGTHS = [6, 3, 0, 4, 1, 6, 2, 5]  # ragged, with an empty row
VERL_MODES = (*AGG_MODES, "token-sum")


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    lp = -2.0 * torch.rand(B, T, generator=g, dtype=torch.float64)
    old = (lp + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)  # ratios e^-1.5 .. e^1.5
    mu = (old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)  # a third policy
    ref = (lp - 0.6 * torch.rand(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    adv = (signs * (0.2 + torch.rand(B, generator=g, dtype=torch.float64)))[:, None].expand(B, T).clone()
    weights = 3.0 * torch.rand(B, T, generator=g, dtype=torch.float64)
    weights[0, 1] = 0.0  # an IcePop-zeroed token
    return dict(mask=mask, lp=lp, old=old, mu=mu, ref=ref, adv=adv, weights=weights)


D = _batch()
TRAINER = dict(dp_size=1, batch_num_tokens=int(D["mask"].sum()), global_batch_size=B, loss_scale_factor=None)


def actor(info=None, **fields):
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **fields)
    config.global_batch_info.update(info or {})
    return config


def verl_loss(fn, mode, config, weights=None, old=None):
    x = D["lp"].clone().requires_grad_(True)
    loss, metrics = fn(old_log_prob=D["old"] if old is None else old, log_prob=x, advantages=D["adv"],
                       response_mask=D["mask"].bool(), loss_agg_mode=mode, config=config,
                       rollout_is_weights=weights)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, metrics


def lab_loss(name, mode, **kw):
    x = D["lp"].clone().requires_grad_(True)
    loss, metrics = estimators.get(name)(x, D["old"], D["adv"], D["mask"], loss_agg_mode=mode, **kw)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, metrics


def assert_same(a, b, what):
    assert torch.isfinite(a[0]) and torch.isfinite(b[0]), what
    assert float((a[0] - b[0]).abs()) <= TOL, f"{what}: loss {float(a[0])} vs {float(b[0])}"
    assert float((a[1] - b[1]).abs().max()) <= TOL, f"{what}: gradient differs by {float((a[1] - b[1]).abs().max())}"


# (verl loss, lab estimator, verl ActorConfig fields, lab hyper-parameters, the lab modes verl supports for it)
POLICY_LOSSES = [
    ("vanilla", "ppo_clip", {}, {"clip_ratio_c": 3.0}, AGG_MODES),  # verl's defaults: eps 0.2 / 0.2, dual clip 3
    ("vanilla", "ppo_clip", {"clip_ratio_high": 0.28, "clip_ratio_c": 2.0},
     {"clip_ratio_high": 0.28, "clip_ratio_c": 2.0}, AGG_MODES),  # DAPO's eps_high, a tighter dual clip
    ("gspo", "gspo", {}, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}, AGG_MODES),  # ActorConfig defaults
    ("gspo", "gspo", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, {}, AGG_MODES),  # verl's GSPO example
    ("sapo", "sapo", {}, {}, ("seq-mean-token-mean",)),  # verl forces seq-mean-token-mean for SAPO
    ("geo_mean", "gmpo", {}, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}, ("seq-mean-token-mean",)),
    ("geo_mean", "gmpo", {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4}, {}, ("seq-mean-token-mean",)),
    ("cispo", "cispo", {}, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}, AGG_MODES),
    ("cispo", "cispo", {"clip_ratio_low": 1.0, "clip_ratio_high": 4.0}, {}, AGG_MODES),  # the lab's defaults
]
CASES = [(v, n, f, h, m) for v, n, f, h, modes in POLICY_LOSSES for m in modes]


@pytest.mark.parametrize("verl_name,name,fields,hyper,mode", CASES)
def test_estimator_equals_verl_policy_loss_under_the_trainer_aggregation(verl_name, name, fields, hyper, mode):
    theirs = verl_loss(ca.get_policy_loss_fn(verl_name), mode, actor(TRAINER, **fields))
    assert_same(lab_loss(name, mode, **hyper), theirs, f"{name} vs verl {verl_name} ({mode})")


def test_the_batch_exercises_clipping_and_both_signs():
    # guard against a parity that holds only because nothing clips
    _, _, m = lab_loss("ppo_clip", "token-mean", clip_ratio_c=3.0)
    assert 0.1 < m["clipfrac"] < 0.9
    assert (D["adv"][:, 0] > 0).any() and (D["adv"][:, 0] < 0).any() and (D["mask"].sum(-1) == 0).any()


# verl's bypass mode (two policies: old_log_prob is the sampler), loss_type="reinforce", and its rollout_is settings
BYPASS = [("token", 2.0, "tis_token"), ("sequence", 2.0, "tis_seq"), ("token", "0.5_5.0", "mis_token"),
          ("sequence", "0.5_2.0", "mis_seq"), ("sequence", 1e30, "seq_is"), (None, 2.0, "reinforce")]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("level,threshold,name", BYPASS)
def test_two_policy_corrections_equal_verl_bypass_reinforce(level, threshold, name, mode):
    correction = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=threshold, bypass_mode=True,
                                         loss_type="reinforce")
    config = actor(TRAINER, policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=correction))
    theirs = verl_loss(ca.get_policy_loss_fn("bypass_mode"), mode, config)
    assert_same(lab_loss(name, mode), theirs, f"{name} vs verl bypass rollout_is={level} {threshold} ({mode})")


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("level,threshold,name", BYPASS[:4])
def test_three_policy_corrections_equal_verl_decoupled_mode(level, threshold, name, mode):
    # verl: weights from pi_old / mu (its rollout correction), multiplied into its vanilla PPO loss on pi / pi_old
    proto, _, _ = compute_rollout_correction_and_rejection_mask(
        old_log_prob=D["old"], rollout_log_prob=D["mu"], response_mask=D["mask"], rollout_is=level,
        rollout_is_threshold=threshold)
    weights = proto.batch["rollout_is_weights"]
    theirs = verl_loss(ca.get_policy_loss_fn("vanilla"), mode, actor(TRAINER), weights=weights)
    assert_same(lab_loss(name, mode, rollout_log_probs=D["mu"]), theirs, f"three-policy {name} ({mode})")


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("kind,name", [("k1", "kl_k1"), ("k2", "kl_k2"), ("low_var_kl", "kl_k3")])
def test_kl_penalties_equal_verl_kl_loss(kind, name, mode):
    x = D["lp"].clone().requires_grad_(True)
    loss = ca.agg_loss(ca.kl_penalty(x, D["ref"], kind), D["mask"].bool(), mode, **TRAINER)
    (grad,) = torch.autograd.grad(loss, x)
    assert_same(lab_loss(name, mode, ref_log_prob=D["ref"]), (loss.detach(), grad), f"{name} vs verl {kind}")


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_equals_verl_agg_loss_with_the_trainer_batch_information(mode):
    loss_mat = torch.randn(B, T, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ours = agg_loss(loss_mat, D["mask"], mode)
    assert float((ours - ca.agg_loss(loss_mat, D["mask"].bool(), mode, **TRAINER)).abs()) <= 1e-12
    # on its own (no global batch information) verl divides the seq-mean-* modes by the 7 non-empty rows, not 8
    alone = ca.agg_loss(loss_mat, D["mask"].bool(), mode)
    expected = 1.0 if mode == "token-mean" else B / 7
    assert float(alone / ours) == pytest.approx(expected, rel=1e-7)


# ---------------------------------------------------------------------------------- the exporter, in verl's registry
EXPORTABLE = [n for n in estimators.names() if not estimators.info(n).inputs and not estimators.info(n).fixed_agg]


@pytest.fixture(scope="module")
def registered():
    """Every exportable lab estimator registered in verl's registry as lab_<name> (removed afterwards)."""
    names = {n: f"lab_{n}" for n in EXPORTABLE}
    for name, key in names.items():
        ca.register_policy_loss(key)(estimators.to_verl(name))
    yield {name: ca.get_policy_loss_fn(key) for name, key in names.items()}
    for key in names.values():
        ca.POLICY_LOSS_REGISTRY.pop(key, None)


def test_every_estimator_without_extra_inputs_is_exportable():
    assert {"reinforce", "seq_is", "token_is", "ppo_clip", "tis_token", "tis_seq", "mis_token", "mis_seq", "cispo",
            "sapo", "gspo", "gmpo", "vespo"} <= set(EXPORTABLE)
    for name in ("gvpo", "kl_k3", "vopd"):
        with pytest.raises(LabError, match="to_verl"):
            estimators.to_verl(name)


@pytest.mark.parametrize("mode", VERL_MODES)
@pytest.mark.parametrize("name", EXPORTABLE)
def test_exported_estimator_equals_the_lab_function(registered, name, mode):
    # verl's config fields set to the lab's defaults: in the trainer regime the exported loss is the lab's loss
    # (token-sum, which the lab does not have, is the token-mean loss times the number of real tokens)
    defaults = estimators.info(name).defaults
    config = actor(TRAINER, **{k: defaults[k] for k in estimators.export.VERL_FIELDS if k in defaults})
    ours = lab_loss(name, "token-mean" if mode == "token-sum" else mode)
    if mode == "token-sum":
        ours = (ours[0] * D["mask"].sum(), ours[1] * D["mask"].sum(), ours[2])
    theirs = verl_loss(registered[name], mode, config)
    assert_same(ours, theirs, f"exported {name} ({mode})")
    assert all(isinstance(v, float) for v in theirs[2].values())


EXPORTED_PAIRS = [(v, n, f) for v, n, f, _, _ in POLICY_LOSSES]


@pytest.mark.parametrize("regime", ["trainer", "alone"])
@pytest.mark.parametrize("with_weights", [False, True])
@pytest.mark.parametrize("verl_name,name,fields", EXPORTED_PAIRS)
def test_exported_estimator_equals_verl_in_both_aggregation_regimes(registered, verl_name, name, fields, with_weights,
                                                                    regime):
    modes = {"sapo": ["seq-mean-token-mean"], "geo_mean": ["token-mean"]}.get(verl_name, VERL_MODES)
    weights = D["weights"] if with_weights else None
    for mode in modes:
        config = actor(TRAINER if regime == "trainer" else None, **fields)
        ours_mode = "seq-mean-token-mean" if verl_name in ("sapo", "geo_mean") else mode
        theirs = verl_loss(ca.get_policy_loss_fn(verl_name), mode, config, weights)
        ours = verl_loss(registered[name], ours_mode, config, weights)
        if verl_name == "geo_mean" and regime == "alone":
            # verl's geo_mean ignores agg_loss and its batch information (torch.mean over all 8 rows); the exported
            # GMPO aggregates like every other verl loss: on its own, over the 7 non-empty rows
            ours = (ours[0] * 7 / B, ours[1] * 7 / B, ours[2])
        assert_same(ours, theirs, f"exported {name} vs verl {verl_name} ({mode}, {regime}, weights={with_weights})")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("level,threshold,name", BYPASS)
def test_exported_corrections_equal_verl_bypass_on_their_own(registered, level, threshold, name, mode):
    correction = RolloutCorrectionConfig(rollout_is=level, rollout_is_threshold=threshold, bypass_mode=True,
                                         loss_type="reinforce")
    config = actor(None, policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=correction))
    theirs = verl_loss(ca.get_policy_loss_fn("bypass_mode"), mode, config)
    assert_same(verl_loss(registered[name], mode, config), theirs, f"exported {name} vs bypass alone ({mode})")


def test_exported_vespo_reads_verl_config_and_folds_rollout_weights(registered):
    # rollout_is_weights w = pi_old / mu per token: the same as the lab's rollout_log_probs = old - log w
    w = D["weights"]
    theirs = verl_loss(registered["vespo"], "token-mean", actor(TRAINER), weights=w)
    ours = lab_loss("vespo", "token-mean", rollout_log_probs=D["old"] - torch.log(w.clamp(min=1e-8)))
    assert_same(ours, theirs, "vespo with rollout_is_weights")
    # hyper-parameters under policy_loss.vespo, the key VESPO's reference code reads (a plain dict config here)
    config = {"policy_loss": {"vespo": {"k_pos": 1.5, "lambda_neg": 2.5}}, "global_batch_info": TRAINER}
    theirs = verl_loss(registered["vespo"], "token-mean", config)
    assert_same(lab_loss("vespo", "token-mean", k_pos=1.5, lambda_neg=2.5), theirs, "vespo hyper from config")
    # values given to to_verl are fixed and win over the config
    fixed = estimators.to_verl("vespo", k_pos=2.5)
    assert_same(verl_loss(fixed, "token-mean", config), lab_loss("vespo", "token-mean", k_pos=2.5, lambda_neg=2.5),
                "to_verl(vespo, k_pos=2.5)")


def test_exporter_reads_verl_clip_ratio_fallbacks_and_refuses_bad_values(registered):
    # verl: clip_ratio_low/high fall back to clip_ratio when None
    config = actor(TRAINER, clip_ratio=0.3, clip_ratio_low=None, clip_ratio_high=None)
    theirs = verl_loss(ca.get_policy_loss_fn("vanilla"), "token-mean", config)
    assert_same(verl_loss(registered["ppo_clip"], "token-mean", config), theirs, "clip_ratio fallback")
    assert estimators.export.verl_hyper("ppo_clip", config) == {"clip_ratio_low": 0.3, "clip_ratio_high": 0.3,
                                                                "clip_ratio_c": 3.0}
    with pytest.raises(LabError, match="tau_neg must be a finite number > 0"):
        verl_loss(registered["sapo"], "seq-mean-token-mean", actor(TRAINER, tau_neg=-1.0))
    with pytest.raises(LabError, match="global batch information"):
        verl_loss(registered["ppo_clip"], "seq-mean-token-mean", actor({"dp_size": 2}))


def test_exported_loss_by_hand_on_its_own_divides_by_non_empty_rows(registered):
    # one row of three is empty; REINFORCE with A = 1 and log pi = -1 on 2 + 1 real tokens:
    # seq-mean-token-sum alone (verl): (2 + 1) / 2 non-empty rows = 1.5; in the trainer regime (3 rows): 1.0
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    lp = torch.full((3, 2), -1.0, dtype=torch.float64)
    fn = registered["reinforce"]
    alone, _ = fn(lp, lp, torch.ones(3, 2, dtype=torch.float64), mask.bool(), "seq-mean-token-sum", actor())
    trainer, _ = fn(lp, lp, torch.ones(3, 2, dtype=torch.float64), mask.bool(), "seq-mean-token-sum",
                    actor(dict(global_batch_size=3, dp_size=1)))
    assert float(alone) == pytest.approx(1.5) and float(trainer) == pytest.approx(1.0)
    lab, _ = estimators.get("reinforce")(lp, lp, torch.ones(3, 2, dtype=torch.float64), mask, "seq-mean-token-sum")
    assert float(lab) == pytest.approx(1.0) and math.isclose(float(trainer), float(lab))
