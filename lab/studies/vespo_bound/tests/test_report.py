"""What the vespo_bound report decides is what the summary says: the decisions are checked on hand-made summaries,
the template renders them (the wording is free; the numbers and names are not), and the figures draw the tables."""
import json
import math

import numpy as np
import pytest

from lab.estimators import vespo as V
from lab.reports import style
from lab.runs import write_json
from lab.studies.vespo_bound.tests.hand import wide_bound
from lab.studies.vespo_bound import figures, report
from lab.studies.vespo_bound.bound import tidy_bound


def _per_kernel(k, lam, max_ratio, median_ratio):
    K = V.bound_constant(k, lam)
    finite = math.isfinite(K)
    return {"k": k, "lam": lam, "K": K, "peak_w": V.argmax_bound(k, lam) if finite else None,
            "on_policy_ratio": 1 / K if finite else None, "max_ratio": max_ratio if finite else None,
            "median_ratio": median_ratio if finite else None, "min_ratio": 0.3 if finite else None}


def _lag(kl, ess, verdict, vespo, seq_is, bias, cos, size):
    """One per_lag entry: VESPO's and sequence IS's [MSE, lo, hi], VESPO's exact bias / cosine / size."""
    return {"kl_token": kl, "ess_frac": ess, "verdict": verdict, "vespo_rel_mse": vespo, "seq_is_rel_mse": seq_is,
            "vespo_variance": [v / 2 for v in vespo], "seq_is_variance": [v / 2 for v in seq_is],
            "vespo_exact_bias": bias, "vespo_exact_cos": cos, "vespo_exact_size": size, "seq_is_exact_bias": 1e-16,
            "seq_is_exact_cos": 1.0, "seq_is_exact_size": 1.0, "ppo_clip_exact_bias": bias / 2,
            "ppo_clip_exact_cos": 0.9, "ppo_clip_exact_size": 0.5, "reinforce_exact_bias": 0.7,
            "reinforce_exact_cos": 1.0, "reinforce_exact_size": 0.3}


def report_summary(violations=0, last_mse=1.02, cos=0.999, size=0.0):
    """A vespo_bound summary with known numbers: lags 0, 8, 64; VESPO lower at 8, sequence IS lower at nothing."""
    return {
        "study": "vespo_bound", "env": "tiny_target", "policy": "prefix", "violations": violations,
        "max_bound_ratio": 1.0, "max_bound_ratio_off_policy": 0.93, "settings_checked": 357,
        "settings_without_bound": 51,
        "tightest": {"kernel": "k=3, λ=2", "staleness_kind": "lag", "staleness": 0.0, "seed": 0, "ratio": 1.0},
        "per_kernel": {"k=2, λ=3": _per_kernel(2.0, 3.0, 0.52, 0.47), "k=3, λ=2": _per_kernel(3.0, 2.0, 1.0, 0.86),
                       "k=1, λ=1": _per_kernel(1.0, 1.0, 0.37, 0.35), "k=0.5, λ=1": _per_kernel(0.5, 1.0, 0, 0)},
        "max_floor_mass": 0.0, "staleness_kinds": ["kl", "lag", "temperature"], "bound_seeds": 3,
        "vespo_lower_mse_at_lags": [8.0], "seq_is_lower_mse_at_lags": [], "max_lag": 64.0,
        "mse_ratio_vespo_over_seq_is_at_max_lag": last_mse / 74.0,
        "per_lag": {"0": _lag(0.0, 1.0, "equal", [1.0, 0.9, 1.1], [1.0, 0.9, 1.1], 0.0, 1.0, 1.0),
                    "8": _lag(0.05, 0.8, "VESPO lower", [0.5, 0.4, 0.6], [3.0, 2.0, 4.0], 0.4, cos, 0.6),
                    "64": _lag(1.15, 0.12, "unresolved", [last_mse, 0.98, 1.05], [74.0, 0.5, 300.0], 1.0, math.nan,
                               size)},
        "config": {"replicates": 500, "batch_size": 64, "group_size": 8, "advantage": "rloo",
                   "loss_agg_mode": "token-mean", "seed": 0},
    }


def test_the_decisions_follow_the_summary():
    d = report.decide(report_summary())
    assert not d.violated and d.bounded == ["k=2, λ=3", "k=3, λ=2", "k=1, λ=1"]  # k < 1 has no K
    assert d.peak_at_one == ["k=3, λ=2"]  # computed from the kernels: only (3, 2) peaks at w = (k-1)/λ = 1
    assert (d.vespo_lower, d.seq_is_lower, d.unresolved, d.on_policy) == ([8.0], [], [64.0], [0.0])
    assert d.last_lag == 64.0 and d.last.kl_token == 1.15
    assert d.focus.lag == 8.0 and d.focus.lower == "vespo" and d.focus.ratio == pytest.approx(6.0)
    b = d.bias
    assert b.notable and b.notable_lags == [8.0, 64.0] and b.vespo == [0.0, 0.4, 1.0]
    assert b.same_direction and b.vanishes  # cos 0.999 (the NaN at lag 64 is undefined, not a turn); size 0 at 64
    assert math.isnan(b.cos[1]) and b.size == [0.6, 0.0]
    assert d.zero_update and d.shrunk == 0.0  # VESPO's MSE 1.02 at lag 64: it barely moves


