"""Bad logs, as a new user would produce them: one line naming the file, the record and the field, exit 2, nothing
in --out."""
from __future__ import annotations

import errno
import json
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lab.diagnose import RolloutLogWriter, make_meta
from lab.diagnose.cli import main
from test_diagnose_adapters import prime_record, write_prime_export

ROOT = Path(__file__).resolve().parents[1]
META = make_meta("t", {"sampler_logp": "mu", "old_logp": "old", "current_logp": None})


def lab_log(path, sampler, old, mask=None):
    B, T = sampler.shape
    with RolloutLogWriter(path, META) as w:
        w.add(1, torch.arange(B), torch.zeros(B, T, dtype=torch.long), torch.ones(B, T) if mask is None else mask,
              sampler_logp=sampler, old_logp=old)
    return path


def one_line(capsys, code, rc=2):
    assert code == rc
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1, err
    return err


def test_log_probs_above_zero_are_refused(tmp_path, capsys):
    log = lab_log(tmp_path / "log", torch.full((2, 3), 5.0), torch.full((2, 3), -1.0))
    err = one_line(capsys, main([str(log), "--out", str(tmp_path / "run"), "--nan", "drop"]))
    assert "row 0: step 1, sample_id 0: sampler_logp is 5, a log-probability above 0" in err
    assert not (tmp_path / "run").exists()


def test_infinite_and_empty_logs(tmp_path, capsys):
    s = -torch.rand(2, 3)
    s[1, 1] = float("inf")
    err = one_line(capsys, main([str(lab_log(tmp_path / "a", s, s.clone()))]))
    assert "sample_id 1: sampler_logp is" in err  # +inf names itself, not "missing or NaN"
    s[1, 1] = -1.0
    err = one_line(capsys, main([str(lab_log(tmp_path / "b", s, s, mask=torch.zeros(2, 3)))]))
    assert "nothing to diagnose: 2 sequences, none with a loss-masked token" in err
    with RolloutLogWriter(tmp_path / "c", META):
        pass
    err = one_line(capsys, main([str(tmp_path / "c"), "--out", str(tmp_path / "run")]))
    assert "nothing to diagnose: no sequences" in err and not (tmp_path / "run").exists()


def test_pair_update_without_current_log_probs(tmp_path, capsys):
    log = lab_log(tmp_path / "log", -torch.rand(2, 3), -torch.rand(2, 3))
    err = one_line(capsys, main([str(log), "--pair", "update"]))
    assert "--pair update compares current_logp and old_logp" in err
    err = one_line(capsys, main(["--from", "prime-rl", str(tmp_path), "--pair", "total"]))
    assert "--pair total" in err and "prime-rl" in err


def test_repeated_hyper_parameter(tmp_path, capsys):
    log = lab_log(tmp_path / "log", -torch.rand(2, 3), -torch.rand(2, 3))
    err = one_line(capsys, main([str(log), "-H", "tis_token.cap=3", "-H", "tis_token.cap=4"]))
    assert "-H tis_token.cap is given twice (3 and 4)" in err


@pytest.mark.parametrize("error", [errno.ENOSPC, errno.EIO])
def test_write_errors_leave_nothing(tmp_path, capsys, monkeypatch, error):
    import lab.runs

    log = lab_log(tmp_path / "log", -torch.rand(2, 3), -torch.rand(2, 3))
    real = lab.runs.write_run_files

    def failing(dest, *a, **k):
        real(dest, *a, **k)
        raise OSError(error, "No space left on device" if error == errno.ENOSPC else "I/O error", str(dest))

    monkeypatch.setattr(lab.runs, "write_run_files", failing)
    before = sorted(p.name for p in tmp_path.iterdir())
    err = one_line(capsys, main([str(log), "--out", str(tmp_path / "run")]))
    assert "nothing was written" in err and ("disk is full" in err) == (error == errno.ENOSPC)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.__setitem__("step", 2 ** 70), "field 'step' is 1.1805916207174113e+21; expected an integer"),
    (lambda r: r["trainer_logprobs"].__setitem__(6, "1" * 400), "'trainer_logprobs' entry 6 is 1111"),
    (lambda r: r.__setitem__("extra", json.loads("[" * 40 + "]" * 40)), None),
], ids=["huge-step", "huge-logprob", "nested-ok"])
@pytest.mark.slow
def test_json_numbers_and_nesting_are_bounded(tmp_path, capsys, edit, message):
    rng = np.random.default_rng(0)
    rec = prime_record(rng, 1, 0, 0, 0, 0, 3, 8)
    edit(rec)
    write_prime_export(tmp_path / "out", {(1, 0): [rec]})
    f = tmp_path / "out" / "token_exports" / "step_1" / "rank_0.jsonl"
    if message == "'trainer_logprobs' entry 6 is 1111":
        f.write_text(f.read_text().replace('"1' + "1" * 399 + '"', "1" * 400))
    if message is None:
        assert main(["--from", "prime-rl", str(tmp_path / "out")]) == 0
        return
    err = one_line(capsys, main(["--from", "prime-rl", str(tmp_path / "out")]))
    assert f"{f}:1: {message}" in err


