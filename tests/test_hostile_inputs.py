"""Crafted inputs and hostile folders: parameter files run no code, inputs are bounded, the lab replaces only what it
wrote, temporary files are never written through links, a lock belongs to its holder, and every bad value is one
line with exit 2 and nothing left on disk."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab import inputs
from lab.cli import main
from lab.errors import LabError
from lab.reports import inject
from lab.runs import exclusive_lock, write_file, FILE_MARK

ROOT = Path(__file__).resolve().parents[1]
BOMB = "a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(8))
PAYLOAD = 'x"; open("PWNED", "w").write("1"); y = "'


def one_line(capsys, needle: str) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err
    return err[0]


# ---------------------------------------------------------------------------------------------- data, never code
@pytest.mark.parametrize("value", [
    PAYLOAD, "back\\slash \" quote ' newline \n tab \t \x00 nul \u2028 \U0001F600", "}}; import os #",
    {"k\"ey": [1, 2.5, None, True, {"deep": PAYLOAD}]}, [[], {}, "", -0.0, 10**20],
])
def test_injected_parameters_are_literals_that_evaluate_back_to_the_data(value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cell = inject.cell({"p": value})
    scope = {}
    exec(compile(cell, "<cell>", "exec"), {"__builtins__": {}}, scope)  # the cell only assigns data
    assert scope == {"p": value} and not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("value", [b"bytes", {1: "int key"}, {"k": b"x"}, [float("nan")], float("inf"), {"s": {1, 2}},
                                   (1, 2), object()])
def test_anything_but_plain_data_is_refused_before_it_reaches_a_notebook(value):
    with pytest.raises(LabError):
        inject.cell({"p": value})


def test_papermill_uses_the_data_translator_for_the_lab_kernel():
    from papermill.translators import translate_parameters

    inject.register()
    with pytest.raises(LabError):
        translate_parameters("python3", "python", {"p": b"\"; import os; os.system('x'); \""}, "Parameters")
    assert "p = 'x'" in translate_parameters("python3", "python", {"p": "x"}, "Parameters")


@pytest.mark.parametrize("text", ["env_overrides:\n  length: !!binary aGVsbG8=\n", "estimators: [!!binary aGVsbG8=]\n",
                                  "x: !!python/object/apply:os.system ['touch PWNED']\n", "x: !!set {a, b}\n",
                                  "x: !custom 1\n"])
def test_report_parameter_files_with_tags_are_one_line_before_any_kernel(text, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("p.yaml").write_text(text)
    assert main(["report", "variance", "-f", "p.yaml", "--out", "reports"]) == 2
    one_line(capsys, "YAML tag")
    assert sorted(os.listdir(tmp_path)) == ["p.yaml"]


@pytest.mark.slow
def test_a_crafted_string_parameter_reaches_the_notebook_as_that_string(tmp_path, monkeypatch):
    """A real kernel: the payload is a string the study keeps (an hf policy's trainable subset, unused by a prefix
    policy), never code that runs."""
    monkeypatch.chdir(tmp_path)
    assert main(["report", "variance", "--smoke", "-p", f"params={PAYLOAD}", "--out", "reports"]) == 0
    assert not (tmp_path / "PWNED").exists() and not (ROOT / "PWNED").exists()
    assert json.loads((tmp_path / "reports" / "variance" / "config.json").read_text())["params"] == PAYLOAD
    nb = json.loads((tmp_path / "reports" / "variance" / "variance.ipynb").read_text())
    injected = next(c for c in nb["cells"] if "injected-parameters" in c["metadata"].get("tags", []))
    assert f"params = {PAYLOAD!r}" in "".join(injected["source"])


# ---------------------------------------------------------------------------------------------- bounded inputs
@pytest.mark.parametrize("what", ["spec", "params"])
def test_alias_bombs_are_refused_in_milliseconds_and_leave_nothing(what, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    if what == "spec":
        Path("s.yaml").write_text("name: s\nbase:\n  env_overrides:\n" + "".join("    " + ln + "\n"
                                                                               for ln in BOMB.splitlines())
                                  + "grid: {seed: [0]}\n")
        argv = ["sweep", "s.yaml", "--out", "out"]
    else:
        Path("s.yaml").write_text("env_overrides:\n" + "".join("  " + ln + "\n" for ln in BOMB.splitlines()))
        argv = ["report", "variance", "-f", "s.yaml", "--out", "out"]
    t0 = time.perf_counter()
    assert main(argv) == 2
    assert time.perf_counter() - t0 < 5
    one_line(capsys, "more than 100,000 values")
    assert sorted(os.listdir(tmp_path)) == ["s.yaml"]


def test_a_grid_too_large_to_run_is_refused_before_it_is_expanded(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    values = list(range(1000))
    Path("s.yaml").write_text(json.dumps({"name": "s", "grid": {"seed": values, "lr": [0.1 + i / 1e4 for i in values],
                                                              "steps": values[1:], "group_size": values[1:]}}))
    t0 = time.perf_counter()
    assert main(["sweep", "s.yaml", "--out", "out"]) == 2
    assert time.perf_counter() - t0 < 5
    one_line(capsys, "more than 10,000 cells")
    assert sorted(os.listdir(tmp_path)) == ["s.yaml"]


@pytest.mark.parametrize("content, needle", [
    (os.urandom(64) + b"\xff\xfe", "not"), (b"name: s\n\xff\xfe\n", "not UTF-8"), (b"\x00\x01binary", "NUL"),
    (b"name: s\nname: t\ngrid: {seed: [0]}\n", "twice"), (b"[1, 2]", "mapping"), (b"x" * (1 << 21), "larger than"),
    (b"name: s\ngrid: {seed: [0]}\nbase: {lr: .inf}\n", "not a finite number"),
    (b"name: s\ngrid: {seed: [0]}\nbase: &a {x: *a}\n", "alias"),
])
def test_bad_spec_files_are_one_line(content, needle, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("s.yaml").write_bytes(content)
    assert main(["sweep", "s.yaml", "--out", "out"]) == 2
    one_line(capsys, "")
    assert sorted(os.listdir(tmp_path)) == ["s.yaml"]
    assert main(["report", "variance", "-f", "s.yaml", "--out", "out"]) == 2
    one_line(capsys, "")
    assert sorted(os.listdir(tmp_path)) == ["s.yaml"]


def test_a_folder_given_as_a_file_says_so(tmp_path, capsys):
    assert main(["sweep", str(tmp_path)]) == 2
    one_line(capsys, "is a folder; pass the file itself")
    assert main(["report", "variance", "-f", str(tmp_path)]) == 2
    one_line(capsys, "is a folder; pass the file itself")


@pytest.mark.parametrize("text", ['{"a": 1, "a": 2}', "[" * 100_000 + "]" * 100_000, "1e400", "NaN", "9" * 400])
def test_json_inputs_are_bounded(text):
    with pytest.raises(LabError):
        inputs.parse_json(text, "meta.json")


# ---------------------------------------------------------------------------------------------- silent wrong results
@pytest.mark.parametrize("argv, needle", [
    (["variance", "--values", "0,-0"], "more than once"),
    (["variance", "--set", "length=true"], "env field length must be a whole number"),
    (["variance", "--set", "eos=5"], "env field eos must be true or false"),
    (["variance", "--set", "seed=1.5"], "env field seed must be a whole number"),
    (["variance", "--set", "seed=abc"], "env field seed must be a whole number"),
    (["variance", "--set", "seed=1e400"], "not finite"),
    (["variance", "--set", "n_prompts=true"], "whole number"),
    (["variance", "--set", "length=10000000000"], "from 1 to"),
    (["variance", "--hyper", ".clip=1"], "both names"),
    (["variance", "--hyper", "ppo_clip.=1"], "both names"),
    (["train", "--regime", "sync", "--lag-max", "3"], "applies only with regime async"),
    (["train", "--regime", "sync", "--eta", "3"], "applies only with regime async"),
    (["train", "--regime", "sync", "--over-stale", "keep"], "applies only with regime async"),
    (["train", "--regime", "async", "--sampler-temperature", "2"], "applies only with regime mismatch"),
    (["train", "--lr", "1e38"], "lr must be > 0 and <= 1000"),
    (["train", "--regime", "mismatch", "--sampler-temperature", "1e-300"], "sampler_temperature must be >= 0.01"),
    (["train", "--regime", "mismatch", "--logprob-noise", "1e300"], "logprob_noise must be >= 0 and <= 100"),
    (["train", "--regime", "mismatch", "--router-scale", "1e300"], "router_scale must be >= 0 and <= 100"),
    (["train", "--steps", "99999999999999999999999999999999999"], "--steps must be a whole number"),
    (["train", "--epochs", "true"], "--epochs must be a whole number"),
    (["train", "--policy", "markov", "--size", "medium"], "applies only with policy transformer"),
])
def test_values_that_ran_silently_wrong_or_crashed_are_one_line(argv, needle, tmp_path, capsys):
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    one_line(capsys, needle)
    assert not (tmp_path / "out").exists()


def test_a_repeated_key_in_a_params_file_is_refused(tmp_path, capsys):
    (tmp_path / "p.yaml").write_text("seed: 1\nseed: 2\n")
    assert main(["report", "variance", "-f", str(tmp_path / "p.yaml"), "--out", str(tmp_path / "r")]) == 2
    one_line(capsys, "gives the key 'seed' twice")


# ---------------------------------------------------------------------------------------------- ownership
def model_folder(path: Path) -> dict:
    path.mkdir(parents=True)
    files = {"config.json": '{"model_type": "llama"}', "model.safetensors": "weights", "tokenizer.json": "{}"}
    for name, text in files.items():
        (path / name).write_text(text)
    return files


@pytest.mark.parametrize("command", [["variance", "--replicates", "4", "--values", "0"], ["train", "--steps", "1"]])
def test_a_model_folder_holding_config_json_is_never_replaced(command, tmp_path, capsys):
    files = model_folder(tmp_path / "model")
    assert main([*command, "--out", str(tmp_path / "model")]) == 2
    one_line(capsys, "the lab did not write")
    assert {p.name: p.read_text() for p in (tmp_path / "model").iterdir()} == files


@pytest.mark.slow
def test_a_lab_run_folder_is_replaced_and_a_dangling_link_is_refused(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["variance", "--replicates", "4", "--values", "0", "--n-boot", "10", "--out", str(out)]
    assert main(argv) == 0 and (out / ".lab").is_file()
    first = json.loads((out / ".lab").read_text())["id"]
    assert main(argv) == 0 and json.loads((out / ".lab").read_text())["id"] != first  # its own: replaced
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert main([*argv[:-1], str(tmp_path / "dangling")]) == 2
    one_line(capsys, "symbolic link")
    assert not (tmp_path / "nowhere").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "run"]  # no staging left


def test_report_out_never_overwrites_a_foreign_index_or_hidden_folder(tmp_path, capsys):
    out = tmp_path / "site"
    out.mkdir()
    (out / "index.html").write_text("<h1>my site</h1>")
    (out / ".variance.cache").mkdir()  # a user's hidden folder named like a staging leftover
    assert main(["report", "variance", "--out", str(out)]) == 2
    one_line(capsys, "the lab did not write it")
    assert (out / "index.html").read_text() == "<h1>my site</h1>" and (out / ".variance.cache").is_dir()
    assert main(["report", "--all", "--out", str(out)]) == 2
    one_line(capsys, "the lab did not write it")
    assert sorted(p.name for p in out.iterdir()) == [".variance.cache", "index.html"]


def test_temporary_files_are_never_written_through_planted_links(tmp_path):
    target = tmp_path / "bashrc"
    target.write_text("mine")
    out = tmp_path / "shared"
    out.mkdir()
    for name in (".index.html.tmp", ".index.html.lab-1.None.aaaaaa", ".sweep.json.tmp"):
        (out / name).symlink_to(target)
    write_file(out / "index.html", f"<html>{FILE_MARK}</html>")
    assert target.read_text() == "mine" and FILE_MARK in (out / "index.html").read_text()
    (out / "index.html").unlink()
    (out / "index.html").symlink_to(target)  # a link at the destination itself is refused
    with pytest.raises(LabError, match="did not write"):
        write_file(out / "index.html", f"<html>{FILE_MARK}</html>")
    assert target.read_text() == "mine"


def test_a_lock_belongs_to_the_process_that_took_it(tmp_path):
    """A refused second taker leaves the holder's lock in place, so a third is refused too."""
    path = tmp_path / ".x.lock"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from lab.runs import exclusive_lock\n"
        f"with exclusive_lock({str(path)!r}, 'busy'):\n    print('held', flush=True); time.sleep(30)")],
        stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert holder.stdout.readline().strip() == "held"
        for _ in range(2):
            with pytest.raises(LabError, match="busy"):
                with exclusive_lock(path, "busy"):
                    pass
            assert path.exists()
    finally:
        holder.kill()
        holder.wait()
    with exclusive_lock(path, "busy"):  # the holder died: its lock is free
        pass
    assert not path.exists()


