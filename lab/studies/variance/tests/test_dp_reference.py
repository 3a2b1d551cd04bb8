"""The variance study's dynamic-programming reference: the same numbers as enumeration where both run (grad J, J,
the divergences, the exact bias of token IS and REINFORCE), the default picks it where enumeration is too large, and
bad combinations are one line before any work."""
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

import toy_envs
from lab import advantages as adv_mod
from lab.engine import dp
from lab.engine.batches import draw_batches
from lab.engine.estimator import Estimator
from lab.engine.gradients import replicate_gradients
from lab.errors import LabError
from lab.policies import Perturbed, init_params, make_policy
from lab.studies.variance.study import Config, run

SMALL = dict(policy="markov", replicates=24, n_boot=50, trajectory_steps=6, advantage="reward",
             estimators=["reinforce", "token_is", "seq_is", "ppo_clip"])
DIVERGENCES = ("kl_seq", "kl_token", "chi2_seq", "chi2_token", "logw_var", "mean_len")


@pytest.mark.slow
@pytest.mark.parametrize("env,staleness,values,agg", [
    ("small_dense", "lag", [0, 3], "seq-mean-token-sum"),
    ("small_eos", "temperature", [1.0, 1.6], "seq-mean-token-sum-norm"),
    ("tiny_parity", "lag", [2], "token-mean")])
def test_dp_reference_equals_enumeration(env, staleness, values, agg):
    cfg = dict(SMALL, env=env, staleness=staleness, values=values, loss_agg_mode=agg, exact_directions=True)
    exact, by_dp = run(Config(**cfg, reference="exact")), run(Config(**cfg, reference="dp"))
    se, sd = exact.summary, by_dp.summary
    assert (se["reference"], sd["reference"]) == ("exact", "dp") and sd["reference_pairs"] == 0
    assert sd["target_grad_norm"] == pytest.approx(se["target_grad_norm"], rel=1e-10, abs=1e-12)
    assert sd["objective"] == pytest.approx(se["objective"], rel=1e-10, abs=1e-12)
    for a, b in zip(se["per_value"], sd["per_value"]):
        for k in DIVERGENCES:
            assert b[k] == pytest.approx(a[k], rel=1e-10, abs=1e-12), k
    key = ["staleness", "estimator", "metric"]
    re, rd = (r.results.set_index(key).sort_index() for r in (exact, by_dp))
    exact_only = re.index.get_level_values("metric").str.startswith("exact_")
    exact_rows = re[exact_only]
    dp_names = set(dp.EXACT_ESTIMATORS)
    expected_rows = exact_rows[exact_rows.index.get_level_values("estimator").isin(dp_names)]
    got = rd[rd.index.get_level_values("metric").str.startswith("exact_")]
    assert set(got.index) == set(expected_rows.index) and len(got) > 0
    assert np.allclose(got.value.sort_index(), expected_rows.value.sort_index(), rtol=1e-10, atol=1e-10)
    assert got.xs("exact_bias_norm", level="metric").value.max() > 1e-4  # off-policy: the check is not vacuous
    # everything sampled is drawn from the same batches: equal up to the truth's float64 rounding
    sampled = re[~exact_only]
    other = rd.loc[sampled.index]
    assert np.allclose(other[["value", "lo", "hi"]], sampled[["value", "lo", "hi"]], rtol=1e-6, atol=1e-9,
                       equal_nan=True)


def test_dp_expected_estimate_rloo_is_the_baseline_expectation():
    """advantage rloo: E_mu[(R - E_mu[R | x]) sum_t w_t grad log pi]; drgrpo (G - 1) / G of it; reward without the
    baseline; None where the DP does not give the mean exactly."""
    env = toy_envs.make("long_dense", length=12)
    policy = make_policy("markov", env)
    g = torch.Generator().manual_seed(0)
    theta = init_params(policy, 1.0, g)
    mu = (Perturbed(policy, policy.noise_table(g), 0.5), theta)
    token_is = Estimator.resolve("token_is", {}, "seq-mean-token-sum")
    with_b = dp.expected_token_gradient(env, policy, theta, mu, True, baseline=True).reshape(-1)
    rloo = dp.expected_estimate(env, policy, theta, mu, token_is, "rloo", 8)
    assert torch.equal(rloo, with_b)
    assert torch.allclose(dp.expected_estimate(env, policy, theta, mu, token_is, "drgrpo", 8), 7 / 8 * with_b)
    norm = Estimator.resolve("reinforce", {}, "seq-mean-token-sum-norm")
    plain = dp.expected_token_gradient(env, policy, theta, mu, False).reshape(-1)
    assert torch.allclose(dp.expected_estimate(env, policy, theta, mu, norm, "reward", 8), plain / 12)
    assert dp.expected_estimate(env, policy, theta, mu, token_is, "grpo", 8) is None
    assert dp.expected_estimate(env, policy, theta, mu, Estimator.resolve("seq_is", {}), "reward", 8) is None
    far = (Perturbed(policy, policy.noise_table(g), 40.0), theta)  # log-ratios beyond the +-20 clamp
    assert dp.expected_estimate(env, policy, theta, far, token_is, "reward", 8) is None
    eos = toy_envs.make("long_eos", length=12)
    tm = Estimator.resolve("token_is", {}, "token-mean")
    pe = make_policy("markov", eos)
    assert dp.expected_estimate(eos, pe, init_params(pe, 1.0, g), (pe, init_params(pe, 1.0, g)), tm, "reward",
                                8) is None


