"""Cost of every registered estimator per batch, against plain REINFORCE on the same batch.

Each estimator runs forward and backward (the gradient with respect to the token log-probs, and to the student's
logits where it reads them) on one batch of B responses of T tokens; the time is the median of several calls
after a warm-up, and the ratio divides it by REINFORCE's time measured in the same run on the same tensors.

    .venv/bin/python benchmarks/bench_estimator_cost.py            # B x T = 64 x 256, V = 1024 for distillation
    .venv/bin/python benchmarks/bench_estimator_cost.py --quick    # small sizes, a few seconds
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from lab import estimators


def make_inputs(B: int, T: int, V: int, G: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(V, (B, T), generator=g)
    log_prob = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    noise = lambda: 0.05 * torch.randn(B, T, generator=g)  # noqa: E731
    teacher_logits = logits + torch.randn(B, T, V, generator=g)
    rewards = torch.bernoulli(torch.full((B,), 0.5), generator=g)
    centred = rewards.view(-1, G) - rewards.view(-1, G).mean(-1, keepdim=True)
    return {
        "logits": logits, "log_prob": log_prob * mask, "mask": mask,
        "old_log_prob": (log_prob + noise()).clamp(max=0) * mask,
        "advantages": centred.reshape(B, 1).expand(B, T) * mask,
        "rewards": rewards, "group_size": G,
        "ref_log_prob": (log_prob + noise()).clamp(max=0) * mask,
        "rollout_log_probs": (log_prob + noise()).clamp(max=0) * mask,
        "teacher_logits": teacher_logits,
        "teacher_log_prob": torch.log_softmax(teacher_logits, -1).gather(-1, tokens[..., None]).squeeze(-1) * mask,
    }


def one_call(name: str, x: dict, from_logits: bool = False) -> None:
    """Forward + backward of one estimator; ``from_logits`` makes even REINFORCE start from the logits."""
    info = estimators.info(name)
    logits = x["logits"].detach().requires_grad_("logits" in info.inputs or from_logits)
    log_prob = x["log_prob"].detach().requires_grad_(True)
    if logits.requires_grad:  # the sampled token's log-prob is a function of the logits
        log_prob = torch.log_softmax(logits, -1).gather(-1, x["tokens"][..., None]).squeeze(-1) * x["mask"]
    named = {k: (logits if k == "logits" else x[k]) for k in info.inputs}
    loss, _ = info.fn(log_prob, x["old_log_prob"], x["advantages"], x["mask"], **named)
    loss.backward()


def time_it(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    p.add_argument("--json", help="write the numbers to this file")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared or busy machine a multi-threaded elementwise op waits "
                        "for descheduled workers and its time says more about the load than the estimator)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    B, T, V, G, repeats = (16, 64, 256, 4, 5) if args.quick else (64, 256, 1024, 8, 15)
    x = make_inputs(B, T, V, G)
    g = torch.Generator().manual_seed(1)
    x["tokens"] = torch.randint(V, (B, T), generator=g)
    x["log_prob"] = torch.log_softmax(x["logits"], -1).gather(-1, x["tokens"][..., None]).squeeze(-1) * x["mask"]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; batch B x T = {B} x {T}, "
          f"V = {V} for estimators that read logits; median of {repeats} calls (forward + backward)")
    base = time_it(lambda: one_call("reinforce", x), repeats)
    base_logits = time_it(lambda: one_call("reinforce", x, from_logits=True), repeats)
    print(f"baselines: REINFORCE on token log-probs {1e3 * base:.3f} ms; REINFORCE from [B, T, V] logits "
          f"(log-softmax + gather + backward) {1e3 * base_logits:.3f} ms")
    rows = []
    print(f"{'estimator':<12}{'family':<20}{'reads logits':>13}{'ms/batch':>11}{'x baseline':>12}")
    for name in estimators.names():
        info = estimators.info(name)
        reads = "logits" in info.inputs
        t = base if name == "reinforce" else time_it(lambda: one_call(name, x), repeats)
        ratio = t / (base_logits if reads else base)
        rows.append({"estimator": name, "family": info.family, "ms": 1e3 * t, "ratio": ratio, "reads_logits": reads})
        print(f"{name:<12}{info.family:<20}{str(reads):>13}{1e3 * t:>11.3f}{ratio:>12.2f}")
    print("x baseline: against REINFORCE on the same token log-probs, or, for estimators that read the logits, "
          "against REINFORCE computed from the same logits (both pay the log-softmax over V).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"B": B, "T": T, "V": V, "baseline_ms": 1e3 * base, "baseline_logits_ms": 1e3 * base_logits,
                       "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
