"""The ``lab`` command: list envs and estimators, run a variance study or a training run, sweeps, reports.

The flags of ``variance`` and ``train`` come from their config dataclasses (``lab.configs``). Bad input exits with
status 2 and one line on stderr: ``error: what was wrong; what to do``.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

from lab.errors import LabError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        raise LabError(f"{message} (see `{self.prog} --help`)")


def cmd_envs(args) -> int:
    import toy_envs

    print(f"{'name':<18}{'prompts':>8}{'V':>4}{'T':>4}  {'reward':<10}{'eos':<6}{'pairs':>12}  description")
    for name in toy_envs.names():
        e = toy_envs.make(name)
        print(f"{name:<18}{e.n_prompts:>8}{e.vocab_size:>4}{e.length:>4}  {e.reward:<10}{str(e.eos):<6}"
              f"{e.num_pairs:>12,}  {e.description}")
    return 0


def cmd_estimators(args) -> int:
    from lab import estimators
    from lab.estimators import presets

    if args.preset:
        system, _, name = args.preset.partition(":")
        if system not in presets.SYSTEMS:
            raise LabError(f"unknown preset system {system!r}; choose one of {', '.join(presets.SYSTEMS)} "
                           f"(e.g. --preset verl or --preset verl:decoupled_geo_rs)")
        chosen = [args.preset] if name else presets.names(system)
        for full in chosen:
            print(presets.composition(full))
        if not name:
            print(f"\nRun one with `lab variance --estimators {system}:NAME` or `lab train --estimator {system}:NAME`; "
                  f"decoupled presets see a three-policy batch (old_log_prob = the recomputed pi_old, "
                  f"rollout_log_probs = the sampler), bypass presets a two-policy one (old_log_prob = the sampler).")
        return 0
    for name in estimators.names():
        i = estimators.info(name)
        defaults = ", ".join(f"{k}={v}" for k, v in i.defaults.items()) or "-"
        domains = "; ".join(f"{k}: {d.describe()}" for k, d in i.domains.items()) or "-"
        inputs = ", ".join([*i.inputs, *(f"{k} (optional)" for k in i.optional_inputs)])
        print(f"{name}  [{i.family}]  {i.label}: {i.description}\n    paper: {i.paper}\n    source: {i.source}\n"
              f"    defaults: {defaults}\n    allowed: {domains}\n    unbiased for: {i.unbiased_for}"
              + (f"\n    inputs: {inputs}" if inputs else "")
              + (f"\n    differs from the code it cites: {i.differences}" if i.differences else ""))
    print("\nEvery estimator: a response with no real token counts in the batch size B of the seq-mean-* modes, as "
          "in verl 0.9.1's trainer (global batch size = every sequence of the mini-batch) and TRL's GRPOTrainer. "
          "verl's agg_loss called on its own (no global batch information) divides by the non-empty rows instead; "
          "lab.estimators.to_verl(name) follows verl in both cases, except that verl's geo_mean (GMPO) averages over "
          "every row whatever it is given, while the exported gmpo aggregates like verl's other losses.\n"
          "Three-policy estimators (rollout_log_probs required) take old_log_prob = the recomputed pi_old and "
          "rollout_log_probs = the sampler; `lab variance` and `lab train` supply that batch. verl's "
          "rollout-correction presets run as verl:NAME (`lab estimators --preset verl` lists them).")
    return 0


def cmd_variance(args) -> int:
    from lab.configs import from_args, to_dict
    from lab.runs import check_out_dir, write_run
    from lab.studies import variance

    cfg = from_args(variance.Config, args)
    out = Path(args.out or f"runs/variance/{cfg.env}-{cfg.staleness}-seed{cfg.seed}")
    check_out_dir(out)
    results, summary = variance.run(cfg)
    write_run(out, {"command": "variance", **to_dict(cfg)}, results, summary)
    best = ", ".join(f"{k}: {v or 'none beats a zero update'}" for k, v in summary["best_by_mse"].items())
    print(f"wrote {out} ({len(results)} rows); lowest MSE per {cfg.staleness} value: {best}")
    return 0


def cmd_train(args) -> int:
    from lab.configs import estimator_pairs, from_args, to_dict
    from lab.engine.training import TrainConfig, train
    from lab.runs import atomic_dir, check_out_dir, write_run, write_run_files

    nested = estimator_pairs(args.hyper)
    name = args.estimator or TrainConfig.estimator
    other = sorted(set(nested) - {name})
    if other:
        raise LabError(f"--hyper names estimator(s) {', '.join(other)}, but this run trains {name!r}; "
                       f"use --hyper {name}.KEY=VALUE")
    cfg = from_args(TrainConfig, args, hyper=nested.get(name, {}))
    out = Path(args.out or f"runs/train/{cfg.env}-{cfg.estimator}-N{cfg.minibatches}-{cfg.regime}-seed{cfg.seed}")
    check_out_dir(out)
    if not args.rollout_log:
        result = train(cfg)
        write_run(out, {"command": "train", **to_dict(cfg)}, result.table, result.summary)
    else:  # the log is written inside the run's own staging folder and moves in with it
        with atomic_dir(out) as stage:
            result = train(cfg, rollout_log=stage / "rollout_log")
            write_run_files(stage, {"command": "train", **to_dict(cfg)}, result.table, result.summary)
    log = args.rollout_log
    print(f"wrote {out} ({len(result.table)} updates{', with its rollout log' if log else ''}); "
          f"{result.summary.get('headline', '')}")
    return 0


def cmd_sweep(args) -> int:
    from lab.engine.sweep import load_spec, run_sweep

    spec = load_spec(args.spec)
    if args.device is not None:  # every cell on this device (a field of the cell's config, so part of its id)
        from lab.engine.sweep import _fields

        if "device" not in _fields(spec.kind) or "device" in spec.grid:
            raise LabError(f"--device applies to sweeps whose cells take a device and do not sweep it; "
                           f"{spec.name!r} cannot take it")
        spec.base = {**spec.base, "device": args.device}
    out = Path(args.out or f"runs/sweeps/{spec.name}")
    try:
        counts = run_sweep(spec, out, executor=args.executor, workers=args.workers, address=args.address)
    except KeyboardInterrupt:
        if not out.exists():
            raise
        print(f"error: interrupted; the finished cells are kept in {out}: rerun the same command to resume",
              file=sys.stderr)
        return 130
    print(f"wrote {out}: {counts['done']} cells run, {counts['skipped']} already done, {counts['total']} in all")
    return 0


def cmd_report(args) -> int:
    from lab import reports
    from lab.configs import pairs
    from lab.reports import params as report_params
    from lab.runs import check_file

    if args.all:
        if args.name or args.param or args.file or args.params:
            raise LabError("give either a report name (with -p / -f) or --all, not both")
        check_file(Path(args.out) / "index.html")  # before any report runs
        n, done, t0, lock = len(reports.names()), [0], time.perf_counter(), threading.Lock()

        def say(kind, name, seconds, error=None):
            with lock:  # reports build in parallel threads: one whole line at a time
                if kind == "start":
                    print(f"building {name} ...", flush=True)
                else:
                    done[0] += 1
                    status = f"failed ({error})" if kind == "failed" else f"{seconds:.0f} s"
                    print(f"[{done[0]}/{n}] {name}: {status}", flush=True)

        paths = reports.run_all(out_root=Path(args.out), workers=args.workers, on_event=say)
        print(f"wrote {len(paths) - 1} reports and the gallery {paths[-1]} in {time.perf_counter() - t0:.0f} s",
              flush=True)
        return 0
    if not args.name:
        raise LabError(f"name a report ({', '.join(reports.names())}) or pass --all")
    if args.params:
        for p in reports.parameters(args.name).values():
            print(f"{p.name:<22}{p.kind:<18}{p.default!r:<40} {p.help}")
        return 0
    given = {**(report_params.from_file(args.file) if args.file else {}), **pairs(args.param, "-p")}
    check_file(Path(args.out) / "index.html")  # the gallery page is refreshed after the build
    path = reports.run_report(args.name, given, out_root=Path(args.out))
    reports.write_index(Path(args.out))  # the gallery shows what the folder holds
    print(f"wrote {path}")
    return 0


def _folder(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path; name a folder")
    return text


def _positive(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive whole number, got {text!r}")
    return n


def build_parser() -> argparse.ArgumentParser:
    from lab.configs import add_flags
    from lab.engine.training import TrainConfig
    from lab.studies import variance

    p = _Parser(prog="lab", description="Off-policy variance lab: bias, variance and MSE of gradient corrections.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("envs", help="list toy environments").set_defaults(func=cmd_envs)
    e = sub.add_parser("estimators", help="list estimators with defaults and sources")
    e.add_argument("--preset", default=None, metavar="SYSTEM[:NAME]",
                   help="list a trainer's presets and the lab composition each maps to (verl, or verl:NAME)")
    e.set_defaults(func=cmd_estimators)

    v = sub.add_parser("variance", help="one variance study: every estimator on the same batches")
    add_flags(v, variance.Config)
    v.add_argument("--out", type=_folder, default=None, help="run folder (default runs/variance/ENV-KIND-seedN)")
    v.set_defaults(func=cmd_variance)

    t = sub.add_parser("train", help="one training run under staleness (sync mini-batching, async lag, mismatch)")
    add_flags(t, TrainConfig)
    t.add_argument("--out", type=_folder, default=None, help="run folder (default runs/train/ENV-EST-N-REGIME-seedS)")
    t.add_argument("--rollout-log", action="store_true",
                   help="also write every mini-batch as a neutral rollout log in OUT/rollout_log (see `lab diagnose`)")
    t.set_defaults(func=cmd_train)

    w = sub.add_parser("sweep", help="many training runs from a YAML grid; resumable; local pool or Ray")
    w.add_argument("spec", help="sweep spec (YAML with name, kind, base, grid; see sweeps/example.yaml)")
    w.add_argument("--device", default=None, help="run every cell on this device (cpu | cuda), over the spec's base")
    w.add_argument("--executor", default="local", help="local (process pool) | ray")
    w.add_argument("--workers", type=_positive, default=None, help="parallel workers (default: all CPUs)")
    w.add_argument("--address", default=None, help="Ray cluster address (default: a local Ray instance)")
    w.add_argument("--out", type=_folder, default=None, help="results folder (default runs/sweeps/NAME); rerun to resume")
    w.set_defaults(func=cmd_sweep)

    r = sub.add_parser("report", help="execute a report notebook into reports/ with an HTML export")
    r.add_argument("name", nargs="?", help="report name")
    r.add_argument("-p", "--param", action="append", metavar="KEY=VALUE",
                   help="notebook parameter (lists: a,b,c or JSON)")
    r.add_argument("-f", "--file", default=None, metavar="PARAMS.yaml", help="notebook parameters from a YAML file")
    r.add_argument("--params", action="store_true", help="list the report's parameters with types and defaults")
    r.add_argument("--all", action="store_true", help="build every report with its defaults and the gallery")
    r.add_argument("--out", type=_folder, default="reports", help="reports folder")
    r.add_argument("--workers", type=_positive, default=1, help="with --all: reports built at a time (one kernel each)")
    r.set_defaults(func=cmd_report)

    from lab.diagnose.cli import add_parser as add_diagnose
    from lab.pretrain import add_parser as add_pretrain

    add_diagnose(sub)
    add_pretrain(sub)
    return p


def _terminate(signum, frame):
    """SIGTERM (what `timeout`, `docker stop` and batch schedulers send) and SIGHUP stop a command the way Ctrl-C
    does: staging folders are removed, finished sweep cells kept, worker processes shut down."""
    raise KeyboardInterrupt


def main(argv=None) -> int:
    import signal

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except LabError as e:
        _say(f"error: {e}")
        return 2
    except OSError as e:  # a full disk, a vanished folder: one line; staging was removed on the way out
        where = f" ({e.filename})" if e.filename else ""
        _say(f"error: {e.strerror or e}{where}; nothing half-written was kept: free the space or fix the path, then "
             f"rerun")
        return 2
    except KeyboardInterrupt:
        _say("error: interrupted; nothing half-written was kept")
        return 130


def _say(line: str) -> None:
    """The error line, after any progress bar still open (so it is the last line)."""
    from lab.progress import close_all

    close_all()
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
