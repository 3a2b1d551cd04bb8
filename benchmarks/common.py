"""What the benchmarks share: the machine's load, a device barrier, the float32 matmul rate they compare against,
and the common ending (numbers to JSON, the checks' verdict as the exit status)."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch


def load() -> str:
    """The 1/5/15-minute load averages ("n/a" where the platform has none)."""
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def matmul_rate(device: str, n: int = 1024, repeats: int = 5) -> float:
    """float32 FLOP/s of an n x n matmul, 2 n^3 over the best of ``repeats`` timings after a warm-up."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def finish_checks(meta: dict, t_start: float, checks: list[tuple[str, bool]], rows: list, json_path: str | None) -> int:
    """Print each (name, ok) check with ok / FAIL, then ``finish``."""
    print()
    for name, ok in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {name}")
    return finish(meta, t_start, [{"check": n, "ok": bool(ok)} for n, ok in checks], rows, json_path,
                  all(ok for _, ok in checks))


def finish(meta: dict, t_start: float, checks: list, rows: list, json_path: str | None, all_ok: bool) -> int:
    """Print the load and wall time, write every number to ``json_path`` if given, and return the exit status: 1 if
    a check failed."""
    meta["load_end"], meta["wall_s"], meta["all_ok"] = load(), time.perf_counter() - t_start, all_ok
    print(f"\nload average at end: {meta['load_end']}; wall time {meta['wall_s']:.0f} s")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps({"meta": meta, "checks": checks, "rows": rows}, indent=1))
        print(f"numbers written to {json_path}")
    if not all_ok:
        print("FAIL: a check failed (rows marked FAIL)")
        return 1
    print("all checks passed")
    return 0
