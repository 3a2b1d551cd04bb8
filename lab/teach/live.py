"""Live controls for the lessons (ipywidgets): move a slider, the lesson recomputes and redraws.

``Live`` holds the controls, a picture (an Output widget whose outputs are set directly, so it also works without
a frontend, e.g. under papermill or in tests) and a line of numbers. Each builder below returns one for a lesson;
every redraw calls the lesson's numpy core and a small matplotlib figure at a screen resolution, well under a
second on a laptop (``Live.elapsed`` records the last one). Without a widget frontend (papermill, a static export,
GitHub's viewer) the cell shows its static fallback instead of the controls: the figure at the setting it was built
with as a 150-dpi PNG, its numbers, and a sentence pointing to the lesson's static page and to ``make lab``.
Estimator series take the lab's colour for that estimator (``lab.reports.style.color``).
"""
from __future__ import annotations

import time
from typing import Callable

import html

import numpy as np

from lab.estimators import vespo
from lab.reports.style import color
from lab.teach import (clip_mask, gvpo_zero_sum, plots, sampler_truncation, tokens, vespo_kernel, vopd_baseline,
                       weight_explosion)

LIVE_DPI = 72
NOTE = "Live controls: open this notebook in JupyterLab with a running kernel (make lab) to move them."
STATIC = ("Static picture at the notebook's setting: the controls need a running kernel. Open this notebook in "
          "JupyterLab (<code>make lab</code>) to move them, or open the lesson's <a href=\"{page}.html\">static page"
          "</a>, which recomputes in the browser with no Python (<code>python -m lab.teach.pages DIR</code> writes "
          "it anywhere).")


class Live:
    """Controls + picture + numbers; ``update()`` redraws with the controls' current values."""

    def __init__(self, title: str, controls: dict, draw: Callable[..., tuple], page: str):
        import ipywidgets as w

        self.title, self.controls, self.draw, self.page = title, controls, draw, page
        self.picture = w.Output()
        self.numbers = w.HTML()
        self.elapsed = float("nan")
        self.figure = None
        for control in controls.values():
            control.observe(lambda change: self.update(), names="value")
        grid = w.GridBox(list(controls.values()),
                         layout=w.Layout(grid_template_columns="repeat(auto-fill, minmax(300px, 1fr))"))
        self.widget = w.VBox([w.HTML(f"<b>{title}</b>"), grid, self.numbers, self.picture])
        self.update()

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def update(self) -> None:
        start = time.perf_counter()
        fig, text = self.draw(**self.values())
        data = plots.bundle(fig, text, dpi=LIVE_DPI, tight=False)
        self.picture.outputs = ({"output_type": "display_data", "metadata": {},
                                 "data": {"image/png": data["image/png"], "text/plain": data["text/plain"]}},)
        self.numbers.value = text
        self.figure = fig
        self.elapsed = time.perf_counter() - start

    def snapshot(self) -> dict:
        """The static fallback: the current figure as a 150-dpi PNG (alt text: the title and the numbers) under a
        sentence that says where the live version is."""
        data = plots.bundle(self.figure, f"{self.title}, at the notebook's setting: {self.numbers.value}", tight=False)
        note = STATIC.format(page=html.escape(self.page))
        return {"image/png": data["image/png"], "text/plain": NOTE,
                "text/html": f"<p><em>{note}</em></p><p>{html.escape(self.numbers.value)}</p>{data['text/html']}"}

    def _repr_mimebundle_(self, **kwargs):
        out = self.widget._repr_mimebundle_(**kwargs)
        if isinstance(out, tuple):
            out = out[0]
        return {**out, **self.snapshot()}  # a widget frontend shows the controls, anything else the snapshot


def _sliders():
    import ipywidgets as w

    style = {"description_width": "initial"}
    layout = w.Layout(width="95%")

    def floatlog(description, value, lo, hi, step=0.05):
        return w.FloatLogSlider(value=value, base=10, min=lo, max=hi, step=step, description=description,
                                continuous_update=False, style=style, layout=layout, readout_format=".3g")

    def floats(description, value, lo, hi, step):
        return w.FloatSlider(value=value, min=lo, max=hi, step=step, description=description,
                             continuous_update=False, style=style, layout=layout)

    def ints(description, value, lo, hi):
        return w.IntSlider(value=value, min=lo, max=hi, description=description, continuous_update=False,
                           style=style, layout=layout)

    def choice(description, value, options):
        return w.Dropdown(value=value, options=options, description=description, style=style, layout=layout)

    return floatlog, floats, ints, choice


def _fmt(x: float) -> str:
    return f"{x:.3g}"


