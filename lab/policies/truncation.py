"""Truncated sampling: the kept set of top-k, top-p and min-p, and the sampler that draws from it.

An inference engine samples from q(a) = pi(a) 1[a in S] / pi(S), where S is the set of tokens its sampler keeps
from the next-token logits (after temperature). ``kept_set(logits, top_k, top_p, min_p)`` is that set as a boolean
mask, with the engines' semantics (vLLM v1: ``vllm/v1/sample/sampler.py`` and
``vllm/v1/sample/ops/topk_topp_sampler.py::apply_top_k_top_p_pytorch``), in vLLM's order:

1. min-p (an argmax-invariant logits processor, applied after temperature and before top-k/top-p): keep a iff
   p(a) >= min_p * max_b p(b);
2. top-k: keep a iff its logit >= the k-th largest logit (every token tied with the k-th is kept, as both vLLM's
   ``logits_sort < kth`` and HF transformers' ``TopKLogitsWarper`` keep them);
3. top-p on the distribution left by steps 1-2, renormalised: sorted ascending, a token is removed iff the
   cumulative probability up to and including it is <= 1 - p (vLLM's ``probs_sum <= 1 - p``, HF's
   ``TopPLogitsWarper``). Tie rule: tokens of equal probability are removed together or not at all (a token is
   removed iff the mass of every token with probability <= its own is <= 1 - p), where the engines' choice among
   tied tokens follows their unstable sort; without ties at the boundary the two agree exactly.

HF transformers applies min-p after top-k and top-p; the two orders differ only when min-p is combined with top-p
(top-p on a min-p-renormalised distribution keeps fewer tokens). The most probable token is always kept (p > 0,
k >= 1, min_p < 1). Settings that cut nothing are skipped as the engines skip them (top_p = 1, top_k = V or None,
min_p = 0), so they give bit-identical logits to no truncation.

``Truncated(policy, top_p=, top_k=, min_p=)`` wraps any policy's logits (tabular, transformer, hf) like
``Tempered`` and ``Perturbed``: logits outside the kept set become -inf, so sampling and scoring through it is the
engine's q. ``kept(theta, prompts, tokens)`` gives the kept set at every position [..., T, V]; ``to_ids`` and
``from_ids`` convert kept masks to and from per-token id lists with offsets (slime's ``rollout_top_p_token_ids``).

Replaying the kept set in the trainer: log q_pi(y_t) = log pi(y_t) - log pi(S_t), with
``kept_log_mass(logits, kept)`` = log pi(S_t) = logsumexp_{a in S_t} z_a - logsumexp_a z_a (differentiable; the
input ``kept_log_mass`` of every replayable estimator, lab.estimators.contract), and ``replayed(logits, tokens,
kept)`` the renormalised log-probs themselves, computed as the sampler computes log q (the engine's path: on-policy
the replayed ratio is then exactly 1, which estimators with a kink at ratio 1, such as KL-Cov's |log ratio|, need).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from lab.errors import LabError
from lab.policies.protocol import _Wrapper

KNOBS = ("top_p", "top_k", "min_p")


def check_truncation(top_p: float = 1.0, top_k: int | None = None, min_p: float = 0.0,
                     vocab_size: int | None = None) -> None:
    """One LabError line unless p in (0, 1], k a whole number in [1, V] (or None: off), min_p in [0, 1)."""
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not (math.isfinite(top_p)
                                                                               and 0 < top_p <= 1):
        raise LabError(f"top_p must be a number in (0, 1] (1: no top-p), got {top_p!r}")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, numbers.Real) or top_k != int(top_k) or top_k < 1:
            raise LabError(f"top_k must be a whole number >= 1 (or off), got {top_k!r}")
        if vocab_size is not None and top_k > vocab_size:
            raise LabError(f"top_k {int(top_k)} exceeds the vocabulary size {vocab_size}; use at most {vocab_size}")
    if isinstance(min_p, bool) or not isinstance(min_p, numbers.Real) or not (math.isfinite(min_p)
                                                                               and 0 <= min_p < 1):
        raise LabError(f"min_p must be a number in [0, 1) (0: no min-p), got {min_p!r}")


def active(top_p: float = 1.0, top_k: int | None = None, min_p: float = 0.0, vocab_size: int | None = None) -> bool:
    """Whether the settings can cut anything (the engines skip top_p = 1, top_k = V and min_p = 0)."""
    return top_p < 1 or min_p > 0 or (top_k is not None and (vocab_size is None or int(top_k) < vocab_size))


def kept_set(logits: torch.Tensor, top_k: int | None = None, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """The boolean kept set [..., V] of the next-token ``logits`` [..., V] (after temperature; -inf entries are
    never kept), in vLLM's order: min-p, top-k, top-p (module docstring). Computed in float64."""
    z = logits.detach().double()
    keep = z > -math.inf
    V = z.shape[-1]
    if min_p > 0:
        p = torch.softmax(z, -1)
        keep &= p >= min_p * p.amax(-1, keepdim=True)
    if top_k is not None and int(top_k) < V:
        kth = torch.topk(torch.where(keep, z, -math.inf), int(top_k), dim=-1).values[..., -1:]
        keep &= z >= kth
    if top_p < 1:
        p = torch.softmax(torch.where(keep, z, -math.inf), -1)
        ps, _ = torch.sort(p, dim=-1)
        cs = torch.cumsum(ps, -1)
        # mass of every token with probability <= p(a): the cumulative sum at the last of a's tie class
        last = torch.searchsorted(ps.contiguous(), p.contiguous(), right=True) - 1
        keep &= ~(cs.gather(-1, last) <= 1 - top_p)
        keep |= p == p.amax(-1, keepdim=True)  # at least one token (rounding in the cumulative sum)
    return keep


