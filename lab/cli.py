"""The ``lab`` command: list envs and estimators, run a variance study or a training run, sweeps, reports.

The flags of ``variance`` and ``train`` come from their config dataclasses (``lab.configs``). Bad input exits with
status 2 and one line on stderr: ``error: what was wrong; what to do``.
"""
from __future__ import annotations

import argparse
import os
import sys
import json
import time
from pathlib import Path

from lab.errors import LabError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        raise LabError(f"{message} (see `{self.prog} --help`)")


def _count(n: int) -> str:
    """A count with thousands separators, or its power of ten when it has more than 12 digits."""
    return f"{n:,}" if n < 10**12 else f"~1e{len(str(n)) - 1}"


def cmd_envs(args) -> int:
    import toy_envs

    print(f"{'name':<18}{'prompts':>8}{'V':>4}{'T':>5}  {'reward':<10}{'eos':<6}{'pairs':>12}  description")
    for name in toy_envs.names():
        e = toy_envs.make(name)
        print(f"{name:<18}{e.n_prompts:>8}{e.vocab_size:>4}{e.length:>5}  {e.reward:<10}{str(e.eos):<6}"
              f"{_count(e.num_pairs):>12}  {e.description}")
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
              + ("\n    mask replay: kept_log_mass (optional): log-probs renormalised over the sampler's kept set"
                 if i.mask_replay else "")
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


def cmd_study(args) -> int:
    """Any study from the command line: flags from its Config, a run folder with its results and summary."""
    from lab.configs import from_args, to_dict
    from lab.runs import check_out_dir, write_run
    from lab.studies import study_module

    mod = study_module(args.study)
    cfg = from_args(mod.Config, args)
    out = Path(args.out or f"runs/{args.study}/{mod.run_name(cfg) if hasattr(mod, 'run_name') else 'run'}")
    check_out_dir(out)
    results, summary = mod.run(cfg)
    write_run(out, {"command": f"study {args.study}", **to_dict(cfg)}, results, summary)
    line = mod.describe(summary) if hasattr(mod, "describe") else ""
    print(f"wrote {out} ({len(results)} rows){'; ' + line if line else ''}")
    return 0


def cmd_train(args) -> int:
    from lab.configs import estimator_pairs, from_args, to_dict
    from lab.engine.training import TrainConfig, train
    from lab.runs import atomic_dir, check_out_dir, write_failed, write_run, write_run_files

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
        try:
            with atomic_dir(out) as stage:
                result = train(cfg, rollout_log=stage / "rollout_log")
                write_run_files(stage, {"command": "train", **to_dict(cfg)}, result.table, result.summary)
        except OSError as e:
            raise write_failed(out, e) from None
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
        _interrupt_handled()
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
        n, done, t0 = len([r for r in reports.catalog().values() if r.gallery]), [0], time.perf_counter()

        def say(kind, name, seconds, error=None):
            if kind == "start":
                print(f"building {name} ...", flush=True)
            else:
                done[0] += 1
                status = f"failed ({error})" if kind == "failed" else f"{seconds:.0f} s"
                print(f"[{done[0]}/{n}] {name}: {status}", flush=True)

        paths = reports.run_all(out_root=Path(args.out), workers=args.workers, on_event=say, smoke=args.smoke)
        print(f"wrote {len(paths) - 1} reports and the gallery {paths[-1]} in {time.perf_counter() - t0:.0f} s",
              flush=True)
        return 0
    if not args.name:
        raise LabError(f"name a report ({', '.join(reports.names())}) or pass --all")
    if args.params:
        for p in reports.parameters(args.name).values():
            print(f"{p.name:<24}{p.kind:<36} {json.dumps(p.default):<40} {p.help}")
        return 0
    given = report_params.from_file(args.file) if args.file else {}
    cli = pairs(args.param, "-p", parse=False)
    check_file(Path(args.out) / "index.html")  # the gallery page is refreshed after the build
    path = reports.run_report(args.name, given, out_root=Path(args.out), cli=cli, smoke=args.smoke)
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


def _add_study(p, name: str) -> None:
    from lab.configs import add_flags
    from lab.studies import study_module

    add_flags(p, study_module(name).Config)
    p.add_argument("--out", type=_folder, default=None, help=f"run folder (default runs/{name}/...)")


def _add_estimators(p) -> None:
    p.add_argument("--preset", default=None, metavar="SYSTEM[:NAME]",
                   help="list a trainer's presets and the lab composition each maps to (verl, or verl:NAME)")


def _add_train(p) -> None:
    from lab.configs import add_flags
    from lab.engine.training import TrainConfig

    add_flags(p, TrainConfig)
    p.add_argument("--out", type=_folder, default=None, help="run folder (default runs/train/ENV-EST-N-REGIME-seedS)")
    p.add_argument("--rollout-log", action="store_true",
                   help="also write every mini-batch as a neutral rollout log in OUT/rollout_log (see `lab diagnose`)")


def _add_sweep(p) -> None:
    p.add_argument("spec", help="sweep spec (YAML with name, kind, base, grid; see sweeps/example.yaml)")
    p.add_argument("--device", default=None, help="run every cell on this device (cpu | cuda), over the spec's base")
    p.add_argument("--executor", default="local", help="local (process pool) | ray")
    p.add_argument("--workers", type=_positive, default=None, help="parallel workers (default: all CPUs)")
    p.add_argument("--address", default=None, help="Ray cluster address (default: a local Ray instance)")
    p.add_argument("--out", type=_folder, default=None,
                   help="results folder (default runs/sweeps/NAME); rerun to resume")


