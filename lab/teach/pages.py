"""Static browser pages with live controls for the six lessons: ``python -m lab.teach.pages DIR``.

Each page is one self-contained HTML file: Bokeh's plots and sliders with BokehJS inlined (``resources=INLINE``), and
CustomJS callbacks that recompute the lesson with lab.teach.jscore, the JavaScript twin of the numpy cores, also
inlined. The initial plots are drawn from the Python cores; moving a control reruns the same formulas in the
browser. Nothing is fetched from the network and no Python runs in the browser: the files open from disk
(file://) in any current browser.

Why Bokeh with CustomJS rather than a WASM notebook export (marimo, Pyodide): a WASM export loads a Python runtime of
tens of MB from a CDN at every visit and needs an HTTP server, while these pages are about 2 MB each, work offline
from disk and update in milliseconds. The price is a JavaScript port of the small cores, which the page tests check
number by number against Python in headless Chromium.
"""
from __future__ import annotations

import argparse
import html
import inspect
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from lab import estimators
from lab.errors import LabError
from lab.estimators import vespo
from lab.reports.style import color as estimator_color
from lab.runs import FILE_MARK, check_file, write_file
from lab.teach import (clip_mask, gvpo_zero_sum, jscore, sampler_truncation, vespo_kernel, vopd_baseline,
                       weight_explosion)
from lab.teach.plots import MU, TARGET

TV_FLOOR = 1e-9
# Estimator series take the lab's colour for that estimator (estimator_color); PALETTE is for the other series, and
# MU and TARGET (as in the notebooks' figures) mark the behaviour policy and the target (pi, pi*) beside an estimator.
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#17becf")
FMT = """
const fmt = (x) => (x === null || x === undefined || Number.isNaN(x)) ? "n/a" : (!isFinite(x) ? "∞" :
  (x !== 0 && (Math.abs(x) < 1e-3 || Math.abs(x) >= 1e4) ? x.toExponential(2) : x.toPrecision(3)));
"""


@dataclass
class Page:
    """One page: ``build()`` returns its Bokeh layout; ``lesson`` names its TeachCore object; ``params`` and
    ``grids`` are what the initial plots were computed with; ``controls`` maps each control's model name to a
    value that must change the plot (used by the page tests)."""

    slug: str
    title: str
    summary: str
    lesson: str
    params: dict
    grids: dict
    python: Callable[[dict], dict]  # params -> the Python core's page_data
    build: Callable[["Page"], object]
    controls: dict = field(default_factory=dict)
    sources: tuple = ()  # names of the data sources the controls update


def _coefficient_hyper(name: str) -> dict:
    """The registry's defaults of ``name`` that its coefficient function takes."""
    info = estimators.info(name)
    params = inspect.signature(info.coefficient).parameters
    return {k: v for k, v in info.defaults.items() if k in params}


def _bk():
    from bokeh import layouts, models, plotting

    return layouts, models, plotting


def _figure(title: str, x_label: str, y_label: str, **kw):
    _, _, plotting = _bk()
    fig = plotting.figure(title=title, height=300, sizing_mode="stretch_width", min_width=280, tools="",
                          toolbar_location=None, x_axis_label=x_label, y_axis_label=y_label, **kw)
    fig.title.text_font_size = "13px"
    return fig


def _text(markup: str, name: str | None = None):
    _, models, _ = _bk()
    return models.Div(text=markup, name=name, sizing_mode="stretch_width",
                      styles={"font-size": "14px", "line-height": "1.45", "overflow-wrap": "anywhere"})


def _slider(name: str, title: str, value, start, end, step, fmt: str = "0[.]00"):
    _, models, _ = _bk()
    return models.Slider(name=name, title=title, value=value, start=start, end=end, step=step, format=fmt,
                         sizing_mode="stretch_width", min_width=200)


