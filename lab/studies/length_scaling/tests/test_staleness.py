"""The transformer staleness table across lengths: the flips and the report's decisions on hand-made tables and
summaries, the Config's checks (one line before any run), and the full tables' sweep specs."""
import copy
import json

import pandas as pd
import pytest

from lab.engine.sweep import expand, load_spec
from lab.errors import LabError
from lab.studies.length_scaling import report, staleness, study

IQM = staleness.IQM


def _rows(study_name, x, length, cells):
    """cells: estimator -> (value, lo, hi)."""
    return [{"study": study_name, "length": length, "setting": "minibatches", "x": x, "estimator": e, "metric": IQM,
             "value": v, "lo": lo, "hi": hi} for e, (v, lo, hi) in cells.items()]


def test_a_flip_is_a_reversal_with_intervals_apart_at_both_lengths():
    rows = (_rows("sync", "16", 6, {"vespo": (0.6, 0.55, 0.65), "ppo_clip": (0.4, 0.35, 0.45),
                                    "gspo": (0.5, 0.3, 0.7)})
            + _rows("sync", "16", 64, {"vespo": (0.2, 0.15, 0.25), "ppo_clip": (0.5, 0.45, 0.55),
                                       "gspo": (0.1, 0.05, 0.15)})
            + _rows("sync", "16", 256, {"vespo": (0.3, 0.1, 0.5), "ppo_clip": (0.35, 0.2, 0.5),
                                        "gspo": (0.3, 0.25, 0.35)})
            + _rows("sync", "1", 6, {"vespo": (0.6, 0.55, 0.65), "ppo_clip": (0.4, 0.35, 0.45)})
            + _rows("sync", "1", 64, {"vespo": (0.45, 0.35, 0.55), "ppo_clip": (0.5, 0.45, 0.55)}))
    table = pd.DataFrame(rows)
    table = pd.concat([table, table.assign(metric="collapse_rate", value=0.9, lo=0.8, hi=1.0)])  # not scored
    found = staleness.flips(table)
    # N = 16: vespo above ppo_clip at T = 6 (apart), below it at T = 64 (apart); at T = 256 they overlap; gspo's
    # T = 6 interval overlaps both. N = 1: the order changes at T = 64 but within the intervals: no flip.
    assert [(f["setting"], f["first"], f["second"], f["length_a"], f["length_b"]) for f in found] == [
        ("16", "vespo", "ppo_clip", 6, 64)]
    assert found[0]["first_at_a"] == [0.6, 0.55, 0.65] and found[0]["second_at_b"] == [0.5, 0.45, 0.55]
    ties = pd.DataFrame(_rows("sync", "16", 6, {"a": (0.5, 0.4, 0.6), "b": (0.3, 0.2, 0.4)})
                        + _rows("sync", "16", 64, {"a": (0.3, 0.2, 0.4), "b": (0.5, 0.4, 0.6)}))
    assert staleness.flips(ties) == []  # touching intervals (0.4 = 0.4) are not apart
    collapsed = pd.DataFrame(_rows("sync", "64", 6, {"a": (0.7, 0.65, 0.75), "b": (0.5, 0.45, 0.55)})
                             + _rows("sync", "64", 64, {"a": (0.0, 0.0, 0.0), "b": (0.001, 0.0003, 0.03)}))
    assert staleness.flips(collapsed) == []  # both collapsed at T = 64: apart by less than TIE, not a flip
    apart = collapsed.assign(lo=collapsed["lo"].where(collapsed["value"] != 0.001, 0.02))
    assert [(f["first"], f["second"]) for f in staleness.flips(apart)] == [("a", "b")]


def _runs(study_name, spec):
    """A finished sweep's runs table: spec is {length: {(estimator, setting): n_seeds}}."""
    col = staleness.real.SETTINGS[study_name]
    return (None, pd.DataFrame([{"estimator": e, col: x, "seed": s, "length": t} for t, cells in spec.items()
                                for (e, x), n in cells.items() for s in range(n)]))


