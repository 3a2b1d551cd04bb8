#!/usr/bin/env python
"""Benchmark: `lab diagnose` as a whole process against the floor, a bare read of the same input, in the same run.

    .venv/bin/python benchmarks/bench_diagnose.py                    # 10M and 20M tokens, JSONL and pickle dumps
    .venv/bin/python benchmarks/bench_diagnose.py --tokens 2e6       # smaller (logs of 2M and 4M tokens)
    .venv/bin/python benchmarks/bench_diagnose.py --quick            # smoke test: 300k tokens, one repeat
    .venv/bin/python benchmarks/bench_diagnose.py --keep /tmp/bench  # write the logs once, reuse them next time
    .venv/bin/python benchmarks/bench_diagnose.py --lengths 4 12     # short responses: memory per sequence
    .venv/bin/python benchmarks/bench_diagnose.py --pandas           # also the pandas read-then-compute (agreement)
    .venv/bin/python benchmarks/bench_diagnose.py --json out.json    # also save every number
    .venv/bin/python benchmarks/bench_diagnose.py --baseline ../old  # also another checkout's lab diagnose, interleaved

Neutral logs (``lab.diagnose.synthetic.random_log``: sampler, old and current log-probs, versions, advantages,
entropy; responses of 64 to 1024 tokens (``--lengths``), batches of 512) of N = ``--tokens`` tokens in 1M-row
groups, of 2N tokens in 1M-row groups, and of 2N tokens in a single row group. For each, whole processes,
interleaved and repeated ``--repeats`` times (medians reported):

- ``python -m lab.diagnose LOG`` (start-up and imports included);
- the floor: a process that only reads the token columns the diagnostics need with pyarrow, batch by batch at
  pyarrow's defaults (``FLOOR``), once on one thread and once with pyarrow's threads; the ratio is taken against
  the faster.

Framework dumps (``--dumps`` tokens, the same random responses): a prime-rl token export and a NeMo-RL
training-data log (JSONL), and a slime ``--dump-details`` folder (``torch.save`` pickles): ``python -m
lab.diagnose --from FORMAT DUMP`` (conversion and diagnostics) against a process that only parses the same files
(orjson.loads of every line, the fastest parser at hand; json.loads for reference; torch.load with
weights_only=True of every file).

``--baseline DIR`` adds ``lab diagnose`` run from another checkout of the project (DIR, e.g. a git worktree of an
earlier commit) to every comparison, interleaved with the others in each repeat: before and after under the same
load.

Memory: each process's peak resident set size (VmHWM, read as it exits), and for ``lab diagnose`` the same less
the peak of a process that only imports what it imports (the state the pass itself holds). Read ratios, not
seconds: the header prints the machine's load average before and after; on a shared machine interleaving and
medians keep the ratios comparable.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

TOKEN_COLUMNS = ["run", "step", "sample_id", "position", "loss_mask", "advantage", "version", "sampler_logp",
                 "old_logp", "current_logp"]
FLOOR = r"""
import sys, pyarrow.parquet as pq
cols = %r
pf = pq.ParquetFile(sys.argv[1] + "/tokens.parquet")
for b in pf.iter_batches(columns=cols, use_threads=sys.argv[2] == "threads"):
    [c.to_numpy(zero_copy_only=False) for c in b.columns[1:]]
""" % TOKEN_COLUMNS
PARSE = {
    "orjson": "import orjson, pathlib, sys\nfor f in sorted(pathlib.Path(sys.argv[1]).rglob('*.jsonl')):\n"
              "    for line in open(f, 'rb'):\n        orjson.loads(line)\n",
    "json": "import json, pathlib, sys\nfor f in sorted(pathlib.Path(sys.argv[1]).rglob('*.jsonl')):\n"
            "    for line in open(f, 'rb'):\n        json.loads(line)\n",
    "torch.load": "import pathlib, sys, torch\nfor f in sorted(pathlib.Path(sys.argv[1]).rglob('*.pt')):\n"
                  "    torch.load(f, weights_only=True)\n",
}
# what `lab diagnose` imports on a neutral log (the modules of the pass, its tables and the command; no torch, no
# pandas); the framework adapters import more
IMPORTS = ("import lab.diagnose.cli, lab.diagnose.streaming, lab.diagnose.tables, lab.diagnose.adapters, "
           "lab.diagnose.coefficients, lab.estimators, lab.diagnostics, pyarrow.parquet")


PEAK = r"""
import atexit, runpy, sys
out, kind, target = sys.argv[1:4]
del sys.argv[1:4]