@pytest.mark.slow
def test_rloo_exact_bias_agrees_with_the_replicates():
    """The DP's exact mean of token IS with RLOO advantages lies within sampling error of the replicates' mean at
    T = 16 (z-test along the exact bias direction, fixed seed)."""
    env = toy_envs.make("long_dense", length=16)
    policy = make_policy("markov", env)
    g = torch.Generator().manual_seed(3)
    theta = init_params(policy, 1.0, g)
    mu = (Perturbed(policy, policy.noise_table(g), 0.3), theta)
    M, B, G = 400, 16, 4
    batch = draw_batches(env, mu, M, B, G, g)
    adv = adv_mod.group_advantages(batch.rewards.reshape(M, B // G, G), "rloo").reshape(M, B)[..., None] * batch.mask
    est = Estimator.resolve("token_is", {}, "seq-mean-token-sum")
    estimates = replicate_gradients(policy, theta.float(), batch, adv, est)[0].double()  # old_log_prob: mu's
    exact = dp.expected_estimate(env, policy, theta, mu, est, "rloo", G)
    grad_j = dp.policy_gradient(env, policy, theta).reshape(-1)
    u = (exact - grad_j) / (exact - grad_j).norm()
    proj = estimates @ u
    z = (float(proj.mean()) - float(exact @ u)) / (float(proj.std()) / math.sqrt(M))
    assert abs(z) < 4, z
    assert float((exact - grad_j).norm()) > 4 * float(proj.std()) / math.sqrt(M)  # the bias itself is resolved


def test_auto_picks_the_reference():
    assert Config(env="small_dense", policy="markov").problem().reference == "exact"
    assert Config(env="long_dense", policy="markov").problem().reference == "dp"
    assert Config(env="large_parity", policy="markov").problem().reference == "dp"
    assert Config(env="long_dense", policy="markov", reference="mc").problem().reference == "mc"
    # truncation or a reward the DP does not accumulate: auto stays with enumeration, which refuses in one line
    for cfg in (Config(env="large_parity", policy="markov", top_p=0.9),
                Config(env="large_parity", policy="prefix"),
                Config(env="large_dense", policy="markov", env_overrides={"reward": "bernoulli", "length": 10})):
        assert cfg.problem().reference == "exact"
        with pytest.raises(LabError, match="--reference mc") as err:
            cfg.validate()
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides,words", [
    (dict(env="small_dense", policy="prefix"), "markov policy"),
    (dict(env="add2", policy="transformer", model="test"), "markov policy"),
    (dict(env="small_bernoulli", policy="markov"), "reward accumulated"),
    (dict(env="add2", policy="markov"), "bandit env"),
    (dict(env="long_dense", policy="markov", top_p=0.9), "truncating sampler"),
    (dict(env="long_dense", policy="markov", staleness="top_k", values=[2]), "truncating sampler")])
def test_bad_dp_combinations_are_one_line(overrides, words):
    with pytest.raises(LabError, match=words) as err:
        Config(reference="dp", **overrides).validate()
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_cli_dp_on_a_non_markov_policy_exits_2_before_any_work(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "lab.cli", "variance", "--env", "long_dense", "--policy", "prefix",
                           "--reference", "dp", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "markov" in proc.stderr and not out.exists()


@pytest.mark.slow
def test_long_env_runs_by_default_with_exact_bias():
    """`lab variance --env long_dense --policy markov` needs no --reference: the DP is picked, every estimator runs,
    and token IS and REINFORCE get their exact bias (rloo, the default advantage)."""
    res = run(Config(env="long_dense", env_overrides={"length": 128}, policy="markov", values=[0, 4],
                     replicates=20, n_boot=50, trajectory_steps=6, batch_size=16)).results
    assert set(res.reference) == {"dp"}
    eb = res[res.metric == "exact_bias_norm"].set_index(["staleness", "estimator"]).value
    assert set(eb.index.get_level_values("estimator")) == {"reinforce", "token_is"}
    assert eb.loc[(0.0, "token_is")] < 1e-10 and eb.loc[(4.0, "reinforce")] > 1e-4
    assert np.isfinite(res[res.metric == "rel_mse"].value).all()


def test_the_report_names_the_dp_truth():
    from lab.studies.variance import report
    from lab.studies.variance.tests.test_report import SUMMARY

    md = report.answer(dict(SUMMARY, reference="dp", reference_pairs=0))
    assert "by dynamic programming" in md and "Monte Carlo" not in md
