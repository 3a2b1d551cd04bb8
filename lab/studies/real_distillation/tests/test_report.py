"""What the real_distillation report decides is what the summary says: decisions checked on a hand-made summary, the
templates rendered (the wording is free; the numbers and names are not)."""
import copy

from lab.studies.real_distillation import report


def _m(value, lo, hi, n=4):
    return {"value": value, "lo": lo, "hi": hi, "n": n}


def _setting(V, a, red, share, pred, vs_full, diff=None, topk=None):
    """One setting: vOPD's reduction red = (v, lo, hi), its predicted factor and its variance ÷ full KL's."""
    trained = ["opd", "vopd", "kl_topk"]
    return {"vocab_size": V, "student_accuracy": a, "initial_accuracy": 0.1 if a == 0 else a, "initial_kl_seq": 3.0,
            "teacher_accuracy": 0.95,
            "var_reduction": {"vopd": _m(*red), "vopd_topk": _m(*topk) if topk else None, "kl_full": _m(20, 18, 22)},
            "var_vs_kl_full": {"opd": _m(30, 25, 35), "vopd": _m(*vs_full)}, "pred_reduction": _m(*pred),
            "final_kl_seq": {e: _m(1.0, 0.9, 1.1) for e in trained},
            "kl_closed": {e: _m(0.6, 0.5, 0.7) for e in trained},
            "kl_minus_opd": diff or {"vopd": _m(0.01, -0.05, 0.07), "kl_topk": _m(0.0, -0.1, 0.1)},
            "value_share": share, "distractor_mass": 0.5, "topk_mass": 0.6, "kl_token": 0.8, "kl_topk_token": 0.2,
            "verdict": "helps" if red[1] > 1 else "hurts" if red[2] < 1 else "unresolved",
            "training_verdict": "no detectable difference"}


SETTINGS = [_setting(10, 0.3, (1.7, 1.6, 1.9), 0.64, (2.8, 2.6, 3.0), (10.0, 9.0, 11.0)),
            _setting(64, 0.0, (7.3, 6.5, 8.0), 0.87, (7.7, 7.0, 8.5), (4.5, 4.0, 5.0), topk=(1.3, 1.2, 1.4),
                     diff={"vopd": _m(-0.1, -0.2, -0.05), "kl_topk": _m(0.3, 0.2, 0.4)})]
SUMMARY = {"study": "real_distillation", "source": "the small default grid", "results": None, "sweep": None,
           "runs": 24, "seeds": [0, 1], "estimators": ["opd", "vopd", "kl_topk"], "vocab_sizes": [10, 64],
           "student_accuracies": [0.0, 0.3], "steps": 30, "student_size": "small", "teacher_size": "medium",
           "env": "chain3", "settings": SETTINGS,
           "step_cost": {"10": {"vopd": _m(1.02, 1.0, 1.04)}, "64": {"vopd": _m(1.06, 1.03, 1.09)}},
           "helps": ["V=10, student accuracy 0.3", "V=64, student accuracy 0"], "not_helps": [],
           "config": {"n_boot": 2000, "ci": 0.95}}


def test_the_decisions_follow_the_settings():
    d = report.decide(SUMMARY)
    assert d.most.vocab_size == 64 and d.least.vocab_size == 10
    assert sorted(d.vs_full) == [4.5, 10.0] and d.costs == [1.02, 1.06]
    assert [x.vocab_size for x in d.lower_kl] == [64] and len(d.trained_both) == 2
    assert d.rises_with_share  # 1.7 at share 0.64, 7.3 at 0.87
    assert [x.vocab_size for x in d.below_prediction] == [10]  # [1.6, 1.9] lies below [2.6, 3.0]
    assert [x.vocab_size for x in d.topk_loss_worse] == [64] and [x.vocab_size for x in d.topk] == [64]
    s = copy.deepcopy(SUMMARY)
    s["settings"][0]["var_reduction"]["vopd"] = _m(9.0, 8.0, 10.0)  # larger at the smaller share
    d = report.decide(s)
    assert not d.rises_with_share and d.most.vocab_size == 10


def test_the_headline_states_the_largest_and_smallest_reduction_with_their_value_shares():
    line = report.headline("real_distillation", SUMMARY)
    assert line.startswith("vOPD's baseline cuts vanilla OPD's gradient variance by 7.3x [6.5, 8] at V = 64 from a "
                           "random student (value share 87%)")
    assert "1.7x [1.6, 1.9] at V = 10" in line and "4.5-10x noisier" in line and "1.02-1.06x" in line
    s = copy.deepcopy(SUMMARY)
    for x in s["settings"]:
        x["var_reduction"]["vopd"] = None
    assert report.headline("real_distillation", s) == "real-teacher distillation: no vOPD variance measured"
    assert "No vOPD gradient variance" in report.opening(s)


def test_the_templates_render_every_decision():
    opening, answer = (" ".join(text.split()) for text in (report.opening(SUMMARY), report.answer(SUMMARY)))
    for fact in ("small default grid", "{10, 64}", "{random, 0.3}", "= 24 runs", "V = 64", "7.3 [6.5, 8]", "87%",
                 "7.7 [7, 8.5]", "1.7 [1.6, 1.9]", "64%", "2 of 2 settings", "1 of 2", "4.5-10×", "1.02-1.06×"):
        assert fact in opening, fact
    for fact in ("lowers", "1.3 [1.2, 1.4]", "25%", "+0.3 [+0.2, +0.4]", "30 steps",
                 "V = 10: vOPD 1.02×", "below the prediction in 1 of them"):
        assert fact in answer, fact
    assert "{{" not in opening + answer and "{%" not in opening + answer
    s = copy.deepcopy(SUMMARY)
    s["runs"], s["sweep"], s["results"] = 5, {"name": "real_distillation", "base": {}, "grid": {}}, "runs/rd"
    assert "`runs/rd`" in report.opening(s) and "5 of them finished" in report.opening(s)


def test_tables_have_one_row_per_setting():
    rows = report.results_table(SUMMARY).data
    assert list(rows["V"]) == [10, 64] and list(rows["student start"]) == ["0.30", "random"]
    assert rows.iloc[1][report.pretty("vopd")] == "7.3 [6.5, 8]" and rows.iloc[0][report.pretty("vopd_topk")] == "–"
    final = report.final_table(SUMMARY).data
    assert list(final.columns[:3]) == ["V", "student start", "start KL"] and final.iloc[0]["start KL"] == "3"
