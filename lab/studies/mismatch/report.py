"""What the mismatch report decides, from the study's Summary alone, placed beside the figures practitioners report
(``measure.PRACTITIONERS``, carried in the summary); the sentences are in templates/, the figures in figures.py.
Δ = log p_sampler − log p_trainer of a sampled token; log w = Σ_t Δ_t is the sequence log-weight."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from lab.reports.style import interval, table
from lab.reports.templates import render
from lab.studies.mismatch.study import Summary
from lab.typed import build

HERE = Path(__file__).parent
LINEAR_EXPONENT = 0.85  # a growth exponent whose interval lies above this: the deltas add up linearly
MASS_TOLERANCE = 0.01  # |mean ratio - mean kept mass| within this: the ratio is the kept mass (dtype rounding aside)
MEAN_TOLERANCE = 0.02  # a measured mean ratio within this of a published one reproduces it
SHARE_TOLERANCE = 0.05  # likewise for a share of tokens outside [0.9, 1.1]


def summary_of(data: dict | Summary) -> Summary:
    return data if isinstance(data, Summary) else build(Summary, data)


# ---- reading the summary (summary.json stores NaN as null) --------------------------------------------------------
def _num(x) -> float:
    return math.nan if x is None else float(x)


def value(entry: dict, metric: str) -> float:
    """A metric's point value, NaN where missing."""
    return _num(entry.get(metric, [math.nan])[0])


def triple(entry: dict, metric: str) -> list[float]:
    """[value, lo, hi] of a metric, NaN where missing."""
    return [_num(x) for x in entry.get(metric, [None] * 3)]


def shown(entry: dict, metric: str, fmt: str = "{:.3g}") -> str:
    """A metric with its interval ("n/a" when missing; the point alone when the interval is not finite)."""
    v = triple(entry, metric)
    if not math.isfinite(v[0]):
        return "n/a"
    if not all(math.isfinite(x) for x in v[1:]):
        return fmt.format(v[0])
    return interval(*v, fmt)


def bf16_setting(info: dict) -> str | None:
    """The main bf16 setting of a model: bf16 with the KV cache if measured, else the first bf16 setting."""
    names = list(info["settings"])
    return next((n for n in ("bf16+kv", *[n for n in names if n.startswith("bf16")]) if n in info["settings"]), None)


def pretrained(s: Summary) -> tuple[str, dict] | tuple[None, None]:
    return next(((n, i) for n, i in s.models.items() if i["kind"] == "pretrained"), (None, None))


def moe_model(s: Summary) -> tuple[str, dict] | tuple[None, None]:
    return next(((n, i) for n, i in s.models.items() if i.get("moe")), (None, None))


def target(s: Summary) -> tuple[str, dict]:
    """The model the report's per-sequence findings are about: the pretrained LM, else the first model."""
    name, info = pretrained(s)
    return (name, info) if info is not None else next(iter(s.models.items()))


# ---- decisions ------------------------------------------------------------------------------------------------------
@dataclass
class PerToken:
    """One model's mean |Δ| in its bf16 setting against the practitioners' per-token range."""

    model: str
    kind: str  # in-lab | pretrained
    setting: str
    abs_mean: list[float]  # [value, lo, hi]
    where: str  # inside | below | above the range
    sure_share: float  # share of its sampled tokens with p > 0.9


@dataclass
class Growth:
    """How the sequence log-weight grows with length, against the rule |Δ| × length."""

    model: str
    setting: str
    ref_length: float  # n
    linear: float  # mean |Δ| × n
    measured: float  # mean |log w| after n tokens
    verdict: str  # flat | linear | cancel (Σ (log w)² / Σ Δ² below 1) | drift (above 1) | independent (about 1)

    @property
    def overstated(self) -> float:
        """How many times |Δ| × n exceeds the measured |log w|."""
        return self.linear / self.measured


@dataclass
class LowProb:
    """Tokens the trainer gives p < 0.1: mean |Δ| on them over that on p > 0.9 tokens, and their shares."""

    model: str
    setting: str
    ratio: list[float]  # [value, lo, hi]
    token_share: float  # of the sampled tokens
    abs_share: float  # of the total |Δ|

    @property
    def holds(self) -> bool:
        """The ratio's interval lies above 1: low-probability tokens carry larger deltas, per token."""
        return self.ratio[1] > 1


@dataclass
class Head32:
    """The pretrained LM with an fp32 output head: probability correlation and mean |Δ|, bf16 head -> fp32 head."""

    model: str
    corr: tuple[float, float]
    abs_mean: tuple[float, float]