# ---- 1 --------------------------------------------------------------------------------------------------------

def weight_explosion_ui(kl: float = 0.01, length: int = 256, vocab: int = 32, batch: int = 256, seed: int = 0) -> Live:
    floatlog, _, ints, _ = _sliders()

    def draw(kl, length, vocab, batch):
        d = weight_explosion.page_data(kl, vocab, length, seed)
        log_pi, log_mu = tokens.stale_pair(vocab, kl, seed)
        log_w = weight_explosion.sample_log_weights(log_pi, log_mu, length, batch, 1, seed)[0]
        diag = {k: float(v[0]) for k, v in weight_explosion.batch_diagnostics(log_w).items()}
        fig, (ax, bx) = plots._fig(2, width=4.6, height=3.2, fast=True)
        ax.plot(d["lengths"], d["ess_frac"], lw=2, color=plots.COLORS[0], label="(1 + chi2_tok)^-T")
        ax.plot([length], [d["at_length"]["ess_frac"]], "o", color=plots.COLORS[1], label="your T")
        ax.plot([length], [diag["ess_frac"]], "s", color=plots.COLORS[3], label=f"this batch of {batch}")
        ax.set(xscale="log", yscale="log", ylim=(1e-16, 1.5), xlabel="length T", ylabel="ESS fraction")
        ax.legend(fontsize=7, loc="lower left")
        share = np.sort(np.exp(log_w - log_w.max()))[::-1]
        share = share / share.sum()
        bx.bar(np.arange(1, min(20, batch) + 1), share[:20], color=plots.COLORS[3])
        bx.set(xlabel="rank of the sequence in the batch", ylabel="share of the batch's weight",
               title="the 20 heaviest weights")
        a, t = d["at_length"], d["token"]
        text = (f"chi2_tok {_fmt(t['chi2'])}; at T = {length}: population ESS {_fmt(a['ess_frac'])}, "
                f"chi2_seq {_fmt(a['chi2_seq'])}, Var(log W) {_fmt(a['var_log_w'])}; this batch: Kish ESS "
                f"{_fmt(diag['ess_frac'])}, largest weight {diag['max_weight_share']:.0%} of the total, k-hat "
                f"{_fmt(diag['khat'])}")
        return fig, text

    return Live("Sequence weights: per-token KL, length, vocabulary, batch",
                {"kl": floatlog("per-token KL", kl, -3, 0), "length": ints("length T", length, 1, 1024),
                 "vocab": ints("vocabulary V", vocab, 2, 512), "batch": ints("batch size", batch, 16, 1024)},
                draw, "weight_explosion")


# ---- 2 --------------------------------------------------------------------------------------------------------

def clip_mask_ui(kl: float = 0.1, vocab: int = 64, seed: int = 0, method: str = "ppo_clip", eps: float = 0.2) -> Live:
    floatlog, floats, ints, choice = _sliders()

    def draw(kl, vocab, seed, method, eps):
        over = {"ppo_clip": {"clip_ratio_low": eps, "clip_ratio_high": eps}}
        table = clip_mask.token_table(vocab, kl, seed)
        table["ppo_clip"] = clip_mask.coefficient("ppo_clip", table["rho"], table["advantage"], **over["ppo_clip"])
        summary = clip_mask.compare(vocab, kl, seed, **over)
        fig = plots.Figure(figsize=(9.6, 3.3))
        ax, bx = fig.subplots(1, 2, width_ratios=(1, 1.4))
        fig.subplots_adjust(left=0.07, right=0.98, bottom=0.22, top=0.9, wspace=0.2)
        coef, rho = table[method].to_numpy(), table["rho"].to_numpy()
        state = np.where(coef == 0, 2, np.where(np.isclose(coef, rho), 0, 1))
        colors = np.array([plots.COLORS[0], plots.COLORS[3], plots.COLORS[1]])[state]
        ax.scatter(np.log(rho), table["advantage"], s=4 + 300 * table["mu"], c=colors, alpha=0.7)
        ax.set(xlabel="log rho", ylabel="A",
               title=f"{clip_mask.LABELS[method]}: blue kept, orange reweighted, red dropped")
        ax.title.set_fontsize(8)
        pivot = summary.pivot(index="method", columns="metric", values="value").loc[list(clip_mask.METHODS)]
        x = np.arange(len(pivot))
        for i, (metric, label) in enumerate((("cos", "cos to grad J"), ("mass_lost", "IS mass lost"),
                                             ("zeroed", "mu dropped"))):
            bx.bar(x + (i - 1) * 0.27, pivot[metric], 0.27, label=label, color=plots.COLORS[(0, 1, 3)[i]])
        bx.set_xticks(x, [clip_mask.LABELS[m] for m in pivot.index], rotation=20, fontsize=7)
        for tick, m in zip(bx.get_xticklabels(), pivot.index):
            tick.set_color(color(m))
        bx.set(ylim=(0, 1.05))
        bx.legend(fontsize=7)
        r = pivot.loc[method]
        text = (f"{clip_mask.LABELS[method]}: drops {r['zeroed']:.0%} of mu's mass, removes {r['mass_lost']:.0%} of "
                f"the IS mass; expected update: cosine {_fmt(r['cos'])} with grad J, length {_fmt(r['norm_ratio'])} x, "
                f"lost across grad J {_fmt(r['lost_across'])} |grad J|")
        return fig, text

    return Live("Clipping and masking: staleness, vocabulary, draw, method, PPO's eps",
                {"kl": floatlog("per-token KL", kl, -2, 0), "vocab": ints("vocabulary V", vocab, 2, 512),
                 "seed": ints("draw", seed, 0, 30),
                 "method": choice("colour by", method, [(clip_mask.LABELS[m], m) for m in clip_mask.METHODS]),
                 "eps": floats("PPO eps", eps, 0.05, 0.5, 0.01)}, draw, "clip_mask")


