"""The rollout_diagnostics study: the same numbers as lab.diagnose on the same log (simulated, neutral, or a NeMo-RL
training-data log converted on the fly), its summary's typed shape, and every bad parameter refused before any
work."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pandas as pd
import pytest

from lab.diagnose import RolloutLog, diagnose
from lab.diagnose.adapters import ADAPTERS
from lab.diagnose.cli import plain
from lab.diagnose.synthetic import simulate
from lab.errors import LabError
from lab.studies.rollout_diagnostics import study


def same(a, b) -> bool:
    """Equal as JSON data, types, key order and NaN included."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def nemo_rl_log(folder, rng, steps=2, B=6, prompt=3):
    """NeMo-RL's train_data_step<N>.jsonl (one json line per sample, prompt + response padded to the longest; no
    current log-probs, no policy versions)."""
    folder.mkdir(parents=True)
    for step in range(1, steps + 1):
        lens = rng.integers(prompt + 3, prompt + 12, B)
        S = int(lens.max())
        mask = (np.arange(S)[None] >= prompt) & (np.arange(S)[None] < lens[:, None])
        gen = np.where(mask, -rng.exponential(1.0, (B, S)), 0.0)
        prev = np.where(mask, gen + rng.normal(0, 0.05, (B, S)), 0.0)
        with open(folder / f"train_data_step{step}.jsonl", "w") as f:
            for i in range(B):
                f.write(json.dumps({"content": f"s{i}", "rewards": float(rng.random()), "input_lengths": int(lens[i]),
                                    "token_ids": rng.integers(0, 99, S).tolist(), "token_loss_mask": mask[i].tolist(),
                                    "sample_loss_mask": 1, "advantages": [float(rng.normal())] * S,
                                    "generation_logprobs": gen[i].tolist(), "prev_logprobs": prev[i].tolist(),
                                    "idx": i}) + "\n")
    return folder


def test_the_study_is_lab_diagnose_on_the_simulated_run(tmp_path):
    cfg = study.Config(**study.SMOKE, seed=3)
    results, summary = study.run(cfg, progress=False)
    log = simulate(tmp_path / "log", **cfg.simulate())
    direct = diagnose(RolloutLog(log), seed=3, progress=False)
    pd.testing.assert_frame_equal(results, direct.tables["results"], check_exact=True)
    assert same(summary, plain(direct.summary))  # the typed Summary declares every key lab.diagnose writes
    assert summary["n_steps"] == 3 and summary["notes"][0].startswith("lab.diagnose.synthetic.simulate(steps=3")


def test_a_neutral_log_with_its_options_and_a_converted_dump(tmp_path):
    log = simulate(tmp_path / "log", **{**study.Config(**study.SMOKE).simulate(), "current": False})
    cfg = study.Config(log_path=str(log), nan="drop", pair="mismatch", hyper={"tis_token": {"cap": 3.0}}, top_p=0.9,
                       chunk_rows=100, seed=1)
    _, summary = study.run(cfg, progress=False)
    assert summary["pairs"] == ["mismatch"] and summary["nan"]["mode"] == "drop"
    assert summary["sampling"]["top_p"] == 0.9 and summary["truncated_sampling"]
    assert summary["corrections"]["tis_token"]["hyper"] == "cap=3.0"
    with pytest.raises(LabError, match="pair update"):
        study.Config(log_path=str(log), pair="update").validate()
    dump = nemo_rl_log(tmp_path / "nemo", np.random.default_rng(0))
    results, summary = study.run(study.Config(log_path=str(dump), log_format="nemo-rl"), progress=False)
    assert summary["staleness"] is None and summary["source"] == "nemo-rl" and summary["n_sequences"] == 12
    assert same(summary, plain(diagnose(RolloutLog(ADAPTERS["nemo-rl"].convert(dump, tmp_path / "converted")),
                                        progress=False).summary))
    assert set(results["section"]) >= {"overall", "per_step", "corrections"}


@pytest.mark.parametrize("given,match", [
    ({"log_format": "bogus"}, "log_format must be one of lab, prime-rl"),
    ({"nan": "ignore"}, "nan must be one of error, drop"), ({"pair": "both"}, "pair must be one of natural"),
    ({"log_format": "slime"}, "describe a given log"), ({"top_p": 0.9}, "describe a given log"),
    ({"top_p": 1.5}, "top_p must be > 0 and <= 1"), ({"temperature": 0}, "temperature must be > 0"),
    ({"trust_pickle": True}, "applies only with log_format slime or skyrl"),
    ({"log_path": "/nonexistent/log"}, "no such file or folder"),
    ({"log_path": ".", "simulate_steps": 3}, "simulate_steps applies only with log_path"),
    ({"simulate_batch": 30}, "multiple of simulate_group_size"),
    ({"simulate_vocab": 65_536}, "GiB"), ({"simulate_steps": 20_000, "simulate_mean_len": 1000}, "tokens"),
    ({"simulate_sampler_dtype": "int8"}, "simulate_sampler_dtype must be one of"),
    ({"hyper": {"nope": {"x": 1}}}, "nope"), ({"hyper": {"tis_token": {"nope": 1}}}, "nope"),
    ({"chunk_rows": 0}, "chunk_rows must be >= 1"), ({"seed": -1}, "seed"),
])
def test_bad_parameters_are_one_line_before_any_work(given, match):
    t0 = time.perf_counter()
    with pytest.raises(LabError, match=match):
        study.Config(**given).validate()
    assert time.perf_counter() - t0 < 2


def test_the_reports_parameters_are_the_configs_fields_and_a_bogus_format_starts_no_kernel(tmp_path, capsys):
    from dataclasses import fields

    from lab.cli import main
    from lab.reports import get, params

    report = get("rollout_diagnostics")
    assert list(params.specs(report)) == [f.name for f in fields(study.Config)]
    assert params.specs(report)["log_format"].kind == "one of " + ", ".join(ADAPTERS)
    cfg, _ = params.resolve(report, {}, {"hyper": '{"tis_token": {"cap": 3}}', "log_path": "none"}, smoke=True)
    assert cfg.hyper == {"tis_token": {"cap": 3}} and cfg.log_path is None and cfg.simulate_steps == 3
    assert main(["report", "rollout_diagnostics", "-p", "log_format=bogus", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "log_format must be one of lab, prime-rl" in err[0]
    assert not (tmp_path / "r").exists()