@dataclass
class Routing:
    """A mixture of experts in bf16: routing decisions that differ, and what replaying the sampler's routes removes."""

    model: str
    setting: str
    disagreement: list[float]  # [value, lo, hi]
    reduction: list[float]  # 1 - KL_replay / KL_free, [value, lo, hi]
    abs_mean: tuple[float, float]  # free routing, replayed
    few_flips: bool  # below a third of the practitioners' share
    little_removed: bool  # below half of R3's reduction


@dataclass
class KvCache:
    """One model's mean |Δ| with the cache in fp32 and in bf16, and in bf16 recomputing every step (if measured)."""

    model: str
    fp32_kv: float
    bf16_kv: float
    bf16: float | None


@dataclass
class Acting:
    """How often the usual corrections act on the target model's tokens in its bf16 setting."""

    model: str
    setting: str
    tis_truncated: float
    icepop_masked: float
    seq_mis_masked: float


@dataclass
class Truncated:
    """One truncating sampler of the pretrained LM against the trainer, beside the published figures for it.

    ``is_mass``: the mean ratio equals the mean kept mass within MASS_TOLERANCE; ``renorm_fixes``: renormalising
    over the kept set brings the mean ratio within MASS_TOLERANCE of 1 and shrinks the share outside [0.9, 1.1];
    ``published`` {metric: (published, measured, reproduced)} for the metrics published for this truncation;
    ``verdict``: reproduced (every published figure within MEAN_TOLERANCE / SHARE_TOLERANCE), explained (not, but
    the ratio is the kept mass and renormalising fixes it: the figures differ by the model's kept mass, i.e. its
    next-token entropy), unexplained (otherwise), or unpublished (nothing published for this truncation)."""

    model: str
    setting: str
    truncation: str
    ratio_mean: float
    ratio_outside: float
    kept_mass: float
    renorm_mean: float
    renorm_outside: float
    entropy: float  # the trainer's mean next-token entropy, nats
    is_mass: bool
    renorm_fixes: bool
    published: dict
    verdict: str


@dataclass
class Decisions:
    per_token: list[PerToken]
    growth: Growth | None
    low_prob: LowProb | None
    head32: Head32 | None
    routing: Routing | None
    kv_cache: list[KvCache]
    acting: Acting | None
    truncation: list[Truncated]


def where(x: float, lo: float, hi: float) -> str:
    return "inside" if lo <= x <= hi else "below" if x < lo else "above"


def per_token(s: Summary) -> list[PerToken]:
    lo, hi = s.practitioners["abs_delta_range"]["value"]
    out = []
    for name, info in s.models.items():
        setting = bf16_setting(info)
        if setting is None:
            continue
        e = info["settings"][setting]
        a = triple(e, "abs_mean")
        out.append(PerToken(name, info["kind"], setting, a, where(a[0], lo, hi), value(e, "token_share[p>0.9]")))
    return out


def growth_verdict(e: dict) -> str:
    """flat when |log w| does not grow; linear when the growth exponent's lower bound exceeds 0.85; else how the
    deltas of a response correlate, from seq_var_ratio = Σ_n (log w_n)² / Σ_n Σ_t Δ²_nt (1: uncorrelated)."""
    if not value(e, "abs_L_ref") > 0:
        return "flat"
    if triple(e, "growth_exponent")[1] > LINEAR_EXPONENT:
        return "linear"
    vr = triple(e, "seq_var_ratio")
    return "cancel" if vr[2] < 1 else "drift" if vr[1] > 1 else "independent"


def decide(summary: dict | Summary) -> Decisions:
    s = summary_of(summary)
    t_name, t_info = target(s)
    t_set = bf16_setting(t_info)
    e = t_info["settings"][t_set] if t_set else None
    growth = low = head = acting = None
    if e is not None:
        growth = Growth(t_name, t_set, value(e, "ref_length"), value(e, "linear_prediction_ref"),
                        value(e, "abs_L_ref"), growth_verdict(e))
        low = LowProb(t_name, t_set, triple(e, "low_high_ratio"), value(e, "token_share[p<0.1]"),
                      value(e, "abs_share[p<0.1]"))
        st = t_info["settings"]
        if "bf16+kv+head32" in st and "bf16+kv" in st:
            b, h = st["bf16+kv"], st["bf16+kv+head32"]
            head = Head32(t_name, (value(b, "prob_corr"), value(h, "prob_corr")),
                          (value(b, "abs_mean"), value(h, "abs_mean")))
        acting = Acting(t_name, t_set, value(e, "tis_truncated"), value(e, "icepop_masked"),
                        value(e, "seq_mis_masked"))
    return Decisions(per_token(s), growth, low, head, routing(s), kv_cache(s), acting, truncation(s))


