"""Report input before anything runs (names, types, list syntax, parameter files, the study's own checks) and the
driver's outcomes (the summary returned, a failing cell's partial notebook, a failed report in --all)."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lab import reports
from lab.errors import LabError
from lab.reports import params

LAB = Path(sys.executable).parent / "lab"
LESSON = "teach_weight_explosion"  # the quickest notebook: numpy only
BAD_LESSON = {"kls": [-0.1]}  # passes the type checks, fails in the lesson's first computation


def check(name: str, **given) -> dict:
    return params.check(name, reports.REPO_ROOT / reports.REPORTS[name].notebook, given)


def lab(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([str(LAB), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def no_kernel(monkeypatch):
    """Any attempt to start papermill fails the test: the input must be refused before."""
    import papermill

    def refuse(*args, **kwargs):
        raise AssertionError("papermill started")

    monkeypatch.setattr(papermill, "execute_notebook", refuse)


# ---- types ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("default,kind", [(3, "int"), (0.5, "float"), (True, "bool"), ("a", "str"), ({}, "dict"),
                                          ([0, 1, 2], "list[int]"), ([0, 0.5], "list[float]"), (["a"], "list[str]"),
                                          ([[2, 3], [1.5, 1]], "list[list[float]]"), ([], "list"), (["a", 1], "list"),
                                          (None, "any")])
def test_types_follow_the_defaults(default, kind):
    assert params.infer(default) == kind


def test_annotations_declare_types():
    zoo = reports.parameters("estimator_zoo")
    assert zoo["values"].kind == "list[float]" and zoo["values"].default == [0, 2, 8, 32, 64]
    assert zoo["estimators"].kind == "list[str]" and zoo["estimators"].default is None
    assert reports.parameters("rollout_diagnostics")["log_path"].kind == "str"
    assert reports.parameters("mismatch_anatomy")["lm_prompts"].kind == "list"
    for name in ("estimator_variance", "estimator_zoo", "gvpo_optimum", "opd_variance", "mismatch_anatomy",
                 "rollout_diagnostics", "staleness_training", "real_staleness_training", "real_distillation"):
        specs = reports.parameters(name).values()
        assert all(p.help for p in specs), (name, [p.name for p in specs if not p.help])
        assert all(p.kind != "any" for p in specs), (name, [p.name for p in specs if p.kind == "any"])
    with pytest.raises(LabError, match="unsupported parameter annotation 'tuple'"):
        params._declared("tuple")


def test_values_are_checked_against_their_types():
    assert check("estimator_variance", values="0,0.5", replicates=40) == {"values": [0, 0.5], "replicates": 40}
    assert check("estimator_zoo", estimators="reinforce,seq_is") == {"estimators": ["reinforce", "seq_is"]}
    assert check("estimator_zoo", estimators=None) == {"estimators": None}
    assert check(LESSON, kls=0.1) == {"kls": [0.1]}  # a single value is the one-element list
    assert check("vespo_bound", kernels=[[2, 3], [0.5, 1]]) == {"kernels": [[2, 3], [0.5, 1]]}
    for given, message in [({"replicates": "many"}, r"replicates takes a whole number, got 'many'"),
                           ({"replicates": 40.5}, r"replicates takes a whole number, got 40.5"),
                           ({"replicates": True}, r"replicates takes a whole number, got True"),
                           ({"env": 3}, r"env takes a string, got 3"),
                           ({"estimators": ["reinforce", 3]}, r"estimators\[1\] takes a string, got 3")]:
        with pytest.raises(LabError, match=message):
            check("estimator_variance", **given)
    with pytest.raises(LabError, match=r"log_path takes a string or null, got 3"):
        check("rollout_diagnostics", log_path=3)
    with pytest.raises(LabError, match=r"simulate takes a mapping"):
        check("rollout_diagnostics", simulate=[1])


def test_lists_of_whole_numbers_refuse_fractions():
    with pytest.raises(LabError, match=r"parameter lengths\[0\] takes a whole number, got 1\.5"):
        check("teach_vespo_kernel", lengths="1.5,2")
    with pytest.raises(LabError, match=r"parameter seeds\[1\] takes a whole number, got 0\.5"):
        check("gvpo_optimum", seeds=[0, 0.5])
    assert check("teach_vespo_kernel", lengths="1,2", kls="1,0.5") == {"lengths": [1, 2], "kls": [1, 0.5]}


@pytest.mark.parametrize("text,message", [("0,,4", "an empty entry"), ("[0, 4", r"write JSON \(\[0, 4\]\) or 0,4")])
def test_list_syntax(text, message):
    with pytest.raises(LabError, match=rf"parameter values: cannot read .* as a list.*{message}"):
        check("estimator_variance", values=text)


def test_cli_wrong_type_and_list_syntax_are_one_line(tmp_path):
    for arg, message in [("replicates=many", "parameter replicates takes a whole number, got 'many'"),
                         ("lengths=1.5,2", "parameter lengths[0] takes a whole number, got 1.5"),
                         ("lengths=[1, 2", "parameter lengths: cannot read '[1, 2' as a list")]:
        name = "estimator_variance" if arg.startswith("replicates") else "teach_vespo_kernel"
        proc = lab("report", name, "-p", arg, "--out", str(tmp_path))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"error: {message}"), proc.stderr
    assert not any(tmp_path.iterdir())


# ---- parameter files ---------------------------------------------------------------------------------------------

def test_parameter_files(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("replicates: 40\nvalues: [0, 4]\n")
    assert params.from_file(good) == {"replicates": 40, "values": [0, 4]}
    bad = tmp_path / "bad.yaml"
    bad.write_text("replicates: 40\nvalues: [0, 4\nseed: 1\n")
    with pytest.raises(LabError, match=r"bad.yaml is not valid YAML at line 3, column 5: .*"):
        params.from_file(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text("- replicates: 40\n- seed: 1\n")
    with pytest.raises(LabError, match=r"must be a mapping of parameter names to values, got a list"):
        params.from_file(listed)
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(LabError, match=r"empty.yaml is empty"):
        params.from_file(tmp_path / "empty.yaml")
    with pytest.raises(LabError, match="does not exist"):
        params.from_file(tmp_path / "missing.yaml")


@pytest.mark.parametrize("content,message", [
    ("replicates: 40\nvalues: [0, 4\n", "is not valid YAML at line 3"),
    ("- replicates: 40\n", "must be a mapping of parameter names to values, got a list"),
    ("replicats: 40\n", r"unknown parameter(s) replicats for report 'estimator_variance'; valid parameters: env,")])
def test_cli_parameter_file_errors_are_one_line(tmp_path, content, message):
    spec = tmp_path / "params.yaml"
    spec.write_text(content)
    proc = lab("report", "estimator_variance", "-f", str(spec), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_cli_lists_parameters_with_types_defaults_and_help():
    proc = lab("report", "teach_vespo_kernel", "--params")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()}
    assert "out_dir" not in rows
    assert rows["lengths"].split()[1:3] == ["list[int]", "[1,"] and "lengths for the bound check" in rows["lengths"]
    assert rows["kl"].split()[1:3] == ["float", "0.1"] and "per-token KL" in rows["kl"]
    assert rows["live_controls"].split()[1:3] == ["bool", "True"]
    proc = lab("report", "estimator_zoo", "--params")
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()}
    assert rows["estimators"].split()[1:3] == ["list[str]", "None"] and "every registered" in rows["estimators"]
    assert rows["values"].split()[1] == "list[float]"


# ---- the study's own checks, before papermill --------------------------------------------------------------------

@pytest.mark.parametrize("name,given,message", [
    ("estimator_variance", {"estimators": ["reinforce", "nope"]}, "unknown estimator"),
    ("estimator_variance", {"env": "nope"}, "nope"),
    ("gvpo_optimum", {"samplers": ["sideways"]}, r"unknown sampler\(s\) sideways"),
    ("opd_variance", {"teacher": "oracle"}, "unknown teacher construction 'oracle'"),
    ("real_model_variance", {"model": "huge"}, "unknown model size 'huge'"),
    ("real_distillation", {"student_size": "huge"}, "huge"),
    ("mismatch_anatomy", {"lm": "/no/such/model"}, "no model at '/no/such/model'"),
])
def test_bad_study_input_is_refused_before_papermill(tmp_path, failed_reports, no_kernel, name, given, message):
    with pytest.raises(LabError, match=rf"^report '{name}': .*{message}") as err:
        reports.run_report(name, given, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() and not any(failed_reports.iterdir())


@pytest.mark.parametrize("name", ["real_model_variance", "mismatch_anatomy", "real_distillation"])
def test_a_missing_device_is_refused_before_papermill(tmp_path, no_kernel, name):
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last CUDA device: missing on every machine
    with pytest.raises(LabError, match=rf"^report '{name}': .*{missing}.*(no CUDA device|is not available here)"):
        reports.run_report(name, {"device": missing}, tmp_path)


def test_a_corrupt_model_is_refused_before_papermill(tmp_path, no_kernel):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(LabError, match=r"lm '.*model' is not a readable model .*config.json.*corrupt"):
        reports.run_report("mismatch_anatomy", {"lm": str(folder)}, tmp_path / "out")
    (folder / "config.json").unlink()
    (folder / "m.gguf").write_bytes(b"\0" * 64)
    with pytest.raises(LabError, match=r"m.gguf: not a GGUF file"):
        reports.run_report("mismatch_anatomy", {"lm": str(folder)}, tmp_path / "out")


def test_every_study_report_accepts_its_defaults_and_smoke_parameters():
    for name, report in reports.REPORTS.items():
        if report.config is None:
            continue
        defaults = {k: p.default for k, p in reports.parameters(name).items()}
        smoke = check(name, **report.smoke)
        assert report.config({**defaults, **smoke}) is not None, name
        if name != "mismatch_anatomy":  # its default LM is SmolLM2's wheel, which a machine may lack
            report.config(defaults)


def test_cli_bad_estimator_is_one_line_before_any_kernel(tmp_path):
    proc = lab("report", "estimator_variance", "-p", "estimators=reinforce,nope", "--out", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: report 'estimator_variance': unknown estimator")
    assert not any(tmp_path.iterdir())


# ---- outcomes ----------------------------------------------------------------------------------------------------

def test_python_api_returns_the_summary(tmp_path):
    smoke = reports.REPORTS[LESSON].smoke
    summary = reports.run(LESSON, out_root=tmp_path, **smoke)
    folder = tmp_path / LESSON
    assert summary == json.loads((folder / "summary.json").read_text())
    assert isinstance(summary["headline"], str) and summary["headline"].startswith("At per-token KL")
    assert json.loads((folder / "config.json").read_text())["kls"] == smoke["kls"]
    assert (tmp_path / "index.html").exists() and f'href="{LESSON}/{LESSON}.html"' in (
        tmp_path / "index.html").read_text()
    page = (folder / f"{LESSON}.html").read_text()
    assert 'href="weight_explosion.html"' in page and (folder / "weight_explosion.html").exists()  # the static page


def test_failing_cell_keeps_the_partial_notebook(tmp_path, failed_reports):
    with pytest.raises(LabError) as err:
        reports.run_report(LESSON, BAD_LESSON, tmp_path / "out")
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"report '{LESSON}' failed in cell ") and "LabError: per-token KL targets" in line
    kept = Path(line.rsplit("(partial notebook: ", 1)[1].rstrip(")"))
    assert kept.parent == failed_reports and kept.exists()
    cells = json.loads(kept.read_text())["cells"]
    assert any(o.get("output_type") == "error" for c in cells for o in c.get("outputs", []))
    assert not (tmp_path / "out").exists()


def test_failed_reports_folder_is_apart_from_the_model_cache(failed_reports, monkeypatch, tmp_path):
    from lab.runs import cache_dir

    assert reports.failed_reports_dir() == failed_reports != cache_dir() / "failed-reports"
    monkeypatch.delenv("LAB_FAILED_REPORTS")
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path))
    assert reports.failed_reports_dir() == tmp_path / "failed-reports"


def test_run_all_goes_on_after_a_failure_and_writes_the_gallery(tmp_path, monkeypatch):
    good, bad = "teach_clip_mask", LESSON
    chosen = {good: reports.REPORTS[good], bad: reports.REPORTS[bad]}
    chosen = {good: dataclasses.replace(chosen[good], params=chosen[good].smoke),
              bad: dataclasses.replace(chosen[bad], params=BAD_LESSON)}
    monkeypatch.setattr(reports, "REPORTS", chosen)
    events = []
    with pytest.raises(LabError, match=rf"1 of 2 reports failed \(report '{bad}' failed in cell .*\); the gallery "
                                       rf".*index.html shows the 1 others"):
        reports.run_all(tmp_path, on_event=lambda kind, name, seconds, **kw: events.append((kind, name, kw)))
    assert [(k, n) for k, n, _ in events if k != "start"] in ([("done", good), ("failed", bad)],
                                                              [("failed", bad), ("done", good)])
    error = next(kw["error"] for k, _, kw in events if k == "failed")
    assert error.startswith(f"report '{bad}' failed in cell") and "\n" not in error
    index = (tmp_path / "index.html").read_text()
    assert f'href="{good}/{good}.html"' in index and f'href="{bad}/' not in index
