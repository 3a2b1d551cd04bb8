"""``lab diagnose --from FORMAT PATH``: the rollout diagnostics of a training run's own logs (FORMAT: a name in
lab.diagnose.adapters.ADAPTERS).

Prints the verdict and the headline numbers; ``--out DIR`` also writes a run folder (config.json,
results.parquet, summary.json and one parquet file per table). Framework dumps are converted to the neutral
format first (``--save-log DIR`` keeps the converted log). Bad input raises LabError: the main command prints it
as one line and exits 2. Every option and output path is checked before any work (an output may not be, contain
or lie inside the input, nor overlap the other output); the outputs are built in hidden staging folders and
renamed into place together at the end, so a failure (a full disk included) leaves nothing written, and the
verdict is printed only once everything is.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import sys
from pathlib import Path

from lab.configs import seed_arg
from lab.errors import LabError

TABLES = ("per_step", "overall", "by_probability", "by_length", "growth", "staleness", "corrections", "truncation",
          "histograms", "dashboards")


def _from_help() -> str:
    from lab.diagnose.adapters import ADAPTERS

    return "; ".join(f"{a.name}: {a.reads}" for a in ADAPTERS.values()) + " (default: lab)"


def add_parser(subparsers):
    from lab.diagnose.adapters import FORMATS
    from lab.diagnose.streaming import CHUNK_ROWS

    p = subparsers.add_parser(
        "diagnose", help="importance-weight diagnostics of a training run's rollout logs",
        description="Importance-weight diagnostics of a training run's own rollout logs: sampler/trainer and "
                    "policy-version log-ratios, their dependence on token probability and length, ESS, chi2 and "
                    "PSIS k-hat per step, staleness, and what each correction (TIS, IcePop, PPO clip, GSPO, CISPO, "
                    "SAPO, VESPO) would clip or mask. See docs/rollout-logs.md.")
    p.add_argument("path", type=Path, help="the log: a neutral log folder, or the framework's dump (see --from)")
    p.add_argument("--from", dest="fmt", default="lab", metavar="{" + ",".join(FORMATS) + "}", help=_from_help())
    p.add_argument("--out", type=Path, default=None, help="write the run folder with every table here")
    p.add_argument("--save-log", type=Path, default=None, help="keep the converted neutral log here (framework dumps)")
    p.add_argument("--nan", default="error", metavar="error|drop",
                   help="missing or NaN log-probs on loss-masked tokens: stop (default) or exclude them, counted")
    p.add_argument("--pair", default="natural", metavar="natural|total|mismatch|update",
                   help="which log-ratio the corrections see (default: each its natural one)")
    p.add_argument("-H", "--hyper", action="append", metavar="NAME.KEY=VALUE",
                   help="a correction's hyper-parameter, e.g. -H tis_token.cap=3 (repeatable)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="load slime/SkyRL pickles without the restricted unpickler (runs code from the file: trusted "
                        "files only)")
    p.add_argument("--temperature", type=float, default=None, help="the sampler's temperature, if the log lacks it")
    p.add_argument("--top-p", type=float, default=None, help="the sampler's top-p, if the log lacks it")
    p.add_argument("--top-k", type=int, default=None, help="the sampler's top-k, if the log lacks it")
    p.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS, help="token rows per streamed chunk")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the bootstrap intervals")
    p.set_defaults(func=run)
    return p


def parse_hyper(items) -> dict:
    """{name: {key: value}} from -H NAME.KEY=VALUE items (VALUE read as JSON when it parses, else a string); a
    NAME.KEY given twice is refused rather than the last one silently kept."""
    out: dict = {}
    for item in items or []:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise LabError(f"-H must look like NAME.KEY=VALUE (e.g. tis_token.cap=3), got {item!r}")
        lhs, value = item.split("=", 1)
        name, key = (x.strip() for x in lhs.split(".", 1))
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError, ValueError):
            pass
        if key in out.get(name, {}):
            raise LabError(f"-H {name}.{key} is given twice ({out[name][key]!r} and {value!r}); give it once")
        out.setdefault(name, {})[key] = value
    return out


SAMPLING_RANGES = {"temperature": (0, 1000), "top_p": (0, 1), "top_k": (-1, 10_000_000)}  # the report's ranges


def _sampling(args) -> dict:
    """The sampler settings given on the command line: temperature in (0, 1000], top-p in (0, 1], top-k from -1 to
    10^7 (0 or -1: none)."""
    out = {k: v for k, v in (("temperature", args.temperature), ("top_p", args.top_p), ("top_k", args.top_k))
           if v is not None}
    for k, v in out.items():
        lo, hi = SAMPLING_RANGES[k]
        if not (lo <= v <= hi if k == "top_k" else lo < v <= hi):  # NaN fails both
            raise LabError(f"--{k.replace('_', '-')} must be {'from' if k == 'top_k' else 'above'} {lo} "
                           f"{'to' if k == 'top_k' else 'and at most'} {hi:,}, got {v}")
    return out


def plain(obj):
    """JSON-ready copy: numpy scalars to Python numbers."""
    import numpy as np

    if isinstance(obj, dict):
        return {str(k): plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [plain(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def headline_text(diag) -> str:
    """The verdict and the overall numbers as plain text (what the command prints)."""
    lines = [f"- {line}" for line in diag.verdict]
    lines.append("")
    lines.append(f"{'pair':<10}{'tokens':>12}{'mean|Δ|':>10}{'p99|Δ|':>10}{'ESS':>8}{'k-hat>0.7':>11}{'W median':>10}")
    for r in diag.summary["overall"].values():  # the rows of tables["overall"]
        lines.append(f"{r['pair']:<10}{int(r['n_tok']):>12,}{r['mean_abs']:>10.3g}{r['abs_p99']:>10.3g}"
                     f"{r['ess_median']:>8.2f}{int(r['khat_warning_steps']):>5}/{int(r['khat_steps']):<5}"
                     f"{r['w_median']:>10.3g}")
    return "\n".join(lines)


def _overlap(a: Path, b: Path) -> str | None:
    """How folder ``a`` relates to ``b`` when one would clobber the other: "is", "contains", "lies inside"."""
    a, b = Path(a).resolve(), Path(b).resolve()
    if a == b:
        return "is"
    if a in b.parents:
        return "contains"
    if b in a.parents:
        return "lies inside"
    return None


def check_targets(path: Path, out: Path | None, save_log: Path | None) -> None:
    """Refuse, before any work, an output that would replace or sit inside the input, two outputs that overlap, and
    an output that cannot be written or holds something else (lab.runs.check_out_dir, neutral.check_log_target)."""
    targets = [(flag, Path(p)) for flag, p in (("--out", out), ("--save-log", save_log)) if p is not None]
    if not targets:
        return
    from lab.diagnose.neutral import check_log_target
    from lab.runs import check_out_dir, check_writable

    for flag, p in targets:
        how = _overlap(p, path)
        if how:
            raise LabError(f"{flag} {p} {how} the input {path}; choose another {flag}")
    if out is not None and save_log is not None and (how := _overlap(out, save_log)):
        raise LabError(f"--out {out} {how} --save-log {save_log}; give them separate folders")
    for flag, p in targets:
        blocker = next((a for a in p.absolute().parents if a.exists() and not a.is_dir()), None)
        if blocker is not None:
            raise LabError(f"cannot write to {p}: {blocker} is a file, not a folder; choose another {flag}")
        try:
            check_writable(p)
        except LabError as e:
            raise LabError(str(e).replace("choose another --out", f"choose another {flag}")) from None
    if out is not None:
        check_out_dir(out)
    if save_log is not None:
        check_log_target(save_log)


class Outputs:
    """Output folders written all together or not at all: each is built in a hidden staging folder beside it
    (``stage(dest)``), and ``commit()`` renames them all into place, putting back what it replaced if a rename
    fails. ``close()`` removes the staging folders, and after a failure the parent folders it created."""

    def __init__(self, dests):
        dests = [Path(d) for d in dests]
        made = {p for d in dests for p in (d.parent, *d.parent.parents) if not p.exists()}
        self.made = sorted(made, key=lambda p: len(p.parts), reverse=True)  # innermost first
        self._stages, self.committed = {}, False
        try:
            for d in dests:
                d.parent.mkdir(parents=True, exist_ok=True)
                from lab.runs import staging_dir  # imports pandas: only when there is an output

                self._stages[d] = staging_dir(d, kind="staging")  # marked: a kill -9's is removed by the next run
        except BaseException:
            self.close()
            raise

    def stage(self, dest: Path) -> Path:
        return self._stages[Path(dest)] / "new"

    def commit(self) -> None:
        done = []
        try:
            for dest, tmp in self._stages.items():
                if dest.exists():
                    os.replace(dest, tmp / "old")
                done.append((dest, tmp))
                os.replace(tmp / "new", dest)
        except BaseException as e:
            for dest, tmp in reversed(done):
                if not (tmp / "new").exists() and dest.exists():
                    os.replace(dest, tmp / "new")
                if (tmp / "old").exists():
                    os.replace(tmp / "old", dest)
            if isinstance(e, OSError):
                raise LabError(f"cannot move the outputs into place ({e.strerror or e}); nothing was written") from None
            raise
        self.committed = True

    def close(self) -> None:
        for tmp in self._stages.values():
            shutil.rmtree(tmp, ignore_errors=True)
        if not self.committed and self.made:
            from lab.runs import remove_empty

            remove_empty(self.made)


def _check_pair(pair: str, logp: dict, what: str) -> None:
    """Refuse --pair P before any work when the log (declared log-prob columns ``logp``) cannot form P."""
    from lab.diagnose.streaming import PAIRS, pairs_of

    have = pairs_of([c for c, d in logp.items() if d is not None])
    if pair != "natural" and pair not in have:
        raise LabError(f"--pair {pair} compares {' and '.join(PAIRS[pair])}, which {what} does not both have (it "
                       f"can give: {', '.join(have) or 'none'}); choose one of those or natural")


def keep_freed_memory() -> None:
    """Let glibc's malloc reuse freed blocks of up to 32 MiB instead of returning each to the system: the pass
    allocates and frees arrays of a chunk's size (512 KiB at 64k rows) thousands of times, and with glibc's defaults
    every one is a fresh mmap whose pages fault in again (about 800,000 page faults, 2 s of system time on a
    10M-token log). Nothing happens where the C library is not glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: the largest value glibc takes on 64-bit
        libc.mallopt(-1, 64 << 20)  # M_TRIM_THRESHOLD
    except (OSError, AttributeError):
        pass


