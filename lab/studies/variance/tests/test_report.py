"""What the estimator_variance report says is what its summary says: the text is checked on hand-made summaries."""
import copy

import pandas as pd
import pytest

from lab.reports import figures, style
from lab.reports import variance as text


def _entry(staleness, kl, ests):
    """One per_value entry; ests: name -> (rel_mse, lo, hi, bias_norm), with ||g*||^2 = 4 (mse = 4 rel_mse)."""
    return {"staleness": staleness, "kl_token": kl, "ess_frac": [0.5, 0.4, 0.6], "khat": [0.3, 0.2, 0.4],
            "estimators": {e: {"rel_mse": r, "mse": 4 * r, "variance": 4 * r, "bias_norm": b}
                           for e, (r, lo, hi, b) in ests.items()},
            "intervals": {e: {"rel_mse": [lo, hi], "variance": [4 * lo, 4 * hi], "bias_norm": [0.5 * b, 1.5 * b]}
                          for e, (r, lo, hi, b) in ests.items()}}


SUMMARY = {"env": "tiny_target", "policy": "prefix", "staleness": "lag", "reference": "exact",
           "config": {"batch_size": 64, "group_size": 8, "advantage": "rloo", "loss_agg_mode": "seq-mean-token-sum",
                      "replicates": 500},
           "per_value": [_entry(0.0, 0.0, {"reinforce": (2.0, 1.8, 2.2, 0.1), "seq_is": (2.0, 1.8, 2.2, 0.1)}),
                         _entry(8.0, 0.2, {"reinforce": (2.1, 1.9, 2.3, 0.5), "seq_is": (0.5, 0.4, 0.6, 0.1)}),
                         _entry(32.0, 0.9, {"reinforce": (9.0, 8.0, 10.0, 4.0), "seq_is": (0.3, 0.2, 0.4, 0.2)})]}


def test_answer_reports_the_most_off_policy_setting_with_its_numbers():
    md = text.answer(SUMMARY)
    assert "**At the most off-policy setting, lag = 32** (KL(μ‖π) 0.9" in md
    assert "| **seq_is** ★ |" in md and "| reinforce |" in md
    assert "0.3 [0.2, 0.4]" in md  # seq_is's MSE and interval at lag 32
    assert "Lowest MSE: seq_is.** Its interval clears every other estimator's." in md
    assert "Nothing does much better than a zero update" not in md
    # reinforce's MSE interval at lag 8 [1.9, 2.3] overlaps its on-policy one [1.8, 2.2]; at lag 32 it does not
    assert "stays within its on-policy MSE interval up to **KL 0.2/token** (lag = 8)." in md


def test_answer_says_when_nothing_beats_a_zero_update_and_when_intervals_overlap():
    s = copy.deepcopy(SUMMARY)
    s["per_value"][2] = _entry(32.0, 0.9, {"reinforce": (1.2, 0.9, 1.5, 1.0), "seq_is": (1.05, 0.8, 1.3, 0.9)})
    md = text.answer(s)
    assert "Nothing does much better than a zero update here" in md
    assert "Its interval overlaps reinforce: not resolved at this number of replicates" in md
    assert "every setting here" in md  # reinforce's interval [0.9, 1.5] never leaves its on-policy one
    assert text.headline(s).endswith("no correction beats a zero update (1×)")
    assert "lowest MSE seq_is, 0.3×‖∇J‖² vs 9× uncorrected" in text.headline(SUMMARY)


def test_headline_table_stars_the_lowest_per_setting():
    html = text.headline_table(SUMMARY).to_html()
    assert html.count(">★ ") == 2  # lags 8 and 32; on-policy the two coincide and nothing is starred
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
    html = text.headline_table(SUMMARY, wide_limit=1).to_html()
    assert html.count(">★ ") == 2 and "lag 32" in html and "lag 8" in html  # settings are columns now
    assert html.index(">seq_is<") > html.index(">ESS<")  # estimators are rows, after the divergence rows


def test_answer_opens_with_where_a_correction_matters_and_where_nothing_helps():
    md = text.answer(SUMMARY)
    assert md.index("Where a correction matters most: lag = 32") < md.index("At the most off-policy setting")
    assert "seq_is has MSE 0.3×‖∇J‖² against 9× uncorrected, 30 times lower" in md
    assert "Where nothing beats a zero update" in md and "lag = 0." in md  # on-policy both intervals are [1.8, 2.2]
    s = copy.deepcopy(SUMMARY)
    s["per_value"] = s["per_value"][1:]
    assert "lag = 0." not in text.answer(s)
