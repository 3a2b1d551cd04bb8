"""Supervised warm start of the transformer policy on a task, to a stated partial accuracy, cached per user.

Training: teacher-forced cross-entropy on the correct answers, -(1/T) sum_t log pi(a_t | x, a_<t), on batches of
problems drawn uniformly from the task's space without its held-out prompts (so the model learns the task, not
only the env's prompts), AdamW (lr 3e-3, betas 0.9/0.99, no weight decay, 50 warm-up steps, gradient norm
clipped to 1), float32, from the policy's random init (scale 1), on one CPU thread (floating-point sums depend on
the thread count, and a warm start's fate can too: the same run must give the same checkpoint on every machine).
Training stops at the first step where the ACCURACY on the env's training prompts reaches the target:

    accuracy = mean_x pi(a*(x) | x),

the exact probability that a response SAMPLED at temperature 1 is right (the expected exact-match reward J that
RL starts from), computed from one teacher-forced pass, without sampling noise. The greedy (argmax) accuracy on
the training and the held-out prompts is recorded beside it. A run can stall on a plateau (chain6's "small" model
from seed 0 sits at 0.7 nats per token for thousands of steps); one that has not reached the target in ``max_steps``
restarts from fresh draws (init and batches from the seed's next streams), up to ``TRIES`` tries in all, and the
checkpoint records which try reached it. A run that reaches its target on its first try is unchanged by this.

Cache: ``$LAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/offpolicy-lab``, else ``~/.cache/offpolicy-lab``, in
``pretrain/TASK-SIZE-KEY.pt``. KEY hashes everything that changes the result: the task (kind, difficulty, prompt
counts, seed), the model config, the target, the seed, the device type, the torch version and the source of the
model, the tasks, the seeding (``lab.seeding``: the init and the batches) and this module (editing any of them
starts a new checkpoint). A checkpoint is written atomically (a temporary file renamed into place) and reused when
present; a file that cannot be read, or that was written for another key, is an error naming it (delete it to
rebuild), never silently replaced.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

import toy_envs
from lab import seeding
from lab.configs import seed_arg
from lab.errors import LabError
from lab.threads import one_thread
from lab.runs import MARKER, cache_dir, check_cache_dir, marker, read_marker, write_atomic
from lab.policies import transformer
from lab.policies.transformer import (SIZES, TransformerConfig, TransformerPolicy, env_config, parameter_count,
                                      size_config)
from lab.progress import bar
from lab.seeding import generator

FORMAT = 1
LR, BETAS, WARMUP, CLIP, BATCH = 3e-3, (0.9, 0.99), 50, 1.0, 128
DEFAULT_SIZE, DEFAULT_TARGET, DEFAULT_MAX_STEPS = "small", 0.5, 5000
TRIES = 3  # a run that stalls restarts from fresh draws, up to this many tries in all
MAX_STEPS_LIMIT = 1_000_000


@dataclass(frozen=True)
class Checkpoint:
    theta: torch.Tensor  # flat float32 parameters, on the CPU
    path: Path
    accuracy: float  # mean_x pi(a*(x) | x) on the training prompts
    greedy_accuracy: float
    heldout_accuracy: float  # mean_x pi(a*(x) | x) on the held-out prompts
    heldout_greedy_accuracy: float
    steps: int
    seconds: float  # training time (of the run that wrote the file)
    trained: bool  # False when read from the cache
    config: dict


def code_version() -> str:
    """sha256 of the source of the model, the tasks, the seeding and this module."""
    h = hashlib.sha256()
    for module in (transformer, toy_envs.tasks, seeding):
        h.update(Path(module.__file__).read_bytes())
    h.update(Path(__file__).read_bytes())
    return h.hexdigest()


def micro_batch(env, cfg: TransformerConfig, batch: int = BATCH, grad: bool = True) -> int:
    """Sequences per pass so that the attention of one pass stays within the rollout memory budget
    (``lab.engine.training.attention_memory``, float32): the whole batch on short tasks, fewer on long answers; a
    batch is then taken in micro-batches (the same mean loss, gradients accumulated). Raises when one sequence alone
    does not fit."""
    from lab.engine.training import ROLLOUT_MEMORY_BUDGET, attention_memory

    L = env.prompt_length + env.length
    one = attention_memory(cfg, L, 1, 0) if grad else attention_memory(cfg, L, 0, 1)
    if one > ROLLOUT_MEMORY_BUDGET:
        raise LabError(f"one sequence of {env.name!r} ({L:,} positions) needs {one / 2**30:.1f} GiB of attention "
                       f"(budget {ROLLOUT_MEMORY_BUDGET / 2**30:.0f} GiB); choose a shorter task or a smaller size")
    return max(1, min(batch, ROLLOUT_MEMORY_BUDGET // one))


def _check(env, size: str, target_accuracy: float, max_steps: int, device: str):
    from lab.policies import check_device

    if not isinstance(env, toy_envs.Task):
        raise LabError(f"env {getattr(env, 'name', env)!r} is not a task with answers; warm starts need a task env "
                       f"({', '.join(toy_envs.tasks.names())})")
    cfg = size_config(size)
    micro_batch(env, env_config(env, cfg))  # a task too long for the memory budget: one line, before training
    if not (isinstance(target_accuracy, (int, float)) and 0 < target_accuracy < 1):
        raise LabError(f"target accuracy must lie strictly between 0 and 1, got {target_accuracy}")
    if not isinstance(max_steps, int) or isinstance(max_steps, bool) or not 1 <= max_steps <= MAX_STEPS_LIMIT:
        raise LabError(f"max steps must be a whole number from 1 to {MAX_STEPS_LIMIT:,}, got {max_steps}")
    check_device(device)
    check_cache_dir()  # before training a checkpoint it could not keep
    return cfg


def run_config(env, size: str, target_accuracy: float, seed: int, device: str) -> dict:
    """Everything the warm start's result depends on (hashed into the cache key)."""
    task = {k: v for k, v in dataclasses.asdict(env).items() if k not in ("name", "description", "reward")}
    return {"format": FORMAT, "task": task, "size": size, "model": dataclasses.asdict(env_config(env, size)),
            "target_accuracy": float(target_accuracy), "seed": int(seed), "device": torch.device(device).type,
            "torch": str(torch.__version__), "code": code_version()}


