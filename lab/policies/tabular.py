"""Tabular softmax policies over token sequences, functional in a parameter tensor ``theta``.

Both policies map (theta, prompts [..., ], tokens [..., T]) to next-token logits [..., T, V] under teacher
forcing: the logits at position t depend only on the prompt and tokens before t. Parameters are one table whose
rows ARE the logits (``rows(prompts, tokens)`` says which row each position reads), so the variance engine's
gradient backend differentiates the gathered rows and scatters them back (``gradient_backend = "rows"``).

- PrefixTreePolicy: one logit vector per (prompt, prefix); it can represent any sequence distribution.
  Prefix y_<t has node index (V^t - 1)/(V - 1) + sum_{i<t} y_i V^(t-1-i).
- MarkovPolicy: one logit vector per (prompt, position, previous token); the previous token at t=0 is BOS.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


class _Table:
    """What both tabular policies share: logits are gathered rows of theta.reshape(-1, V)."""

    gradient_backend = "rows"

    def init_params(self, scale: float, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
        """Random logits ~ N(0, scale^2)."""
        return scale * torch.randn(self.shape, generator=generator, dtype=dtype)

    def logits(self, theta: torch.Tensor, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.rows(prompts, tokens), theta.reshape(-1, self.vocab_size))

    def noise_table(self, generator: torch.Generator) -> torch.Tensor:
        """One N(0, 1) logit per (state, token): a table like theta."""
        return torch.randn(self.shape, generator=generator, dtype=torch.float64)

    def noise_logits(self, noise: torch.Tensor, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.logits(noise, prompts, tokens)


@dataclass(frozen=True)
class PrefixTreePolicy(_Table):
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

    def params_for(self, env, log_p: torch.Tensor) -> torch.Tensor:
        """Logits representing the sequence distribution exp(log_p) ([P, N], the env's enumeration order) exactly.

        Each node's logits are the log marginal probabilities of its children (the node's own mass cancels in the
        softmax); nodes no response reaches get logits 0, children of zero mass -1000.
        """
        prompts, tokens, mask = env.enumerate()
        V = self.vocab_size
        index = (self.rows(prompts, tokens) * V + tokens)[mask > 0]
        mass = log_p.double().reshape(-1).exp()[:, None].expand(tokens.shape)[mask > 0]
        table = torch.zeros(math.prod(self.shape), dtype=torch.float64).index_add_(0, index, mass).reshape(-1, V)
        logits = torch.log(table).clamp(min=-1000.0)
        logits = torch.where((table > 0).any(-1, keepdim=True), logits, torch.zeros_like(logits))
        return logits.reshape(self.shape)


@dataclass(frozen=True)
class MarkovPolicy(_Table):
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


POLICIES = {"prefix": PrefixTreePolicy, "markov": MarkovPolicy}
