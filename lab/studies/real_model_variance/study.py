"""Do the toy's lessons survive on a real model? The variance study on the lab's transformer, beside the tabular
policy on the same task, against staleness (lag on a real Adam trajectory) and response length.

For each response length T the task's difficulty is set to give T answer tokens (chain sums: T steps; sorting: T
digits; addition: T - 1 digits per operand) over its training prompts, small enough to enumerate every response,
so both policies get the exact gradient grad J, exact divergences and, with ``exact_directions``, each estimator's
exact expected gradient (advantage = R) by enumeration. Both start from the SAME distribution pi_0: the
transformer's supervised warm start (``lab.pretrain``: an exact-match accuracy of ``warm_start``), copied exactly
into the prefix-tree table for the tabular policy; each then climbs the exact objective with Adam for
``trajectory_steps`` steps, and a lag of k is the snapshot k steps behind. What differs is the parameterisation:
a transformer update moves every prompt's distribution at once, a table update only the states it touches.
Everything else is the variance study (``lab.studies.variance.study``): the same replicate batches for every
estimator, bias / variance / MSE against grad J with bootstrap intervals. Results: the variance study's tidy rows
with two more keys, ``model`` (transformer | tabular) and ``length``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np
import pandas as pd

import toy_envs
from lab.advantages import ADVANTAGES
from lab.configs import SEED_MAX, check_types, check_unique
from lab.errors import LabError
from lab.estimators.aggregation import AGG_MODES
from lab.policies.transformer import SIZES
from lab.studies import StudyResult
from lab.studies.variance import study as variance
from lab.typed import knob

DIFFICULTY = {"chain": lambda T: T, "sorting": lambda T: T, "addition": lambda T: T - 1}  # T answer tokens
MODELS = ("transformer", "tabular")


@dataclass
class Config:
    """The real-model variance study. Defaults finish in a few minutes on 2 cores."""

    env: str = "chain3"
    """task env preset (see `lab envs`): chain sums, sorting or addition"""
    lengths: list[int] = knob([2, 3], ge=1, le=1000)
    """response lengths T (the task's difficulty is set to give them)"""
    n_prompts: int = knob(6, ge=1, le=100_000)
    """training prompts of the task (every response of each is enumerated)"""
    model: Literal[tuple(SIZES)] = "small"
    """transformer size (see lab.policies.transformer.SIZES)"""
    warm_start: float = knob(0.3, gt=0, lt=1)
    """exact-match accuracy of the transformer's supervised warm start (the table starts at its distribution)"""
    tabular: bool = True
    """also run the tabular prefix-tree policy on the same task"""
    values: list[int] = knob([0, 1, 2, 4, 8], ge=0, le=1_000_000)
    """lags: Adam steps between mu and pi"""
    estimators: list[str] = knob(["reinforce", "seq_is", "token_is", "ppo_clip", "tis_seq", "vespo"])
    """estimators (see `lab estimators`)"""
    advantage: Literal[ADVANTAGES] = "rloo"
    """reward | rloo | grpo | drgrpo | gpg"""
    group_size: int = knob(8, ge=1, le=4096)
    """G responses per prompt"""
    batch_size: int = knob(64, ge=1, le=1_000_000)
    """B responses per batch (a multiple of G)"""
    replicates: int = knob(200, ge=2, le=1_000_000)
    """M replicate batches per setting"""
    trajectory_steps: int = knob(8, ge=0, le=1_000_000)
    """Adam steps on the exact objective from the starting point to pi"""
    lr: float = knob(3e-4, gt=0, le=1e3)
    """the transformer trajectory's Adam learning rate (Adam moves every one of its parameters by about lr per step)"""
    tabular_lr: float = knob(0.1, gt=0, le=1e3)
    """the tabular trajectory's Adam learning rate (chosen so that the lags span a similar range of KL per token)"""
    loss_agg_mode: Literal[(*AGG_MODES, "native")] = "seq-mean-token-sum"
    """loss aggregation mode, or native (each estimator's own)"""
    exact_directions: bool = True
    """the exact expected gradient of each estimator (advantage R): relative bias, cosine, size"""
    n_boot: int = knob(500, ge=10, le=1_000_000)
    """bootstrap resamples"""
    ci: float = knob(0.95, gt=0, lt=1)
    """interval coverage"""
    seed: int = knob(0, ge=0, le=SEED_MAX)
    """seed of every random stream"""
    device: str = "cpu"
    """where the transformer's passes run: cpu | cuda"""
    chunk: int = knob(0, ge=0, le=1_000_000)
    """replicates per vmap call of the transformer's gradients (0: as many as the gradient memory budget holds)"""

    def task(self) -> str:
        env = toy_envs.make(self.env)
        if not hasattr(env, "task"):
            raise LabError(f"env {self.env!r} is not a task env; choose one of the tasks (chain3, sort3, add2, ...)")
        return env.task

    def study(self, model: str, length: int) -> variance.Config:
        """The variance study of one (model, length) cell."""
        overrides = {"difficulty": DIFFICULTY[self.task()](int(length)), "n_prompts": self.n_prompts}
        transformer = model == "transformer"
        return variance.Config(
            env=self.env, env_overrides=overrides, policy="transformer" if transformer else "prefix",
            model=self.model, warm_start=self.warm_start, staleness="lag",
            values=list(self.values), estimators=list(self.estimators), advantage=self.advantage,
            group_size=self.group_size, batch_size=self.batch_size, replicates=self.replicates,
            loss_agg_mode=self.loss_agg_mode, trajectory_steps=self.trajectory_steps,
            lr=self.lr if transformer else self.tabular_lr, exact_directions=self.exact_directions,
            n_boot=self.n_boot, ci=self.ci, seed=self.seed, device=self.device,
            chunk=self.chunk if transformer else 0)

    def cells(self) -> list[tuple[str, int]]:
        return [(m, int(T)) for T in self.lengths for m in MODELS if m == "transformer" or self.tabular]

    def validate(self) -> None:
        check_types(self)
        task = self.task()
        if not self.lengths:
            raise LabError("give at least one response length")
        check_unique("lengths", self.lengths)
        low = 2 if task == "addition" else 1
        for T in self.lengths:
            if T < low:
                raise LabError(f"response lengths of the {task} task are whole numbers >= {low}, got {T!r}")
        for model, T in self.cells():
            self.study(model, T).validate()


SMOKE = {"lengths": [2], "model": "test", "values": [0, 2], "replicates": 30, "trajectory_steps": 2,
         "estimators": ["reinforce", "seq_is", "token_is"]}  # seconds once the test model's warm start is cached


@dataclass
class Point:
    """One estimator at one lag: [value, lo, hi] of its MSE ÷ ‖∇J‖² and squared bias, and with ``exact_directions``
    its exact expected gradient against ∇J (relative bias ‖E g − ∇J‖ ÷ ‖∇J‖, cosine, size ‖E g‖ ÷ ‖∇J‖)."""

    rel_mse: list[float]
    bias2: list[float]
    exact_rel_bias: float | None = None
    exact_cos: float | None = None
    exact_size: float | None = None


@dataclass
class Lag:
    """One lag of one cell: mu's exact divergence from pi, the effective sample size [value, lo, hi], the estimators."""

    kl_token: float
    chi2_seq: float
    ess_frac: list[float]
    estimators: dict[str, Point]


@dataclass
class Cell:
    """One (model, length) cell: the policy's parameter count, ‖∇J‖ and J at pi, and each lag (keyed "%g")."""

    model: str
    length: int
    parameters: int
    target_grad_norm: float
    objective: float
    per_lag: dict[str, Lag]


@dataclass
class Exactness:
    max_rel_bias: float  # the largest exact ‖E g − ∇J‖ ÷ ‖∇J‖ of sequence IS over every cell and lag
    holds: bool  # below 1e-9: float64 rounding only


@dataclass
class Coverage:
    settings: int  # (cell, lag) settings with sequence IS
    covered: int  # those whose bias2 interval covers 0


@dataclass
class Lowest:
    estimator: str
    rel_mse: list[float]  # [value, lo, hi]
    beats_zero_update: bool  # the interval's upper end is below 1


@dataclass
class Findings:
    """The checks on the numbers: sequence IS unbiased everywhere (exactly, and its sampled bias2 interval covers 0),
    the lowest-MSE estimator at the largest lag per cell ("model/T=length"), whether the two models agree on it per
    length."""

    seq_is_exactly_unbiased: Exactness | None
    seq_is_sampled_bias_covers_zero: Coverage | None
    lowest_mse_at_max_lag: dict[str, Lowest]
    agree: dict[str, bool]


@dataclass
class Summary:
    """What a real-model variance study found (summary.json); ``cells`` keyed "model/T=length"."""

    study: str
    env: str
    task: str
    model_size: str
    estimators: list[str]
    lags: list[float]
    lengths: list[int]
    advantage: str
    replicates: int
    warm_start: float
    cells: dict[str, Cell]
    findings: Findings


def run(cfg: Config, progress: bool | None = None) -> StudyResult:
    """Every (model, length) cell's variance study; the tidy rows with ``model`` and ``length`` keys. Each length's
    warm start is trained (or read from the cache) first, with ``progress``: the cells then read it from the cache."""
    from lab.pretrain import warm_start

    cfg.validate()
    for T in cfg.lengths:
        warm_start(cfg.study("transformer", T).make_env(), cfg.model, cfg.warm_start, seed=cfg.seed,
                   device=cfg.device, progress=progress)
    frames, cells = [], {}
    for model, T in cfg.cells():
        results, summary = variance.run(cfg.study(model, T), progress)
        frames.append(results.assign(model=model, length=T))
        cells[f"{model}/T={T}"] = _cell(summary, model, T)
    summary = Summary(study="real_model_variance", env=cfg.env, task=cfg.task(), model_size=cfg.model,
                      estimators=list(cfg.estimators), lags=[float(v) for v in cfg.values],
                      lengths=[int(T) for T in cfg.lengths], advantage=cfg.advantage, replicates=cfg.replicates,
                      warm_start=cfg.warm_start, cells=cells, findings=findings(cells, cfg.values, cfg.lengths))
    return StudyResult(pd.concat(frames, ignore_index=True), asdict(summary))


def _cell(summary: dict, model: str, T: int) -> Cell:
    """Per lag: divergence, ESS, and per estimator (value, lo, hi) of rel_mse and bias2, and the exact numbers."""
    per_lag = {}
    for entry in summary["per_value"]:
        ests = {}
        for e, point in entry["estimators"].items():
            iv = entry["intervals"][e]
            ests[e] = Point([point["rel_mse"], *iv["rel_mse"]], [point["bias2"], *iv["bias2"]],
                            **{k: point[k] for k in ("exact_rel_bias", "exact_cos", "exact_size") if k in point})
        per_lag[f"{entry['staleness']:g}"] = Lag(entry["kl_token"], entry["chi2_seq"], entry["ess_frac"], ests)
    return Cell(model, T, summary["parameters"], summary["target_grad_norm"], summary["objective"], per_lag)


def findings(cells: dict[str, Cell], values: list, lengths: list[int]) -> Findings:
    """The checks the report states (see ``Findings``)."""
    exact, sampled, lowest = [], [], {}
    for key, cell in cells.items():
        last = cell.per_lag[f"{max(values):g}"].estimators
        best = min(last, key=lambda e: last[e].rel_mse[0])
        lowest[key] = Lowest(best, last[best].rel_mse, last[best].rel_mse[2] < 1)
        for lag in cell.per_lag.values():
            s = lag.estimators.get("seq_is")
            if s is None:
                continue
            if s.exact_rel_bias is not None:
                exact.append(s.exact_rel_bias)
            sampled.append(s.bias2[1] <= 0 <= s.bias2[2])
    agree = {}
    for T in lengths:
        a, b = lowest.get(f"transformer/T={T}"), lowest.get(f"tabular/T={T}")
        if a and b:
            agree[str(T)] = a.estimator == b.estimator
    return Findings(
        Exactness(float(np.max(exact)), float(np.max(exact)) < 1e-9) if exact else None,
        Coverage(len(sampled), int(np.sum(sampled))) if sampled else None, lowest, agree)
