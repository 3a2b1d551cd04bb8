"""Loss aggregation modes (verl names). The choice is a bias choice, so it is always explicit.

- token-mean:              sum_{i,t} m l / sum_{i,t} m               (length-weighted)
- seq-mean-token-sum:      1/B sum_i sum_t m l                       (unbiased for the sequence objective)
- seq-mean-token-mean:     1/B sum_i (sum_t m l / sum_t m)           (per-sequence length normalisation)
- seq-mean-token-sum-norm: sum_{i,t} m l / (B T_max)                 (Dr. GRPO: a constant normaliser)
"""
from __future__ import annotations

import torch

from lab.errors import LabError

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise LabError(f"unknown loss_agg_mode {mode!r}; choose one of {', '.join(AGG_MODES)}")


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Aggregate a [B, T] per-token loss. Empty rows count as zero-length sequences (no NaN)."""
    check_mode(loss_agg_mode)
    masked = loss_mat * loss_mask
    B, T = loss_mat.shape[-2], loss_mat.shape[-1]
    if loss_agg_mode == "token-mean":
        return masked.sum((-2, -1)) / loss_mask.sum((-2, -1)).clamp(min=1.0)
    if loss_agg_mode == "seq-mean-token-sum":
        return masked.sum(-1).mean(-1)
    if loss_agg_mode == "seq-mean-token-mean":
        return (masked.sum(-1) / loss_mask.sum(-1).clamp(min=1.0)).mean(-1)
    return masked.sum((-2, -1)) / (B * T)


def target_scale(loss_agg_mode: str, length: int) -> float:
    """The factor c such that, for fixed-length responses, the aggregated REINFORCE gradient estimates c * grad J."""
    check_mode(loss_agg_mode)
    return 1.0 if loss_agg_mode == "seq-mean-token-sum" else 1.0 / length


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)
