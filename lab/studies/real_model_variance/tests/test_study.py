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
from lab.studies.real_model_variance import study as rmv
from lab.studies.variance import study as variance

# every registered estimator the variance study runs that claims to be unbiased on-policy and whose exact expectation
# the engine computes (no inputs beyond the samples: lab.engine.gradients.exact_direction), so that a new one is
# covered without new test code
ESTIMATORS = [n for n in estimators.names() if variance.applicable(n) and not estimators.info(n).inputs
              and estimators.info(n).unbiased in ("always", "on-policy")]
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


@pytest.mark.slow
def test_every_estimator_is_exact_at_zero_staleness_in_every_mode_on_the_transformer(task_world):
    problem, traj, grad_j = task_world
    assert grad_j.norm() > 1e-4
    zero = _mu(problem, traj, "lag", 0)
    for agg in AGG_MODES:
        for name in ESTIMATORS:
            e = _expected(problem, traj, "lag", 0, name, agg, behaviour_support=zero)
            assert torch.allclose(e, _target(problem, grad_j, name, agg), atol=1e-10, rtol=1e-8), (agg, name)


@pytest.mark.slow
def test_every_estimator_is_exact_at_zero_staleness_on_the_transformer(task_world):
    problem, traj, grad_j = task_world
    for kind, zero in [("lag", 0), ("kl", 0.0), ("temperature", 1.0)]:
        behaviour_support = _mu(problem, traj, kind, zero)
        for name in ESTIMATORS:
            assert torch.allclose(_expected(problem, traj, kind, zero, name, behaviour_support=behaviour_support),
                                  _target(problem, grad_j, name), atol=1e-10, rtol=1e-8), (kind, name)


@pytest.mark.slow
def test_seq_is_stays_unbiased_at_every_lag_in_every_mode(task_world):
    problem, traj, grad_j = task_world
    for lag in [1, 3, 6]:
        stale = _mu(problem, traj, "lag", lag)
        for agg in AGG_MODES:
            assert torch.allclose(_expected(problem, traj, "lag", lag, "seq_is", agg, behaviour_support=stale),
                                  _target(problem, grad_j, "seq_is", agg), atol=1e-10, rtol=1e-8), (lag, agg)


@pytest.mark.slow
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


@pytest.mark.slow
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


def _cell(best_mse, exact):
    """A cell at lags 0 and 4 where ppo_clip has MSE ``best_mse`` and seq_is 1 more (its bias2 interval covers 0)."""
    ests = {"seq_is": rmv.Point([best_mse + 1, 0, 9], [0.0, -1.0, 1.0], exact_rel_bias=exact),
            "ppo_clip": rmv.Point([best_mse, best_mse - 0.1, best_mse + 0.1], [1.0, 0.5, 1.5])}
    return rmv.Cell("transformer", 2, 10, 1.0, 0.5, {lag: rmv.Lag(0.1, 0.2, [0.9, 0.8, 1.0], ests)
                                                    for lag in ("0", "4")})


def test_findings_read_the_cells():
    f = rmv.findings({"transformer/T=2": _cell(0.5, 1e-16), "tabular/T=2": _cell(0.7, 2e-16)}, [0, 4], [2])
    assert f.seq_is_exactly_unbiased == rmv.Exactness(2e-16, True)
    assert f.seq_is_sampled_bias_covers_zero == rmv.Coverage(4, 4)
    assert f.lowest_mse_at_max_lag["transformer/T=2"].estimator == "ppo_clip"
    assert f.lowest_mse_at_max_lag["tabular/T=2"].beats_zero_update is True and f.agree == {"2": True}
    f = rmv.findings({"transformer/T=2": _cell(1.5, 0.3)}, [0, 4], [2])
    assert f.seq_is_exactly_unbiased.holds is False and f.agree == {}
    assert f.lowest_mse_at_max_lag["transformer/T=2"].beats_zero_update is False
    cell = _cell(0.5, None)
    for lag in cell.per_lag.values():
        lag.estimators["seq_is"].bias2 = [1.0, 0.5, 1.5]  # a sampled bias whose interval misses 0
    f = rmv.findings({"transformer/T=2": cell}, [0, 4], [2])
    assert f.seq_is_exactly_unbiased is None and f.seq_is_sampled_bias_covers_zero == rmv.Coverage(2, 0)


@pytest.mark.parametrize("given, match", [
    ({"env": "tiny_target"}, "not a task env"),
    ({"lengths": [0]}, "lengths"),
    ({"lengths": []}, "at least one response length"),
    ({"lengths": [2, 2]}, "more than once"),
    ({"env": "add2", "lengths": [1]}, "response lengths of the addition task"),
    ({"model": "huge"}, "model"),
    ({"warm_start": 0.0}, "warm_start"),
    ({"values": [0, 1.5]}, "values"),
    ({"values": [0, 16]}, "trajectory"),
    ({"estimators": ["nope"]}, "nope"),
    ({"batch_size": 60}, "multiple of the group size"),
])
def test_bad_real_model_settings_are_one_line(given, match):
    with pytest.raises(LabError, match=match) as e:
        rmv.Config(**given).validate()
    assert "\n" not in str(e.value)


def test_no_cuda_is_one_line():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
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


@pytest.mark.slow
def test_the_warm_start_trained_by_the_study_is_quiet_when_asked(tmp_path, monkeypatch, capfd, one_thread):
    """progress=False reaches the warm start: from an empty cache the study trains it and prints no progress bar,
    with the environment's quiet setting off."""
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LAB_QUIET", raising=False)
    monkeypatch.delenv("CI", raising=False)
    cfg = rmv.Config(**{**rmv.SMOKE, "replicates": 4, "n_boot": 10, "tabular": False, "exact_directions": False})
    rmv.run(cfg, progress=False)
    trained = list((tmp_path / "pretrain").glob("*.pt"))
    out = capfd.readouterr()
    assert len(trained) == 1 and out.err == "" and out.out == ""


def test_the_reports_smoke_values_are_the_studys():
    from lab.studies.real_model_variance import STUDY

    assert STUDY.reports[0].smoke == rmv.SMOKE
