"""Report notebooks: a registry, a papermill driver with a self-contained HTML export, and the gallery index.

``run_report(name, params)`` executes ``notebooks/<name>.ipynb`` with papermill in a hidden staging folder
next to the destination, exports HTML (code hidden, figures embedded as base64 PNG, no external scripts or
styles) and renames the folder into ``<out_root>/<name>/``:

    <name>.ipynb  <name>.html  config.json  results.parquet  summary.json

A failed execution raises ``LabError`` naming the failing cell's error and leaves nothing behind.
The second half of the module holds the text and tables the notebooks show (``answer``, ``headline_table``).
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd

from lab.errors import LabError
from lab.runs import RUN_FILES, replace_dir

REPO_ROOT = Path(__file__).resolve().parent.parent
DRIVER_PARAMS = ("out_dir",)  # set by the driver, not by users


def _variance_headline(summary: dict) -> str:
    last = max(summary["per_value"], key=lambda e: e["kl_token"])  # the most off-policy setting
    ests = last["estimators"]
    best = min(ests, key=lambda n: ests[n]["rel_mse"])
    text = (f"{summary['staleness']} {last['staleness']:g} (KL {last['kl_token']:.2g}/token): lowest MSE "
            f"{best}, {ests[best]['rel_mse']:.3g}×‖∇J‖²")
    if "reinforce" in ests and best != "reinforce":
        text += f" vs {ests['reinforce']['rel_mse']:.3g}× uncorrected"
    if ests[best]["rel_mse"] >= 1:
        text += "; no correction beats a zero update (1×)"
    return text


def _summary_headline(summary: dict) -> str:
    return str(summary.get("headline", ""))


@dataclass(frozen=True)
class Report:
    notebook: str  # path relative to the repository root
    description: str  # one line for listings and the gallery
    params: dict = field(default_factory=dict)  # overrides of the notebook's defaults used by run_all
    smoke: dict = field(default_factory=dict)  # small parameters: the test suite builds every report with them
    headline: Callable[[dict], str] = _summary_headline  # summary.json -> one line for the gallery


REPORTS: dict[str, Report] = {
    "estimator_variance": Report(
        "notebooks/estimator_variance.ipynb",
        "How wrong and how noisy is the policy gradient under each off-policy correction as rollouts go stale.",
        smoke={"replicates": 40, "values": [0, 4]}, headline=_variance_headline),
    "estimator_zoo": Report(
        "notebooks/estimator_zoo.ipynb",
        "Every estimator side by side: its effective coefficient on grad log pi, and bias, variance and MSE on the "
        "same batches across staleness.",
        smoke={"replicates": 30, "values": [0, 8]}),
    "vespo_bound": Report(
        "notebooks/vespo_bound.ipynb",
        "VESPO's variance bound (Proposition 3.1) checked exactly by enumeration, and VESPO against sequence IS up "
        "to 64x staleness.",
        smoke={"lags": [0, 4], "kl_targets": [0.1], "temperatures": [2.0], "bound_seeds": [0], "replicates": 40,
               "trajectory_steps": 4, "kernels": [[2, 3], [3, 2], [1, 1], [0.5, 1]]}),
    "gvpo_optimum": Report(
        "notebooks/gvpo_optimum.ipynb",
        "GVPO converges to the KL-constrained optimum pi_ref exp(R/beta)/Z, on-policy and from other sampling "
        "distributions, against IS-corrected alternatives.",
        smoke={"steps": 60, "seeds": [0, 1], "groups_per_step": 8}),
    "opd_variance": Report(
        "notebooks/opd_variance.ipynb",
        "On-policy distillation: vanilla OPD, vOPD (full and top-k baselines), full-vocabulary and top-k KL: bias "
        "against both targets, variance, and the baseline's variance reduction.",
        smoke={"vocab_size": 8, "length": 2, "replicates": 40, "k_values": [2], "teacher_steps": 3}),
    "staleness_training": Report(
        "notebooks/staleness_training.ipynb",
        "Training under staleness: final reward, collapse rate and probability of improvement per correction as "
        "mini-batch staleness N, the async bound eta and sampler mismatch grow, beside VESPO's table.",
        smoke={"estimators": ["reinforce", "ppo_clip", "vespo"], "minibatches": [1, 4], "seeds": [0, 1], "steps": 4,
               "etas": [0, 2], "noise_levels": [0.0, 0.5], "n_boot": 200}),
}


def names() -> list[str]:
    return list(REPORTS)


def _get(name: str) -> Report:
    if name not in REPORTS:
        raise LabError(f"unknown report {name!r}; known reports: {', '.join(names())}")
    return REPORTS[name]


def parameters(name: str) -> dict:
    """The notebook's parameters cell as {name: default source text}, driver-set parameters left out."""
    import papermill as pm

    found = pm.inspect_notebook(str(REPO_ROOT / _get(name).notebook))
    return {k: v["default"] for k, v in found.items() if k not in DRIVER_PARAMS}


