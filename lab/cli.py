"""The ``lab`` command: list envs and estimators, run a variance study, execute reports.

Bad input exits with status 2 and one line on stderr: ``error: what was wrong; what to do``.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path

from lab.errors import LabError


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not usage + message
        raise LabError(f"{message} (see `{self.prog} --help`)")


def _value(text: str):
    """A command-line value: JSON if it parses (numbers, true/false, lists), else the string itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _pairs(items, what: str) -> dict:
    out = {}
    for item in items or []:
        if "=" not in item:
            raise LabError(f"{what} must look like key=value, got {item!r}")
        k, v = item.split("=", 1)
        out[k.strip()] = _value(v.strip())
    return out


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes"):
        return True
    if text.lower() in ("0", "false", "no"):
        return False
    raise LabError(f"expected true or false, got {text!r}")


def _list(text: str, cast):
    try:
        return [cast(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LabError(f"cannot read {text!r} as a comma-separated list") from None


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

    for name in estimators.names():
        i = estimators.info(name)
        defaults = ", ".join(f"{k}={v}" for k, v in i.defaults.items()) or "-"
        print(f"{name}  [{i.family}]  {i.description}\n    source: {i.source}\n    defaults: {defaults}\n"
              f"    unbiased for: {i.unbiased_for}")
    return 0


def cmd_variance(args) -> int:
    from lab.runs import check_out_dir, write_run
    from lab.variance import VarianceConfig, config_dict, run_study

    hyper = _hyper(args.hyper)
    cfg = VarianceConfig(
        env=args.env, env_overrides=_pairs(args.set, "--set"), policy=args.policy, staleness=args.staleness,
        values=_list(args.values, float), estimators=_list(args.estimators, str), hyper=hyper,
        advantage=args.advantage, group_size=args.group_size, batch_size=args.batch_size,
        replicates=args.replicates, loss_agg_mode=args.agg, reference=args.reference, mc_samples=args.mc_samples,
        enum_limit=args.enum_limit, init_scale=args.init_scale, trajectory_steps=args.trajectory_steps, lr=args.lr,
        n_boot=args.n_boot, ci=args.ci, seed=args.seed)
    out = Path(args.out or f"runs/variance/{cfg.env}-{cfg.staleness}-seed{cfg.seed}")
    check_out_dir(out)
    result = run_study(cfg)
    write_run(out, {"command": "variance", **config_dict(cfg)}, result.results, result.summary)
    best = ", ".join(f"{k}: {v or 'none beats a zero update'}" for k, v in result.summary["best_by_mse"].items())
    print(f"wrote {out} ({len(result.results)} rows); lowest MSE per {cfg.staleness} value: {best}")
    return 0


def _hyper(items) -> dict:
    """--hyper EST.KEY=VALUE pairs as {estimator: {key: value}}."""
    hyper: dict = {}
    for key, v in _pairs(items, "--hyper").items():
        if "." not in key:
            raise LabError(f"--hyper must look like estimator.name=value, got {key!r}")
        est, name = key.split(".", 1)
        hyper.setdefault(est, {})[name] = v
    return hyper


def cmd_train(args) -> int:
    from lab.runs import check_out_dir, write_run
    from lab.training import TrainConfig, config_dict, train

    values = {f.name: getattr(args, f.name) for f in fields(TrainConfig)
              if not callable(f.default_factory) and getattr(args, f.name, None) is not None}
    hyper = _pairs(args.hyper, "--hyper")
    cfg = TrainConfig(**values, env_overrides=_pairs(args.set, "--set"), hyper=hyper)
    out = Path(args.out or f"runs/train/{cfg.env}-{cfg.estimator}-N{cfg.minibatches}-{cfg.regime}-seed{cfg.seed}")
    check_out_dir(out)
    result = train(cfg)
    write_run(out, {"command": "train", **config_dict(cfg)}, result.table, result.summary)
    print(f"wrote {out} ({len(result.table)} updates); {result.summary.get('headline', '')}")
    return 0


def cmd_sweep(args) -> int:
    from lab.sweep import load_spec, run_sweep

    spec = load_spec(args.spec)
    out = Path(args.out or f"runs/sweeps/{spec.name}")
    counts = run_sweep(spec, out, executor=args.executor, workers=args.workers, address=args.address)
    print(f"wrote {out}: {counts['done']} cells run, {counts['skipped']} already done, {counts['total']} in all")
    return 0


def cmd_report(args) -> int:
    from lab import reports

    if args.all:
        if args.name or args.param:
            raise LabError("give either a report name (with -p) or --all, not both")
        for path in reports.run_all(out_root=Path(args.out)):
            print(f"wrote {path}")
        return 0
    if not args.name:
        raise LabError(f"name a report ({', '.join(reports.names())}) or pass --all")
    path = reports.run_report(args.name, _pairs(args.param, "-p"), out_root=Path(args.out))
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from lab.variance import VarianceConfig

    d = {f.name: f.default for f in fields(VarianceConfig) if not callable(f.default_factory)}
    p = _Parser(prog="lab", description="Off-policy variance lab: bias, variance and MSE of gradient corrections.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    sub.add_parser("envs", help="list toy environments").set_defaults(func=cmd_envs)
    sub.add_parser("estimators", help="list estimators with defaults and sources").set_defaults(func=cmd_estimators)

    v = sub.add_parser("variance", help="one variance study: every estimator on the same batches")
    v.add_argument("--env", default=d["env"], help="toy env preset (see `lab envs`)")
    v.add_argument("--set", action="append", metavar="KEY=VALUE", help="override an env field, e.g. length=6")
    v.add_argument("--policy", default=d["policy"], help="prefix | markov")
    v.add_argument("--staleness", default=d["staleness"], help="lag | kl | temperature")
    v.add_argument("--values", default="0,1,2,4,8,16,32,64", help="comma-separated staleness values")
    v.add_argument("--estimators", default="reinforce,seq_is,token_is,ppo_clip", help="comma-separated names")
    v.add_argument("--hyper", action="append", metavar="EST.KEY=VALUE", help="e.g. ppo_clip.clip_ratio_c=3.0")
    v.add_argument("--advantage", default=d["advantage"], help="reward | rloo | grpo | drgrpo")
    v.add_argument("--group-size", type=int, default=d["group_size"])
    v.add_argument("--batch-size", type=int, default=d["batch_size"])
    v.add_argument("--replicates", type=int, default=d["replicates"])
    v.add_argument("--agg", default=d["loss_agg_mode"], help="loss aggregation mode, or native (each estimator's own)")
    v.add_argument("--reference", default=d["reference"], help="exact | mc")
    v.add_argument("--mc-samples", type=int, default=d["mc_samples"])
    v.add_argument("--enum-limit", type=int, default=d["enum_limit"])
    v.add_argument("--init-scale", type=float, default=d["init_scale"])
    v.add_argument("--trajectory-steps", type=int, default=d["trajectory_steps"])
    v.add_argument("--lr", type=float, default=d["lr"])
    v.add_argument("--n-boot", type=int, default=d["n_boot"])
    v.add_argument("--ci", type=float, default=d["ci"])
    v.add_argument("--seed", type=int, default=d["seed"])
    v.add_argument("--out", default=None, help="run folder (default runs/variance/ENV-KIND-seedN)")
    v.set_defaults(func=cmd_variance)

    from lab.training import TrainConfig

    t = sub.add_parser("train", help="one training run under staleness (sync mini-batching, async lag, mismatch)")
    for f in fields(TrainConfig):
        if callable(f.default_factory):
            continue
        kind = {bool: _bool, int: int, float: float}.get(type(f.default), str)
        t.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None,
                       help=f"default {f.default}")
    t.add_argument("--set", action="append", metavar="KEY=VALUE", help="override an env field, e.g. length=6")
    t.add_argument("--hyper", action="append", metavar="KEY=VALUE", help="estimator hyper-parameter, e.g. cap=3")
    t.add_argument("--out", default=None, help="run folder (default runs/train/ENV-EST-N-REGIME-seedS)")
    t.set_defaults(func=cmd_train)

    w = sub.add_parser("sweep", help="many training runs from a YAML grid; resumable; local pool or Ray")
    w.add_argument("spec", help="sweep spec (YAML with name, base, grid; see sweeps/example.yaml)")
    w.add_argument("--executor", default="local", help="local (process pool) | ray")
    w.add_argument("--workers", type=int, default=None, help="parallel workers (default: all CPUs)")
    w.add_argument("--address", default=None, help="Ray cluster address (default: a local Ray instance)")
    w.add_argument("--out", default=None, help="results folder (default runs/sweeps/NAME); rerun to resume")
    w.set_defaults(func=cmd_sweep)

    r = sub.add_parser("report", help="execute a report notebook into reports/ with an HTML export")
    r.add_argument("name", nargs="?", help="report name")
    r.add_argument("-p", "--param", action="append", metavar="KEY=VALUE", help="notebook parameter")
    r.add_argument("--all", action="store_true", help="build every report with its defaults and the gallery")
    r.add_argument("--out", default="reports", help="reports folder")
    r.set_defaults(func=cmd_report)
    return p


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