def run(args) -> int:
    from lab.diagnose.adapters import adapter
    from lab.diagnose.corrections import PAIR_ORDER, resolve
    from lab.diagnose.neutral import RolloutLog
    from lab.diagnose.schema import check_meta
    from lab.diagnose.streaming import check_options, diagnose

    source = adapter(args.fmt)
    if args.save_log is not None and source.module is None:
        raise LabError("--save-log keeps a converted framework dump; a --from lab log is already neutral")
    check_options(args.nan, args.pair, args.chunk_rows)
    hyper = parse_hyper(args.hyper)
    resolve(PAIR_ORDER, pair=args.pair, hyper=hyper)  # unknown names, keys or values: before any work
    sampling = _sampling(args)
    if not Path(args.path).exists():
        raise LabError(f"{args.path}: no such file or folder")
    log = None
    if source.module is None:
        log = RolloutLog(args.path)
        _check_pair(args.pair, log.meta["logp"], f"the log {args.path}")
    else:
        _check_pair(args.pair, source.logp, f"a {source.name} dump")
    check_targets(args.path, args.out, args.save_log)

    outputs = Outputs(p for p in (args.save_log, args.out) if p is not None)
    scratch = None
    keep_freed_memory()
    try:
        if log is not None:
            if sampling:
                log.meta["sampling"].update(sampling)
                check_meta(log.meta, log.path / "meta.json")
        else:
            if args.save_log is not None:
                dest = outputs.stage(args.save_log)
            else:
                from lab.runs import scratch_dir

                scratch = scratch_dir("lab-diagnose")
                dest = scratch / "log"
            log = RolloutLog(source.convert(args.path, dest, trust=args.trust_pickle, sampling=sampling),
                             shown_as=args.path)
        diag = diagnose(log, nan=args.nan, pair=args.pair, hyper=hyper, chunk_rows=args.chunk_rows, seed=args.seed)
        if args.out is not None:
            _write_out(outputs.stage(args.out), args, hyper, sampling, log, diag)
        outputs.commit()
    except OSError as e:
        raise LabError(_os_error_text(e, args.path)) from None
    finally:
        outputs.close()
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(headline_text(diag))
    for note in diag.summary.get("notes") or []:
        print(f"note: {note}")
    for p in (args.save_log, args.out):
        if p is not None:
            print(f"wrote {p}")
    return 0


