"""Policies (see ``lab.policies.protocol`` for what a policy provides) and the functions every policy shares:
log-probs of given tokens and autoregressive sampling with recorded log-probs.

Kinds: ``prefix`` and ``markov`` (tabular softmax, ``lab.policies.tabular``), ``transformer`` (the lab's own
decoder-only transformer, ``lab.policies.transformer``; sizes from "test" to "1m"), and ``hf``: through
``lab.policies.hf`` any local causal LM (a ``save_pretrained`` folder or a GGUF file).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lab.errors import LabError
from lab.policies.protocol import Perturbed, Policy, Tempered
from lab.policies.tabular import POLICIES, MarkovPolicy, PrefixTreePolicy
from lab.policies.truncation import Truncated

__all__ = ["KINDS", "NETWORKS", "POLICIES", "Kind", "kind", "MarkovPolicy", "Perturbed", "Policy", "PrefixTreePolicy",
           "Tempered", "Truncated", "make_policy", "check_device", "resolve_device", "init_params", "log_probs_of",
           "masked", "token_log_probs", "sequence_log_probs", "sample"]


@dataclass(frozen=True)
class Kind:
    """A kind of policy and what it can do (the engine and the configs ask these, never the kind's name)."""

    name: str
    description: str
    network: bool  # a network with the sampler contract (generate, score, routes): trains on a device, real mismatch
    model: str  # what the ``model`` argument of make_policy names ("" when it takes none)


KINDS = {
    "prefix": Kind("prefix", "tabular softmax over every response prefix (any sequence distribution)", False, ""),
    "markov": Kind("markov", "tabular softmax over (position, previous token)", False, ""),
    "transformer": Kind("transformer", "the lab's decoder-only transformer (lab.policies.transformer)", True,
                        "a size: test, small, medium, moe, 1m"),
    "hf": Kind("hf", "a local causal LM: a save_pretrained folder or a .gguf file (lab.policies.hf)", True,
               "the model's path"),
}
NETWORKS = tuple(k for k, v in KINDS.items() if v.network)


def kind(name: str) -> Kind:
    if name not in KINDS:
        raise LabError(f"unknown policy {name!r}; choose one of {', '.join(KINDS)}")
    return KINDS[name]


def make_policy(kind_name: str, env, model: str = "small", initial=None, trainable: str = "last:1",
                device="cpu") -> Policy:
    """The policy of kind ``kind_name`` sized for ``env``: a transformer of size ``model`` (with ``initial``
    parameters, if given); for ``hf``, the local causal LM at path ``model`` (a save_pretrained folder or a .gguf
    file) over the env's prompts and response vocabulary, theta its ``trainable`` subset, run on ``device``
    (``lab.policies.hf``); a tabular table otherwise."""
    kind(kind_name)
    if kind_name == "transformer":
        from lab.policies.transformer import TransformerPolicy

        return TransformerPolicy.for_env(env, model, initial)
    if kind_name == "hf":
        from lab.policies.hf import HFPolicy

        return HFPolicy.for_env(model, env, trainable, device)
    return POLICIES[kind_name](env.n_prompts, env.vocab_size, env.length)


def resolve_device(device) -> torch.device:
    """A torch device that exists here (cpu, an existing CUDA index, mps where available), or a one-line LabError
    saying what is there."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise LabError(f"unknown device {device!r} ({str(e).splitlines()[0] if str(e) else type(e).__name__}); "
                       f"use cpu or cuda") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise LabError(f"device {device!r} was asked for but no CUDA device is available here; use --device cpu")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise LabError(f"device {device!r} is not available here: {n} CUDA device(s), cuda:0 to cuda:{n - 1}")
    elif dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise LabError(f"device {device!r} is not available here; use --device cpu")
    elif dev.type != "cpu":
        raise LabError(f"device {device!r} is not supported; use cpu or cuda")
    return dev


def check_device(device) -> None:
    """Refuse a device that is not there, with one line saying what is (``resolve_device``)."""
    resolve_device(device)


def init_params(policy: Policy, scale: float, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
    """The policy's initial parameters (tabular: logits ~ N(0, scale^2))."""
    return policy.init_params(scale, generator, dtype)


def log_probs_of(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits) at ``tokens``: [..., T, V], [..., T] -> [..., T] (on the logits' device)."""
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.to(logits.device)[..., None]).squeeze(-1)


def token_log_probs(policy: Policy, theta, prompts, tokens) -> torch.Tensor:
    """log pi(y_t | x, y_<t) for every position: [..., T] (padding positions included; mask them).

    Returned on the tokens' device: theta (and the forward pass) may live on an accelerator, the data on the CPU.
    """
    return log_probs_of(policy.logits(theta, prompts, tokens), tokens).to(tokens.device)


def masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values at real positions, 0 on padding (torch.where: a -inf log-prob of a truncated sampler on padding stays
    out, where -inf * 0 would be NaN)."""
    return torch.where(mask.to(values.device) > 0, values, torch.zeros((), dtype=values.dtype, device=values.device))


def sequence_log_probs(policy: Policy, theta, prompts, tokens, mask) -> torch.Tensor:
    """log pi(y | x) = sum_t m_t log pi(y_t | s_t): [...] (-inf where a real token lies outside a truncated
    sampler's kept set)."""
    return masked(token_log_probs(policy, theta, prompts, tokens), mask).sum(-1)


def markov_logits(policy: Policy, theta) -> torch.Tensor | None:
    """For a policy whose logits at t depend on (prompt, t, previous token) only (``MarkovPolicy``, also tempered or
    perturbed): its logits for every prompt x and previous token a, [P, V, T, V], read with the probe responses
    (a, a, ..., a) (position 0 sees BOS); None for any other policy. Sampling reads one row per position from it,
    O(T), instead of a teacher-forced pass per position, O(T^2)."""
    base = policy
    while isinstance(base, (Perturbed, Tempered)):
        base = base.base
    if not isinstance(base, MarkovPolicy):
        return None
    P, V, T = base.n_prompts, policy.vocab_size, policy.length
    probe = torch.arange(V)[None, :, None].expand(P, V, T)
    return policy.logits(theta, torch.arange(P)[:, None].expand(P, V), probe).cpu()


@torch.no_grad()
def sample(policy: Policy, theta, env, prompts: torch.Tensor, generator: torch.Generator, dtype=None,
           record_kept: bool = False):
    """Draw one response per prompt. Returns tokens [B, T] (long), mask [B, T], token log-probs [B, T] (masked),
    and with ``record_kept`` the sampler's kept set at every position [B, T, V] (bool: the tokens whose logits
    were finite when it drew the token there, as slime records top-p's kept ids; all True without truncation).

    Logits are computed in theta's dtype and rounded to ``dtype`` (default: theta's) before sampling and scoring,
    so a float64 behaviour policy can be sampled exactly as its float32 copy would be.
    """
    dtype = dtype or theta.dtype
    B, T = prompts.shape[0], env.length
    tokens = torch.zeros(B, T, dtype=torch.long)
    kept = torch.ones(B, T, policy.vocab_size, dtype=torch.bool) if record_kept else None
    table = markov_logits(policy, theta)
    if table is not None:  # rows (prompt, previous token) of each position, [T, P V, V]
        V = table.shape[1]
        table = table.permute(2, 0, 1, 3).reshape(T, -1, V).contiguous()
    for t in range(T):  # autoregressive: position t needs the tokens before it
        if table is None:  # the full teacher-forced pass (T is small)
            logits_t = policy.logits(theta, prompts, tokens)[:, t].to(dtype)
        else:  # a Markov policy: the row of (prompt, position, previous token), the same numbers
            logits_t = table[t].index_select(0, prompts * V + (tokens[:, t - 1] if t else 0)).to(dtype)
        tokens[:, t] = torch.multinomial(torch.softmax(logits_t.double().cpu(), -1), 1, generator=generator)[:, 0]
        if record_kept:
            kept[:, t] = torch.isfinite(logits_t).cpu()
    mask = env.mask_of(tokens).to(dtype)
    tokens = tokens * mask.long()  # after the end token: padding 0
    logp = masked(log_probs_of(policy.logits(theta, prompts, tokens).to(dtype), tokens).cpu(), mask)
    return (tokens, mask, logp, kept) if record_kept else (tokens, mask, logp)