def test_coverage_names_what_a_stopped_sweep_did_not_finish():
    full = {(e, x): 3 for e in ("reinforce", "vespo") for x in (1, 16)}
    short = {("reinforce", 1): 3, ("reinforce", 16): 2}  # vespo not run, reinforce N = 16 one seed short
    sweeps = {"sync": _runs("sync", {6: full, 256: short}),
              "async": _runs("async", {6: {("vespo", 0): 3, ("vespo", 8): 3}, 256: {("vespo", 0): 3}})}
    assert staleness.coverage(sweeps) == {
        "sync": {"256": {"finished": 5, "of": 12, "short": ["reinforce at N = 16: 2 of 3 seeds", "vespo not run"]}},
        "async": {"256": {"finished": 3, "of": 6, "short": ["vespo at η = 8 not run"]}}}
    assert staleness.coverage({"sync": _runs("sync", {6: full, 64: full})}) == {}  # complete: nothing said


def _cell(v, w=0.05, c=0.0):
    return {"final_accuracy_iqm": [v, v - w, v + w], "collapse_rate": [c, 0.0, c + 0.3]}


def _ordering(better, worse, verdict, n=16.0):
    return {"better": better, "worse": worse, "paper": [0.6, 0.5], "miniature": [0.5, 0.4], "n": n,
            "intervals": [[0.4, 0.6], [0.3, 0.5]], "verdict": verdict}


def _summary(section):
    base = json.loads(json.dumps(HAND_MARKOV))
    base["staleness"] = section
    return base


HAND_MARKOV = {"study": "length_scaling", "env": "long_dense", "policy": "markov", "lengths": [8], "regimes": [],
               "kl_token": 0.01, "kl_seq": 0.5, "loss_agg_modes": {}, "points": [], "fits": [],
               "config": {"batch_size": 32, "group_size": 8, "advantage": "rloo",
                          "loss_agg_mode": "seq-mean-token-sum", "replicates": 100, "trajectory_steps": 8}}
SECTION = {
    "source": "the sweeps in runs/x", "env": "copy6", "task": "copy", "size": "small",
    "lengths": [6, 64], "estimators": ["reinforce", "ppo_clip", "vespo"], "seeds": 3, "baseline": "ppo_clip",
    "parameters": {"6": 27008, "64": 30080}, "initial_heldout_accuracy": {"6": 0.31, "64": 0.29},
    "updates": {"sync": [6, 96]}, "runs": {"sync": 36},
    "table": {"sync": {"6": {"reinforce": {"1": _cell(0.5), "16": _cell(0.2)},
                             "ppo_clip": {"1": _cell(0.5), "16": _cell(0.45)},
                             "vespo": {"1": _cell(0.5), "16": _cell(0.6)}},
                       "64": {"reinforce": {"1": _cell(0.4), "16": _cell(0.1)},
                              "ppo_clip": {"1": _cell(0.4), "16": _cell(0.42)},
                              "vespo": {"1": _cell(0.4), "16": _cell(0.44, w=0.1)}}}},
    "flips": [{"study": "sync", "setting": "16", "first": "vespo", "second": "ppo_clip", "length_a": 6,
               "length_b": 64, "first_at_a": [0.6, 0.55, 0.65], "second_at_a": [0.45, 0.4, 0.5],
               "first_at_b": [0.2, 0.15, 0.25], "second_at_b": [0.42, 0.37, 0.47]}],
    "orderings": {"6": [_ordering("vespo", "ppo_clip", "reproduced")],
                  "64": [_ordering("vespo", "ppo_clip", "not separated")]},
    "paper_comparison": {"6": None, "64": None}}


