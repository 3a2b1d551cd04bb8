"""The rollout_diagnostics study: importance-weight diagnostics of one rollout log, through ``lab.diagnose`` (the
library of the `lab diagnose` command; this study only chooses the log and its options).

The log is a training run's own (``log_path``): a neutral rollout log (docs/rollout-logs.md) or a framework dump
that ``lab.diagnose.adapters`` converts (``log_format``, one of its registry ``ADAPTERS``), or, without one, a
simulated asynchronous run (``lab.diagnose.synthetic.simulate``: a bigram policy sampled from logits rounded to
``simulate_sampler_dtype`` at a lag of up to ``simulate_lag_max`` versions, scored by a float32 trainer). One
streaming pass (``lab.diagnose.diagnose``) gives every table, the summary and the verdict: sampler/trainer and
policy-version log-ratios by token probability and length, ESS and PSIS k-hat per step, staleness, and what each
correction would clip or mask. Results: ``lab.diagnose``'s tidy table (section, keys, metric, value, lo, hi).
"""
from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from lab.configs import SEED_MAX, check_types
from lab.diagnose import Diagnostics, RolloutLog, diagnose
from lab.diagnose.adapters import ADAPTERS, adapter
from lab.diagnose.cli import TABLES, plain
from lab.diagnose.corrections import resolve
from lab.diagnose.schema import check_meta
from lab.diagnose.streaming import CHUNK_ROWS, CHUNK_ROWS_MAX, PAIRS, pairs_of
from lab.errors import LabError
from lab.studies import StudyResult
from lab.typed import build, knob

SIMULATED = ("log_path", None)  # the simulated run's settings apply only without a log
PICKLES = ("log_format", "slime", "skyrl")  # the adapters that read pickles
SIMULATION_MEMORY = 4 * 2**30  # bytes: the simulated run's logit tables and one step's [B, T, V] arrays
SIMULATION_TOKENS = 100_000_000  # the simulated log's expected tokens (about 3 GB on disk, minutes to diagnose)


@dataclass
class Config:
    """The log to diagnose and how. ``Config()`` simulates a run and diagnoses it in seconds."""

    log_path: str | None = None
    """a neutral rollout log folder, or a framework dump (see log_format); none: simulate a run"""
    log_format: Literal[tuple(ADAPTERS)] = "lab"
    """what log_path holds: lab (a neutral rollout log) or a framework dump converted on the fly (lab.diagnose.adapters;
    `lab diagnose --help` says what each reads)"""
    trust_pickle: bool = knob(False, only=PICKLES)
    """slime/SkyRL pickles: load without the restricted unpickler (runs code from the file: trusted files only)"""
    nan: Literal["error", "drop"] = "error"
    """missing or NaN log-probs on loss-masked tokens: stop, or leave their sequences out (counted in the report)"""
    pair: Literal[("natural", *PAIRS)] = "natural"
    """the log-ratio every correction sees: natural (each its own: TIS and the masks trainer/sampler, the clip family
    current/old, VESPO current/sampler) or one for all"""
    hyper: dict[str, dict] = knob({}, parse="estimator_pairs")
    """a correction's hyper-parameters over its defaults, e.g. tis_token.cap=3"""
    temperature: float | None = knob(None, gt=0, le=1000)
    """the sampler's temperature, for a log that lacks it (none: the log's)"""
    top_p: float | None = knob(None, gt=0, le=1)
    """the sampler's top-p, for a log that lacks it (none: the log's)"""
    top_k: int | None = knob(None, ge=-1, le=10_000_000)
    """the sampler's top-k, for a log that lacks it (0 or -1: no top-k; none: the log's)"""
    chunk_rows: int = knob(CHUNK_ROWS, ge=1, le=CHUNK_ROWS_MAX)
    """token rows per streamed chunk (memory stays flat in the log's length)"""
    seed: int = knob(0, ge=0, le=SEED_MAX)
    """seed of the bootstrap intervals"""
    simulate_steps: int = knob(16, ge=1, le=100_000, only=SIMULATED)
    """simulated run: training steps (one batch each)"""
    simulate_batch: int = knob(64, ge=1, le=1_000_000, only=SIMULATED)
    """simulated run: responses per step (a multiple of simulate_group_size)"""
    simulate_group_size: int = knob(8, ge=1, le=4096, only=SIMULATED)
    """simulated run: responses per prompt (a group shares its prompt and its policy version)"""
    simulate_vocab: int = knob(128, ge=2, le=65_536, only=SIMULATED)
    """simulated run: vocabulary size of the bigram policy"""
    simulate_mean_len: int = knob(128, ge=1, le=100_000, only=SIMULATED)
    """simulated run: mean response length in tokens (log-normal lengths between 2 and 4x this)"""
    simulate_lag_max: int = knob(4, ge=0, le=100_000, only=SIMULATED)
    """simulated run: largest version lag of a group's sampler behind the trainer (uniform on 0..lag_max)"""
    simulate_drift: float = knob(0.06, ge=0, le=100, only=SIMULATED)
    """simulated run: std of the logits' change per policy version (the policy update)"""
    simulate_sampler_dtype: Literal["bfloat16", "float16", "float32"] = knob("bfloat16", only=SIMULATED)
    """simulated run: the sampler's logit precision (the trainer's is float32)"""
    simulate_seed: int = knob(0, ge=0, le=SEED_MAX, only=SIMULATED)
    """simulated run: seed of the simulated policy, prompts and samples"""

    def sampling(self) -> dict:
        """The sampler settings given here, over the log's own."""
        return {k: getattr(self, k) for k in ("temperature", "top_p", "top_k") if getattr(self, k) is not None}

    def simulate(self) -> dict:
        """The keyword arguments of ``lab.diagnose.synthetic.simulate``."""
        return {k: getattr(self, f"simulate_{k}") for k in ("steps", "batch", "group_size", "vocab", "mean_len",
                                                               "lag_max", "drift", "sampler_dtype", "seed")}

    def validate(self) -> None:
        check_types(self)
        if self.log_path is None:
            if self.log_format != "lab" or self.sampling():
                raise LabError("log_format, temperature, top_p and top_k describe a given log; without log_path the "
                               "report simulates a run (temperature 1, no truncation)")
            self._validate_simulation()
            available = pairs_of(("sampler_logp", "old_logp", "current_logp"))
        else:
            if not Path(self.log_path).exists():
                raise LabError(f"log_path {self.log_path}: no such file or folder")
            if self.log_format == "lab":
                log = RolloutLog(self.log_path)
                check_meta({**log.meta, "sampling": {**log.meta["sampling"], **self.sampling()}},
                           log.path / "meta.json")
                available = pairs_of(log.logp_columns)
            else:
                available = pairs_of([c for c, d in adapter(self.log_format).logp.items() if d is not None])
        resolve(available, pair=self.pair, hyper=self.hyper)  # corrections, their hyper-parameters, the pair

    def _validate_simulation(self) -> None:
        """The simulated run's shape, and its size bounded before any work: its logit tables (one V x V table per
        policy version) and one step's [B, T, V] arrays (T up to 4x the mean length) within SIMULATION_MEMORY, its
        expected tokens within SIMULATION_TOKENS."""
        B, G, V, L = self.simulate_batch, self.simulate_group_size, self.simulate_vocab, self.simulate_mean_len
        if B % G:
            raise LabError(f"simulate_batch {B} must be a multiple of simulate_group_size {G}")
        need = 4 * (self.simulate_steps + 2) * V * V + 4 * 4 * B * 4 * L * V
        if need > SIMULATION_MEMORY:
            raise LabError(f"the simulated run needs about {need / 2**30:.1f} GiB (budget "
                           f"{SIMULATION_MEMORY / 2**30:.0f} GiB): lower simulate_vocab, simulate_batch, "
                           f"simulate_mean_len or simulate_steps")
        if self.simulate_steps * B * L > SIMULATION_TOKENS:
            raise LabError(f"the simulated run would hold about {self.simulate_steps * B * L:,} tokens (at most "
                           f"{SIMULATION_TOKENS:,}); lower simulate_steps, simulate_batch or simulate_mean_len")