def checkpoint_path(config: dict) -> Path:
    key = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:20]
    t = config["task"]
    return cache_dir() / "pretrain" / f"{t['task']}{t['difficulty']}-{config['size']}-{key}.pt"


@torch.no_grad()
def accuracies(policy: TransformerPolicy, theta, prompt_tokens, answers, chunk: int | None = None):
    """(mean_x pi(a*(x) | x), greedy exact-match rate) on prompts [N, P] with answers [N, T], in passes of ``chunk``
    prompts (None: one pass)."""
    probs, greedy, n = [], [], chunk or max(len(prompt_tokens), 1)
    for x, a in zip(prompt_tokens.split(n), answers.split(n)):
        logits = policy.logits_for(theta, x, a).float()
        a = a.to(logits.device)
        logp = torch.log_softmax(logits, -1).gather(-1, a[..., None]).squeeze(-1).sum(-1)
        probs.append(logp.exp())
        greedy.append((logits.argmax(-1) == a).all(-1))  # teacher-forced argmax = greedy decoding when all are right
    return float(torch.cat(probs).mean()), float(torch.cat(greedy).float().mean())


def pretrain(env, size: str = DEFAULT_SIZE, target_accuracy: float = DEFAULT_TARGET, max_steps: int = DEFAULT_MAX_STEPS,
             seed: int = 0, device: str = "cpu", progress: bool | None = None) -> Checkpoint:
    """The warm-start checkpoint of ``size`` on task ``env``: read from the cache, or trained and cached."""
    _check(env, size, target_accuracy, max_steps, device)
    config = run_config(env, size, target_accuracy, seed, device)
    path = checkpoint_path(config)
    if path.exists():
        return load(path, config)
    policy = TransformerPolicy.for_env(env, size)
    start = time.perf_counter()
    with one_thread() if torch.device(device).type == "cpu" else contextlib.nullcontext():
        for attempt in range(TRIES):
            theta, steps, acc = _train(env, policy, target_accuracy, max_steps, seed, attempt, torch.device(device),
                                       progress)
            if acc[0] >= target_accuracy:
                break
        else:
            raise LabError(f"the warm start reached accuracy {acc[0]:.3f}, not {target_accuracy}, in {max_steps} "
                           f"steps, {TRIES} times from fresh draws; raise --max-steps, lower --target-accuracy or "
                           f"choose a larger --size")
    seconds = time.perf_counter() - start
    heldout = accuracies(policy, theta, env.heldout_prompt_tokens, env.heldout_answers,
                         micro_batch(env, policy.config, env.n_heldout, grad=False)) if env.n_heldout else (
        math.nan, math.nan)
    record = {"format": FORMAT, "config": config, "theta": theta.detach().float().cpu().contiguous(),
              "accuracy": acc[0], "greedy_accuracy": acc[1], "heldout_accuracy": heldout[0],
              "heldout_greedy_accuracy": heldout[1], "steps": steps, "seconds": seconds, "try": attempt + 1}
    _write(path, record)
    return _checkpoint(record, path, trained=True)


def warm_start(env, size: str = DEFAULT_SIZE, target_accuracy: float = DEFAULT_TARGET,
               max_steps: int = DEFAULT_MAX_STEPS, seed: int = 0, device: str = "cpu",
               progress: bool | None = None) -> torch.Tensor:
    """The warm-start parameters theta (flat, float32, CPU); see ``pretrain``."""
    return pretrain(env, size, target_accuracy, max_steps, seed, device, progress).theta


