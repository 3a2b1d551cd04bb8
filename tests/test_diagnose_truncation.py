"""Sampler truncation in `lab diagnose` (lab.diagnose.truncation): the detection rule fires on truncating samplers
built exactly (lab.diagnose.synthetic.simulate samples from the truncated, renormalised bigram policy and records
log q) and not on bf16 mismatch or stale samplers, with fixed seeds; the mean ratio tracks the kept mass; kept sets
travel through the neutral format and slime's dumps, are checked on read, and tell whether the trainer renormalised."""
from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lab.diagnose import RolloutLog, diagnose
from lab.diagnose.adapters import convert
from lab.diagnose.cli import main
from lab.diagnose.neutral import RolloutLogWriter
from lab.diagnose.schema import make_meta
from lab.diagnose.synthetic import kept_mask, simulate
from lab.diagnose.truncation import ONE_SIDED, RATIO_MAX
from lab.errors import LabError
from test_diagnose_frameworks import save_v2, slime_rollout

SIZE = dict(steps=4, batch=32, vocab=64, mean_len=32)
TRUNCATED = {"top_p 0.95": dict(top_p=0.95), "top_p 0.9": dict(top_p=0.9), "top_p 0.8": dict(top_p=0.8),
             "top_k 20": dict(top_k=20), "top_k 5": dict(top_k=5),
             "top_p 0.9, stale": dict(top_p=0.9, lag_max=4, drift=0.1)}
UNTRUNCATED = {"bf16 mismatch": dict(lag_max=0), "fp16 mismatch": dict(lag_max=0, sampler_dtype="float16"),
               "stale": dict(lag_max=4, drift=0.1), "very stale": dict(lag_max=8, drift=0.3)}


def _kept_mass(meta) -> float:
    note = next(n for n in meta["notes"] if n.startswith("mean trainer kept mass"))
    return float(note.rsplit(":", 1)[1])


def _run(tmp_path, name, seed, **kw):
    folder = tmp_path / f"{re.sub(r'[^a-z0-9]+', '_', name)}-{seed}"
    return diagnose(simulate(folder, **{**SIZE, **kw}, seed=seed), progress=False)


