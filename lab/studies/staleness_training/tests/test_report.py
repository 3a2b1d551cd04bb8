"""What the staleness_training report decides is what the summary says: decisions on the study's own aggregation of
hand-made sweeps, the answer rendering their numbers (the wording is free), and the figures drawing them."""
import pytest

from lab.studies.staleness_training import report


def test_decisions_follow_the_numbers_when_the_toy_disagrees_with_the_paper(hand_study):
    _, s = hand_study([0.0, 0.0, 0.5, 1.0], [0.5] * 4)
    d = report.decide(s)
    y = d.sync
    assert (y.n1, y.nh, y.best, y.tied) == (4, 64, "ppo_clip", ["vespo"])  # vespo's interval reaches ppo_clip's
    assert not y.collapses and y.runs == 16 and y.poi_above == [] and y.poi_below == []
    assert d.focus.n == 64 and (d.focus.best, d.focus.worst) == ("ppo_clip", "vespo") and not d.focus.apart
    assert d.focus.spread == pytest.approx(0.25)
    p = d.paper
    assert (p.paper_order, p.toy_order) == ("VESPO > GRPO", "GRPO > VESPO")
    vespo = next(c for c in p.changes if c["name"] == "VESPO")
    assert vespo["paper"] == pytest.approx(61.8 - 70.0) and vespo["toy"] == pytest.approx(-0.25)
    assert p.vespo == {"rank": 2, "of": 2, "agrees": False, "beats": [], "below": [], "unresolved": ["ppo_clip"]}
    # every run ends on a whole number of solved prompts; seeds (range 0.5) differ more than estimators (0.25)
    assert p.why["decided_early"] and p.why["seeds_more"] and p.why["spread"] == pytest.approx(0.25)
    mismatch = next(r for r in d.regimes if r.study == "mismatch")
    assert mismatch.aware == ["vespo"] and mismatch.spread == pytest.approx(0.4) and not mismatch.coincide
    text = report.answer(s)
    for number in ("0.25 [", "-8.2", "-0.25", "100%", "680", "0.40"):
        assert number in text, number
    line = report.headline("staleness_training", s)
    assert line.startswith("N=64") and "ppo_clip 0.50 [0.50, 0.50]" in line and "vespo 0.25" in line


def test_a_clear_vespo_lead_turns_the_verdict_around(hand_study):
    _, s = hand_study([1.0] * 4, [0.0] * 4)
    d = report.decide(s)
    assert d.sync.best == "vespo" and d.sync.tied == [] and d.sync.poi_above == ["vespo"]
    assert d.paper.vespo["agrees"] and d.paper.vespo["rank"] == 1 and d.paper.why is None  # nothing explained away
    assert d.focus.apart and report.headline("x", s).startswith("N=64") and "1.00 [1.00, 1.00]" in report.answer(s)


def test_the_headline_picks_the_n_where_estimators_differ_most(hand_study):
    import copy

    _, s = hand_study([1.0] * 4, [0.0] * 4)
    t = copy.deepcopy(s)  # make N = 64 a tie and N = 4 the only gap
    t["table"]["sync"]["vespo"]["64"]["final_reward_iqm"] = [0.3, 0.2, 0.4]
    t["table"]["sync"]["ppo_clip"]["64"]["final_reward_iqm"] = [0.3, 0.2, 0.4]
    t["table"]["sync"]["vespo"]["4"]["final_reward_iqm"] = [0.9, 0.8, 1.0]
    assert report.decide(t).focus.n == 4 and report.headline("x", t).startswith("N=4")
    t["table"]["sync"]["vespo"]["4"]["final_reward_iqm"] = [0.5, 0.5, 0.5]
    t["table"]["sync"]["ppo_clip"]["4"]["final_reward_iqm"] = [0.5, 0.5, 0.5]
    assert report.decide(t).focus.spread == 0 and "same final reward" in report.headline("x", t)


def test_without_a_sync_study_the_report_still_answers(hand_study):
    _, s = hand_study([1.0] * 4, [0.0] * 4)
    for key in ("sync",):
        s["table"].pop(key), s["settings"].pop(key), s["poi_all"].pop(key, None)
    s.update(curves=None, outcomes=None, paper_comparison=None)
    d = report.decide(s)
    assert d.sync is None and d.focus is None and d.paper is None and [r.study for r in d.regimes] == ["mismatch"]
    assert report.answer(s) and report.headline("x", s)


def test_figures_draw_the_summarised_numbers(hand_study):
    import matplotlib.colors as mcolors

    from lab.reports.style import color

    results, s = hand_study([0.0, 0.0, 0.5, 1.0], [0.5] * 4)
    ax = report.final_vs_setting(results, "sync").axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["4", "64"] and ax.get_xlabel().startswith("mini-batches")
    for c in ax.containers:
        e = c.get_label()
        line = c.lines[0]
        assert list(line.get_ydata()) == pytest.approx([s["table"]["sync"][e][x]["final_reward_iqm"][0]
                                                        for x in ("4", "64")])
        assert mcolors.to_hex(line.get_color()) == color(e)
    ax = report.poi_figure(results, "sync").axes[0]
    assert [c.get_label() for c in ax.containers] == ["vespo"] and ax.get_ylabel() == "P(final J > ppo_clip's)"
    fig = report.reward_curves(s["curves"])
    assert [a.get_title() for a in fig.axes] == ["N = 4", "N = 64"]
    line = next(ln for ln in fig.axes[1].lines if ln.get_label() == "vespo")
    assert list(line.get_xdata()) == [1, 2] and list(line.get_ydata()) == s["curves"]["64"]["vespo"]["iqm"]
    assert [a.get_title() for a in report.regimes(results).axes] == ["mismatch"]
