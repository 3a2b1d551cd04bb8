"""What the lab needs from a policy, in one place.

A policy is a parameterised autoregressive model over responses of at most ``length`` tokens from a vocabulary of
``vocab_size``, given a prompt id. Its parameters are ONE tensor ``theta`` (a table for tabular policies, a flat
vector for networks), so optimisers, snapshots, trajectories and per-replicate gradients treat every kind alike.
Everything else (log-probs, sampling, exact supports, gradients) is built on these members:

    vocab_size, length        V and T
    shape                     the shape of theta
    gradient_backend          "rows": the logits are rows of theta (tabular; ``rows(prompts, tokens)`` says which),
                              so per-replicate gradients are taken with respect to the gathered rows and scattered
                              back; "functional": torch.func vmap of grad through ``logits`` itself (networks)
    init_params(scale, generator, dtype) -> theta
    logits(theta, prompts, tokens) -> [..., T, V]
                              next-token logits under teacher forcing: position t sees the prompt and tokens < t
    noise_table(generator) -> z;  noise_logits(z, prompts, tokens) -> [..., T, V]
                              a fixed N(0, 1) logit perturbation per state (prompt, prefix)

Networks also play an inference engine and a trainer that disagree (the mismatch contract, ``Sampler`` below):

    generate(theta, prompts, generator, dtype, kv_cache, temperature) -> tokens [N, T], log-probs [N, T], routes
                              one response per prompt as an inference engine samples it: weights in ``dtype``,
                              optionally with a KV cache; routes are the MoE routing taken (None when dense)
    score(theta, prompts, tokens, dtype, routes) -> [N, T]
                              the trainer's log-probs on the full sequence, replaying ``routes`` when given
    logits(theta, prompts, tokens, routes=None)
                              teacher-forced logits that replay the sampler's routes (differentiable)

The training simulator samples through ``generate`` and scores through ``score`` whenever the policy has them; a
tabular policy lacks them and the simulator samples its tables directly (with simulated mismatch).

A behaviour policy is a (policy, theta) pair like any other. The staleness knobs that do not move parameters act on
the LOGITS through two wrappers, so a temperature or a KL target means the same thing for every policy kind:
``Tempered(policy, t)`` (logits / t) and ``Perturbed(policy, z, s)`` (logits + s z(state)).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


class Policy(Protocol):
    vocab_size: int
    length: int
    gradient_backend: str

    @property
    def shape(self) -> tuple[int, ...]: ...

    def init_params(self, scale: float, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor: ...

    def logits(self, theta: torch.Tensor, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor: ...

    def noise_table(self, generator: torch.Generator) -> torch.Tensor: ...

    def noise_logits(self, noise: torch.Tensor, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor: ...


@runtime_checkable
class Sampler(Protocol):
    """The mismatch contract of a network policy (see the module doc); ``is_sampler(policy)`` tests for it."""

    def generate(self, theta: torch.Tensor, prompts: torch.Tensor, generator: torch.Generator,
                 dtype=torch.float32, kv_cache: bool = True, temperature: float = 1.0): ...

    def score(self, theta: torch.Tensor, prompts: torch.Tensor, tokens: torch.Tensor, dtype=torch.float32,
              routes=None) -> torch.Tensor: ...

    @property
    def moe(self) -> bool: ...  # whether tokens are routed to experts (routes recorded and replayable)


def is_sampler(policy) -> bool:
    """Whether ``policy`` samples and scores like an inference engine and a trainer (``Sampler``)."""
    return isinstance(policy, Sampler)


@dataclass(frozen=True, eq=False)
class _Wrapper:
    base: Policy

    gradient_backend = "sampler"  # a sampler setting: scored and sampled from, never differentiated

    @property
    def vocab_size(self) -> int:
        return self.base.vocab_size

    @property
    def length(self) -> int:
        return self.base.length

    @property
    def shape(self) -> tuple[int, ...]:
        return self.base.shape

    def init_params(self, scale, generator, dtype=torch.float64):
        return self.base.init_params(scale, generator, dtype)

    def noise_table(self, generator):
        return self.base.noise_table(generator)

    def noise_logits(self, noise, prompts, tokens):
        return self.base.noise_logits(noise, prompts, tokens)


@dataclass(frozen=True, eq=False)
class Tempered(_Wrapper):
    """The sampler at temperature t: logits / t."""

    temperature: float = 1.0

    def logits(self, theta, prompts, tokens):
        return self.base.logits(theta, prompts, tokens) / self.temperature


@dataclass(frozen=True, eq=False)
class Perturbed(_Wrapper):
    """Logits moved along a fixed per-state noise: logits + scale * z(state), z ~ N(0, 1) per (state, token)."""

    noise: torch.Tensor = None
    scale: float = 0.0

    def logits(self, theta, prompts, tokens):
        out = self.base.logits(theta, prompts, tokens)
        return out + self.scale * self.base.noise_logits(self.noise, prompts, tokens).to(out.device)
