"""The neutral rollout-log format: writers, validated reading, atomic output, and one-line errors with file and row."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lab.diagnose import RolloutLog, RolloutLogWriter, diagnose, make_meta
from lab.diagnose.neutral import NeutralLogWriter, write_tables
from lab.diagnose.schema import SEQUENCE_COLUMNS, TOKEN_COLUMNS
from lab.errors import LabError

META = make_meta("test", {"sampler_logp": "sampler", "old_logp": "trainer", "current_logp": None})


def small_tables(n_seq: int = 6, length: int = 5, seed: int = 0):
    rng = np.random.default_rng(seed)
    rows = []
    for s in range(n_seq):
        for t in range(length):
            mu = float(-rng.random() * 3)
            rows.append({"run": "", "step": 1 + s // 3, "sample_id": s % 3, "position": t,
                         "token_id": int(rng.integers(50)),
                         "loss_mask": t > 0, "sampler_logp": mu, "old_logp": mu + 0.1 * float(rng.standard_normal()),
                         "current_logp": None, "version": 0, "advantage": 1.0 - 2 * (s % 2), "entropy": 1.0})
    tok = pd.DataFrame(rows)
    seq = pd.DataFrame({"run": [""] * n_seq, "step": [1 + s // 3 for s in range(n_seq)],
                        "sample_id": [s % 3 for s in range(n_seq)], "group_id": [0] * n_seq,
                        "reward": [float(s % 2) for s in range(n_seq)],
                        "advantage": [1.0 - 2 * (s % 2) for s in range(n_seq)],
                        "response_length": [length] * n_seq, "version_min": [0] * n_seq, "version_max": [0] * n_seq,
                        "trainer_version": [1 + s // 3 for s in range(n_seq)], "origin": [None] * n_seq})
    return tok, seq


def test_tensor_writer_round_trip(tmp_path):
    B, T = 4, 6
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 1, 1, 0, 1, 0], [1, 0, 0, 0, 0, 0]],
                        dtype=torch.float32)
    mu = -torch.rand(B, T, generator=g)
    old, cur = mu - 0.01, mu + 0.02
    tokens = torch.randint(0, 9, (B, T), generator=g)
    ver = torch.tensor([3, 2, 3, 1])
    adv = torch.tensor([0.5, -0.5, 1.0, -1.0])
    path = tmp_path / "log"
    meta = make_meta("lab", {"sampler_logp": "mu", "old_logp": "old", "current_logp": "pi"})
    with RolloutLogWriter(path, meta, run="r0") as w:
        w.add(7, torch.tensor([10, 11, 12, 13]), tokens, mask, sampler_logp=mu, old_logp=old, current_logp=cur,
              version=ver, advantages=adv, rewards=torch.tensor([1., 0., 1., 0.]), group_ids=torch.tensor([0, 0, 1, 1]),
              entropy=torch.ones(B, T), trainer_version=4)
    log = RolloutLog(path)
    assert log.meta["logp_dtype"] == "float32" and log.meta["batch_width"] == T
    tok = pq.read_table(path / "tokens.parquet").to_pandas()
    lengths = [3, 6, 5, 1]  # through the last loss-masked position
    assert len(tok) == sum(lengths)
    assert tok["run"].astype(str).eq("r0").all() and tok["step"].eq(7).all()
    np.testing.assert_array_equal(tok["sample_id"], np.repeat([10, 11, 12, 13], lengths))
    np.testing.assert_array_equal(tok["position"], np.concatenate([np.arange(n) for n in lengths]))
    keep = torch.arange(T)[None] < torch.tensor(lengths)[:, None]
    np.testing.assert_array_equal(tok["token_id"], tokens[keep].numpy())
    np.testing.assert_array_equal(tok["loss_mask"], mask[keep].numpy() > 0)
    np.testing.assert_array_equal(tok["sampler_logp"].to_numpy(np.float32), mu[keep].numpy())
    np.testing.assert_array_equal(tok["current_logp"].to_numpy(np.float32), cur[keep].numpy())
    np.testing.assert_array_equal(tok["version"], np.repeat(ver.numpy(), lengths))
    np.testing.assert_array_equal(tok["advantage"], np.repeat(adv.numpy(), lengths))
    seq = log.sequences()
    np.testing.assert_array_equal(seq["response_length"], lengths)
    np.testing.assert_array_equal(seq["trainer_version"], [4] * B)
    np.testing.assert_array_equal(seq["version_min"], ver.numpy())
    np.testing.assert_array_equal(seq["group_id"], [0, 0, 1, 1])
    assert seq["origin"].isna().all()


def test_tensor_writer_takes_bfloat16(tmp_path):
    """A bf16 trainer's tensors (log-probs, mask, advantages) are written as float32, exactly."""
    B, T = 3, 4
    mu = (-torch.rand(B, T, generator=torch.Generator().manual_seed(1))).to(torch.bfloat16)
    mask = torch.ones(B, T, dtype=torch.bfloat16)
    with RolloutLogWriter(tmp_path / "log", META) as w:
        w.add(1, torch.arange(B), torch.zeros(B, T, dtype=torch.long), mask, sampler_logp=mu, old_logp=mu - 0.25,
              advantages=torch.tensor([0.5, -1.0, 2.0], dtype=torch.bfloat16))
    log = RolloutLog(tmp_path / "log")
    tok = pq.read_table(tmp_path / "log" / "tokens.parquet").to_pandas()
    assert log.meta["logp_dtype"] == "float32"
    np.testing.assert_array_equal(tok["sampler_logp"].to_numpy(np.float32), mu.float().reshape(-1).numpy())
    np.testing.assert_array_equal(tok["advantage"], np.repeat([0.5, -1.0, 2.0], T))


