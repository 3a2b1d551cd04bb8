"""Per-sequence advantages from group rewards [..., n_groups, G] (every group shares one prompt).

- reward:  A_i = R_i                                      (plain REINFORCE; unbiased)
- rloo:    A_i = R_i - mean_{j != i} R_j                  (leave-one-out baseline; unbiased, Kool et al. 2019)
- grpo:    A_i = (R_i - mean_j R_j) / (std_j R_j + eps)   (GRPO, Shao et al. 2024; std with Bessel's correction
                                                           as torch.std in verl; biased: data-dependent scale)
- drgrpo:  A_i = R_i - mean_j R_j                         (Dr. GRPO, Liu et al. 2025; equals (G-1)/G * rloo)
- gpg:     A_i = alpha (R_i - mean_j R_j), alpha = (responses in the batch) / (responses with R != 0), at least 1
                                                          (GPG, Chu et al. 2025, arXiv 2504.02546; verl 0.9.1
                                                           compute_gpg_outcome_advantage, f_norm = 1: a batch-level
                                                           scale that is biased, larger when rewards are sparse)

The VCPO baseline depends on the importance weights, so it lives in its estimator (lab.estimators.baselines), which
takes the rewards.
"""
from __future__ import annotations

from lab.lazy import torch

from lab.errors import LabError

ADVANTAGES = ("reward", "rloo", "grpo", "drgrpo", "gpg")
GRPO_EPS = 1e-6


def check(kind: str, group_size: int) -> None:
    if kind not in ADVANTAGES:
        raise LabError(f"unknown advantage {kind!r}; choose one of {', '.join(ADVANTAGES)}")
    if group_size < 1:
        raise LabError(f"group size must be at least 1, got {group_size}")
    if kind != "reward" and group_size < 2:
        raise LabError(f"advantage {kind!r} needs groups of at least 2 responses per prompt; "
                       f"raise --group-size or use --advantage reward")


def group_advantages(rewards: torch.Tensor, kind: str) -> torch.Tensor:
    """Advantages with the shape of ``rewards`` ([..., n_groups, G])."""
    check(kind, rewards.shape[-1])
    if kind == "reward":
        return rewards
    if kind == "rloo":
        return leave_one_out(rewards)
    centred = rewards - rewards.mean(-1, keepdim=True)
    if kind == "drgrpo":
        return centred
    if kind == "gpg":
        nonzero = (rewards != 0).sum((-2, -1), keepdim=True).clamp(min=1).to(rewards.dtype)
        return rewards.shape[-2] * rewards.shape[-1] / nonzero * centred
    return centred / (rewards.std(-1, keepdim=True) + GRPO_EPS)


def leave_one_out(values: torch.Tensor, group_size: int | None = None) -> torch.Tensor:
    """v_i - mean_{j != i} v_j = G/(G-1) (v_i - mean_j v_j) within groups of G: the last axis is one group, or with
    ``group_size`` it holds consecutive groups of that size."""
    G = group_size or values.shape[-1]
    g = values.reshape(*values.shape[:-1], -1, G)
    return ((g - g.mean(-1, keepdim=True)) * G / (G - 1)).reshape(values.shape)