def peak():  # VmHWM: the peak resident size of this process's own memory (ru_maxrss counts the forking parent's)
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            open(out, "w").write(line.split()[1])


atexit.register(peak)
if kind == "-m":
    runpy.run_module(target, run_name="__main__", alter_sys=True)
else:
    exec(compile(target, "<benchmark>", "exec"), {"__name__": "__main__"})
"""


BASELINE = "--baseline"  # argv[0] marker: run the rest from the baseline checkout
BASELINE_DIR: Path | None = None


def run(argv: list) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one whole process: ``argv`` is ["-m", module, *args] or ["-c", code,
    *args], run by this Python (from the baseline checkout when argv[0] is BASELINE)."""
    root, env = ROOT, {**os.environ, "LAB_QUIET": "1"}
    if argv[0] == BASELINE:
        root, argv = BASELINE_DIR, argv[1:]
        env["PYTHONPATH"] = str(BASELINE_DIR)
    elif "PYTHONPATH" in env:
        env["PYTHONPATH"] = str(ROOT)
    with tempfile.NamedTemporaryFile(prefix="bench-peak-") as f:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", PEAK, f.name, *map(str, argv)], cwd=root,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(map(str, argv[:4]))} failed:\n{proc.stderr[-2000:]}")
        return wall, int(Path(f.name).read_text()) / 1024


def compare(variants: dict, repeats: int) -> dict:
    """Run every variant ({name: argv}) once per repeat, interleaved; medians of wall time and peak RSS."""
    got = {name: [] for name in variants}
    for _ in range(repeats):
        for name, argv in variants.items():
            got[name].append(run(argv))
    return {name: {"seconds": statistics.median(s for s, _ in v), "peak_mib": statistics.median(m for _, m in v),
                   "all_seconds": [round(s, 3) for s, _ in v]} for name, v in got.items()}


def _baseline(argv: list) -> dict:
    return {"diagnose_baseline": [BASELINE, *argv]} if BASELINE_DIR is not None else {}


def log_ratios(path: Path, repeats: int, import_mib: float) -> dict:
    res = compare({"diagnose": ["-m", "lab.diagnose", path], **_baseline(["-m", "lab.diagnose", path]),
                   "floor_1thread": ["-c", FLOOR, path, "one"], "floor_threads": ["-c", FLOOR, path, "threads"]},
                  repeats)
    floor = min(res["floor_1thread"]["seconds"], res["floor_threads"]["seconds"])
    res["ratio"] = res["diagnose"]["seconds"] / floor
    if BASELINE_DIR is not None:
        res["ratio_baseline"] = res["diagnose_baseline"]["seconds"] / floor
    res["ratio_1thread"] = res["diagnose"]["seconds"] / res["floor_1thread"]["seconds"]
    res["state_mib"] = res["diagnose"]["peak_mib"] - import_mib
    return res


def write_logs(folder: Path, n: int, lengths: tuple[int, int]) -> dict:
    """{name: (path, tokens, row groups)}, written unless already there."""
    from lab.diagnose.synthetic import random_log

    import pyarrow.parquet as pq

    spec = {f"{n / 1e6:g}M, 1M-row groups": (n, 1 << 20), f"{2 * n / 1e6:g}M, 1M-row groups": (2 * n, 1 << 20),
            f"{2 * n / 1e6:g}M, one row group": (2 * n, 4 * n)}
    out = {}
    for name, (tokens, rg) in spec.items():
        path = folder / f"log_{tokens}_{rg}_{lengths[0]}_{lengths[1]}"
        if not (path / "meta.json").exists():
            t0 = time.perf_counter()
            random_log(path, tokens, lengths=lengths, batch=512, seed=0, row_group_rows=rg)
            print(f"wrote {name} in {time.perf_counter() - t0:.0f} s")
        meta = pq.ParquetFile(path / "tokens.parquet").metadata
        out[name] = (path, meta.num_rows, meta.num_row_groups)
    return out


