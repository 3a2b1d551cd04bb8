"""Report input before anything runs (names, types, list syntax, parameter files, the config's own checks) and the
driver's outcomes (the summary returned, a failing cell's partial notebook, a failed report in --all). A report's
parameters are its config's fields: these tests hold every report in the catalog to that."""
from __future__ import annotations

import json
import subprocess
import sys
import typing
from dataclasses import fields
from pathlib import Path

import pytest

from lab import reports, typed
from lab.configs import field_docs
from lab.errors import LabError
from lab.reports import params

LAB = Path(sys.executable).parent / "lab"
LESSON = "teach_weight_explosion"  # the quickest notebook: numpy only
FAILING = ("variance", {"reference": "mc", "mc_samples": 2, "replicates": 4, "values": [0]})  # passes every check
# before the kernel, fails in the study: two Monte Carlo samples give grad J = 0


def resolve(name: str, **cli) -> dict:
    """The values a report would run with, given command-line strings."""
    cfg, _ = params.resolve(reports.get(name), {}, {k: str(v) for k, v in cli.items()})
    return {k: getattr(cfg, k) for k in cli}


def lab(*args, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([str(LAB), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def no_kernel(monkeypatch):
    """Any attempt to start papermill fails the test: the input must be refused before."""
    import papermill

    def refuse(*args, **kwargs):
        raise AssertionError("papermill started")

    monkeypatch.setattr(papermill, "execute_notebook", refuse)


# ---- every report: one declaration per parameter -------------------------------------------------------------------

@pytest.mark.parametrize("name", reports.names())
def test_every_parameter_is_a_typed_documented_config_field(name):
    report = reports.get(name)
    cls = report.config_class()
    docs, tps = field_docs(cls), typed.hints(cls)
    assert report.notebook.exists() and set(report.defaults) | set(report.smoke) <= set(tps)
    for f in fields(cls):
        assert docs.get(f.name), (name, f.name, "no docstring")
        tp = tps[f.name]
        numbers = tp in (int, float) or typing.get_args(tp)[:1] in ((int,), (float,)) or \
            (typing.get_origin(tp) is list and typing.get_args(typing.get_args(tp)[0])[:1] in ((int,), (float,)))
        if numbers and f.name != "seed":
            assert "range" in f.metadata, (name, f.name, "a number field without a declared range")
    nb = json.loads(report.notebook.read_text())
    cell = next(c for c in nb["cells"] if "parameters" in c["metadata"].get("tags", []))
    assert [ln.split()[0] for ln in "".join(cell["source"]).splitlines() if ln and not ln.startswith("#")] == \
        ["out_dir"], (name, "the notebook declares parameters of its own")


@pytest.mark.parametrize("name", reports.names())
@pytest.mark.slow
def test_defaults_and_smoke_values_pass_the_configs_checks(name, no_kernel):
    report = reports.get(name)
    params.resolve(report, {}, smoke=True)
    if name != "mismatch":  # its default LM is SmolLM2's wheel, which a machine may lack
        params.resolve(report, {})


# ---- types ------------------------------------------------------------------------------------------------------

def test_values_are_read_as_their_fields_types():
    assert resolve("variance", values="0,2", replicates=40) == {"values": [0.0, 2.0], "replicates": 40}
    assert resolve("variance", staleness="kl", values="0,0.5") == {"staleness": "kl", "values": [0.0, 0.5]}
    assert resolve("variance_zoo", estimators="reinforce,seq_is") == {"estimators": ["reinforce", "seq_is"]}
    assert resolve(LESSON, kls="0.1") == {"kls": [0.1]}  # a single value is the one-element list
    assert resolve("teach_vespo_kernel", kernels="[[2, 3], [0.5, 1]]") == {"kernels": [[2.0, 3.0], [0.5, 1.0]]}
    for given, message in [({"replicates": "many"}, r"parameter replicates must be a whole number, got 'many'"),
                           ({"replicates": "40.5"}, r"parameter replicates must be a whole number, got '40.5'"),
                           ({"replicates": "true"}, r"parameter replicates must be a whole number, got 'true'"),
                           ({"policy": "tree"}, r"parameter policy must be one of prefix, markov"),
                           ({"values": "0,,4"}, r"parameter values: cannot read '0,,4' as a comma-separated list"),
                           ({"values": "[0, 4"}, r"parameter values is not valid JSON")]:
        with pytest.raises(LabError, match=message):
            resolve("variance", **given)


def test_file_values_are_checked_at_every_depth():
    report = reports.get("variance")
    for given, message in [({"estimators": ["reinforce", 3]}, r"estimators\[1\] must be text, got 3"),
                           ({"env": 3}, r"env must be text, got 3"),
                           ({"replicates": True}, r"replicates must be a whole number, got true"),
                           ({"values": [0, "a"]}, r"values\[1\] must be a number, got 'a'")]:
        with pytest.raises(LabError, match=message):
            params.resolve(report, given)


def test_lists_of_whole_numbers_refuse_fractions():
    with pytest.raises(LabError, match=r"parameter lengths\[0\] must be a whole number, got '1.5'"):
        resolve("teach_vespo_kernel", lengths="1.5,2")
    assert resolve("teach_vespo_kernel", lengths="1,2", kls="1,0.5") == {"lengths": [1, 2], "kls": [1.0, 0.5]}


def test_ranges_are_checked_before_anything_runs():
    with pytest.raises(LabError, match=r"parameter replicates must be >= 2"):
        resolve("variance", replicates="1")
    with pytest.raises(LabError, match=r"parameter lengths must be >= 1 and <= 16, got 100"):
        resolve("teach_vespo_kernel", lengths="1,100")


@pytest.mark.slow
def test_cli_wrong_type_and_list_syntax_are_one_line(tmp_path):
    for name, arg, message in [("variance", "replicates=many", "parameter replicates must be a whole number"),
                               ("teach_vespo_kernel", "lengths=1.5,2", "parameter lengths[0] must be a whole number"),
                               ("teach_vespo_kernel", "lengths=[1, 2", "parameter lengths is not valid JSON")]:
        proc = lab("report", name, "-p", arg, "--out", str(tmp_path))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert message in proc.stderr, proc.stderr
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
    ("replicats: 40\n", r"unknown parameter(s) replicats for report 'variance'; valid parameters: env,")])
@pytest.mark.slow
def test_cli_parameter_file_errors_are_one_line(tmp_path, content, message):
    spec = tmp_path / "params.yaml"
    spec.write_text(content)
    proc = lab("report", "variance", "-f", str(spec), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_command_line_values_override_the_files(tmp_path, no_kernel):
    f = tmp_path / "p.yaml"
    f.write_text("replicates: 40\nvalues: [0, 4]\n")
    cfg, _ = params.resolve(reports.get("variance"), params.from_file(f), {"replicates": "50"})
    assert (cfg.replicates, cfg.values) == (50, [0.0, 4.0])


@pytest.mark.slow
def test_cli_lists_parameters_with_types_defaults_and_help():
    proc = lab("report", "teach_vespo_kernel", "--params")
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()}
    assert "out_dir" not in rows
    assert "a list of whole numbers" in rows["lengths"] and "[1, 2, 4, 6]" in rows["lengths"]
    assert "lengths for the bound check" in rows["lengths"] and ">= 1 and <= 16" in rows["lengths"]
    assert "a number" in rows["kl"] and "0.1" in rows["kl"] and "true or false" in rows["live_controls"]
    rows = {line.split()[0]: line for line in lab("report", "variance_zoo", "--params").stdout.splitlines()}
    assert '["all"]' in rows["estimators"] and "every policy-gradient estimator" in rows["estimators"]
    assert "one of lag, kl, temperature" in rows["staleness"]


# ---- the config's own checks, before papermill -------------------------------------------------------------------

@pytest.mark.parametrize("name,given,message", [
    ("variance", {"estimators": ["reinforce", "nope"]}, "unknown estimator"),
    ("variance", {"env": "nope"}, "nope"),
    ("variance_zoo", {"estimators": ["kl_k3"]}, "needs ref_log_prob"),
])
def test_bad_study_input_is_refused_before_papermill(tmp_path, failed_reports, no_kernel, name, given, message):
    with pytest.raises(LabError, match=rf"^report '{name}': .*{message}") as err:
        reports.run_report(name, given, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() and not any(failed_reports.iterdir())


@pytest.mark.slow
def test_renamed_reports_say_their_new_name(tmp_path):
    proc = lab("report", "estimator_variance", "--out", str(tmp_path))
    assert proc.returncode == 2 and "now called 'variance'" in proc.stderr


@pytest.mark.slow
def test_cli_bad_estimator_is_one_line_before_any_kernel(tmp_path):
    proc = lab("report", "variance", "-p", "estimators=reinforce,nope", "--out", str(tmp_path))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: report 'variance': unknown estimator")
    assert not any(tmp_path.iterdir())


# ---- outcomes ----------------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_python_api_returns_the_summary(tmp_path):
    smoke = reports.get(LESSON).smoke
    summary = reports.run(LESSON, out_root=tmp_path, **smoke)
    folder = tmp_path / LESSON
    assert summary == json.loads((folder / "summary.json").read_text())
    assert json.loads((folder / "config.json").read_text())["kls"] == smoke["kls"]
    assert (tmp_path / "index.html").exists() and f'href="{LESSON}/{LESSON}.html"' in (
        tmp_path / "index.html").read_text()
    page = (folder / f"{LESSON}.html").read_text()
    assert 'href="weight_explosion.html"' in page and (folder / "weight_explosion.html").exists()  # the static page
    nb = json.loads((folder / f"{LESSON}.ipynb").read_text())
    injected = "".join(next(c for c in nb["cells"] if "injected-parameters" in c["metadata"]["tags"])["source"])
    assert f"kls = {smoke['kls']!r}" in injected and "# a list of numbers: per-token KL" in injected


@pytest.mark.slow
def test_failing_cell_keeps_the_partial_notebook(tmp_path, failed_reports):
    name, given = FAILING
    with pytest.raises(LabError) as err:
        reports.run_report(name, given, tmp_path / "out")
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith(f"report '{name}' failed in cell ") and "raise --mc-samples" in line
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


@pytest.mark.slow
def test_run_all_goes_on_after_a_failure_and_writes_the_gallery(tmp_path):
    good, (bad, given) = LESSON, FAILING
    events = []
    with pytest.raises(LabError, match=rf"1 of 2 reports failed \(report '{bad}' failed in cell .*\); the gallery "
                                       rf".*index.html shows the 1 others"):
        reports.run_all(tmp_path, smoke=True, only=[good, bad], params={bad: given},
                        on_event=lambda kind, name, seconds, **kw: events.append((kind, name, kw)))
    assert [(k, n) for k, n, _ in events if k != "start"] in ([("done", good), ("failed", bad)],
                                                              [("failed", bad), ("done", good)])
    error = next(kw["error"] for k, _, kw in events if k == "failed")
    assert error.startswith(f"report '{bad}' failed in cell") and "\n" not in error
    index = (tmp_path / "index.html").read_text()
    assert f'href="{good}/{good}.html"' in index and f'href="{bad}/' not in index