# ---------------------------------------------------------------------------------------------- files and disks
def test_an_unusable_cache_folder_is_found_before_any_training(tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("LAB_CACHE_DIR", str(tmp_path / "afile"))
    t0 = time.perf_counter()
    assert main(["train", "--policy", "transformer", "--env", "chain3", "--warm-start", "0.3",
                 "--out", str(tmp_path / "out")]) == 2
    one_line(capsys, "is a file, not a folder")
    assert time.perf_counter() - t0 < 10 and not (tmp_path / "out").exists()


def test_failed_reports_folder_that_is_a_file_is_one_clear_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("LAB_FAILED_REPORTS", str(tmp_path / "afile"))
    assert main(["report", "variance", "--out", str(tmp_path / "r")]) == 2
    one_line(capsys, "LAB_FAILED_REPORTS")


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_keeps_the_previous_run(tmp_path):
    """A real write failure (the file size limit, EFBIG) while the run folder is written."""
    out = tmp_path / "run"
    argv = ["variance", "--replicates", "4", "--values", "0", "--n-boot", "10", "--out", str(out)]
    assert main(argv) == 0
    before = (out / "results.parquet").read_bytes()
    code = ("import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "from lab.cli import main\nresource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))\n"
            f"sys.exit(main({argv!r}))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       env={**os.environ, "LAB_QUIET": "1"})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "nothing was written" in lines[0], p.stderr
    assert (out / "results.parquet").read_bytes() == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["run"]


