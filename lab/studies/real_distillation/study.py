"""On-policy distillation from a real teacher: where does vOPD's baseline help? Vanilla OPD, vOPD (full and top-k
baseline), full-vocabulary and top-k KL, each training a small student transformer against a larger, well-trained
teacher (``lab.engine.distill``) across vocabulary sizes V and student-teacher gaps, over seeds.

Two sources of runs, aggregated the same way:

- the grid of this config (``estimators`` x ``vocab_sizes`` x ``student_accuracies`` x ``seeds``), run here cell by
  cell: each cell is ``distil(DistillConfig(...))``, exactly the cell the sweep ``sweeps/real_distillation.yaml``
  of this folder runs (``kind: distill``), with this config's (smaller) number of steps;
- ``results``: the folder of a finished sweep of kind distill
  (``lab sweep lab/studies/real_distillation/sweeps/real_distillation.yaml``), read with
  ``lab.engine.sweep.load_results``; the grid fields are then ignored.

A setting is (V, the student's warm-start accuracy; 0 = a random student). Aggregates (tidy rows: ``part``, setting,
``estimator``, ``metric``, ``update``, ``value``, ``lo``, ``hi``, ``n``), every interval a 95% percentile bootstrap
(``lab.stats``):

- ``curve``: the held-out and training sequence KL, the per-token KL on visited states and the accuracies against
  the update (update 0: the start), mean over seeds, interval over seeds; ``gvar`` of every probed estimator against
  the update, mean over the runs of the setting (every trained estimator's trajectory), interval over runs;
- ``final``: per trained estimator, the final held-out sequence KL, the share of the initial KL it closed, and the
  difference from vanilla OPD's final KL paired by seed (same warm start, same first batch);
- ``variance``: per probed estimator, Var(OPD) / Var(estimator) on the same probe responses at the same
  parameters, a ratio of the pooled variances over every probe of every run of the setting, interval over runs;
  beside it, the factor a state-value baseline would give if the score's size did not depend on the token:
  pred = mean E[r_t^2|s_t] / mean Var(r_t|s_t) = 1 / (1 - value share), from the training batches of the same steps;
- ``cost``: per V and estimator, the median wall-clock step (and update) time over runs divided by vanilla OPD's
  (runs at different times: ``benchmarks/bench_real_distillation.py`` measures the ratios in one run).

Why the baseline helps where it does. Per token, OPD's coefficient is the sampled-token reward r_t, whose second
moment at a state is E[r_t^2|s_t] = Var(r_t|s_t) + KL_t^2; vOPD subtracts its mean -KL_t and keeps only the
within-state variance. So the baseline removes the value share mean KL_t^2 / mean E[r_t^2|s_t]: large when the
student's sampled tokens are uniformly bad (a random student spreading its mass over distractors the teacher
rules out: every token's reward is about -KL_t), small when a closer student's rewards differ a lot between tokens
at the same state (the right token's reward is large and positive, a wrong one's very negative). A top-k baseline
estimates KL_t from the student's top-k tokens renormalised, so it misses the value wherever the student's mass
lies outside its top-k (``topk_mass``).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd

from lab import stats
from lab.configs import SEED_MAX, check_types, check_unique
from lab.engine.distill import DIGITS, FAMILY, DistillConfig, distil
from lab.errors import LabError
from lab.policies.transformer import SIZES
from lab.progress import bar
from lab.studies import StudyResult
from lab.typed import knob

SETTING = ("vocab_size", "student_accuracy")
RUN = (*SETTING, "estimator", "seed")
CURVES = ("kl_seq", "kl_seq_train", "kl_token", "accuracy", "heldout_accuracy")
INITIAL = {"kl_seq": "initial_kl_seq", "kl_seq_train": "initial_kl_seq_train", "accuracy": "initial_accuracy",
           "heldout_accuracy": "initial_heldout_accuracy"}
SWEPT = {"cell_id", "estimator", "distractors", "student_accuracy", "seed"}  # grid keys the study aggregates over
CELL_FIELDS = ("env", "difficulty", "n_prompts", "teacher_size", "teacher_accuracy", "student_size", "top_k",
               "batch_size", "steps", "lr", "grad_every", "probe_size", "eval_every", "device")
SWEEP = "lab/studies/real_distillation/sweeps/real_distillation.yaml"  # the full grid (kind distill)


@dataclass
class Config:
    """The real-teacher distillation study. Defaults: 2 vocabulary sizes x 2 gaps x 5 estimators x 2 seeds of 30
    steps, about 2 minutes on one core, the warm starts' training included (cached afterwards); each run's other
    settings default to ``DistillConfig``'s."""

    results: str | None = None
    """a finished sweep folder of kind distill to aggregate instead of running the grid below"""
    estimators: list[Literal[FAMILY]] = knob(list(FAMILY))
    """trained estimators, one run each per setting (opd is needed: everything is a ratio to vanilla OPD)"""
    vocab_sizes: list[int] = knob([10, 64], ge=DIGITS, le=1_000_000)
    """response vocabularies V = 10 digits + V - 10 distractor tokens"""
    student_accuracies: list[float] = knob([0.0, 0.3], ge=0, lt=1)
    """the student's warm-start accuracy (the gap to the teacher); 0: a random student"""
    seeds: list[int] = knob([0, 1], ge=0, le=SEED_MAX)
    """seeds of every run (at least two: intervals are over runs)"""
    steps: int = knob(30, ge=1, le=1_000_000)
    """optimiser steps per run"""
    env: str = DistillConfig.env
    """task env preset (chain, sorting or addition; see `lab envs`)"""
    difficulty: int = knob(DistillConfig.difficulty, ge=1, le=64)
    """the task's difficulty (chain: T)"""
    n_prompts: int = knob(DistillConfig.n_prompts, ge=1, le=1_000_000)
    """training prompts"""
    teacher_size: Literal[tuple(SIZES)] = DistillConfig.teacher_size
    """teacher transformer size (lab.policies.transformer.SIZES; larger than the student's)"""
    teacher_accuracy: float = knob(DistillConfig.teacher_accuracy, gt=0, lt=1)
    """the teacher's warm-start accuracy on the task"""
    student_size: Literal[tuple(SIZES)] = DistillConfig.student_size
    """student transformer size"""
    top_k: int = knob(DistillConfig.top_k, ge=1, le=1_000_000)
    """k of the top-k baseline and loss"""
    batch_size: int = knob(DistillConfig.batch_size, ge=1, le=1_000_000)
    """student responses per step"""
    lr: float = knob(DistillConfig.lr, gt=0, le=1e3)
    """the student's Adam learning rate"""
    grad_every: int = knob(DistillConfig.grad_every, ge=0, le=1_000_000)
    """measure the gradient variance every this many steps (0: never)"""
    probe_size: int = knob(DistillConfig.probe_size, ge=2, le=1_000_000)
    """responses per gradient-variance probe"""
    eval_every: int = knob(DistillConfig.eval_every, ge=1, le=1_000_000)
    """sequence KL every this many steps"""
    device: str = DistillConfig.device
    """where the networks run: cpu | cuda"""
    n_boot: int = knob(2000, ge=10, le=1_000_000)
    """bootstrap resamples"""
    ci: float = knob(0.95, gt=0, lt=1)
    """interval coverage"""

    def cells(self) -> list[DistillConfig]:
        """The runs of the grid, in the sweep's order (estimator, V, gap, seed)."""
        shared = {k: getattr(self, k) for k in CELL_FIELDS}
        return [DistillConfig(**shared, estimator=e, distractors=int(V) - DIGITS, student_accuracy=float(a),
                              seed=int(s))
                for e in self.estimators for V in self.vocab_sizes for a in self.student_accuracies
                for s in self.seeds]

    def validate(self) -> None:
        check_types(self)
        if self.results is not None:
            if not (Path(self.results) / "sweep.json").is_file():
                raise LabError(f"results {self.results!r} is not a sweep folder (no sweep.json); run `lab sweep "
                               f"{SWEEP} --out DIR` and pass DIR")
            return
        for name in ("estimators", "vocab_sizes", "student_accuracies", "seeds"):
            if not getattr(self, name):
                raise LabError(f"{name} must list at least one value")
            check_unique(name, getattr(self, name))
        if "opd" not in self.estimators:
            raise LabError("estimators must include opd: variance and cost are reported as ratios to vanilla OPD")
        if len(self.seeds) < 2:
            raise LabError("give at least two seeds: intervals are taken over seeds")
        for cell in self.cells():
            cell.validate()