def _check_params(name: str, params: dict) -> None:
    valid = parameters(name)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        raise LabError(f"unknown parameter(s) {', '.join(unknown)} for report {name!r}; "
                       f"valid parameters: {', '.join(valid)}")


def _check_dest(dest: Path, name: str) -> None:
    if dest.exists() and (not dest.is_dir() or (any(dest.iterdir()) and not (dest / f"{name}.ipynb").exists())):
        raise LabError(f"{dest} exists and is not a report folder; choose another --out")


def _one_line(text: str) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(text)).strip()
    return text.splitlines()[0] if text else ""


_SCRIPTS = re.compile(r"<script\b.*?</script>", re.I | re.S)  # MathJax, require.js, mermaid: all from CDNs
_REMOTE_LINKS = re.compile(r"<link\b[^>]*\bhref\s*=\s*[\"']?(?:https?:)?//[^>]*>", re.I)
_CSS = """<style>
body { max-width: 1180px; margin: 0 auto !important; padding: 0 24px 48px; }
.jp-Notebook { padding: 8px 0 !important; }
.jp-RenderedHTMLCommon table.lab-headline { font-size: 13px; }
.jp-RenderedHTMLCommon table.lab-headline td, .jp-RenderedHTMLCommon table.lab-headline th { white-space: nowrap; }
.jp-RenderedImage img { max-width: 100%; height: auto; }
</style>
"""