@pytest.mark.parametrize("raw,message", [
    (b'{"schema_version": 1, "token_ids": [1, 2]}\xff\xfe\n', "not valid UTF-8"),
    (b"[" * 200_000 + b"]" * 200_000 + b"\n", "JSON nested deeper than"),
    (b'{"schema_version": NaN}\n', "NaN is not JSON"),
], ids=["utf8", "deep", "nan-literal"])
def test_json_lines_that_are_not_records(tmp_path, capsys, raw, message):
    d = tmp_path / "out" / "token_exports" / "step_1"
    d.mkdir(parents=True)
    (d / "rank_0.jsonl").write_bytes(raw)
    err = one_line(capsys, main(["--from", "prime-rl", str(tmp_path / "out")]))
    assert f"rank_0.jsonl:1: {message}" in err


def test_corrupt_pickle_with_trust_is_one_line(tmp_path, capsys, recwarn):
    dump = tmp_path / "dump"
    (dump / "train_data").mkdir(parents=True)
    (dump / "train_data" / "0.pt").write_bytes(pickle.dumps({"rollout_id": 0})[:-3] + b"garbage")
    for flags in ([], ["--trust-pickle"]):
        err = one_line(capsys, main(["--from", "slime", str(dump), *flags]))
        assert "0.pt: not a readable torch.save file" in err
    d = tmp_path / "sky" / "dumped_data"
    d.mkdir(parents=True)
    (d / "global_step_1_training_input.pkl").write_bytes(b"\x80\x04\x95garbage")
    for flags in ([], ["--trust-pickle"]):
        err = one_line(capsys, main(["--from", "skyrl", str(tmp_path / "sky"), *flags]))
        assert "not a readable SkyRL pickle" in err
    # and no warning beside the line (torch.load's about a plain pickle's protocol printed two more lines)
    assert [str(w.message)[:60] for w in recwarn] == []


@pytest.mark.parametrize("text", [
    "-9223372036854775808", "-9223372036854775809", "9223372036854775807", "18446744073709551615",
    "18446744073709551616", "1" * 30, "-" + "9" * 300, "1e308", "-2.5e-320", "[0.1, null, 3, -0.0]",
    '{"a": [1, 2.5, {"b": [true, false, "x"]}]}', "[" * 30 + "]" * 30,
])
def test_json_lines_read_alike_by_both_parsers(text):
    """orjson (the fast path) and the standard library parser with its number bounds (the path that names what is
    wrong) give the same value for every number up to and across the 64-bit and float64 limits."""
    from lab.diagnose.adapters.common import _json_line_checked, json_line

    fast, careful = json_line(text.encode(), "x"), _json_line_checked(text.encode(), "x")
    assert fast == careful and type(fast) is type(careful)
    assert json.dumps(fast) == json.dumps(careful)


@pytest.mark.parametrize("text,refusal", [
    ("1" * 400, "out of range"), ("[1e999]", "out of range"), ("[" * 65 + "]" * 65, "JSON nested deeper than 64"),
    ("NaN", "NaN is not JSON"), ('{"a": Infinity}', "Infinity is not JSON"),
])
def test_json_lines_beyond_the_bounds_are_refused_by_both_parsers(text, refusal):
    """Beyond the bounds both paths refuse alike: a number too large for a float64 comes back as OutOfRange text
    (the field checks name it), deeper nesting and non-finite literals are one error."""
    from lab.diagnose.adapters.common import OutOfRange, _json_line_checked, json_line
    from lab.errors import LabError

    for parse in (json_line, _json_line_checked):
        if refusal == "out of range":
            value = parse(text.encode(), "x")
            assert isinstance(value if isinstance(value, str) else value[0], OutOfRange), parse
        else:
            with pytest.raises(LabError, match=f"^x: {refusal}"):
                parse(text.encode(), "x")


