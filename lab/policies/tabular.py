"""Tabular softmax policies over token sequences, functional in a parameter tensor ``theta``.

Both policies map (theta, prompts [..., ], tokens [..., T]) to next-token logits [..., T, V] under teacher
forcing: the logits at position t depend only on the prompt and tokens before t. Parameters are one tensor
so that ``torch.func`` (grad, vmap) can differentiate a loss with respect to them directly.

- PrefixTreePolicy: one logit vector per (prompt, prefix); it can represent any sequence distribution.
  Prefix y_<t has node index (V^t - 1)/(V - 1) + sum_{i<t} y_i V^(t-1-i).
- MarkovPolicy: one logit vector per (prompt, position, previous token); the previous token at t=0 is BOS.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefixTreePolicy:
    n_prompts: int
    vocab_size: int
    length: int

    @property
    def nodes_per_prompt(self) -> int:
        V, T = self.vocab_size, self.length
        return sum(V**t for t in range(T))

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.n_prompts, self.nodes_per_prompt, self.vocab_size)

    def rows(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Row of theta.reshape(-1, V) used at every position: [..., T]."""
        V, T = self.vocab_size, self.length
        prefix = torch.zeros_like(tokens)
        for t in range(1, T):  # code of y_<t in base V, accumulated left to right (T is small)
            prefix[..., t] = prefix[..., t - 1] * V + tokens[..., t - 1]
        offsets = torch.tensor([(V**t - 1) // (V - 1) for t in range(T)], dtype=torch.long)
        return prompts[..., None] * self.nodes_per_prompt + offsets + prefix

    def logits(self, theta: torch.Tensor, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.rows(prompts, tokens), theta.reshape(-1, self.vocab_size))


@dataclass(frozen=True)
class MarkovPolicy:
    n_prompts: int
    vocab_size: int
    length: int

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.n_prompts, self.length, self.vocab_size + 1, self.vocab_size)

    def rows(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        V, T = self.vocab_size, self.length
        bos = torch.full_like(tokens[..., :1], V)
        previous = torch.cat([bos, tokens[..., :-1]], dim=-1)
        position = torch.arange(T)
        return (prompts[..., None] * T + position) * (V + 1) + previous

    def logits(self, theta: torch.Tensor, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.rows(prompts, tokens), theta.reshape(-1, self.vocab_size))


POLICIES = {"prefix": PrefixTreePolicy, "markov": MarkovPolicy}
