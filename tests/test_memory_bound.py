"""The variance engine on a network in bounded memory: the largest block of gradient estimates follows from the
memory budget, not from the number of replicates, and the numbers do not depend on how the replicates are
chunked."""
from functools import lru_cache

import numpy as np
import pytest

from lab.engine import variance as engine
from lab.engine.gradients import budget_chunk
from lab.engine.metrics import streamed_memory
from lab.errors import LabError
from lab.studies.variance import study as variance

ROWS = 4  # the budget, in replicates (float64 rows of D parameters)


def _config(**overrides):
    base = dict(env="sort3", env_overrides={"difficulty": 2, "n_prompts": 2}, policy="transformer", model="test",
                values=[0, 1], estimators=["seq_is", "ppo_clip"], replicates=24, batch_size=4, group_size=2,
                n_boot=50, trajectory_steps=2, init_scale=2.0)
    return variance.Config(**{**base, **overrides})


@lru_cache(maxsize=None)
def _dims() -> int:
    """D, the test transformer's parameter count on the task."""
    return int(np.prod(_config().problem().policy.shape))


def _budget(rows: int = ROWS) -> float:
    """A memory budget of ``rows`` replicates, in GiB (the config's unit)."""
    return rows * 8 * _dims() / 2**30


@pytest.fixture
def blocks(monkeypatch):
    """The shape of every block of estimates the engine streams into the statistics."""
    seen = []
    stream = engine.stream_gradients

    def recorded(*args, **kwargs):
        for rows, g, m in stream(*args, **kwargs):
            seen.append(tuple(g.shape))
            yield rows, g, m
    monkeypatch.setattr(engine, "stream_gradients", recorded)
    return seen


def test_budget_chunk_is_the_budget_over_a_float64_row():
    assert budget_chunk(1000, 8 * 1000 * 25) == 25
    assert budget_chunk(1000, 8 * 1000 * 25 + 7999) == 25
    assert budget_chunk(10**9, 1) == 1  # a row over the budget: one replicate at a time


@pytest.mark.slow
def test_largest_block_stays_within_the_budget_whatever_m(blocks):
    D, M = _dims(), 16 * ROWS
    cfg = _config(replicates=M, memory_budget=_budget(), values=[0], estimators=["seq_is"])
    variance.run(cfg, progress=False)
    budget = cfg.sampling().memory_budget
    assert blocks and max(rows for rows, _ in blocks) == ROWS  # not M, M - 4, ... as one vmap call over the rest
    assert all(d == D and rows * d * 8 <= budget for rows, d in blocks)
    need = streamed_memory(M, D, ROWS, budget)
    assert need["chunk"] <= budget and need["estimates"] <= 3 * budget  # a held block and one chunk, never M x D


def _agree(results: dict, rtol: float) -> None:
    names = list(results)
    ref = results[names[0]]
    scale = float(ref.loc[ref.metric == "mse", "value"].abs().max())
    assert scale > 0 and (ref.metric == "variance").any() and ref.loc[ref.metric == "variance", "value"].min() > 0
    for name in names[1:]:
        res = results[name]
        assert list(res.metric) == list(ref.metric) and list(res.estimator) == list(ref.estimator)
        cos = ref.metric.str.startswith("cos").to_numpy()  # cosines of near-zero clipped gradients: in [-1, 1]
        for col in ("value", "lo", "hi"):
            assert np.allclose(res[col][~cos], ref[col][~cos], rtol=rtol, atol=rtol * scale, equal_nan=True), \
                (name, col)
            assert np.allclose(res[col][cos], ref[col][cos], rtol=0, atol=100 * rtol, equal_nan=True), (name, col)


@pytest.mark.slow
def test_numbers_do_not_depend_on_the_chunk_size(blocks):
    """Within the budget (every estimate kept): one vmap call, chunks of 1 and of 5. Beyond it (a budget of 4
    replicates: the Gram built block by block): chunks from the budget, of 1 and of 3. Every run agrees to 1e-4 of
    the largest MSE (a replicate dropped or counted twice would move the variance by 1/M = 4%): a network's
    per-replicate float32 gradients can differ in their last bits with the chunk size on CPUs whose matrix kernels
    depend on the batch shape (the ratios and debiased squared biases amplify that a little; cosines, of gradients that
    PPO's clip can make nearly zero, agree to 1e-2), and the two families differ by the float32 rounding of the
    target that the in-memory path applies (``streamed_metrics``)."""
    small = _budget()
    within = {"whole": _config(), "chunk 1": _config(chunk=1), "chunk 5": _config(chunk=5)}
    beyond = {"budget": _config(memory_budget=small), "budget, chunk 1": _config(memory_budget=small, chunk=1),
              "budget, chunk 3": _config(memory_budget=small, chunk=3)}
    within = {k: variance.run(cfg, progress=False).results for k, cfg in within.items()}
    beyond = {k: variance.run(cfg, progress=False).results for k, cfg in beyond.items()}
    _agree({**within, **beyond}, 1e-4)
    assert {rows for rows, _ in blocks} >= {1, 3, 5, ROWS, 24}


def test_memory_validation_covers_network_policies():
    D, budget = _dims(), _budget()
    with pytest.raises(LabError, match="chunk of 40 replicates"):
        _config(chunk=40, replicates=64, memory_budget=budget).validate()
    with pytest.raises(LabError, match="Gram matrix"):
        _config(replicates=400, memory_budget=budget).validate()
    with pytest.raises(LabError, match="memory_budget must be > 0"):
        _config(memory_budget=0.0).validate()
    _config(replicates=150, memory_budget=budget).validate()  # 37 times the budget's rows: streamed, accepted
    need = streamed_memory(150, D, budget_chunk(D, int(budget * 2**30)), int(budget * 2**30))
    assert need["chunk"] <= budget * 2**30 and need["gram"] <= budget * 2**30
