"""What the distillation report decides is what the summary says: decisions checked on hand-made summaries, the
templates rendered (the wording is free; the numbers and names are not), the figures drawn from a real study."""
import copy

import matplotlib.colors as mcolors
import pytest

from lab.studies.distillation import report
from lab.studies.distillation.study import Config, run


def _iv(value, lo, hi):
    return {"value": value, "lo": lo, "hi": hi}


def hand_summary():
    """Round numbers: vOPD divides OPD's variance by 1.25 [1.15, 1.33], a top-4 baseline keeps 95% of that, the top-2
    KL loss is 83% biased, full KL is 10x less noisy than vOPD; a grid where V = 3 hurts and V = 32 helps."""
    unb = {"opd": ["per_token"], "opd_rtg": ["sequence"], "vopd": ["per_token"], "vopd_top2": ["per_token"],
           "vopd_top4": ["per_token"], "kl_full": ["per_token"], "kl_top2": []}
    rel_bias = {"opd_rtg": 0.035, "kl_top2": 0.83}
    rel_mse = {"vopd": 0.201, "kl_full": 0.0189}
    bias = {lab: {t: {"exact_rel_bias": 0.0 if t in u else rel_bias.get(lab, 0.034),
                      "sampled_bias_norm": _iv(0, 0, 0.1), "rel_mse": _iv(rel_mse.get(lab, 0.25), 0.2, 0.3)}
                  for t in ("per_token", "sequence")} for lab, u in unb.items()}
    for lab, u in unb.items():
        bias[lab]["unbiased_for"] = u
    red = {"vopd": dict(_iv(1.25, 1.15, 1.33), k=None), "vopd_top2": dict(_iv(1.1, 1.02, 1.2), k=2),
           "vopd_top4": dict(_iv(1.24, 1.14, 1.32), k=4)}
    ks = {"vopd_top2": 2, "vopd_top4": 4, "kl_top2": 2}
    variants = {lab: {"estimator": lab, "k": ks.get(lab), "rel_variance": _iv(0.2, 0.15, 0.25),
                      "variance_reduction": red.get(lab), "kept_share": None} for lab in unb}
    variants["vopd_top2"]["kept_share"], variants["vopd_top4"]["kept_share"] = 0.45, 0.95
    cell = {"length": 2, "teacher_noise": 0.25, "kl_token": 0.1}
    grid = {"cells": [dict(cell, vocab_size=3, ratio=0.6, lo=0.5, hi=0.7, verdict="hurts"),
                      dict(cell, vocab_size=8, ratio=1.05, lo=0.9, hi=1.2, verdict="unresolved"),
                      dict(cell, vocab_size=32, ratio=2.7, lo=2.5, hi=2.9, verdict="helps")],
            "helps": 1, "hurts": 1, "unresolved": 1, "replicates": 200, "lengths": [2]}
    return {"study": "distillation", "env": "small_dense", "vocab_size": 8, "length": 2, "kl_seq": 0.614,
            "kl_token": 0.307, "target_norms": {"per_token": 1.0, "sequence": 1.0}, "targets_cos": 0.9994,
            "targets_rel_gap": 0.034, "variance_reduction": red, "variance_vs_kl_full": {"vopd": _iv(10.9, 9.54, 12.7)},
            "bias": bias, "variance": {lab: 0.1 for lab in unb}, "variants": variants, "student_topk_mass": {},
            "student_trajectory_kl": [], "reduction_grid": grid,
            "config": {"policy": "prefix", "teacher": "trained", "replicates": 40, "batch_size": 32,
                       "behaviour_lag": 0, "importance_weights": False, "loss_agg_mode": "token-mean", "seed": 0}}


