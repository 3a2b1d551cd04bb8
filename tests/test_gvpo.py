"""GVPO against hand-computed values, its gradient-weight form, its optimum (Theorems 1 and 2) by enumeration, and
what the gvpo_optimum report says."""
import math

import numpy as np
import pandas as pd
import pytest
import torch
from torch.func import grad, vmap

import toy_envs
from lab import estimators
from lab.advantages import leave_one_out
from lab.engine.exact import exact_support, policy_gradient
from lab.errors import LabError
from lab.estimators.gvpo import gvpo_weights
from lab.policies import make_policy
from lab.reports import gvpo_optimum as report
from lab.reports import style
from lab.studies import gvpo_optimum as go

BETA = 0.1
# Two groups of three responses, T = 2; row 2's second token is padding (its log-probs differ but must not count).
# Sequence log-ratios ell = sum_t m_t (log pi - log pi_old):
#   group 1: row 0: (-1 + 2.5) + (-2 + 3.5) = 3;  row 1: 0;  row 2: -3 + 0 = -3 (padding -7 vs -1 ignored)
#   group 2: row 3: 0.5 + 0.5 = 1;  row 4: 0.5 + 0.5 = 1;  row 5: -1 - 1 = -2
LOGP = torch.tensor([[-1.0, -2.0], [-0.5, -0.5], [-3.0, -7.0], [-1.0, -1.0], [-0.2, -0.3], [-2.0, -2.0]],
                    dtype=torch.float64)
OLD = torch.tensor([[-2.5, -3.5], [-0.5, -0.5], [0.0, -1.0], [-1.5, -1.5], [-0.7, -0.8], [-1.0, -1.0]],
                   dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0, 3.0], dtype=torch.float64)
# Residuals e_i = (R_theta,i - mean R_theta) - (R_i - mean R), R_theta = 0.1 ell:
#   group 1: R_theta = (0.3, 0, -0.3), mean 0; R - mean R = (2/3, -1/3, -1/3) -> e = (-11/30, 10/30, 1/30)
#   group 2: R_theta = (0.1, 0.1, -0.2), mean 0; R - mean R = (-1, -1, 2)    -> e = (1.1, 1.1, -2.2)
RESIDUAL = torch.tensor([-11 / 30, 10 / 30, 1 / 30, 1.1, 1.1, -2.2], dtype=torch.float64)


def run(log_prob=LOGP, old=OLD, mask=MASK, rewards=REWARDS, group_size=3, **hyper):
    lp = log_prob.clone().requires_grad_(True)
    loss, metrics = estimators.get("gvpo")(lp, old, torch.zeros_like(old), mask, rewards=rewards,
                                           group_size=group_size, **hyper)
    (g,) = torch.autograd.grad(loss, lp)
    return loss.detach(), g, metrics


def test_loss_by_hand():
    loss, _, metrics = run()
    # L_1 = 1/(k-1) * 1/2 * sum e^2 = 1/2 * 1/2 * (121 + 100 + 1)/900 = 222/3600
    # L_2 = 1/2 * 1/2 * (1.21 + 1.21 + 4.84) = 1.815;  the batch loss is the mean over the two groups
    assert float(loss) == pytest.approx((222 / 3600 + 1.815) / 2)
    assert float(metrics["seq_log_ratio_abs_max"]) == pytest.approx(3.0)
    assert float(metrics["residual_rms"]) == pytest.approx(float(RESIDUAL.pow(2).mean().sqrt()))


def test_gradient_by_hand():
    _, g, _ = run()
    # d loss / d log pi(y_i, t) = 1/G * 1/(k-1) * beta * e_i * m_t = 1/2 * 1/2 * 0.1 * e_i on every real token
    expected = 0.025 * RESIDUAL[:, None] * MASK
    assert torch.allclose(g, expected)
    assert g[2, 1] == 0.0  # padding gets no gradient
    assert float(g[0, 0]) == pytest.approx(0.025 * -11 / 30)


