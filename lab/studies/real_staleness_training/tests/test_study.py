"""The real_staleness_training study run small on the lab's transformer: the four sweeps, the summary, the report
reading it, and the same numbers read back from the sweeps' folder; bad input refused before any cell runs."""
import pandas as pd
import pytest

from lab.engine.sweep import cell_id, expand, load_spec
from lab.errors import LabError
from lab.studies.real_staleness_training import report, study

IQM = f"{study.LABEL}_iqm"


@pytest.mark.slow
def test_the_study_runs_small_and_reads_back_its_sweeps(tmp_path):
    cfg = study.Config(**{**study.SMOKE, "n_boot": 100}, workers=2, sweep_dir=str(tmp_path / "sweeps"))
    res = study.run(cfg, progress=False)
    assert set(res.results["study"]) == {"sync", "async", "mismatch", "truncation"}
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
    assert set(d.sync.fell) | set(d.sync.held) == set(at4) and set(d.regimes) == {"async", "mismatch", "truncation"}
    # truncation: top-p 0.8 with and without replay; the untruncated runs are the sync study's N = 4 cells, the same
    # configurations, so their numbers are the sync study's exactly
    tr = s["table"]["truncation"]
    assert list(s["truncation"]) == ["top-p 1", "top-p 0.8", "top-p 0.8 +replay"]
    assert s["truncation_reference_shared"] and s["truncation_noop_identical"] is None
    assert set(tr) == {"ppo_clip", "vespo"} and all(tr[e]["top-p 1"] == at4[e]["4"] for e in tr)
    assert 0 < s["truncation"]["top-p 0.8"]["kept_mass"] < 1 and s["truncation"]["top-p 1"]["kept_mass"] is None
    [t] = d.truncation
    assert t.sampler == "top-p 0.8" and {r.estimator for r in t.rows} == set(tr)
    assert all(r.plain == tr[r.estimator]["top-p 0.8"][IQM] for r in t.rows)
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


@pytest.mark.slow
@pytest.mark.parametrize("name", ["sync", "async", "mismatch", "truncation"])
def test_the_full_tables_specs_are_valid_sweeps(name):
    spec = load_spec(study.SWEEPS / f"real_staleness_{name}.yaml")
    cells = expand(spec)
    assert spec.name == f"real_staleness_{name}" and len(cells) >= 9 * 2
    assert {c["env"] for c in cells} == {"chain6"} and {c["regime"] for c in cells} == {name.replace("truncation",
                                                                                                      "sync")}


@pytest.mark.slow
def test_the_truncation_tables_reference_is_the_sync_tables_cells():
    """Every untruncated twin of a truncation cell (top-p 1, no replay) is a cell of the sync table: the same id."""
    trunc, sync = (expand(load_spec(study.SWEEPS / f"real_staleness_{n}.yaml")) for n in ("truncation", "sync"))
    twins = {cell_id({**c, "top_p": 1.0, "mask_replay": False}) for c in trunc}
    assert {c["estimator"] for c in trunc} == {c["estimator"] for c in sync}
    assert len(twins) == 15 * 10 and twins <= {cell_id(c) for c in sync}


@pytest.mark.parametrize("fields, words", [
    ({"sampler_dtypes": ["float64"]}, "sampler_dtypes"),
    ({"warm_start": 1.0}, "warm_start"),
    ({"estimators": ["reinforce"]}, "baseline 'ppo_clip' is not among the estimators"),
    ({"minibatches": [], "etas": [], "sampler_dtypes": [], "top_ps": []}, "every study is switched off"),
    ({"top_ps": [0.8, 0.8]}, "top_ps lists 0.8 more than once"),
    ({"top_ps": [1.5]}, "top_ps"),
    ({"truncation_estimators": []}, "truncation_estimators is empty"),
    ({"truncation_estimators": ["aspo"], "minibatches": [], "etas": [], "sampler_dtypes": []}, "no mask replay"),
])
def test_bad_configs_are_refused(fields, words):
    with pytest.raises(LabError, match=words):
        study.Config(**fields).validate()