def export_html(notebook: Path, title: str) -> str:
    """Self-contained HTML of an executed notebook: outputs only, images inline, no scripts or remote resources."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(str(notebook), as_version=4)
    exporter = HTMLExporter(template_name="lab", exclude_input=True, exclude_input_prompt=True,
                            exclude_output_prompt=True)
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title}})
    body = _REMOTE_LINKS.sub("", _SCRIPTS.sub("", body))  # a report is static: tables, text, PNGs
    return body.replace("</head>", _CSS + "</head>", 1)


def run_report(name: str, params: dict | None = None, out_root: Path = Path("reports")) -> Path:
    """Execute report ``name`` with ``params`` (overrides of its parameters cell) into ``out_root/name``."""
    import papermill as pm
    from papermill.exceptions import PapermillExecutionError

    report = _get(name)
    notebook = REPO_ROOT / report.notebook
    if not notebook.exists():
        raise LabError(f"report notebook {notebook} not found; reports run from a source checkout (pip install -e .)")
    params = dict(params or {})
    _check_params(name, params)
    out_root = Path(out_root).resolve()
    dest = out_root / name
    _check_dest(dest, name)
    made = [p for p in (out_root, *out_root.parents) if not p.exists()]  # removed again on failure
    out_root.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=out_root))
    try:
        stage.chmod(0o755)  # mkdtemp makes it private; the report folder is for reading
        executed = stage / f"{name}.ipynb"
        try:
            pm.execute_notebook(str(notebook), str(executed),
                                parameters={**params, "out_dir": str(stage / "run")}, kernel_name="python3",
                                cwd=str(REPO_ROOT), progress_bar=False, log_output=False,
                                extra_arguments=["--IPKernelApp.log_level=CRITICAL"])  # no kernel log noise
        except PapermillExecutionError as e:
            raise LabError(f"report {name!r} failed in cell {e.exec_count}: {e.ename}: "
                           f"{_one_line(e.evalue)}") from None
        except Exception as e:  # kernel missing or dead: still one line
            raise LabError(f"report {name!r} could not run: {type(e).__name__}: {_one_line(e)}") from None
        for f in RUN_FILES:
            if not (stage / "run" / f).exists():
                raise LabError(f"report {name!r} did not write its run folder ({f} missing)")
            os.replace(stage / "run" / f, stage / f)
        (stage / "run").rmdir()
        (stage / f"{name}.html").write_text(export_html(executed, title=f"{name} report"), encoding="utf-8")
        replace_dir(stage, dest)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        for p in made:
            if not any(p.iterdir()):
                p.rmdir()
        raise
    return dest


def run_all(out_root: Path = Path("reports")) -> list[Path]:
    """Build every report with its default parameters, then the gallery ``out_root/index.html``."""
    paths = [run_report(name, REPORTS[name].params, out_root) for name in names()]
    return [*paths, write_index(out_root)]


def _thumbnail(notebook: Path) -> str | None:
    """The first PNG output of an executed notebook, base64."""
    nb = json.loads(notebook.read_text())
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            png = out.get("data", {}).get("image/png")
            if png:
                return "".join(png).strip()
    return None


def write_index(out_root: Path = Path("reports")) -> Path:
    """The gallery page: one card per built report with its description and headline number."""
    out_root = Path(out_root)
    cards = []
    for name, report in REPORTS.items():
        folder = out_root / name
        if not (folder / f"{name}.html").exists():
            continue
        try:
            headline = report.headline(json.loads((folder / "summary.json").read_text()))
        except (OSError, KeyError, ValueError, TypeError) as e:
            headline = f"(no headline: {type(e).__name__})"
        thumb = _thumbnail(folder / f"{name}.ipynb")
        img = f'<img src="data:image/png;base64,{thumb}" alt="{name}">' if thumb else ""
        cards.append(f'<a class="card" href="{name}/{name}.html">{img}<h2>{html.escape(name)}</h2>'
                     f'<p>{html.escape(report.description)}</p><p class="num">{html.escape(headline)}</p>'
                     f'<p class="files">{name}.ipynb · config.json · results.parquet · summary.json</p></a>')
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Off-policy variance lab: reports</title>
<style>
body {{ font-family: system-ui, sans-serif; max-width: 1100px; margin: 2em auto; padding: 0 1em; color: #222; }}
.card {{ display: block; border: 1px solid #ddd; border-radius: 8px; padding: 1em; margin: 1em 0;
        color: inherit; text-decoration: none; }}
.card:hover {{ border-color: #1f77b4; }}
.card img {{ width: 100%; }} .num {{ font-weight: 600; font-size: 1.1em; }} .files {{ color: #777; font-size: .85em; }}
</style></head><body>
<h1>Off-policy variance lab: reports</h1>
<p>Generated by <code>make reports</code> (<code>lab report --all</code>). Each report folder holds the executed
notebook and its run files; rebuild one with <code>lab report NAME -p key=value</code>.</p>
{''.join(cards) or '<p>No reports built yet.</p>'}
</body></html>
"""
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = out_root / ".index.html.tmp"
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, out_root / "index.html")
    return out_root / "index.html"


# ---- what the report notebooks show -------------------------------------------------------------------------