# ---------------------------------------------------------------------------------------------- interruptions
def _start_train(out: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "lab.cli", "train", "--steps", "100000", "--rollout-log",
                             "--out", str(out)], cwd=ROOT, env={**os.environ, "LAB_QUIET": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a background job's
    # shell starts its children with SIGINT ignored; Ctrl-C's default here
    deadline = time.time() + 60
    while not list(out.parent.glob(f".{out.name}.lab-*")):  # its staging folder exists: it is writing
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
        time.sleep(0.05)
    time.sleep(0.5)
    return proc


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
@pytest.mark.slow
def test_sigterm_stops_a_run_like_ctrl_c_and_leaves_nothing(signum, tmp_path):
    import signal

    proc = _start_train(tmp_path / "run")
    proc.send_signal(getattr(signal, signum))
    proc.wait(timeout=60)
    err = proc.stderr.read().strip().splitlines()
    assert proc.returncode == 130 and err == ["error: interrupted; nothing half-written was kept"], err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_kill_9_leaves_only_a_hidden_marked_folder_that_the_next_run_removes(tmp_path):
    proc = _start_train(tmp_path / "run")
    proc.kill()
    proc.wait()
    left = list(tmp_path.iterdir())
    assert len(left) == 1 and left[0].name.startswith(".run.lab-") and (left[0] / ".lab").is_file()
    assert main(["train", "--steps", "1", "--out", str(tmp_path / "run")]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.slow
def test_a_killed_gallery_build_leaves_no_build_running(tmp_path):
    import signal
    import uuid

    mark = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "lab.cli", "report", "--all", "--smoke", "--workers", "2", "--out",
                             str(tmp_path / "r")], cwd=ROOT, env={**os.environ, "LAB_TEST_MARK": mark},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def marked() -> list[int]:
        out = []
        for p in Path("/proc").iterdir():
            try:
                if p.name.isdigit() and int(p.name) != proc.pid and mark.encode() in (p / "environ").read_bytes() \
                        and "State:\tZ" not in (p / "status").read_text():
                    out.append(int(p.name))
            except OSError:
                continue
        return out

    deadline = time.time() + 60
    while len(marked()) < 2 and time.time() < deadline:  # two builds started
        time.sleep(0.2)
    assert marked(), "no build started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 30
    while marked() and time.time() < deadline:
        time.sleep(0.2)
    assert marked() == []


def test_a_sweep_record_edited_to_explode_is_refused(tmp_path):
    from lab.engine.sweep import load_results
    from lab.runs import marker

    out = tmp_path / "s"
    out.mkdir()
    (out / ".lab").write_text(json.dumps(marker("sweep")))
    (out / "sweep.json").write_text(json.dumps({"name": "s", "base": {}, "grid": {"seed": list(range(1000)),
                                                                                  "steps": list(range(1, 1000))}}))
    with pytest.raises(LabError, match="more than 10,000 cells"):
        load_results(out)
    (out / "sweep.json").write_text("[" * 100 + "]" * 100)
    with pytest.raises(LabError, match="nests deeper"):
        load_results(out)


# ---------------------------------------------------------------------------------------------- files read back
def _neutral_log(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    assert main(["train", "--steps", "1", "--rollout-log", "--out", str(out)]) == 0
    return out / "rollout_log"


@pytest.mark.parametrize("meta, needle", [
    ("[" * 200_000 + "]" * 200_000, "nests deeper"),
    ('{"format": "rollout-log", "format": "rollout-log"}', "gives the key 'format' twice"),
    (None, "is a folder"),
])
def test_rollout_log_metadata_is_bounded_plain_data(meta, needle, tmp_path, capsys):
    log = _neutral_log(tmp_path)
    (log / "meta.json").unlink()
    if meta is None:
        (log / "meta.json").mkdir()
    else:
        (log / "meta.json").write_text(meta)
    capsys.readouterr()
    assert main(["diagnose", str(log), "--out", str(tmp_path / "d")]) == 2
    one_line(capsys, needle)
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("argv, needle", [
    (["--chunk-rows", str(10**20)], "chunk_rows must be a whole number from 1 to"),
    (["--top-k", str(10**11)], "--top-k must be from -1 to"),
    (["--temperature", "nan"], "--temperature must be above 0"),
    (["-H", "tis_token.cap=" + "[" * 5000 + "]" * 5000], "cap must be"),
])
def test_diagnose_options_are_bounded_like_the_report(argv, needle, tmp_path, capsys):
    log = _neutral_log(tmp_path)
    capsys.readouterr()
    assert main(["diagnose", str(log), *argv]) == 2
    line = one_line(capsys, needle)
    assert len(line) < 300  # a huge value is not echoed whole


def test_the_gallery_reads_only_report_folders_the_lab_wrote_and_survives_broken_ones(tmp_path):
    from lab.reports.gallery import write_index
    from lab.runs import marker

    root = tmp_path / "r"
    for name, owned in (("variance", True), ("mismatch", False)):
        folder = root / name
        folder.mkdir(parents=True)
        (folder / f"{name}.html").write_text("<html></html>")
        (folder / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
        (folder / f"{name}.ipynb").write_text("{not json")
        (folder / "config.json").write_text("[1]")
        if owned:
            (folder / ".lab").write_text(json.dumps(marker("report")))
    page = write_index(root).read_text()
    assert 'href="variance/variance.html"' in page and "mismatch/mismatch.html" not in page
    assert "no headline" in page


@pytest.mark.slow
def test_a_sweep_cell_summary_edited_to_explode_is_one_line(tmp_path):
    from lab.engine.sweep import load_results, load_spec, run_sweep

    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nbase: {steps: 1}\ngrid: {seed: [0]}\n")
    run_sweep(load_spec(spec), tmp_path / "out", workers=1, progress=False)
    (cell,) = (tmp_path / "out" / "cells").iterdir()
    (cell / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(LabError, match="nests deeper"):
        load_results(tmp_path / "out")


@pytest.mark.slow
def test_a_broken_study_folder_of_ones_own_is_one_line(tmp_path):
    bad = tmp_path / "studies" / "mine"
    bad.mkdir(parents=True)
    (bad / "__init__.py").write_text("raise RuntimeError('broken on purpose')\n")
    p = subprocess.run([sys.executable, "-m", "lab.cli", "report", "variance", "--params"], capture_output=True,
                       text=True, cwd=ROOT, env={**os.environ, "LAB_STUDIES_PATH": str(tmp_path / "studies")})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "cannot be imported (RuntimeError: broken on purpose)" in lines[0]


@pytest.mark.parametrize("argv, needle", [
    (["train", "--set", "vocab_size=100000", "--set", "length=1", "--steps", "1"], "GiB"),
    (["train", "--policy", "markov", "--set", "vocab_size=20000", "--set", "length=1", "--set", "n_prompts=1"], "GiB"),
    (["variance", "--set", "vocab_size=100000", "--set", "length=1", "--replicates", "4", "--batch-size", "4",
      "--group-size", "4", "--values", "0"], "logits per pass"),
])
def test_runs_too_large_for_memory_or_time_are_refused_before_any_work(argv, needle, tmp_path, capsys):
    t0 = time.perf_counter()
    assert main([*argv, "--out", str(tmp_path / "out")]) == 2
    one_line(capsys, needle)
    assert time.perf_counter() - t0 < 10 and not (tmp_path / "out").exists()


def test_a_sweep_cell_given_twice_as_int_and_float_hyper_parameters_is_refused(tmp_path, capsys):
    (tmp_path / "s.yaml").write_text("name: s\nbase: {steps: 1, estimator: tis_token}\n"
                                     "grid: {hyper: [{cap: 2}, {cap: 2.0}]}\n")
    assert main(["sweep", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "out")]) == 2
    one_line(capsys, "are the same config")
    assert not (tmp_path / "out").exists()