SMOKE = {"simulate_steps": 3, "simulate_batch": 32, "simulate_vocab": 32, "simulate_mean_len": 20,
         "simulate_lag_max": 2, "simulate_drift": 0.05}  # seconds: what the tests build


@dataclass
class PairOverall:
    """One log-ratio over the whole log: pooled token statistics of Δ (quantiles p01..p99, |Δ| quantiles, k3 KL
    per token), the medians over steps of the Kish ESS fraction and of the share of sequences holding half the
    weight (with intervals), PSIS k-hat warnings (> 0.7), and the sequence log-weight log W of usable sequences."""

    pair: str
    n_tok: float
    mean: float
    mean_abs: float
    std: float
    k3_token: float
    max_abs: float
    abs_p50: float
    abs_p99: float
    neg_share: float
    p01: float
    p05: float
    p50: float
    p95: float
    p99: float
    mean_abs_lo: float
    mean_abs_hi: float
    n_seq: int
    n_steps: int
    ess_median: float
    ess_lo: float
    ess_hi: float
    dominant_median: float
    dominant_lo: float
    dominant_hi: float
    khat_steps: int
    khat_warning_steps: int
    khat_median: float
    logw_mean: float
    logw_sd: float
    w_median: float
    w_mean: float
    median_len: float


@dataclass
class LowProb:
    """Tokens with p < 0.1: their share, their share of the |Δ| mass [lo, hi], mean |Δ| on them and on p > 0.9."""

    token_share: float
    abs_mass_share: float
    lo: float
    hi: float
    mean_abs_low: float
    mean_abs_high: float


@dataclass
class Growth:
    """OLS slopes on the response length: the drift of log W per token and the growth of Var(log W) per token."""

    drift_per_token: float
    drift_lo: float
    drift_hi: float
    var_per_token: float
    var_lo: float
    var_hi: float
    n_seq: int


@dataclass
class Staleness:
    """Version lag (trainer version minus the sequence's oldest version), over sequences whose versions are known."""

    n_seq: int
    stale_share: float
    mean_lag: float
    max_lag: int
    negative_lags: int
    spanning_versions: int
    pair: str


