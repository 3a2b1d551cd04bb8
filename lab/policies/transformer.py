"""A small decoder-only transformer as a lab policy, functional in ONE flat parameter vector theta.

The network follows nanoGPT (Karpathy, github.com/karpathy/nanoGPT, ``model.py``): token and position embeddings,
pre-norm blocks x = x + Attn(LN(x)); x = x + MLP(LN(x)) with causal multi-head self-attention
softmax(q k^T / sqrt(d_head) + causal mask) v and a GELU MLP of width 4d, a final LayerNorm and a head tied to the
token embedding. No dropout, so torch.func transforms (vmap of grad over replicates) apply.

Optional mixture-of-experts MLP (``n_experts`` > 0): a linear router r = W_r x scores E expert MLPs, the token goes
to the top-k experts and their outputs are mixed with the softmax of the router scores renormalised over the
chosen k, y = sum_{e in top-k} softmax(r_topk)_e MLP_e(x) (top-k gating of Shazeer et al. 2017 and GShard,
Lepikhin et al. 2020; k = 1 is the Switch Transformer, Fedus et al. 2021). Every forward pass returns the routing
decisions it took, routes [N, n_layer, L, k]; given routes, it REPLAYS them: the chosen experts are the given ones,
the gates still come from this pass's router scores (Rollout Routing Replay, arXiv 2510.11370). Experts are
evaluated densely and masked (E is small here), so shapes never depend on the data.

The policy reads prompt ids into a fixed prompt table [n_prompts, P] of token ids; a response of T tokens is drawn
from the first V token ids (the response vocabulary; the tasks' digits). Under teacher forcing the network sees
prompt + response[:-1] and the logits of response position t are read at sequence position P - 1 + t, so they
depend on the prompt and the response tokens before t only. The tied head scores the V response tokens:
logits = LN_f(h) @ W_te[:V]^T.

Two further entry points model an inference engine against a trainer (the mismatch contract shared with the
Hugging Face adapter): ``generate`` samples with a KV cache (or full recomputation) with the weights cast to a
chosen dtype (e.g. bfloat16) and records the sampler's log-probs and routes; ``score`` recomputes the log-probs of
given tokens on the full sequence, optionally replaying routes. ``logits`` (what the engine differentiates) runs
in theta's dtype, float32 or float64, on theta's device.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.func import functional_call

from lab.errors import LabError
from lab.policies.truncation import kept_set

NOISE_ROWS = 2**16  # rows of the per-state noise table (states share a row only on a hash collision)
_HASH_MOD = 2**31 - 1  # a prime; products of two residues fit in int64
_HASH_MUL = 1_000_003


@dataclass(frozen=True)
class TransformerConfig:
    """Sizes of the network. Parameters: d (n_tokens + block_size + 2) + n_layer (12 d^2 + 13 d) for the dense
    MLP (biases and LayerNorms included); an MoE layer has E times the MLP plus a router of d E."""

    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 16  # d
    n_experts: int = 0  # E; 0: dense MLP
    top_k: int = 2  # experts per token (MoE only)
    n_tokens: int = 16  # embedding rows: every token id a prompt or response may hold (the tasks use 13)
    block_size: int = 32  # longest context, prompt + response

    def __post_init__(self):
        for name in ("n_layer", "n_head", "n_embd", "n_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise LabError(f"transformer config field {name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise LabError(f"n_embd {self.n_embd} must be a multiple of n_head {self.n_head}")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise LabError(f"top_k must lie in 1..n_experts={self.n_experts}, got {self.top_k}")

    @property
    def moe(self) -> bool:
        return self.n_experts > 0


SIZES = {  # name: config  (parameters)
    "test": TransformerConfig(n_layer=2, n_head=2, n_embd=16),  # 7,360
    "test_moe": TransformerConfig(n_layer=2, n_head=2, n_embd=16, n_experts=4, top_k=2),  # 20,256
    "small": TransformerConfig(n_layer=2, n_head=4, n_embd=32),  # 27,008
    "medium": TransformerConfig(n_layer=3, n_head=4, n_embd=64),  # 153,152
    "moe": TransformerConfig(n_layer=2, n_head=4, n_embd=64, n_experts=4, top_k=2),  # 302,208
    "1m": TransformerConfig(n_layer=4, n_head=4, n_embd=144),  # 1,010,016
}


def size_config(size: str) -> TransformerConfig:
    if size not in SIZES:
        raise LabError(f"unknown model size {size!r}; choose one of {', '.join(SIZES)}")
    return SIZES[size]


def env_config(env, size: str | TransformerConfig) -> TransformerConfig:
    """The config of ``size`` for ``env``: its embedding grown to the env's response vocabulary and prompt ids when
    they need more token ids than the size has (a task with distractor tokens, V = 10 + d), and its position table
    grown to P + T - 1 when a task's prompt and answer need a longer context (a long copy task); otherwise
    ``size``'s."""
    cfg = size if isinstance(size, TransformerConfig) else size_config(size)
    table = getattr(env, "prompt_tokens", None)
    if table is None:
        return cfg
    need = max(env.vocab_size, int(table.max()) + 1 if table.numel() else 0)
    if need > cfg.n_tokens:
        cfg = replace(cfg, n_tokens=need)
    context = table.shape[1] + env.length - 1
    return replace(cfg, block_size=context) if context > cfg.block_size else cfg


