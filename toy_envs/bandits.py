"""Autoregressive sequence bandits: a prompt, a response of up to T tokens from a vocabulary of V, a reward.

Every (prompt, response) pair can be enumerated, so objectives and gradients are exact. With ``eos=True``
token 0 ends the response: it is a real, masked-in token, later positions are padding (token 0, mask 0).

Reward families (``reward=``):
- ``target``: 1 if the response equals the prompt's hidden target sequence, else 0 (sparse, verifiable).
- ``parity``: 1 if (prompt + sum of response tokens) is even, else 0 (a parity-like verifier).
- ``dense``: sum over real tokens of a per-(prompt, position, token) table, scaled to [-1, 1] in total.
- ``bernoulli``: success probability sigmoid(score) with a dense score table; the sampled reward is a
  Bernoulli draw, the exact objective uses the probability (noisy reward).

The ``long_*`` presets (T = 1024 by default, any length with ``length=``) are the Markov bandit family: far beyond
enumeration, but with the ``markov`` policy (next token given position and previous token) and a reward that a
finite state accumulates (target, parity, dense) every exact quantity comes from dynamic programming over
positions (``lab.engine.dp``).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
from lab.lazy import torch

from lab.errors import LabError

REWARDS = ("target", "parity", "dense", "bernoulli")
DEFAULT_ENUM_LIMIT = 2**20
MAX_PROMPTS, MAX_VOCAB, MAX_LENGTH = 1_000_000, 1_000_000, 100_000  # beyond any table or network the lab can hold


@dataclass(frozen=True)
class SequenceBandit:
    """A toy autoregressive bandit. ``seed`` fixes the hidden tables (targets, score tables)."""

    name: str
    n_prompts: int  # prompts x are drawn uniformly from range(n_prompts)
    vocab_size: int  # V
    length: int  # T, the maximum response length
    reward: str = "target"  # one of REWARDS
    eos: bool = False  # token 0 ends the response (variable length)
    seed: int = 0  # seed of the hidden reward tables
    description: str = ""

    def __post_init__(self):
        if self.reward not in REWARDS:
            raise LabError(f"unknown reward family {self.reward!r}; choose one of {', '.join(REWARDS)}")
        for field, most in (("n_prompts", MAX_PROMPTS), ("vocab_size", MAX_VOCAB), ("length", MAX_LENGTH)):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= most:
                raise LabError(f"env field {field} must be a whole number from 1 to {most:,}, got {value!r}")
        if self.vocab_size < 2 or (self.eos and self.vocab_size < 3):
            raise LabError("vocab_size must be at least 2 (3 with eos=True)")

    # ---- sizes and enumeration -------------------------------------------------------------
    @property
    def sequences_per_prompt(self) -> int:
        """Number of distinct responses: V^T, or with an end token sum_{t<T} (V-1)^t + (V-1)^T."""
        V, T = self.vocab_size, self.length
        if not self.eos:
            return V**T
        # responses ending in the end token at positions 1..T (sum_{t<T} (V-1)^t), plus those without it
        head = T if V == 2 else ((V - 1) ** T - 1) // (V - 2)
        return head + (V - 1) ** T

    @property
    def num_pairs(self) -> int:
        return self.n_prompts * self.sequences_per_prompt

    def check_enumerable(self, limit: int = DEFAULT_ENUM_LIMIT) -> None:
        if self.num_pairs > limit:
            raise LabError(
                f"env {self.name!r} has {self.num_pairs:,} (prompt, response) pairs, above the enumeration limit "
                f"{limit:,}; use Monte Carlo mode (--reference mc) or raise the limit (--enum-limit)"
            )

    def enumerate(self, limit: int = DEFAULT_ENUM_LIMIT):
        """All (prompt, response) pairs: prompts [N], tokens [N, T] (long), mask [N, T] (float64)."""
        self.check_enumerable(limit)
        return _enumerate(self)

    def _enumerate_uncached(self):
        V, T = self.vocab_size, self.length
        grid = torch.cartesian_prod(*[torch.arange(V)] * T) if T > 1 else torch.arange(V)[:, None]
        grid = grid.reshape(-1, T)
        mask = self.mask_of(grid)
        if self.eos:  # keep one representative per response: everything after the end token is padding
            grid = grid[((grid != 0) & (mask == 0)).sum(1) == 0]
            mask = self.mask_of(grid)
        n = grid.shape[0]
        prompts = torch.arange(self.n_prompts).repeat_interleave(n)
        return prompts, grid.repeat(self.n_prompts, 1), mask.repeat(self.n_prompts, 1)

    def mask_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """1 on real tokens: all of them, or with an end token up to and including the first one."""
        if not self.eos:
            return torch.ones(tokens.shape, dtype=torch.float64)
        ended_before = torch.cumsum((tokens == 0).long(), dim=-1) - (tokens == 0).long()
        return (ended_before == 0).double()

    # ---- rewards ---------------------------------------------------------------------------
    def _tables(self):
        return _tables(self)

    def _tables_uncached(self):
        g = torch.Generator().manual_seed(10_007 * self.seed + 17)
        V, T, P = self.vocab_size, self.length, self.n_prompts
        lo = 1 if self.eos else 0  # targets avoid the end token except as a terminator
        targets = torch.randint(lo, V, (P, T), generator=g)
        if self.eos:  # each target ends somewhere in 1..T
            ends = torch.randint(1, T + 1, (P,), generator=g)
            pos = torch.arange(T)[None, :]
            targets = torch.where(pos == (ends[:, None] - 1), torch.zeros_like(targets), targets)
            targets = torch.where(pos >= ends[:, None], torch.zeros_like(targets), targets)
        scores = torch.randn(P, T, V, generator=g, dtype=torch.float64)
        return targets, scores

    def expected_reward(self, prompts: torch.Tensor, tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """E[R | x, y] in float64 (the reward itself for deterministic families)."""
        targets, scores = self._tables()
        mask = mask.double()
        if self.reward == "target":
            return (tokens == targets[prompts]).all(dim=-1).double()
        if self.reward == "parity":
            total = prompts + (tokens * mask.long()).sum(-1)
            return (total % 2 == 0).double()
        per_token = scores[prompts[:, None], torch.arange(self.length)[None, :], tokens] * mask
        if self.reward == "dense":
            return per_token.sum(-1) / self.length
        return torch.sigmoid(per_token.sum(-1) / np.sqrt(self.length))

    def sample_reward(self, prompts, tokens, mask, generator: torch.Generator) -> torch.Tensor:
        """The reward a verifier returns: a Bernoulli draw for ``bernoulli``, else the exact reward."""
        expected = self.expected_reward(prompts, tokens, mask)
        if self.reward != "bernoulli":
            return expected
        return torch.bernoulli(expected, generator=generator)


@functools.lru_cache(maxsize=8)
def _enumerate(env: SequenceBandit):
    return env._enumerate_uncached()


@functools.lru_cache(maxsize=32)
def _tables(env: SequenceBandit):
    return env._tables_uncached()


_PRESETS = {
    p.name: p
    for p in [
        SequenceBandit("tiny_target", 2, 4, 4, "target",
                       description="2 prompts, V=4, T=4: 512 pairs, exact-match reward"),
        SequenceBandit("tiny_parity", 2, 4, 4, "parity", description="2 prompts, V=4, T=4: 512 pairs, parity verifier"),
        SequenceBandit("small_dense", 4, 6, 5, "dense",
                       description="4 prompts, V=6, T=5: 31,104 pairs, dense per-token reward"),
        SequenceBandit("small_bernoulli", 4, 6, 5, "bernoulli",
                       description="4 prompts, V=6, T=5: noisy Bernoulli reward"),
        SequenceBandit("small_eos", 4, 6, 6, "target", eos=True,
                       description="4 prompts, V=6, T<=6 with an end token: variable length"),
        SequenceBandit("medium_target", 4, 8, 5, "target",
                       description="4 prompts, V=8, T=5: 131,072 pairs, exact-match reward"),
        SequenceBandit("large_parity", 4, 4, 10, "parity",
                       description="4 prompts, V=4, T=10: 4.2M pairs, beyond the default enumeration limit "
                                   "(Monte Carlo mode)"),
        SequenceBandit("large_dense", 4, 4, 9, "dense",
                       description="4 prompts, V=4, T=9: 1,048,576 pairs, at the enumeration limit"),
        SequenceBandit("long_dense", 2, 4, 1024, "dense",
                       description="2 prompts, V=4, T=1024 (any length): per-position reward, exact by DP (markov)"),
        SequenceBandit("long_parity", 2, 4, 1024, "parity",
                       description="2 prompts, V=4, T=1024 (any length): parity verifier, exact by DP (markov)"),
        SequenceBandit("long_eos", 2, 4, 1024, "dense", eos=True,
                       description="2 prompts, V=4, T<=1024 with an end token: per-position reward, exact by DP "
                                   "(markov)"),
    ]
}


def names() -> list[str]:
    return list(_PRESETS)


def make(name: str, **overrides) -> SequenceBandit:
    """A named preset, with fields overridden by keyword (``make('tiny_target', length=6)``)."""
    if name not in _PRESETS:
        raise LabError(f"unknown env {name!r}; known envs: {', '.join(_PRESETS)} (see `lab envs`)")
    from lab.typed import check_overrides

    overrides = check_overrides(SequenceBandit, overrides, "env field", fixed=("name", "description"))
    return dataclasses.replace(_PRESETS[name], **overrides)