def test_beta_scales_the_prediction():
    # beta = 0.5: group 2's R_theta = (0.5, 0.5, -1), residual (1.5, 1.5, -3): L_2 = 1/4 * 13.5 = 3.375
    # group 1's R_theta = (1.5, 0, -1.5): residual (1.5 - 2/3, 1/3, -1.5 + 1/3) = (5/6, 1/3, -7/6)
    loss, _, _ = run(beta=0.5)
    L1 = 0.25 * ((5 / 6) ** 2 + (1 / 3) ** 2 + (7 / 6) ** 2)
    assert float(loss) == pytest.approx((L1 + 3.375) / 2)


def test_weight_form_matches_autograd():
    gen = torch.Generator().manual_seed(0)
    B, T, k = 12, 4, 3
    lp = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    old = lp + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    mask = (torch.rand(B, T, generator=gen) > 0.2).double()
    rewards = torch.randn(B, generator=gen, dtype=torch.float64)
    for beta in (0.1, 0.7):
        _, g, _ = run(lp, old, mask, rewards, k, beta=beta)
        w = gvpo_weights(rewards, ((lp - old) * mask).sum(-1), k, beta)
        # grad L_group = -beta/(k-1) sum_i w_i grad log pi(y_i); the batch averages G = B/k groups
        assert torch.allclose(g, -beta / ((k - 1) * (B // k)) * w[:, None] * mask)
        assert torch.allclose(w.reshape(-1, k).sum(-1), torch.zeros(B // k, dtype=torch.float64), atol=1e-12)
    # by hand on the fixed batch: w = -e
    assert torch.allclose(gvpo_weights(REWARDS, torch.tensor([3.0, 0, -3, 1, 1, -2]), 3, BETA), -RESIDUAL)


def full_mse(lp, old, mask, rewards, k, beta, centred_target=True):
    """The MSE with nothing detached (the paper's form); ``centred_target=False`` drops the target's centring."""
    r_theta = (beta * ((lp - old) * mask).sum(-1)).reshape(-1, k)
    target = rewards.reshape(-1, k)
    if centred_target:
        target = target - target.mean(-1, keepdim=True)
    return (0.5 * ((r_theta - r_theta.mean(-1, keepdim=True)) - target).pow(2).sum(-1) / (k - 1)).mean()


def test_detached_group_mean_gives_the_same_gradient():
    lp = LOGP.clone().requires_grad_(True)
    loss = full_mse(lp, OLD, MASK, REWARDS, 3, BETA)
    (g_full,) = torch.autograd.grad(loss, lp)
    official, g_official, _ = run()
    assert float(loss.detach()) == pytest.approx(float(official))
    assert torch.allclose(g_official, g_full)
    # the equivalence needs sum_i e_i = 0; with uncentred targets the residuals do not sum to 0 and the
    # detached and full gradients differ (here by mean_g(e) per group) - so the check above can fail
    lp2 = LOGP.clone().requires_grad_(True)
    (g_unc,) = torch.autograd.grad(full_mse(lp2, OLD, MASK, REWARDS, 3, BETA, centred_target=False), lp2)
    r_theta = (BETA * ((lp2.detach() - OLD) * MASK).sum(-1)).reshape(-1, 3)
    resid = (r_theta - r_theta.mean(-1, keepdim=True)) - REWARDS.reshape(-1, 3)
    g_detached = (0.5 * 0.5 * BETA * resid.reshape(-1))[:, None] * MASK  # what a detached mean would give
    assert not torch.allclose(g_unc, g_detached)


def test_gvpo_gradient_is_beta_times_reinforce_on_the_kl_regularised_reward():
    # w_i = r_i - mean r with r = R - beta * ell: REINFORCE with a group-mean baseline (RLOO = k/(k-1) * centred)
    ell = ((LOGP - OLD) * MASK).sum(-1)
    adv = leave_one_out(REWARDS - BETA * ell, 3)[:, None] * MASK
    lp = LOGP.clone().requires_grad_(True)
    loss, _ = estimators.get("reinforce")(lp, OLD, adv, MASK, loss_agg_mode="seq-mean-token-sum")
    (g_reinforce,) = torch.autograd.grad(loss, lp)
    _, g, _ = run()
    assert torch.allclose(g, BETA * g_reinforce)


def test_bad_groups_raise_one_clear_error():
    with pytest.raises(LabError, match="GVPO needs at least 2 responses per prompt"):
        run(group_size=1)
    with pytest.raises(LabError, match="not a multiple of group_size 4"):
        run(group_size=4)
    with pytest.raises(LabError, match="one reward per response"):
        run(rewards=REWARDS[:3])
    with pytest.raises(LabError, match="at least 2 responses per prompt"):
        gvpo_weights(torch.ones(3), torch.zeros(3), 1)
    with pytest.raises(LabError, match="loss_agg_mode"):
        estimators.get("gvpo")(LOGP, OLD, OLD, MASK, loss_agg_mode="sum", rewards=REWARDS, group_size=3)


def test_registry_entry():
    info = estimators.info("gvpo")
    assert info.inputs == ("rewards", "group_size") and info.defaults == {"beta": 0.1}
    assert info.grad_scale(info.defaults) == 0.1 and info.grad_scale({"beta": 0.3}) == 0.3
    assert info.coefficient is None  # the weight depends on the whole group: see gvpo_weights
    assert "GVPO" in info.description and "2504.19599" in info.source


def test_finite_on_extreme_log_ratios_and_under_vmap():
    lp = torch.tensor([[-1e4, -0.1, 0.0], [0.0, -3e3, -1.0], [-50.0, 0.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, -1e4, -2e3], [-1e4, 0.0, 0.0], [0.0, 0.0, -80.0], [-1e3, -1e3, -1e3]])
    loss, metrics = estimators.get("gvpo")(lp, old, torch.ones(4, 3), torch.ones(4, 3), rewards=torch.ones(4),
                                           group_size=2)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert all(torch.isfinite(v) for v in metrics.values())
    # -inf log-probs on padding (as some trainers leave them) must not leak into the loss: same value as with 0s
    padded = LOGP.clone()
    padded[2, 1] = -float("inf")
    old_padded = OLD.clone()
    old_padded[2, 1] = -float("inf")
    loss_inf, g_inf, metrics_inf = run(padded, old_padded)
    loss_ref, g_ref, metrics_ref = run()
    assert float(loss_inf) == float(loss_ref) and torch.equal(g_inf, g_ref)
    assert all(torch.equal(metrics_inf[key], metrics_ref[key]) for key in metrics_ref)
    # per-replicate gradients with torch.func equal a loop (the variance engine's path)
    gen = torch.Generator().manual_seed(1)
    lp = torch.randn(5, 6, 3, generator=gen).clamp(max=0)
    old = lp + 0.1 * torch.randn(5, 6, 3, generator=gen)
    rewards, mask = torch.randn(5, 6, generator=gen), torch.ones(5, 6, 3)
    fn = estimators.get("gvpo")

    def f(a, b, m, r):
        return fn(a, b, torch.zeros_like(b), m, rewards=r, group_size=3)[0]

    g = vmap(grad(f))(lp, old, mask, rewards)
    loop = torch.stack([grad(f)(lp[i], old[i], mask[i], rewards[i]) for i in range(5)])
    assert torch.allclose(g, loop, atol=1e-6)


# ---- expectations by enumeration ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small():
    """2 prompts x 9 responses (V = 3, T = 2) with dense rewards; pi_ref random."""
    env = toy_envs.make("tiny_target", reward="dense", vocab_size=3, length=2)
    theta_ref = go.reference_params(env, 0, 1.0)
    prompts, tokens, mask = env.enumerate()
    reward = env.expected_reward(prompts, tokens, mask).reshape(env.n_prompts, -1)
    log_opt = go.optimum_log_probs(go.enumerated_log_probs(env, theta_ref), reward, BETA)
    return env, theta_ref, reward, log_opt


@pytest.mark.parametrize("k", [2, 3])
def test_on_policy_expected_gradient_is_beta_grad_J_exactly(small, k):
    """At pi = pi_ref' (on-policy, no update yet) E[-grad L] = beta * grad J: the registry's grad_scale."""
    env, theta, _, _ = small
    policy = make_policy("prefix", env)
    log_pi = go.enumerated_log_probs(env, theta)
    expected = -go.expected_gvpo_gradient(env, theta, theta, log_pi, k, BETA)
    grad_J = policy_gradient(env, policy, theta, exact_support(env, policy, theta, 10**6)).reshape(-1)
    assert grad_J.norm() > 1e-2
    assert torch.allclose(expected, BETA * grad_J, atol=1e-14, rtol=1e-10)


def test_on_policy_expected_gradient_includes_the_kl_term(small):
    """Sampling from pi with pi_ref' fixed elsewhere: E[-grad L] = beta * grad (J - beta KL(pi || pi_ref))."""
    env, theta_ref, reward, _ = small
    theta = theta_ref + 0.5 * torch.randn(theta_ref.shape, generator=torch.Generator().manual_seed(3),
                                          dtype=torch.float64)
    expected = -go.expected_gvpo_gradient(env, theta, theta_ref, go.enumerated_log_probs(env, theta), 2, BETA)
    th = theta.clone().requires_grad_(True)
    log_pi, log_ref = go.enumerated_log_probs(env, th), go.enumerated_log_probs(env, theta_ref)
    objective = (log_pi.exp() * (reward - BETA * (log_pi - log_ref))).sum(-1).mean()  # J - beta KL, prompts uniform
    (g,) = torch.autograd.grad(objective, th)
    assert torch.allclose(expected, BETA * g.reshape(-1), atol=1e-14, rtol=1e-10)


@pytest.mark.parametrize("sampler", ["uniform", "reference"])
def test_expected_gradient_vanishes_at_the_optimum_and_nowhere_else(small, sampler):
    """Theorems 1-2 with k = 2 and a fixed sampler q: the exact expected gradient (all 81 pairs per prompt) is
    0 at pi* and nonzero elsewhere; it equals grad of 1/2 Var_q(beta log(pi/pi_ref) - R) (the population loss)."""
    env, theta_ref, reward, log_opt = small
    log_q = (torch.full_like(log_opt, -math.log(9)) if sampler == "uniform"
             else go.enumerated_log_probs(env, theta_ref))
    theta_opt = go.prefix_tree_params(env, log_opt)
    assert torch.allclose(go.enumerated_log_probs(env, theta_opt), log_opt, atol=1e-12)
    at_opt = go.expected_gvpo_gradient(env, theta_opt, theta_ref, log_q, 2, BETA)
    assert at_opt.norm() < 1e-13
    gen = torch.Generator().manual_seed(4)
    others = [theta_ref, go.prefix_tree_params(env, go.optimum_log_probs(go.enumerated_log_probs(env, theta_ref),
                                                                         reward, 2 * BETA))]
    others += [theta_opt + 0.3 * torch.randn(theta_opt.shape, generator=gen, dtype=torch.float64) for _ in range(3)]
    for theta in others:
        g = go.expected_gvpo_gradient(env, theta, theta_ref, log_q, 2, BETA)
        th = theta.clone().requires_grad_(True)
        (g_pop,) = torch.autograd.grad(go.population_loss(env, th, theta_ref, log_q, BETA), th)
        assert torch.allclose(g, g_pop.reshape(-1), atol=1e-14, rtol=1e-10)
        assert g.norm() > 1e-4
    # and descending the population loss from pi_ref lands on pi*
    th = theta_ref.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([th], max_iter=500, tolerance_grad=1e-14, tolerance_change=0, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = go.population_loss(env, th, theta_ref, log_q, BETA)
        loss.backward()
        return loss

    opt.step(closure)
    tv = go.total_variation(go.enumerated_log_probs(env, th.detach()), log_opt)
    assert float(tv) < 1e-6


def test_training_reaches_the_optimum_from_both_samplers():
    cfg = go.Config(methods=["gvpo"], samplers=["on_policy", "uniform"], seeds=[0], steps=500, n_boot=100)
    result = go.run(cfg)
    final = result.summary["final_tv"]["gvpo"]
    assert result.summary["tv_at_start"] > 0.5  # pi_ref is far from pi*: the test is not satisfied at the start
    assert final["on_policy"]["mean"] < 0.05 and final["uniform"]["mean"] < 0.05
    tv = result.results[result.results["metric"] == "tv"]
    assert tv["step"].max() == 500 and set(tv["sampler"]) == {"on_policy", "uniform"}


def test_study_tables_and_bad_configs():
    cfg = go.Config(methods=["gvpo", "seq_is"], samplers=["tempered", "uniform"], seeds=[0, 1], steps=5,
                    groups_per_step=4)
    result = go.run(cfg)
    summary, res = result.summary, result.results
    summary = {**summary, "headline": report.headline(summary)}  # the gallery line, from the summary alone
    assert "\n" not in summary["headline"] and "GVPO" in summary["headline"]
    for m in cfg.methods:
        for s in cfg.samplers:
            e = summary["final_tv"][m][s]
            assert e["lo"] <= e["mean"] <= e["hi"] and len(e["per_seed"]) == 2
    curves = res[res["metric"] == "tv"]
    assert len(curves) == 2 * 2 * 2 * 6  # methods x samplers x seeds x (steps + 1)
    probs = res[res["metric"] == "prob"]
    for (m, s), p in probs.groupby(["method", "sampler"]):  # every stored distribution sums to 1 per prompt
        assert p.groupby("prompt")["value"].sum().to_numpy() == pytest.approx([1.0, 1.0])
    assert {"pi*", "pi_ref"} <= set(probs["method"])
    for bad, match in [({"samplers": ["replay"]}, "unknown sampler"), ({"group_size": 1}, "at least 2 responses"),
                       ({"env": "small_bernoulli", "env_overrides": {}}, "deterministic rewards"),
                       ({"methods": ["kl_k3"]}, "extra inputs|unknown estimator"), ({"beta": 0.0}, "beta"),
                       ({"schedule": "linear"}, "schedule")]:
        with pytest.raises(LabError, match=match):
            go.Config(**bad).validate()


# ---- what the gvpo_optimum report says --------------------------------------------------------------------------

def _entry(mean, half=0.01):
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "per_seed": [mean - half, mean + half]}


def report_summary(gvpo_uniform=0.02, start=0.87):
    """A gvpo_optimum summary with known numbers: three methods, on-policy and uniform samplers, two seeds."""
    return {"study": "gvpo_optimum", "env": "small_dense", "beta": 0.1, "steps": 60, "group_size": 4, "seeds": [0, 1],
            "tv_at_start": start, "policy": "prefix",
            "final_tv": {"gvpo": {"on_policy": _entry(0.01), "uniform": _entry(gvpo_uniform)},
                         "seq_is": {"on_policy": _entry(0.012), "uniform": _entry(0.15)},
                         "ppo_clip": {"on_policy": _entry(0.3, 0.005), "uniform": _entry(0.85)}},
            "config": {"env": "small_dense", "env_overrides": {"n_prompts": 2}, "beta": 0.1, "steps": 60, "lr": 0.1,
                       "schedule": "constant", "groups_per_step": 8, "group_size": 4}}


def test_answer_and_headline_state_the_numbers():
    text = report.answer(report_summary())
    assert "**Setup.** `small_dense (n_prompts=2)`, a prefix-tree policy, β = 0.1" in text
    assert "60 Adam steps (lr 0.1, constant) on 8 groups of k = 4 responses per step; 2 seeds" in text
    assert "TV(π_ref, π\\*) = 0.87 at the start" in text
    assert "| gvpo | **0.010 [0.000, 0.020]** | **0.020 [0.010, 0.030]** |" in text  # lowest per sampler in bold
    assert "| ppo_clip | 0.300 [0.295, 0.305] | 0.850 [0.840, 0.860] |" in text
    assert "**GVPO lands on π\\* whichever distribution the groups came from** (upper interval bound 0.030" in text
    assert "From uniform samples the alternatives end at seq_is 0.150 (7.5× GVPO's), ppo_clip 0.850 (42× GVPO's)." \
        in text
    assert "they end at TV 0.010 to 0.300." in text  # ppo_clip's on-policy interval does not overlap the others
    assert report.headline(report_summary()) == ("GVPO ends within TV 0.02 of π* from every sampler, with no "
                                                 "importance weights; from uniform samples: gvpo 0.02, seq_is 0.15, "
                                                 "ppo_clip 0.85 (60 steps, β = 0.1)")


def test_answer_says_when_gvpo_has_not_reached_the_optimum():
    short = report.answer(report_summary(gvpo_uniform=0.5))
    assert "lands on" not in short
    assert "**GVPO moves toward π\\* from every sampler but has not reached it in 60 steps**: its final TV is at " \
           "most 0.500 (upper interval bound 0.510), down from 0.87" in short
    worse = report.answer(report_summary(gvpo_uniform=0.9))
    assert "**GVPO does not approach π\\* from every sampler**: its final TV reaches 0.900 against 0.87" in worse
    assert "| seq_is | 0.012 [0.002, 0.022] | **0.150 [0.140, 0.160]** |" in short  # seq_is now lowest from uniform


def _curves():
    """Tidy results by hand: TV curves (3 steps) for two methods x two samplers x two seeds, and final distributions."""
    rows = []
    for m_i, m in enumerate(["gvpo", "seq_is"]):
        for s_i, s in enumerate(["on_policy", "uniform"]):
            for seed in (0, 1):
                for step in range(3):
                    rows.append({"method": m, "sampler": s, "seed": seed, "step": step, "metric": "tv",
                                 "value": 0.8 / (1 + step) / (1 + m_i + s_i) + 0.01 * seed, "prompt": -1,
                                 "response": ""})
    opt = {"00": 0.5, "01": 0.3, "10": 0.15, "11": 0.05}
    for method, sampler, probs in [("pi*", "-", opt), ("pi_ref", "-", dict.fromkeys(opt, 0.25)),
                                   ("gvpo", "uniform", opt), ("seq_is", "uniform", dict.fromkeys(opt, 0.25)),
                                   ("gvpo", "on_policy", opt), ("seq_is", "on_policy", opt)]:
        rows += [{"method": method, "sampler": sampler, "seed": 0, "step": 2, "metric": "prob", "value": p,
                  "prompt": 0, "response": r} for r, p in probs.items()]
    return pd.DataFrame(rows)


def test_figures_draw_what_the_results_hold():
    fig = report.final_tv_figure(report_summary())
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["on-policy (π_θ)", "uniform (fixed)"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["gvpo", "seq_is", "ppo_clip"]
    markers = [ln for ln in ax.get_lines() if ln.get_marker() == "o"]
    assert [ln.get_color() for ln in markers] == [style.color(m) for m in ("gvpo", "seq_is", "ppo_clip")
                                                  for _ in range(2)]
    assert np.allclose([ln.get_ydata()[0] for ln in markers], [0.01, 0.02, 0.012, 0.15, 0.3, 0.85])
    results = _curves()
    fig = report.tv_curves_figure(results)
    assert [ax.get_title() for ax in fig.axes] == ["on-policy (π_θ)", "uniform (fixed)"]
    lines = fig.axes[1].get_lines()
    assert [ln.get_label() for ln in lines] == ["gvpo", "seq_is"] and lines[1].get_color() == style.color("seq_is")
    assert np.allclose(lines[0].get_ydata(), [0.8 / 2 / (1 + s) + 0.005 for s in range(3)])  # median of 2 seeds
    fig = report.distribution_figure(results, prompt=0, top=3)
    ax = fig.axes[0]
    assert ax.get_title() == "Learned vs closed form, groups from uniform (fixed)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["00", "01", "10"]  # pi*'s most likely first
    bars = [p.get_height() for p in ax.patches]
    assert np.allclose(bars, [0.5, 0.3, 0.15, 0.25, 0.25, 0.25])  # pi* then pi_ref
    learned = [c for c in ax.collections if c.get_label() == "seq_is (learned)"][0]
    assert np.allclose(learned.get_offsets()[:, 1], [0.25, 0.25, 0.25])
