"""What the mismatch_anatomy report says and draws: answer text from the study's summary alone, placed beside the
figures practitioners report (``lab.mismatch.PRACTITIONERS``, carried in the summary); figures from the tidy
results table. The numbers come from ``lab.studies.mismatch``."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from lab.errors import LabError
from lab.reports.style import _PALETTE, color, interval, table

BAR_METRICS = {"abs_mean": "mean |Δ log p| per token", "abs_q99": "99th percentile of |Δ log p|",
               "kl_k3": "KL(sampler ‖ trainer) per token (k3)"}


def setting_colors(settings) -> dict[str, str]:
    """One colour per sampler setting, from the lab's palette (bf16 settings warm, fp32 cool)."""
    order = sorted(dict.fromkeys(settings), key=lambda s: (not s.startswith("bf16"), s))
    warm, cool = ["#d62728", "#ff7f0e", "#8c564b", "#e377c2"], ["#1f77b4", "#17becf", "#9467bd", "#2ca02c"]
    out, w, c = {}, 0, 0
    for s in order:
        if s.startswith("fp32"):
            out[s], c = cool[c % len(cool)], c + 1
        elif s.startswith("bf16"):
            out[s], w = warm[w % len(warm)], w + 1
        else:
            out[s] = _PALETTE[(w + c) % len(_PALETTE)]
            w += 1
    return out


# ---- input ----------------------------------------------------------------------------------------------------------