# ---- 3 --------------------------------------------------------------------------------------------------------

def vespo_kernel_ui(k: float = vespo.K_POS, lam: float = vespo.LAMBDA_POS, kl: float = 0.1, length: int = 6,
                    vocab: int = 4) -> Live:
    _, floats, ints, _ = _sliders()
    edges = np.linspace(-8.0, 8.0, 33)

    def draw(k, lam, kl, length):
        d = vespo_kernel.page_data(k, lam, kl, length, vocab, 0, 1.0, edges)
        s = d["summary"]
        fig, (ax, bx) = plots._fig(2, width=4.6, height=3.2, fast=True)
        grid = np.asarray(d["log_w_grid"])
        ax.plot(grid, np.exp(grid), ":", color="0.6", label="W")
        ax.plot(grid, d["phi"], lw=2, color=color("vespo"), label="phi(W)")
        if d["k_w"] is not None:
            ax.plot(grid, d["k_w"], "--", color=plots.COLORS[1], label="K W")
        ax.set(ylim=(0, 3), xlabel="log W", title="kernel and bound")
        ax.legend(fontsize=7)
        centres = 0.5 * (edges[1:] + edges[:-1])
        for key, c, label in (("mu", plots.MU, "mu"), ("q", color("vespo"), "Q"), ("pi", plots.TARGET, "pi")):
            bx.step(centres, d["hist"][key], where="mid", color=c, lw=2, label=label)
            bx.plot([s[f"mean_logw_{key}"]], [0], "^", ms=9, color=c, clip_on=False)
        bx.set(xlabel="log W", title="mu, Q, pi on the log-W axis")
        bx.legend(fontsize=7)
        text = (f"Z {_fmt(s['Z'])}, C {_fmt(s['C'])}, K {_fmt(s['K'])}: E_mu[phi^2] = {_fmt(s['phi2'])} <= "
                f"Z K C = {_fmt(s['bound'])} (ratio {_fmt(s['ratio'])}); Q's position from mu (0) to pi (1): "
                f"{_fmt(s['position'])}; ESS {s['ess_vespo']:.0%} (VESPO) vs {s['ess_is']:.0%} (IS)")
        return fig, text

    return Live("VESPO's kernel: k, lambda, staleness, length",
                {"k": floats("k", k, 0.0, 5.0, 0.1), "lam": floats("lambda", lam, 0.1, 5.0, 0.1),
                 "kl": floats("per-token KL", kl, 0.0, 0.5, 0.01), "length": ints("length T", length, 1, 8)},
                draw, "vespo_kernel")


# ---- 4 --------------------------------------------------------------------------------------------------------

