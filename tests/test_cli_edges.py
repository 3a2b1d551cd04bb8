"""Bad input found at the edges of the command line: one clear line, exit 2, nothing left behind, before any work."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab.cli import main

ROOT = Path(__file__).resolve().parents[1]


def one_line(capsys, needle: str) -> None:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


@pytest.mark.parametrize("argv,needle", [
    (["train", "--steps", "2", "--out", ""], "an empty path"),
    (["variance", "--out", " "], "an empty path"),
    (["train", "--estimator", "tis_seq", "--hyper", "tis_seq.cap=2", "--hyper", "tis_seq.cap=3"], "twice"),
    (["train", "--set", "length=3", "--set", "length=4"], "twice"),
    (["train", "--policy", "transformer", "--env", "chain6", "--rollout-batch", "1000000"], "GiB"),
    (["train", "--lr", "1e300"], "lr must be > 0 and <= 1000"),
    (["report", "--all", "--workers", "0"], "positive whole number"),
    (["sweep", "spec.yaml", "--workers", "-1"], "positive whole number"),
    (["diagnose", ".", "--seed", "-1"], "between 0 and 2^63 - 1"),
    (["pretrain", "--task", "chain3", "--seed", "-1"], "between 0 and 2^63 - 1"),
    (["variance", "--env", "large_parity", "--policy", "markov", "--reference", "mc", "--mc-samples",
      "100000000"], "use fewer --mc-samples"),
    (["diagnose", ".", "--seed", "100000000000000000000"], "between 0 and 2^63 - 1"),
])
def test_bad_values_are_one_line_and_exit_2(tmp_path, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    one_line(capsys, needle)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("out", ["{tmp}/{long}/x", "{tmp}/afile/x", "/proc/x"])
def test_impossible_report_gallery_folders_are_refused_before_any_report(tmp_path, capsys, out):
    (tmp_path / "afile").write_text("")
    assert main(["report", "--all", "--out", out.format(tmp=tmp_path, long="a" * 300)]) == 2
    one_line(capsys, "cannot write to")
    assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_a_path_component_too_long_anywhere_is_one_line(tmp_path, capsys):
    assert main(["variance", "--out", str(tmp_path / ("a" * 300) / "x")]) == 2
    one_line(capsys, "File name too long")


@pytest.mark.parametrize("log", [False, True])
def test_train_without_out_writes_under_runs_from_an_empty_folder(tmp_path, monkeypatch, log):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--steps", "2", *(["--rollout-log"] if log else [])]) == 0
    (run,) = (tmp_path / "runs" / "train").iterdir()
    assert (run / "summary.json").exists() and (run / "rollout_log").exists() == log
    assert [p.name for p in (tmp_path / "runs" / "train").iterdir()] == [run.name]  # no staging folder left


@pytest.mark.slow
def test_a_sweep_whose_only_cell_fails_leaves_no_folder_and_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    Path("s.yaml").write_text("name: s\nbase: {env: tiny_target, steps: 2, regime: async, lag_dist: geometric, "
                              "lag_p: 1.0e-6, lag_max: 10000, eta: 0}\ngrid:\n  seed: [0]\n")
    # drop cannot fill a rollout
    assert main(["sweep", "s.yaml", "--workers", "1"]) == 2
    one_line(capsys, "nothing was written")
    assert os.listdir(tmp_path) == ["s.yaml"]


def _full_disk(tmp_path, cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``cmd`` with writes limited to 4 kB (RLIMIT_FSIZE: EFBIG, as a full disk's ENOSPC)."""
    code = ("import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "from lab.cli import main\nresource.setrlimit(resource.RLIMIT_FSIZE, (4000, 4000))\n"
            f"sys.exit(main({cmd!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, "LAB_QUIET": "1", "PYTHONPATH": str(ROOT)})


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [["train", "--steps", "2", "--rollout-log", "--out", "run"],
                                 ["sweep", "s.yaml", "--workers", "1", "--out", "run"]])
def test_a_write_failure_mid_run_is_one_line_and_leaves_nothing(cmd, tmp_path):
    (tmp_path / "s.yaml").write_text("name: s\nbase: {steps: 2, rollout_batch: 64}\ngrid: {seed: [0]}\n")
    p = _full_disk(tmp_path, cmd, tmp_path)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: cannot write"), p.stderr
    assert "nothing was written" in lines[0]
    assert sorted(os.listdir(tmp_path)) == ["s.yaml"]