SMOKE = {"vocab_sizes": [10], "student_accuracies": [0.0], "seeds": [0, 1], "steps": 4, "grad_every": 2,
         "probe_size": 8, "batch_size": 16, "teacher_size": "small", "teacher_accuracy": 0.5, "student_size": "test",
         "n_boot": 200}


# ---- the summary's shape --------------------------------------------------------------------------------------------

@dataclass
class Measured:
    """An aggregate with its 95% interval and the number of units (runs or seeds) behind it."""

    value: float
    lo: float
    hi: float
    n: int


@dataclass
class Setting:
    """One (V, student start): the variance ratios on the same probes, the value share that predicts vOPD's, the
    training outcome per trained estimator. Mappings are keyed by estimator; None: not measured."""

    vocab_size: int
    student_accuracy: float
    initial_accuracy: float
    initial_kl_seq: float
    teacher_accuracy: float
    var_reduction: dict[str, Measured | None]  # Var(OPD) / Var(estimator)
    var_vs_kl_full: dict[str, Measured | None]  # Var(estimator) / Var(full-vocabulary KL)
    pred_reduction: Measured | None  # 1 / (1 - value share): a state-only baseline's factor, were scores equal
    final_kl_seq: dict[str, Measured | None]
    kl_closed: dict[str, Measured | None]  # share of the initial KL closed
    kl_minus_opd: dict[str, Measured | None]  # final KL minus OPD's, paired by seed
    value_share: float
    distractor_mass: float
    topk_mass: float
    kl_token: float
    kl_topk_token: float
    verdict: str  # helps | hurts | unresolved | unmeasured: vOPD's variance reduction against 1
    training_verdict: str  # vOPD's final KL against OPD's