def test_writer_is_atomic_and_refuses_foreign_paths(tmp_path):
    path = tmp_path / "log"
    with pytest.raises(RuntimeError):
        with NeutralLogWriter(path, META) as w:
            tok, seq = small_tables()
            w.write_tokens({c: tok[c].to_numpy() if tok[c].dtype != object else tok[c].tolist() for c in tok})
            raise RuntimeError("interrupted")
    assert not path.exists() and list(tmp_path.iterdir()) == []
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "x.txt").write_text("keep me")
    with pytest.raises(LabError, match="not a rollout log"):
        NeutralLogWriter(tmp_path / "foreign", META)
    assert (tmp_path / "foreign" / "x.txt").read_text() == "keep me"


def test_writer_rejects_inconsistent_input(tmp_path):
    w = RolloutLogWriter(tmp_path / "log", META)
    m = torch.ones(2, 3)
    with pytest.raises(LabError, match="current_logp is given"):
        w.add(1, torch.arange(2), torch.zeros(2, 3, dtype=torch.long), m, sampler_logp=-m, old_logp=-m, current_logp=-m)
    with pytest.raises(LabError, match="shape"):
        w.add(1, torch.arange(2), torch.zeros(2, 4, dtype=torch.long), m, sampler_logp=-m, old_logp=-m)
    with pytest.raises(LabError, match="distinct"):
        w.add(1, torch.zeros(2), torch.zeros(2, 3, dtype=torch.long), m, sampler_logp=-m, old_logp=-m)
    with pytest.raises(TypeError):  # the optional arguments are keywords: no positional placeholders
        w.add(1, torch.arange(2), torch.zeros(2, 3, dtype=torch.long), m, -m, -m)
    w.abort()
    assert not (tmp_path / "log").exists() and list(tmp_path.iterdir()) == []


def _write(tmp_path, tok, seq, meta=META):
    return write_tables(tmp_path / "log", meta, tok, seq)


@pytest.mark.parametrize("table,column", [("tokens", "old_logp"), ("tokens", "loss_mask"),
                                          ("sequences", "response_length")])
def test_missing_column_is_named(tmp_path, table, column):
    tok, seq = small_tables()
    path = _write(tmp_path, tok, seq)
    t = pq.read_table(path / f"{table}.parquet")
    pq.write_table(t.drop([column]), path / f"{table}.parquet")
    with pytest.raises(LabError) as e:
        RolloutLog(path)
    assert f"{table}.parquet" in str(e.value) and repr(column) in str(e.value) and "missing" in str(e.value)
    assert "\n" not in str(e.value)