def test_kept_mask_is_vllm_top_k_then_top_p():
    lp = np.log(np.array([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    assert kept_mask(lp, top_p=0.7).tolist() == [[True, True, False, False, False]]  # 0.5 < 0.7 <= 0.5 + 0.2
    assert kept_mask(lp, top_p=0.71).tolist() == [[True, True, True, False, False]]
    assert kept_mask(lp, top_k=3).tolist() == [[True, True, True, False, False]]
    # top-p on the top-k-renormalised distribution: 0.5 / 0.7 = 0.714 >= 0.7 keeps the first token alone
    assert kept_mask(lp, top_k=2, top_p=0.7).tolist() == [[True, False, False, False, False]]
    assert kept_mask(lp, top_p=1.0, top_k=0).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.slow
def test_detection_fires_on_every_truncating_sampler_and_tracks_the_kept_mass(tmp_path, seed):
    ratios = {}
    for name, kw in TRUNCATED.items():
        d = _run(tmp_path, name, seed, **kw)
        t = d.summary["truncation"]
        assert t["detected"], (name, seed, t)
        assert t["mean_ratio_hi"] < RATIO_MAX and t["below_one"] >= ONE_SIDED
        # E_q[pi / q] = pi(S): the mean ratio estimates the trainer's kept mass, within its own interval width
        assert abs(t["mean_ratio"] - _kept_mass(d.meta)) < t["mean_ratio_hi"] - t["mean_ratio_lo"], (name, seed, t)
        if kw.get("top_p") and "lag_max" not in kw:
            assert t["mean_ratio"] >= kw["top_p"] - 0.01  # a top-p kept set holds at least top_p of mu's mass
        ratios[name] = t["mean_ratio"]
        assert any(v.startswith("Truncated sampling detected: mean trainer/sampler token ratio") for v in d.verdict)
    assert ratios["top_p 0.8"] < ratios["top_p 0.9"] < ratios["top_p 0.95"]
    assert ratios["top_k 5"] < ratios["top_k 20"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_no_detection_on_precision_mismatch_or_staleness(tmp_path, seed):
    for name, kw in UNTRUNCATED.items():
        d = _run(tmp_path, name, seed, **kw)
        t = d.summary["truncation"]
        assert not t["detected"], (name, seed, t)
        assert t["below_one"] < ONE_SIDED  # two-sided: about half the tokens below 1
        assert t["mean_ratio_lo"] < 1.01 and t["mean_ratio_hi"] > 0.98  # E_mu[pi / mu] = 1
        assert not any("runcat" in v for v in d.verdict)


@pytest.mark.slow
def test_detection_rates_over_twenty_seeds(tmp_path):
    """20 seeds per regime: every truncating sampler detected in 20 of 20, no untruncated one in any."""
    seeds = range(3, 23)
    for name, kw in {"top_p 0.95": TRUNCATED["top_p 0.95"], "top_k 20": TRUNCATED["top_k 20"]}.items():
        assert sum(_run(tmp_path, name, s, **kw).summary["truncation"]["detected"] for s in seeds) == 20, name
    for name, kw in UNTRUNCATED.items():
        assert sum(_run(tmp_path, name, s, **kw).summary["truncation"]["detected"] for s in seeds) == 0, name


def test_kept_sets_tell_whether_the_trainer_renormalised(tmp_path):
    plain = _run(tmp_path, "kept", 0, top_p=0.9, kept_sets=True)
    replay = _run(tmp_path, "replay", 0, top_p=0.9, kept_sets=True, renormalise=True)
    k = plain.summary["truncation"]["kept_sets"]
    assert k["share"] == 1.0 and k["detected"] and k["mean_size"] > 1
    line = next(v for v in plain.verdict if v.startswith("The log records the sampler's kept sets"))
    assert "not renormalised over them" in line and "mask replay" in line and "never sampled" in line
    k = replay.summary["truncation"]["kept_sets"]
    assert not k["detected"] and k["mean_ratio_lo"] < 1 < k["mean_ratio_hi"] + 1e-3
    line = next(v for v in replay.verdict if v.startswith("The log records the sampler's kept sets"))
    assert "match them" in line and "never sampled" in line
    assert not replay.summary["truncation"]["detected"]
    tab = plain.tables["truncation"]
    assert set(tab["name"]) == {"all", "kept_sets"} and set(tab["pair"]) == {"mismatch", "total"}
    res = plain.tables["results"]
    assert set(res.query("section == 'truncation'")["metric"]) >= {"mean_ratio", "below_one", "n_tok"}


def test_singleton_kept_sets_give_a_renormalised_log_prob_of_zero(tmp_path):
    """A kept set of one token: the renormalised log-prob is 0; the full-softmax trainer's is log pi(y) < 0."""
    d = _run(tmp_path, "single", 0, top_p=0.5, kept_sets=True, logit_scale=4.0)
    k = d.summary["truncation"]["kept_sets"]
    assert k["singletons"] > 50
    assert k["singleton_mean_sampler_logp"] == 0.0 and k["singleton_mean_old_logp"] < -0.01
    r = _run(tmp_path, "single-r", 0, top_p=0.5, kept_sets=True, renormalise=True, logit_scale=4.0)
    assert r.summary["truncation"]["kept_sets"]["singleton_mean_old_logp"] == 0.0


def test_declared_truncation_that_the_ratios_do_not_show(tmp_path):
    """Renormalised trainer without recorded kept sets: the meta declares top_p, the ratios are centred."""
    d = _run(tmp_path, "renorm", 0, top_p=0.9, kept_sets=True, renormalise=True)
    path = tmp_path / "nokept"
    tok = pq.read_table(tmp_path / "renorm-0" / "tokens.parquet")
    (tmp_path / "renorm-0" / "tokens.parquet").unlink()
    pq.write_table(tok.drop(["kept_token_ids"]), tmp_path / "renorm-0" / "tokens.parquet")
    (tmp_path / "renorm-0").rename(path)
    log = RolloutLog(path)
    assert not log.has_kept_sets  # a log without the optional column is still a valid log
    d = diagnose(log, progress=False)
    assert d.summary["truncation"]["kept_sets"] is None and not d.summary["truncation"]["detected"]
    assert any(v.startswith("Sampling was truncated (top_p 0.9) but the ratios do not show it") for v in d.verdict)


# ------------------------------------------------------------------------------------------------ the neutral format
def _write(path, kept, tokens=(3, 1)):
    meta = make_meta("t", {"sampler_logp": "s", "old_logp": "o"}, top_p=0.9)
    with RolloutLogWriter(path, meta) as w:
        w.add(1, np.array([0]), np.array([list(tokens)]), np.ones((1, 2)), sampler_logp=np.full((1, 2), -0.1),
              old_logp=np.full((1, 2), -0.2), kept_token_ids=[kept])
    return path


def test_kept_sets_round_trip_and_are_checked_on_read(tmp_path):
    _write(tmp_path / "ok", [np.array([3, 7]), None])
    col = pq.read_table(tmp_path / "ok" / "tokens.parquet").column("kept_token_ids")
    assert col.type == pa.list_(pa.int64()) and col.to_pylist() == [[3, 7], None]
    diagnose(tmp_path / "ok", progress=False)
    _write(tmp_path / "out", [np.array([3, 7]), np.array([2, 5])])
    with pytest.raises(LabError, match=r"tokens.parquet: row 1: column 'kept_token_ids': step 1, sample_id 0, "
                                       r"position 1 has token 1 outside its kept set"):
        diagnose(tmp_path / "out", progress=False)
    _write(tmp_path / "empty", [np.array([3]), np.array([], np.int64)])
    with pytest.raises(LabError, match="row 1: .* has an empty kept set"):
        diagnose(tmp_path / "empty", progress=False)
    assert main([str(tmp_path / "out")]) == 2


def test_a_kept_set_column_of_the_wrong_type_is_refused(tmp_path):
    _write(tmp_path / "log", [np.array([3]), np.array([1])])
    f = tmp_path / "log" / "tokens.parquet"
    t = pq.read_table(f)
    t = t.set_column(t.schema.get_field_index("kept_token_ids"), "kept_token_ids", pa.array(["a", "b"]))
    pq.write_table(t, f)
    with pytest.raises(LabError, match="column 'kept_token_ids' has type string, expected a list of integers"):
        RolloutLog(tmp_path / "log")


# ------------------------------------------------------------------------------------------------ slime
def _slime_dump(tmp_path, rng, *, where="train", bad=None):
    """A --dump-details folder whose samples carry rollout_top_p_token_ids / offsets (int32 tensors, as
    observability/rollout_data_utils.py stores them), the sampled token in each set, an empty span on the last."""
    dump = tmp_path / "dump"
    (dump / "train_data").mkdir(parents=True)
    (dump / "rollout_data").mkdir()
    samples, train = slime_rollout(rng, 0, 1)
    want = []
    for s, t in zip(samples, train):
        R = t["response_lengths"]
        resp = t["tokens"][-R:].tolist()
        sets = [sorted({y, y + 1, y + 2}) for y in resp[:-1]] + [[]]
        ids = torch.tensor([i for st in sets for i in st], dtype=torch.int32)
        offsets = torch.tensor(np.concatenate(([0], np.cumsum([len(st) for st in sets]))), dtype=torch.int32)
        if bad == "offsets":
            offsets = offsets[:-1]
        target = t if where == "train" else s
        target["rollout_top_p_token_ids"] = ids
        if bad != "ids only":
            target["rollout_top_p_token_offsets"] = offsets
        want.append([st or None for st in sets])
    torch.save({"rollout_id": 0, "samples": samples}, dump / "rollout_data" / "0.pt")
    save_v2(dump / "train_data", "0.pt", 0, train)
    return dump, want


@pytest.mark.parametrize("where", ["train", "rollout"])
def test_slime_kept_sets_become_the_kept_token_ids_column(tmp_path, where):
    dump, want = _slime_dump(tmp_path, np.random.default_rng(0), where=where)
    log = RolloutLog(convert("slime", dump, tmp_path / "log"))
    assert log.has_kept_sets
    got = pq.read_table(tmp_path / "log" / "tokens.parquet").column("kept_token_ids").to_pylist()
    assert got == [st for sets in want for st in sets]
    d = diagnose(log, progress=False)
    k = d.summary["truncation"]["kept_sets"]
    assert k["n_tok"] == sum(len(sets) - 1 for sets in want) and k["mean_size"] == 3.0


@pytest.mark.parametrize("bad,message", [
    ("offsets", "'rollout_top_p_token_offsets' must be response_lengths \\+ 1"),
    ("ids only", "has rollout_top_p_token_ids without rollout_top_p_token_offsets")])
def test_slime_malformed_kept_sets_are_one_line(tmp_path, bad, message):
    dump, _ = _slime_dump(tmp_path, np.random.default_rng(0), bad=bad)
    with pytest.raises(LabError, match=message):
        convert("slime", dump, tmp_path / "log")
    assert not (tmp_path / "log").exists()


def test_cli_prints_the_truncation_verdict_and_writes_its_table(tmp_path, capsys):
    simulate(tmp_path / "log", **SIZE, top_k=10, seed=0)
    assert main([str(tmp_path / "log"), "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "Truncated sampling detected" in out and "the log declares top_k 10" in out
    tab = pq.read_table(tmp_path / "run" / "truncation.parquet").to_pandas()
    assert tab.query("pair == 'mismatch' and name == 'all'")["detected"].item()
    by_p = pq.read_table(tmp_path / "run" / "by_probability.parquet").to_pandas()
    assert by_p.query("pair == 'mismatch' and n_tok > 0")["mean_ratio"].lt(1).all()