def _legend_below(fig, ncols: int = 2):
    """Move the figure's legend under the plot area (it never hides data, and wraps on narrow screens)."""
    legend = fig.legend[0]
    fig.center = [r for r in fig.center if r is not legend]
    legend.orientation = "vertical"
    legend.ncols = ncols
    legend.label_text_font_size = "11px"
    fig.add_layout(legend, "below")
    fig.height += 40 * ((len(legend.items) + ncols - 1) // ncols)


def _page_layout(page: Page, controls: list, plots: list, numbers):
    layouts, models, _ = _bk()
    head = _text(f"<h1 style='font-size:22px;margin:8px 0'>{html.escape(page.title)}</h1>{page.summary}")
    foot = _text("<p style='color:#555;font-size:12px'>Computed in this page by a JavaScript port of "
                 "<code>lab.teach</code> (numbers checked against the Python cores); nothing is loaded from the "
                 "network. Built by <code>python -m lab.teach.pages</code>.</p>")
    box = models.Column(*controls, sizing_mode="stretch_width")
    return layouts.column(head, box, numbers, *plots, foot, sizing_mode="stretch_width",
                          styles={"max-width": "980px", "margin": "0 auto", "padding": "0 12px"})


def _callback(page: Page, args: dict, read: str, draw: str):
    """CustomJS that reads the controls into ``p``, calls TeachCore.<lesson>.pageData(p, GRIDS) and draws ``d``."""
    _, models, _ = _bk()
    code = (FMT + f"const GRIDS = {json.dumps(page.grids)};\nconst BASE = {json.dumps(page.params)};\n"
            f"const p = Object.assign({{}}, BASE);\n{read}\n"
            f"const d = window.TeachCore.{page.lesson}.pageData(p, GRIDS);\n{draw}")
    return models.CustomJS(args=args, code=code)


def _wire(callback, widgets):
    for w in widgets:
        w.js_on_change("value", callback)
    return callback


def _dodge(column: str, offset: float, range):
    from bokeh.transform import dodge

    return dodge(column, offset, range=range)


# ---- 1. why sequence weights explode --------------------------------------------------------------------------

def _weights_page(page: Page):
    _, models, _ = _bk()
    p0 = page.params
    d = page.python(p0)
    kl = _slider("log10_kl", "log10 per-token KL(mu||pi)", math.log10(p0["kl"]), -3.0, 0.0, 0.05)
    length = _slider("length", "response length T (tokens)", p0["length"], 1, 1024, 1, "0")
    vocab = _slider("vocab", "vocabulary size V", p0["vocab"], 2, 512, 1, "0")
    ess = models.ColumnDataSource({"x": d["lengths"], "y": d["ess_frac"]}, name="ess")
    grow = models.ColumnDataSource({"x": d["lengths"], "chi2": d["chi2_seq"], "var": d["var_log_w"]}, name="growth")
    here = models.ColumnDataSource({"x": [p0["length"]], "y": [d["at_length"]["ess_frac"]]}, name="here")
    f1 = _figure("ESS fraction (1 + chi2_tok)^-T", "length T", "ESS / batch size", x_axis_type="log",
                 y_axis_type="log", y_range=(1e-16, 1.5))
    f1.line("x", "y", source=ess, line_width=2, color=PALETTE[0], legend_label="ESS fraction")
    f1.scatter("x", "y", source=here, size=10, color=PALETTE[1], legend_label="your T")
    f1.add_layout(models.Span(location=1 / 256, dimension="width", line_dash="dashed", line_color="#777"))
    f1.legend.location = "bottom_left"
    f2 = _figure("chi2_seq against Var(log W)", "length T", "value", x_axis_type="log",
                 y_axis_type="log", y_range=(1e-4, 1e12))
    f2.line("x", "chi2", source=grow, line_width=2, color=PALETTE[1], legend_label="chi2_seq = (1+chi2_tok)^T - 1")
    f2.line("x", "var", source=grow, line_width=2, color=PALETTE[2], legend_label="Var(log W) = T Var(log rho)")
    f2.legend.location = "top_left"
    numbers = _text("", name="numbers")
    cb = _callback(page, dict(ess=ess, grow=grow, here=here, kl=kl, length=length, vocab=vocab, numbers=numbers),
                   "p.kl = Math.pow(10, kl.value); p.length = Math.round(length.value); p.vocab = Math.round(vocab.value);",
                   """ess.data = {x: d.lengths, y: d.ess_frac};
grow.data = {x: d.lengths, chi2: d.chi2_seq, var: d.var_log_w};
here.data = {x: [p.length], y: [d.at_length.ess_frac]};
const t = d.token, a = d.at_length, t10 = Math.ceil(Math.log(10) / Math.log1p(t.chi2) * (1 - 1e-12));
numbers.text = `<b>Per token:</b> KL(mu||pi) = ${fmt(t.kl_mu_pi)}, chi2 = ${fmt(t.chi2)}, Var(log rho) = ${fmt(t.var_log_rho)}. ` +
  `<b>At T = ${p.length}:</b> ESS fraction = ${fmt(a.ess_frac)}, chi2_seq = ${fmt(a.chi2_seq)}, ` +
  `Var(log W) = ${fmt(a.var_log_w)}. The ESS fraction falls below 10 % at T = ${t10}; ` +
  `below the dashed line (1/256) a batch of 256 holds less than one effective sequence.`;""")
    _wire(cb, (kl, length, vocab))
    return _page_layout(page, [kl, length, vocab], [f1, f2], numbers), cb


# ---- 2. what clipping and masking throw away ------------------------------------------------------------------

def _clip_page(page: Page):
    _, models, _ = _bk()
    p0, g = page.params, page.grids
    d = page.python(p0)
    methods = list(p0["methods"])
    labels = [clip_mask.LABELS[m] for m in methods]
    kl = _slider("log10_kl", "log10 per-token KL(mu||pi)", math.log10(p0["kl"]), -2.0, 0.0, 0.05)
    vocab = _slider("vocab", "vocabulary size V", p0["vocab"], 2, 512, 1, "0")
    seed = _slider("seed", "draw (seed of pi, mu and the rewards)", p0["seed"], 0, 30, 1, "0")
    show = models.Select(name="method", title="colour the tokens by", value="ppo_clip",
                         options=[(m, clip_mask.LABELS[m]) for m in methods], sizing_mode="stretch_width")

    def token_data(dd, method):
        rho, coef = np.asarray(dd["rho"]), np.asarray(dd["coef"][method])
        state = np.where(coef == 0, "dropped", np.where(np.isclose(coef, rho), "kept", "reweighted"))
        return {"x": np.log(rho).tolist(), "y": dd["advantage"], "size": (4 + 30 * np.sqrt(dd["mu"])).tolist(),
                "color": [{"dropped": PALETTE[1], "kept": PALETTE[0], "reweighted": PALETTE[3]}[s] for s in state]}

    tok = models.ColumnDataSource(token_data(d, "ppo_clip"), name="tokens")
    bars = models.ColumnDataSource({"method": labels, "cos": [d["at"][m]["cos"] for m in methods],
                                    "mass": [d["at"][m]["mass_lost"] for m in methods],
                                    "zeroed": [d["at"][m]["zeroed"] for m in methods]}, name="bars")
    curves = models.ColumnDataSource({"x": [g["kl_grid"]] * len(methods), "y": [d["grid"][m]["cos"] for m in methods],
                                      "color": [estimator_color(m) for m in methods], "label": labels}, name="curves")
    f1 = _figure("Tokens: kept, reweighted, dropped", "log rho = log pi(y) - log mu(y)  (dot size ~ mu(y))",
                 "advantage A")
    f1.scatter("x", "y", size="size", color="color", source=tok, alpha=0.7)
    f2 = _figure("At your KL", "", "", x_range=labels, y_range=(-0.05, 1.05))
    f2.vbar(x=_dodge("method", -0.25, range=f2.x_range), top="cos", width=0.22, source=bars,
            color=PALETTE[0], legend_label="cos(g, grad J)")
    f2.vbar(x=_dodge("method", 0.0, range=f2.x_range), top="mass", width=0.22, source=bars,
            color=PALETTE[1], legend_label="IS mass lost")
    f2.vbar(x=_dodge("method", 0.25, range=f2.x_range), top="zeroed", width=0.22, source=bars,
            color=PALETTE[3], legend_label="mu-mass dropped")
    f2.xaxis.major_label_orientation = 0.5
    _legend_below(f2, 3)
    f3 = _figure("cos(expected update, grad J)", "per-token KL(mu||pi)", "cosine", y_range=(-0.05, 1.05))
    f3.multi_line("x", "y", color="color", legend_field="label", source=curves, line_width=2)
    marker = models.Span(location=p0["kl"], dimension="height", line_dash="dashed", line_color="#777", name="marker")
    f3.add_layout(marker)
    _legend_below(f3, 3)
    numbers = _text("", name="numbers")
    cb = _callback(page, dict(tok=tok, bars=bars, curves=curves, kl=kl, vocab=vocab, seed=seed, show=show,
                              marker=marker, numbers=numbers),
                   "p.kl = Math.pow(10, kl.value); p.vocab = Math.round(vocab.value); p.seed = Math.round(seed.value);",
                   """const m = show.value, rho = d.rho, c = d.coef[m];
const cols = {dropped: "#d62728", kept: "#1f77b4", reweighted: "#ff7f0e"};
tok.data = {x: rho.map(Math.log), y: d.advantage, size: d.mu.map((v) => 4 + 30 * Math.sqrt(v)),
  color: rho.map((r, i) => cols[c[i] === 0 ? "dropped" : (Math.abs(c[i] - r) <= 1e-8 + 1e-5 * Math.abs(r) ? "kept" : "reweighted")])};
bars.data = {method: bars.data.method, cos: p.methods.map((k) => d.at[k].cos),
  mass: p.methods.map((k) => d.at[k].mass_lost), zeroed: p.methods.map((k) => d.at[k].zeroed)};
curves.data = {x: p.methods.map(() => d.kl_grid), y: p.methods.map((k) => d.grid[k].cos),
  color: curves.data.color, label: curves.data.label};
marker.location = p.kl;
const a = d.at[m];
numbers.text = `<b>${show.options.find((o) => o[0] === m)[1]}</b> at KL ${fmt(p.kl)}: drops tokens holding ${fmt(100 * a.zeroed)} % of mu's mass, ` +
  `removes ${fmt(100 * a.mass_lost)} % of the IS weight mass; its expected update has cosine ${fmt(a.cos)} with grad J, ` +
  `length ${fmt(a.norm_ratio)} x; of the lost vector ${fmt(a.lost_along)} lies along grad J (a shorter step) and ` +
  `${fmt(a.lost_across)} across it (a wrong direction), in units of |grad J|.`;""")
    _wire(cb, (kl, vocab, seed, show))
    return _page_layout(page, [kl, vocab, seed, show], [f1, f2, f3], numbers), cb


# ---- 3. VESPO's kernel -------------------------------------------------------------------------------------------

def _vespo_page(page: Page):
    _, models, _ = _bk()
    p0, g = page.params, page.grids
    d = page.python(p0)
    k = _slider("k", "k (tilt towards pi)", p0["k"], 0.0, 5.0, 0.1, "0.0")
    lam = _slider("lam", "lambda (cut of large W)", p0["lam"], 0.1, 5.0, 0.1, "0.0")
    kl = _slider("kl", "per-token KL(mu||pi)", p0["kl"], 0.0, 0.5, 0.01)
    length = _slider("length", "response length T (all 4^T responses enumerated)", p0["length"], 1, 8, 1, "0")
    kern = models.ColumnDataSource({"x": g["log_w_grid"], "phi": d["phi"], "is": np.exp(g["log_w_grid"]).tolist(),
                                    "kw": d["k_w"] or [float("nan")] * len(g["log_w_grid"])}, name="kernel")
    edges = np.asarray(g["edges"])
    hist = models.ColumnDataSource({"left": edges[:-1].tolist(), "right": edges[1:].tolist(), **d["hist"]},
                                   name="hist")
    means = models.ColumnDataSource({"x": [d["summary"][f"mean_logw_{s}"] for s in ("mu", "q", "pi")],
                                     "y": [0.0, 0.0, 0.0], "color": [MU, estimator_color("vespo"), TARGET]},
                                    name="means")
    f1 = _figure("phi(W) stays under K W", "log W", "coefficient", y_range=(0, 3.0))
    f1.line("x", "is", source=kern, color="#999", line_dash="dotted", legend_label="W (importance sampling)")
    f1.line("x", "kw", source=kern, color=PALETTE[1], line_dash="dashed", legend_label="K W")
    f1.line("x", "phi", source=kern, color=estimator_color("vespo"), line_width=2, legend_label="phi(W)")
    f1.legend.location = "top_left"
    f2 = _figure("mu, Q = mu phi(W) / Z and pi on the log-W axis", "log W = log pi(y) - log mu(y)  (triangles: means)",
                 "probability", y_range=(0, 1.0))
    for key, color, label in (("mu", MU, "mu"), ("q", estimator_color("vespo"), "Q (VESPO)"), ("pi", TARGET, "pi")):
        f2.quad(left="left", right="right", top=key, bottom=0, source=hist, fill_color=color, fill_alpha=0.25,
                line_color=color, legend_label=label)
    f2.scatter("x", "y", source=means, color="color", size=12, marker="triangle")
    f2.legend.location = "top_right"
    numbers = _text("", name="numbers")
    cb = _callback(page, dict(kern=kern, hist=hist, means=means, k=k, lam=lam, kl=kl, length=length, numbers=numbers,
                              y1=f2.y_range),
                   "p.k = k.value; p.lam = lam.value; p.kl = kl.value; p.length = Math.round(length.value);",
                   """kern.data = {x: d.log_w_grid, phi: d.phi, is: d.log_w_grid.map(Math.exp),
  kw: d.k_w === null ? d.log_w_grid.map(() => NaN) : d.k_w};
hist.data = {left: d.edges.slice(0, -1), right: d.edges.slice(1), mu: d.hist.mu, q: d.hist.q, pi: d.hist.pi};
const s = d.summary;
means.data = {x: [s.mean_logw_mu, s.mean_logw_q, s.mean_logw_pi], y: [0, 0, 0], color: means.data.color};
y1.end = Math.min(1, 1.1 * Math.max(...d.hist.mu, ...d.hist.q, ...d.hist.pi));
numbers.text = `Z = E_mu[phi] = ${fmt(s.Z)}, C = E_Q[W] = ${fmt(s.C)}, K = ${fmt(s.K)}. ` +
  `<b>Proposition 3.1:</b> E_mu[phi^2] = ${fmt(s.phi2)} <= Z K C = ${fmt(s.bound)} (ratio ${fmt(s.ratio)}). ` +
  `Mean log W: mu ${fmt(s.mean_logw_mu)}, Q ${fmt(s.mean_logw_q)}, pi ${fmt(s.mean_logw_pi)} ` +
  `(Q's position from mu (0) to pi (1): ${fmt(s.position)}; phi peaks at log(k/lambda) = ${fmt(Math.log(p.k / p.lam))}). ` +
  `Population ESS: VESPO ${fmt(100 * s.ess_vespo)} %, sequence IS ${fmt(100 * s.ess_is)} %.`;""")
    _wire(cb, (k, lam, kl, length))
    return _page_layout(page, [k, lam, kl, length], [f1, f2], numbers), cb


# ---- 4. GVPO's zero-sum trick ----------------------------------------------------------------------------------

def _gvpo_page(page: Page):
    _, models, _ = _bk()
    p0, g = page.params, page.grids
    d = page.python(p0)
    samplers = list(g["samplers"])
    beta = _slider("beta", "beta (KL strength)", p0["beta"], 0.05, 2.0, 0.05)
    lr = _slider("lr", "step size (units of 1/beta^2)", p0["lr"], 0.1, 1.9, 0.1, "0.0")
    steps = _slider("steps", "gradient steps", p0["steps"], 10, 600, 10, "0")
    pick = models.Select(name="sampler", title="final policy of the sampler", value="uniform",
                         options=[(s, f"{s}: {gvpo_zero_sum.SAMPLER_TEXT[s]}") for s in samplers],
                         sizing_mode="stretch_width")
    steps_axis = list(range(p0["steps"] + 1))
    floor = lambda a: np.maximum(a, TV_FLOOR).tolist()  # noqa: E731  (a log axis cannot show 0)
    tv = models.ColumnDataSource({"x": [steps_axis] * (2 * len(samplers)),
                                  "y": [floor(d["tv"][s]) for s in samplers]
                                  + [floor(d["tv_uncentred"][s]) for s in samplers],
                                  "color": list(PALETTE[:len(samplers)]) * 2,
                                  "dash": ["solid"] * len(samplers) + ["dashed"] * len(samplers),
                                  "label": [f"{s} (GVPO)" for s in samplers] + [f"{s} (uncentred)" for s in samplers]},
                                 name="tv")
    idx = [str(i) for i in range(len(d["ref"]))]
    dist = models.ColumnDataSource({"y": idx, "ref": d["ref"], "opt": d["optimum"], "gvpo": d["final"]["uniform"],
                                    "naive": d["final_uncentred"]["uniform"]}, name="dist")
    f1 = _figure("Distance to pi* = pi_ref e^(R/beta) / Z", "step", "TV(pi, pi*)", y_axis_type="log",
                 y_range=(TV_FLOOR, 1))
    f1.multi_line("x", "y", color="color", line_dash="dash", legend_field="label", source=tv, line_width=2)
    _legend_below(f1, 2)
    f2 = _figure("Final policies", "response", "probability", x_range=idx)
    for off, key, color, label in ((-0.3, "ref", "#999", "pi_ref"), (-0.1, "opt", TARGET, "pi*"),
                                   (0.1, "gvpo", estimator_color("gvpo"), "GVPO"),
                                   (0.3, "naive", PALETTE[1], "uncentred")):
        f2.vbar(x=_dodge("y", off, range=f2.x_range), top=key, width=0.18, source=dist, color=color,
                legend_label=label)
    _legend_below(f2, 4)
    numbers = _text("", name="numbers")
    cb = _callback(page, dict(tv=tv, dist=dist, beta=beta, lr=lr, steps=steps, pick=pick, numbers=numbers),
                   "p.beta = beta.value; p.lr = lr.value; p.steps = Math.round(steps.value);",
                   """const S = GRIDS.samplers, xs = Array.from({length: p.steps + 1}, (_, i) => i);
const fl = (a) => a.map((v) => Math.max(v, 1e-9));
tv.data = {x: S.concat(S).map(() => xs), y: S.map((s) => fl(d.tv[s])).concat(S.map((s) => fl(d.tv_uncentred[s]))),
  color: tv.data.color, dash: tv.data.dash, label: tv.data.label};
const s = pick.value;
dist.data = {y: dist.data.y, ref: d.ref, opt: d.optimum, gvpo: d.final[s], naive: d.final_uncentred[s]};
const last = (a) => a[a.length - 1];
numbers.text = `log Z = ${fmt(d.log_z)} (beta log Z = ${fmt(p.beta * d.log_z)}: the constant the weights never see). ` +
  `Final TV to pi* with GVPO: ` + S.map((k) => `${k} ${fmt(last(d.tv[k]))}`).join(", ") +
  `; uncentred: ` + S.map((k) => `${k} ${fmt(last(d.tv_uncentred[k]))}`).join(", ") + `.`;""")
    _wire(cb, (beta, lr, steps, pick))
    return _page_layout(page, [beta, lr, steps, pick], [f1, f2], numbers), cb


# ---- 5. vOPD's baseline ----------------------------------------------------------------------------------------

def _vopd_page(page: Page):
    _, models, _ = _bk()
    p0 = page.params
    d = page.python(p0)
    vocab = _slider("vocab", "vocabulary size V", p0["vocab"], 2, 256, 1, "0")
    sharp = _slider("sharpness", "logit scale (peakedness)", p0["sharpness"], 0.2, 4.0, 0.1, "0.0")
    close = _slider("closeness", "teacher closeness to the student (0: random teacher)", p0["closeness"], 0.0, 0.99,
                    0.01)
    seed = _slider("seed", "draw (seed)", p0["seed"], 0, 50, 1, "0")
    m = d["pair"]
    curve = models.ColumnDataSource({"b": d["baselines"], "v": d["variance"]}, name="parabola")
    marks = models.ColumnDataSource({"b": [0.0, m["value"], m["b_star"]], "v": [m["var_opd"], m["var_vopd"], m["var_best"]],
                                     "color": [estimator_color("opd"), estimator_color("vopd"), PALETTE[2]],
                                     "label": ["OPD (b = 0)", "vOPD (b = V = -KL)", "best constant b*"]}, name="marks")
    band = models.BoxAnnotation(left=min(0.0, 2 * m["b_star"]), right=max(0.0, 2 * m["b_star"]), fill_alpha=0.12,
                                fill_color=PALETTE[2], name="band")
    frac = models.ColumnDataSource({"x": d["vocabs"], "y": d["helps_frac"], "r": d["ratio_median"]}, name="helps")
    here = models.Span(location=p0["vocab"], dimension="height", line_dash="dashed", line_color="#777", name="here")
    f1 = _figure("Variance against the baseline b", "baseline b  (green band: b lowers the variance)",
                 "trace of the covariance")
    f1.line("b", "v", source=curve, line_width=2, color="#444")
    f1.scatter("b", "v", source=marks, color="color", size=11, legend_field="label")
    f1.add_layout(band)
    _legend_below(f1, 3)
    f2 = _figure("Where vOPD lowers the variance", f"vocabulary size V  ({p0['draws']} random pairs each)", "share",
                 x_axis_type="log", y_range=(0, 1.6))
    f2.line("x", "y", source=frac, line_width=2, color=estimator_color("vopd"), legend_label="vOPD helps")
    f2.line("x", "r", source=frac, line_width=2, color="#444", line_dash="dashed",
            legend_label="median Var(vOPD)/Var(OPD)")
    f2.add_layout(models.Span(location=0.5, dimension="width", line_color="#bbb"))
    f2.add_layout(here)
    _legend_below(f2, 2)
    numbers = _text("", name="numbers")
    cb = _callback(page, dict(curve=curve, marks=marks, band=band, frac=frac, here=here, vocab=vocab, sharp=sharp,
                              close=close, seed=seed, numbers=numbers),
                   "p.vocab = Math.round(vocab.value); p.sharpness = sharp.value; p.closeness = close.value; "
                   "p.seed = Math.round(seed.value);",
                   """const m = d.pair;
curve.data = {b: d.baselines, v: d.variance};
marks.data = {b: [0, m.value, m.b_star], v: [m.var_opd, m.var_vopd, m.var_best], color: marks.data.color,
  label: marks.data.label};
band.left = Math.min(0, 2 * m.b_star); band.right = Math.max(0, 2 * m.b_star);
frac.data = {x: d.vocabs, y: d.helps_frac, r: d.ratio_median};
here.location = p.vocab;
numbers.text = `This pair: V = -KL = ${fmt(m.value)}, b* = ${fmt(m.b_star)}, so a baseline helps inside ` +
  `(${fmt(Math.min(0, 2 * m.b_star))}, ${fmt(Math.max(0, 2 * m.b_star))}). Var(OPD) = ${fmt(m.var_opd)}, ` +
  `Var(vOPD) = ${fmt(m.var_vopd)} (<b>${m.helps ? "lower" : "higher"}</b>, ratio ${fmt(m.ratio)}), ` +
  `Var(b*) = ${fmt(m.var_best)}.`;""")
    _wire(cb, (vocab, sharp, close, seed))
    return _page_layout(page, [vocab, sharp, close, seed], [f1, f2], numbers), cb


# ---- 6. sampler truncation ------------------------------------------------------------------------------------

def _truncation_tokens(d, shown: int = 24) -> dict:
    order = np.argsort(-np.asarray(d["pi"]), kind="stable")[:shown]
    return {"x": list(range(len(order))), "pi": [d["pi"][i] for i in order], "mu": [d["mu"][i] for i in order],
            "color": [PALETTE[0] if d["kept"][i] else "#bbbbbb" for i in order]}


def _truncation_bias(d, truth: str, methods) -> dict:
    rows = [(m, r) for m in methods for r in ("plain", "replay")]
    xs = [d["grid"]] * len(rows)
    ys = [d["curves"]["bias"][m][r][truth] for m, r in rows]
    out = {"x": xs, "y": ys, "color": [estimator_color(m) for m, _ in rows],
           "dash": ["solid" if r == "plain" else "dashed" for _, r in rows],
           "width": [4 - 1.2 * (i // 2) for i in range(len(rows))],
           "label": [f"{sampler_truncation.LABELS[m]}{', replay' if r == 'replay' else ''}" for m, r in rows]}
    if truth == "full":
        out = {k: v + [{"x": d["grid"], "y": d["curves"]["gap"], "color": "#000000", "dash": "dotted", "width": 2,
                        "label": "gap: deployed vs full"}[k]] for k, v in out.items()}
    return out


def _truncation_page(page: Page):
    _, models, _ = _bk()
    p0, g = page.params, page.grids
    d = page.python(p0)
    methods = list(p0["methods"])
    r0 = g["ranges"][p0["kind"]]
    kind = models.Select(name="kind", title="sampler", value=p0["kind"],
                         options=[(k, sampler_truncation.KIND_LABELS[k]) for k in sampler_truncation.KINDS],
                         sizing_mode="stretch_width")
    level = _slider("level", g["titles"][p0["kind"]], p0["level"], r0["start"], r0["end"], r0["step"])
    temp = _slider("temperature", "sampler temperature (the kept set is chosen after it)", p0["temperature"], 0.5,
                   2.0, 0.05)
    kl = _slider("kl", "staleness: KL(sampler's logits || pi) before truncation", p0["kl"], 0.0, 0.5, 0.01)
    seed = _slider("seed", "draw (seed of pi, the staleness direction and the rewards)", p0["seed"], 0, 30, 1, "0")
    tok = models.ColumnDataSource(_truncation_tokens(d), name="tokens")
    c = d["curves"]
    ratio = models.ColumnDataSource({"x": d["grid"], "m": c["kept_mass"], "mean": c["mean_ratio"],
                                     "out": c["share_out"], "out_replay": c["share_out_replay"]}, name="ratio")
    full = models.ColumnDataSource(_truncation_bias(d, "full", methods), name="bias_full")
    dep = models.ColumnDataSource(_truncation_bias(d, "deployed", methods), name="bias_deployed")
    flipped = p0["kind"] != "min_p"
    f1 = _figure("The kept set: pi (blue kept, grey dropped) and the sampler mu (dots)",
                 "token, most probable first (the first 24)", "probability")
    f1.vbar(x="x", top="pi", width=0.8, color="color", source=tok, legend_label="pi")
    f1.scatter("x", "mu", source=tok, color=MU, size=6, legend_label="sampler mu")
    f2 = _figure(f"Kept mass = mean ratio; share of sampled ratios outside [{p0['band'][0]:g}, {p0['band'][1]:g}]",
                 g["titles"][p0["kind"]], "value", y_range=(-0.05, 1.05))
    f2.line("x", "m", source=ratio, line_width=2, color=PALETTE[0], legend_label="kept mass m = pi(S)")
    f2.scatter("x", "mean", source=ratio, color=PALETTE[1], size=5, legend_label="E_mu[pi/mu]")
    f2.line("x", "out", source=ratio, line_width=2, color=PALETTE[3], legend_label="outside the band, no replay")
    f2.line("x", "out_replay", source=ratio, line_width=2, color=PALETTE[2], line_dash="dashed",
            legend_label="outside the band, replay")
    _legend_below(f2, 2)
    f3 = _figure("Bias of the expected one-token update against grad J(pi_S), the deployed policy",
                 g["titles"][p0["kind"]], "|E[update] - truth| / |grad J(pi)|")
    f3.multi_line("x", "y", color="color", line_dash="dash", line_width="width", legend_field="label", source=dep)
    _legend_below(f3, 3)
    f4 = _figure("... and against grad J(pi), the full policy", g["titles"][p0["kind"]],
                 "|E[update] - truth| / |grad J(pi)|")
    f4.multi_line("x", "y", color="color", line_dash="dash", line_width="width", legend_field="label", source=full)
    _legend_below(f4, 3)
    marks = []
    for i, f in enumerate((f2, f3, f4)):
        f.x_range.flipped = flipped
        mark = models.Span(location=p0["level"], dimension="height", line_dash="dashed", line_color="#777",
                           name=f"marker{i}")
        f.add_layout(mark)
        marks.append(mark)
    numbers = _text("", name="numbers")
    cb = _callback(page, dict(tok=tok, ratio=ratio, full=full, dep=dep, kind=kind, level=level, temp=temp, kl=kl,
                              seed=seed, numbers=numbers, marks=marks, ranges=[f.x_range for f in (f2, f3, f4)],
                              axes=[f.xaxis[0] for f in (f2, f3, f4)]),
                   """if (cb_obj === kind) {  // the knob's range, title and starting value follow the kind
  const r = GRIDS.ranges[kind.value];
  level.start = Math.min(level.start, r.start); level.end = Math.max(level.end, r.end);
  level.step = r.step; level.format = kind.value === "top_k" ? "0" : "0[.]00"; level.title = GRIDS.titles[kind.value];
  level.value = r.value; level.start = r.start; level.end = r.end;
  for (const x of ranges) x.flipped = kind.value !== "min_p";
  for (const ax of axes) ax.axis_label = GRIDS.titles[kind.value];
}
p.kind = kind.value; p.level = kind.value === "top_k" ? Math.round(level.value) : level.value;
p.temperature = temp.value; p.kl = kl.value; p.seed = Math.round(seed.value);""",
                   """const order = d.pi.map((v, i) => i).sort((a, b) => d.pi[b] - d.pi[a]).slice(0, 24);
tok.data = {x: order.map((v, j) => j), pi: order.map((i) => d.pi[i]), mu: order.map((i) => d.mu[i]),
  color: order.map((i) => (d.kept[i] ? "#1f77b4" : "#bbbbbb"))};
const c = d.curves;
ratio.data = {x: d.grid, m: c.kept_mass, mean: c.mean_ratio, out: c.share_out, out_replay: c.share_out_replay};
const bias = (truth) => {
  const rows = [];
  for (const m of p.methods) for (const r of ["plain", "replay"]) rows.push(c.bias[m][r][truth]);
  return rows;
};
const nd = dep.data.x.length;
dep.data = {x: rows(nd), y: bias("deployed"), color: dep.data.color, dash: dep.data.dash, width: dep.data.width,
  label: dep.data.label};
full.data = {x: rows(nd + 1), y: bias("full").concat([c.gap]), color: full.data.color, dash: full.data.dash,
  width: full.data.width, label: full.data.label};
function rows(n) { return Array.from({length: n}, () => d.grid); }
for (const mk of marks) mk.location = p.level;
const a = d.at, b = a.bias.token_is, pc = (x) => fmt(100 * x) + " %";
const shown = p.kind === "top_k" ? String(p.level) : fmt(p.level);
numbers.text = `<b>${kind.options.find((o) => o[0] === p.kind)[1]} ${shown}</b> keeps ${a.kept_count} of ` +
  `${p.vocab} tokens holding <b>m = ${fmt(a.kept_mass)}</b> of pi; the mean ratio pi/mu under the sampler is ` +
  `${fmt(a.mean_ratio)} (= m). Sampled ratios outside [${p.band[0]}, ${p.band[1]}]: ${pc(a.share_out)} without ` +
  `replay, ${pc(a.share_out_replay)} with. Importance sampling's expected update is off the deployed gradient by ` +
  `${fmt(b.plain.deployed)} without replay and ${fmt(b.replay.deployed)} with it; off the full gradient by ` +
  `${fmt(b.replay.full)} with replay: the gap that no correction closes (all in units of |grad J(pi)|).`;""")
    _wire(cb, (kind, level, temp, kl, seed))
    return _page_layout(page, [kind, level, temp, kl, seed], [f1, f2, f3, f4], numbers), cb


# ---- the page registry ---------------------------------------------------------------------------------------

def _clip_python(p: dict) -> dict:
    return clip_mask.page_data(p["vocab"], p["kl"], p["seed"], p["sharpness"], kl_grid=CLIP_GRID)


CLIP_GRID = np.linspace(0.0, 1.0, 41)[1:].tolist()
WEIGHT_LENGTHS = np.unique([int(2 ** (i / 4)) for i in range(41)]).tolist()
VESPO_EDGES = np.linspace(-8.0, 8.0, 33).tolist()
VESPO_GRID = np.linspace(-4.0, 3.0, 141).tolist()


def _truncation_python(p: dict) -> dict:
    return sampler_truncation.page_data(p["kind"], p["level"], p["vocab"], p["seed"], p["sharpness"], p["kl"],
                                        p["temperature"], TRUNCATION_GRIDS[p["kind"]])


TRUNCATION_VOCAB = 64
TRUNCATION_GRIDS = {k: sampler_truncation.level_grid(k, TRUNCATION_VOCAB) for k in sampler_truncation.KINDS}


def pages() -> list[Page]:
    """The six pages with their default parameters."""
    return [
        Page("weight_explosion", "Why sequence weights explode with length",
             "<p>A stale sampler mu and the policy pi differ by a small KL per token. The sequence weight "
             "W = pi(y)/mu(y) multiplies T token ratios, so E_mu[W²] = (1 + chi2_tok)<sup>T</sup>: the effective "
             "sample size shrinks exponentially with length while Var(log W) grows only linearly.</p>",
             "weightExplosion", {"kl": 0.01, "vocab": 32, "length": 256, "seed": 0, "sharpness": 2.0},
             {"lengths": WEIGHT_LENGTHS},
             lambda p: weight_explosion.page_data(p["kl"], p["vocab"], p["length"], p["seed"], p["sharpness"],
                                                  WEIGHT_LENGTHS),
             _weights_page, {"log10_kl": -1.0, "length": 64, "vocab": 8}, ("ess", "growth", "here")),
        Page("clip_mask", "What clipping and masking throw away",
             "<p>One state, V tokens, a stale sampler. Each correction multiplies A ∇log pi(y) by a coefficient "
             "c(rho, A): importance sampling uses rho (unbiased here), PPO drops tokens outside its band, TIS caps, "
             "IcePop masks, CISPO caps a detached weight, SAPO gates softly. What is dropped changes the expected "
             "update's length and direction.</p>",
             "clipMask", {"kl": 0.1, "vocab": 64, "seed": 0, "sharpness": 2.0, "methods": list(clip_mask.METHODS),
                          "hyper": {m: _coefficient_hyper(m) for m in clip_mask.METHODS}},
             {"kl_grid": CLIP_GRID}, _clip_python, _clip_page,
             {"log10_kl": -0.5, "vocab": 16, "seed": 3, "method": "mis_token"}, ("tokens", "bars", "curves")),
        Page("vespo_kernel", "VESPO's kernel: a proposal between mu and pi, and its bound",
             "<p>VESPO replaces W by phi(W) = W<sup>k</sup> e<sup>lambda(1-W)</sup>, which turns the update into an "
             "on-policy gradient under Q = mu phi(W)/Z. Move k and lambda to see where Q sits relative to mu and pi, "
             "and check Proposition 3.1, E_mu[phi²] ≤ Z K C, on every enumerated response.</p>",
             "vespoKernel", {"k": vespo.K_POS, "lam": vespo.LAMBDA_POS, "kl": 0.1, "length": 6, "vocab": 4,
                             "seed": 0, "sharpness": 1.0},
             {"edges": VESPO_EDGES, "log_w_grid": VESPO_GRID},
             lambda p: vespo_kernel.page_data(p["k"], p["lam"], p["kl"], p["length"], p["vocab"], p["seed"],
                                              p["sharpness"], np.asarray(VESPO_EDGES)),
             _vespo_page, {"k": 3.0, "lam": 2.0, "kl": 0.3, "length": 3}, ("kernel", "hist", "means")),
        Page("gvpo_zero_sum", "GVPO's zero-sum trick",
             "<p>GVPO's weights w<sub>i</sub> = (R<sub>i</sub> − mean R) − beta (l<sub>i</sub> − mean l) sum to "
             "zero in every group, so the unknown beta log Z(x) cancels and the loss 1/2 Var<sub>mu</sub>(beta l − R) "
             "is minimised at pi* = pi_ref e<sup>R/beta</sup>/Z from any sampler that covers the responses. The "
             "uncentred regression 1/2 E<sub>mu</sub>[(beta l − R)²] is not.</p>",
             "gvpoZeroSum", {"beta": 0.5, "lr": 1.0, "steps": 300, "n": 8, "seed": 0, "sharpness": 1.0},
             {"samplers": list(gvpo_zero_sum.SAMPLERS)},
             lambda p: gvpo_zero_sum.page_data(p["beta"], p["lr"], p["steps"], p["n"], p["seed"], p["sharpness"]),
             _gvpo_page, {"beta": 0.2, "lr": 0.5, "steps": 100, "sampler": "partial"}, ("tv", "dist")),
        Page("vopd_baseline", "vOPD's baseline: unbiased, but not always lower variance",
             "<p>On-policy distillation's per-token gradient r(y)(e<sub>y</sub> − p) with r = log q − log p. vOPD "
             "subtracts V = −KL(p‖q): unbiased because E<sub>p</sub>[e<sub>y</sub> − p] = 0. A constant baseline "
             "lowers the variance only between 0 and 2b*, b* = E[r s]/E[s], s = ‖e<sub>y</sub> − p‖²: on small "
             "vocabularies V often falls outside.</p>",
             "vopdBaseline", {"vocab": 3, "sharpness": 1.0, "closeness": 0.0, "seed": 0, "draws": 300},
             {"vocabs": list(vopd_baseline.DEFAULT_VOCABS)},
             lambda p: vopd_baseline.page_data(p["vocab"], p["sharpness"], p["closeness"], p["seed"], p["draws"],
                                               vopd_baseline.DEFAULT_VOCABS),
             _vopd_page, {"vocab": 64, "sharpness": 2.5, "closeness": 0.5, "seed": 7}, ("parabola", "marks", "helps")),
        Page("sampler_truncation", "Sampler truncation: top-p, the kept mass and mask replay",
             "<p>The engine samples from the kept set S of top-p (or top-k, min-p), renormalised: mu = pi restricted "
             "to S / pi(S). Every sampled token's ratio pi/mu is then the kept mass m = pi(S), so the ratio averages "
             "m, not 1. Replaying the mask (the trainer's log-softmax renormalised over S) makes the ratio 1 and "
             "importance sampling exact for the deployed policy; nothing recovers the full policy's gradient, "
             "because tokens outside S are never drawn.</p>",
             "samplerTruncation",
             {"kind": "top_p", "level": 0.8, "vocab": TRUNCATION_VOCAB, "seed": 0, "sharpness": 2.0, "kl": 0.0,
              "temperature": 1.0, "methods": list(sampler_truncation.METHODS),
              "hyper": {m: _coefficient_hyper(m) for m in sampler_truncation.METHODS},
              "band": list(sampler_truncation.BAND)},
             {**TRUNCATION_GRIDS, "ranges": {k: sampler_truncation.level_range(k, TRUNCATION_VOCAB)
                                             for k in sampler_truncation.KINDS},
              "titles": dict(sampler_truncation.LEVEL_TITLES)},
             _truncation_python, _truncation_page,
             {"level": 0.7, "kind": "min_p", "temperature": 1.5, "kl": 0.2, "seed": 3},
             ("tokens", "ratio", "bias_full", "bias_deployed")),
    ]


def render(page: Page) -> str:
    """The page as one self-contained HTML string (BokehJS and the JavaScript cores inline)."""
    from bokeh.document import Document
    from bokeh.embed import file_html
    from bokeh.events import DocumentReady
    from bokeh.resources import INLINE

    layout, callback = page.build(page)
    doc = Document()
    doc.add_root(layout)
    doc.js_on_event(DocumentReady, callback)  # fill the numbers line (and redraw) with the JavaScript core
    doc.title = page.title
    text = file_html(doc, resources=INLINE, title=page.title)
    core = f'<script type="text/javascript">{jscore.SOURCE}</script>\n'
    meta = f'{FILE_MARK}\n<meta name="viewport" content="width=device-width, initial-scale=1">\n'
    return text.replace("<head>", "<head>\n" + meta + core, 1)


def _index(built: list[Page]) -> str:
    items = "".join(f'<li><a href="{p.slug}.html">{html.escape(p.title)}</a></li>' for p in built)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">{FILE_MARK}<meta name="viewport" content="width=device-width, initial-scale=1">
<title>Off-policy variance lab: lessons</title>
<style>body {{ font-family: system-ui, sans-serif; max-width: 760px; margin: 2em auto; padding: 0 1em; }}
li {{ margin: .5em 0; }}</style></head><body>
<h1>Off-policy variance: six lessons with live controls</h1>
<p>Each page runs in the browser with no Python and no network. The notebooks behind them are in
<code>notebooks/teach/</code>.</p>
<ol>{items}</ol>
</body></html>
"""


def build_pages(out_dir, slugs=None) -> list[Path]:
    """Write ``index.html`` and one page per lesson into ``out_dir``; returns the page paths (index last).

    ``slugs`` picks lessons by slug (default: all). Each file is written to a temporary name and renamed into place.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise LabError(f"{out} exists and is not a folder; choose another output folder")
    every = pages()
    known = [p.slug for p in every]
    chosen = every if slugs is None else [p for p in every if p.slug in set(slugs)]
    unknown = sorted(set(slugs or ()) - set(known))
    if unknown:
        raise LabError(f"unknown lesson(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    dests = [out / f"{p.slug}.html" for p in chosen] + [out / "index.html"]
    for dest in dests:  # every page the lab would replace is one it wrote, before anything is written
        check_file(dest, "output folder")
    out.mkdir(parents=True, exist_ok=True)
    for dest, text in zip(dests, [render(p) for p in chosen] + [_index(chosen)]):
        write_file(dest, text, "output folder")
    return dests


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.teach.pages",
                                     description="Build the lessons' static pages with live controls (no Python or "
                                                 "network needed to open them).")
    parser.add_argument("out", type=Path, help="output folder (created if missing)")
    parser.add_argument("--only", nargs="+", metavar="LESSON", help="build only these lessons (slugs)")
    args = parser.parse_args(argv)
    try:
        paths = build_pages(args.out, args.only)
    except LabError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = len(paths) - 1
    print(f"wrote {n} page{'' if n == 1 else 's'} and {paths[-1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
