"""What the real_staleness_training report decides is what the summary says: the paper's orderings judged by the
seeds' intervals, degradation from the smallest to the largest N, the headline and the answer rendering them (the
wording is free; the numbers and verdicts are not)."""
import pandas as pd

from lab.studies.real_staleness_training import report, study

IQM = f"{study.LABEL}_iqm"


def fake_table(iqms: dict) -> pd.DataFrame:
    rows = [dict(study="sync", setting="minibatches", x=str(n), estimator=e, metric=IQM, value=v, lo=lo, hi=hi, n=5,
                 baseline=None) for (e, n), (v, lo, hi) in iqms.items()]
    return pd.DataFrame(rows)


def test_orderings_by_hand():
    # at the largest N: vespo's interval lies above gspo's (reproduced), sapo's above ppo_clip's (reversed: the paper
    # has GRPO > SAPO), the rest overlap (ppo_clip's and gspo's touch at 0.25)
    t = fake_table({("vespo", 64): (0.5, 0.45, 0.55), ("gspo", 64): (0.3, 0.25, 0.35),
                    ("ppo_clip", 64): (0.2, 0.15, 0.25), ("sapo", 64): (0.4, 0.3, 0.5),
                    ("vespo", 4): (0.1, 0.0, 0.2), ("gspo", 4): (0.1, 0.0, 0.2), ("ppo_clip", 4): (0.1, 0.0, 0.2),
                    ("sapo", 4): (0.1, 0.0, 0.2)})
    got = {(o["better"], o["worse"]): o["verdict"] for o in study.orderings(t)}
    # the paper's VESPO 61.8 > GRPO (ppo_clip) 48.6 > GSPO 47.6 > SAPO 16.5 at N = 64 orders every pair
    assert got == {("vespo", "gspo"): "reproduced", ("vespo", "ppo_clip"): "reproduced",
                   ("vespo", "sapo"): "not separated", ("gspo", "sapo"): "not separated",
                   ("ppo_clip", "sapo"): "reversed", ("ppo_clip", "gspo"): "not separated"}
    deg = study.degradation(t)
    assert not deg["vespo"]["degrades"]  # it rose
    t2 = fake_table({("vespo", 4): (0.5, 0.45, 0.55), ("vespo", 64): (0.2, 0.1, 0.3)})
    assert study.degradation(t2)["vespo"]["degrades"]


def _summary(t: pd.DataFrame) -> dict:
    """A summary with only what the orderings decide (the report reads nothing else for them)."""
    from dataclasses import asdict

    return {"orderings": study.orderings(t), "table": {}, "degradation": {},
            "setup": asdict(study.Setup("chain6", "running sums", 6, 128, 64, "small", 27_000, 3, 0.3, {}, {}, "x")),
            "study": "real_staleness_training", "score": study.SCORE, "baseline": "ppo_clip", "poi_all": {},
            "mismatch_aware": [], "paper_comparison": None}


def test_headline_and_answer_say_what_the_orderings_say():
    t = fake_table({("vespo", 64): (0.5, 0.45, 0.55), ("gspo", 64): (0.3, 0.25, 0.35),
                    ("ppo_clip", 64): (0.2, 0.15, 0.25), ("sapo", 64): (0.4, 0.3, 0.5)})
    s = _summary(t)
    o = report.decide(s).orderings
    assert (o.n, sorted(o.reproduced), o.reversed, o.unresolved) == (64, ["vespo > gspo", "vespo > ppo_clip"],
                                                                     ["sapo > ppo_clip"], 3)
    hl = report.headline("real_staleness_training", s)
    assert hl.startswith("At N = 64") and "sapo > ppo_clip" in hl and "vespo > gspo" in hl and "3 of 6" in hl
    text = report.answer(s)
    assert text.count("**reproduced**") == 2 and text.count("**reversed**") == 1
    assert text.count("**not separated**") == 3 and "0.50 [0.45, 0.55]" in text and "62%" in text
    s["orderings"] = []
    assert report.decide(s).orderings is None and report.headline("x", s).startswith("fewer than two")
    assert report.answer(s)


def _truncation_summary(cells: dict, settings: dict) -> dict:
    """A summary with only the truncation study: cells {(estimator, setting): (v, lo, hi)}, settings {key: (sampler,
    replay, truncates)}."""
    from dataclasses import asdict

    s = _summary(fake_table({("reinforce", 4): (0.1, 0.0, 0.2)}))  # no pair of the paper's methods: no orderings
    table: dict = {}
    for (e, x), v in cells.items():
        table.setdefault(e, {})[x] = {IQM: list(v), "collapse_rate": [0.0, 0.0, 0.5]}
    s["table"] = {"truncation": table}
    s["truncation"] = {x: asdict(study.TruncationSetting(sampler, replay, cut, 0.9 if cut else None))
                       for x, (sampler, replay, cut) in settings.items()}
    s["truncation_noop_identical"] = True
    return s