def _cell(results: pd.DataFrame, metric: str, estimator: str = "-") -> pd.DataFrame:
    rows = results[(results["metric"] == metric) & (results["estimator"] == estimator)]
    return rows.set_index("staleness")[["value", "lo", "hi"]].sort_index()


def _relative(results: pd.DataFrame, estimator: str) -> pd.DataFrame:
    """Relative bias ‖bias‖/‖∇J‖, noise √variance/‖∇J‖ and MSE/‖∇J‖² per staleness (‖∇J‖² = mse / rel_mse)."""
    norm2 = _cell(results, "mse", estimator)["value"] / _cell(results, "rel_mse", estimator)["value"]
    bias = _cell(results, "bias_norm", estimator).div(np.sqrt(norm2), axis=0)
    noise = np.sqrt(_cell(results, "variance", estimator).clip(lower=0)).div(np.sqrt(norm2), axis=0)
    return pd.concat({"bias": bias, "noise": noise, "rel_mse": _cell(results, "rel_mse", estimator)}, axis=1)


def _best(values: pd.Series) -> list[str]:
    """Estimators with the lowest value (several when they coincide, as on-policy where all reduce to one)."""
    low = values.min()
    return [k for k, v in values.items() if v <= low + 1e-9 * abs(low)]


def _iv(row, fmt: str = "{:.3g}") -> str:
    return f"{fmt.format(row['value'])} [{fmt.format(row['lo'])}, {fmt.format(row['hi'])}]"


def answer(results: pd.DataFrame, config: dict | None = None) -> str:
    """Markdown answering "my rollouts are this stale: how wrong and how noisy is each correction?"."""
    from lab.figures import KIND_LABELS, estimator_names

    config = config or {}
    kind = results["staleness_kind"].iloc[0]
    ests = estimator_names(results)
    rel = {e: _relative(results, e) for e in ests}
    kls = _cell(results, "kl_token")["value"]
    values = list(kls.sort_values(kind="stable").index)  # from least to most off-policy
    s = values[-1]
    kl, ess = kls.loc[s], _cell(results, "ess_frac").loc[s]
    mse = pd.Series({e: rel[e].loc[s, ("rel_mse", "value")] for e in ests})
    best = _best(mse)
    setup = (f"**Setup.** `{results['env'].iloc[0]}` with a `{results['policy'].iloc[0]}` policy; behaviour policy "
             f"μ set by **{KIND_LABELS.get(kind, kind)}** ∈ {{{', '.join(f'{v:g}' for v in sorted(values))}}}")
    if config:
        setup += (f"; batches of {config.get('batch_size')} responses ({config.get('group_size')} per prompt, "
                  f"`{config.get('advantage')}` advantages, `{config.get('loss_agg_mode')}`), "
                  f"{config.get('replicates')} replicate batches per setting")
    lines = [setup + ". Truth: the exact on-policy gradient ∇J of π.", ""]
    lines += [f"**At the most off-policy setting, {kind} = {s:g}** (KL(μ‖π) {kl:.2g} nats/token, "
              f"ESS {ess['value']:.0%} of the batch):", ""]
    lines += ["| estimator | how wrong: ‖bias‖ ÷ ‖∇J‖ | how noisy: one batch's √tr Cov ÷ ‖∇J‖ | MSE ÷ ‖∇J‖² |",
              "|---|---|---|---|"]
    for e in ests:
        r, name = rel[e].loc[s], (f"**{e}** ★" if e in best else e)
        lines.append(f"| {name} | {_iv(r['bias'], '{:.0%}')} | {_iv(r['noise'], '{:.0%}')} | {_iv(r['rel_mse'])} |")
    lines += ["", "*Brackets: 95% bootstrap intervals over replicate batches.*", ""]
    if len(best) < len(ests):
        lines.append(f"- **Lowest MSE: {' = '.join(best)}.** " + _advice(rel, ests, best, s))
    if mse[best].min() > 0.9:  # a zero gradient has MSE = ||grad J||^2 exactly
        lines.append("- **Nothing does much better than a zero update here**: a zero gradient has MSE ÷ ‖∇J‖² = 1. "
                     "The lowest MSE comes from an estimate that barely moves, not from a useful gradient.")
    if "reinforce" in ests and len(values) > 1:
        base = rel["reinforce"].loc[values[0], "rel_mse"]
        safe = values[0]
        for v in values[1:]:
            if rel["reinforce"].loc[v, ("rel_mse", "lo")] > base["hi"]:
                break
            safe = v
        base_name = "on-policy" if kls.loc[values[0]] == 0 else f"{kind} = {values[0]:g}"
        lines.append(f"- Uncorrected `reinforce` stays within its {base_name} MSE interval up to "
                     f"**KL {kls.loc[safe]:.2g}/token** ({kind} = {safe:g})"
                     + ("." if safe != s else ": every setting here."))
    return "\n".join(lines)


