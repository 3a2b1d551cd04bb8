"""The transformer through the engine: exact where the tabular path is exact, sequence IS unbiased at every lag,
the same pi_0 for the table, and the real-model study's findings read off its numbers."""
from functools import lru_cache
from pathlib import Path

import pytest
import torch

import toy_envs
from lab import estimators
from lab.engine.estimator import Estimator
from lab.engine.exact import Problem, divergence, exact_support, policy_gradient
from lab.engine.gradients import expected_gradient
from lab.engine.staleness import behaviour, optimisation_trajectory
from lab.errors import LabError
from lab.estimators.aggregation import AGG_MODES
from lab.policies import check_device, make_policy, sequence_log_probs
from lab.studies import real_model_variance as rmv
from lab.studies import variance

# every registered estimator the variance study runs, except those whose loss couples a group (a new one is covered
# without new test code)
ESTIMATORS = [n for n in estimators.names() if variance.applicable(n) and "group_size" not in estimators.info(n).inputs]
TASKS = {"chain3": {"difficulty": 2, "n_prompts": 3}, "sort3": {"difficulty": 2, "n_prompts": 2}}


@lru_cache(maxsize=None)
def _world(task):
    env = toy_envs.make(task, **TASKS[task])
    policy = make_policy("transformer", env, "test")
    problem = Problem(env, policy)
    g = torch.Generator().manual_seed(0)
    traj = optimisation_trajectory(problem, policy.init_params(2.0, g), 6, 0.05, g)
    pi = traj.current
    grad_j = policy_gradient(env, policy, pi, exact_support(env, policy, pi, 10**6)).reshape(-1)
    return problem, traj, grad_j


@pytest.fixture(scope="module", params=list(TASKS))
def task_world(request):
    return _world(request.param)


@pytest.fixture(scope="module")
def world():
    return _world("chain3")


def _mu(problem, traj, kind, value):
    mu = behaviour(problem, kind, value, traj, torch.Generator().manual_seed(1))
    return mu, exact_support(problem.env, *mu, 10**6)


def _expected(problem, traj, kind, value, name, agg="seq-mean-token-sum", behaviour_support=None):
    mu, support = behaviour_support or _mu(problem, traj, kind, value)
    return expected_gradient(problem.env, problem.policy, traj.current, mu, support, Estimator.resolve(name, {}, agg))


def _target(problem, grad_j, name, agg="seq-mean-token-sum"):
    """The on-policy expectation of the estimate: its scale (1 but for GVPO's beta) times c grad J, c from the
    aggregation (fixed-length responses: 1 or 1/T)."""
    est = Estimator.resolve(name, {}, agg)
    return est.grad_scale * est.target_scale(problem.env.length) * grad_j


def test_the_registry_is_covered():
    assert {"reinforce", "seq_is", "token_is", "ppo_clip", "tis_token", "vespo", "gspo"} <= set(ESTIMATORS)
    assert "gvpo" not in ESTIMATORS and len(ESTIMATORS) >= 12


def test_every_estimator_is_exact_at_zero_staleness_in_every_mode_on_the_transformer(task_world):
    problem, traj, grad_j = task_world
    assert grad_j.norm() > 1e-4
    zero = _mu(problem, traj, "lag", 0)
    for agg in AGG_MODES:
        for name in ESTIMATORS:
            e = _expected(problem, traj, "lag", 0, name, agg, behaviour_support=zero)
            assert torch.allclose(e, _target(problem, grad_j, name, agg), atol=1e-10, rtol=1e-8), (agg, name)


def test_every_estimator_is_exact_at_zero_staleness_on_the_transformer(task_world):
    problem, traj, grad_j = task_world
    for kind, zero in [("lag", 0), ("kl", 0.0), ("temperature", 1.0)]:
        behaviour_support = _mu(problem, traj, kind, zero)
        for name in ESTIMATORS:
            assert torch.allclose(_expected(problem, traj, kind, zero, name, behaviour_support=behaviour_support),
                                  _target(problem, grad_j, name), atol=1e-10, rtol=1e-8), (kind, name)


def test_seq_is_stays_unbiased_at_every_lag_in_every_mode(task_world):
    problem, traj, grad_j = task_world
    for lag in [1, 3, 6]:
        stale = _mu(problem, traj, "lag", lag)
        for agg in AGG_MODES:
            assert torch.allclose(_expected(problem, traj, "lag", lag, "seq_is", agg, behaviour_support=stale),
                                  _target(problem, grad_j, "seq_is", agg), atol=1e-10, rtol=1e-8), (lag, agg)