@dataclass
class CorrectionEffect:
    """What one correction does at its defaults: shares of tokens and sequences changed or zeroed, and the share of
    |A|-weighted gradient weight it removes and adds [lo, hi] (lab.diagnose.corrections)."""

    label: str
    level: str  # token | sequence | geometric
    pair: str
    hyper: str
    tokens_changed: float
    tokens_zeroed: float
    sequences_changed: float
    sequences_zeroed: float | None  # NaN (null in JSON) for a token-level correction
    removed: float
    removed_lo: float
    removed_hi: float
    added: float
    added_lo: float
    added_hi: float


@dataclass
class KeptSets:
    """The sampler's recorded kept sets: the share of tokens with one, their mean size, singleton sets and the mean
    log-prob of each column on them (0 when renormalised), and the truncation statistic on those tokens (detected:
    the trainer's log-probs are not renormalised over the sets)."""

    share: float
    mean_size: float
    singletons: int
    singleton_mean_sampler_logp: float  # NaN without singletons or without the column
    singleton_mean_old_logp: float
    singleton_mean_current_logp: float
    n_tok: float
    mean_ratio: float
    mean_ratio_lo: float
    mean_ratio_hi: float
    below_one: float
    detected: bool


@dataclass
class Truncation:
    """Sampler truncation (lab.diagnose.truncation): the mean trainer/sampler token ratio [lo, hi] (1 without
    truncation, the kept mass with it), the share of tokens with ratio below 1 [lo, hi], whether the rule fires,
    what the log declares, and the kept sets when it records them."""

    pair: str
    detected: bool
    n_tok: float
    mean_ratio: float
    mean_ratio_lo: float
    mean_ratio_hi: float
    below_one: float
    below_one_lo: float
    below_one_hi: float
    declared: bool
    top_p: float | None
    top_k: int | None
    kept_sets: KeptSets | None


@dataclass
class Sampling:
    temperature: float | None
    top_p: float | None
    top_k: int | None


@dataclass
class NanCounts:
    mode: str  # error | drop
    tokens: dict[str, int]  # per log-prob column
    sequences: int


@dataclass
class Summary:
    """What the diagnostics found (summary.json): ``lab.diagnose``'s summary as it writes it, per log-ratio pair
    (``pairs``: mismatch = trainer old / sampler, update = current / trainer old, total = current / sampler)."""

    overall: dict[str, PairOverall]
    low_prob: dict[str, LowProb]
    growth: dict[str, Growth]
    staleness: Staleness | None  # None: the log has no versions
    corrections: dict[str, CorrectionEffect]
    study: str
    source: str
    logp: dict[str, str | None]  # what each log-prob column holds (None: absent)
    sampling: Sampling
    pairs: list[str]
    pair_text: dict[str, str]
    n_token_rows: int
    n_loss_tokens: int
    n_tokens_used: int
    n_sequences: int
    n_steps: int
    advantages: list[str]
    nan: NanCounts
    truncated_sampling: bool
    notes: list[str]
    verdict: list[str]  # lab.diagnose.verdict's sentences, in order
    headline: str  # the verdict's first sentence
    truncation: Truncation | None = None  # None: the log has no sampler log-probs (or predates the statistic)


def diagnostics(cfg: Config, progress: bool | None = None) -> Diagnostics:
    """Every table, the summary and the verdict of the configured log (converted or simulated in a temporary folder,
    removed afterwards)."""
    cfg.validate()
    from lab.diagnose.adapters import convert
    from lab.diagnose.synthetic import simulate

    with tempfile.TemporaryDirectory(prefix="rollout-diagnostics-") as work:
        if cfg.log_path is None:
            log = RolloutLog(simulate(Path(work) / "log", **cfg.simulate()))
        elif cfg.log_format == "lab":
            log = RolloutLog(cfg.log_path)
            log.meta["sampling"].update(cfg.sampling())
        else:
            log = RolloutLog(convert(cfg.log_format, cfg.log_path, Path(work) / "log", trust=cfg.trust_pickle,
                                     sampling=cfg.sampling()))
        return diagnose(log, nan=cfg.nan, pair=cfg.pair, hyper=cfg.hyper, chunk_rows=cfg.chunk_rows,
                        progress=progress, seed=cfg.seed)


def result(diag: Diagnostics) -> StudyResult:
    """(the tidy results table, the summary) of a diagnosis."""
    return StudyResult(diag.tables["results"], asdict(build(Summary, plain(diag.summary))))


def table_files(diag: Diagnostics) -> dict:
    """The run folder's per-table files beside results.parquet, as ``lab.runs.write_run``'s ``extra``."""
    return {f"{name}.parquet": (lambda p, df=diag.tables[name]: df.to_parquet(p, index=False))
            for name in TABLES if name in diag.tables}


def run(cfg: Config, progress: bool | None = None) -> StudyResult:
    """(tidy results, summary) of the configured log's diagnostics; deterministic given the log and ``cfg.seed``."""
    return result(diagnostics(cfg, progress))
