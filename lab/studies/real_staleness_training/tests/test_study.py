"""The real_staleness_training study run small on the lab's transformer: the three sweeps, the summary, the report
reading it, and the same numbers read back from the sweeps' folder; bad input refused before any cell runs."""
import pandas as pd
import pytest

from lab.engine.sweep import expand, load_spec
from lab.errors import LabError
from lab.studies.real_staleness_training import report, study

IQM = f"{study.LABEL}_iqm"


def test_the_study_runs_small_and_reads_back_its_sweeps(tmp_path):
    cfg = study.Config(**{**study.SMOKE, "n_boot": 100}, workers=2, sweep_dir=str(tmp_path / "sweeps"))
    res = study.run(cfg, progress=False)
    assert set(res.results["study"]) == {"sync", "async", "mismatch"}
    mm = res.results[(res.results["study"] == "mismatch") & (res.results["metric"] == IQM)]
    assert set(mm["x"]) == {"bfloat16", "bfloat16+replay"}
    s = res.summary
    assert s["setup"]["size"] == "test" and s["setup"]["seeds"] == 2
    assert [o["better"] for o in s["orderings"]] == ["vespo"]
    assert set(s["mismatch_size"]) == {"bfloat16", "bfloat16+replay"} and min(s["mismatch_size"].values()) > 0
    # the report's decisions and text read the summary's numbers, at the largest staleness
    d = report.decide(s)
    at4 = s["table"]["sync"]
    assert (d.sync.n_low, d.sync.n_high) == ("1", "4")
    assert d.sync.top.high == max((v["4"][IQM] for v in at4.values()), key=lambda v: v[0])
    assert set(d.sync.fell) | set(d.sync.held) == set(at4) and set(d.regimes) == {"async", "mismatch"}
    assert report.headline("real_staleness_training", s).startswith("At N = 4: ")
    text = report.answer(s)
    assert all(report._iv(at4[e]["4"][IQM]) in text for e in at4) and "the sweeps in" not in text
    paper = report.paper_table(s)
    assert list(paper["estimator"]) == list(at4) and list(paper.columns) == ["estimator", "N=1", "N=4"]
    assert paper.set_index("estimator").loc["vespo", "N=4"].endswith("(paper 70%)")  # VESPO's table at N = 4
    fig = report.accuracy_vs_setting(res.results)
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == list(at4)
    # N = 1: every estimator is REINFORCE, so the IQMs agree exactly
    n1 = {e: v["1"][IQM][0] for e, v in at4.items()}
    assert max(n1.values()) - min(n1.values()) < 1e-9
    again = study.run(study.Config(results=str(tmp_path / "sweeps"), n_boot=100), progress=False)
    pd.testing.assert_frame_equal(again.results, res.results)
    assert again.summary["setup"]["source"].startswith("the sweeps in")
    with pytest.raises(LabError, match="does not exist"):
        study.Config(results=str(tmp_path / "nothing")).validate()


@pytest.mark.parametrize("name", ["sync", "async", "mismatch"])
def test_the_full_tables_specs_are_valid_sweeps(name):
    spec = load_spec(study.SWEEPS / f"real_staleness_{name}.yaml")
    cells = expand(spec)
    assert spec.name == f"real_staleness_{name}" and len(cells) >= 9 * 2
    assert {c["env"] for c in cells} == {"chain6"} and {c["regime"] for c in cells} == {name}


@pytest.mark.parametrize("fields, words", [
    ({"sampler_dtypes": ["float64"]}, "sampler_dtypes"),
    ({"warm_start": 1.0}, "warm_start"),
    ({"estimators": ["reinforce"]}, "baseline 'ppo_clip' is not among the estimators"),
    ({"minibatches": [], "etas": [], "sampler_dtypes": []}, "every study is switched off"),
])
def test_bad_configs_are_refused(fields, words):
    with pytest.raises(LabError, match=words):
        study.Config(**fields).validate()
