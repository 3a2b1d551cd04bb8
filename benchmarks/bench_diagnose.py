#!/usr/bin/env python
"""Benchmark: `lab diagnose` (one streaming pass) against a plain pandas read-then-compute of the same numbers.

    .venv/bin/python benchmarks/bench_diagnose.py                  # a synthetic 10-million-token neutral log
    .venv/bin/python benchmarks/bench_diagnose.py --tokens 2e6     # smaller
    .venv/bin/python benchmarks/bench_diagnose.py --quick          # smoke test, 300k tokens
    .venv/bin/python benchmarks/bench_diagnose.py --mean-len 8     # short responses: many sequences per token
    .venv/bin/python benchmarks/bench_diagnose.py --json out.json  # also save every number

The log is ``lab.diagnose.synthetic.random_log`` (sampler, old and current log-probs, versions, advantages,
entropy; responses of ``--mean-len`` tokens on average, 256 by default; row groups of 1M rows), written once
before timing. The streaming pass keeps about 1 KB per sequence, so with short responses its peak grows with the
number of sequences: ``--mean-len`` measures that. Each implementation then runs in its own fresh process on the
same file, so that its peak memory is its own:

- streaming: ``lab.diagnose.diagnose`` (chunks of ``--chunk-rows`` token rows): every table of the report;
- pandas: ``lab.diagnose.reference.reference``: ``pd.read_parquet`` of both tables, then groupby for per-step
  token statistics, sequence weights (ESS, chi2, k-hat, dominant share), quantiles, probability bins, staleness and
  the correction shares: a subset of what the streaming pass computes.

The floor: the command as a whole process (``python -m lab.diagnose LOG``) against a whole process that only reads
the token columns the diagnostics need with pyarrow (``FLOOR``), in the same run; for framework dumps
(``--dumps``: a prime-rl JSONL export and a slime pickle dump of the same random tokens), ``lab diagnose --from``
against a process that only parses the same files (json.loads of every line; torch.load of every file).

Peak memory is the process's peak resident set size (VmHWM) after imports, reset just before the call (Linux
/proc/self/clear_refs), so imports are excluded; "peak" is that peak minus the resident size before the call.
The two results are compared (per-step ESS, k-hat, mean |delta|, correction shares) and must agree to 1e-9
(quantiles: within one bin of the streaming histogram, 5.9 % or 1e-6 near 0); a disagreement makes the script
exit 1. Read the ratios:
absolute speeds depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

CHILD = r"""
import json, os, sys, time
os.environ["LAB_QUIET"] = "1"
threads = int(sys.argv[3])
if threads:
    import torch
    torch.set_num_threads(threads)
import numpy as np
from lab.diagnose import diagnose
from lab.diagnose.reference import reference

def kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1])

which, path = sys.argv[1], sys.argv[2]
chunk = int(sys.argv[4])
try:
    open("/proc/self/clear_refs", "w").write("5")
except OSError:
    pass
base = kib("VmRSS")
t0 = time.perf_counter()
if which == "streaming":
    d = diagnose(path, chunk_rows=chunk, progress=False)
    ps, corr, ov = d.tables["per_step"], d.tables["corrections"], d.tables["overall"]
else:
    r = reference(path)
    ps, corr, ov = r["per_step"], r["corrections"], r["overall"]
dt = time.perf_counter() - t0
out = {"seconds": dt, "base_mib": base / 1024, "hwm_mib": kib("VmHWM") / 1024,
       "per_step": ps[["run", "step", "pair", "ess_frac", "khat", "mean_abs", "n_tok"]].to_dict("list"),
       "corrections": corr[["name", "tokens_changed", "removed"]].to_dict("list"),
       "quantiles": ov[["pair", "p01", "p50", "p99"]].to_dict("list")}
print(json.dumps(out))
"""


FLOOR = r"""
import sys, pyarrow.parquet as pq
cols = ["run", "step", "sample_id", "position", "loss_mask", "advantage", "version", "sampler_logp", "old_logp",
        "current_logp"]
for g in range(pq.ParquetFile(sys.argv[1] + "/tokens.parquet").metadata.num_row_groups):
    pf = pq.ParquetFile(sys.argv[1] + "/tokens.parquet")
    for b in pf.iter_batches(batch_size=1 << 18, row_groups=[g], columns=cols, use_threads=False):
        [c.to_numpy(zero_copy_only=False) for c in b.columns[1:]]
"""
PARSE = {"prime-rl": r"""
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).rglob("*.jsonl")):
    for line in open(f, "rb"):
        json.loads(line)
