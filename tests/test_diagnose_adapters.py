"""Adapters from real framework dumps: each fixture is written the way the framework writes it (field names, nesting,
dtypes, file layout, serializer), and the neutral tables are checked value by value. Bad dumps give one line
naming the file and the row, and leave nothing behind."""
from __future__ import annotations

import io
import json
import math
import pickle
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from lab.diagnose import RolloutLog, diagnose
from lab.diagnose.adapters import convert
from lab.diagnose.cli import main
from lab.errors import LabError


def _tables(path: Path):
    tok = pq.read_table(path / "tokens.parquet").to_pandas()
    seq = pq.read_table(path / "sequences.parquet").to_pandas()
    tok["run"], seq["run"] = tok["run"].astype(str), seq["run"].astype(str)
    return tok, seq


def _f32(x) -> list:
    return [None if not math.isfinite(v) else v for v in np.asarray(x, np.float32).astype(np.float64).tolist()]


# ------------------------------------------------------------------------------------------------ prime-rl
def prime_record(rng, step, rank, micro_step, idx, export_idx, prompt, completion, hole=None, run_id=None,
                 release="2026-06"):
    """One line of prime-rl's trainer token export (schema_version 1): aligned per-token lists over the packed
    prompt + completion, float32 values as JSON numbers, non-finite as null.

    ``release`` "2026-06": the fields of 941019f2e .. 0be5ac452 (``export_step``, ``run_id``, per-token
    ``rewards``) plus the per-token ``losses`` records of prime-rl's trace-advantage branches (004274ec9, never
    on main). "2026-08": rl/token_export.py at 559b44772, its keys in its order: no export_step, run_id, rewards
    (289562d2e, 0be5ac452), the weight streams ``rl_weights`` / ``ce_weights`` / ``ref_kl_weights`` as lists of
    null when absent (the defaults), the trainer's log-probs on prompt and tool tokens too (its forward scores
    every token; the sampler's are 0 there)."""
    n = prompt + completion
    mask = np.r_[np.zeros(prompt, bool), np.ones(completion, bool)]
    if hole is not None:
        mask[prompt + hole] = False  # e.g. a tool output inside the completion
    inf = np.where(mask, -rng.exponential(1.0, n), 0.0).astype(np.float32)
    tr = np.where(mask, inf + rng.normal(0, 0.03, n), 0.0 if release == "2026-06" else -rng.exponential(2.0, n))
    tr = (tr if release == "2026-06" else np.minimum(tr, 0)).astype(np.float32)
    adv = np.float32(rng.normal())
    reward = float(rng.integers(0, 2))
    lr = (tr - inf).astype(np.float32)
    ratio = np.exp(lr)
    pd_ = np.exp(tr) - np.exp(inf)
    head = {"schema_version": 1, "step": step, "rank": rank, "micro_step": micro_step, "micro_sequence_idx": idx,
            "export_sequence_idx": export_idx, "env_name": "gsm8k"}
    tokens = {"token_ids": rng.integers(0, 151_000, n).tolist(), "position_ids": list(range(n)),
              "loss_mask": mask.tolist()}
    if release == "2026-08":
        adv_all = np.full(n, adv)  # the orchestrator broadcasts the rollout's advantage over the sample
        masked = mask & np.where(adv_all > 0, pd_ > 0.2, pd_ < -0.2)  # DefaultLossConfig dppo_mask_high/low 0.2
        return {**head, **tokens, "advantages": _f32(adv_all), "inference_logprobs": _f32(inf),
                "trainer_logprobs": _f32(tr), "entropy": _f32(rng.gamma(2.0, 0.3, n)),
                "mismatch_kl": _f32(ratio - lr - 1), "log_importance_ratio": _f32(lr), "importance_ratio": _f32(ratio),
                "prob_delta": _f32(pd_), "is_masked": masked.tolist(), "is_masked_high": (masked & (adv > 0)).tolist(),
                "is_masked_low": (masked & (adv < 0)).tolist(), "rl_weights": [None] * n, "ce_weights": [None] * n,
                "ref_kl_weights": [None] * n}
    return {"schema_version": 1, "step": step, "export_step": step, "rank": rank, "micro_step": micro_step,
            "micro_sequence_idx": idx, "export_sequence_idx": export_idx, "run_id": run_id, "env_name": "gsm8k",
            **tokens, "advantages": _f32(np.where(mask, adv, 0.0)),
            "losses": [{"rl": {"advantage": float(adv) if m else 0.0, "mask": bool(m)}} for m in mask],
            "rewards": _f32(np.full(n, reward)), "inference_logprobs": _f32(inf), "trainer_logprobs": _f32(tr),
            "entropy": _f32(rng.gamma(2.0, 0.3, n)), "mismatch_kl": _f32(ratio - lr - 1),
            "log_importance_ratio": _f32(lr), "importance_ratio": _f32(ratio),
            "prob_delta": _f32(pd_), "is_masked": [False] * n, "is_masked_high": [False] * n,
            "is_masked_low": [False] * n}


