"""What the real_model_variance report says and draws, checked against the summary of a small run of its study."""
import pytest

from lab.reports import real_model_variance as report
from lab.reports.style import color, interval
from lab.studies import real_model_variance as rmv


@pytest.fixture(scope="module")
def study(one_thread_module):
    return rmv.run(rmv.Config(lengths=[2], model="test", values=[0, 2], replicates=30, trajectory_steps=2,
                              estimators=["reinforce", "seq_is", "token_is"], n_boot=100), progress=False)


def test_headline_and_answer_state_the_summarys_findings(study):
    s = study.summary
    f = s["findings"]
    assert f["seq_is_exactly_unbiased"]["holds"]  # advantage R by enumeration: float64 rounding only
    hl = report.headline(s)
    assert hl.startswith("sequence IS exactly unbiased on the transformer and the table at every lag")
    text = report.answer(s)
    for model in ("transformer", "tabular"):
        best = f["lowest_mse_at_max_lag"][f"{model}/T=2"]
        said = f"{model}: **{best['estimator']}** {interval(*best['rel_mse'])}"
        assert said in text and f"lag 2, T=2: lowest MSE {model} {best['estimator']}" in hl
        if not best["beats_zero_update"]:
            assert said + " (not clearly below a zero update's 1)" in text
    agree = f["agree"]["2"]
    assert ("The two agree." in text) == agree and ("**They disagree**" in text) == (not agree)
    assert f"at most {f['seq_is_exactly_unbiased']['max_rel_bias']:.1e} of its norm" in text


def test_table_stars_the_lowest_mse_per_column(study):
    s = study.summary
    shown = report.mse_table(s).data.set_index("estimator")
    for key, cell in s["cells"].items():
        ests = cell["per_lag"]["2"]["estimators"]
        col = f"T={cell['length']} {report.LABELS[cell['model']]}"
        starred = [e for e in shown.index if shown.loc[e, col].startswith("★")]
        assert starred == [min(ests, key=lambda e: ests[e]["rel_mse"][0])]
        assert all(shown.loc[e, col].endswith(interval(*ests[e]["rel_mse"])) for e in ests)


def test_figures_draw_one_line_per_estimator_per_panel_in_its_colour(study):
    for fig in (report.mse_figure(study.results), report.exact_bias_figure(study.results)):
        assert [ax.get_title() for ax in fig.axes] == ["transformer, T = 2", "tabular (same π₀), T = 2"]
        for ax in fig.axes:
            drawn = {ln.get_label(): ln.get_color() for ln in ax.lines if not ln.get_label().startswith("_")}
            assert drawn == {e: color(e) for e in ("reinforce", "seq_is", "token_is")}