def gvpo_ui(beta: float = 0.5, lr: float = 1.0, steps: int = 300, sampler: str = "uniform") -> Live:
    floatlog, floats, ints, choice = _sliders()
    log_ref, reward = gvpo_zero_sum.problem()

    def draw(beta, lr, steps, sampler):
        gv = gvpo_zero_sum.train_expected(log_ref, reward, beta, gvpo_zero_sum.SAMPLERS, steps, lr, True)
        nv = gvpo_zero_sum.train_expected(log_ref, reward, beta, gvpo_zero_sum.SAMPLERS, steps, lr, False)
        fig, (ax, bx) = plots._fig(2, width=4.6, height=3.2, fast=True)
        for i, s in enumerate(gvpo_zero_sum.SAMPLERS):
            c = plots.COLORS[i]
            ax.plot(np.maximum(gv["tv"][:, i], 1e-12), color=c, lw=2, label=s)
            ax.plot(np.maximum(nv["tv"][:, i], 1e-12), "--", color=c, lw=1)
        ax.set(yscale="log", ylim=(1e-9, 1.5), xlabel="step", ylabel="TV(pi, pi*)",
               title="solid GVPO, dashed uncentred")
        ax.legend(fontsize=6)
        i = gvpo_zero_sum.SAMPLERS.index(sampler)
        opt = np.exp(gvpo_zero_sum.optimum(log_ref, reward, beta))
        x = np.arange(len(opt))
        for j, (p, label, c) in enumerate(((np.exp(log_ref), "pi_ref", "0.6"), (opt, "pi*", plots.TARGET),
                                           (np.exp(gv["log_pi"][i]), "GVPO", color("gvpo")),
                                           (np.exp(nv["log_pi"][i]), "uncentred", plots.COLORS[1]))):
            bx.bar(x + (j - 1.5) * 0.2, p, 0.2, color=c, label=label)
        bx.set(xlabel="response", title=f"final policies, sampler {sampler}")
        bx.legend(fontsize=7)
        text = (f"beta log Z = {_fmt(beta * gvpo_zero_sum.log_partition(log_ref, reward, beta))}; final TV to pi* "
                f"from {sampler}: GVPO {_fmt(gv['tv'][-1, i])}, uncentred {_fmt(nv['tv'][-1, i])}")
        return fig, text

    return Live("GVPO: beta, step size, steps, sampler",
                {"beta": floatlog("beta", beta, -1.3, 0.3), "lr": floats("step (1/beta^2 units)", lr, 0.1, 1.9, 0.1),
                 "steps": ints("steps", steps, 10, 600),
                 "sampler": choice("sampler", sampler, list(gvpo_zero_sum.SAMPLERS))},
                draw, "gvpo_zero_sum")


# ---- 5 --------------------------------------------------------------------------------------------------------

def vopd_ui(vocab: int = 3, sharpness: float = 1.0, closeness: float = 0.0, seed: int = 0, draws: int = 200) -> Live:
    _, floats, ints, _ = _sliders()

    def draw(vocab, sharpness, closeness, seed):
        d = vopd_baseline.page_data(vocab, sharpness, closeness, seed, draws)
        m = d["pair"]
        fig, (ax, bx) = plots._fig(2, width=4.6, height=3.2, fast=True)
        ax.plot(d["baselines"], d["variance"], color="0.3", lw=2)
        lo, hi = sorted((0.0, 2 * m["b_star"]))
        ax.axvspan(lo, hi, color=plots.COLORS[2], alpha=0.15)
        for b, v, c, label in ((0, m["var_opd"], color("opd"), "OPD"),
                               (m["value"], m["var_vopd"], color("vopd"), "vOPD"),
                               (m["b_star"], m["var_best"], plots.COLORS[2], "b*")):
            ax.plot([b], [v], "o", color=c, label=label)
        ax.set(xlabel="baseline b", ylabel="variance", title="this pair (green: b helps)")
        ax.legend(fontsize=7)
        bx.plot(d["vocabs"], d["helps_frac"], "o-", color=color("vopd"), ms=4, label="share vOPD helps")
        bx.plot(d["vocabs"], d["ratio_median"], "s--", color="0.3", ms=3, label="median variance ratio")
        bx.axvline(vocab, color="0.5", ls=":")
        bx.axhline(1, color="k", lw=0.5)
        bx.set(xscale="log", ylim=(0, 1.6), xlabel="vocabulary size V", title=f"{draws} random pairs per V")
        bx.legend(fontsize=7)
        text = (f"V = -KL = {_fmt(m['value'])}, b* = {_fmt(m['b_star'])}: vOPD {'lowers' if m['helps'] else 'RAISES'} "
                f"the variance ({_fmt(m['var_opd'])} -> {_fmt(m['var_vopd'])}, ratio {_fmt(m['ratio'])}); "
                f"best constant: {_fmt(m['var_best'])}")
        return fig, text

    return Live("vOPD's baseline: vocabulary, peakedness, teacher closeness, draw",
                {"vocab": ints("vocabulary V", vocab, 2, 256),
                 "sharpness": floats("logit scale", sharpness, 0.2, 4.0, 0.1),
                 "closeness": floats("teacher closeness", closeness, 0.0, 0.99, 0.01),
                 "seed": ints("draw", seed, 0, 50)},
                draw, "vopd_baseline")


# ---- 6 --------------------------------------------------------------------------------------------------------