def kept_log_mass(logits: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """log pi(S) = logsumexp over the kept set minus logsumexp over the vocabulary: [..., V] -> [...]
    (differentiable in ``logits``; 0 where every token is kept)."""
    return torch.logsumexp(logits.masked_fill(~kept.to(logits.device), -math.inf), -1) - torch.logsumexp(logits, -1)


def replayed(logits: torch.Tensor, tokens: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
    """log pi(y_t) - log pi(S_t) at ``tokens`` [..., T]: the log-softmax of the logits restricted to the kept sets
    [..., T, V], computed as the sampler computes log q (so on-policy the ratio is exactly 1; differentiable)."""
    restricted = logits.masked_fill(~kept.to(logits.device), -math.inf)
    return torch.log_softmax(restricted, -1).gather(-1, tokens.to(logits.device)[..., None]).squeeze(-1)


def to_ids(kept: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[list[int], list[int]]:
    """Kept masks [N, T, V] as slime dumps them: the kept token ids of every real position, concatenated, and the
    offsets [n_positions + 1] where each position's ids start (positions in row-major order, real ones only)."""
    flat = kept.reshape(-1, kept.shape[-1])
    if mask is not None:
        flat = flat[mask.reshape(-1) > 0]
    counts = flat.sum(-1)
    offsets = [0, *torch.cumsum(counts, 0).tolist()]
    return flat.nonzero()[:, 1].tolist(), offsets


def from_ids(ids, offsets, vocab_size: int) -> torch.Tensor:
    """The kept masks [n_positions, V] of ``to_ids``'s lists (ids outside [0, V) are refused)."""
    n = len(offsets) - 1
    ids = torch.as_tensor(list(ids), dtype=torch.long)
    if ids.numel() and (ids.min() < 0 or ids.max() >= vocab_size):
        raise LabError(f"kept token ids must lie in [0, {vocab_size}), got {int(ids.min())}..{int(ids.max())}")
    rows = torch.repeat_interleave(torch.arange(n), torch.as_tensor(list(offsets)).diff())
    out = torch.zeros(n, vocab_size, dtype=torch.bool)
    out[rows, ids] = True
    return out


@dataclass(frozen=True, eq=False)
class Truncated(_Wrapper):
    """The sampler with top-k / top-p / min-p: logits outside the kept set (``kept_set``) become -inf.

    Settings that cut nothing leave the logits untouched (bit-identical to ``base``)."""

    top_p: float = 1.0
    top_k: int | None = None
    min_p: float = 0.0

    def __post_init__(self):
        check_truncation(self.top_p, self.top_k, self.min_p, self.base.vocab_size)

    @property
    def active(self) -> bool:
        return active(self.top_p, self.top_k, self.min_p, self.base.vocab_size)

    def kept_of(self, logits: torch.Tensor) -> torch.Tensor:
        """The kept set of given base logits [..., V]."""
        return kept_set(logits, self.top_k, self.top_p, self.min_p).to(logits.device)

    def kept(self, theta, prompts, tokens) -> torch.Tensor:
        """The kept set at every position under teacher forcing: [..., T, V] bool."""
        return self.kept_of(self.base.logits(theta, prompts, tokens))

    def logits(self, theta, prompts, tokens):
        out = self.base.logits(theta, prompts, tokens)
        if not self.active:
            return out
        return out.masked_fill(~self.kept_of(out), -math.inf)

    def describe(self) -> str:
        parts = [f"min_p {self.min_p:g}" if self.min_p > 0 else "",
                 f"top_k {int(self.top_k)}" if self.top_k is not None and self.top_k < self.vocab_size else "",
                 f"top_p {self.top_p:g}" if self.top_p < 1 else ""]
        return ", ".join(p for p in parts if p) or "no truncation"


def sampler_kept(policy):
    """The Truncated layer of a (possibly wrapped) sampler policy, or None."""
    while policy is not None:
        if isinstance(policy, Truncated):
            return policy
        policy = getattr(policy, "base", None)
    return None