def test_the_sections_decisions_read_the_summary():
    d = report.decide_staleness(_summary(SECTION))
    assert d.settings == {"sync": "16"}
    at6, at64 = d.orders["sync"]
    assert [e for e, _ in at6.ranked] == ["vespo", "ppo_clip", "reinforce"] and at6.apart
    assert [e for e, _ in at64.ranked] == ["vespo", "ppo_clip", "reinforce"] and at64.apart
    assert d.reproduced == {6: ["vespo > ppo_clip"], 64: []} and d.unresolved == {6: 0, 64: 1}
    assert d.appears == [6]
    md = report.staleness_answer(_summary(SECTION))
    for fact in ("copy task", "checked at N = 16", "T = 64",
                 "vespo 0.60 [0.55, 0.65] above ppo_clip 0.45 [0.40, 0.50] at T = 6", "below it at T = 64",
                 "appears in full at T = 6", "30080 parameters at T = 64", "the sweeps in"):
        assert fact in md, fact
    html = report.staleness_table(_summary(SECTION)).to_html()
    assert "0.44 [0.34, 0.54]" in html and "T=64" in html
    fig = report.staleness_figure(_summary(SECTION))
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["reinforce", "ppo_clip", "vespo"]


def test_an_unfinished_table_says_what_did_not_run():
    s = copy.deepcopy(SECTION)
    s["coverage"] = {"sync": {"64": {"finished": 4, "of": 6, "short": ["vespo not run"]}}}
    s["table"]["sync"]["64"].pop("vespo")
    s["orderings"]["64"] = []
    md = report.staleness_answer(_summary(s))
    assert "Not every run finished" in md and "sync, T = 64: 4 of 6 runs; vespo not run." in md
    assert "T = 64: not checked: no pair of the paper's methods finished" in md
    assert "Not every run finished" not in report.staleness_answer(_summary(SECTION))  # a complete table: not said


def test_no_flip_and_no_section_are_said():
    s = copy.deepcopy(SECTION)
    s["flips"], s["orderings"] = [], {"6": [_ordering("vespo", "ppo_clip", "reversed")], "64": []}
    md = report.staleness_answer(_summary(s))
    assert "No flip" in md and "reversed ppo_clip > vespo" in md and "does not appear in full" in md
    assert report.decide_staleness(HAND_MARKOV) is None
    md = report.staleness_answer(HAND_MARKOV)
    assert "Not run in this report" in md and "length_transformer_sync.yaml" in md and "results=" in md


@pytest.mark.parametrize("kwargs,match", [
    ({"staleness_lengths": [6, 6]}, "more than once"),
    ({"staleness_lengths": [6], "staleness_env": "long_dense"}, "not a task env"),
    ({"staleness_lengths": [6], "staleness_estimators": ["reinforce"]}, "baseline 'ppo_clip'"),
    ({"staleness_lengths": [6], "staleness_minibatches": []}, "staleness_minibatches or staleness_etas"),
    pytest.param({"staleness_lengths": [6], "staleness_minibatches": [3]}, "do not divide",
                 marks=pytest.mark.slow),  # every cell is checked first
    ({"staleness_lengths": [1024]}, "GiB"),  # copy at T = 1024 with 256 responses per rollout: over the budget
    ({"staleness_lengths": [10_000]}, "staleness_lengths"),
    ({"results": "/nonexistent/length_transformer"}, "does not exist"),
])
def test_bad_staleness_configs_are_one_line_before_any_run(kwargs, match):
    with pytest.raises(LabError, match=match):
        study.Config(**kwargs).validate()


@pytest.mark.slow  # a thousand cells validated
@pytest.mark.parametrize("name", ["sync", "async"])
def test_the_full_tables_specs_are_valid_sweeps_over_length(name):
    spec = load_spec(staleness.SWEEPS / f"length_transformer_{name}.yaml")
    cells = expand(spec)  # every cell validated, its memory against the training budget included
    assert spec.name == f"length_transformer_{name}" and {c["regime"] for c in cells} == {name}
    assert sorted({c["env_overrides"]["difficulty"] for c in cells}) == [6, 64, 256]
    assert {"reinforce", "ppo_clip", "gspo", "vespo", "seq_is"} <= {c["estimator"] for c in cells}
    ours = study.Config(staleness_lengths=[6, 64, 256], staleness_etas=[0, 2, 8]).staleness_table().specs()[name]
    assert {k: v for k, v in ours.base.items() if k != "device"} == spec.base  # the Config's defaults, full size
    assert list(ours.grid) == list(spec.grid) and ours.grid["env_overrides"] == spec.grid["env_overrides"]