SETTINGS = {"top-p 1": ("top-p 1", False, False), "top-p 1 +replay": ("top-p 1", True, False),
            "top-p 0.8": ("top-p 0.8", False, True), "top-p 0.8 +replay": ("top-p 0.8", True, True)}


def test_truncation_decisions_by_hand():
    ref = (0.5, 0.45, 0.55)
    cells = {}
    for e, plain, replayed in [("a", (0.3, 0.25, 0.35), (0.5, 0.46, 0.54)),  # loses; replay raises it back: recovered
                               ("b", (0.3, 0.25, 0.35), (0.4, 0.37, 0.42)),  # loses; replay raises it, still below
                               ("c", (0.3, 0.25, 0.35), (0.32, 0.27, 0.37)),  # loses; replay does not separate
                               ("d", (0.5, 0.44, 0.56), (0.3, 0.25, 0.35))]:  # holds; replay lowers it
        cells |= {(e, "top-p 1"): ref, (e, "top-p 1 +replay"): ref, (e, "top-p 0.8"): plain,
                  (e, "top-p 0.8 +replay"): replayed}
    s = _truncation_summary(cells, SETTINGS)
    d = report.decide(s)
    [t] = d.truncation
    assert (t.sampler, t.reference, t.kept_mass) == ("top-p 0.8", "top-p 1", 0.9)
    assert (t.lost, t.recovered, t.partly, t.not_recovered) == (["a", "b", "c"], ["a"], ["b"], ["c"])
    assert (t.raised, t.lowered) == (["a", "b"], ["d"])
    assert {r.estimator: r.replay for r in t.rows}["c"] == "not separated"
    # the no-op setting (replay with nothing cut) is left out of the per-setting spreads and the table
    assert [p.x for p in d.regimes["truncation"]] == ["top-p 1", "top-p 0.8", "top-p 0.8 +replay"]
    assert list(report.truncation_table(s).columns) == ["estimator", "top-p 1", "top-p 0.8", "top-p 0.8 +replay"]
    hl = report.headline("real_staleness_training", s)  # no sync study: the truncation finding is the headline
    assert "top-p 0.8" in hl and "a, b, c" in hl
    text = report.answer(s)
    assert "0.30 [0.25, 0.35]" in text and "0.50 [0.46, 0.54]" in text and "90.0%" in text


def test_truncation_without_the_untruncated_sampler_judges_replay_only():
    cells = {("a", "top-p 0.8"): (0.3, 0.25, 0.35), ("a", "top-p 0.8 +replay"): (0.5, 0.46, 0.54)}
    s = _truncation_summary(cells, {k: v for k, v in SETTINGS.items() if v[2]})
    [t] = report.decide(s).truncation
    assert t.reference is None and t.lost == [] and t.rows[0].loses is None and t.raised == ["a"]
    assert report.answer(s) and report.headline("x", s).startswith("fewer than two")


def test_truncation_labels_order_and_the_no_op_check():
    runs = pd.DataFrame({"estimator": ["e"] * 6, "seed": [0] * 6, "env": ["chain3"] * 6,
                         "top_p": [0.8, 1.0, 0.9, 0.8, 1.0, 0.9],
                         "mask_replay": [True, True, False, False, False, True],
                         study.SCORE: [0.1, 0.5, 0.2, 0.3, 0.5, 0.4]})
    t = study._label_truncation(runs)
    assert list(t["sampler"]) == ["top-p 0.8 +replay", "top-p 1 +replay", "top-p 0.9", "top-p 0.8", "top-p 1",
                                  "top-p 0.9 +replay"]
    assert list(t["truncates"]) == [True, False, True, True, False, True]
    assert study.truncation_order(t) == ["top-p 1", "top-p 1 +replay", "top-p 0.9", "top-p 0.9 +replay", "top-p 0.8",
                                         "top-p 0.8 +replay"]
    assert study.noop_identical(t) is True
    t.loc[t["sampler"] == "top-p 1 +replay", study.SCORE] = 0.49
    assert study.noop_identical(t) is False
    assert study.noop_identical(t[t["truncates"]]) is None