def _add_report(p) -> None:
    p.add_argument("name", nargs="?", help="report name (lab report --list shows them)")
    p.add_argument("-p", "--param", action="append", metavar="KEY=VALUE",
                   help="a parameter (lists: a,b,c or JSON); overrides the same one in -f")
    p.add_argument("-f", "--file", default=None, metavar="PARAMS.yaml", help="parameters from a YAML file")
    p.add_argument("--params", action="store_true", help="list the report's parameters with types and defaults")
    p.add_argument("--all", action="store_true", help="build the gallery's reports with their defaults and the index")
    p.add_argument("--smoke", action="store_true", help="build with each report's small values (a quick check)")
    p.add_argument("--out", type=_folder, default="reports", help="reports folder")
    p.add_argument("--workers", type=_positive, default=1,
                   help="with --all: reports built at a time (one process each)")


# command: (help, flag builder, handler); flags are built for the command being run only, so `lab --help` and the
# listing commands import nothing heavy
COMMANDS = {
    "envs": ("list toy environments", None, cmd_envs),
    "estimators": ("list estimators with defaults and sources", _add_estimators, cmd_estimators),
    "study": ("run any study: `lab study NAME --help` lists its flags (its Config's fields)", None, cmd_study),
    "variance": ("the variance study (= lab study variance): every estimator on the same batches",
                 lambda p: _add_study(p, "variance"), cmd_study),
    "train": ("one training run under staleness (sync mini-batching, async lag, mismatch)", _add_train, cmd_train),
    "sweep": ("many training runs from a YAML grid; resumable; local pool or Ray", _add_sweep, cmd_sweep),
    "report": ("build a report notebook into reports/ with an HTML export, or the whole gallery", _add_report,
               cmd_report),
}
# commands whose module registers its own parser (``add_parser(subparsers)``), imported only when run
REGISTERED = {"diagnose": ("lab.diagnose.cli", "importance-weight diagnostics of a training run's rollout logs"),
              "pretrain": ("lab.pretrain", "supervised warm start of a transformer on a task (cached per user)")}


def build_parser(argv=None) -> argparse.ArgumentParser:
    """The ``lab`` parser; only the command named in ``argv`` gets its flags (and imports what they need)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    p = _Parser(prog="lab", description="Off-policy variance lab: bias, variance and MSE of gradient corrections.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_text, add, handler) in COMMANDS.items():
        s = sub.add_parser(name, help=help_text, description=help_text)
        s.set_defaults(func=handler, study="variance" if name == "variance" else None)
        if name != chosen:
            continue
        if name == "study":
            _add_study_command(s, argv[argv.index("study") + 1:])
        elif add:
            add(s)
    for name, (module, help_text) in REGISTERED.items():
        if name == chosen:
            import importlib

            importlib.import_module(module).add_parser(sub)
        else:
            sub.add_parser(name, help=help_text)
    return p


def _add_study_command(p, rest: list) -> None:
    from lab.studies import studies

    known = list(studies())
    p.add_argument("study", choices=known, metavar="NAME", help=f"the study ({', '.join(known)})")
    name = next((a for a in rest if not a.startswith("-")), None)
    if name in known:
        _add_study(p, name)


def _terminate(signum, frame):
    """SIGTERM (what `timeout`, `docker stop` and batch schedulers send) and SIGHUP stop a command the way Ctrl-C
    does: staging folders are removed, finished sweep cells kept, worker processes shut down."""
    raise KeyboardInterrupt


def main(argv=None) -> int:
    import signal

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _terminate)
    try:
        argv = list(sys.argv[1:] if argv is None else argv)
        args = build_parser(argv).parse_args(argv)
        return args.func(args)
    except LabError as e:
        _say(f"error: {e}")
        return 2
    except BrokenPipeError:  # the reader went away (`lab estimators | head`): nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # a full disk, a vanished folder: one line; staging was removed on the way out
        where = f" ({e.filename})" if e.filename else ""
        _say(f"error: {e.strerror or e}{where}; nothing half-written was kept: free the space or fix the path, then "
             f"rerun")
        return 2
    except KeyboardInterrupt:
        _say("error: interrupted; nothing half-written was kept")
        _interrupt_handled()
        return 130


def _interrupt_handled() -> None:
    """CPython (3.11) marks a KeyboardInterrupt as unhandled when it leaves a nested ``PyRun_*`` call (C code that
    runs Python), even when Python code catches it afterwards, and then ends the process by SIGINT instead of with
    its exit status: the shell would see 130 either way, a parent process -2 instead of 130. The interrupt was
    handled here (staging removed, one line said), so the mark is cleared."""
    import ctypes

    try:
        ctypes.c_int.in_dll(ctypes.pythonapi, "_Py_UnhandledKeyboardInterrupt").value = 0
    except (ValueError, AttributeError, OSError):  # another interpreter, or the symbol not exported
        pass


def _say(line: str) -> None:
    """The error line, after any progress bar still open (so it is the last line); one line whatever it quotes (a
    value's multi-line repr, a file name with a line break)."""
    from lab.progress import close_all

    close_all()
    print(" ".join(part.strip() for part in line.splitlines()), file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
