"""The training simulator (lab/engine/training.py): the N = 1 identity, learning, staleness regimes, collapse, bad
input (the staleness_training study built on it has its tests in its folder)."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

import toy_envs
from lab.errors import LabError
from lab.estimators import registry
from lab.estimators.aggregation import agg_loss
from lab.engine.training import TrainConfig, collapse_flags, reward_range, train

FAST = dict(env="tiny_parity", rollout_batch=32, group_size=4, steps=6)  # J_0 ~ 0.47: every rollout carries signal
RATIO_BASED = ["seq_is", "token_is", "ppo_clip", "tis_token", "tis_seq", "mis_token", "mis_seq", "vespo", "cispo",
               "gspo", "gmpo"]


@pytest.fixture
def test_estimators():
    """Estimators registered for these tests only (removed afterwards): a spy that records whether it received
    rollout_log_probs, one that ascends -J (a run that must collapse), one whose loss is NaN."""
    seen = []

    @registry.register("_spy", family="test", source="test", unbiased_for="test",
                       optional_inputs=("rollout_log_probs",))
    def spy(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean", *, rollout_log_probs=None):
        seen.append(None if rollout_log_probs is None else rollout_log_probs.detach().clone())
        return agg_loss(-advantages * log_prob, response_mask, loss_agg_mode), {}

    @registry.register("_anti", family="test", source="test", unbiased_for="-grad J")
    def anti(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean"):
        return agg_loss(advantages * log_prob, response_mask, loss_agg_mode), {}

    @registry.register("_nan", family="test", source="test", unbiased_for="nothing")
    def nan(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode="token-mean"):
        return agg_loss(advantages * log_prob, response_mask, loss_agg_mode) * math.nan, {}

    yield seen
    for name in ("_spy", "_anti", "_nan"):
        registry._REGISTRY.pop(name)


# ------------------------------------------------------------------------------------------ the identity
@pytest.mark.slow
def test_n1_on_policy_every_ratio_estimator_trains_exactly_like_reinforce():
    # N = 1, sync, no mismatch: pi = pi_old = mu at each update, delta_t = 0 exactly, rho = W = 1, and each estimator's
    # gradient is REINFORCE's -A grad log pi (PPO clip inactive at rho = 1, phi(1) = 1, min(1, C) = 1, ...).
    base = train(TrainConfig(**FAST, record_params=True), progress=False)
    assert (base.table["grad_norm"] > 0).sum() >= 4  # the updates are not vacuous
    assert base.params.shape == (6 + 1, base.params.shape[1])
    for name in RATIO_BASED:
        run = train(TrainConfig(**FAST, estimator=name, record_params=True), progress=False)
        diff = float((run.params - base.params).abs().max())
        assert diff <= 1e-6, f"{name} departs from reinforce by {diff}"
        np.testing.assert_allclose(run.table["expected_reward"], base.table["expected_reward"], atol=1e-6)
    # ... and the identity can fail: with N = 4 the stale mini-batches make token IS differ from REINFORCE
    stale = dict(FAST, minibatches=4, record_params=True)
    a = train(TrainConfig(**stale), progress=False)
    b = train(TrainConfig(**stale, estimator="token_is"), progress=False)
    assert float((a.params - b.params).abs().max()) > 1e-3


@pytest.mark.slow
def test_training_improves_expected_reward_on_tiny_target():
    run = train(TrainConfig(env="tiny_target", steps=30, seed=0), progress=False)
    s = run.summary
    # uniform-ish start: J_0 ~ 1/256 (a 4-token exact match over V = 4); 30 REINFORCE-RLOO rollouts lift it far
    assert s["initial_expected_reward"] < 0.01
    assert s["final_expected_reward"] > 0.2
    assert s["first_collapse_update"] is None and not run.table["collapsed"].any()
    assert run.table["kl_to_init"].iloc[-1] > 0.5
    assert run.table["entropy"].iloc[-1] < run.table["entropy"].iloc[0]


# ------------------------------------------------------------------------------------------ staleness
@pytest.mark.slow
def test_minibatch_staleness_shows_up_in_the_version_lag():
    run = train(TrainConfig(**dict(FAST, steps=2), minibatches=4, epochs=2), progress=False)
    t = run.table
    assert len(t) == 2 * 4 * 2 and list(t["update"]) == list(range(1, 17))
    # mini-batch j of epoch e is e N + j updates behind the version that sampled it: the same lag for all its rows
    np.testing.assert_array_equal(t["lag_min"], t["epoch"] * 4 + t["minibatch"])
    np.testing.assert_array_equal(t["lag_max"], t["lag_min"])
    assert sorted(set(t["lag_mean"])) == [0, 1, 2, 3, 4, 5, 6, 7]
    # mu = pi exactly on the first mini-batch of each rollout, not after it
    first = t[t["lag_mean"] == 0]
    assert (first["ess_frac"] == 1).all() and (first["chi2_seq_sampled"].abs() < 1e-12).all()
    stale = t[t["lag_mean"] > 0]
    assert (stale["k3_token"] > 0).all() and (stale["ess_frac"] < 1).all()
    assert run.summary["max_lag"] == 7


def rollouts(run):
    return pd.DataFrame(run.summary["rollouts"])


@pytest.mark.slow
def test_async_lag_respects_eta_with_drop_and_requeue_and_exceeds_it_with_keep():
    common = dict(FAST, steps=10, regime="async", lag_dist="uniform", lag_max=4, eta=1)
    drop = rollouts(train(TrainConfig(**common, over_stale="drop"), progress=False))
    assert (drop["gen_lag_max"] <= 1).all() and (drop["n_over_stale_groups"] == 0).all()
    assert drop["dropped"].sum() > 0 and drop["requeued"].sum() == 0 and drop["kept_over_stale"].sum() == 0
    # a lag cannot exceed the versions that exist: rollout r starts at version r (N = 1, one epoch)
    assert (drop["gen_lag_max"] <= drop["version"]).all()

    req = rollouts(train(TrainConfig(**common, over_stale="requeue"), progress=False))
    assert (req["gen_lag_max"] <= 1).all() and req["requeued"].sum() > 0 and req["dropped"].sum() == 0
    assert (req["n_lag0_groups"] >= req["requeued"]).all()  # a requeued group is regenerated by the current version

    keep_run = train(TrainConfig(**common, over_stale="keep"), progress=False)
    keep = rollouts(keep_run)
    assert (keep["kept_over_stale"] == keep["n_over_stale_groups"]).all() and keep["kept_over_stale"].sum() > 0
    assert keep["gen_lag_max"].max() > 1 and keep["dropped"].sum() == 0 and keep["requeued"].sum() == 0
    # with N = 1 the update lag is the generation lag; the table agrees with the rollout records
    np.testing.assert_array_equal(keep_run.table["lag_max"], keep["gen_lag_max"])
    # uniform on 0..4, cut at the version: with eta = 1 about 3/5 of the later groups are over-stale (8 per rollout)
    late = keep[keep["version"] >= 4]
    share = late["kept_over_stale"].sum() / (8 * len(late))
    assert 0.35 < share < 0.85


@pytest.mark.slow
def test_async_with_zero_lag_is_the_sync_run():
    sync = train(TrainConfig(**FAST), progress=False)
    asyn = train(TrainConfig(**FAST, regime="async", lag_dist="constant", lag_max=0, eta=0), progress=False)
    cols = ["expected_reward", "loss", "grad_norm", "lag_max"]
    pd.testing.assert_frame_equal(sync.table[cols], asyn.table[cols])


@pytest.mark.slow
def test_async_stale_groups_carry_their_versions_log_probs():
    # old_log_prob is the generating version's (two-policy): stale groups show mu != pi at the first mini-batch
    run = train(TrainConfig(**dict(FAST, steps=8), regime="async", lag_dist="constant", lag_max=2, eta=2),
                progress=False)
    t = run.table
    assert list(t["lag_max"]) == [0, 1, 2, 2, 2, 2, 2, 2]
    assert (t["k3_token"].iloc[1:] > 0).all() and t["k3_token"].iloc[0] == 0


# ------------------------------------------------------------------------------------------ mismatch
@pytest.mark.slow
def test_mismatch_records_behaviour_log_probs_different_from_pi_old(test_estimators):
    neutral = train(TrainConfig(**FAST, regime="mismatch"), progress=False)
    assert (neutral.table["mismatch_abs_logprob"] < 1e-5).all()  # no perturbation: mu = pi_old up to rounding
    for knob in (dict(logprob_noise=0.3), dict(sampler_temperature=1.5), dict(router_flip_p=0.5)):
        run = train(TrainConfig(**FAST, regime="mismatch", **knob), progress=False)
        assert (run.table["mismatch_abs_logprob"] > 0.01).all(), knob
    # the router flips each (response, position) with probability p: 6 rollouts x 32 responses x 4 positions
    n = 6 * 32 * 4
    flips = train(TrainConfig(**FAST, regime="mismatch", router_flip_p=0.25), progress=False).summary["router_flips"]
    assert abs(flips - 0.25 * n) < 5 * math.sqrt(n * 0.25 * 0.75)


@pytest.mark.slow
def test_mismatch_passes_rollout_log_probs_to_estimators_that_take_them(test_estimators):
    seen = test_estimators
    train(TrainConfig(**FAST, estimator="_spy", regime="mismatch", logprob_noise=0.2), progress=False)
    assert len(seen) == 6 and all(x is not None and x.shape == (32, 4) for x in seen)
    assert all((x <= 0).all() for x in seen)
    seen.clear()
    train(TrainConfig(**FAST, estimator="_spy"), progress=False)  # sync: a two-policy batch, nothing extra
    assert len(seen) == 6 and all(x is None for x in seen)
    # VESPO folds log(pi_old / mu) into L only when it receives them: its metric appears in the mismatch regime only
    v = train(TrainConfig(**FAST, estimator="vespo", regime="mismatch", logprob_noise=0.2), progress=False).table
    assert "est_seq_log_tis_mean" in v and (v["est_seq_log_tis_mean"].abs() > 0).all()
    assert "est_seq_log_tis_mean" not in train(TrainConfig(**FAST, estimator="vespo"), progress=False).table
    # reinforce takes no rollout_log_probs: the mismatch regime runs it without them (no TypeError)
    train(TrainConfig(**dict(FAST, steps=1), regime="mismatch", logprob_noise=0.2), progress=False)


# ------------------------------------------------------------------------------------------ collapse
def test_collapse_rule_by_hand():
    ones = [True] * 5
    # reward collapse: best so far [0.2, 0.6, 0.9, 0.9, 0.9]; loss from best [0, 0, 0, 0.4, 0.6]; range 1, drop 0.5
    flags = collapse_flags([0.2, 0.6, 0.9, 0.5, 0.3], [1.0] * 5, ones, 0.0, 1.0, 4, warmup=2, drop=0.5)
    assert list(flags) == [False, False, False, False, True]
    # the warm-up: a drop of 0.6 at update index 1 counts only once u >= warmup
    assert list(collapse_flags([0.9, 0.3], [1.0, 1.0], [True, True], 0.0, 1.0, 4, warmup=2)) == [False, False]
    assert list(collapse_flags([0.9, 0.3], [1.0, 1.0], [True, True], 0.0, 1.0, 4, warmup=1)) == [False, True]
    # entropy collapse: floor 0.05 log 4 = 0.0693; H = 0.01 collapses with J = 0.2 < 0.5, not with J = 0.8
    assert list(collapse_flags([0.2, 0.8], [0.01, 0.01], [True, True], 0.0, 1.0, 4)) == [True, False]
    # any non-finite value
    assert list(collapse_flags([0.5, 0.5, np.nan], [1.0, 1.0, 1.0], [True, False, True], 0.0, 1.0, 4)) == \
        [False, True, True]
    assert reward_range(toy_envs.make("tiny_target")) == (0.0, 1.0)


@pytest.mark.slow
def test_collapse_fires_on_a_collapsing_run_and_not_on_a_healthy_one(test_estimators):
    healthy = train(TrainConfig(**dict(FAST, steps=20)), progress=False)
    assert healthy.summary["first_collapse_update"] is None and not healthy.table["collapsed"].any()
    # ascending -J: the policy turns deterministic on wrong answers (entropy collapse while J is low)
    # (per-token entropy < 0.05 log 4 = 0.069 while J < 1/2; seed 0 gets there after about 10 updates)
    anti = train(TrainConfig(**dict(FAST, steps=20), estimator="_anti", lr=1.0), progress=False)
    first = anti.summary["first_collapse_update"]
    assert first is not None and 5 <= first <= 20
    assert anti.table["collapsed"].iloc[first - 1:].all() and not anti.table["collapsed"].iloc[:first - 1].any()
    assert anti.table["entropy"].iloc[first - 1] < 0.05 * math.log(4) and anti.summary["final_expected_reward"] < 0.01
    # a NaN loss: flagged at the first update, and the run stops there
    nan = train(TrainConfig(**FAST, estimator="_nan"), progress=False)
    assert nan.summary["first_collapse_update"] == 1 and nan.summary["stopped_early"] and len(nan.table) == 1


# ------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("overrides, words", [
    (dict(minibatches=3), "do not divide"),
    (dict(eta=-1), "eta"),
    (dict(regime="replay"), "regime must be one of"),
    (dict(group_size=1, rollout_batch=8, advantage="rloo"), "at least 2"),
    (dict(estimator="gvpo", group_size=8, minibatches=16), "whole groups"),
    (dict(estimator="opd"), "does not estimate a reward gradient"),
    (dict(estimator="nope"), "unknown estimator"),
    (dict(logprob_noise=0.1), "applies only with regime mismatch"),
    (dict(regime="mismatch", router_flip_p=1.5), "router_flip_p"),
    (dict(regime="async", over_stale="wait"), "over_stale must be one of"),
    (dict(lr=0.0), "lr must be > 0"),
    (dict(steps=0), "steps"),
])
def test_bad_input_raises_lab_error(overrides, words):
    with pytest.raises(LabError, match=words):
        train(TrainConfig(**overrides))


def test_drop_that_cannot_fill_a_rollout_is_refused():
    certain = TrainConfig(**dict(FAST, steps=5), regime="async", lag_dist="constant", lag_max=3, eta=0,
                          over_stale="drop")
    with pytest.raises(LabError, match="would drop them all"):  # known before any work
        certain.validate()
    nearly = TrainConfig(**dict(FAST, steps=5), regime="async", lag_dist="geometric", lag_p=1e-6, lag_max=10_000,
                         eta=0, over_stale="drop")
    nearly.validate()
    with pytest.raises(LabError, match="cannot fill"):  # found while drawing
        train(nearly, progress=False)


# ------------------------------------------------------------------------------------------ reproducibility
@pytest.mark.slow
def test_same_seed_same_table_other_seed_differs():
    cfg = dict(FAST, steps=4, regime="async", lag_max=3, eta=1, over_stale="requeue", minibatches=2)
    a = train(TrainConfig(**cfg, seed=3), progress=False)
    b = train(TrainConfig(**cfg, seed=3), progress=False)
    pd.testing.assert_frame_equal(a.table, b.table)
    assert a.summary == b.summary or math.isnan(a.summary["final_expected_reward"])
    c = train(TrainConfig(**cfg, seed=4), progress=False)
    assert not np.allclose(a.table["expected_reward"], c.table["expected_reward"])
    m = dict(FAST, steps=3, regime="mismatch", logprob_noise=0.1, router_flip_p=0.2, sampler_temperature=1.2)
    pd.testing.assert_frame_equal(train(TrainConfig(**m), progress=False).table,
                                  train(TrainConfig(**m), progress=False).table)