@dataclass
class Summary:
    """What a real-teacher distillation study found (summary.json)."""

    study: str
    source: str  # which runs: the default grid run here, or a sweep folder
    results: str | None
    sweep: dict | None  # the sweep's name, base and grid
    runs: int
    seeds: list[int]
    estimators: list[str]
    vocab_sizes: list[int]
    student_accuracies: list[float]
    steps: int
    student_size: str
    teacher_size: str
    env: str
    settings: list[Setting]
    step_cost: dict[str, dict[str, Measured]]  # V -> estimator -> step time / OPD's
    helps: list[str]  # settings where vOPD's baseline lowers the variance
    not_helps: list[str]
    config: dict  # n_boot, ci


# ---- runs ----------------------------------------------------------------------------------------------------------

def run_grid(cfg: Config, progress=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(steps, runs) of the config's grid, shaped as ``lab.engine.sweep.load_results`` returns them."""
    steps, runs = [], []
    cells = cfg.cells()
    with bar(len(cells), "real distillation", progress, unit="run") as b:
        for cell in cells:
            res = distil(cell, progress=False)
            steps.append(res.table.assign(distractors=cell.distractors))
            runs.append({"estimator": cell.estimator, "distractors": cell.distractors,
                         "student_accuracy": cell.student_accuracy, "seed": cell.seed,
                         **{k: v for k, v in res.summary.items() if not isinstance(v, (dict, list))}})
            b.update(1)
    return pd.concat(steps, ignore_index=True), pd.DataFrame(runs)


def read_sweep(folder: str) -> tuple[pd.DataFrame, pd.DataFrame, dict]:
    """(steps, runs, sweep.json) of a finished distill sweep; LabError for another kind or other swept fields."""
    from lab.engine.sweep import load_results

    meta = json.loads((Path(folder) / "sweep.json").read_text())
    if meta.get("kind", "train") != "distill":
        raise LabError(f"{folder} holds a sweep of kind {meta.get('kind', 'train')!r}; give a distill sweep "
                       f"({SWEEP})")
    other = sorted(set(meta.get("grid") or {}) - SWEPT)
    if other:
        raise LabError(f"the sweep in {folder} also varies {', '.join(other)}; this study aggregates over estimator, "
                       f"distractors, student_accuracy and seed only")
    steps, runs = load_results(folder)
    if runs.empty:
        raise LabError(f"the sweep in {folder} has no finished cells yet; run it (rerunning resumes)")
    return steps, runs, meta


# ---- aggregation ---------------------------------------------------------------------------------------------------

class _Boot:
    """One bootstrap counts matrix per number of units, drawn in a fixed order (so the tables are deterministic)."""

    def __init__(self, n_boot: int, ci: float):
        self.n_boot, self.ci, self.rng, self.cache = n_boot, ci, np.random.default_rng(0), {}

    def counts(self, n: int) -> np.ndarray:
        if n not in self.cache:
            self.cache[n] = stats.bootstrap_counts(n, self.n_boot, self.rng)
        return self.cache[n]

    def mean(self, x) -> tuple[float, float, float]:
        x = np.asarray(x, dtype=np.float64)
        return stats.mean_interval(x, self.counts(len(x)), self.ci)

    def ratio(self, a, b) -> tuple[float, float, float]:
        """sum a / sum b over units, resampled jointly (paired units)."""
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        c = self.counts(len(a))
        with np.errstate(divide="ignore", invalid="ignore"):
            return (float(a.sum() / b.sum()), *stats.percentile_interval((c @ a) / (c @ b), self.ci))

    def ratio2(self, a, b) -> tuple[float, float, float]:
        """mean a / mean b for two independent samples, each resampled on its own."""
        a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
        ba, bb = self.counts(len(a)) @ a / len(a), self.counts(len(b)) @ b / len(b)
        return (float(a.mean() / b.mean()), *stats.percentile_interval(ba / bb, self.ci))


def _row(part, setting, estimator, metric, value, lo, hi, n, update=np.nan) -> dict:
    return {"part": part, "vocab_size": setting[0], "student_accuracy": setting[1], "estimator": estimator,
            "metric": metric, "update": float(update), "value": float(value), "lo": float(lo), "hi": float(hi),
            "n": int(n)}


def _with_start(steps: pd.DataFrame, runs: pd.DataFrame) -> pd.DataFrame:
    """The steps table with an update-0 row per run holding its starting values (accuracies, sequence KL)."""
    start = runs[[*RUN, *INITIAL.values()]].rename(columns={v: k for k, v in INITIAL.items()}).assign(update=0)
    return pd.concat([start, steps], ignore_index=True)


def curve_rows(steps: pd.DataFrame, runs: pd.DataFrame, boot: _Boot) -> list[dict]:
    rows = []
    table = _with_start(steps, runs)
    for metric in CURVES:
        d = table.dropna(subset=[metric])
        for (V, a, e, u), g in d.groupby([*SETTING, "estimator", "update"], sort=True):
            rows.append(_row("curve", (V, a), e, metric, *boot.mean(g[metric]), len(g), u))
    probes = steps.dropna(subset=["gvar"]) if "gvar" in steps else steps.iloc[:0]
    for col in sorted(c for c in probes if c.startswith("gvar_")):
        for (V, a, u), g in probes.groupby([*SETTING, "update"], sort=True):
            rows.append(_row("curve", (V, a), col[5:], "gvar", *boot.mean(g[col]), len(g), u))
    return rows


def final_rows(runs: pd.DataFrame, boot: _Boot) -> list[dict]:
    rows = []
    runs = runs.assign(kl_closed=1 - runs["final_kl_seq"] / runs["initial_kl_seq"])
    for (V, a), g in runs.groupby(list(SETTING), sort=True):
        opd = g[g["estimator"] == "opd"].set_index("seed")["final_kl_seq"]
        for e, ge in g.groupby("estimator", sort=False):
            for metric in ("final_kl_seq", "final_kl_seq_train", "kl_closed", "final_heldout_accuracy"):
                rows.append(_row("final", (V, a), e, metric, *boot.mean(ge[metric]), len(ge)))
            paired = (ge.set_index("seed")["final_kl_seq"] - opd).dropna()
            if e != "opd" and len(paired):
                rows.append(_row("final", (V, a), e, "kl_minus_opd", *boot.mean(paired), len(paired)))
    return rows


def variance_rows(steps: pd.DataFrame, boot: _Boot) -> list[dict]:
    """Var(OPD) / Var(e) pooled over every probe of the setting (units: runs), the predicted factor, the masses."""
    rows = []
    probes = steps.dropna(subset=["gvar"]) if "gvar" in steps else steps.iloc[:0]
    names = [c[5:] for c in probes if c.startswith("gvar_")]
    for (V, a), g in probes.groupby(list(SETTING), sort=True):
        per_run = g.groupby(["estimator", "seed"], sort=True).agg(
            **{f"s_{n}": (f"gvar_{n}", "sum") for n in names}, m2=("reward_m2", "sum"),
            within=("reward_var_within", "sum"), distractor=("distractor_mass", "mean"), topk=("topk_mass", "mean"),
            value_share=("value_share", "mean"), kl=("kl_token", "mean"), kl_topk=("kl_topk_token", "mean"),
            probes=("gvar", "size"))
        n = len(per_run)
        for e in names:
            rows.append(_row("variance", (V, a), e, "gvar", *boot.mean(per_run[f"s_{e}"] / per_run["probes"]), n))
            if "opd" in names and e != "opd":
                rows.append(_row("variance", (V, a), e, "var_reduction", *boot.ratio(per_run["s_opd"],
                                                                                     per_run[f"s_{e}"]), n))
            if "kl_full" in names and e != "kl_full":
                rows.append(_row("variance", (V, a), e, "var_vs_kl_full", *boot.ratio(per_run[f"s_{e}"],
                                                                                      per_run["s_kl_full"]), n))
        rows.append(_row("variance", (V, a), "-", "pred_reduction", *boot.ratio(per_run["m2"], per_run["within"]),
                         n))
        for metric, col in (("value_share", "value_share"), ("distractor_mass", "distractor"), ("topk_mass", "topk"),
                            ("kl_token", "kl"), ("kl_topk_token", "kl_topk")):
            rows.append(_row("variance", (V, a), "-", metric, *boot.mean(per_run[col]), n))
    return rows


def cost_rows(steps: pd.DataFrame, boot: _Boot) -> list[dict]:
    """Median step and update time per run, as ratios to vanilla OPD's runs at the same V (all gaps pooled)."""
    rows = []
    per_run = steps.groupby([*RUN], sort=True)[["step_s", "update_s"]].median().reset_index()
    for V, g in per_run.groupby("vocab_size", sort=True):
        opd = g[g["estimator"] == "opd"]
        for e, ge in g.groupby("estimator", sort=False):
            for col in ("step_s", "update_s"):
                rows.append(_row("cost", (V, np.nan), e, col, *boot.mean(ge[col]), len(ge)))
                if e != "opd" and len(opd):
                    rows.append(_row("cost", (V, np.nan), e, f"{col[:-2]}_ratio", *boot.ratio2(ge[col], opd[col]),
                                     len(ge)))
    return rows


def aggregate(steps: pd.DataFrame, runs: pd.DataFrame, n_boot: int = 2000, ci: float = 0.95) -> pd.DataFrame:
    """The tidy results table (see the module doc) of a set of distillation runs."""
    boot = _Boot(n_boot, ci)
    rows = curve_rows(steps, runs, boot) + final_rows(runs, boot) + variance_rows(steps, boot) + cost_rows(steps,
                                                                                                          boot)
    return pd.DataFrame(rows)


# ---- summary -------------------------------------------------------------------------------------------------------

def pick(results: pd.DataFrame, part: str, metric: str, estimator: str = "-", V=None, a=None) -> dict:
    """{value, lo, hi, n} of one aggregate row ({} when absent); V / a select the setting."""
    r = results[(results["part"] == part) & (results["metric"] == metric) & (results["estimator"] == estimator)]
    if V is not None:
        r = r[r["vocab_size"] == V]
    if a is not None:
        r = r[r["student_accuracy"] == a]
    if r.empty:
        return {}
    r = r.iloc[0]
    return {"value": float(r["value"]), "lo": float(r["lo"]), "hi": float(r["hi"]), "n": int(r["n"])}


def verdict(r: dict) -> str:
    """helps / hurts / unresolved for a ratio above 1 = better, from its interval."""
    if not r:
        return "unmeasured"
    return "helps" if r["lo"] > 1 else "hurts" if r["hi"] < 1 else "unresolved"


def measured(r: dict) -> Measured | None:
    """A ``pick`` as a Measured (None when absent)."""
    return Measured(r["value"], r["lo"], r["hi"], r["n"]) if r else None


def setting_summary(results: pd.DataFrame, runs: pd.DataFrame, V, a) -> Setting:
    g = runs[(runs["vocab_size"] == V) & (runs["student_accuracy"] == a)]
    probed = sorted(set(results.loc[(results["metric"] == "var_reduction"), "estimator"]))
    trained = list(pd.unique(g["estimator"]))

    def each(part, metric, names):
        return {e: measured(pick(results, part, metric, e, V, a)) for e in names}

    red = each("variance", "var_reduction", probed)
    diff = each("final", "kl_minus_opd", [e for e in trained if e != "opd"])
    d = diff.get("vopd")
    masses = {m: pick(results, "variance", m, "-", V, a).get("value", float("nan"))
              for m in ("value_share", "distractor_mass", "topk_mass", "kl_token", "kl_topk_token")}
    return Setting(
        vocab_size=int(V), student_accuracy=float(a), initial_accuracy=float(g["initial_accuracy"].mean()),
        initial_kl_seq=float(g["initial_kl_seq"].mean()), teacher_accuracy=float(g["teacher_accuracy"].mean()),
        var_reduction=red, var_vs_kl_full=each("variance", "var_vs_kl_full", [e for e in ["opd", *probed]
                                                                              if e != "kl_full"]),
        pred_reduction=measured(pick(results, "variance", "pred_reduction", "-", V, a)),
        final_kl_seq=each("final", "final_kl_seq", trained), kl_closed=each("final", "kl_closed", trained),
        kl_minus_opd=diff, **masses, verdict=verdict(pick(results, "variance", "var_reduction", "vopd", V, a)),
        training_verdict=("unmeasured" if d is None else "lower final KL" if d.hi < 0 else
                          "higher final KL" if d.lo > 0 else "no detectable difference"))


def summarise(results: pd.DataFrame, runs: pd.DataFrame, source: str, cfg: Config, meta: dict | None) -> Summary:
    """summary.json: every number the report's text prints."""
    settings = [setting_summary(results, runs, V, a) for (V, a), _ in runs.groupby(list(SETTING), sort=True)]
    cost = {}
    for V in sorted(runs["vocab_size"].unique()):
        picked = {e: measured(pick(results, "cost", "step_ratio", e, V)) for e in pd.unique(runs["estimator"])
                  if e != "opd"}
        cost[str(int(V))] = {e: r for e, r in picked.items() if r}
    return Summary(
        study="real_distillation", source=source, results=cfg.results,
        sweep=None if meta is None else {"name": meta.get("name"), "base": meta.get("base"), "grid": meta.get("grid")},
        runs=int(len(runs)), seeds=sorted(int(s) for s in runs["seed"].unique()),
        estimators=list(pd.unique(runs["estimator"])), vocab_sizes=sorted(int(v) for v in runs["vocab_size"].unique()),
        student_accuracies=sorted(float(a) for a in runs["student_accuracy"].unique()),
        steps=int(runs["updates"].max()), student_size=str(runs["student_size"].iloc[0]),
        teacher_size=str(runs["teacher_size"].iloc[0]), env=str(runs["env"].iloc[0]), settings=settings,
        step_cost=cost, helps=[_key(s) for s in settings if s.verdict == "helps"],
        not_helps=[_key(s) for s in settings if s.verdict != "helps"],
        config={k: getattr(cfg, k) for k in ("n_boot", "ci")})


def _key(s: Setting) -> str:
    return f"V={s.vocab_size}, student accuracy {s.student_accuracy:g}"


def run(cfg: Config, progress: bool | None = None) -> StudyResult:
    """(tidy aggregates, summary) of the default grid run here, or of the sweep folder ``cfg.results``."""
    cfg.validate()
    if cfg.results is None:
        steps, runs = run_grid(cfg, progress)
        meta, source = None, "the small default grid of lab.studies.real_distillation.study.Config, run in this report"
    else:
        steps, runs, meta = read_sweep(cfg.results)
        source = f"the sweep results folder {cfg.results} ({len(runs)} finished runs)"
    for frame in (steps, runs):  # settings keyed by V (from the table) and the gap
        if "vocab_size" not in frame:
            frame["vocab_size"] = DIGITS + frame["distractors"]
    results = aggregate(steps, runs, cfg.n_boot, cfg.ci)
    return StudyResult(results, asdict(summarise(results, runs, source, cfg, meta)))