def config(values: dict):
    """The report's parameters as the study's validated config, with the pretrained LM's files checked too (the study
    itself reads them only when it loads the model, after the in-lab models)."""
    import json

    from lab.policies.hf import _locate, smollm2_path
    from lab.reports.params import study_config

    cfg = study_config("mismatch")(values)
    if cfg.lm != "none":
        folder, gguf = _locate(smollm2_path() if cfg.lm == "smollm2" else cfg.lm)
        try:
            if gguf:
                with open(folder / gguf, "rb") as f:
                    if f.read(4) != b"GGUF":
                        raise ValueError("not a GGUF file")
            else:
                json.loads((folder / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise LabError(f"lm {cfg.lm!r} is not a readable model ({folder / (gguf or 'config.json')}: {e}); the "
                           f"checkpoint is corrupt") from None
    return cfg


# ---- text -----------------------------------------------------------------------------------------------------------
def _num(x) -> float:
    """A number from the summary (summary.json stores NaN as null)."""
    return math.nan if x is None else float(x)


def _v(entry: dict, metric: str) -> float:
    return _num(entry.get(metric, [math.nan])[0])


def _triple(entry: dict, metric: str) -> list[float]:
    """[value, lo, hi] of a metric, NaN where missing."""
    return [_num(x) for x in entry.get(metric, [None] * 3)]


def _iv(entry: dict, metric: str, fmt: str = "{:.3g}") -> str:
    v = entry.get(metric)
    v = None if v is None else [_num(x) for x in v]
    if v is None or not math.isfinite(v[0]):
        return "n/a"
    if not all(math.isfinite(x) for x in v[1:]):
        return fmt.format(v[0])
    return interval(*v, fmt)


def _bf16(info: dict) -> str | None:
    """The main bf16 setting of a model: bf16 with the KV cache if measured, else the first bf16 setting."""
    names = list(info["settings"])
    for s in ("bf16+kv", *[n for n in names if n.startswith("bf16")]):
        if s in info["settings"]:
            return s
    return None


def _lm(summary: dict) -> tuple[str, dict] | tuple[None, None]:
    for name, info in summary["models"].items():
        if info["kind"] == "pretrained":
            return name, info
    return None, None


def _moe(summary: dict) -> tuple[str, dict] | tuple[None, None]:
    for name, info in summary["models"].items():
        if info.get("moe"):
            return name, info
    return None, None


def headline(summary: dict) -> str:
    """One line for the gallery: the pretrained LM's bf16 mismatch per token and per sequence (else the in-lab's)."""
    name, info = _lm(summary)
    if info is None:
        name, info = next(iter(summary["models"].items()))
    s = _bf16(info) or next(iter(info["settings"]))
    e = info["settings"][s]
    text = (f"{name} {s}: mean |Δlog p| {_v(e, 'abs_mean'):.3g}/token (p99 {_v(e, 'abs_q99'):.2g}), "
            f"{_v(e, 'low_high_ratio'):.2g}x larger on p<0.1 than p>0.9 tokens; |log w| {_v(e, 'abs_L_ref'):.2g} "
            f"after {_v(e, 'ref_length'):.0f} tokens vs {_v(e, 'linear_prediction_ref'):.2g} if it added up linearly")
    mname, minfo = _moe(summary)
    if minfo is not None:
        ms = _bf16(minfo)
        if ms:
            m = minfo["settings"][ms]
            text += (f"; {mname}: {_v(m, 'route_disagreement'):.2%} of routes differ, replay cuts KL by "
                     f"{_v(m, 'replay_kl_reduction'):.0%}")
    return text


def _setup(summary: dict) -> list[str]:
    lines = [f"**Setup.** Trainer: {summary['trainer']}. Every sampler setting of a model sees the same prompts and "
             f"the same random numbers.", ""]
    for name, info in summary["models"].items():
        if info["kind"] == "in-lab":
            init = (f"warm-started to accuracy {info['accuracy']:.2f} (probability that a sampled answer is right)"
                    if info.get("init") == "warm" else "at random init")
            lines.append(f"- **{name}**: the lab's transformer ({info['parameters']:,} parameters"
                         f"{', mixture of experts' if info['moe'] else ', dense'}) on `{info['env']}` "
                         f"({info['env_description']}), {init}; {info['sequences']} responses of "
                         f"{info['length']} tokens.")
        else:
            first = next(iter(info["settings"].values()))
            lines.append(f"- **{name}** (`{info['model_type']}`, {info['model_parameters'] / 1e6:.0f}M parameters, "
                         f"vocabulary {info['vocab_size']:,}; loaded in {info['load_seconds']:.0f} s): "
                         f"{info['sequences']} responses to {info['n_prompts']} plain-English prompts in its chat "
                         f"template, temperature 1, up to {info['length']} tokens (mean "
                         f"{_v(first, 'mean_length'):.0f}); full-recompute settings: "
                         f"{info['nocache_sequences']} responses of up to {info['nocache_length']} tokens.")
    return lines


def _table_rows(summary: dict) -> list[str]:
    rows = ["| model | sampler | mean \\|Δ\\| | p50 | p99 | max | p<0.1 ÷ p>0.9 | KL k3 / token | corr(p) |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, info in summary["models"].items():
        for s, e in info["settings"].items():
            rows.append(f"| {name} | `{s}` | {_iv(e, 'abs_mean')} | {_v(e, 'abs_q50'):.2g} | {_v(e, 'abs_q99'):.2g} | "
                        f"{_v(e, 'abs_max'):.2g} | {_iv(e, 'low_high_ratio', '{:.2g}')} | {_v(e, 'kl_k3'):.2g} | "
                        f"{_v(e, 'prob_corr'):.4f} |")
    return rows


def answer(summary: dict) -> str:
    """Markdown: how large the train/inference mismatch is, per token and per sequence, beside practitioners'
    figures, with the places where the lab's measurement differs said plainly."""
    ref = summary["practitioners"]
    lines = _setup(summary)
    lines += ["", "**Per-token mismatch** Δ = log p_sampler − log p_trainer on the sampled tokens "
                  "(brackets: 95% bootstrap intervals over sequences):", ""]
    lines += _table_rows(summary)
    lines += ["", "**Beside the practitioners' figures.**", ""]
    lines += _per_token_bullets(summary, ref)
    lines += _target_bullets(summary, ref)
    notes = [_moe_bullet(summary, ref), _kv_note(summary), _corrections_note(summary)]
    lines += [note for note in notes if note]
    return "\n".join(lines)


def _per_token_bullets(summary: dict, ref: dict) -> list[str]:
    """One bullet per model with a bf16 setting: its mean |Δ| against the practitioners' range."""
    lo_ref, hi_ref = ref["abs_delta_range"]["value"]
    lines = []
    for name, info in summary["models"].items():
        s = _bf16(info)
        if s is None:
            continue
        e = info["settings"][s]
        a = _triple(e, "abs_mean")
        where = ("inside" if lo_ref <= a[0] <= hi_ref else "below" if a[0] < lo_ref else "above")
        lines.append(f"- **Per token ({name}, `{s}`)**: mean |Δ| {_iv(e, 'abs_mean')}, {where} the "
                     f"{lo_ref}-{hi_ref} practitioners report for a bf16 engine against its trainer"
                     + ("." if where == "inside" else _why_off(info, where)))
    return lines


def _target_bullets(summary: dict, ref: dict) -> list[str]:
    """The bullets on the pretrained LM (else the first model) in its bf16 setting: per sequence, low-probability
    tokens, and the fp32 output head where measured."""
    lm_name, lm = _lm(summary)
    target = lm if lm is not None else next(iter(summary["models"].values()))
    t_name = lm_name if lm is not None else next(iter(summary["models"]))
    s = _bf16(target)
    if not s:
        return []
    e = target["settings"][s]
    lines = [_sequence_bullet(t_name, s, e, ref), _low_prob_bullet(t_name, e)]
    if "bf16+kv+head32" in target["settings"] and "bf16+kv" in target["settings"]:
        lines.append(_head32_bullet(t_name, target["settings"], ref))
    return lines


def _growth_verdict(e: dict, lin: float, meas: float) -> str:
    """Whether the deltas add up: linear when the growth exponent's lower bound exceeds 0.85; else how they
    correlate within a response, from seq_var_ratio = Σ_n (log w_n)² / Σ_n Σ_t Δ²_nt."""
    exponent = _triple(e, "growth_exponent")
    if not meas > 0:
        return "the sequence log-weight does not grow"
    if exponent[1] > 0.85:
        return "the deltas add up almost linearly, as the rule assumes"
    vr = _triple(e, "seq_var_ratio")
    how = ("partly cancel one another, more than independent deltas would" if vr[2] < 1 else
           "drift with one sign, yet not enough to add up linearly" if vr[1] > 1 else
           "behave like independent deltas of random sign")
    return (f"the deltas do not add up (a random walk grows with exponent 0.5, linear accumulation with "
            f"1), so |Δ| × length overstates the sequence log-weight {lin / meas:.1f}-fold. Within a "
            f"response they {how}: Σ_n (log w_n)² is {_iv(e, 'seq_var_ratio', '{:.2g}')} times "
            f"Σ_n Σ_t Δ²_nt (1 for uncorrelated deltas)")


def _sequence_bullet(t_name: str, s: str, e: dict, ref: dict) -> str:
    """Per sequence: mean |log w| at the reference length n against the linear rule |Δ| × n."""
    n = _v(e, "ref_length")
    lin, meas = _v(e, "linear_prediction_ref"), _v(e, "abs_L_ref")
    verdict = _growth_verdict(e, lin, meas)
    return (f"- **Per sequence ({t_name}, `{s}`)**: the practitioners' rule (0.012 × 100 tokens gives a "
            f"sequence ratio near exp({ref['seq_log_ratio_100']['value']})) multiplies the per-token |Δ| by "
            f"the length. Measured: mean |log w| after {n:.0f} tokens "
            f"{_iv(e, 'abs_L_ref', '{:.2g}')} against {lin:.2g} from |Δ| × {n:.0f}; mean |log w| grows "
            f"{_iv(e, 'growth_rate', '{:.2g}')} nats per token with exponent "
            f"{_iv(e, 'growth_exponent', '{:.2f}')} in the length: {verdict}.")


def _low_prob_bullet(t_name: str, e: dict) -> str:
    """Low-probability tokens: mean |Δ| on p < 0.1 over p > 0.9, and their shares of tokens and of total |Δ|."""
    share_tok, share_abs = _v(e, "token_share[p<0.1]"), _v(e, "abs_share[p<0.1]")
    ratio = _triple(e, "low_high_ratio")
    claim = ("holds per token" if ratio[1] > 1 else "is not resolved per token")
    return (f"- **Low-probability tokens ({t_name})**: mean |Δ| on tokens the trainer gives p < 0.1 is "
            f"{_iv(e, 'low_high_ratio', '{:.2g}')} times that on p > 0.9 tokens: the claim {claim}. They "
            f"are {share_tok:.0%} of the sampled tokens and carry {share_abs:.0%} of the total |Δ|"
            + (": most of the mismatch." if share_abs > 0.5 else
               ", not most of it: at temperature 1 most sampled tokens are likely ones, and their small "
               "deltas add up."))


def _head32_bullet(t_name: str, settings: dict, ref: dict) -> str:
    """fp32 output head: probability correlation and mean |Δ| of bf16+kv against bf16+kv+head32."""
    h, b = settings["bf16+kv+head32"], settings["bf16+kv"]
    lo_c, hi_c = ref["prob_corr"]["value"]
    return (f"- **fp32 output head ({t_name})**: probability correlation {_v(b, 'prob_corr'):.4f} "
            f"with the bf16 head and {_v(h, 'prob_corr'):.4f} with an fp32 head (MiniMax-M1: {lo_c} → "
            f"{hi_c}); mean |Δ| {_v(b, 'abs_mean'):.3g} → {_v(h, 'abs_mean'):.3g}. "
            + ("The correlation here starts far above MiniMax's 0.9: their engines differ in more than "
               "the head's precision (kernels, a 456B MoE), ours only in the weights' dtype."
               if _v(b, "prob_corr") > 0.95 else ""))


def _moe_bullet(summary: dict, ref: dict) -> str | None:
    """MoE routing: share of routing decisions that differ, and replay's KL reduction 1 - KL_replay / KL_free."""
    mname, moe = _moe(summary)
    ms = _bf16(moe) if moe is not None else None
    if not ms:
        return None
    m = moe["settings"][ms]
    d_ref, r_ref = ref["moe_route_disagreement"]["value"], ref["replay_kl_reduction"]["value"]
    red = _v(m, "replay_kl_reduction")
    return (f"- **MoE routing ({mname}, `{ms}`)**: {_iv(m, 'route_disagreement', '{:.2%}')} of "
            f"(token, layer) routing decisions differ from the trainer's (practitioners: about "
            f"{d_ref:.0%}). Replaying the sampler's routes in the trainer "
            f"{'reduces' if red >= 0 else 'raises'} the KL by {abs(red):.0%} (reduction "
            f"{_iv(m, 'replay_kl_reduction', '{:.0%}')}; R3 reports about {r_ref:.0%}) and moves mean "
            f"|Δ| from {_v(m, 'abs_mean'):.3g} to {_v(m, 'abs_mean_replay'):.3g}."
            + _moe_note(m, d_ref, r_ref))


def _why_off(info: dict, where: str) -> str:
    if info["kind"] == "in-lab":
        e = info["settings"][_bf16(info)]
        sure = _v(e, "token_share[p>0.9]")
        return (f": the lab's transformer is tiny ({info['parameters']:,} parameters, {info.get('length')}-token "
                f"answers over 10 digits; {sure:.0%} of its sampled tokens have p > 0.9), so there is little depth "
                f"and few uncertain tokens for rounding to act on. The practitioners' figure is for "
                f"billion-parameter models; a pretrained LM is the closer comparison.")
    return (": this measurement changes only the weights' dtype on the same CPU kernels; production engines also "
            "differ in kernels, batching and reduction order, which adds mismatch." if where == "below" else
            ": a 135M model quantised to 4 bits and sampled at temperature 1 puts many tokens in the uncertain "
            "range, where rounding moves log-probabilities most.")


def _moe_note(m: dict, d_ref: float, r_ref: float) -> str:
    notes = []
    if _v(m, "route_disagreement") < d_ref / 3:
        notes.append("far fewer routes flip than practitioners see: here the sampler and the trainer share kernels "
                     "and differ only in the weights' dtype, on a small router (few near-ties)")
    if _v(m, "replay_kl_reduction") < r_ref / 2:
        notes.append("replay removes little because the flipped routes are too few to carry the KL; the rest "
                     "is rounding in every layer, which replay cannot remove")
    text = "; ".join(notes)
    return f" {text[0].upper()}{text[1:]}." if notes else ""


def _kv_note(summary: dict) -> str | None:
    parts = []
    for name, info in summary["models"].items():
        st = info["settings"]
        if "fp32+kv" in st and "bf16+kv" in st:
            part = (f"{name}: fp32 with the cache {_v(st['fp32+kv'], 'abs_mean'):.2g}, bf16 with the cache "
                    f"{_v(st['bf16+kv'], 'abs_mean'):.2g}")
            if "bf16" in st:
                part += f", bf16 recomputing every step {_v(st['bf16'], 'abs_mean'):.2g}"
            parts.append(part)
    if not parts:
        return None
    return ("- **KV cache alone**: mean |Δ| " + "; ".join(parts) + ". Incremental decoding in fp32 differs from "
            "the full fp32 pass by rounding only: the precision of the weights, not the cache, makes the mismatch.")


def _corrections_note(summary: dict) -> str | None:
    name, info = _lm(summary)
    if info is None:
        name, info = next(iter(summary["models"].items()))
    s = _bf16(info)
    if s is None:
        return None
    e = info["settings"][s]
    return (f"- **What the corrections see ({name}, `{s}`)**: token TIS (C = 2) truncates "
            f"{_v(e, 'tis_truncated'):.2%} of tokens, IcePop's band [0.5, 5] masks {_v(e, 'icepop_masked'):.2%}, "
            f"and the sequence mask [0.5, 2] drops {_v(e, 'seq_mis_masked'):.0%} of responses.")


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
    tokens, sequences = [], []
    for name, info in summary["models"].items():
        for s, e in info["settings"].items():
            key = {"model": name, "sampler": s}
            tokens.append({**key, "tokens": f"{_v(e, 'tokens'):.0f}", "mean |Δ|": _iv(e, "abs_mean"),
                           "p90 |Δ|": _iv(e, "abs_q90", "{:.2g}"), "p99 |Δ|": _iv(e, "abs_q99", "{:.2g}"),
                           "max |Δ|": f"{_v(e, 'abs_max'):.2g}", "p<0.1 ÷ p>0.9": _iv(e, "low_high_ratio", "{:.2g}"),
                           "KL k3": f"{_v(e, 'kl_k3'):.2g}"})
            row = {**key, "|log w| growth / token": _iv(e, "growth_rate", "{:.2g}"),
                   "growth exponent": _iv(e, "growth_exponent", "{:.2f}")}
            if "route_disagreement" in e:
                row["routes differ"] = _iv(e, "route_disagreement", "{:.2%}")
                row["replay: KL reduction"] = _iv(e, "replay_kl_reduction", "{:.0%}")
            sequences.append(row)
    ci = " [95% bootstrap interval over sequences]"
    return Tables(
        table(pd.DataFrame(tokens), "Sampler against trainer, per token: |Δ log p|, the low/high-probability ratio "
                                    "and the train/inference KL." + ci),
        table(pd.DataFrame(sequences).fillna("–"), "Per sequence: the growth of the log-weight |log w| with length "
                                                  "(exponent 1: linear accumulation, 0.5: random walk); for mixtures "
                                                  "of experts, the routing." + ci))


# ---- figures --------------------------------------------------------------------------------------------------------
def _models(results: pd.DataFrame) -> list[str]:
    if results.empty:
        raise LabError("no mismatch results to draw")
    return list(dict.fromkeys(results["model"]))


def _noisy(s: str) -> bool:
    return not s.startswith("fp32")


def abs_delta_vs_probability(results: pd.DataFrame) -> Figure:
    """Mean |Δ log p| against the trainer's probability of the token, one panel per model, one line per reduced-
    precision setting (bands: 95% intervals)."""
    models = _models(results)
    fig = Figure(figsize=(4.2 * len(models), 3.6), layout="constrained")
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    df = results[results["metric"] == "abs_delta_by_prob"]
    colors = setting_colors(results["setting"])
    for ax, model in zip(axes, models):
        for s, g in df[df["model"] == model].groupby("setting", sort=False):
            if not _noisy(s) or g.empty:
                continue
            g = g.sort_values("x")
            ax.plot(g["x"], g["value"], "-o", ms=3.5, lw=1.6, color=colors[s], label=s)
            ax.fill_between(g["x"], g["lo"].clip(lower=1e-12), g["hi"], color=colors[s], alpha=0.15, lw=0)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.axvline(0.1, color="0.6", lw=0.8, ls=":")
        ax.axvline(0.9, color="0.6", lw=0.8, ls=":")
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("trainer probability of the sampled token")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("mean |Δ log p|")
    fig.suptitle("Low-probability tokens carry larger log-prob differences", fontsize=11)
    return fig


def log_weight_vs_length(results: pd.DataFrame) -> Figure:
    """Mean |log w_t| (the sequence log-weight after t tokens) against t, each response's |log w| at its own length
    as a dot, the linear rule |Δ| × t dashed and the practitioners' 0.012 × t dotted; one panel per model."""
    models = _models(results)
    fig = Figure(figsize=(4.2 * len(models), 3.6), layout="constrained")
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    df = results[results["metric"] == "abs_L_by_length"]
    dots = results[results["metric"] == "seq_log_weight"]
    scal = results[results["metric"] == "abs_mean"]
    colors = setting_colors(results["setting"])
    for ax, model in zip(axes, models):
        top = 0.0
        for s, g in df[df["model"] == model].groupby("setting", sort=False):
            if not _noisy(s) or g.empty:
                continue
            g = g.sort_values("x")
            ax.plot(g["x"], g["value"], "-", lw=1.8, color=colors[s], label=f"{s}: measured")
            ax.fill_between(g["x"], g["lo"], g["hi"], color=colors[s], alpha=0.15, lw=0)
            seq = dots[(dots["model"] == model) & (dots["setting"] == s)]
            ax.scatter(seq["x"], seq["value"].abs(), s=7, color=colors[s], alpha=0.35, lw=0)
            a = scal[(scal["model"] == model) & (scal["setting"] == s)]["value"]
            if len(a):
                ax.plot(g["x"], float(a.iloc[0]) * g["x"], "--", lw=1.0, color=colors[s],
                        label=f"{s}: |Δ| × t")
            top = max(top, float(g["hi"].max()), float(np.quantile(seq["value"].abs(), 0.95)) if len(seq) else 0.0)
        xs = df[df["model"] == model]["x"]
        if len(xs):
            t = np.linspace(1, xs.max(), 50)
            ax.plot(t, 0.012 * t, ":", color="0.35", lw=1.2, label="0.012 × t (practitioners)")
            ax.set_ylim(0, max(top * 1.4, 1e-12))
        ax.set_title(model, fontsize=10)
        ax.set_xlabel("tokens t")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("mean |log w_t|  (log p_sampler − log p_trainer)")
    fig.suptitle("Sequence log-weight against response length", fontsize=11)
    return fig


def setting_bars(results: pd.DataFrame) -> Figure:
    """Per model and setting: mean |Δ|, p99 |Δ| and KL per token (log scale; whiskers: 95% intervals), with the
    practitioners' 0.01-0.04 band on the mean |Δ| panel."""
    df = results[results["metric"].isin(BAR_METRICS) & results["x"].isna()]
    fig = Figure(figsize=(12, 3.9), layout="constrained")
    axes = fig.subplots(1, len(BAR_METRICS))
    colors = setting_colors(results["setting"])
    labels = list(dict.fromkeys(zip(df["model"], df["setting"])))
    y = np.arange(len(labels))
    for ax, (metric, title) in zip(axes, BAR_METRICS.items()):
        d = df[df["metric"] == metric]
        at = {(m, s): (v, lo, hi) for m, s, v, lo, hi in zip(d["model"], d["setting"], d["value"], d["lo"], d["hi"])}
        vals, lo, hi = (np.array([max(float(at[k][i]), 1e-12) for k in labels]) for i in range(3))
        ax.barh(y, vals, color=[colors[s] for _, s in labels], alpha=0.8)
        ax.errorbar(vals, y, xerr=[np.maximum(vals - lo, 0), np.maximum(hi - vals, 0)], fmt="none", color="black",
                    lw=0.8, capsize=2)
        if metric == "abs_mean":
            ax.axvspan(0.01, 0.04, color="0.5", alpha=0.18, lw=0, label="practitioners: 0.01-0.04")
            ax.legend(fontsize=7, loc="lower right")
        ax.set_xscale("log")
        ax.set_title(title, fontsize=9)
        ax.set_yticks(y)
        ax.set_yticklabels([f"{m}: {s}" for m, s in labels] if ax is axes[0] else [], fontsize=8)
        ax.invert_yaxis()
    fig.suptitle("Every sampler setting against the fp32 full-sequence trainer", fontsize=11)
    return fig


def routing_replay(results: pd.DataFrame) -> Figure | None:
    """MoE models in reduced precision: share of routing decisions that differ, and the KL per token with free
    routing and with the sampler's routes replayed, per setting (references: about 10% of routes, replay halving
    the KL)."""
    moe = results[(results["metric"] == "route_disagreement") & results["setting"].map(_noisy)]
    if moe.empty:
        return None
    labels = list(dict.fromkeys(zip(moe["model"], moe["setting"])))
    fig = Figure(figsize=(10, 0.6 * len(labels) + 2.4), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    y = np.arange(len(labels))
    scalars = results[results["x"].isna()]
    d = {(m, s, metric): v for m, s, metric, v in zip(scalars["model"], scalars["setting"], scalars["metric"],
                                                      scalars["value"])}

    def get(k, metric):
        return float(d.get((*k, metric), math.nan))

    rd = np.array([get(k, "route_disagreement") for k in labels])
    ax1.barh(y, rd * 100, color=color("mis_token"), alpha=0.8)
    for yi, v in zip(y, rd):
        ax1.annotate(f"{v:.2%}", (v * 100, yi), xytext=(4, 0), textcoords="offset points", va="center", fontsize=8)
    ax1.axvline(10, color="0.35", ls=":", lw=1.2, label="practitioners: about 10%")
    ax1.set_xlabel("routing decisions that differ (%)")
    ax1.set_yticks(y)
    ax1.set_yticklabels([f"{m}: {s}" for m, s in labels], fontsize=8)
    ax1.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), frameon=False)
    free = np.array([get(k, "kl_k3") for k in labels])
    rep = np.array([get(k, "kl_k3_replay") for k in labels])
    ax2.barh(y - 0.2, free, height=0.4, color="0.55", label="free routing")
    ax2.barh(y + 0.2, rep, height=0.4, color=color("vespo"), label="routes replayed (R3)")
    ax2.scatter(free / 2, y + 0.2, marker="|", color="black", s=120, label="half the free KL (R3's figure)")
    ax2.set_xlabel("KL(sampler ‖ trainer) per token")
    ax2.set_yticks(y)
    ax2.set_yticklabels([])
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=3, frameon=False)
    for ax in (ax1, ax2):
        ax.invert_yaxis()
    fig.suptitle("Mixture of experts: routes that flip, and what replaying them removes", fontsize=11)
    return fig


def examples(summary: dict) -> str:
    """The pretrained LM's first sampled responses, as markdown quotes (what the measured text looks like)."""
    _, info = _lm(summary)
    if not info or not info.get("examples"):
        return "*No pretrained LM in this run.*"
    out = []
    for ex in info["examples"]:
        quoted = (ex["response"].strip() or "(empty)").replace("\n", "\n> ")
        out.append(f"**Prompt:** {ex['prompt']}\n\n> {quoted}")
    return "\n\n".join(out)