def _advice(rel: dict, ests: list, best: list, s: float) -> str:
    b = rel[best[0]].loc[s, ("rel_mse", "hi")]
    tied = [e for e in ests if e not in best and rel[e].loc[s, ("rel_mse", "lo")] <= b]
    if not tied:
        return "Its interval clears every other estimator's."
    least = min(best + tied, key=lambda e: rel[e].loc[s, ("bias", "value")])
    return (f"Its interval overlaps {', '.join(tied)}: not resolved at this number of replicates; the least biased "
            f"of these is {least}.")


def headline_table(results: pd.DataFrame):
    """Per staleness value: exact per-token KL, ESS and each estimator's MSE ÷ ‖∇J‖² [95% CI], lowest starred."""
    kind = results["staleness_kind"].iloc[0]
    from lab.figures import estimator_names

    ests = estimator_names(results)
    kl, ess = _cell(results, "kl_token"), _cell(results, "ess_frac")
    rows, marks = [], []
    for s in kl.index:
        mse = pd.Series({e: _cell(results, "rel_mse", e).loc[s, "value"] for e in ests})
        best = _best(mse) if len(_best(mse)) < len(ests) else []
        row = {kind: f"{s:g}", "KL(μ‖π)/token": f"{kl.loc[s, 'value']:.2g}", "ESS": _iv(ess.loc[s], "{:.0%}")}
        for e in ests:
            row[e] = ("★ " if e in best else "") + _iv(_cell(results, "rel_mse", e).loc[s])
        rows.append(row)
        marks.append(best)
    table = pd.DataFrame(rows)
    styles = pd.DataFrame("", index=table.index, columns=table.columns)
    for i, best in enumerate(marks):
        for e in best:
            styles.loc[i, e] = "font-weight: bold; background-color: #e3f4e1"
    return (table.style.hide(axis="index").apply(lambda _: styles, axis=None)
            .set_table_attributes('class="lab-headline"')
            .set_caption("MSE ÷ ‖∇J‖² per estimator (lower is better; ★ lowest; [95% bootstrap interval]). "
                         "ESS: Kish effective sample size as a share of the batch.")
            .set_table_styles([{"selector": "caption", "props": "caption-side: top; text-align: left; color: #555;"},
                               {"selector": "td, th", "props": "text-align: right; padding: 3px 10px;"}]))


def registry_table(names: list[str]) -> pd.DataFrame:
    """One row per estimator: family, source, its defaults, its own aggregation, what it is unbiased for."""
    from lab import estimators

    rows = []
    for n in names:
        i = estimators.info(n)
        rows.append({"estimator": n, "family": i.family, "ratio": i.ratio, "source": i.source,
                     "defaults": ", ".join(f"{k}={v}" for k, v in i.defaults.items()) or "-",
                     "own aggregation": i.loss_agg_mode, "unbiased for": i.unbiased_for})
    return pd.DataFrame(rows).set_index("estimator")