def write_dumps(folder: Path, n_tokens: int, seed: int = 0) -> dict:
    """The same random responses as a prime-rl token export (JSONL), a NeMo-RL training-data log (JSONL) and a
    slime --dump-details folder (pickles), 64 responses of 64 to 1024 tokens per step."""
    import numpy as np
    import torch

    rng = np.random.default_rng(seed)
    out = {"prime-rl": folder / "prime", "nemo-rl": folder / "nemo", "slime": folder / "slime"}
    done = folder / f"done_v2_{n_tokens}"  # v2: NeMo-RL rows as one-element lists
    if done.exists():
        return out
    shutil.rmtree(folder, ignore_errors=True)
    (out["slime"] / "train_data").mkdir(parents=True)
    out["nemo-rl"].mkdir(parents=True)
    written, step = 0, 0
    while written < n_tokens:
        step += 1
        lens = rng.integers(64, 1025, 64)
        d = out["prime-rl"] / "token_exports" / f"step_{step}"
        d.mkdir(parents=True)
        samples = []
        with open(d / "rank_0.jsonl", "w") as prime, open(out["nemo-rl"] / f"train_data_step{step}.jsonl", "w") as nemo:
            for i, n in enumerate(lens):
                s = (-rng.exponential(1.0, n)).astype(np.float32)
                o = np.minimum(s + rng.normal(0, 0.05, n), 0).astype(np.float32)
                toks = rng.integers(0, 150_000, n)
                prime.write(json.dumps({"schema_version": 1, "step": step, "rank": 0, "token_ids": toks.tolist(),
                                        "loss_mask": [True] * int(n), "advantages": [0.5] * int(n),
                                        "inference_logprobs": s.astype(float).tolist(),
                                        "trainer_logprobs": o.astype(float).tolist()}, separators=(",", ":")) + "\n")
                # NeMo-RL's logger writes each field sliced to the sample's row: a one-element list
                nemo.write(json.dumps({"content": [f"sample {i}"], "rewards": [1.0], "input_lengths": [int(n)],
                                       "token_ids": [toks.tolist()], "token_loss_mask": [[1] * int(n)],
                                       "sample_loss_mask": [1], "advantages": [[0.5] * int(n)],
                                       "generation_logprobs": [s.astype(float).tolist()],
                                       "prev_logprobs": [o.astype(float).tolist()], "idx": i}) + "\n")
                samples.append({"tokens": torch.tensor(toks), "response_lengths": int(n), "total_lengths": int(n),
                                 "loss_masks": torch.ones(n, dtype=torch.int), "rollout_log_probs": torch.tensor(s),
                                 "log_probs": torch.tensor(o), "rollout_position": i})
        torch.save({"format_version": 2, "rollout_id": step, "rank": 0, "samples": samples},
                   out["slime"] / "train_data" / f"{step}.pt")
        written += int(lens.sum())
    done.touch()
    return out


def dump_ratios(folder: Path, n_tokens: int, repeats: int) -> dict:
    res = {}
    for fmt, path in write_dumps(folder, n_tokens).items():
        floors = ("orjson", "json") if fmt != "slime" else ("torch.load",)
        r = compare({"diagnose": ["-m", "lab.diagnose", "--from", fmt, path],
                     **_baseline(["-m", "lab.diagnose", "--from", fmt, path]),
                     **{f"parse_{f}": ["-c", PARSE[f], path] for f in floors}}, repeats)
        r["ratio"] = r["diagnose"]["seconds"] / r[f"parse_{floors[0]}"]["seconds"]
        if BASELINE_DIR is not None:
            r["ratio_baseline"] = r["diagnose_baseline"]["seconds"] / r[f"parse_{floors[0]}"]["seconds"]
        if fmt != "slime":
            r["ratio_json"] = r["diagnose"]["seconds"] / r["parse_json"]["seconds"]
        r["mib_on_disk"] = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20
        res[fmt] = r
    return res


