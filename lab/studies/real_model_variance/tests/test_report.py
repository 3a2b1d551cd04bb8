"""What the real_model_variance report decides is what the summary says: decisions on hand-made summaries, the
template rendering them, the table and figures on a small real run, and a report built from an empty model cache
showing no progress output."""
import copy
import re
from contextlib import nullcontext
from dataclasses import asdict

import pytest

from lab.reports.style import color, interval
from lab.studies.real_model_variance import report
from lab.studies.real_model_variance import study as rmv


def _lag(kl, ests):
    """ests: name -> (rel_mse, lo, hi); sequence IS's exact bias is float64 rounding, the others' 0.2."""
    return rmv.Lag(kl, 0.1, [0.9, 0.8, 1.0],
                   {e: rmv.Point([v, lo, hi], [0.0, -1.0, 1.0], exact_rel_bias=1e-16 if e == "seq_is" else 0.2)
                    for e, (v, lo, hi) in ests.items()})


def _summary(cells: dict) -> dict:
    lags = sorted({float(k) for c in cells.values() for k in c.per_lag})
    lengths = sorted({c.length for c in cells.values()})
    return asdict(rmv.Summary("real_model_variance", "chain3", "chain", "small", ["reinforce", "seq_is", "vespo"],
                              lags, lengths, "rloo", 200, 0.3, cells, rmv.findings(cells, lags, lengths)))


ON = {"reinforce": (4.5, 4.0, 5.0), "seq_is": (4.5, 4.0, 5.0), "vespo": (4.5, 4.0, 5.0)}  # on-policy: all coincide
TAB_ON = {"reinforce": (1.0, 0.9, 1.1), "seq_is": (1.0, 0.9, 1.1), "vespo": (1.0, 0.9, 1.1)}
CELLS = {
    "transformer/T=2": rmv.Cell("transformer", 2, 7000, 1.0, 0.3, {
        "0": _lag(0.0, ON),
        "4": _lag(0.05, {"reinforce": (6.0, 5.0, 7.0), "seq_is": (0.9, 0.7, 0.99), "vespo": (0.6, 0.5, 0.8)}),
        "8": _lag(0.13, {"reinforce": (1.1, 1.0, 1.2), "seq_is": (1.3, 1.1, 1.6), "vespo": (1.2, 1.05, 1.4)})}),
    "tabular/T=2": rmv.Cell("tabular", 2, 100, 1.0, 0.3, {
        "0": _lag(0.0, TAB_ON),
        "4": _lag(0.04, {"reinforce": (2.0, 1.5, 2.5), "seq_is": (0.7, 0.6, 0.8), "vespo": (0.8, 0.7, 0.9)}),
        "8": _lag(0.1, {"reinforce": (0.6, 0.5, 0.7), "seq_is": (0.9, 0.8, 1.0), "vespo": (0.95, 0.8, 1.1)})}),
}
SUMMARY = _summary(CELLS)


def test_the_focus_is_where_the_corrections_differ_most_not_the_largest_lag():
    d = report.decide(report.summary_of(SUMMARY))
    fo = d.focus
    assert (fo.length, fo.lag) == (2, "4")  # at lag 8 every estimator is within a factor 1.2 on the transformer
    assert fo.picks["transformer"].estimator == "vespo" and fo.picks["tabular"].estimator == "seq_is"
    assert fo.agree is False and fo.picks["transformer"].spread == pytest.approx(10.0)
    assert fo.picks["transformer"].reinforce == 6.0 and fo.picks["transformer"].kl_token == 0.05
    assert d.noise == {"transformer": 4.5, "tabular": 1.0}
    assert d.max_lag == "8" and d.lengths[0].agree is True  # at lag 8 both pick reinforce; at lag 4 they differ
    assert d.lengths[0].picks["transformer"].estimator == "reinforce"
    assert d.lengths[0].picks["transformer"].beats_zero_update is False
    assert d.exact.holds and d.coverage == rmv.Coverage(6, 6)


def test_when_nothing_helps_the_focus_is_the_largest_lag_of_the_longest_response():
    cells = copy.deepcopy(CELLS)
    for cell in cells.values():
        for lag in cell.per_lag.values():
            for p in lag.estimators.values():
                p.rel_mse = [2 * p.rel_mse[0], 1.5, 3.0]  # every interval above a zero update's 1
    d = report.decide(report.summary_of(_summary(cells)))
    assert (d.focus.length, d.focus.lag) == (2, "8")
    assert not any(p.beats_zero_update for p in d.focus.picks.values())
    line = report.headline("real_model_variance", _summary(cells))
    assert line.startswith("T=2, lag 8") and "(1×)" in line  # the zero update's MSE is stated beside them