def test_the_decisions_flip_with_the_numbers():
    assert report.decide(report_summary(violations=3)).violated
    assert not report.decide(report_summary(last_mse=0.4)).zero_update
    turned = report.decide(report_summary(cos=0.5, size=0.2))
    assert not turned.bias.same_direction and not turned.bias.vanishes
    small = report_summary()
    for e in small["per_lag"].values():
        e["vespo_exact_bias"] = 0.01
    assert not report.decide(small).bias.notable
    near_zero = report_summary()
    near_zero["per_lag"]["8"]["vespo_rel_mse"] = [0.95, 0.93, 0.97]  # lower, but about a zero update's MSE
    assert report.decide(near_zero).focus is None
    seq = report_summary()
    seq["per_lag"]["8"].update(verdict="seq IS lower", vespo_rel_mse=[3.0, 2.0, 4.0], seq_is_rel_mse=[0.3, 0.2, 0.4])
    f = report.decide(seq).focus
    assert f.lower == "seq_is" and f.ratio == pytest.approx(10.0)


def test_the_headline_states_the_focus_and_the_most_stale_lag():
    line = report.headline("vespo_bound", report_summary())
    assert line.startswith("Prop. 3.1 never violated (0 of 357 exact settings")
    assert "lag 8" in line and "VESPO 0.5 vs seq IS 3" in line  # where they differ most, VESPO still moving
    assert "lag 64" in line and "1.02" in line and "zero update" in line
    assert report.headline("vespo_bound", report_summary(violations=3)).startswith("Prop. 3.1 VIOLATED in 3 of 357")
    assert "zero update" not in report.headline("vespo_bound", report_summary(last_mse=0.4))


def test_the_answer_renders_every_decision(tmp_path):
    text = report.answer(report_summary())
    for fact in ("357", "3 kernels", "kl, lag, temperature", "1.0000", "0.9300", "k=3, λ=2",
                 f"| k=2, λ=3 | 2.463 | 0.333 | {3 / math.e**2:.3f} | 0.5200 | 0.470 |", "| k=1, λ=1 | 2.718 | → 0 |",
                 "no bound (k < 1)", "**8**", "0.5 [0.4, 0.6]", "3 [2, 4]", "1.02 [0.98, 1.05]", "74 [0.5, 300]",
                 "0%, 40%, 100%", "1.00, undefined", "0.6, 0"):
        assert fact in text, fact
    assert "{" not in text and "}" not in text  # no template syntax left behind
    assert text != report.answer(report_summary(violations=3)) != report.answer(report_summary(cos=0.5, size=0.2))
    assert report.answer(report_summary(last_mse=0.4)).count("lag 64") < text.count("lag 64")  # no zero-update line
    # summary.json stores NaN and inf as null: the text is the same from the file
    write_json(tmp_path / "summary.json", report_summary())
    assert report.answer(json.loads((tmp_path / "summary.json").read_text())) == text



def test_bound_figures_draw_the_table():
    wide = wide_bound()
    fig = figures.bound_figure(tidy_bound(wide))
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == ["lag", "sampling temperature of μ"]
    assert "ratio ≤ 1 everywhere" in fig._suptitle.get_text()
    lines = [ln for ln in axes[0].get_lines() if not ln.get_label().startswith("_")]
    assert [ln.get_label() for ln in lines] == ["k=2, λ=3 (VESPO)", "k=1, λ=1"]  # k < 1 has no ratio: no line
    assert lines[0].get_color() == style.color("vespo")
    assert np.allclose(lines[0].get_ydata(), [0.525, 0.625]) and np.allclose(lines[1].get_ydata(), [0.225, 0.325])
    wide.loc[0, "ratio"] = 1.2  # one violation: the title says so and the axis shows it
    fig = figures.bound_figure(tidy_bound(wide))
    assert "violated" in fig._suptitle.get_text() and fig.axes[0].get_ylim()[1] >= 1.2
    fig = figures.second_moment_figure(tidy_bound(wide), "temperature")
    by_label = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    assert np.allclose(by_label["sequence IS: E_μ[W²] = 1 + χ²"].get_ydata(), [1.0, 11.0])
    assert np.allclose(by_label["VESPO E_μ[φ²], k=2, λ=3"].get_ydata(), [0.5, 1.5])
    assert by_label["sequence IS: E_μ[W²] = 1 + χ²"].get_color() == style.color("seq_is")
    fig = figures.kernel_figure()
    k_line = [ln for ln in fig.axes[0].get_lines() if ln.get_label().startswith("K·W, K = 2.46")][0]
    x, y = k_line.get_xdata(), k_line.get_ydata()
    assert np.allclose(y / x, V.bound_constant(2, 3))


def test_comparison_figure_and_table_show_the_summary():
    fig = figures.comparison_figure(report_summary())
    assert len(fig.axes) == 4
    mse = {ln.get_label(): ln for ln in fig.axes[0].get_lines()}
    assert np.allclose(mse["VESPO"].get_ydata(), [1.0, 0.5, 1.02]) and mse["VESPO"].get_color() == style.color("vespo")
    assert np.allclose(mse["sequence IS"].get_ydata(), [1.0, 3.0, 74.0])
    assert mse["sequence IS"].get_color() == style.color("seq_is")
    bias = {ln.get_label(): ln for ln in fig.axes[2].get_lines()}
    assert set(bias) == {"seq_is", "vespo", "ppo_clip", "reinforce"}
    assert np.allclose(bias["vespo"].get_ydata(), [0.0, 0.4, 1.0]) and bias["ppo_clip"].get_color() == style.color(
        "ppo_clip")
    direction = {ln.get_label(): ln.get_ydata() for ln in fig.axes[3].get_lines()}
    assert np.allclose(direction["vespo: ‖E g‖ ÷ ‖∇J‖"], [1.0, 0.6, 0.0])
    shown = report.comparison_table(report_summary()).data
    assert shown["VESPO MSE"].tolist() == ["1 [0.9, 1.1]", "0.5 [0.4, 0.6]", "1.02 [0.98, 1.05]"]
    assert shown["verdict"].tolist() == ["equal", "VESPO lower", "unresolved"]
    assert shown["VESPO exact bias"].tolist() == ["0%", "40%", "100%"]