def _write_out(dest: Path, args, hyper: dict, sampling: dict, log, diag) -> None:
    from lab.runs import atomic_dir, write_run_files

    config = {"command": "diagnose", "from": args.fmt, "path": str(args.path), "nan": args.nan,
              "pair": args.pair, "hyper": hyper, "sampling_overrides": sampling, "chunk_rows": args.chunk_rows,
              "seed": args.seed, "log_meta": plain(log.meta)}
    extra = {f"{name}.parquet": (lambda p, df=diag.tables[name]: df.to_parquet(p, index=False))
             for name in TABLES if name in diag.tables}
    with atomic_dir(dest) as stage:  # an OSError (a full disk) reaches run(), which says it in one line
        write_run_files(stage, config, diag.tables["results"], plain(diag.summary), extra=extra)


def _os_error_text(e: OSError, source: Path) -> str:
    """One line for an OSError while converting or writing: the outputs' staging folders are removed by then."""
    why = "the disk is full" if e.errno == errno.ENOSPC else (e.strerror or str(e).splitlines()[0] if str(e) else
                                                              type(e).__name__)
    name = getattr(e, "filename", None)
    if name and e.errno != errno.ENOSPC and Path(source).resolve() in (Path(name).resolve(),
                                                                        *Path(name).resolve().parents):
        return f"cannot read {name}: {why}; nothing was written"
    where = f" ({name})" if name else ""
    return (f"cannot write the outputs: {why}{where}; the staging folders were cleaned up and nothing was "
            f"written; free space or choose another --out / --save-log")


def main(argv=None) -> int:
    """``python -m lab.diagnose ...``: the ``lab diagnose`` command outside the ``lab`` entry point, through the same
    main (one line and exit 2 on bad input, 130 on an interrupt, the same handling of SIGTERM and a closed pipe)."""
    from lab.cli import main as lab_main

    return lab_main(["diagnose", *(sys.argv[1:] if argv is None else argv)])
