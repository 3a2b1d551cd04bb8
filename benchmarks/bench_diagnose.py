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
                                         "results": results, "agreement": errs, "ok": ok}, indent=2))
    tmp.cleanup()
    if not ok:
        print("FAIL: the two implementations disagree")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
