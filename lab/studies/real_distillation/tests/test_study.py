"""The real_distillation study (lab/studies/real_distillation/study.py): bad input as one line, its sweep spec, the
study on a distill sweep's folder (pooled variance ratios equal to the runs' own numbers) and on its own small grid
(aggregation over seeds)."""
import math
from pathlib import Path

import pytest

from lab.engine.distill import DIGITS
from lab.engine.sweep import SweepSpec, expand, load_results, load_spec, run_sweep
from lab.errors import LabError
from lab.studies.real_distillation import study as rd
from lab.studies.real_distillation.report import decide

# a "small" teacher warm-started to 0.5 on 32 prompts of 2-step chain sums (a few seconds, once), a random "test"
# student, a handful of steps: every run below takes about a second
TINY = dict(n_prompts=32, teacher_size="small", teacher_accuracy=0.5, student_size="test", student_accuracy=0.0,
            batch_size=16, steps=3, grad_every=2, probe_size=8, eval_every=2, eval_prompts=4, eval_samples=4)
ROOT = Path(__file__).resolve().parents[4]

pytestmark = pytest.mark.usefixtures("one_thread_module")  # before the module's warm starts


def test_study_config_errors_are_one_line():
    for change, message in [({"estimators": ["vopd"]}, "must include opd"),
                            ({"vocab_sizes": [8]}, r"vocab_sizes must be >= 10"),
                            ({"estimators": ["opd", "vespo"]}, r"estimators\[1\] must be one of opd"),
                            ({"seeds": [0]}, "two seeds"), ({"seeds": [0, 0]}, "more than once"),
                            ({"results": "/nonexistent"}, "not a sweep folder"),
                            ({"student_accuracies": []}, "at least one"),
                            ({"student_accuracies": [1.0]}, "< 1"), ({"probe_size": 1}, ">= 2")]:
        with pytest.raises(LabError, match=message) as err:
            rd.Config(**change).validate()
        assert "\n" not in str(err.value)


def test_the_sweep_spec_lives_in_the_study_folder_and_runs_the_studys_cells():
    spec = load_spec(ROOT / rd.SWEEP)
    assert spec.kind == "distill" and spec.name == "real_distillation"
    cells = expand(spec)
    assert len(cells) == 5 * 4 * 3 * 5  # estimators x V x student starts x seeds
    assert {c["distractors"] + DIGITS for c in cells} == {10, 64, 256, 1024}
    # the study's own grid builds the same cells (the sweep's other fields from its base)
    cfg = rd.Config(vocab_sizes=[10, 64], **{k: spec.base[k] for k in ("env", "difficulty", "n_prompts", "steps")})
    first = cfg.cells()[0]
    assert (first.estimator, first.distractors, first.teacher_size) == ("opd", 0, spec.base["teacher_size"])


SPEC = SweepSpec("d", dict(TINY), {"estimator": ["opd", "vopd"], "seed": [0, 1]}, kind="distill")


def test_the_study_reads_a_sweeps_folder(distill_cache, tmp_path):
    out = tmp_path / "sweep"
    run_sweep(SPEC, out, "local", workers=1)
    steps, _ = load_results(out)
    result, summary = rd.run(rd.Config(results=str(out), n_boot=200))
    assert str(out) in summary["source"] and summary["runs"] == 4 and summary["sweep"]["name"] == "d"
    probes = steps.dropna(subset=["gvar"])
    want = probes["gvar_opd"].sum() / probes["gvar_vopd"].sum()  # pooled over every probe of every run
    got = rd.pick(result, "variance", "var_reduction", "vopd", 10, 0.0)
    assert got["value"] == pytest.approx(want) and got["lo"] <= got["value"] <= got["hi"] and got["n"] == 4
    (setting,) = summary["settings"]
    assert setting["var_reduction"]["vopd"]["value"] == got["value"]
    assert setting["verdict"] == ("helps" if got["lo"] > 1 else "hurts" if got["hi"] < 1 else "unresolved")
    d = decide(summary)
    assert d.most is d.least and d.most.vocab_size == 10
    train = SweepSpec("t", {"steps": 2}, {"seed": [0]})
    run_sweep(train, tmp_path / "train", "local", workers=1)
    with pytest.raises(LabError, match="kind 'train'"):
        rd.run(rd.Config(results=str(tmp_path / "train")))


def test_the_study_runs_its_grid_and_aggregates_over_seeds(distill_cache):
    cfg = rd.Config(estimators=["opd", "vopd", "kl_full"], vocab_sizes=[10], student_accuracies=[0.0], seeds=[0, 1],
                    n_boot=200, **{k: TINY[k] for k in ("n_prompts", "teacher_size", "teacher_accuracy",
                                                         "student_size", "batch_size", "steps", "grad_every",
                                                         "probe_size")}, eval_every=1)
    results, summary = rd.run(cfg)
    assert summary["sweep"] is None and "default grid" in summary["source"] and summary["runs"] == 6
    s = summary["settings"][0]
    assert s["verdict"] in ("helps", "hurts", "unresolved") and s["pred_reduction"]["value"] > 1
    assert math.isclose(s["pred_reduction"]["value"], 1 / (1 - s["value_share"]), rel_tol=0.5)
    curve = results[(results["part"] == "curve") & (results["metric"] == "kl_seq") & (results["estimator"] == "opd")]
    assert list(curve["update"]) == [0, 1, 2, 3] and (curve["n"] == 2).all()  # update 0: the start
    final = rd.pick(results, "final", "kl_minus_opd", "kl_full", 10, 0.0)
    assert final["n"] == 2 and final["lo"] <= final["value"] <= final["hi"]
    assert s["kl_minus_opd"]["kl_full"]["value"] == final["value"]
    assert set(summary["step_cost"]["10"]) == {"vopd", "kl_full"}