def test_malformed_column_and_metadata(tmp_path):
    tok, seq = small_tables()
    path = _write(tmp_path, tok, seq)
    t = pq.read_table(path / "tokens.parquet")
    i = t.schema.get_field_index("sampler_logp")
    pq.write_table(t.set_column(i, "sampler_logp", pa.array([str(x) for x in t.column(i).to_pylist()])),
                   path / "tokens.parquet")
    with pytest.raises(LabError,
                       match=r"tokens.parquet: column 'sampler_logp' has type string, expected float32 or float64"):
        RolloutLog(path)
    path2 = _write(tmp_path / "b", tok, seq)
    meta = json.loads((path2 / "meta.json").read_text())
    meta["logp"]["old_logp"] = None
    (path2 / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(LabError, match="at least two"):
        RolloutLog(path2)
    (path2 / "meta.json").write_text("{not json")
    with pytest.raises(LabError, match="meta.json is not valid JSON"):
        RolloutLog(path2)
    with pytest.raises(LabError, match="no such file"):
        RolloutLog(tmp_path / "absent")


def test_required_nulls_duplicates_unknown_samples_and_lengths(tmp_path):
    tok, seq = small_tables()
    bad = seq.copy()
    bad.loc[3, "sample_id"] = bad.loc[4, "sample_id"]
    with pytest.raises(LabError, match=r"sequences.parquet: row 4: .* appears twice"):
        RolloutLog(_write(tmp_path / "a", tok, bad)).sequences()
    bad = tok.copy()
    bad.loc[12, "sample_id"] = 99
    with pytest.raises(LabError, match=r"tokens.parquet: row 12: .*sample_id 99\) has no row in sequences.parquet"):
        diagnose(_write(tmp_path / "b", bad, seq), progress=False)
    bad = seq.copy()
    bad.loc[2, "response_length"] = 6
    with pytest.raises(LabError, match=r"sequences.parquet: row 2: response_length is 6 but tokens.parquet has 5 rows"):
        diagnose(_write(tmp_path / "c", tok, bad), progress=False)
    bad.loc[2, "response_length"] = 4
    with pytest.raises(LabError, match=r"tokens.parquet: row 14: position 4 is outside 0..response_length - 1 = 3"):
        diagnose(_write(tmp_path / "c2", tok, bad), progress=False)
    bad = tok.copy()
    bad.loc[13, "position"] = 1  # positions 0, 1, 1, 3, 4
    with pytest.raises(LabError, match=r"sequences.parquet: row 2: the token positions .* are not 0..4, each once"):
        diagnose(_write(tmp_path / "c3", bad, seq), progress=False)
    path = _write(tmp_path / "d", tok, seq)  # another tool's file: position nullable, one null
    t = pq.read_table(path / "tokens.parquet")
    i = t.schema.get_field_index("position")
    pos = t.column(i).to_pylist()
    pos[7] = None
    pq.write_table(t.set_column(i, pa.field("position", pa.int32(), nullable=True), pa.array(pos, pa.int32())),
                   path / "tokens.parquet")
    with pytest.raises(LabError, match=r"tokens.parquet: row 7: column 'position' is null; it is required"):
        diagnose(path, progress=False)
    with pytest.raises(LabError, match="column 'position' is required but is null at row 7"):
        NeutralLogWriter(tmp_path / "e", META).write_tokens({"run": "", "step": np.ones(9), "sample_id": np.zeros(9),
                                                            "position": [0.0] * 7 + [np.nan, 8.0],
                                                            "loss_mask": np.ones(9, bool)})


def test_nan_log_probs_are_counted_and_refused_or_dropped(tmp_path):
    tok, seq = small_tables(n_seq=6)
    tok.loc[[6, 8, 23], "old_logp"] = np.nan  # loss-masked rows of sequences 1 and 4
    tok.loc[5, "sampler_logp"] = np.nan  # position 0: not loss-masked, ignored
    path = _write(tmp_path, tok, seq)
    with pytest.raises(LabError) as e:
        diagnose(path, progress=False)
    msg = str(e.value)
    assert "tokens.parquet: row 6: step 1, sample_id 1: old_logp is missing or NaN" in msg
    assert "3 such tokens in 2 sequences" in msg
    assert "--nan drop" in msg and "\n" not in msg
    d = diagnose(path, nan="drop", progress=False)
    assert d.summary["nan"] == {"mode": "drop", "tokens": {"sampler_logp": 0, "old_logp": 3}, "sequences": 2}
    assert d.summary["n_tokens_used"] == 6 * 4 - 3
    assert d.tables["per_step"]["n_seq"].sum() == 6 - 2  # whole sequences leave the sequence statistics
    assert any("3 loss-masked tokens had missing or NaN log-probs (2 sequences)" in v for v in d.verdict)


def test_schema_lists_are_what_the_docs_promise():
    doc = (__import__("pathlib").Path(__file__).resolve().parents[1] / "docs" / "rollout-logs.md").read_text()
    for name in {*TOKEN_COLUMNS, *SEQUENCE_COLUMNS}:
        assert f"`{name}`" in doc, name