def test_the_decisions_follow_the_intervals():
    d = report.decide(hand_summary())
    assert d.vopd_vs_opd == "above" and d.vopd_unbiased and d.opd_unbiased
    assert d.vopd_vs_full == "above"  # vOPD is noisier than full KL: 10.9 [9.54, 12.7]
    assert [t.k for t in d.topk] == [2, 4] and d.topk_biased == [] and d.kept_by == "vopd_top4"
    assert d.unbiased_per_token == ["opd", "vopd", "vopd_top2", "vopd_top4", "kl_full"]
    assert d.unbiased_sequence == ["opd_rtg"] and d.biased_both == ["kl_top2"] and d.kl_topk == ["kl_top2"]
    assert [c.vocab_size for c in d.hurts] == [3] and d.best.vocab_size == 32
    s = hand_summary()
    s["variance_reduction"]["vopd"].update(_iv(1.05, 0.95, 1.12))
    s["variance_vs_kl_full"]["vopd"] = _iv(0.5, 0.4, 0.6)
    d = report.decide(s)
    assert d.vopd_vs_opd == "overlaps" and d.vopd_vs_full == "below"
    s["variance_reduction"]["vopd"].update(_iv(0.8, 0.7, 0.9))
    d = report.decide(s)
    assert d.vopd_vs_opd == "below" and d.kept_by is None  # no reduction for a top-k baseline to keep


def test_the_headline_names_the_smallest_top_k_that_keeps_the_reduction_and_where_it_hurts():
    s = hand_summary()
    line = report.headline("distillation", s)
    assert line.startswith("vOPD cuts vanilla OPD's gradient variance by a factor 1.2 [1.1, 1.3] at no bias")
    assert "top-4 baseline keeps 1.2x" in line and "top-2 KL loss is 83% biased" in line
    assert "1 of 3 grid settings" in line and "T = 2, V = 3" in line
    s["variants"]["vopd_top2"]["kept_share"] = 0.92
    assert "top-2 baseline keeps 1.1x" in report.headline("distillation", s)
    s["variants"]["vopd_top2"]["kept_share"] = s["variants"]["vopd_top4"]["kept_share"] = 0.6
    assert "top-4 baseline keeps" in report.headline("distillation", s)  # none keeps 90%: the largest k
    s["variance_reduction"]["vopd"].update(_iv(0.8, 0.7, 0.9))
    assert report.headline("distillation", s).startswith("vOPD does not cut vanilla OPD's gradient variance")


def test_a_stale_behaviour_makes_baselines_biased_and_the_decisions_say_so():
    s = hand_summary()
    s["config"]["behaviour_lag"] = 2
    for lab in ("vopd", "vopd_top2"):
        s["bias"][lab]["unbiased_for"] = []
        s["bias"][lab]["per_token"]["exact_rel_bias"] = 0.12
    d = report.decide(s)
    assert not d.vopd_unbiased and d.topk_biased == ["vopd_top2"]  # vOPD itself is no top-k baseline
    assert d.biased_both == ["vopd", "vopd_top2", "kl_top2"]
    text = report.answer(s)
    assert "12%" in text and "2 steps" in text and "vOPD top-2" in text


def test_the_templates_render_every_decision():
    s = hand_summary()
    text = report.answer(s)
    for fact in ("V = 8, T = 2", "1.25 [1.15, 1.33]", "10.9 [9.54, 12.7]", "0.201", "0.0189", "(45%)", "(95%)",
                 "83%", "3%", "40 replicate batches of 32"):
        assert fact in text, fact
    grid = report.grid_answer(s)
    for fact in ("T = 2, V = 3", "0.6 [0.5, 0.7]", "T = 2, V = 32", "2.7 [2.5, 2.9]", "200 replicate"):
        assert fact in grid, fact
    assert "{" not in text + grid and "}" not in text + grid  # no template syntax left behind
    s["reduction_grid"]["cells"] = s["reduction_grid"]["cells"][1:2]
    assert "T = 2, V = 3" not in report.grid_answer(s)


