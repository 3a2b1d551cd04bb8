"""How fast the listing commands answer: `lab --help`, `lab envs` and `lab estimators` as whole processes, against
the floor of starting Python itself (`python -c pass`) and, for scale, a process that only imports torch, all
interleaved in one run (median of --repeats). Target: each under 0.5 s, which needs them to load neither torch
nor scipy (tests/test_light_core.py checks that they do not).

    python benchmarks/bench_cli.py [--repeats 7] [--json out.json]
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from common import finish, load

TARGET_S = 0.5
COMMANDS = {
    "python -c pass (floor)": [sys.executable, "-c", "pass"],
    "python -c 'import torch'": [sys.executable, "-c", "import torch"],
    "lab --help": [sys.executable, "-m", "lab.cli", "--help"],
    "lab envs": [sys.executable, "-m", "lab.cli", "envs"],
    "lab estimators": [sys.executable, "-m", "lab.cli", "estimators"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    t0 = time.perf_counter()
    meta = {"load_start": load(), "repeats": args.repeats}
    print(f"load average at start: {meta['load_start']}")
    times = {k: [] for k in COMMANDS}
    for _ in range(args.repeats):
        for name, argv in COMMANDS.items():
            t = time.perf_counter()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
            times[name].append(time.perf_counter() - t)
    floor = statistics.median(times["python -c pass (floor)"])
    rows, checks, ok = [], [], True
    for name, ts in times.items():
        med = statistics.median(ts)
        rows.append({"command": name, "median_s": med, "over_floor": med / floor})
        line = f"{name:<28} {med:6.3f} s  {med / floor:5.1f}x the floor"
        if name.startswith("lab "):
            passed = med < TARGET_S
            ok &= passed
            checks.append({"check": f"{name} under {TARGET_S} s", "ok": passed, "value": med})
            line += "" if passed else "  FAIL"
        print(line)
    return finish(meta, t0, checks, rows, args.json, ok)


if __name__ == "__main__":
    sys.exit(main())
