"""Parity with verl 0.9.1's own code for the corrections it shipped in 2026: its policy losses dppo_tv, dppo_kl, dro,
gpg, clip_cov and kl_cov, its GPG advantage, and every rollout-correction preset of RolloutCorrectionConfig run the
way its trainer runs them (decoupled mode: ``compute_rollout_correction_and_rejection_mask`` then the vanilla loss
on the rejection-masked response_mask, whose tokens the trainer counts; bypass mode: ``compute_policy_loss_bypass_mode``
with old_log_prob = the sampler's). Each is compared with the lab's estimator (or ``verl:NAME`` preset) on batches
with ragged rows, an empty row and both advantage signs, in every aggregation mode, to 1e-6 in loss and gradient.

Needs verl, installed without its dependencies (see tests/test_parity_verl.py).
"""
import numpy as np
import pytest
import torch

from test_parity_verl import B, D, LENGTHS, TRAINER, T, actor, assert_same, ca, lab_loss, verl_loss  # noqa: E402
from verl.trainer.config import RolloutCorrectionConfig  # noqa: E402
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask  # noqa: E402
from verl.workers.config import PolicyLossConfig  # noqa: E402

from lab import advantages, estimators  # noqa: E402
from lab.estimators.aggregation import AGG_MODES  # noqa: E402
from lab.estimators.covariance import covariance  # noqa: E402
from lab.estimators.presets import VERL_PRESETS  # noqa: E402
from shipped_code import permutation_keys  # noqa: E402

# (verl loss, lab estimator, ActorConfig fields, lab hyper-parameters)
LOSSES = [
    ("dppo_tv", "dppo_tv", {}, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}),  # ActorConfig
    ("dppo_tv", "dppo_tv", {"clip_ratio_low": 0.15, "clip_ratio_high": 0.15, "clip_ratio_c": 10000.0}, {}),  # example
    ("dppo_kl", "dppo_kl", {}, {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}),
    ("dppo_kl", "dppo_kl", {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05, "clip_ratio_c": 10000.0}, {}),
    ("dppo_kl", "dppo_kl", {"clip_ratio_low": 0.05, "clip_ratio_high": 0.05, "clip_ratio_c": 1.5},
     {"clip_ratio_c": 1.5}),  # a cap that binds
    ("dro", "dro", {"policy_loss": PolicyLossConfig(loss_mode="dro", dro_beta=0.05)}, {}),
    ("dro", "dro", {"policy_loss": PolicyLossConfig(loss_mode="dro", dro_beta=0.7)}, {"beta": 0.7}),
    ("gpg", "gpg", {}, {}),
    ("kl_cov", "kl_cov", {}, {}),  # PolicyLossConfig's kl_cov_ratio 0.0002, ppo_kl_coef 0.1
    ("kl_cov", "kl_cov", {"policy_loss": PolicyLossConfig(loss_mode="kl_cov", kl_cov_ratio=0.3, ppo_kl_coef=1.0)},
     {"kl_cov_ratio": 0.3, "ppo_kl_coef": 1.0}),
]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("verl_name,name,fields,hyper", LOSSES)
def test_policy_loss_equals_verl_under_the_trainer_aggregation(verl_name, name, fields, hyper, mode):
    theirs = verl_loss(ca.get_policy_loss_fn(verl_name), mode, actor(TRAINER, **fields))
    assert_same(lab_loss(name, mode, **hyper), theirs, f"{name} vs verl {verl_name} {fields} ({mode})")


def test_the_dppo_masks_and_caps_bind_on_the_batch():
    for name, hyper in [("dppo_tv", {}), ("dppo_kl", {}), ("dppo_kl", {"clip_ratio_c": 1.5})]:
        m = lab_loss(name, "token-mean", **hyper)[2]
        assert 0 < float(m["clipfrac"]) < 1, name
    assert float(lab_loss("dppo_kl", "token-mean", clip_ratio_c=1.5)[2]["is_trunc_frac"]) > 0


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("ratio", [0.0002, 0.3])
def test_clip_cov_equals_verl_given_its_random_permutation(mode, ratio):
    """verl draws torch.randperm over the candidate tokens (cov in (1, 5), not clipped by PPO); keys built from the
    same draw make the lab choose the same tokens."""
    adv = D["adv"] * 4.0  # covariances in (1, 5) for several tokens
    keys, n = permutation_keys(_candidates(adv), seed=3)
    assert n >= 3
    config = actor(TRAINER, policy_loss=PolicyLossConfig(loss_mode="clip_cov", clip_cov_ratio=ratio))
    torch.manual_seed(3)
    x = D["lp"].clone().requires_grad_(True)
    loss, _ = ca.get_policy_loss_fn("clip_cov")(D["old"], x, adv, D["mask"].bool(), mode, config)
    theirs = (loss.detach(), torch.autograd.grad(loss, x)[0])
    y = D["lp"].clone().requires_grad_(True)
    ours_loss, m = estimators.get("clip_cov")(y, D["old"], adv, D["mask"], loss_agg_mode=mode, clip_cov_ratio=ratio,
                                             selection_keys=keys)
    assert_same((ours_loss.detach(), torch.autograd.grad(ours_loss, y)[0]), theirs, f"clip_cov {ratio} ({mode})")
    assert float(m["clipfrac"]) > 0


def _candidates(adv):
    """verl's Clip-Cov candidates: real tokens PPO did not clip whose covariance lies in (1, 5)."""
    ratio = torch.exp(D["lp"] - D["old"])
    mask = D["mask"]
    by_origin = (-adv * torch.clamp(ratio, 0.8, 1.2) > -adv * ratio) & (mask > 0)
    cov = covariance(adv, D["lp"], mask, eps=1e-8)
    return (mask > 0) & ~by_origin & (cov > 1.0) & (cov < 5.0)