def truncation(s: Summary) -> list[Truncated]:
    """Every truncating sampler of the pretrained LM (``info["truncation"]``), decided as ``Truncated`` says."""
    name, info = pretrained(s)
    if info is None or "truncation" not in info:
        return []
    ref = s.practitioners.get("truncation", {}).get("value", {})
    out = []
    for setting, by in info["truncation"]["settings"].items():
        for trunc, e in by.items():
            v = {k: value(e, k) for k in ("ratio_mean", "ratio_outside", "kept_mass", "renorm_mean", "renorm_outside")}
            is_mass = abs(value(e, "ratio_minus_mass")) <= MASS_TOLERANCE
            fixes = abs(v["renorm_mean"] - 1) <= MASS_TOLERANCE and v["renorm_outside"] <= v["ratio_outside"]
            published = {k: (p, v[k], abs(p - v[k]) <= (SHARE_TOLERANCE if k.endswith("outside") else MEAN_TOLERANCE))
                         for k, p in ref.get(trunc, {}).items()}
            verdict = ("unpublished" if not published else "reproduced" if all(r for *_, r in published.values())
                       else "explained" if is_mass and fixes else "unexplained")
            out.append(Truncated(name, setting, trunc, *v.values(), value(e, "entropy"), is_mass, fixes, published,
                                 verdict))
    return out


def routing(s: Summary) -> Routing | None:
    name, info = moe_model(s)
    setting = bf16_setting(info) if info is not None else None
    if not setting:
        return None
    m = info["settings"][setting]
    ref = s.practitioners
    red = triple(m, "replay_kl_reduction")
    disagreement = triple(m, "route_disagreement")
    return Routing(name, setting, disagreement, red, (value(m, "abs_mean"), value(m, "abs_mean_replay")),
                   disagreement[0] < ref["moe_route_disagreement"]["value"] / 3,
                   red[0] < ref["replay_kl_reduction"]["value"] / 2)


def kv_cache(s: Summary) -> list[KvCache]:
    out = []
    for name, info in s.models.items():
        st = info["settings"]
        if "fp32+kv" in st and "bf16+kv" in st:
            out.append(KvCache(name, value(st["fp32+kv"], "abs_mean"), value(st["bf16+kv"], "abs_mean"),
                               value(st["bf16"], "abs_mean") if "bf16" in st else None))
    return out


# ---- text -----------------------------------------------------------------------------------------------------------
def headline(name: str, summary: dict) -> str:
    """One line for the gallery: the pretrained LM's bf16 mismatch per token and per sequence (else the first
    model's), and the MoE's routing."""
    s = summary_of(summary)
    model, info = target(s)
    setting = bf16_setting(info) or next(iter(info["settings"]))
    e = info["settings"][setting]
    text = (f"{model} {setting}: mean |Δlog p| {value(e, 'abs_mean'):.3g}/token (p99 {value(e, 'abs_q99'):.2g}), "
            f"{value(e, 'low_high_ratio'):.2g}x larger on p<0.1 than p>0.9 tokens; |log w| "
            f"{value(e, 'abs_L_ref'):.2g} after {value(e, 'ref_length'):.0f} tokens vs "
            f"{value(e, 'linear_prediction_ref'):.2g} if it added up linearly")
    r = routing(s)
    if r is not None:
        text += f"; {r.model}: {r.disagreement[0]:.2%} of routes differ, replay cuts KL by {r.reduction[0]:.0%}"
    return text


def _rows(s: Summary) -> list[dict]:
    """The answer's table: per model and sampler setting, the per-token numbers."""
    return [{"model": name, "setting": setting, "abs_mean": shown(e, "abs_mean"), "q50": value(e, "abs_q50"),
             "q99": value(e, "abs_q99"), "max": value(e, "abs_max"), "ratio": shown(e, "low_high_ratio", "{:.2g}"),
             "kl": value(e, "kl_k3"), "corr": value(e, "prob_corr")}
            for name, info in s.models.items() for setting, e in info["settings"].items()]


def answer(summary: dict) -> str:
    """Markdown: how large the train/inference mismatch is, per token and per sequence, beside practitioners'
    figures, with the places where the lab's measurement differs said plainly."""
    s = summary_of(summary)
    d = decide(s)
    first = {n: next(iter(i["settings"].values())) for n, i in s.models.items()}
    settings_of = {n: i["settings"] for n, i in s.models.items()}
    return render(HERE, "answer.md", s=s, d=d, rows=_rows(s), first=first, settings_of=settings_of,
                  ref=s.practitioners, value=value, shown=shown)


