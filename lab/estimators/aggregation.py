"""Loss aggregation modes (verl names). The choice is a bias choice, so it is always explicit.

- token-mean:              sum_{i,t} m l / sum_{i,t} m               (length-weighted)
- seq-mean-token-sum:      1/B sum_i sum_t m l                       (unbiased for the sequence objective)
- seq-mean-token-mean:     1/B sum_i (sum_t m l / sum_t m)           (per-sequence length normalisation)
- seq-mean-token-sum-norm: sum_{i,t} m l / (B T_max)                 (Dr. GRPO: a constant normaliser)

Rows without a real token (a response truncated to nothing, a sequence masked out) contribute 0 and still count
in B. That is what the trainers run: verl 0.9.1's trainer passes ``global_batch_size`` = ppo_mini_batch_size x
rollout.n (every sequence of the mini-batch) to ``core_algos.agg_loss`` and its token-mean divides by the global
token count; TRL's GRPOTrainer (1.16) takes ``.mean()`` over all rows for loss_type grpo, sapo and luspo and
divides by B x max_completion_length for dr_grpo (seq-mean-token-sum-norm with T_max = max_completion_length).
Only verl's ``agg_loss`` called without global batch information (a single micro-batch, e.g. a policy loss
called on its own) divides the seq-mean-* modes by the number of non-empty rows; ``lab.estimators.to_verl``
reproduces that case too. An all-masked batch aggregates to 0 in every mode (verl's token-mean gives 0/0 there).

Masked positions are selected with ``torch.where``, never multiplied by 0, so NaN or inf on padding cannot leak.
"""
from __future__ import annotations

from lab.lazy import torch

from lab.errors import LabError

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise LabError(f"unknown loss_agg_mode {mode!r}; choose one of {', '.join(AGG_MODES)}")


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x where mask > 0, else 0 (torch.where: a NaN or inf on a masked position does not survive)."""
    return torch.where(mask > 0, x * mask, torch.zeros((), dtype=torch.result_type(x, mask)))


def agg_loss(loss_mat: torch.Tensor, loss_mask: torch.Tensor, loss_agg_mode: str) -> torch.Tensor:
    """Aggregate a [B, T] per-token loss. Empty rows count as zero-length sequences (no NaN) and as rows."""
    check_mode(loss_agg_mode)
    masked = _masked(loss_mat, loss_mask)
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
    """Mean of x over the positions where mask > 0 (0 when there are none); masked values never leak."""
    return _masked(x, mask).sum() / mask.sum().clamp(min=1.0)