def test_gpg_advantage_equals_verl():
    g = torch.Generator().manual_seed(4)
    rewards = (torch.rand(12, generator=g) > 0.6).double() * torch.rand(12, generator=g, dtype=torch.float64)
    mask = torch.ones(12, 3, dtype=torch.float64)
    token_rewards = torch.zeros(12, 3, dtype=torch.float64)
    token_rewards[:, -1] = rewards
    index = np.repeat(np.arange(3), 4)
    theirs, _ = ca.compute_gpg_outcome_advantage(token_rewards, mask, index)
    ours = advantages.group_advantages(rewards.reshape(3, 4), "gpg").reshape(12)
    assert torch.allclose(theirs[:, 0], ours, rtol=1e-12, atol=1e-12)
    assert int((rewards != 0).sum()) < 12  # alpha = 12 / (non-zero rewards) > 1


# ------------------------------------------------------------------------------------------ presets
def _rs_batch(seed=7):
    """Rows whose sampler is within 3e-4 of pi and pi_old (kept by every band), rows whose sampler is near pi_old
    but pi has moved (decoupled keeps, bypass rejects), and rows far from both (rejected)."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    lp = -2.0 * torch.rand(B, T, generator=g, dtype=torch.float64)
    kind = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])[:, None]  # near both, near pi_old only, far
    tiny = 3e-4 * (2 * torch.rand(B, T, generator=g, dtype=torch.float64) - 1)
    wide = 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    old = torch.where(kind == 0, lp + tiny, lp + wide).clamp(max=0.0)
    mu = torch.where(kind == 2, old + wide.flip(0), old + tiny.flip(1)).clamp(max=0.0)
    return dict(mask=mask, lp=lp, old=old, mu=mu, adv=D["adv"])


R = _rs_batch()


def _preset_config(name):
    return getattr(RolloutCorrectionConfig, name)()


def _verl_preset(name, mode):
    cfg = _preset_config(name)
    x = R["lp"].clone().requires_grad_(True)
    if cfg.bypass_mode:
        config = actor(TRAINER, policy_loss=PolicyLossConfig(loss_mode="bypass_mode", rollout_correction=cfg))
        loss, _ = ca.get_policy_loss_fn("bypass_mode")(R["mu"], x, R["adv"], R["mask"].bool(), mode, config)
    else:  # the trainer: correction and rejection on (pi_old, mu), then the actor's vanilla loss on the new mask
        proto, kept, _ = compute_rollout_correction_and_rejection_mask(
            old_log_prob=R["old"], rollout_log_prob=R["mu"], response_mask=R["mask"], rollout_is=cfg.rollout_is,
            rollout_is_threshold=cfg.rollout_is_threshold, rollout_rs=cfg.rollout_rs,
            rollout_rs_threshold=cfg.rollout_rs_threshold)
        weights = None if proto is None else proto.batch["rollout_is_weights"]
        info = dict(dp_size=1, batch_num_tokens=int(kept.sum()), global_batch_size=B, loss_scale_factor=None)
        loss, _ = ca.get_policy_loss_fn("vanilla")(R["old"], x, R["adv"], kept.bool(), mode, actor(info), weights)
    return loss.detach(), torch.autograd.grad(loss, x)[0]


def _lab_preset(name, mode):
    info = estimators.info(f"verl:{name}")
    x = R["lp"].clone().requires_grad_(True)
    if info.three_policy:
        loss, _ = info.fn(x, R["old"], R["adv"], R["mask"], loss_agg_mode=mode, rollout_log_probs=R["mu"])
    else:  # bypass: verl's trainer sets old_log_prob = rollout_log_prob
        loss, _ = info.fn(x, R["mu"], R["adv"], R["mask"], loss_agg_mode=mode)
    return loss.detach(), torch.autograd.grad(loss, x)[0]


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", list(VERL_PRESETS))
def test_every_verl_preset_equals_verl_trainer(name, mode):
    assert _preset_config(name).bypass_mode == (not VERL_PRESETS[name].decoupled)
    assert_same(_lab_preset(name, mode), _verl_preset(name, mode), f"verl:{name} ({mode})")


@pytest.mark.parametrize("name", [n for n, p in VERL_PRESETS.items() if p.estimator in ("geo_rs", "k3_rs")])
def test_the_rejection_keeps_some_rows_and_drops_others(name):
    cfg = _preset_config(name)
    log_ratio = (R["lp"] - R["mu"]) if cfg.bypass_mode else (R["old"] - R["mu"])
    _, kept, _ = compute_rollout_correction_and_rejection_mask(
        old_log_prob=R["mu"] + log_ratio, rollout_log_prob=R["mu"], response_mask=R["mask"],
        rollout_rs=cfg.rollout_rs, rollout_rs_threshold=cfg.rollout_rs_threshold)
    rows = kept.sum(-1) > 0
    real = R["mask"].sum(-1) > 0
    assert bool(rows.any()) and bool((~rows & real).any()), name


def test_preset_names_resolve_through_the_registry():
    assert estimators.info("verl:decoupled_geo_rs").three_policy
    assert not estimators.info("verl:bypass_pg_geo_rs").three_policy
    assert estimators.info("verl:bypass_pg_geo_rs").defaults["bypass_loss"] == "reinforce"
    with pytest.raises(Exception, match="unknown estimator or preset"):
        estimators.info("verl:no_such_preset")
