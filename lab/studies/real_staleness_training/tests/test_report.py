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
