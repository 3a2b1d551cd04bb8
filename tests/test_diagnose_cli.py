"""`lab diagnose` end to end: the run folder, converted logs, one-line errors that leave nothing behind, and memory
that does not grow with the log (the report notebook's tests are in lab/studies/rollout_diagnostics/tests)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from lab.diagnose import diagnose, make_meta
from lab.diagnose.cli import TABLES, main
from lab.diagnose.neutral import NeutralLogWriter
from lab.diagnose.synthetic import random_log, simulate
from lab.errors import LabError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sim(tmp_path_factory):
    return simulate(tmp_path_factory.mktemp("sim") / "log", steps=4, batch=32, vocab=32, mean_len=24, lag_max=2,
                    drift=0.05)


def test_run_folder_holds_every_table(sim, tmp_path, capsys):
    out = tmp_path / "run"
    assert main([str(sim), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert {p.name for p in out.iterdir()} == {".lab", "config.json", "results.parquet", "summary.json",
                                               *(f"{t}.parquet" for t in TABLES)}
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    assert summary["verdict"][0] in printed and summary["headline"] == summary["verdict"][0]
    assert summary["n_steps"] == 4 and summary["pairs"] == ["mismatch", "update", "total"]
    assert config["from"] == "lab" and config["log_meta"]["source"] == "synthetic" and config["versions"]["pyarrow"]
    res = pd.read_parquet(out / "results.parquet")
    assert {"section", "pair", "step", "metric", "value", "lo", "hi"} <= set(res.columns)
    ess = res[(res["section"] == "overall") & (res["metric"] == "ess_median")]
    assert len(ess) == 3 and (ess["lo"] <= ess["value"]).all() and (ess["value"] <= ess["hi"]).all()
    per_step = pd.read_parquet(out / "per_step.parquet")
    assert len(per_step) == 4 * 3
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_hyper_parameters_sampling_and_one_sided_logs(tmp_path, capsys):
    rng = np.random.default_rng(0)
    meta = make_meta("test", {"sampler_logp": "engine", "old_logp": "trainer", "current_logp": None})
    n, lens = 4000, np.full(40, 100)
    s = np.log(rng.random(n)).astype(np.float32)
    with NeutralLogWriter(tmp_path / "log", meta) as w:  # the trainer sits 0.05 below the sampler on every token
        w.write_tokens({"run": "", "step": 1, "sample_id": np.repeat(np.arange(40), 100),
                        "position": np.tile(np.arange(100), 40),
                        "loss_mask": np.ones(n, bool), "sampler_logp": s,
                        "old_logp": s - np.float32(0.05) + 0.005 * rng.standard_normal(n).astype(np.float32)})
        w.write_sequences({"run": "", "step": 1, "sample_id": np.arange(40), "response_length": lens})
    assert main([str(tmp_path / "log")]) == 0  # a mean ratio of 0.95 with every token below 1: truncation's mark
    out = capsys.readouterr().out
    assert "Truncated sampling detected: mean trainer/sampler token ratio 0.951" in out
    assert "the log declares no truncation" in out and "another temperature" in out
    assert main([str(tmp_path / "log"), "--top-p", "0.95"]) == 0
    assert "(the log declares top_p 0.95)" in capsys.readouterr().out
    with NeutralLogWriter(tmp_path / "small", meta) as w:  # 0.005 below: one-sided, but the mean ratio is 0.995
        w.write_tokens({"run": "", "step": 1, "sample_id": np.repeat(np.arange(40), 100),
                        "position": np.tile(np.arange(100), 40), "loss_mask": np.ones(n, bool), "sampler_logp": s,
                        "old_logp": s - np.float32(0.005) + 0.0005 * rng.standard_normal(n).astype(np.float32)})
        w.write_sequences({"run": "", "step": 1, "sample_id": np.arange(40), "response_length": lens})
    assert main([str(tmp_path / "small")]) == 0
    out = capsys.readouterr().out
    assert "one-sided: 100 % of tokens are negative" in out and "Truncated sampling detected" not in out
    base = diagnose(tmp_path / "log", progress=False).tables["corrections"].set_index("name")
    tight = diagnose(tmp_path / "log", hyper={"mis_token": {"lower": 0.96}}, progress=False
                     ).tables["corrections"].set_index("name")
    assert base.loc["mis_token", "tokens_changed"] == 0 < tight.loc["mis_token", "tokens_changed"]
    assert main([str(tmp_path / "log"), "-H", "nope.cap=3"]) == 2
    assert "hyper-parameters given for nope" in capsys.readouterr().err
    assert main([str(tmp_path / "log"), "-H", "tis_token.kap=3"]) == 2
    assert "has no hyper-parameter(s) kap" in capsys.readouterr().err


def test_failures_write_nothing(sim, tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert main([str(sim), "--out", str(foreign)]) == 2
    assert "the lab did not write" in capsys.readouterr().err and (foreign / "notes.txt").read_text() == "mine"
    tok = pd.read_parquet(sim / "tokens.parquet")
    tok.loc[tok.index[tok["loss_mask"]][5], "sampler_logp"] = np.nan
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("sequences.parquet", "meta.json"):
        (bad / f).write_bytes((sim / f).read_bytes())
    tok.to_parquet(bad / "tokens.parquet", index=False)
    out = tmp_path / "run"
    assert main([str(bad), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sampler_logp is missing or NaN" in err[0] and "1 such tokens in 1 sequences" in err[0]
    assert not out.exists()
    assert main([str(bad), "--out", str(out), "--nan", "drop"]) == 0
    assert json.loads((out / "summary.json").read_text())["nan"]["tokens"]["sampler_logp"] == 1
    assert main([str(sim), "--nan", "ignore"]) == 2
    assert "nan must be 'error' or 'drop'" in capsys.readouterr().err


def test_save_log_keeps_the_converted_log(tmp_path, capsys):
    from test_diagnose_adapters import prime_record, write_prime_export  # tests/ is on sys.path (rootdir conftest)

    rng = np.random.default_rng(7)
    write_prime_export(tmp_path / "out", {(1, 0): [prime_record(rng, 1, 0, 0, i, i, 4, 30) for i in range(30)]})
    assert main(["--from", "prime-rl", str(tmp_path / "out"), "--save-log", str(tmp_path / "neutral"),
                 "--out", str(tmp_path / "a")]) == 0
    assert main([str(tmp_path / "neutral"), "--out", str(tmp_path / "b")]) == 0
    a, b = (json.loads((tmp_path / x / "summary.json").read_text()) for x in "ab")
    assert a["overall"] == b["overall"] and a["verdict"] == b["verdict"]
    assert main([str(tmp_path / "neutral"), "--save-log", str(tmp_path / "c")]) == 2
    assert "already neutral" in capsys.readouterr().err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


@pytest.fixture
def prime(tmp_path):
    """A prime-rl export (30 records of step 1 and one without loss-masked tokens) in tmp_path/dump."""
    from test_diagnose_adapters import prime_record, write_prime_export

    rng = np.random.default_rng(8)
    records = [prime_record(rng, 1, 0, 0, i, i, 4, 30) for i in range(30)]
    empty = prime_record(rng, 1, 0, 0, 30, 30, 4, 3)
    empty["loss_mask"] = [False] * len(empty["loss_mask"])
    write_prime_export(tmp_path / "dump", {(1, 0): records + [empty]})
    return tmp_path / "dump"


def _listing(root: Path) -> list:
    return sorted((str(p.relative_to(root)), p.is_dir() or p.read_bytes()) for p in root.rglob("*"))


def test_output_paths_are_checked_before_any_work(prime, tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    before = _listing(tmp_path)
    cases = [
        (["--save-log", str(tmp_path / "afile" / "log")], f"{tmp_path / 'afile'} is a file",
         "choose another --save-log"),
        (["--out", str(tmp_path / "afile" / "run")], f"{tmp_path / 'afile'} is a file", "choose another --out"),
        (["--out", str(tmp_path / "afile" / "deeper" / "run")], "is a file", "choose another --out"),
        (["--out", str(prime)], f"--out {prime} is the input {prime}", "choose another --out"),
        (["--out", str(tmp_path)], f"--out {tmp_path} contains the input {prime}", "choose another --out"),
        (["--save-log", str(prime / "neutral")], "lies inside the input", "choose another --save-log"),
        (["--out", str(tmp_path / "x"), "--save-log", str(tmp_path / "x")], "--out", "give them separate folders"),
        (["--out", str(tmp_path / "x" / "run"), "--save-log", str(tmp_path / "x")], "lies inside --save-log",
         "give them separate folders"),
        (["--out", str(tmp_path / "afile")], "is a file", "--out"),
        (["--save-log", str(tmp_path / "afile")], "exists and is not a rollout log folder", "another path"),
        (["--nan", "ignore"], "nan must be 'error' or 'drop'", ""),
        (["--pair", "both"], "pair must be natural, total, mismatch or update", ""),
        (["-H", "tis_token.kap=3"], "has no hyper-parameter(s) kap", ""),
    ]
    for extra, first, second in cases:
        assert main(["--from", "prime-rl", str(prime), *extra]) == 2, extra
        out = capsys.readouterr()
        assert out.out == "" and len(out.err.strip().splitlines()) == 1, extra
        assert first in out.err and second in out.err, (extra, out.err)
    assert _listing(tmp_path) == before  # nothing written, no staging folders, no parents left behind


def test_outputs_under_missing_parents_and_notes(prime, tmp_path, capsys):
    save, out = tmp_path / "a" / "b" / "neutral", tmp_path / "c" / "run"
    assert main(["--from", "prime-rl", str(prime), "--save-log", str(save), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "note: 1 records without loss-masked tokens skipped" in printed
    assert printed[-2:] == [f"wrote {save}", f"wrote {out}"]
    assert (save / "meta.json").exists() and (out / "summary.json").exists()
    assert not [p for p in tmp_path.rglob(".*") if p.name != ".lab"]  # no staging left; each output is marked


@pytest.mark.slow
def test_no_partial_output(prime, tmp_path, capsys, monkeypatch):
    """A failure at any point after the checks leaves neither output (nor its parents) and prints no verdict; a
    failed final rename puts back the folders it was replacing."""
    import lab.runs
    from lab.diagnose import cli

    save, out = tmp_path / "new" / "neutral", tmp_path / "new" / "run"

    def broken_write_run_files(*a, **k):
        raise LabError("disk full")

    with monkeypatch.context() as m:
        m.setattr(lab.runs, "write_run_files", broken_write_run_files)
        assert main(["--from", "prime-rl", str(prime), "--save-log", str(save), "--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip() == "error: disk full"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump"]

    assert main(["--from", "prime-rl", str(prime), "--save-log", str(save), "--out", str(out)]) == 0
    capsys.readouterr()
    old = _listing(tmp_path / "new")
    real_replace = os.replace

    def failing_replace(src, dst):
        if Path(dst) == out and Path(src).name == "new":
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(cli.os, "replace", failing_replace)
    assert main(["--from", "prime-rl", str(prime), "--save-log", str(save), "--out", str(out),
                 "--temperature", "0.7"]) == 2  # a new log and a new run folder (both record the temperature)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.strip() == ("error: cannot move the outputs into place (No space left "
                                                           "on device); nothing was written")
    assert _listing(tmp_path / "new") == old  # the earlier log and run folder, as they were


MEASURE = textwrap.dedent("""
    import os, sys
    os.environ["LAB_QUIET"] = "1"
    from lab.diagnose import diagnose

    def kib(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1])

    small, large, chunk = sys.argv[1], sys.argv[2], int(sys.argv[3])
    for path in (small, large):  # warm-up: imports, code pages, allocator pools
        diagnose(path, chunk_rows=chunk, progress=False)
    for path in (small, large):
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark
        base = kib("VmRSS")
        diagnose(path, chunk_rows=chunk, progress=False)
        print((kib("VmHWM") - base) / 1024)
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="peak RSS reset needs Linux /proc")
@pytest.mark.slow
def test_memory_does_not_grow_with_the_log(tmp_path):
    """Peak memory above the baseline for a log 4x longer stays about the same: it is set by the chunk and the
    row-group size, not by the number of tokens."""
    # long responses: few sequences, so their state (about 1-4 KB each) stays far below what holding the tokens takes
    small = random_log(tmp_path / "small", 100_000, mean_len=800, batch=256, row_group_rows=1 << 14)
    large = random_log(tmp_path / "large", 800_000, mean_len=800, batch=256, row_group_rows=1 << 14)
    run = subprocess.run([sys.executable, "-c", MEASURE, str(small), str(large), str(1 << 14)], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stderr
    peak_small, peak_large = map(float, run.stdout.split()[-2:])
    tokens_mb = 800_000 * 60 / 2**20  # what holding the long log's columns in memory would take, at least
    # a pass that held the tokens would grow by at least 3/4 of that from the short log to the long one; the
    # streaming pass grows only by its per-sequence state (about 1 KB a sequence) and allocator noise
    assert peak_large < peak_small + 0.5 * tokens_mb, (peak_small, peak_large)
