"""`lab diagnose` without torch or pandas: the numpy coefficient functions and weight diagnostics equal the
registry's and lab.diagnostics' torch ones, the numpy reading of the sequences table equals pandas', the tables are
still DataFrames, and a neutral-log run imports neither torch nor pandas."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

from lab import diagnostics, estimators
from lab.diagnose import diagnose
from lab.diagnose.coefficients import NUMPY
from lab.diagnose.corrections import CORRECTIONS, Correction, resolve
from lab.diagnose.neutral import RolloutLog, _array, _duplicated
from lab.diagnose.synthetic import random_log

ROOT = Path(__file__).resolve().parents[1]

# hyper-parameters other than the defaults, per correction (the defaults are tested too)
OTHER = {"tis_token": {"cap": 1.5}, "tis_seq": {"cap": 4.0}, "mis_token": {"lower": 0.8, "upper": 1.3},
         "mis_seq": {"lower": 0.2, "upper": 9.0}, "ppo_clip": {"clip_ratio_low": 0.1, "clip_ratio_high": 0.28,
                                                               "clip_ratio_c": 3.0},
         "gspo": {"clip_ratio_low": 0.01, "clip_ratio_high": 0.02}, "cispo": {"clip_ratio_low": 0.2,
                                                                               "clip_ratio_high": 0.2},
         "sapo": {"tau_pos": 2.0, "tau_neg": 0.5}, "vespo": {"k_pos": 1.0, "lambda_pos": 0.5, "k_neg": 0.0,
                                                             "lambda_neg": 4.0}}


def _ratios_and_advantages(seed: int, n: int = 5000):
    rng = np.random.default_rng(seed)
    log_r = np.concatenate([rng.normal(0, 0.3, n), rng.normal(0, 3, n), rng.uniform(-30, 30, n // 10),
                            [0.0, -20.0, 20.0, -25.0, 25.0, np.log(2.0), np.log(0.5), np.log(5.0), 10.0]])
    adv = rng.normal(0, 1, log_r.size)
    adv[rng.random(log_r.size) < 0.05] = 0.0
    return np.exp(log_r), adv


@pytest.mark.parametrize("name", CORRECTIONS)
def test_numpy_coefficients_equal_the_registry(name):
    """Every correction the report evaluates: the numpy coefficient equals the registry's torch coefficient to 1e-12
    (relative), at the registry's defaults and at other hyper-parameters, on ratios from e^-30 to e^30 and both
    signs of the advantage."""
    assert set(NUMPY) == set(CORRECTIONS)
    info = estimators.info(name)
    for hyper in ({}, OTHER[name]):
        estimators.check_hyper(name, hyper)
        params = {**info.defaults, **hyper}
        for seed in (0, 1):
            ratio, adv = _ratios_and_advantages(seed)
            want = info.coefficient(torch.from_numpy(ratio.copy()), torch.from_numpy(adv.copy()), **params).numpy()
            got = NUMPY[name](ratio, adv, **params)
            assert got.dtype == np.float64 and got.shape == want.shape
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-300)
            assert np.array_equal(got == 0, want == 0)  # zeroed tokens are the same tokens


def test_correction_coefficient_uses_numpy_and_falls_back_to_the_registry():
    ratio, adv = _ratios_and_advantages(2, 500)
    for c in resolve(["mismatch", "update", "total"]):
        want = estimators.info(c.name).coefficient(torch.from_numpy(ratio.copy()), torch.from_numpy(adv.copy()),
                                                   **c.hyper).numpy()
        np.testing.assert_allclose(c.coefficient(ratio, adv), want, rtol=1e-12)
    gmpo = Correction("gmpo", "token", "update", dict(estimators.info("gmpo").defaults))  # no numpy version
    want = estimators.info("gmpo").coefficient(torch.from_numpy(ratio.copy()), torch.from_numpy(adv.copy()),
                                               **gmpo.hyper).numpy()
    np.testing.assert_array_equal(gmpo.coefficient(ratio, adv), want)


def test_weight_diagnostics_numpy_equal_torch():
    rng = np.random.default_rng(3)
    for L in (rng.normal(0, 1, (4, 300)), rng.normal(0, 8, (2, 50)), np.zeros((1, 7))):
        t = torch.from_numpy(L.copy())
        for fn in (diagnostics.kish_ess_fraction, diagnostics.max_weight_share, diagnostics.chi2):
            got, want = fn(L), fn(t)
            assert isinstance(got, np.ndarray) and torch.is_tensor(want)
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-12)


def test_sequence_arrays_equal_the_pandas_read(tmp_path):
    """The sequences table read as numpy arrays holds what pandas reads (nullable integers as float with NaN)."""
    log = RolloutLog(random_log(tmp_path / "log", 5000, seed=4, lag_max=3))
    table = RolloutLog._open(log.sequences_file).read().to_pandas()
    table["run"] = table["run"].astype(str)
    arrays = log.sequence_arrays()
    assert list(arrays) == list(table.columns)
    for c in table.columns:
        want = table[c].to_numpy()
        if want.dtype == object or arrays[c].dtype == object:  # strings; missing: None here, None or NaN there
            assert [None if pd.isna(v) else v for v in arrays[c]] == [None if pd.isna(v) else v for v in want]
        else:
            np.testing.assert_array_equal(arrays[c], want)
            assert arrays[c].dtype == want.dtype
    pd.testing.assert_frame_equal(log.sequences(), table)


def test_duplicated_is_pandas_duplicated():
    rng = np.random.default_rng(5)
    for n in (0, 1, 50, 2000):
        run = rng.choice(np.array(["a", "b", "c"], object), n)
        step, sid = rng.integers(0, 4, n), rng.integers(0, 30, n)
        want = pd.DataFrame({"run": run, "step": step, "sid": sid}).duplicated().to_numpy()
        np.testing.assert_array_equal(_duplicated(run, step, sid), want)


def test_array_reads_arrow_buffers_as_to_numpy():
    for a in (pa.array(np.arange(20, dtype=np.int32)), pa.array(np.linspace(0, 1, 20, dtype=np.float32)),
              pa.array(np.linspace(-1, 1, 20)), pa.array(np.arange(20) % 3 == 0), pa.array([1.0, None, 2.0]),
              pa.array([1, None, 3])):
        for part in (a, a.slice(3, 9), a.slice(0, 0), a.slice(len(a) - 1)):
            got, want = _array(part), part.to_numpy(zero_copy_only=False)
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(got, want)


def test_prefetch_stops_when_the_reader_stops_early(tmp_path):
    import threading

    log = RolloutLog(random_log(tmp_path / "log", 50_000, seed=6, row_group_rows=10_000))
    before = threading.active_count()
    chunks = log.iter_tokens(["step", "position"], 4096)
    first = next(chunks)
    assert first[0] == 0 and len(first[1]["step"]) == 4096
    chunks.close()
    assert threading.active_count() == before
    rows = [len(c["step"]) for _, c in log.iter_tokens(["step"], 4096)]
    assert rows == [len(c["step"]) for _, c in log.iter_tokens(["step"], 4096, prefetch=False)]
    assert sum(rows) == log.n_token_rows


def test_tables_are_dataframes(tmp_path):
    d = diagnose(random_log(tmp_path / "log", 5000, seed=7), progress=False)
    for name, df in d.tables.items():
        assert isinstance(df, pd.DataFrame), name
    assert d.tables["results"] is d.tables["results"]  # built once
    overall = d.tables["overall"].set_index("pair")
    for p, row in d.summary["overall"].items():
        assert overall.loc[p, "mean_abs"] == row["mean_abs"]


@pytest.mark.slow  # a fresh process: about a second
def test_a_neutral_log_run_imports_neither_torch_nor_pandas(tmp_path):
    """`lab diagnose LOG` (no --out) in a fresh process: what it prints, and no torch or pandas in sys.modules."""
    path = random_log(tmp_path / "log", 5000, seed=8)
    code = ("import json, sys\nfrom lab.diagnose.cli import main\nrc = main([sys.argv[1]])\n"
            "print(json.dumps({'rc': rc, 'loaded': [m for m in ('torch', 'pandas') if m in sys.modules]}))\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LAB_QUIET": "1"}
    proc = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"rc": 0, "loaded": []}
    assert "pair" in proc.stdout and "mismatch" in proc.stdout
