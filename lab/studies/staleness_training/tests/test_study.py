"""The staleness_training study: the summary its aggregation writes (hand-made sweeps), resuming from a sweep folder,
no folder left behind, and bad input refused before any cell runs."""
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lab import stats
from lab.engine.sweep import load_results, run_sweep
from lab.errors import LabError
from lab.studies.staleness_training import study
from lab.studies.staleness_training.tests.hand import hand_sweeps

LAB = Path(sys.executable).parent / "lab"
TINY = dict(env="tiny_target", rollout_batch=16, group_size=4)


def test_the_study_aggregates_the_sweeps_into_the_summary(hand_study):
    results, s = hand_study([0.0, 0.0, 0.5, 1.0], [0.5] * 4)
    # IQM of [0, 0, 0.5, 1]: cut one each end -> 0.25
    assert s["table"]["sync"]["vespo"]["64"]["final_reward_iqm"][0] == pytest.approx(0.25)
    assert s["settings"]["sync"] == {"column": "minibatches", "values": [4.0, 64.0]}
    pc = s["paper_comparison"]
    assert (pc["n_low"], pc["n_high"]) == (4, 64) and pc["estimators"]["vespo"]["paper_high"] == pytest.approx(0.618)
    assert pc["estimators"]["vespo"]["toy_rank"] == 2 and pc["estimators"]["ppo_clip"]["toy_rank"] == 1
    # finals x 2 prompts: 0, 0, 1, 2 and 1, 1, 1, 1: every run ends on a whole number of solved prompts
    assert s["outcomes"]["64"] == {"whole_share": 1.0, "seed_range": pytest.approx(0.5), "zero_reward_share": 0.5}
    assert s["curves"]["64"]["vespo"] == {"rollout": [0, 1], "iqm": [0.25, 0.25], "q25": [0.25, 0.0],
                                          "q75": [0.25, 0.625]}
    assert s["setup"]["length"] == 4 and s["setup"]["n_prompts"] == 2 and s["mismatch_aware"] == ["vespo"]
    assert set(results["study"]) == {"sync", "mismatch"} and results["x"].dtype == float


def test_no_paper_comparison_with_fewer_than_two_of_the_papers_n():
    from lab.studies.staleness_training import aggregate

    sweeps = hand_sweeps([0.5] * 4, [0.5] * 4)
    steps, runs = sweeps["sync"]
    sweeps["sync"] = (steps[steps["minibatches"] == 64], runs[runs["minibatches"] == 64])
    cfg = study.Config(estimators=["ppo_clip", "vespo"], minibatches=[64], seeds=[0, 1, 2, 3], etas=[],
                       noise_levels=[0.0, 0.5], n_boot=50)
    _, s = study.aggregate(cfg, sweeps)
    assert s["paper_comparison"] is None and s["table"]["sync"]["vespo"].keys() == {"64"}
    assert aggregate.setting_key(0.5) == "0.5" and aggregate.setting_key(64.0) == "64"


def test_a_partly_finished_sweep_compares_the_n_every_paper_method_has():
    # a sweep stopped early: vespo has no N = 64 cell. The comparison takes the N every paper method has (before, a
    # KeyError ended the report); with one N left shared there is no comparison
    import pandas as pd

    from lab.studies.staleness_training.paper import paper_comparison

    def table(cells):
        return pd.DataFrame([{"study": "sync", "metric": "final_reward_iqm", "estimator": e, "x": float(x), "value": v,
                              "lo": v - 0.1, "hi": v + 0.1} for e, x, v in cells])

    full = [("ppo_clip", 4, 0.5), ("ppo_clip", 16, 0.4), ("ppo_clip", 64, 0.3), ("vespo", 4, 0.6), ("vespo", 16, 0.5)]
    pc = paper_comparison(table(full))
    assert (pc["n_low"], pc["n_high"]) == (4, 16)
    assert pc["estimators"]["ppo_clip"]["toy_high"] == 0.4 and pc["estimators"]["vespo"]["toy_high"] == 0.5
    assert paper_comparison(table([c for c in full if c[1] != 4])) is None  # only N = 16 shared
    assert paper_comparison(table(full + [("vespo", 64, 0.45)]))["n_high"] == 64


SPEC_GRID = {"estimator": ["reinforce", "ppo_clip"], "minibatches": [1, 4], "seed": [0, 1]}


@pytest.mark.slow
def test_the_study_resumes_from_its_sweep_dir_and_aggregates_the_cells(tmp_path):
    cfg = study.Config(**TINY, steps=20, lr=0.1, estimators=["reinforce", "ppo_clip"], minibatches=[1, 4],
                       seeds=[0, 1], etas=[], noise_levels=[], n_boot=50, sweep_dir=str(tmp_path), workers=2)
    spec = cfg.specs()["sync"]
    assert spec.grid == SPEC_GRID
    run_sweep(spec, tmp_path / "ref", "local", workers=2)
    shutil.copytree(tmp_path / "ref", tmp_path / "sync")  # every cell of the study's sync sweep is done
    _, runs = load_results(tmp_path / "ref")
    cells = {p: p.stat().st_mtime_ns for p in (tmp_path / "sync" / "cells").rglob("*")}
    results, summary = study.run(cfg)
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "sync" / "cells").rglob("*")} == cells  # nothing re-ran
    assert summary["runs"] == {"sync": 8} and set(results["study"]) == {"sync"}
    for (e, n), cell in runs.groupby(["estimator", "minibatches"]):
        want = stats.iqm(cell["final_reward"].to_numpy())
        assert summary["table"]["sync"][e][str(n)]["final_reward_iqm"][0] == pytest.approx(want)


@pytest.mark.slow
def test_without_a_sweep_dir_the_study_leaves_no_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cfg = study.Config(**TINY, steps=1, estimators=["reinforce"], baseline=None, minibatches=[], seeds=[0], etas=[0],
                       noise_levels=[], n_boot=20, workers=1)
    results, summary = study.run(cfg)
    assert summary["runs"] == {"async": 1} and list(tmp_path.iterdir()) == []
    assert set(results["metric"]) == {"final_reward_iqm", "final_reward_median", "collapse_rate"}


@pytest.mark.parametrize("fields, words", [
    ({"estimators": ["reinforce"]}, "baseline 'ppo_clip' is not among the estimators"),
    ({"minibatches": [], "etas": [], "noise_levels": []}, "every study is switched off"),
    ({"seeds": [0, 0]}, "seeds"),
    ({"minibatches": [0]}, "minibatches"),
    ({"estimators": ["reinforce", "nope"], "baseline": None}, "nope"),
])
def test_bad_configs_are_refused(fields, words):
    with pytest.raises(LabError, match=words):
        study.Config(**fields).validate()


@pytest.mark.slow
def test_bad_input_on_the_command_line_is_one_line_and_exit_2(tmp_path):
    out = subprocess.run([str(LAB), "study", "staleness_training", "--lr", "0", "--out", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "lr" in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "run").exists()