def truncation_table(summary: dict):
    """The pretrained LM's truncating samplers: ratio, share outside [0.9, 1.1] and kept mass, then the same after
    renormalising over the kept set, with intervals, and the published figures beside them (None when none ran)."""
    s = summary_of(summary)
    name, info = pretrained(s)
    if info is None or "truncation" not in info:
        return None
    ref = s.practitioners.get("truncation", {}).get("value", {})
    rows = []
    for setting, by in info["truncation"]["settings"].items():
        for trunc, e in by.items():
            pub = ref.get(trunc, {})
            rows.append({"sampler": setting, "truncation": trunc, "mean ratio": shown(e, "ratio_mean", "{:.3f}"),
                         "outside [0.9, 1.1]": shown(e, "ratio_outside", "{:.1%}"),
                         "kept mass π(S)": shown(e, "kept_mass", "{:.3f}"),
                         "renormalised: mean": shown(e, "renorm_mean", "{:.3f}"),
                         "renormalised: outside": shown(e, "renorm_outside", "{:.1%}"),
                         "mean |S|": f"{value(e, 'kept_size'):.3g}", "entropy (nats)": f"{value(e, 'entropy'):.2f}",
                         "published (mean, outside → renormalised)": _published(pub)})
    return table(pd.DataFrame(rows), f"{name}, truncating samplers against the fp32 full-sequence trainer "
                                     f"({info['truncation']['sequences']} responses of up to "
                                     f"{info['truncation']['length']} tokens): ratio π/q per token. Published: "
                                     f"{s.practitioners['truncation']['source']}, Qwen2.5-1.5B. [95% bootstrap "
                                     f"interval over sequences]", text=("published (mean, outside → renormalised)",))


def _published(pub: dict) -> str:
    if not pub:
        return "–"
    left = ", ".join(f"{pub[k]:.3f}" if k.endswith("mean") else f"{pub[k]:.1%}" for k in ("ratio_mean", "ratio_outside")
                     if k in pub)
    right = ", ".join(f"{pub[k]:.3f}" if k.endswith("mean") else f"{pub[k]:.1%}"
                      for k in ("renorm_mean", "renorm_outside") if k in pub)
    return f"{left} → {right}"


class Tables:
    """Several styled tables shown one after the other (a notebook output, or ``to_html()``)."""

    def __init__(self, *tables):
        self.tables = tables

    def to_html(self) -> str:
        return "".join(t.to_html() for t in self.tables)

    _repr_html_ = to_html


def settings_table(summary: dict) -> Tables:
    """Per model and sampler setting, with intervals: the per-token numbers, then the per-sequence growth and the
    routing (two tables of at most nine columns, so that each fits the page)."""
    s = summary_of(summary)
    tokens, sequences = [], []
    for name, info in s.models.items():
        for setting, e in info["settings"].items():
            key = {"model": name, "sampler": setting}
            tokens.append({**key, "tokens": f"{value(e, 'tokens'):.0f}", "mean |Δ|": shown(e, "abs_mean"),
                           "p90 |Δ|": shown(e, "abs_q90", "{:.2g}"), "p99 |Δ|": shown(e, "abs_q99", "{:.2g}"),
                           "max |Δ|": f"{value(e, 'abs_max'):.2g}",
                           "p<0.1 ÷ p>0.9": shown(e, "low_high_ratio", "{:.2g}"), "KL k3": f"{value(e, 'kl_k3'):.2g}"})
            row = {**key, "|log w| growth / token": shown(e, "growth_rate", "{:.2g}"),
                   "growth exponent": shown(e, "growth_exponent", "{:.2f}")}
            if "route_disagreement" in e:
                row["routes differ"] = shown(e, "route_disagreement", "{:.2%}")
                row["replay: KL reduction"] = shown(e, "replay_kl_reduction", "{:.0%}")
            sequences.append(row)
    ci = " [95% bootstrap interval over sequences]"
    return Tables(
        table(pd.DataFrame(tokens), "Sampler against trainer, per token: |Δ log p|, the low/high-probability ratio "
                                    "and the train/inference KL." + ci),
        table(pd.DataFrame(sequences).fillna("–"), "Per sequence: the growth of the log-weight |log w| with length "
                                                  "(exponent 1: linear accumulation, 0.5: random walk); for mixtures "
                                                  "of experts, the routing." + ci))


def examples(summary: dict) -> str:
    """The pretrained LM's first sampled responses, as Markdown quotes (what the measured text looks like)."""
    _, info = pretrained(summary_of(summary))
    return render(HERE, "examples.md", examples=(info or {}).get("examples") or [])