@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
@pytest.mark.slow
def test_an_interrupted_diagnose_is_one_line_130_and_leaves_nothing(signum, tmp_path):
    """``python -m lab.diagnose`` stopped during its pass (Ctrl-C or a scheduler's SIGTERM): one line, exit 130, no
    traceback, no staging folder."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from lab.diagnose.synthetic import random_log

    log = random_log(tmp_path / "log", 3_000_000, lengths=(64, 1024))
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "LAB_QUIET": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lab.diagnose", str(log), "--out", str(out / "run")],
                            cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_sigint)
    deadline = time.time() + 60
    while not list(out.glob(".run.lab-*")):  # its staging folder exists: the pass has started
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read()
        time.sleep(0.01)
    proc.send_signal(getattr(signal, signum))
    proc.wait(timeout=60)
    err = proc.stderr.read().replace("\r", "\n").strip().splitlines()
    assert proc.returncode == 130 and err[-1] == "error: interrupted; nothing half-written was kept", err
    assert not any("Traceback" in line for line in err), err
    assert list(out.iterdir()) == []


def _default_sigint() -> None:
    """Ctrl-C's default in the child, whatever this process inherited (a background job's shell ignores SIGINT)."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_captured_bad_run_is_one_line_without_progress_bars(tmp_path):
    """Progress bars are drawn on a terminal only: a caller that captures the output of a log that fails in the
    middle of the pass reads the error line and nothing else, without setting LAB_QUIET."""
    s = -torch.rand(4, 3)
    s[3, 2] = float("nan")
    log = lab_log(tmp_path / "log", s, s.clone())
    env = {k: v for k, v in os.environ.items() if k not in ("LAB_QUIET", "CI")}
    r = subprocess.run([sys.executable, "-m", "lab.diagnose", str(log), "--out", str(tmp_path / "run")], cwd=ROOT,
                       env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "\r" not in r.stderr and r.stderr.startswith("error: "), r.stderr
    assert "sampler_logp is missing or NaN" in r.stderr and not (tmp_path / "run").exists()


def test_a_tokens_file_without_its_run_column_is_one_line(tmp_path, capsys):
    log = lab_log(tmp_path / "log", -torch.rand(2, 3), -torch.rand(2, 3))
    f = log / "tokens.parquet"
    pq.write_table(pq.read_table(f).drop(["run"]), f)
    err = one_line(capsys, main([str(log), "--out", str(tmp_path / "run")]))
    assert str(f) in err and "run" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("logp", [-1e4, -1e30, -3e38])
def test_a_finite_log_prob_far_below_any_softmax_is_diagnosed_without_warnings(logp, tmp_path, capsys):
    """A sampler log-prob such as a masking constant (finite, e^logp underflows to 0) makes a delta far beyond
    float64's exp: the weights are infinite and reported so, with no numpy warning on the way."""
    s = -torch.rand(4, 5)
    s[:, 2] = logp  # every sequence: the median weight is beyond float64 too
    old = -torch.rand(4, 5)
    log = lab_log(tmp_path / "log", s, old)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main([str(log), "--out", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().err == ""
    overall = pq.read_table(tmp_path / "run" / "overall.parquet").to_pandas().set_index("pair")
    assert overall.loc["mismatch", "max_abs"] == float((old[:, 2] - s[:, 2]).max())  # the float32 difference


@pytest.mark.parametrize("edit, needle", [
    (lambda m: m.pop("source"), "'source' must name what wrote the log"),
    (lambda m: m.update(source=7), "'source' must name what wrote the log"),
    (lambda m: m.update(notes=[{"a": 1}]), "'notes' must be a list of strings"),
])
def test_metadata_the_report_reads_is_checked_before_the_pass(edit, needle, tmp_path, capsys):
    log = lab_log(tmp_path / "log", -torch.rand(2, 3), -torch.rand(2, 3))
    meta = json.loads((log / "meta.json").read_text())
    edit(meta)
    (log / "meta.json").write_text(json.dumps(meta))
    err = one_line(capsys, main([str(log), "--out", str(tmp_path / "run")]))
    assert needle in err and "meta.json" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize("save_log", [False, True])
def test_a_dump_with_nothing_to_diagnose_names_the_dump_not_a_staging_folder(tmp_path, capsys, save_log):
    rng = np.random.default_rng(0)
    write_prime_export(tmp_path / "outputs", {(1, 0): [prime_record(rng, 1, 0, 0, 0, 0, 3, 5)]})
    f = tmp_path / "outputs" / "token_exports" / "step_1" / "rank_0.jsonl"
    f.write_text("\n")  # the export holds no record
    argv = ["--from", "prime-rl", str(tmp_path / "outputs")]
    argv += ["--save-log", str(tmp_path / "log")] if save_log else []
    err = one_line(capsys, main(argv))
    assert err == (f"error: {tmp_path / 'outputs'}: nothing to diagnose: no sequences; the log needs loss-masked "
                   f"tokens with log-probs")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]


def test_log_probs_are_taken_in_the_declared_dtype(tmp_path, capsys):
    """A float32 log whose column holds a float64 below float32's range: that log-prob is -inf in the log's dtype,
    a sampled token of probability 0 (one line, or dropped with --nan drop), never a warning or a NaN table."""
    log = lab_log(tmp_path / "log", -torch.rand(2, 3), -torch.rand(2, 3))
    f = log / "tokens.parquet"
    t = pq.read_table(f)
    x = t["sampler_logp"].to_numpy().astype(np.float64)
    x[4] = -1e300
    pq.write_table(t.set_column(t.column_names.index("sampler_logp"), "sampler_logp", pa.array(x)), f)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        err = one_line(capsys, main([str(log)]))
        assert "sampler_logp is -inf (probability 0 for a sampled token)" in err
        assert main([str(log), "--nan", "drop", "--out", str(tmp_path / "run")]) == 0
    overall = pq.read_table(tmp_path / "run" / "overall.parquet").to_pandas().set_index("pair")
    assert overall.loc["mismatch", "n_tok"] == 5 and np.isfinite(overall.loc["mismatch", "mean_abs"])