""", "slime": r"""
import pathlib, sys, torch
for f in sorted(pathlib.Path(sys.argv[1]).rglob("*.pt")):
    torch.load(f, weights_only=True)
"""}


def wall(argv: list) -> float:
    """Seconds of a whole process (start-up and imports included), the fastest of three runs."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
        if proc.returncode != 0:
            raise SystemExit(f"{argv[:4]} failed:\n{proc.stderr[-2000:]}")
        best = min(best, time.perf_counter() - t0)
    return best


def floor_ratios(path: Path) -> dict:
    cmd = wall([sys.executable, "-m", "lab.diagnose", str(path)])
    floor = wall([sys.executable, "-c", FLOOR, str(path)])
    return {"command_s": cmd, "floor_s": floor, "ratio": cmd / floor}


def write_dumps(folder: Path, n_tokens: int, seed: int = 0) -> dict:
    """The same random responses as a prime-rl token export (JSONL) and a slime --dump-details folder (pickles)."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    out = {"prime-rl": folder / "prime", "slime": folder / "slime"}
    (out["slime"] / "train_data").mkdir(parents=True)
    written, step = 0, 0
    while written < n_tokens:
        step += 1
        lens = rng.integers(64, 1025, 64)
        d = out["prime-rl"] / "token_exports" / f"step_{step}"
        d.mkdir(parents=True)
        samples = []
        with open(d / "rank_0.jsonl", "w") as f:
            for i, n in enumerate(lens):
                s = (-rng.exponential(1.0, n)).astype(np.float32)
                o = np.minimum(s + rng.normal(0, 0.05, n), 0).astype(np.float32)
                toks = rng.integers(0, 150_000, n)
                f.write(json.dumps({"schema_version": 1, "step": step, "rank": 0, "token_ids": toks.tolist(),
                                    "loss_mask": [True] * int(n), "advantages": [0.5] * int(n),
                                    "inference_logprobs": s.astype(float).tolist(),
                                    "trainer_logprobs": o.astype(float).tolist()}, separators=(",", ":")) + "\n")
                samples.append({"tokens": torch.tensor(toks), "response_lengths": int(n), "total_lengths": int(n),
                                "loss_masks": torch.ones(n, dtype=torch.int), "rollout_log_probs": torch.tensor(s),
                                "log_probs": torch.tensor(o), "rollout_position": i})
        torch.save({"format_version": 2, "rollout_id": step, "rank": 0, "samples": samples},
                   out["slime"] / "train_data" / f"{step}.pt")
        written += int(lens.sum())
    return out


def dump_ratios(folder: Path, n_tokens: int) -> dict:
    res = {}
    for fmt, path in write_dumps(folder, n_tokens).items():
        cmd = wall([sys.executable, "-m", "lab.diagnose", "--from", fmt, str(path)])
        floor = wall([sys.executable, "-c", PARSE[fmt], str(path)])
        res[fmt] = {"command_s": cmd, "floor_s": floor, "ratio": cmd / floor}
    return res


def run_child(which: str, path: Path, threads: int, chunk: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", CHILD, which, str(path), str(threads), str(chunk)],
                          capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise SystemExit(f"{which} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def agree(a: dict, b: dict) -> dict:
    import numpy as np
    import pandas as pd

    key = ["run", "step", "pair"]
    ps = pd.DataFrame(a["per_step"]).merge(pd.DataFrame(b["per_step"]), on=key, suffixes=("", "_b"))
    errs = {}
    for col in ("ess_frac", "khat", "mean_abs", "n_tok"):
        x, y = ps[col].to_numpy(float), ps[f"{col}_b"].to_numpy(float)
        ok = np.isfinite(x) & np.isfinite(y)
        errs[col] = float(np.max(np.abs(x[ok] - y[ok]) / np.maximum(np.abs(y[ok]), 1e-12))) if ok.any() else 0.0
    c = pd.DataFrame(a["corrections"]).merge(pd.DataFrame(b["corrections"]), on="name", suffixes=("", "_b"))
    for col in ("tokens_changed", "removed"):
        errs[col] = float(np.max(np.abs(c[col] - c[f"{col}_b"])))
    q = pd.DataFrame(a["quantiles"]).merge(pd.DataFrame(b["quantiles"]), on="pair", suffixes=("", "_b"))
    # within one histogram bin: 5.9 % of |x|, or the central bin's half-width 1e-6 around 0
    errs["quantiles_outside_bin"] = int(sum(int((np.abs(q[k] - q[f"{k}_b"]) > 0.06 * np.abs(q[f"{k}_b"]) + 2e-6).sum())
                                            for k in ("p01", "p50", "p99")))
    errs["rows_compared"] = int(len(ps))
    return errs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=1e7)
    ap.add_argument("--mean-len", type=int, default=256, help="mean response length in tokens (default 256)")
    ap.add_argument("--chunk-rows", type=int, default=1 << 18)
    ap.add_argument("--threads", type=int, default=0, help="torch threads in each process (0: torch's default)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--keep", type=Path, default=None, help="keep (or reuse) the synthetic log at this path")
    ap.add_argument("--streaming-only", action="store_true", help="skip the pandas baseline (logs too large for it)")
    ap.add_argument("--floor", action="store_true", help="also time the whole command against a bare pyarrow read")
    ap.add_argument("--dumps", type=float, default=0, help="also time JSONL and pickle dumps of this many tokens "
                                                            "against a bare parse of the same files")
    args = ap.parse_args()
    n = int(3e5 if args.quick else args.tokens)
    from lab.diagnose.synthetic import random_log

    tmp = tempfile.TemporaryDirectory(prefix="bench-diagnose-")
    path = args.keep or Path(tmp.name) / "log"
    if not (path / "meta.json").exists():
        t0 = time.perf_counter()
        random_log(path, n, mean_len=args.mean_len, batch=512 if args.quick else 2048, seed=0)
        print(f"wrote a {n:,}-token log in {time.perf_counter() - t0:.1f} s: "
              f"{sum(f.stat().st_size for f in path.iterdir()) / 2**20:.0f} MiB on disk")
    import pyarrow.parquet as pq

    rows = pq.ParquetFile(path / "tokens.parquet").metadata.num_rows
    n_seq = pq.ParquetFile(path / "sequences.parquet").metadata.num_rows
    print(f"python {platform.python_version()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, "
          f"threads {args.threads or 'default'}, chunk {args.chunk_rows:,} rows, {rows:,} token rows, "
          f"{n_seq:,} sequences ({rows / max(n_seq, 1):.0f} tokens each)")
    extra = {}
    if args.floor:
        extra["floor"] = floor_ratios(path)
        print(f"whole process: lab diagnose {extra['floor']['command_s']:.2f} s, bare pyarrow read of the token "
              f"columns {extra['floor']['floor_s']:.2f} s: {extra['floor']['ratio']:.2f}x the floor")
    if args.dumps:
        extra["dumps"] = dump_ratios(Path(tmp.name), int(args.dumps))
        for fmt, r in extra["dumps"].items():
            print(f"--from {fmt}: {r['command_s']:.2f} s, bare parse {r['floor_s']:.2f} s: {r['ratio']:.2f}x")
    which = ("streaming",) if args.streaming_only else ("streaming", "pandas")
    res = {w: run_child(w, path, args.threads, args.chunk_rows) for w in which}
    print(f"\n{'':<11}{'seconds':>9}{'tokens/s':>13}{'peak MiB':>10}{'(RSS before)':>14}")
    for w, r in res.items():
        r["tokens_per_s"] = rows / r["seconds"]
        r["peak_mib"] = r["hwm_mib"] - r["base_mib"]
        print(f"{w:<11}{r['seconds']:>9.2f}{r['tokens_per_s']:>13,.0f}{r['peak_mib']:>10.0f}{r['base_mib']:>14.0f}")
    if args.streaming_only:
        tmp.cleanup()
        return 0
    s, p = res["streaming"], res["pandas"]
    print(f"\nstreaming / pandas: {s['tokens_per_s'] / p['tokens_per_s']:.2f}x the throughput, "
          f"{s['peak_mib'] / p['peak_mib']:.3f}x the peak memory ({p['peak_mib'] / max(s['peak_mib'], 1):.1f}x less)")
    errs = agree(s, p)
    print("agreement (max relative difference): " + ", ".join(f"{k} {v:.2g}" for k, v in errs.items()))
    ok = all(errs[k] <= 1e-9 for k in ("ess_frac", "khat", "mean_abs", "n_tok", "tokens_changed", "removed")) \
        and errs["quantiles_outside_bin"] == 0
    if args.json:
        results = {k: {kk: vv for kk, vv in v.items() if kk not in ("per_step", "corrections", "quantiles")}
                   for k, v in res.items()}
        args.json.write_text(json.dumps({"tokens": rows, "sequences": n_seq, "mean_len": args.mean_len,
                                         "results": results, "agreement": errs, "ok": ok, **extra}, indent=2))
    tmp.cleanup()
    if not ok:
        print("FAIL: the two implementations disagree")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