def _train(env, policy, target, max_steps, seed, attempt, device, progress):
    """One try: init from stream 2 attempt and batches from stream 2 attempt + 1 of ``seed``; returns (theta, steps,
    (accuracy, greedy accuracy)), the accuracy below ``target`` when ``max_steps`` ran out."""
    theta = policy.init_params(1.0, generator(seed, 2 * attempt), torch.float32).to(device).requires_grad_(True)
    opt = torch.optim.AdamW([theta], lr=LR, betas=BETAS, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    batches = generator(seed, 2 * attempt + 1)
    prompts, answers = env.prompt_tokens, env.answers
    micro, chunk = micro_batch(env, policy.config), micro_batch(env, policy.config, env.n_prompts, grad=False)
    acc = accuracies(policy, theta, prompts, answers, chunk)
    steps = 0
    tried = f", try {attempt + 1} of {TRIES}" if attempt else ""
    with bar(max_steps, f"pretrain {env.name} ({policy.n_params:,} parameters{tried})", progress) as b:
        while acc[0] < target and steps < max_steps:
            x, a = env.sample_problems(BATCH, batches)
            opt.zero_grad(set_to_none=True)
            loss = 0.0
            for xs, as_ in zip(x.split(micro), a.split(micro)):  # one pass on short tasks; the same mean loss
                logits = policy.logits_for(theta, xs, as_)
                part = F.cross_entropy(logits.reshape(-1, policy.vocab_size), as_.to(device).reshape(-1))
                (part * (len(xs) / BATCH) if micro < BATCH else part).backward()
                loss += float(part.detach()) * len(xs) / BATCH
            torch.nn.utils.clip_grad_norm_([theta], CLIP)
            opt.step()
            sched.step()
            steps += 1
            acc = accuracies(policy, theta, prompts, answers, chunk)
            b.update(1)
            b.set_postfix(loss=f"{loss:.3f}", accuracy=f"{acc[0]:.3f}", refresh=False)
    return theta.detach(), steps, acc


def _write(path: Path, record: dict) -> None:
    """The checkpoint, written atomically (``lab.runs.write_atomic``) into the cache's folder, which carries the
    lab's marker: the temporary file of a killed run is removed by the next write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if read_marker(path.parent) is None:
        write_atomic(path.parent / MARKER, json.dumps(marker("cache")) + "\n")
    buffer = io.BytesIO()
    torch.save(record, buffer)
    write_atomic(path, buffer.getvalue())


def load(path: Path, config: dict | None = None) -> Checkpoint:
    """A cached checkpoint; ``config`` given, it must be the one it was written for."""
    path = Path(path)
    bad = f"cached checkpoint {path} is corrupt or was written for another configuration; delete it to rebuild"
    try:
        record = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:
        raise LabError(bad) from None
    if not isinstance(record, dict) or record.get("format") != FORMAT or not isinstance(record.get("theta"),
                                                                                          torch.Tensor):
        raise LabError(bad)
    if config is not None and record.get("config") != config:
        raise LabError(bad)
    stored = record["config"]
    try:
        n = parameter_count(TransformerConfig(**stored["model"]))
    except (LabError, KeyError, TypeError):
        raise LabError(bad) from None
    if record["theta"].shape != (n,) or not torch.isfinite(record["theta"]).all():
        raise LabError(bad)
    return _checkpoint(record, path, trained=False)


def _checkpoint(record: dict, path: Path, trained: bool) -> Checkpoint:
    return Checkpoint(record["theta"], path, record["accuracy"], record["greedy_accuracy"],
                      record["heldout_accuracy"], record["heldout_greedy_accuracy"], record["steps"],
                      record["seconds"], trained, record["config"])


# ---- command line ----------------------------------------------------------------------------------------------------
def add_parser(subparsers) -> None:
    """Register ``lab pretrain``."""
    p = subparsers.add_parser("pretrain", help="supervised warm start of a transformer on a task (cached per user)")
    p.add_argument("--task", required=True, help=f"task env ({', '.join(toy_envs.tasks.names())})")
    p.add_argument("--size", default=DEFAULT_SIZE, help=f"model size ({', '.join(SIZES)}; default {DEFAULT_SIZE})")
    p.add_argument("--target-accuracy", type=float, default=DEFAULT_TARGET,
                   help="stop when mean_x pi(answer | x) on the training prompts reaches this (default 0.5)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the init and the training batches")
    p.add_argument("--device", default="cpu", help="cpu | cuda")
    p.add_argument("--max-steps", type=int, default=DEFAULT_MAX_STEPS, help="give up after this many steps")
    p.set_defaults(func=run)


def run(args) -> int:
    env = toy_envs.make(args.task)
    ck = pretrain(env, args.size, args.target_accuracy, args.max_steps, args.seed, args.device)
    how = f"trained in {ck.steps} steps ({ck.seconds:.1f} s)" if ck.trained else "reused from the cache"
    print(f"{ck.path}: accuracy {ck.accuracy:.3f} (target {args.target_accuracy}) on {env.n_prompts} training "
          f"prompts, greedy {ck.greedy_accuracy:.3f}; held out {ck.heldout_accuracy:.3f}, greedy "
          f"{ck.heldout_greedy_accuracy:.3f}; {how}")
    return 0
