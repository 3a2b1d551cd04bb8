"""The sampling_truncation study on a real smoke run: the truths, the kept mass, replay's exact fix, bad input."""
import pytest

from lab.errors import LabError
from lab.studies.sampling_truncation import report, study


@pytest.fixture(scope="module")
def smoke():
    return study.run(study.Config(**study.SMOKE), progress=False)


@pytest.mark.slow
def test_the_smoke_run_answers_with_both_truths(smoke):
    results, summary = smoke
    s = report.summary_of(summary)
    by = {(e.kind, e.value): e for e in s.per_setting}
    none, p8, k2 = by[("top_p", 1.0)], by[("top_p", 0.8)], by[("top_k", 2.0)]
    assert none.kept_mass == 1.0 and none.truth_gap == 0.0 and none.outside_band[0] == 0.0
    for e in (p8, k2):
        assert e.kept_mass < 0.95 and e.truth_gap > 0.01
        lo, hi = e.mean_ratio[1], e.mean_ratio[2]
        assert lo - 1e-6 <= e.kept_mass <= hi + 1e-6  # the sampled mean ratio is the kept mass (within its interval)
        assert e.mean_ratio_replay[0] == pytest.approx(1.0, abs=1e-6) and e.outside_band_replay[0] == 0.0
        est = e.estimators
        for n in ("seq_is", "token_is", "ppo_clip"):  # replay: exact for the deployed gradient; without: biased
            assert est[n]["replay"]["exact_bias"] < 1e-8 and est[n]["plain"]["exact_bias"] > 1e-3
            assert est[n]["replay"]["exact_bias@full"] == pytest.approx(e.truth_gap, rel=1e-6)
    for n in ("seq_is", "token_is", "ppo_clip"):  # without truncation the two modes are one
        plain, replayed = none.estimators[n]["plain"], none.estimators[n]["replay"]
        assert plain == pytest.approx(replayed, rel=1e-9, abs=1e-12)
    assert set(results.replay) == {"plain", "replay"} and results.value.notna().all()


def test_the_report_decides_from_the_summary(smoke):
    _, summary = smoke
    d = report.decide(report.summary_of(summary))
    assert d.focus.kept_mass == min(e["kept_mass"] for e in summary["per_setting"])
    assert set(d.fixed) == {"seq_is", "token_is", "ppo_clip"} and d.ratio_tracks_mass
    text = report.answer(summary)
    assert "seq_is" in text and f"{d.focus.kept_mass:.4g}" in text
    assert "0/3" not in report.headline("sampling_truncation", summary)
    report.bias_table(summary).to_html()
    report.bias_vs_kept_mass(smoke[0])


@pytest.mark.parametrize("overrides", [dict(top_p=[0.0]), dict(top_p=[1.2]), dict(top_k=[0]), dict(top_k=[7]),
                                       dict(top_p=[], top_k=[]), dict(estimators=["kl_k3"]),
                                       dict(estimators=["opd"]), dict(batch_size=30)])
def test_bad_input_is_one_line_before_work(overrides):
    with pytest.raises(LabError) as err:
        study.Config(**{**study.SMOKE, **overrides}).validate()
    assert "\n" not in str(err.value)