def sampler_truncation_ui(kind: str = "top_p", level: float | None = None, temperature: float = 1.0, kl: float = 0.0,
                          seed: int = 0, vocab: int = 64) -> Live:
    """The sampler's kind and knob (p, k or the min-p threshold: one slider whose range follows the kind), its
    temperature and staleness, and the draw."""
    import ipywidgets as w

    _, floats, ints, choice = _sliders()
    st = sampler_truncation
    start = st.level_range(kind, vocab)
    value = start["value"] if level is None else level
    knob_slider = w.FloatSlider(value=value, min=min(start["start"], value), max=max(start["end"], value),
                                step=start["step"], description=st.LEVEL_TITLES[kind],
                                continuous_update=False, style={"description_width": "initial"},
                                layout=w.Layout(width="95%"), readout_format=".0f" if kind == "top_k" else ".2f")
    kinds = choice("sampler", kind, [(st.KIND_LABELS[k], k) for k in st.KINDS])

    def follow(change):  # the knob's range and starting value follow the kind (observed before Live's redraw)
        r = st.level_range(change["new"], vocab)
        knob_slider.min, knob_slider.max = min(knob_slider.min, r["start"]), max(knob_slider.max, r["end"])
        knob_slider.step, knob_slider.value = r["step"], r["value"]
        knob_slider.min, knob_slider.max = r["start"], r["end"]
        knob_slider.description = st.LEVEL_TITLES[change["new"]]
        knob_slider.readout_format = ".0f" if change["new"] == "top_k" else ".2f"

    kinds.observe(follow, names="value")

    def draw(kind, level, temperature, kl, seed):
        level = round(level) if kind == "top_k" else level
        table = st.sweep(kind, st.level_grid(kind, vocab), vocab, seed, 2.0, kl, temperature)
        tok = st.token_table(kind, level, vocab, seed, 2.0, kl, temperature)
        at = st.measures(st.setting(kind, level, vocab, seed, 2.0, kl, temperature))
        label, knob_label = st.KIND_LABELS[kind], st.LEVEL_TITLES[kind]
        fig, (ax, bx, cx) = plots._fig(3, width=3.4, height=3.2, fast=True)
        fig.subplots_adjust(left=0.06, wspace=0.32)
        plots.kept_tokens(ax, tok, f"{label} {level:g}: {int(at['kept_count'])} kept, m = {at['kept_mass']:.3f}")
        bx.plot(*plots._setting_curve(table, "kept_mass"), color=plots.COLORS[0], lw=2, label="kept mass = mean ratio")
        bx.plot(*plots._setting_curve(table, "share_out"), color=plots.COLORS[1], lw=2, label="outside band, no replay")
        bx.plot(*plots._setting_curve(table, "share_out", True), "--", color=plots.COLORS[2], lw=2,
                label="outside band, replay")
        plots.bias_lines(cx, table, "deployed", st.LABELS, markers=False)
        cx.plot(*plots._setting_curve(table, "gap"), ":", color="k", lw=2, label="deployed vs full (gap)")
        bx.set(xlabel=knob_label, ylim=(-0.05, 1.05), title="ratio")
        cx.set(xlabel=knob_label, title="bias against grad J(pi_S)")
        for a, where in ((bx, "center left"), (cx, "upper left")):
            a.axvline(level, color="0.5", ls=":")
            a.legend(fontsize=6, loc=where)
            if kind != "min_p":
                a.invert_xaxis()
        b = at["bias"]
        text = (f"{label} {level:g} keeps {int(at['kept_count'])} of {vocab} tokens, kept mass m = "
                f"{_fmt(at['kept_mass'])} = mean ratio {_fmt(at['mean_ratio'])}; outside [{st.BAND[0]:g}, "
                f"{st.BAND[1]:g}]: {at['share_out']:.0%} of sampled tokens without replay, "
                f"{at['share_out_replay']:.0%} with; IS bias against the deployed gradient "
                f"{_fmt(b['token_is']['plain']['deployed'])} without replay, "
                f"{_fmt(b['token_is']['replay']['deployed'])} with; against the full gradient "
                f"{_fmt(b['token_is']['replay']['full'])} with replay (the gap no correction closes)")
        return fig, text

    return Live("Sampler truncation: kind, its knob, temperature, staleness, draw",
                {"kind": kinds, "level": knob_slider,
                 "temperature": floats("temperature", temperature, min(0.5, temperature), max(2.0, temperature), 0.05),
                 "kl": floats("staleness KL", kl, 0.0, max(0.5, kl), 0.01),
                 "seed": ints("draw", seed, 0, max(30, seed))},
                draw, "sampler_truncation")