def test_one_model_only_has_no_agreement():
    cells = {k: v for k, v in CELLS.items() if k.startswith("transformer")}
    d = report.decide(report.summary_of(_summary(cells)))
    assert d.focus.agree is None and d.noise == {"transformer": 4.5} and list(d.focus.picks) == ["transformer"]
    assert "transformer" in report.answer(_summary(cells)) and "tabular" not in report.answer(_summary(cells))


def test_the_headline_states_the_focus_with_its_numbers():
    line = report.headline("real_model_variance", SUMMARY)
    assert line.startswith("T=2, lag 4") and "lag 8" not in line and "(1×)" not in line
    transformer, tabular = line.split("lowest MSE", 1)[1].split("), ")[:2]  # one clause per model, in order
    assert all(x in transformer for x in ("vespo", "0.6×", "transformer", "0.05"))
    assert all(x in tabular for x in ("seq_is", "0.7×", "table", "0.04"))


def test_the_answer_renders_every_decision():
    md = report.answer(SUMMARY)
    for fact in ("chain3", "7,000", "0.3", "1.0e-16", "6 of", "lag 4", "**vespo** 0.6 [0.5, 0.8]",
                 "**seq_is** 0.7 [0.6, 0.8]", "6×", "4.5×", "lag 8", "**reinforce** 1.1 [1, 1.2]"):
        assert fact in md, fact
    assert "{" not in md and "}" not in md  # no template syntax left behind
    agreeing = copy.deepcopy(SUMMARY)
    agreeing["cells"]["tabular/T=2"]["per_lag"]["4"]["estimators"]["vespo"]["rel_mse"] = [0.5, 0.4, 0.6]
    assert report.decide(report.summary_of(agreeing)).focus.agree is True
    assert report.answer(agreeing) != md.replace("0.8 [0.7, 0.9]", "0.5 [0.4, 0.6]")  # the verdict is stated


@pytest.fixture(scope="module")
def smoke(one_thread_module):
    return rmv.run(rmv.Config(**{**rmv.SMOKE, "n_boot": 100}), progress=False)


@pytest.mark.slow
def test_a_small_run_reads_back_as_its_summary(smoke):
    s = report.summary_of(smoke.summary)
    assert set(s.cells) == {"transformer/T=2", "tabular/T=2"} and s.findings.seq_is_exactly_unbiased.holds
    d = report.decide(s)
    assert d.focus.lag == "2"  # lag 0: every correction is REINFORCE, no spread
    assert set(d.focus.picks) == {"transformer", "tabular"} and report.headline("real_model_variance", smoke.summary)


@pytest.mark.slow
def test_table_stars_the_lowest_mse_per_column(smoke):
    s = report.summary_of(smoke.summary)
    shown = report.mse_table(smoke.summary).data.set_index("estimator")
    for cell in s.cells.values():
        ests = cell.per_lag["2"].estimators
        col = f"T={cell.length} {report.LABELS[cell.model]}"
        starred = [e for e in shown.index if shown.loc[e, col].startswith("★")]
        assert starred == [min(ests, key=lambda e: ests[e].rel_mse[0])]
        assert all(shown.loc[e, col].endswith(interval(*ests[e].rel_mse)) for e in ests)


@pytest.mark.slow
def test_figures_draw_one_line_per_estimator_per_panel_in_its_colour(smoke):
    for fig in (report.mse_figure(smoke.results), report.exact_bias_figure(smoke.results)):
        assert [ax.get_title() for ax in fig.axes] == ["transformer, T = 2", "tabular (same π₀), T = 2"]
        for ax in fig.axes:
            drawn = {ln.get_label(): ln.get_color() for ln in ax.lines if not ln.get_label().startswith("_")}
            assert drawn == {e: color(e) for e in ("reinforce", "seq_is", "token_is")}


PROGRESS = re.compile(r"\d+/\d+ \[\d+:\d+|it/s\]|s/it\]|pretrain \w+ \(")  # a tqdm bar's counter, rate or title


@pytest.mark.slow
def test_the_report_shows_no_progress_output_when_the_warm_start_is_trained(tmp_path, monkeypatch):
    """From an empty model cache the notebook trains its warm start; its HTML holds no progress bar, even where the
    driver's kernel-wide quiet setting is off (a notebook run by hand or by papermill directly)."""
    from lab.reports import build

    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("LAB_QUIET", raising=False)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(build, "_quiet_kernel", nullcontext)
    out = build.run_report("real_model_variance", out_root=tmp_path / "reports", smoke=True)
    assert list((tmp_path / "cache" / "pretrain").glob("*.pt")), "the warm start was not trained in the notebook"
    html = (out / "real_model_variance.html").read_text(encoding="utf-8")
    assert (out / "summary.json").exists() and html.count("data:image/png") >= 2  # the figures are there
    assert PROGRESS.search(html) is None, PROGRESS.search(html).group()