def test_seq_is_stays_unbiased_at_every_lag_and_token_is_does_not(world):
    problem, traj, grad_j = world
    token_bias = []
    for lag in [1, 3, 6]:
        assert torch.allclose(_expected(problem, traj, "lag", lag, "seq_is"), grad_j, atol=1e-10, rtol=1e-8)
        token_bias.append(float((_expected(problem, traj, "lag", lag, "token_is") - grad_j).norm()))
    for kl in [0.02, 0.2]:
        assert torch.allclose(_expected(problem, traj, "kl", kl, "seq_is"), grad_j, atol=1e-10, rtol=1e-8)
    assert token_bias[0] > 1e-6 * float(grad_j.norm()) and token_bias[-1] > token_bias[0]


def test_logit_knobs_mean_the_same_on_the_transformer(world):
    problem, traj, _ = world
    pi = (problem.policy, traj.current)
    kls = []
    for t in [1.0, 1.3, 2.0]:
        mu = behaviour(problem, "temperature", t, traj, None)
        kls.append(divergence(pi, mu, exact_support(problem.env, *mu, 10**6))["kl_token"])
    assert kls[0] == pytest.approx(0.0, abs=1e-12) and kls[1] < kls[2]
    mu = behaviour(problem, "kl", 0.1, traj, torch.Generator().manual_seed(3))
    assert divergence(pi, mu, exact_support(problem.env, *mu, 10**6))["kl_token"] == pytest.approx(0.1, rel=1e-3)


def test_the_table_starts_at_the_transformers_distribution(tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    cfg = variance.Config(env="sort3", env_overrides={"difficulty": 2, "n_prompts": 3}, policy="prefix",
                          model="test", warm_start=0.2)
    problem = cfg.problem()
    theta_tab = cfg.initial(problem, torch.Generator())
    net = variance.Config(**{**cfg.__dict__, "policy": "transformer"})
    theta_net = net.initial(net.problem(), torch.Generator())
    prompts, tokens, mask = problem.env.enumerate()
    a = sequence_log_probs(problem.policy, theta_tab, prompts, tokens, mask)
    b = sequence_log_probs(net.problem().policy, theta_net, prompts, tokens, mask)
    assert torch.allclose(a.exp(), b.exp(), atol=1e-9)


def test_findings_read_the_cells():
    cfg = rmv.Config(lengths=[2], values=[0, 4])

    def cell(best_mse, exact):
        ests = {"seq_is": {"rel_mse": [best_mse + 1, 0, 9], "bias2": [0.0, -1.0, 1.0], "exact_rel_bias": exact},
                "ppo_clip": {"rel_mse": [best_mse, best_mse - 0.1, best_mse + 0.1], "bias2": [1.0, 0.5, 1.5]}}
        return {"per_lag": {"0": {"estimators": ests}, "4": {"estimators": ests}}}

    f = rmv.findings({"transformer/T=2": cell(0.5, 1e-16), "tabular/T=2": cell(0.7, 2e-16)}, cfg)
    assert f["seq_is_exactly_unbiased"] == {"max_rel_bias": 2e-16, "holds": True}
    assert f["seq_is_sampled_bias_covers_zero"] == {"settings": 4, "covered": 4}
    assert f["lowest_mse_at_max_lag"]["transformer/T=2"]["estimator"] == "ppo_clip"
    assert f["lowest_mse_at_max_lag"]["tabular/T=2"]["beats_zero_update"] is True and f["agree"] == {"2": True}
    f = rmv.findings({"transformer/T=2": cell(1.5, 0.3)}, cfg)
    assert f["seq_is_exactly_unbiased"]["holds"] is False
    assert f["lowest_mse_at_max_lag"]["transformer/T=2"]["beats_zero_update"] is False


def test_bad_real_model_settings_are_one_line():
    with pytest.raises(LabError, match="not a task env"):
        rmv.Config(env="tiny_target").validate()
    with pytest.raises(LabError, match="response lengths"):
        rmv.Config(lengths=[0]).validate()
    with pytest.raises(LabError, match="unknown model size"):
        rmv.Config(model="huge").validate()
    if not torch.cuda.is_available():
        with pytest.raises(LabError, match="no CUDA device"):
            rmv.Config(device="cuda").validate()


def test_one_device_check_knows_the_cuda_indices():
    """A CUDA index that is not there is one line at validation, not a traceback later (lab.policies.resolve_device,
    which the Hugging Face adapter shares)."""
    missing = f"cuda:{torch.cuda.device_count() + 4}"
    for bad in (missing, "tpu", "not-a-device"):
        with pytest.raises(LabError, match="device") as e:
            check_device(bad)
        assert "\n" not in str(e.value)
        with pytest.raises(LabError, match="device"):
            variance.Config(policy="transformer", model="test", env="chain3", device=bad).validate()
    check_device("cpu")


def test_the_warm_start_key_covers_the_seeding(monkeypatch):
    """The warm start's init and batches come from lab.seeding: editing it starts a new checkpoint."""
    from lab import pretrain, seeding

    before = pretrain.code_version()
    read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes",
                        lambda self: read(self) + (b"\n# edited" if self == Path(seeding.__file__) else b""))
    assert pretrain.code_version() != before
