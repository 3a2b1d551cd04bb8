"""Do the toy's lessons survive on a real model? The variance study on the lab's transformer, beside the tabular
policy on the same task, against staleness (lag on a real Adam trajectory) and response length.

For each response length T the task's difficulty is set to give T answer tokens (chain sums: T steps; sorting: T
digits; addition: T - 1 digits per operand) over its training prompts, small enough to enumerate every response,
so both policies get the exact gradient grad J, exact divergences and, with ``exact_directions``, each estimator's
exact expected gradient (advantage = R) by enumeration. Both start from the SAME distribution pi_0: the
transformer's supervised warm start (``lab.pretrain``: an exact-match accuracy of ``warm_start``), copied exactly
into the prefix-tree table for the tabular policy; each then climbs the exact objective with Adam for
``trajectory_steps`` steps, and a lag of k is the snapshot k steps behind. What differs is the parameterisation:
a transformer update moves every prompt's distribution at once, a table update only the states it touches. Everything else is ``lab.studies.variance``: the same replicate batches for every estimator, bias /
variance / MSE against grad J with bootstrap intervals. Results: the variance study's tidy rows with two more keys,
``model`` (transformer | tabular) and ``length``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

import toy_envs
from lab.configs import check_types, check_unique
from lab.errors import LabError
from lab.studies import StudyResult, variance

DIFFICULTY = {"chain": lambda T: T, "sorting": lambda T: T, "addition": lambda T: T - 1}  # T answer tokens
MODELS = ("transformer", "tabular")


@dataclass
class Config:
    """The real-model variance study. Defaults finish in a few minutes on 2 cores."""

    env: str = "chain3"
    """task env preset (see `lab envs`): chain sums, sorting or addition"""
    lengths: list = field(default_factory=lambda: [2, 3])
    """response lengths T (the task's difficulty is set to give them)"""
    n_prompts: int = 6
    """training prompts of the task (every response of each is enumerated)"""
    model: str = "small"
    """transformer size (see lab.policies.transformer.SIZES)"""
    warm_start: float = 0.3
    """exact-match accuracy of the transformer's supervised warm start"""
    tabular: bool = True
    """also run the tabular prefix-tree policy on the same task"""
    values: list = field(default_factory=lambda: [0, 1, 2, 4, 8])
    """lags: Adam steps between mu and pi"""
    estimators: list = field(default_factory=lambda: ["reinforce", "seq_is", "token_is", "ppo_clip", "tis_seq",
                                                      "vespo"])
    """estimators (see `lab estimators`)"""
    advantage: str = "rloo"
    """reward | rloo | grpo | drgrpo"""
    group_size: int = 8
    """G responses per prompt"""
    batch_size: int = 64
    """B responses per batch"""
    replicates: int = 200
    """M replicate batches per setting"""
    trajectory_steps: int = 8
    """Adam steps on the exact objective from the starting point to pi"""
    lr: float = 3e-4
    """the transformer trajectory's Adam learning rate (Adam moves every one of its parameters by about lr per step)"""
    tabular_lr: float = 0.1
    """the tabular trajectory's Adam learning rate (chosen so that the lags span a similar range of KL per token)"""
    loss_agg_mode: str = "seq-mean-token-sum"
    """loss aggregation mode, or native"""
    exact_directions: bool = True
    """the exact expected gradient of each estimator (advantage R): relative bias, cosine, size"""
    n_boot: int = 500
    """bootstrap resamples"""
    ci: float = 0.95
    """interval coverage"""
    seed: int = 0
    """seed of every random stream"""
    device: str = "cpu"
    """where the transformer's passes run: cpu | cuda"""
    chunk: int = 0
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
            if not isinstance(T, int) or T < low:
                raise LabError(f"response lengths of the {task} task are whole numbers >= {low}, got {T!r}")
        for model, T in self.cells():
            self.study(model, T).validate()


def run(cfg: Config, progress: bool | None = None) -> StudyResult:
    """Every (model, length) cell's variance study; the tidy rows with ``model`` and ``length`` keys."""
    cfg.validate()
    frames, cells = [], {}
    for model, T in cfg.cells():
        results, summary = variance.run(cfg.study(model, T), progress)
        frames.append(results.assign(model=model, length=T))
        cells[f"{model}/T={T}"] = _cell_summary(summary, model, T)
    results = pd.concat(frames, ignore_index=True)
    summary = {"study": "real_model_variance", "env": cfg.env, "task": cfg.task(), "model_size": cfg.model,
               "estimators": list(cfg.estimators), "lags": [float(v) for v in cfg.values],
               "lengths": [int(T) for T in cfg.lengths], "advantage": cfg.advantage, "replicates": cfg.replicates,
               "warm_start": cfg.warm_start, "cells": cells, "findings": findings(cells, cfg)}
    return StudyResult(results, summary)


def _cell_summary(summary: dict, model: str, T: int) -> dict:
    """Per lag: divergence, ESS, and per estimator (value, lo, hi) of rel_mse, rel bias, bias2 and exact numbers."""
    per_lag = {}
    for entry in summary["per_value"]:
        ests = {}
        for e, point in entry["estimators"].items():
            iv = entry["intervals"][e]
            ests[e] = {"rel_mse": [point["rel_mse"], *iv["rel_mse"]], "bias2": [point["bias2"], *iv["bias2"]],
                       **{k: point[k] for k in ("exact_rel_bias", "exact_cos", "exact_size") if k in point}}
        per_lag[f"{entry['staleness']:g}"] = {"kl_token": entry["kl_token"], "chi2_seq": entry["chi2_seq"],
                                              "ess_frac": entry["ess_frac"], "estimators": ests}
    return {"model": model, "length": T, "parameters": summary["parameters"],
            "target_grad_norm": summary["target_grad_norm"], "objective": summary["objective"],
            "per_lag": per_lag}


def findings(cells: dict, cfg: Config) -> dict:
    """The checks the report states: sequence IS unbiased everywhere (exactly, and its sampled bias2 interval covers
    0), the lowest-MSE estimator at the largest lag per cell, and whether the two models agree on it."""
    out = {"seq_is_exactly_unbiased": None, "seq_is_sampled_bias_covers_zero": None, "lowest_mse_at_max_lag": {},
           "agree": {}}
    exact, sampled = [], []
    for key, cell in cells.items():
        last = cell["per_lag"][f"{max(cfg.values):g}"]["estimators"]
        best = min(last, key=lambda e: last[e]["rel_mse"][0])
        out["lowest_mse_at_max_lag"][key] = {"estimator": best, "rel_mse": last[best]["rel_mse"],
                                             "beats_zero_update": last[best]["rel_mse"][2] < 1}
        for lag in cell["per_lag"].values():
            s = lag["estimators"].get("seq_is")
            if s is None:
                continue
            if "exact_rel_bias" in s:
                exact.append(s["exact_rel_bias"])
            sampled.append(s["bias2"][1] <= 0 <= s["bias2"][2])
    if exact:
        out["seq_is_exactly_unbiased"] = {"max_rel_bias": float(np.max(exact)), "holds": float(np.max(exact)) < 1e-9}
    if sampled:
        out["seq_is_sampled_bias_covers_zero"] = {"settings": len(sampled), "covered": int(np.sum(sampled))}
    for T in cfg.lengths:
        a, b = out["lowest_mse_at_max_lag"].get(f"transformer/T={T}"), out["lowest_mse_at_max_lag"].get(
            f"tabular/T={T}")
        if a and b:
            out["agree"][str(T)] = a["estimator"] == b["estimator"]
    return out