# ---- the network (nanoGPT's model.py, dropout-free, with an optional MoE MLP) ---------------------------------------
class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x, start: int, cache):
        """x [N, L, d] at positions start..start+L-1; cache (k, v) [N, H, start, d_head] of earlier positions."""
        N, L, d = x.shape
        q, k, v = (z.reshape(N, L, self.n_head, d // self.n_head).transpose(1, 2)
                   for z in self.c_attn(x).split(d, dim=-1))
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.n_head)
        visible = torch.arange(k.shape[2], device=x.device) <= start + torch.arange(L, device=x.device)[:, None]
        att = att.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(N, L, d)
        return self.c_proj(y), (k, v)


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x, routes=None):
        return self.c_proj(F.gelu(self.c_fc(x))), None


class MoE(nn.Module):
    """Top-k routed experts; returns (output, routes [N, L, k]); ``routes`` given: those experts are used."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        E, d = cfg.n_experts, cfg.n_embd
        self.top_k = cfg.top_k
        self.router = nn.Linear(d, E, bias=False)
        self.w_fc = nn.Parameter(torch.empty(E, d, 4 * d))
        self.b_fc = nn.Parameter(torch.empty(E, 4 * d))
        self.w_proj = nn.Parameter(torch.empty(E, 4 * d, d))
        self.b_proj = nn.Parameter(torch.empty(E, d))

    def forward(self, x, routes=None):
        scores = self.router(x)  # [N, L, E]
        if routes is None:
            routes = scores.topk(self.top_k, dim=-1).indices  # ties: the lower expert index
        gates = scores.gather(-1, routes).softmax(dim=-1)  # renormalised over the chosen k
        chosen = routes[..., None] == torch.arange(scores.shape[-1], device=x.device)  # [N, L, k, E]
        weight = (chosen.to(x.dtype) * gates[..., None]).sum(-2)  # [N, L, E], zero off the top-k
        hidden = F.gelu(torch.einsum("nld,edh->nleh", x, self.w_fc) + self.b_fc)
        out = torch.einsum("nleh,ehd->nled", hidden, self.w_proj) + self.b_proj  # every expert, then masked
        return (weight[..., None] * out).sum(-2), routes


class Block(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MoE(cfg) if cfg.moe else MLP(cfg)

    def forward(self, x, start, cache, routes):
        a, cache = self.attn(self.ln_1(x), start, cache)
        x = x + a
        m, routes = self.mlp(self.ln_2(x), routes)
        return x + m, cache, routes


class GPT(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.n_tokens, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)

    def forward(self, idx, start: int = 0, cache=None, routes=None, n_out: int | None = None):
        """Logits over the first ``n_out`` token ids [N, L, n_out] for tokens ``idx`` [N, L] at positions
        start..start+L-1; returns (logits, per-layer KV cache, routes [N, n_layer, L, k] or None)."""
        pos = torch.arange(start, start + idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        caches, taken = [], []
        for i, block in enumerate(self.h):
            x, c, r = block(x, start, None if cache is None else cache[i],
                            None if routes is None else routes[:, i])
            caches.append(c)
            taken.append(r)
        w = self.wte.weight if n_out is None else self.wte.weight[:n_out]
        logits = self.ln_f(x) @ w.T  # tied head
        return logits, caches, (torch.stack(taken, dim=1) if taken[0] is not None else None)


def parameter_count(cfg: TransformerConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters())


# ---- the policy ------------------------------------------------------------------------------------------------------
class TransformerPolicy:
    """A lab policy (``lab.policies.protocol``) over responses of ``length`` tokens from the first ``vocab_size``
    token ids, given prompt ids into ``prompt_tokens`` [n_prompts, P]; theta is one flat vector (D,).

    ``initial`` (a flat vector, e.g. a supervised warm start) is what ``init_params`` returns when given.
    """

    gradient_backend = "functional"

    @property
    def moe(self) -> bool:
        """Whether its blocks route tokens to experts (then ``routes`` records them and ``score`` replays them)."""
        return self.config.moe

    def __init__(self, config: TransformerConfig, prompt_tokens: torch.Tensor, initial: torch.Tensor | None = None,
                 *, length: int, vocab_size: int = 10):
        prompt_tokens = torch.as_tensor(prompt_tokens, dtype=torch.long)
        if prompt_tokens.ndim != 2 or prompt_tokens.shape[0] < 1:
            raise LabError(f"prompt tokens must be a table [n_prompts, P], got shape {tuple(prompt_tokens.shape)}")
        if prompt_tokens.numel() and (prompt_tokens.min() < 0 or prompt_tokens.max() >= config.n_tokens):
            raise LabError(f"prompt tokens must be ids in 0..{config.n_tokens - 1} (the model's n_tokens)")
        if not 1 <= vocab_size <= config.n_tokens:
            raise LabError(f"response vocabulary {vocab_size} must lie in 1..n_tokens={config.n_tokens}")
        if prompt_tokens.shape[1] + length > config.block_size + 1 or prompt_tokens.shape[1] < 1:
            raise LabError(f"a prompt of {prompt_tokens.shape[1]} tokens and a response of {length} do not fit the "
                           f"model's context of {config.block_size} positions (prompts need at least one token)")
        self.config, self.length, self.vocab_size = config, int(length), int(vocab_size)
        self.prompt_tokens = prompt_tokens
        self._tables = {prompt_tokens.device: prompt_tokens}
        with torch.device("meta"):
            self.net = GPT(config)
        self._spec = [(name, tuple(p.shape)) for name, p in self.net.named_parameters()]
        self.n_params = sum(math.prod(s) for _, s in self._spec)
        if initial is not None:
            initial = torch.as_tensor(initial).detach()
            if initial.shape != (self.n_params,):
                raise LabError(f"initial parameters have shape {tuple(initial.shape)}, the model needs "
                               f"({self.n_params},)")
        self.initial = initial

    @classmethod
    def for_env(cls, env, size: str | TransformerConfig = "test", initial=None) -> "TransformerPolicy":
        """The policy for ``env``: its prompt table (task envs' ``prompt_tokens``; for a bandit without one, prompt i
        is the single token V + i), response vocabulary and length; a task's embedding grows to fit its vocabulary
        (``env_config``)."""
        cfg = env_config(env, size)
        if getattr(env, "eos", False):
            raise LabError(f"env {env.name!r} has variable-length responses; the transformer policy needs eos=False")
        table = getattr(env, "prompt_tokens", None)
        if table is None:
            if env.vocab_size + env.n_prompts > cfg.n_tokens:
                raise LabError(f"env {env.name!r} needs {env.vocab_size + env.n_prompts} token ids, the model has "
                               f"{cfg.n_tokens}")
            table = (env.vocab_size + torch.arange(env.n_prompts))[:, None]
        return cls(cfg, table, initial, length=env.length, vocab_size=env.vocab_size)

    def with_prompts(self, prompt_tokens: torch.Tensor) -> "TransformerPolicy":
        """The same model over another prompt table (e.g. a task's held-out prompts)."""
        return TransformerPolicy(self.config, prompt_tokens, self.initial, length=self.length,
                                 vocab_size=self.vocab_size)

    @property
    def shape(self) -> tuple[int]:
        return (self.n_params,)

    @property
    def prompt_length(self) -> int:
        return self.prompt_tokens.shape[1]

    # ---- parameters ----
    def init_params(self, scale: float, generator: torch.Generator, dtype=torch.float64) -> torch.Tensor:
        """``initial`` when given (cast to ``dtype``; ``scale`` and ``generator`` unused), else a random init.

        Random init (nanoGPT's, GPT-2 paper): weights N(0, 0.02^2), residual output projections
        N(0, 0.02^2 / (2 n_layer)), biases 0, LayerNorm gains 1, except the token embedding, drawn
        N(0, scale^2 / d), so that a row of the tied head has norm about ``scale`` and the initial logits
        LN(h) @ W_te^T are proportional to ``scale`` and of its order, like the tabular policies' N(0, scale^2)
        (their spread over the vocabulary measures 1.5 to 2.6 times ``scale`` from the "test" to the "1m" size:
        a position's own input token lines up with its row of the head). scale = 0 is the uniform policy. Drawn
        in float64, then cast to ``dtype``.
        """
        if self.initial is not None:
            return self.initial.to(dtype).clone()
        d, L = self.config.n_embd, self.config.n_layer
        parts = []
        for name, shape in self._spec:
            leaf = name.rsplit(".", 1)[-1]
            if ".ln_" in f".{name}" and leaf == "weight":
                p = torch.ones(shape, dtype=torch.float64)
            elif leaf in ("bias", "b_fc", "b_proj"):
                p = torch.zeros(shape, dtype=torch.float64)
            else:
                std = scale / math.sqrt(d) if name == "wte.weight" else 0.02
                if name.endswith(("c_proj.weight", "w_proj")):
                    std = 0.02 / math.sqrt(2 * L)
                p = std * torch.randn(shape, generator=generator, dtype=torch.float64)
            parts.append(p.reshape(-1))
        return torch.cat(parts).to(dtype)

    def params(self, theta: torch.Tensor) -> dict:
        """Named views into the flat theta (the network's parameters)."""
        if theta.shape != (self.n_params,):
            raise LabError(f"theta has shape {tuple(theta.shape)}, the model needs ({self.n_params},)")
        out, at = {}, 0
        for name, shape in self._spec:
            n = math.prod(shape)
            out[name] = theta[at:at + n].view(shape)
            at += n
        return out

    def _table(self, device) -> torch.Tensor:
        device = torch.device(device)
        if device not in self._tables:
            self._tables[device] = self.prompt_tokens.to(device)
        return self._tables[device]

    def _run(self, params, idx, start=0, cache=None, routes=None):
        return functional_call(self.net, params, (idx,),
                               {"start": start, "cache": cache, "routes": routes, "n_out": self.vocab_size})

    def _inputs(self, theta, prompts, tokens):
        """prompt + response[:-1] token ids [N, P + T - 1] on theta's device."""
        prompt_tokens = self._table(theta.device)[prompts.reshape(-1).to(theta.device)]
        return torch.cat([prompt_tokens, tokens.reshape(-1, self.length).to(theta.device)[:, :-1]], dim=1)

    # ---- the engine's view: teacher-forced logits in theta's dtype ----
    def logits(self, theta: torch.Tensor, prompts: torch.Tensor, tokens: torch.Tensor, routes=None) -> torch.Tensor:
        """Next-token logits [..., T, V] for prompt ids [...] and responses [..., T]: position t sees the prompt and
        tokens < t. Computed in theta's dtype on theta's device; works under torch.func vmap and grad. ``routes``
        [N, n_layer, P + T - 1, k] (an MoE model's, e.g. the sampler's) are replayed: the gradient flows through the
        gates of the given experts."""
        if routes is not None:
            if not self.config.moe:
                raise LabError("routes can only be replayed by a mixture-of-experts model")
            routes = routes.to(theta.device)
        logits, _, _ = self._run(self.params(theta), self._inputs(theta, prompts, tokens), routes=routes)
        return logits[:, self.prompt_length - 1:].reshape(*prompts.shape, self.length, self.vocab_size)

    def logits_for(self, theta: torch.Tensor, prompt_tokens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``logits`` for prompts given as tokens [N, P] (of this policy's prompt length) instead of ids: [N, T, V]."""
        dev = theta.device
        idx = torch.cat([prompt_tokens.to(dev), tokens.to(dev)[:, :-1]], dim=1)
        return self._run(self.params(theta), idx)[0][:, prompt_tokens.shape[1] - 1:]

    # ---- a fixed logit perturbation per state (the KL-target staleness knob) ----
    def noise_table(self, generator: torch.Generator) -> torch.Tensor:
        """z ~ N(0, 1) [NOISE_ROWS, V] in float64; row of state (prompt, prefix) by ``state_rows``."""
        return torch.randn(NOISE_ROWS, self.vocab_size, generator=generator, dtype=torch.float64)

    def state_rows(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Row of the noise table for every position [..., T]: a polynomial rolling hash
        h_0 = prompt + 1, h_{t+1} = (h_t * 1000003 + y_t + 1) mod (2^31 - 1), row = h_t mod NOISE_ROWS."""
        h = torch.zeros(tokens.shape, dtype=torch.long, device=tokens.device)
        cur = prompts.to(tokens.device).long() + 1
        for t in range(self.length):  # T is small
            h[..., t] = cur
            cur = (cur * _HASH_MUL + tokens[..., t] + 1) % _HASH_MOD
        return h % NOISE_ROWS

    def noise_logits(self, noise: torch.Tensor, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The noise rows of every position's state [..., T, V], on the noise table's device and in its dtype."""
        return noise[self.state_rows(prompts, tokens.to(noise.device))]

    # ---- the mismatch contract: an inference engine (sampler) and a trainer (scorer) ----
    @torch.no_grad()
    def generate(self, theta, prompts, generator: torch.Generator, dtype=torch.float32, kv_cache: bool = True,
                 temperature: float = 1.0, truncation: dict | None = None):
        """Sample one response per prompt id [N] as an inference engine would.

        The weights are cast to ``dtype`` and the network runs in it; logits are upcast to float32 for the softmax
        (as inference engines do). With ``kv_cache`` the prompt is encoded once and each new token attends to the
        cached keys and values; without it every step recomputes the whole sequence. Token t is drawn by inverse
        CDF from uniforms of the CPU ``generator`` (identical draws on any device) from softmax(logits /
        temperature). Returns tokens [N, T] (long), the sampler's log-probs of them [N, T] (float32, at that
        temperature) and routes [N, n_layer, P + T - 1, k] (each position's routing when it was first computed;
        None for a dense model), all on theta's device. With ``truncation`` ({top_p, top_k, min_p}) each step samples
        from the kept set of its tempered logits (``lab.policies.truncation.kept_set``, renormalised; the log-probs
        are the truncated ones) and the kept sets [N, T, V] (bool) are returned fourth.
        """
        if temperature <= 0:
            raise LabError(f"temperature must be positive, got {temperature}")
        params = self.params(theta.detach().to(dtype))
        dev, N, P, T = theta.device, prompts.shape[0], self.prompt_length, self.length
        seq = self._table(dev)[prompts.to(dev)]
        tokens = torch.zeros(N, T, dtype=torch.long, device=dev)
        logp = torch.zeros(N, T, dtype=torch.float32, device=dev)
        logits, cache, routes = self._run(params, seq)
        taken = [routes]
        kept = torch.ones(N, T, self.vocab_size, dtype=torch.bool, device=dev) if truncation else None
        for t in range(T):
            z = logits[:, -1].float() / temperature
            if truncation:
                kept[:, t] = kept_set(z, **truncation)
                z = z.masked_fill(~kept[:, t], -math.inf)
            lp = torch.log_softmax(z, dim=-1)
            u = torch.rand(N, generator=generator, dtype=torch.float64).to(dev)
            cdf = torch.cumsum(lp.double().exp(), dim=-1)
            y = (cdf < u[:, None] * cdf[:, -1:]).sum(-1).clamp(max=self.vocab_size - 1)
            tokens[:, t], logp[:, t] = y, lp.gather(-1, y[:, None])[:, 0]
            if t == T - 1:
                break
            if kv_cache:
                logits, cache, routes = self._run(params, y[:, None], start=P + t, cache=cache)
            else:
                logits, _, routes = self._run(params, torch.cat([seq, tokens[:, :t + 1]], dim=1))
                routes = None if routes is None else routes[:, :, -1:]
            taken.append(routes)
        routes = torch.cat(taken, dim=2) if taken[0] is not None else None
        return (tokens, logp, routes, kept) if truncation else (tokens, logp, routes)

    @torch.no_grad()
    def score(self, theta, prompts, tokens, dtype=torch.float32, routes=None):
        """The trainer's log-probs [N, T] (float32) of ``tokens`` [N, T] on the full sequence, the network in
        ``dtype`` (logits upcast to float32 for the softmax); ``routes`` [N, n_layer, P + T - 1, k] are replayed."""
        params = self.params(theta.detach().to(dtype))
        idx = self._inputs(theta, prompts, tokens)
        if routes is not None:
            if not self.config.moe:
                raise LabError("routes can only be replayed by a mixture-of-experts model")
            routes = routes.to(theta.device)
        logits, _, _ = self._run(params, idx, routes=routes)
        lp = torch.log_softmax(logits[:, self.prompt_length - 1:].float(), dim=-1)
        return lp.gather(-1, tokens.to(theta.device)[..., None]).squeeze(-1)

    @torch.no_grad()
    def routes(self, theta, prompts, tokens, dtype=torch.float32):
        """The routing decisions [N, n_layer, P + T - 1, k] of a full-sequence pass in ``dtype`` (None if dense)."""
        idx = self._inputs(theta, prompts, tokens)
        return self._run(self.params(theta.detach().to(dtype)), idx)[2]

    def describe(self) -> dict:
        return {**asdict(self.config), "parameters": self.n_params, "length": self.length,
                "vocab_size": self.vocab_size, "prompt_length": self.prompt_length}


__all__ = ["SIZES", "GPT", "TransformerConfig", "TransformerPolicy", "env_config", "parameter_count", "size_config"]