def pandas_comparison(path: Path) -> dict:
    """The streaming pass against lab.diagnose.reference (pandas read-then-compute) in two fresh processes: seconds
    and agreement of per-step ESS, k-hat, mean |delta| and the corrections' shares."""
    child = r"""
import json, sys, time
from lab.diagnose import diagnose
from lab.diagnose.reference import reference
t0 = time.perf_counter()
if sys.argv[1] == "streaming":
    d = diagnose(sys.argv[2], progress=False)
    ps, corr = d.tables["per_step"], d.tables["corrections"]
else:
    r = reference(sys.argv[2])
    ps, corr = r["per_step"], r["corrections"]
print(json.dumps({"seconds": time.perf_counter() - t0,
                  "per_step": ps[["run", "step", "pair", "ess_frac", "khat", "mean_abs"]].to_dict("list"),
                  "corrections": corr[["name", "tokens_changed", "removed"]].to_dict("list")}))
"""
    import numpy as np
    import pandas as pd

    out = {}
    for which in ("streaming", "pandas"):
        proc = subprocess.run([sys.executable, "-c", child, which, str(path)], capture_output=True, text=True,
                              cwd=ROOT, env={**os.environ, "LAB_QUIET": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"{which} failed:\n{proc.stderr[-2000:]}")
        out[which] = json.loads(proc.stdout.strip().splitlines()[-1])
    a, b = out["streaming"], out["pandas"]
    ps = pd.DataFrame(a["per_step"]).merge(pd.DataFrame(b["per_step"]), on=["run", "step", "pair"], suffixes=("", "_b"))
    c = pd.DataFrame(a["corrections"]).merge(pd.DataFrame(b["corrections"]), on="name", suffixes=("", "_b"))
    errs = {}
    for frame, cols in ((ps, ("ess_frac", "khat", "mean_abs")), (c, ("tokens_changed", "removed"))):
        for col in cols:
            x, y = frame[col].to_numpy(float), frame[f"{col}_b"].to_numpy(float)
            ok = np.isfinite(x) & np.isfinite(y)
            errs[col] = float(np.max(np.abs(x[ok] - y[ok]) / np.maximum(np.abs(y[ok]), 1e-12))) if ok.any() else 0.0
    return {"streaming_s": a["seconds"], "pandas_s": b["seconds"], "max_rel_diff": errs,
            "ok": all(v <= 1e-9 for v in errs.values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=float, default=1e7, help="tokens of the first log (the others have twice as many)")
    ap.add_argument("--lengths", type=int, nargs=2, default=(64, 1024), metavar=("LO", "HI"),
                    help="response lengths of the neutral logs, uniform (default 64 1024; short ones: more sequences)")
    ap.add_argument("--dumps", type=float, default=3e6, help="tokens of each framework dump (0: none)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="300k-token logs, 200k-token dumps, one repeat")
    ap.add_argument("--keep", type=Path, default=None, help="write (or reuse) the logs and dumps in this folder")
    ap.add_argument("--pandas", action="store_true", help="also the pandas read-then-compute on the first log")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--baseline", type=Path, default=None, metavar="DIR",
                    help="also run lab diagnose from this other checkout, interleaved (before/after)")
    args = ap.parse_args()
    global BASELINE_DIR
    if args.baseline is not None:
        if not (args.baseline / "lab" / "diagnose").is_dir():
            raise SystemExit(f"--baseline {args.baseline}: not a checkout of this project (no lab/diagnose)")
        BASELINE_DIR = args.baseline.resolve()
    n = int(3e5 if args.quick else args.tokens)
    n_dumps = int(2e5 if args.quick and args.dumps else args.dumps)
    repeats = 1 if args.quick else args.repeats
    tmp = None
    if args.keep is None:
        tmp = tempfile.mkdtemp(prefix="bench-diagnose-")
    folder = args.keep or Path(tmp)
    folder.mkdir(parents=True, exist_ok=True)
    try:
        logs = write_logs(folder, n, tuple(args.lengths))
        load0 = os.getloadavg()
        print(f"python {platform.python_version()}, {os.cpu_count()} cores, load average {load0[0]:.2f} "
              f"(1 min) {load0[1]:.2f} (5 min); {repeats} interleaved repeats, medians")
        imports = compare({"imports": ["-c", IMPORTS]}, repeats)["imports"]
        import_mib = imports["peak_mib"]
        res = {"imports_peak_mib": import_mib, "imports_seconds": imports["seconds"], "logs": {}}
        print(f"\n{'neutral log':<24}{'rows':>12}{'groups':>7}{'floor s':>9}{'(1 thr)':>9}{'diagnose s':>11}"
              f"{'ratio':>7}{'(1 thr)':>8}{'peak MiB':>9}{'state':>7}{'floor MiB':>10}")
        for name, (path, rows, groups) in logs.items():
            r = log_ratios(path, repeats, import_mib)
            res["logs"][name] = {"rows": rows, "row_groups": groups, **r}
            print(f"{name:<24}{rows:>12,}{groups:>7}{r['floor_threads']['seconds']:>9.2f}"
                  f"{r['floor_1thread']['seconds']:>9.2f}{r['diagnose']['seconds']:>11.2f}{r['ratio']:>6.2f}x"
                  f"{r['ratio_1thread']:>7.2f}x{r['diagnose']['peak_mib']:>9.0f}{r['state_mib']:>7.0f}"
                  f"{r['floor_threads']['peak_mib']:>10.0f}")
            if BASELINE_DIR is not None:
                b = r["diagnose_baseline"]
                print(f"{'  baseline':<24}{'':>12}{'':>7}{'':>9}{'':>9}{b['seconds']:>11.2f}"
                      f"{r['ratio_baseline']:>6.2f}x{'':>8}{b['peak_mib']:>9.0f}")
        print(f"(peak MiB: the whole process; state: less the {import_mib:.0f} MiB of a process that only imports "
              f"the same modules, which takes {imports['seconds']:.2f} s)")
        if n_dumps:
            res["dumps"] = dump_ratios(folder / "dumps", n_dumps, repeats)
            print(f"\n{'framework dump':<24}{'MiB':>7}{'parse s':>9}{'diagnose s':>11}{'ratio':>7}  floor")
            for fmt, r in res["dumps"].items():
                floor = "parse_orjson" if fmt != "slime" else "parse_torch.load"
                extra = (f" (json.loads {r['parse_json']['seconds']:.2f} s: {r['ratio_json']:.2f}x)"
                         if fmt != "slime" else "")
                print(f"{fmt:<24}{r['mib_on_disk']:>7.0f}{r[floor]['seconds']:>9.2f}{r['diagnose']['seconds']:>11.2f}"
                      f"{r['ratio']:>6.2f}x  {floor[6:]}{extra}")
                if BASELINE_DIR is not None:
                    b = r["diagnose_baseline"]
                    print(f"{'  baseline':<24}{'':>7}{'':>9}{b['seconds']:>11.2f}{r['ratio_baseline']:>6.2f}x")
        if args.pandas:
            first = next(iter(logs.values()))[0]
            res["pandas"] = pandas_comparison(first)
            p = res["pandas"]
            print(f"\nin-process, first log: streaming {p['streaming_s']:.2f} s, pandas read-then-compute "
                  f"{p['pandas_s']:.2f} s; max relative difference "
                  + ", ".join(f"{k} {v:.2g}" for k, v in p["max_rel_diff"].items()))
        load1 = os.getloadavg()
        res["load"] = {"before": load0, "after": load1}
        print(f"\nload average after: {load1[0]:.2f} (1 min) {load1[1]:.2f} (5 min)")
        if args.json:
            args.json.write_text(json.dumps(res, indent=2))
        return 0 if res.get("pandas", {}).get("ok", True) else 1
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