def test_results_table_has_one_row_per_variant_from_the_summary():
    df = report.results_table(hand_summary()).data
    assert list(df["estimator"]) == [report.pretty(lab) for lab in hand_summary()["variants"]]
    assert report.pretty("vopd_top8") == "vOPD top-8" and report.pretty("opd_rtg") == "OPD (reward-to-go)"
    row = df.set_index("estimator")
    assert row.loc[report.pretty("kl_top2"), "bias vs per-token (exact)"] == "83.0%"
    assert row.loc["vOPD", "Var(OPD) ÷ Var"] == "1.25 [1.15, 1.33]" and row.loc["OPD", "Var(OPD) ÷ Var"] == "–"


@pytest.fixture(scope="module")
def study():
    cfg = Config(vocab_size=8, length=2, n_prompts=2, teacher_steps=5, replicates=60, batch_size=16, k_values=[2],
                 n_boot=100, grid_vocab_sizes=[3, 8], grid_teacher_noises=[1.0], grid_replicates=30,
                 grid_lengths=[2])
    return run(cfg, progress=False)


@pytest.mark.slow
def test_figures_draw_the_study_numbers(study):
    from lab.reports.style import color

    r, s = study.results, study.summary
    labs = list(s["variants"])
    fig = report.bias_figure(r)
    for ax, target in zip(fig.axes[:2], ("per_token", "sequence")):
        bars = ax.patches
        assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [report.pretty(lab) for lab in labs]
        assert [b.get_width() for b in bars] == pytest.approx([s["bias"][lab][target]["exact_rel_bias"]
                                                               for lab in labs])
        assert [b.get_facecolor()[:3] for b in bars] == [pytest.approx(mcolors.to_rgb(color(lab))) for lab in labs]
    fig = report.variance_figure(r)
    norm2 = s["target_norms"]["per_token"] ** 2
    assert fig.axes[0].get_xscale() == "log"
    assert [b.get_width() for b in fig.axes[0].patches] == pytest.approx([s["variance"][lab] / norm2 for lab in labs])
    fig = report.variance_reduction_figure(r)
    ax, ax2 = fig.axes
    top = next(line for line in ax.lines if line.get_label() == "vOPD top-k baseline")
    assert list(top.get_xdata()) == [2] and list(top.get_ydata()) == [s["variance_reduction"]["vopd_top2"]["value"]]
    full = next(line for line in ax.lines if line.get_label().startswith("vOPD, full vocabulary"))
    assert full.get_ydata()[0] == pytest.approx(s["variance_reduction"]["vopd"]["value"])
    assert "k = V = 8" in full.get_label()
    assert list(ax2.lines[0].get_xdata()) == [2, 8] and ax2.lines[0].get_ydata()[-1] == 1.0
    assert ax2.lines[0].get_ydata()[0] == pytest.approx(s["student_topk_mass"]["2"])


def test_the_grid_figure_and_text_come_from_the_same_cells(study):
    r, s = study.results, study.summary
    fig = report.grid_figure(r)
    ys = sorted(fig.axes[0].get_lines()[0].get_ydata())
    assert ys == pytest.approx(sorted(c["ratio"] for c in s["reduction_grid"]["cells"]))
    d = report.decide(s)
    assert len(d.hurts) + len(d.helps) + s["reduction_grid"]["unresolved"] == 2
    assert report.grid_answer(s).count("T = 2") == len(d.hurts) + (1 if d.helps else 0)
    # the real study's summary renders too
    assert "V = 8, T = 2" in report.answer(s) and report.headline("distillation", s)


def test_a_summary_without_a_grid_or_top_k_still_renders():
    s = copy.deepcopy(hand_summary())
    s["reduction_grid"] = None
    for lab in ("vopd_top2", "vopd_top4", "kl_top2"):
        for part in ("variants", "bias", "variance"):
            del s[part][lab]
        s["variance_reduction"].pop(lab, None)
    d = report.decide(s)
    assert d.topk == [] and d.kept_by is None and d.kl_topk == [] and d.hurts == []
    assert "top-" not in report.headline("distillation", s)
    assert "Top-k" not in report.answer(s)
