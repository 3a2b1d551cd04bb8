"""What the variance reports decide is what the summary says: the decisions are checked on hand-made summaries, and
the templates render them (the wording is free; the numbers and names are not)."""
import copy

import pandas as pd
import pytest

from lab.reports import figures, style
from lab.studies.variance import report


def _entry(staleness, kl, ests):
    """One setting; ests: name -> (rel_mse, lo, hi, bias_norm), with ||g*||^2 = 4 (mse = 4 rel_mse)."""
    return {"staleness": staleness, "kl_seq": 4 * kl, "kl_token": kl, "chi2_seq": 0.0, "chi2_token": 0.0,
            "logw_var": 0.0, "mean_len": 4.0, "ess_frac": [0.5, 0.4, 0.6], "khat": [0.3, 0.2, 0.4],
            "estimators": {e: {"rel_mse": r, "mse": 4 * r, "variance": 4 * r, "bias_norm": b}
                           for e, (r, lo, hi, b) in ests.items()},
            "intervals": {e: {"rel_mse": [lo, hi], "variance": [4 * lo, 4 * hi], "bias_norm": [0.5 * b, 1.5 * b]}
                          for e, (r, lo, hi, b) in ests.items()},
            "divergence_intervals": {}}


def _summary(per_value):
    return {"study": "variance", "env": "tiny_target", "policy": "prefix", "parameters": 10, "response_length": 4,
            "staleness": "lag", "reference": "exact", "reference_pairs": 512, "target_grad_norm": 2.0,
            "target_grad_se": float("nan"), "loss_agg_modes": {}, "objective": 0.1, "best_by_mse": {},
            "per_value": per_value,
            "config": {"batch_size": 64, "group_size": 8, "advantage": "rloo", "loss_agg_mode": "seq-mean-token-sum",
                       "replicates": 500}}


SUMMARY = _summary([_entry(0.0, 0.0, {"reinforce": (2.0, 1.8, 2.2, 0.1), "seq_is": (2.0, 1.8, 2.2, 0.1)}),
                    _entry(8.0, 0.2, {"reinforce": (2.1, 1.9, 2.3, 0.5), "seq_is": (0.5, 0.4, 0.6, 0.1)}),
                    _entry(32.0, 0.9, {"reinforce": (9.0, 8.0, 10.0, 4.0), "seq_is": (0.3, 0.2, 0.4, 0.2)}),
                    _entry(64.0, 2.0, {"reinforce": (1.01, 1.0, 1.02, 1.0), "seq_is": (1.02, 1.0, 1.5, 1.0)})])


def test_the_focus_is_where_the_corrections_differ_most_not_where_everything_fails():
    d = report.decide(report.summary_of(SUMMARY))
    assert d.focus.staleness == 32.0 and d.most_off_policy.staleness == 64.0  # at 64 every MSE is about 1
    assert d.best == ["seq_is"] and d.tied == [] and not d.zero_update
    assert d.gain.setting.staleness == 32.0 and d.gain.best == "seq_is" and d.gain.ratio == pytest.approx(30.0)
    assert d.hopeless == [0.0, 64.0]  # every MSE interval at or above 1 there
    assert d.reinforce_safe.staleness == 8.0  # reinforce's interval [1.9, 2.3] overlaps its on-policy [1.8, 2.2]
    assert d.relative["seq_is"].rel_mse == (0.3, 0.2, 0.4)
    assert d.relative["seq_is"].bias == pytest.approx((0.1, 0.05, 0.15))  # bias_norm / ||g*||, ||g*|| = 2


def test_overlapping_intervals_are_not_resolved_and_the_least_biased_is_named():
    s = copy.deepcopy(SUMMARY)
    s["per_value"][2] = _entry(32.0, 0.9, {"reinforce": (0.6, 0.5, 0.9, 0.4), "seq_is": (0.55, 0.4, 0.8, 0.9)})
    d = report.decide(report.summary_of(s))
    assert d.focus.staleness == 8.0  # now the largest spread among settings where a correction helps
    s["per_value"] = s["per_value"][2:3]
    d = report.decide(report.summary_of(s))
    assert d.best == ["seq_is"] and d.tied == ["reinforce"] and d.least_biased == "reinforce"


def test_when_nothing_beats_a_zero_update_the_report_says_so():
    s = _summary([_entry(0.0, 0.0, {"reinforce": (1.2, 0.95, 1.5, 1.0), "seq_is": (1.05, 1.0, 1.3, 0.9)})])
    d = report.decide(report.summary_of(s))
    assert d.zero_update and d.focus.staleness == 0.0
    assert report.headline("variance", s).endswith("no correction beats a zero update (1×)")


def test_the_headline_states_the_focus_with_its_numbers():
    line = report.headline("variance", SUMMARY)
    assert line.startswith("lag 32 (KL 0.9/token)") and "seq_is, 0.3×‖∇J‖²" in line and "9× uncorrected" in line


def test_the_answer_renders_every_decision():
    md = report.answer(SUMMARY)
    for fact in ("lag = 32", "0.3 [0.2, 0.4]", "**seq_is** ★", "| reinforce |", "30", "64", "KL 0.2/token",
                 "tiny_target", "64 responses", "500 replicate"):
        assert fact in md, fact
    assert "{" not in md.replace("{0, 8, 32, 64}", "")  # no template syntax left behind


def test_headline_table_stars_the_lowest_per_setting():
    html = report.headline_table(SUMMARY).to_html()
    assert html.count(">★ ") == 3  # lags 8, 32 and 64; on-policy the two coincide and nothing is starred
    assert "0.3 [0.2, 0.4]" in html


def _results():
    rows = []
    for e, r in (("seq_is", 1.0), ("ppo_clip", 2.0)):
        for s in (0.0, 4.0):
            for metric, v in (("bias2", 0.1 * r), ("variance", r), ("mse", 1.1 * r), ("rel_mse", 1.1 * r / 4)):
                rows.append({"env": "e", "policy": "prefix", "staleness_kind": "lag", "seed": 0, "reference": "exact",
                             "staleness": s, "estimator": e, "metric": metric, "value": v, "lo": v, "hi": v})
    return pd.DataFrame(rows)


def test_figure_draws_one_line_per_estimator_in_its_report_colour():
    fig = figures.bias_variance_mse(_results())
    ax = fig.axes[2]
    lines = {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}
    assert set(lines) == {"seq_is", "ppo_clip"}
    for name, ln in lines.items():
        assert ln.get_color() == style.color(name)
        # in units of ||grad J||^2 = mse / rel_mse = 4
        assert list(ln.get_ydata()) == pytest.approx([1.1 * (1.0 if name == "seq_is" else 2.0) / 4] * 2)


def test_every_estimator_keeps_one_colour():
    from lab import estimators

    colours = [style.color(n) for n in estimators.names()]
    assert len(set(colours)) == len(colours)
    assert style.color("vopd_top8") == style.color("vopd_top16") != style.color("vopd")


def test_many_estimators_become_rows_so_the_table_stays_narrow():
    html = report.headline_table(SUMMARY, wide_limit=1).to_html()
    assert html.count(">★ ") == 3 and "lag 32" in html and "lag 8" in html  # settings are columns now
    assert html.index(">seq_is<") > html.index(">ESS<")  # estimators are rows, after the divergence rows