def write_prime_export(output_dir: Path, records: dict) -> None:
    """token_exports/step_<step>/rank_<rank>.jsonl, compact JSON lines, allow_nan=False, then STABLE."""
    for (step, rank), recs in records.items():
        d = output_dir / "token_exports" / f"step_{step}"
        d.mkdir(parents=True, exist_ok=True)
        with open(d / f"rank_{rank}.jsonl", "w", encoding="utf-8") as f:
            for rec in recs:
                f.write(json.dumps(rec, separators=(",", ":"), allow_nan=False) + "\n")
        (d / "STABLE").touch()


def _prime_dump(tmp_path, release="2026-06"):
    rng = np.random.default_rng(0)
    records = {}
    for step in (1, 2):
        for rank in (0, 1):
            records[(step, rank)] = [prime_record(rng, step, rank, 0, i, i, int(rng.integers(3, 7)),
                                                  int(rng.integers(4, 12)), hole=2 if i == 1 else None,
                                                  release=release)
                                     for i in range(3)]
    write_prime_export(tmp_path / "outputs", records)
    return tmp_path / "outputs", records


@pytest.fixture
def prime_dump(tmp_path):
    return _prime_dump(tmp_path)


@pytest.mark.parametrize("release", ["2026-06", "2026-08"])
def test_prime_rl_export_value_by_value(tmp_path, release):
    root, records = _prime_dump(tmp_path, release)
    log = RolloutLog(convert("prime-rl", root, tmp_path / "neutral"))
    assert log.meta["source"] == "prime-rl" and log.logp_columns == ["sampler_logp", "old_logp"]
    tok, seq = _tables(tmp_path / "neutral")
    t_rows, s_rows = [], []
    for (step, rank) in sorted(records):
        for line, rec in enumerate(records[(step, rank)], 1):
            mask = np.array(rec["loss_mask"])
            first, last = int(np.argmax(mask)), len(mask) - 1 - int(np.argmax(mask[::-1]))
            sid = sum(len(records[(step, r)]) for r in range(rank)) + line - 1
            for t in range(first, last + 1):
                t_rows.append((step, sid, t - first, rec["token_ids"][t], rec["loss_mask"][t],
                               rec["inference_logprobs"][t], rec["trainer_logprobs"][t], rec["advantages"][t],
                               rec["entropy"][t]))
            s_rows.append((step, sid, last - first + 1, rec["rewards"][first] if "rewards" in rec else np.nan,
                           rec["advantages"][first],
                           f"{root / 'token_exports' / f'step_{step}' / f'rank_{rank}.jsonl'}:{line}"))
    want = pd.DataFrame(t_rows, columns=["step", "sample_id", "position", "token_id", "loss_mask", "sampler_logp",
                                         "old_logp", "advantage", "entropy"])
    for col in want.columns:
        got = tok[col].to_numpy()
        if col in ("sampler_logp", "old_logp"):
            np.testing.assert_array_equal(got, want[col].to_numpy(np.float32), err_msg=col)
        else:
            np.testing.assert_array_equal(got, want[col].to_numpy(), err_msg=col)
    assert tok["current_logp"].isna().all() and tok["version"].isna().all() and tok["run"].eq("").all()
    wseq = pd.DataFrame(s_rows, columns=["step", "sample_id", "response_length", "reward", "advantage", "origin"])
    for col in wseq.columns:
        np.testing.assert_array_equal(seq[col].to_numpy(), wseq[col].to_numpy(), err_msg=col)
    assert seq["group_id"].isna().all() and seq["trainer_version"].isna().all()
    # the adapter's mismatch equals prime-rl's own exported log_importance_ratio on every loss-masked token
    d = diagnose(log, progress=False)
    lir = np.concatenate([np.array(r["log_importance_ratio"], dtype=np.float64)[np.array(r["loss_mask"])]
                          for k in sorted(records) for r in records[k]])
    assert d.tables["overall"].set_index("pair").loc["mismatch", "mean_abs"] == pytest.approx(np.abs(lir).mean(),
                                                                                             rel=1e-6)