@pytest.mark.parametrize("name", ["sync", "async"])
def test_the_gpu_tables_specs_are_the_cpu_tables_at_one_more_length_on_cuda(name):
    """The specs of the table run on a GPU: the CPU-sized grid with T = 256 added (the longest first, so a sweep
    stopped early has the lengths a CPU cannot reach) and every cell on CUDA. (Expanding them validates the device,
    which this machine may lack.)"""
    cpu = load_spec(staleness.SWEEPS / f"length_transformer_{name}_cpu.yaml")
    gpu = load_spec(staleness.SWEEPS / f"length_transformer_{name}_gpu.yaml")
    assert gpu.name == f"length_transformer_{name}_gpu" and gpu.base == {**cpu.base, "device": "cuda"}
    assert [o["difficulty"] for o in gpu.grid["env_overrides"]] == [256, 64, 32, 6]
    assert {k: v for k, v in gpu.grid.items() if k != "env_overrides"} == {
        k: v for k, v in cpu.grid.items() if k != "env_overrides"}


@pytest.mark.parametrize("name", ["sync", "async"])
def test_the_cpu_tables_specs_are_the_full_tables_cut_down(name):
    """The CPU-sized specs (the runs the README quotes) are sub-grids of the full tables' specs with the same name and
    base, so the full spec run into the same folder reuses their cells."""
    full = load_spec(staleness.SWEEPS / f"length_transformer_{name}.yaml")
    cpu = load_spec(staleness.SWEEPS / f"length_transformer_{name}_cpu.yaml")
    assert cpu.name == full.name and cpu.base == full.base and list(cpu.grid) == list(full.grid)
    for key, values in cpu.grid.items():
        assert all(v in full.grid[key] or key == "env_overrides" for v in values), key
    assert [o["difficulty"] for o in cpu.grid["env_overrides"]] == [6, 32, 64]
    assert len(expand(cpu)) == (225 if name == "sync" else 150)

@pytest.mark.slow
def test_the_section_runs_small_and_reads_back_its_sweeps(tmp_path):
    """Two short copy tasks (3 and 4 digits) on the test-size transformer, two seeds: the report's own sweeps, then
    the same numbers read back from their folder with ``results``."""
    small = dict(lengths=[8], regimes=["token"], replicates=10, n_boot=50, trajectory_steps=1,
                 estimators=["seq_is", "reinforce"], staleness_estimators=["reinforce", "ppo_clip", "vespo"],
                 staleness_minibatches=[1, 2], staleness_seeds=[0, 1], staleness_size="test", staleness_steps=1,
                 staleness_rollout_batch=16, staleness_lr=1e-3, workers=2)
    res = study.run(study.Config(**small, staleness_lengths=[3, 4], sweep_dir=str(tmp_path / "sweeps")),
                    progress=False)
    t = res.summary["staleness"]
    assert t["lengths"] == [3, 4] and t["runs"] == {"sync": 24} and t["seeds"] == 2
    assert set(t["table"]["sync"]) == {"3", "4"} and set(t["table"]["sync"]["4"]) == {"reinforce", "ppo_clip",
                                                                                          "vespo"}
    n1 = {e: c["1"]["final_accuracy_iqm"][0] for e, c in t["table"]["sync"]["3"].items()}
    assert max(n1.values()) - min(n1.values()) < 1e-9  # N = 1: every estimator is REINFORCE
    tf = res.results[res.results["policy"] == "transformer"]
    assert set(tf["length"]) == {3, 4} and set(tf["study"]) == {"sync"}
    assert staleness.flips(tf) == t["flips"]
    md = report.staleness_answer(res.summary)
    assert "T = 4" in md and "the report's own sweeps" in md
    again = study.run(study.Config(**small, results=str(tmp_path / "sweeps")), progress=False)
    pd.testing.assert_frame_equal(again.results, res.results)
    assert again.summary["staleness"]["source"].startswith("the sweeps in")