def test_prime_rl_bad_input(prime_dump, tmp_path, capsys):
    root, _ = prime_dump
    f = root / "token_exports" / "step_2" / "rank_1.jsonl"
    lines = f.read_text().splitlines(keepends=True)
    f.write_text("".join(lines[:2]) + lines[2][: len(lines[2]) // 2])  # a truncated last line
    out = tmp_path / "run"
    assert main(["--from", "prime-rl", str(root), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and len(err.splitlines()) == 1
    assert f"{f}:3: not valid JSON" in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    rec = json.loads(lines[0])
    rec["loss_mask"] = rec["loss_mask"][:-1]
    f.write_text(json.dumps(rec) + "\n")
    with pytest.raises(LabError, match=rf"{f}:1: 'loss_mask' has \d+ entries but 'token_ids' has \d+"):
        convert("prime-rl", root, tmp_path / "n2")
    rec = json.loads(lines[0])
    rec["inference_logprobs"][-1] = None  # prime-rl writes a non-finite float as null
    f.write_text(json.dumps(rec) + "\n")
    with pytest.raises(LabError, match=rf"{f}:1: token \d+ of step 2: sampler_logp is missing or NaN"):
        diagnose(convert("prime-rl", root, tmp_path / "n3"), progress=False)
    assert main(["--from", "prime-rl", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: no such file or folder" in capsys.readouterr().err


def _no_advantages(rec):
    del rec["advantages"]  # later releases: per-token advantages only under losses[t]["rl"]
    return rec


@pytest.mark.parametrize("edit,message", [
    (lambda r: r["token_ids"].__setitem__(6, None), "'token_ids' entry 6 is None; expected an integer"),
    (lambda r: r["token_ids"].__setitem__(6, 1.5), "'token_ids' entry 6 is 1.5; expected an integer"),
    (lambda r: _no_advantages(r)["losses"][7]["rl"].__setitem__("advantage", "high"),
     "'losses[t].rl.advantage' entry 7 is 'high'; expected a number or null"),
    (lambda r: r["loss_mask"].__setitem__(8, "yes"), "'loss_mask' entry 8 is 'yes'; expected true/false"),
    (lambda r: r["loss_mask"].__setitem__(8, None), "'loss_mask' entry 8 is None; expected true/false"),
    (lambda r: r["trainer_logprobs"].__setitem__(7, "nan"), "'trainer_logprobs' entry 7 is 'nan'; expected a number"),
    (lambda r: r.__setitem__("run_id", ["a"]), "'run_id' is ['a']; expected a string"),
    (lambda r: r.__setitem__("advantages", 2**70), "field 'advantages' is 1.1805916207174113e+21; expected a list"),
    (lambda r: r.__setitem__("rewards", {"r": 1}), "field 'rewards' is {'r': 1}; expected a list"),
], ids=["null-token", "float-token", "string-advantage", "string-mask", "null-mask", "string-logprob", "list-run",
        "scalar-advantages", "dict-rewards"])
def test_prime_rl_malformed_values_are_one_line(prime_dump, tmp_path, capsys, edit, message):
    root, records = prime_dump
    f = root / "token_exports" / "step_1" / "rank_1.jsonl"
    rec = records[(1, 1)][1]
    assert len(rec["token_ids"]) > 8
    edit(rec)
    write_prime_export(root, {(1, 1): records[(1, 1)]})
    out = tmp_path / "run"
    assert main(["--from", "prime-rl", str(root), "--out", str(out), "--save-log", str(tmp_path / "neutral")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith(f"error: {f}:2: {message}")
    assert len(captured.err.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs"]


# ------------------------------------------------------------------------------------------------ slime
def slime_sample_to_dict(group_index, index, tokens, response_length, reward, loss_mask, weight_versions,
                         rollout_log_probs) -> dict:
    """Sample.to_dict(): the dataclass's __dict__ with status, spec_info and prefix_cache_info made plain (the fields
    and their order of slime/utils/types.py at 624b824a8)."""
    return {"group_index": group_index, "index": index, "rollout_id": None, "prompt": "Solve: 2 + 2 = ?",
            "tokens": tokens, "multimodal_inputs": None, "multimodal_train_inputs": None,
            "multimodal_train_input_id": None, "apply_chat_template_kwargs": {}, "response": "4",
            "response_length": response_length, "label": "4", "reward": reward, "loss_mask": loss_mask,
            "weight_versions": weight_versions, "rollout_log_probs": rollout_log_probs,
            "rollout_top_p_token_ids": None, "rollout_top_p_token_offsets": None, "rollout_routed_experts": None,
            "remove_sample": False, "teacher_log_probs": None, "status": "completed", "metadata": {},
            "generate_function_path": None, "custom_rm_path": None, "train_metadata": None, "session_id": None,
            "non_generation_time": 0.0,
            "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0, "spec_verify_ct": 0,
                          "completion_token_num": 0},
            "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": len(tokens) - response_length}}


def slime_v2_payload(rid: int, train: list[dict], raw_reward: list) -> dict:
    """observability/train_data_utils.py _build_dump_payload (slime 624b824a8) for train samples that carry
    ``data_parallel_rank``, ``sample_index`` and ``rollout_position`` (the rollout dump index, slime's
    ``partition``): the per-sample columns of RolloutManager._convert_samples_to_train_data / process_rollout_data
    (``rollout_ids`` = the sample's position when Sample.rollout_id is unset, ``rollout_mask_sums`` a 0-d float32
    tensor, ``source_names`` "unknown" when the metadata names none, ``local_raw_reward`` the rank's slice of
    ``raw_reward``), the samples sorted by rollout_position, one ``dp_shards`` entry per rank and ``raw_reward``, the
    whole rollout's, at the top."""
    samples = []
    for t in train:
        pos = t["rollout_position"]
        smp = {"data_parallel_rank": t["data_parallel_rank"], "sample_index": t["sample_index"],
               "rollout_position": pos, "truncated": 0, "rollout_ids": pos,
               "rollout_mask_sums": torch.as_tensor(t["loss_masks"]).sum().to(torch.float32),
               "source_names": "unknown", "local_raw_reward": raw_reward[pos]}
        smp.update((k, v) for k, v in t.items() if k not in smp or k in ("local_raw_reward", "truncated"))
        if "advantages" in smp:
            smp.setdefault("returns", smp["advantages"].clone())
        samples.append(smp)
    samples.sort(key=lambda smp: smp["rollout_position"])
    ranks = sorted({smp["data_parallel_rank"] for smp in samples})
    dp = [{"rank": r, "data_parallel_rank": r,
           "sample_indices": [smp["sample_index"] for smp in samples if smp["data_parallel_rank"] == r],
           "partition": [smp["rollout_position"] for smp in samples if smp["data_parallel_rank"] == r],
           "global_batch_sizes": [len(samples)], "num_microbatches": [1], "micro_batch_indices": [[0]]}
          for r in ranks]
    return {"format_version": 2, "rollout_id": rid, "rank": 0, "samples": samples, "dp_shards": dp,
            "raw_reward": raw_reward}


def write_slime_dump(root: Path, rid: int, rng, legacy: bool = False, n_groups: int = 2, group_size: int = 2):
    """--dump-details DIR: rollout_data/{rid}.pt and train_data/{rid}.pt (format_version 2; legacy:
    train_data/{rid}_{rank}.pt with the rank's rollout_data columns), all written with torch.save.

    The three ways to name a sample all differ, so that a wrong join shows: ``Sample.index`` counts on over the run
    (100 (rid + 1) + k for the k-th generated sample), the rollout dump lists the samples rotated by one
    (``rollout_position`` p holds generated sample p - 1), and the train dump lists them by rollout position, as
    slime sorts them (format_version 2), or by data-parallel rank (legacy).
    Returns the rollout samples in rollout order and the train samples in generation order."""
    samples, train = [], []
    for g in range(n_groups):
        rewards = rng.random(group_size).round(3)  # distinct rewards: a wrong join moves them
        adv = rewards - rewards.mean()
        for j in range(group_size):
            idx = 100 * (rid + 1) + g * group_size + j
            P, R = int(rng.integers(3, 6)), int(rng.integers(4, 9))
            tokens = rng.integers(0, 150_000, P + R).tolist()
            mask = [1] * R
            mask[1] = 0 if j == 1 else 1
            rlp = (-rng.exponential(1.0, R)).astype(np.float32)
            versions = ["default"] if rid == 0 else [str(rid - 1)] if j == 0 else [str(rid - 1), str(rid)]
            samples.append(slime_sample_to_dict(g, idx, tokens, R, float(rewards[j]), mask, versions,
                                                [float(x) for x in rlp]))
            train.append({"tokens": torch.tensor(tokens, dtype=torch.long), "response_lengths": R,
                          "total_lengths": P + R,
                          "loss_masks": torch.tensor(mask, dtype=torch.int), "rewards": float(adv[j]), "truncated": 0,
                          "rollout_log_probs": torch.tensor(rlp),
                          "log_probs": torch.tensor(rlp + rng.normal(0, 0.02, R).astype(np.float32)),
                          "ref_log_probs": torch.tensor(rlp), "advantages": torch.full((R,), float(adv[j])),
                          "returns": torch.full((R,), float(adv[j])), "sample_index": idx})
    perm = np.roll(np.arange(len(samples)), 1)
    samples = [samples[k] for k in perm]
    for pos, k in enumerate(perm):
        train[k]["rollout_position"] = pos
    (root / "rollout_data").mkdir(parents=True, exist_ok=True)
    (root / "train_data").mkdir(parents=True, exist_ok=True)
    torch.save({"rollout_id": rid, "samples": samples}, root / "rollout_data" / f"{rid}.pt")
    if legacy:  # utils/train_dump_utils.py at d38dc29c9: the rank's rollout_data as process_rollout_data left it
        n = len(train)
        cols = {k: [t[k] for t in train] for k in train[0] if k not in ("sample_index", "rollout_position")}
        cols["sample_indices"] = [t["sample_index"] for t in train]
        by_index = {s["index"]: s for s in samples}
        cols.update(rollout_ids=list(range(n)), source_names=["unknown"] * n,
                    rollout_mask_sums=torch.tensor([float(t["loss_masks"].sum()) for t in train]),
                    raw_reward=[s["reward"] for s in samples],  # the whole rollout's, shipped to every rank
                    local_raw_reward=[by_index[t["sample_index"]]["reward"] for t in train],
                    global_batch_sizes=[n], num_microbatches=[n], micro_batch_indices=[[i] for i in range(n)])
        torch.save({"rollout_id": rid, "rank": 0, "rollout_data": cols}, root / "train_data" / f"{rid}_0.pt")
    else:
        shards = [dict(t, data_parallel_rank=t["rollout_position"] % 2) for t in train]
        torch.save(slime_v2_payload(rid, shards, [s["reward"] for s in samples]), root / "train_data" / f"{rid}.pt")
    return samples, train


@pytest.mark.parametrize("legacy", [False, True])
def test_slime_dump_value_by_value(tmp_path, legacy):
    rng = np.random.default_rng(1)
    dump = tmp_path / "dump_details"
    made = {rid: write_slime_dump(dump, rid, rng, legacy=legacy) for rid in (0, 1)}
    log = RolloutLog(convert("slime", dump, tmp_path / "neutral"))
    tok, seq = _tables(tmp_path / "neutral")
    assert log.meta["source"] == "slime" and log.logp_columns == ["sampler_logp", "old_logp"]
    for rid, (samples, train) in made.items():
        for pos, s in enumerate(samples):
            t = next(t for t in train if t["sample_index"] == s["index"])
            assert legacy or t["rollout_position"] == pos != s["index"]
            sid = s["index"] if legacy else pos  # the legacy dump has no rollout positions
            R = s["response_length"]
            rows = tok[(tok["step"] == rid) & (tok["sample_id"] == sid)]
            np.testing.assert_array_equal(rows["position"], np.arange(R))
            np.testing.assert_array_equal(rows["token_id"], s["tokens"][-R:])
            np.testing.assert_array_equal(rows["loss_mask"], np.array(s["loss_mask"]) > 0)
            np.testing.assert_array_equal(rows["sampler_logp"].to_numpy(np.float32), t["rollout_log_probs"].numpy())
            np.testing.assert_array_equal(rows["old_logp"].to_numpy(np.float32), t["log_probs"].numpy())
            np.testing.assert_array_equal(rows["advantage"], t["advantages"].numpy())
            v = [0 if x == "default" else int(x) for x in s["weight_versions"]]
            if len(set(v)) == 1:
                assert (rows["version"] == v[0]).all()
            else:
                assert rows["version"].isna().all()
            r = seq[(seq["step"] == rid) & (seq["sample_id"] == sid)].iloc[0]
            assert (r["group_id"], r["reward"], r["response_length"]) == (s["group_index"], s["reward"], R)
            assert (r["version_min"], r["version_max"], r["trainer_version"]) == (min(v), max(v), rid)
            assert r["advantage"] == float(t["advantages"][0])
    assert len(seq) == sum(len(s) for s, _ in made.values())
    d = diagnose(log, progress=False)
    assert d.summary["staleness"]["max_lag"] == 1  # rollout 1 samples that began on version 0


def test_slime_refuses_unknown_classes_unless_trusted(tmp_path, capsys):
    import datetime

    rng = np.random.default_rng(2)
    dump = tmp_path / "dump"
    samples, _ = write_slime_dump(dump, 0, rng)
    samples[0]["metadata"] = {"started": datetime.datetime(2025, 1, 1)}
    torch.save({"rollout_id": 0, "samples": samples}, dump / "rollout_data" / "0.pt")
    assert main(["--from", "slime", str(dump)]) == 2
    err = capsys.readouterr().err
    assert "0.pt: holds objects of class datetime.datetime" in err and "--trust-pickle" in err
    assert main(["--from", "slime", str(dump), "--trust-pickle"]) == 0
    payload = torch.load(dump / "train_data" / "0.pt", weights_only=False)
    payload["samples"][2]["loss_masks"] = payload["samples"][2]["loss_masks"][:-1]
    torch.save(payload, dump / "train_data" / "0.pt")
    with pytest.raises(LabError, match=r"train_data/0.pt sample 2: 'loss_masks' has \d+ entries but response_lengths"):
        convert("slime", dump, tmp_path / "n", trust=True)
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize("edit,message", [
    (lambda s, r: s.__setitem__("tokens", [None] + s["tokens"].tolist()[1:]),
     "'tokens' entry 0 is None; expected an integer"),
    (lambda s, r: s.__setitem__("loss_masks", ["1"] * s["response_lengths"]),
     "'loss_masks' entry 0 is '1'; expected true/false"),
    (lambda s, r: s.__setitem__("advantages", ["high"] * s["response_lengths"]),
     "'advantages' entry 0 is 'high'; expected a number"),
    (lambda s, r: s.__setitem__("rollout_position", "first"), "needs integer 'response_lengths' and 'total_lengths'"),
    (lambda s, r: r[s["rollout_position"]].__setitem__("group_index", "g0"),
     "the rollout sample's 'group_index' is 'g0'"),
    (lambda s, r: s.__setitem__("sample_index", [1, 2]), "needs integer 'response_lengths' and 'total_lengths'"),
    (lambda s, r: s.__setitem__("rollout_position", 2**63), "sample id 9223372036854775808 is beyond 2^62"),
    (lambda s, r: s.__setitem__("log_probs", s["log_probs"].to(torch.complex64)),
     "'log_probs' is a torch.complex64 array; expected real numbers"),
    (lambda s, r: r[s["rollout_position"]].__setitem__("group_index", 2**70),
     "group_id 1180591620717411303424 is beyond 2^53"),
], ids=["null-token", "string-mask", "string-advantage", "string-position", "string-group", "list-index",
        "huge-position", "complex-log-probs", "huge-group"])
def test_slime_malformed_values_are_one_line(tmp_path, capsys, edit, message):
    dump = tmp_path / "dump"
    write_slime_dump(dump, 0, np.random.default_rng(6))
    train = torch.load(dump / "train_data" / "0.pt", weights_only=False)
    rollout = torch.load(dump / "rollout_data" / "0.pt", weights_only=False)
    edit(train["samples"][2], rollout["samples"])
    torch.save(train, dump / "train_data" / "0.pt")
    torch.save(rollout, dump / "rollout_data" / "0.pt")
    assert main(["--from", "slime", str(dump), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {dump / 'train_data' / '0.pt'} sample 2: {message}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dump"]


@pytest.mark.parametrize("index", [[1, 2], np.ones(2), "a", 1.5])
def test_slime_per_rank_sample_indices_must_be_integers(tmp_path, capsys, index):
    dump = tmp_path / "dump"
    write_slime_dump(dump, 0, np.random.default_rng(6), legacy=True)
    f = dump / "train_data" / "0_0.pt"
    train = torch.load(f, weights_only=False)
    train["rollout_data"]["sample_indices"][1] = index
    torch.save(train, f)
    assert main(["--from", "slime", str(dump), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {f} sample 1: 'sample_index' is ")
    assert err.endswith("expected an integer") and sorted(p.name for p in tmp_path.iterdir()) == ["dump"]


@pytest.mark.parametrize("version", [2**70, -2**70, 1e308, float("nan"), str(10**30), [1], np.ones(4)])
def test_slime_weight_versions_beyond_an_integer_are_unknown(tmp_path, version):
    dump = tmp_path / "dump"
    for rid in (0, 1):
        write_slime_dump(dump, rid, np.random.default_rng(8))
    f = dump / "rollout_data" / "1.pt"
    rollout = torch.load(f, weights_only=False)
    rollout["samples"][0]["weight_versions"] = version if isinstance(version, np.ndarray) else [version]
    torch.save(rollout, f)
    seq = RolloutLog(convert("slime", dump, tmp_path / "n")).sequences()
    assert seq["version_min"].isna().sum() == 1 and seq["version_max"].isna().sum() == 1


@pytest.mark.parametrize("steps", [1, 2])
def test_slime_rollouts_trained_in_several_optimizer_steps_carry_a_note(tmp_path, steps):
    """slime's dump (train_data_utils._build_dump_payload) keeps each rank's num_microbatches, one entry per optimizer
    step; with several, log_probs may come from the training forward after earlier updates (a note says when)."""
    dump = tmp_path / "dump"
    for rid in (0, 1):
        write_slime_dump(dump, rid, np.random.default_rng(9))
    f = dump / "train_data" / "1.pt"
    train = torch.load(f, weights_only=False)
    for shard in train["dp_shards"]:
        shard["num_microbatches"] = [1] * steps
    torch.save(train, f)
    notes = RolloutLog(convert("slime", dump, tmp_path / "n")).meta["notes"]
    found = [n for n in notes if "more than one optimizer step" in n]
    assert found == ([] if steps == 1 else [found[0]]) and (steps == 1 or found[0].startswith("1 of 2 rollouts"))


@pytest.mark.parametrize("version", [torch.ones(3, dtype=torch.bool), "2", 2.0, True, 3])
def test_slime_format_version_other_than_two_is_one_line(tmp_path, capsys, version):
    dump = tmp_path / "dump"
    write_slime_dump(dump, 0, np.random.default_rng(6))
    f = dump / "train_data" / "0.pt"
    train = torch.load(f, weights_only=False)
    train["format_version"] = version
    torch.save(train, f)
    assert main(["--from", "slime", str(dump), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {f}: format_version ") and "is not supported (2 is)" in err


def test_slime_truncated_file(tmp_path, capsys):
    dump = tmp_path / "dump"
    write_slime_dump(dump, 0, np.random.default_rng(7))
    f = dump / "train_data" / "0.pt"
    f.write_bytes(f.read_bytes()[:-100])
    assert main(["--from", "slime", str(dump)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{f}: not a readable torch.save file, truncated or corrupt?" in err


# ------------------------------------------------------------------------------------------------ SkyRL
def _save_bytes(t):
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _encode_new(t):
    if t is None:
        return None
    if isinstance(t, list):  # TensorList (multimodal inputs, 92764a752)
        return {"format": "tensor_list", "items": [_encode_new(x) for x in t]}
    try:
        arr = t.numpy()
        return {"format": "numpy", "data": arr.tobytes(), "shape": arr.shape, "dtype": str(arr.dtype)}
    except TypeError:  # bfloat16
        return {"format": "torch", "data": _save_bytes(t)}


def skyrl_module(monkeypatch, new: bool):
    """A stand-in for SkyRL's training_batch module that pickles exactly as SkyRL's TensorBatch does: earlier
    releases a dict subclass with __getstate__ (torch.save bytes per key; pickle also carries the dict items),
    later releases __reduce__ -> (_rebuild_tensor_batch, (cls, state)) with numpy-encoded tensors."""
    name = "skyrl.backends.skyrl_train.training_batch" if new else "skyrl_train.training_batch"
    mod = types.ModuleType(name)

    class TrainingInputBatch(dict):
        metadata = None

        def __getstate__(self):
            enc = _encode_new if new else (lambda v: None if v is None else _save_bytes(v))
            return {"batch_dict": {k: enc(v) for k, v in self.items()}, "batch_size": len(next(iter(self.values()))),
                    "device": torch.device("cpu"), "metadata": self.metadata}

        if new:
            def __reduce__(self):
                return (mod._rebuild_tensor_batch, (type(self), self.__getstate__()))

    def _rebuild_tensor_batch(cls, state):
        raise AssertionError("never called when the lab reads a dump")

    TrainingInputBatch.__module__ = name
    TrainingInputBatch.__qualname__ = "TrainingInputBatch"
    _rebuild_tensor_batch.__module__ = name
    _rebuild_tensor_batch.__qualname__ = "_rebuild_tensor_batch"
    mod.TrainingInputBatch, mod._rebuild_tensor_batch = TrainingInputBatch, _rebuild_tensor_batch
    for parent in ("skyrl", "skyrl.backends", "skyrl.backends.skyrl_train") if new else ("skyrl_train",):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, name, mod)
    return TrainingInputBatch


def save_skyrl(folder: Path, batch, step: int) -> Path:
    """``folder``/dumped_data/global_step_{step}_training_input.pkl, pickled as TensorBatch.save does; the folder."""
    d = folder / "dumped_data"
    d.mkdir(exist_ok=True)
    with open(d / f"global_step_{step}_training_input.pkl", "wb") as f:
        pickle.dump(batch, f)
    return d


def hide_skyrl(monkeypatch) -> None:
    """Undo the stand-in and hide any SkyRL module another test imported (restored at teardown): the lab reads
    SkyRL's dumps without SkyRL."""
    monkeypatch.undo()
    for name in [m for m in sys.modules if m.split(".")[0] in ("skyrl", "skyrl_train")]:
        monkeypatch.delitem(sys.modules, name)
    assert "skyrl_train" not in sys.modules and "skyrl" not in sys.modules


def skyrl_batch(cls, rng, B=5, P=4, R=6, pad_rows=1):
    lengths = rng.integers(2, R + 1, B - pad_rows)
    resp_mask = np.zeros((B, R), np.int64)
    for b, n in enumerate(lengths):
        resp_mask[b, :n] = 1
    loss = resp_mask.copy()
    loss[0, 1] = 0  # a masked-out position inside a response
    roll = np.where(resp_mask > 0, -rng.exponential(1.0, (B, R)), 0.0).astype(np.float32)
    act = np.where(resp_mask > 0, roll + rng.normal(0, 0.05, (B, R)), 0.0).astype(np.float32)
    adv = np.repeat(rng.normal(size=(B, 1)), R, 1).astype(np.float32) * resp_mask
    rewards = np.zeros((B, R), np.float32)
    for b, n in enumerate(lengths):
        rewards[b, n - 1] = float(rng.integers(0, 2))
    seqs = rng.integers(1, 100, (B, P + R))
    batch = cls({"sequences": torch.tensor(seqs), "attention_mask": torch.ones(B, P + R, dtype=torch.long),
                 "response_mask": torch.tensor(resp_mask), "loss_mask": torch.tensor(loss),
                 "action_log_probs": torch.tensor(act), "base_action_log_probs": torch.tensor(act),
                 "values": None, "returns": torch.tensor(adv), "advantages": torch.tensor(adv),
                 "rollout_logprobs": torch.tensor(roll), "rewards": torch.tensor(rewards)})
    batch.metadata = {"response_length": R, "policy_prompt_boundaries": [(0, 2), (2, B - pad_rows)],
                      "pad_size": pad_rows, "avg_response_length": float(lengths.mean())}
    return batch


@pytest.mark.parametrize("new", [False, True])
def test_skyrl_dump_value_by_value(tmp_path, monkeypatch, new):
    rng = np.random.default_rng(3)
    cls = skyrl_module(monkeypatch, new)
    d = tmp_path / "export" / "dumped_data"
    d.mkdir(parents=True)
    batches = {}
    for step in (1, 2):
        batches[step] = skyrl_batch(cls, rng)
        with open(d / f"global_step_{step}_training_input.pkl", "wb") as f:  # TensorBatch.save
            pickle.dump(batches[step], f)
    hide_skyrl(monkeypatch)  # SkyRL is not importable while the lab reads its dumps
    log = RolloutLog(convert("skyrl", tmp_path / "export", tmp_path / "neutral"))
    tok, seq = _tables(tmp_path / "neutral")
    assert log.meta["source"] == "skyrl"
    assert log.meta["notes"] == ["2 padding rows (SkyRL's pad_size, added to fill the data-parallel ranks) skipped"]
    k = 0
    for step, batch in batches.items():
        R = batch["loss_mask"].shape[1]
        for b in range(batch["loss_mask"].shape[0]):
            mask = batch["loss_mask"][b].numpy() > 0
            if not mask.any():
                continue
            n = int(np.flatnonzero(batch["response_mask"][b].numpy() | mask)[-1]) + 1
            rows = tok[(tok["step"] == step) & (tok["sample_id"] == b)]
            np.testing.assert_array_equal(rows["position"], np.arange(n))
            np.testing.assert_array_equal(rows["token_id"], batch["sequences"][b, -R:][:n].numpy())
            np.testing.assert_array_equal(rows["loss_mask"], mask[:n])
            np.testing.assert_array_equal(rows["sampler_logp"].to_numpy(np.float32),
                                          batch["rollout_logprobs"][b, :n].numpy())
            np.testing.assert_array_equal(rows["old_logp"].to_numpy(np.float32),
                                          batch["action_log_probs"][b, :n].numpy())
            np.testing.assert_array_equal(rows["advantage"].to_numpy(np.float32), batch["advantages"][b, :n].numpy())
            r = seq.iloc[k]
            assert (r["step"], r["sample_id"], r["group_id"]) == (step, b, 0 if b < 2 else 1)
            assert r["reward"] == pytest.approx(float(batch["rewards"][b].sum()))
            assert r["origin"] == f"{d / f'global_step_{step}_training_input.pkl'} row {b}"
            k += 1
    assert len(seq) == k


def test_skyrl_unpickling_runs_no_code(tmp_path, monkeypatch, capsys):
    cls = skyrl_module(monkeypatch, False)
    batch = skyrl_batch(cls, np.random.default_rng(4))
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    batch.metadata["note"] = Payload()
    d = save_skyrl(tmp_path, batch, 1)
    monkeypatch.undo()
    assert main(["--from", "skyrl", str(d), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "global_step_1_training_input.pkl: the pickle references pathlib" in err and "not loaded" in err
    assert not marker.exists() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("metadata", [torch.ones(3), None, "meta", [1, 2]])
def test_skyrl_metadata_that_is_not_a_dict_is_read_as_absent(tmp_path, monkeypatch, metadata):
    """SkyRL's metadata only adds group ids (prompt boundaries or uids): anything but a dict is read as none."""
    cls = skyrl_module(monkeypatch, True)
    batch = skyrl_batch(cls, np.random.default_rng(5))
    batch.metadata = metadata
    d = save_skyrl(tmp_path, batch, 3)
    with open(tmp_path / "global_step_3_training_input.pkl", "wb") as f:  # the same batch with its metadata
        batch.metadata = skyrl_batch(cls, np.random.default_rng(5)).metadata
        pickle.dump(batch, f)
    monkeypatch.undo()
    tok, seq = _tables(convert("skyrl", d, tmp_path / "n"))
    (tmp_path / "with_meta").mkdir()
    (tmp_path / "global_step_3_training_input.pkl").rename(tmp_path / "with_meta" / "global_step_3_training_input.pkl")
    tok_m, seq_m = _tables(convert("skyrl", tmp_path / "with_meta", tmp_path / "m"))
    assert seq["group_id"].isna().all() and seq_m["group_id"].notna().any()
    m, m_m = tok[tok["loss_mask"]], tok_m[tok_m["loss_mask"]]
    for col in ("step", "sample_id", "position", "sampler_logp", "old_logp"):
        np.testing.assert_array_equal(m[col].to_numpy(), m_m[col].to_numpy())


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool])
def test_skyrl_log_probs_that_are_not_real_numbers_are_one_line(tmp_path, monkeypatch, capsys, dtype):
    cls = skyrl_module(monkeypatch, True)
    batch = skyrl_batch(cls, np.random.default_rng(5))
    batch["rollout_logprobs"] = batch["rollout_logprobs"].to(dtype)
    d = save_skyrl(tmp_path, batch, 3)
    monkeypatch.undo()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["--from", "skyrl", str(d), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {d / 'global_step_3_training_input.pkl'}: 'rollout_logprobs' is a {dtype} tensor; "
                   f"expected real numbers\n")


def test_skyrl_shapes_must_match(tmp_path, monkeypatch):
    cls = skyrl_module(monkeypatch, True)
    batch = skyrl_batch(cls, np.random.default_rng(5))
    batch["rollout_logprobs"] = batch["rollout_logprobs"][:, :-1]
    d = save_skyrl(tmp_path, batch, 3)
    monkeypatch.undo()
    with pytest.raises(LabError, match=r"global_step_3_training_input.pkl: 'rollout_logprobs' has shape \(5, 5\) but "
                                       r"'loss_mask' has \(5, 6\)"):
        convert("skyrl", d, tmp_path / "n")


def test_an_error_quoting_a_multi_line_value_is_one_line(tmp_path, monkeypatch, capsys):
    cls = skyrl_module(monkeypatch, True)
    batch = skyrl_batch(cls, np.random.default_rng(5))
    batch.metadata["policy_prompt_boundaries"] = [torch.zeros(3, 2)]  # its repr spans three lines
    d = save_skyrl(tmp_path, batch, 3)
    monkeypatch.undo()
    assert main(["--from", "skyrl", str(d), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    f = d / "global_step_3_training_input.pkl"
    assert err.count("\n") == 1
    assert err.startswith(f"error: {f}: metadata 'policy_prompt_boundaries' entry 0 is tensor([[0., 0.], [0., 0.],")


@pytest.mark.parametrize("bounds,message", [
    ([(0, 2), ("two", 4)], "entry 1 is ('two', 4); expected (start, end)"),
    ([(0, 2), (3,)], "entry 1 is (3,); expected (start, end)"),
    ([(0, 2), None], "entry 1 is None; expected (start, end)"),
    ([(3, 1)], "entry 0 is (3, 1); expected 0 <= start <= end"),
])
def test_skyrl_malformed_prompt_boundaries(tmp_path, monkeypatch, capsys, bounds, message):
    cls = skyrl_module(monkeypatch, True)
    batch = skyrl_batch(cls, np.random.default_rng(8))
    batch.metadata["policy_prompt_boundaries"] = bounds
    d = save_skyrl(tmp_path, batch, 2)
    monkeypatch.undo()
    assert main(["--from", "skyrl", str(d), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {d / 'global_step_2_training_input.pkl'}: metadata 'policy_prompt_boundaries' "
                   f"{message}")
    assert not (tmp_path / "run").exists()


def test_unknown_format_is_one_line(capsys, tmp_path):
    assert main(["--from", "verl", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    from lab.diagnose.adapters import FORMATS

    assert err == f"error: unknown log format 'verl' for --from; known formats: {', '.join(FORMATS)}"
    assert set(FORMATS) == {"lab", "prime-rl", "slime", "skyrl", "nemo-rl"}
