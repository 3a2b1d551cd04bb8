"""Dumps built the way each framework's writing code builds them, version by version and layout by layout (the code
restated from slime, SkyRL, prime-rl and NeMo-RL at the commits named in the adapters' docstrings): the converted
log's loss-masked tokens, log-probs, lengths, positions, groups and staleness equal the framework's own, and the
headline numbers equal an independent computation."""
from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
import torch

from lab.diagnose import RolloutLog, diagnose
from lab.diagnose.adapters import convert, detect
from lab.diagnose.cli import main
from test_diagnose_adapters import _tables, hide_skyrl, skyrl_module, slime_sample_to_dict, slime_v2_payload


# ------------------------------------------------------------------------------------------------ slime
def slime_rollout(rng, rid: int, version: int, n: int = 4, group_size: int = 2):
    """Samples of one rollout generated on SGLang weight version ``version`` (Sample.to_dict) and the trainer's
    per-sample fields (the train dump's columns) for them."""
    samples, train = [], []
    for k in range(n):
        P, R = int(rng.integers(2, 5)), int(rng.integers(3, 8))
        tokens = rng.integers(0, 1000, P + R).tolist()
        rlp = (-rng.exponential(1.0, R)).astype(np.float32)
        samples.append(slime_sample_to_dict(k // group_size, 1000 * rid + k, tokens, R, float(k % 2), [1] * R,
                                            [str(version)], rlp.tolist()))
        train.append({"tokens": torch.tensor(tokens), "response_lengths": R, "total_lengths": P + R,
                      "loss_masks": torch.ones(R, dtype=torch.int), "rewards": float(k % 2),
                      "rollout_log_probs": torch.tensor(rlp),
                      "log_probs": torch.tensor(rlp + rng.normal(0, 0.02, R).astype(np.float32)),
                      "advantages": torch.zeros(R), "sample_index": 1000 * rid + k})
    return samples, train


def save_v2(folder, name, rid, train):
    """observability/train_data_utils.py: one file per rollout from the DP source rank, samples in rollout order
    (slime_v2_payload: _build_dump_payload's layout at 624b824a8)."""
    samples = [dict(t, data_parallel_rank=0, rollout_position=i) for i, t in enumerate(train)]
    torch.save(slime_v2_payload(rid, samples, [t["rewards"] for t in train]), folder / name)


@pytest.mark.parametrize("script,resume,interval", [("train.py", None, 1), ("train.py", 5, 1),
                                                     ("train_async.py", None, 1), ("train_async.py", None, 3),
                                                     ("train_async.py", 5, 2)])
@pytest.mark.slow
def test_slime_staleness_follows_weight_pushes(tmp_path, script, resume, interval):
    """train.py and train_async.py as written: one push before the loop, counted from 0 in each process; train.py
    generates rollout k, trains on it, pushes; train_async.py launches generate(k + 1) at the top of iteration k,
    trains on k, and pushes when (k + 1) % --update-weights-interval == 0. The lag of rollout k is the rollouts the
    trainer has trained minus those it had trained when it pushed the weights that generated k: 0 for train.py
    (fresh or resumed at rollout 5), 1 for train_async.py after its first rollout, 1..N with an interval of N."""
    rng = np.random.default_rng(0)
    dump = tmp_path / "dump"
    (dump / "train_data").mkdir(parents=True)
    (dump / "rollout_data").mkdir()
    segments = [range(0, 4), range(resume, resume + 7)] if resume else [range(0, 9)]
    want = {}
    for seg in segments:
        pushes, trained_at = 1, {1: 0}  # actor_model.update_weights() before the loop
        gen = {seg.start: pushes}  # train_async.py: generate(start) is launched before the loop
        for k in seg:
            if script == "train.py":
                gen[k] = pushes
            else:
                gen[k + 1] = pushes  # generate(k + 1) launched before training on k
            samples, train = slime_rollout(rng, k, gen[k])
            torch.save({"rollout_id": k, "samples": samples}, dump / "rollout_data" / f"{k}.pt")
            save_v2(dump / "train_data", f"{k}.pt", k, train)
            want[k] = (k - seg.start) - trained_at[gen[k]]
            if script == "train.py" or (k + 1) % interval == 0:  # update_weights() after training on k
                pushes += 1
                trained_at[pushes] = k - seg.start + 1
    log = RolloutLog(convert("slime", dump, tmp_path / "log"))
    d = diagnose(log, progress=False)
    _, seq = _tables(tmp_path / "log")
    got = (seq["trainer_version"] - seq["version_min"]).groupby(seq["step"]).agg(["min", "max"])
    assert got["min"].to_dict() == want and got["max"].to_dict() == want
    assert d.summary["staleness"]["max_lag"] == max(want.values())
    assert any("--update-weights-interval" in n for n in log.meta["notes"]) == (interval > 1)


def test_slime_dump_beginning_mid_run_with_partial_rollouts(tmp_path):
    """--partial-rollout: a sample aborted in rollout k - 1 resumes in rollout k, so its weight_versions span two
    pushes ([v - 1, v]) while the fresh samples carry [v]. A dump kept from rollout 4 of a train.py run (versions
    5, 6): the fresh samples are on-policy, the carried ones one version behind (never lag -1)."""
    rng = np.random.default_rng(11)
    dump = tmp_path / "dump"
    (dump / "train_data").mkdir(parents=True)
    (dump / "rollout_data").mkdir()
    want = {}
    for k in (4, 5):
        samples, train = slime_rollout(rng, k, k + 1)
        samples[0]["weight_versions"] = [str(k), str(k + 1)]  # carried over from rollout k - 1
        torch.save({"rollout_id": k, "samples": samples}, dump / "rollout_data" / f"{k}.pt")
        save_v2(dump / "train_data", f"{k}.pt", k, train)
        want[k] = [1] + [0] * (len(samples) - 1)
    log = RolloutLog(convert("slime", dump, tmp_path / "log"))
    _, seq = _tables(log.path)
    for k, lags in want.items():
        sel = seq[seq["step"] == k].sort_values("sample_id")
        assert (sel["trainer_version"] - sel["version_min"]).tolist() == lags
    assert any("mid-run" in n for n in log.meta["notes"])


def per_rank_dump(tmp_path, rng, n: int):
    """A --dump-details folder with rollout 0's rollout dump written; its per-rank train files are the caller's."""
    dump = tmp_path / "dump"
    (dump / "train_data").mkdir(parents=True)
    (dump / "rollout_data").mkdir()
    samples, train = slime_rollout(rng, 0, 1, n=n)
    torch.save({"rollout_id": 0, "samples": samples}, dump / "rollout_data" / "0.pt")
    return dump, samples, train


def test_slime_per_rank_dumps_of_a_tp_pp_dp_run(tmp_path):
    """Before 2026-08 every rank wrote train_data/{rid}_{rank}.pt: TP ranks identical files, first pipeline stage
    without log_probs; DP shards disjoint. The log holds each sample once, with the last stage's log-probs."""
    dump, samples, train = per_rank_dump(tmp_path, np.random.default_rng(1), n=6)
    tp, pp, dp = 2, 2, 2
    for rank in range(tp * pp * dp):  # Megatron's rank order: tp fastest, then dp, then pp
        d_rank, p_rank = (rank // tp) % dp, rank // (tp * dp)  # the tensor-parallel rank does not change the file
        shard = [t for i, t in enumerate(train) if i % dp == d_rank]
        cols = {k: [t[k] for t in shard] for k in shard[0] if k != "sample_index"}
        cols["sample_indices"] = [t["sample_index"] for t in shard]
        cols["raw_reward"] = [s["reward"] for s in samples]  # shipped whole to every rank
        if p_rank < pp - 1:
            del cols["log_probs"]  # compute_log_prob stores them on the last stage only
        torch.save({"rollout_id": 0, "rank": rank, "rollout_data": cols}, dump / "train_data" / f"0_{rank}.pt")
    log = RolloutLog(convert("slime", dump, tmp_path / "log"))
    tok, seq = _tables(tmp_path / "log")
    assert sorted(seq["sample_id"]) == sorted(t["sample_index"] for t in train)
    for t in train:
        rows = tok[tok["sample_id"] == t["sample_index"]]
        np.testing.assert_array_equal(rows["old_logp"].to_numpy(np.float32), t["log_probs"].numpy())
        np.testing.assert_array_equal(rows["position"], np.arange(t["response_lengths"]))
    assert log.n_token_rows == sum(t["response_lengths"] for t in train)
    for rank in (4, 5, 6, 7):  # only first-stage files left: refused, one line naming the field
        (dump / "train_data" / f"0_{rank}.pt").unlink()
    assert main(["--from", "slime", str(dump), "--out", str(tmp_path / "run")]) == 2
    assert not (tmp_path / "run").exists()


def test_slime_fsdp_backend_dumps_hold_no_trainer_log_probs(tmp_path, capsys):
    """fsdp_utils/actor.py (fd6ebde2a .. e4faf6330): train_dump_utils.save_debug_train_data(rollout_data) per rank,
    one file per data-parallel rank, while _compute_log_prob stores log_probs in the packed batches only."""
    dump, samples, train = per_rank_dump(tmp_path, np.random.default_rng(10), n=4)
    for rank in range(2):
        shard = train[rank::2]
        cols = {k: [t[k] for t in shard] for k in shard[0] if k not in ("sample_index", "log_probs")}
        cols["returns"] = cols["advantages"]
        torch.save({"rollout_id": 0, "rank": rank, "rollout_data": cols}, dump / "train_data" / f"0_{rank}.pt")
    assert main(["--from", "slime", str(dump), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "0_0.pt, 0_1.pt" in err and "FSDP" in err
    assert not (tmp_path / "run").exists()


def test_slime_save_debug_train_data_layout(tmp_path, capsys):
    """--save-debug-train-data /x/train_{rollout_id}.pt and --save-debug-rollout-data /x/data_{rollout_id}.pt,
    as slime's docs show them: files recognised by content."""
    rng = np.random.default_rng(2)
    folder = tmp_path / "debug"
    folder.mkdir()
    for k in (0, 1):
        samples, train = slime_rollout(rng, k, k + 1)
        torch.save({"rollout_id": k, "samples": samples}, folder / f"data_{k}.pt")
        save_v2(folder, f"train_{k}.pt", k, train)
    assert main(["--from", "slime", str(folder)]) == 0
    _, seq = _tables(RolloutLog(convert("slime", folder, tmp_path / "log")).path)
    assert (seq["trainer_version"] == seq["version_min"]).all() and seq["group_id"].notna().all()


@pytest.mark.parametrize("layout", ["dump_details", "templates"])
def test_slime_evaluation_rollout_dumps_are_not_training_rollouts(tmp_path, layout):
    """RolloutManager.eval (48c16f123, 2025-10; observability/rollout_data_utils.py since 624b824a8) saves its
    samples through the same template with rollout_id "eval_{rollout_id}": rollout_data/eval_0.pt beside
    rollout_data/0.pt, as train.py evaluates before rollout 0 and every --eval-interval rollouts."""
    rng = np.random.default_rng(8)
    folder = tmp_path / "dump"
    names = {"dump_details": ("rollout_data/{}.pt", "train_data/{}.pt"),
             "templates": ("data_{}.pt", "train_{}.pt")}[layout]
    for sub in ("rollout_data", "train_data") if layout == "dump_details" else ("",):
        (folder / sub).mkdir(parents=True, exist_ok=True)
    want = {}
    for k in range(3):
        samples, train = slime_rollout(rng, k, k + 1)
        torch.save({"rollout_id": k, "samples": samples}, folder / names[0].format(k))
        save_v2(folder, names[1].format(k), k, train)
        want[k] = [(s["group_index"], s["reward"]) for s in samples]
        if k % 2 == 0:  # an evaluation: other prompts, other rewards, an older weight version
            ev, _ = slime_rollout(rng, k, 0, n=6, group_size=3)
            ev = [dict(e, group_index=e["group_index"] + 50, reward=0.25) for e in ev]
            torch.save({"rollout_id": k, "samples": ev}, folder / names[0].format(f"eval_{k}"))
    log = RolloutLog(convert("slime", folder, tmp_path / "log"))
    _, seq = _tables(log.path)
    for k, rows in want.items():
        sel = seq[seq["step"] == k].sort_values("sample_id")
        assert list(zip(sel["group_id"], sel["reward"])) == rows
        assert (sel["version_min"] == k + 1).all() and (sel["trainer_version"] == k + 1).all()


def test_slime_reward_picked_by_reward_key(tmp_path):
    """A reward model returning several rewards: Sample.reward is a dict and slime trains on
    reward[--reward-key] (Sample.get_reward_value); the train dump carries that pick per sample as
    local_raw_reward (utils/data.py process_rollout_data, c1dd9ab24)."""
    rng = np.random.default_rng(9)
    folder = tmp_path / "debug"
    folder.mkdir()
    samples, train = slime_rollout(rng, 0, 1)
    picked = [float(k % 2) for k in range(len(samples))]
    samples = [dict(s, reward={"acc": r, "format": 0.5}) for s, r in zip(samples, picked)]
    torch.save({"rollout_id": 0, "samples": samples}, folder / "data_0.pt")
    save_v2(folder, "train_0.pt", 0, [dict(t, local_raw_reward=r) for t, r in zip(train, picked)])
    _, seq = _tables(RolloutLog(convert("slime", folder, tmp_path / "log")).path)
    assert seq.sort_values("sample_id")["reward"].tolist() == picked


# ------------------------------------------------------------------------------------------------ SkyRL
def skyrl_tensors(prompts, responses, loss_masks, logprobs, right_aligned: bool):
    """convert_prompts_responses_to_batch_tensors: since b059319cf one left-padded block per row with right-aligned
    response tensors; before it, left-padded prompts, right-padded responses starting at column 0."""
    B = len(prompts)
    R = max(len(r) for r in responses)
    if right_aligned:
        total = max(len(p) + len(r) for p, r in zip(prompts, responses))
        seqs = np.zeros((B, total), np.int64)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            seqs[i, total - len(p) - len(r):] = p + r
    else:
        P = max(len(p) for p in prompts)
        seqs = np.zeros((B, P + R), np.int64)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            seqs[i, P - len(p):P] = p
            seqs[i, P:P + len(r)] = r
    out = {k: np.zeros((B, R), np.float32) for k in ("response_mask", "loss_mask", "rollout_logprobs")}
    for i, r in enumerate(responses):
        cols = slice(R - len(r), R) if right_aligned else slice(0, len(r))
        out["response_mask"][i, cols] = 1
        out["loss_mask"][i, cols] = loss_masks[i]
        out["rollout_logprobs"][i, cols] = logprobs[i]
    return seqs, out


@pytest.mark.parametrize("version", ["2026-02", "2026-04", "2026-07", "2026-08"])
def test_skyrl_dump_versions(tmp_path, monkeypatch, version):
    rng = np.random.default_rng(3)
    new = version != "2026-02"
    cls = skyrl_module(monkeypatch, new)
    uids = ["p0", "p0", "p1", "p1", "p2"]
    prompts = [rng.integers(1, 99, int(rng.integers(2, 6))).tolist() for _ in uids]
    responses = [rng.integers(1, 99, int(rng.integers(2, 9))).tolist() for _ in uids]
    masks = [[1] * len(r) for r in responses]
    masks[1][1] = 0  # a tool output inside a response
    masks[3] = [0] * len(responses[3])  # a response the loss leaves out entirely (not padding)
    lps = [(-rng.exponential(1.0, len(r))).astype(np.float32) for r in responses]
    seqs, t = skyrl_tensors(prompts, responses, masks, lps, right_aligned=new)
    act = np.where(t["response_mask"] > 0, t["rollout_logprobs"] + rng.normal(0, 0.05, t["loss_mask"].shape), 0)
    fields = {"sequences": torch.tensor(seqs), "response_mask": torch.tensor(t["response_mask"]).long(),
              "loss_mask": torch.tensor(t["loss_mask"]), "rollout_logprobs": torch.tensor(t["rollout_logprobs"]),
              "action_log_probs": torch.tensor(act.astype(np.float32)),
              "advantages": torch.tensor(t["response_mask"])}
    pad = 1  # pad_training_input_batch: copies of row 0 with a zero loss mask
    fields = {k: torch.cat([v, v[:1] * (0 if k == "loss_mask" else 1)]) for k, v in fields.items()}
    batch = cls(fields)
    meta = {"response_length": t["loss_mask"].shape[1], "pad_size": pad}
    if version >= "2026-07":
        meta["policy_prompt_boundaries"] = [(0, 2), (2, 4), (4, 5)]
    if version == "2026-08":  # router replay (R3) and multimodal inputs ride along: per-token uint8 routes
        B, S = seqs.shape[0] + pad, seqs.shape[1]
        batch["rollout_expert_indices"] = torch.zeros(B, S, 3, 2, dtype=torch.uint8)
        batch["router_padding_mask"] = torch.zeros(B, S, dtype=torch.bool)
        batch["pixel_values"] = [torch.zeros(int(rng.integers(1, 4)), 8, dtype=torch.bfloat16) for _ in range(B)]
    batch.metadata = meta  # uids and rewards popped before the dump
    d = tmp_path / "export" / "dumped_data"
    d.mkdir(parents=True)
    with open(d / "global_step_3_training_input.pkl", "wb") as f:
        pickle.dump(batch, f)
    hide_skyrl(monkeypatch)
    log = RolloutLog(convert("skyrl", tmp_path / "export", tmp_path / "log"))
    tok, seq = _tables(log.path)
    assert list(seq["sample_id"]) == [0, 1, 2, 3, 4] and list(seq["response_length"]) == [len(r) for r in responses]
    for b, r in enumerate(responses):
        rows = tok[tok["sample_id"] == b]
        np.testing.assert_array_equal(rows["token_id"], r)
        np.testing.assert_array_equal(rows["position"], np.arange(len(r)))
        np.testing.assert_array_equal(rows["loss_mask"], np.array(masks[b]) > 0)
        np.testing.assert_array_equal(rows["sampler_logp"].to_numpy(np.float32), lps[b])
    groups = seq["group_id"].tolist()
    assert groups == ([0, 0, 1, 1, 2] if version >= "2026-07" else [None] * 5) or (
        version < "2026-07" and seq["group_id"].isna().all())
    assert seq["reward"].isna().all()
    diag = diagnose(log, progress=False)
    m = np.concatenate([np.array(x) > 0 for x in masks])
    delta = np.concatenate([act[b][t["response_mask"][b] > 0].astype(np.float32) - lps[b] for b in range(5)])
    assert diag.tables["overall"].set_index("pair").loc["mismatch", "mean_abs"] == pytest.approx(
        np.abs(delta[m].astype(np.float64)).mean(), rel=1e-9)


# ------------------------------------------------------------------------------------------------ prime-rl
def test_prime_rl_distillation_tokens_leave_the_loss_mask(tmp_path):
    """rl/train.py: mismatch metrics on loss_mask & (rl_weights != 0 | ref_kl_weights != 0); ce tokens keep
    loss_mask true but carry a frozen model's tokens. Older exports: training_mode == "sft" records."""
    rng = np.random.default_rng(4)
    d = tmp_path / "out" / "token_exports" / "step_1"
    d.mkdir(parents=True)
    recs, sampled = [], []
    for i in range(4):
        n = 12
        loss = np.r_[np.zeros(3, bool), np.ones(n - 3, bool)]
        ce = np.zeros(n) if i % 2 == 0 else np.r_[np.zeros(7), np.ones(n - 7)]  # distilled tail
        rl = np.where(loss & (ce == 0), 1.0, 0.0)
        inf = -rng.exponential(1.0, n)
        tr = inf + np.where(ce > 0, rng.normal(0, 2.0, n), rng.normal(0, 0.03, n))
        f32 = lambda x: np.asarray(x, np.float32).astype(float).tolist()  # noqa: E731
        recs.append({"schema_version": 1, "step": 1, "export_step": 1, "rank": 0, "micro_step": 0,
                     "micro_sequence_idx": i, "export_sequence_idx": i, "run_id": None, "env_name": "x",
                     "token_ids": list(range(n)), "position_ids": list(range(n)), "loss_mask": loss.tolist(),
                     "advantages": [0.5] * n, "inference_logprobs": f32(inf), "trainer_logprobs": f32(tr),
                     "entropy": [1.0] * n, "rl_weights": rl.tolist(), "ce_weights": ce.tolist(),
                     "ref_kl_weights": [None] * n})
        sampled.append((np.float32(tr) - np.float32(inf))[loss & (rl != 0)])
    recs.append(dict(recs[0], training_mode="sft", micro_sequence_idx=9, rl_weights=[None] * 12,
                     ce_weights=[None] * 12))
    (d / "rank_0.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    log = RolloutLog(convert("prime-rl", tmp_path / "out", tmp_path / "log"))
    diag = diagnose(log, progress=False)
    want = np.abs(np.concatenate(sampled).astype(np.float64))
    assert diag.tables["overall"].set_index("pair").loc["mismatch", "mean_abs"] == pytest.approx(want.mean(), 1e-9)
    assert any("cross-entropy" in n for n in log.meta["notes"])
    k3 = np.expm1(np.concatenate(sampled).astype(np.float64)) - np.concatenate(sampled)
    dash = diag.tables["dashboards"].set_index("metric")["value"]
    assert dash["mismatch_kl/all/mean"] == pytest.approx(k3.mean(), rel=1e-9)


# ------------------------------------------------------------------------------------------------ NeMo-RL
def nemo_rl_log(folder, step, rng, B=6, G=2, force_on_policy=False, token_ids=True, fields=None,
                dynamic_sampling=False):
    """grpo.py's training-data log (f11f99c79 and later; grpo_sync.py without token_ids when it did not stash
    them): B samples, G generations per prompt (repeat_interleave), right-padded to the batch's longest;
    Logger.log_batched_dict_as_jsonl writes json.dumps({**batch.slice(i, i + 1), "idx": i}, default=str), so each
    value is the batch's, sliced to a one-element list. force_on_policy: prev_logprobs = zeros_like(generation_
    logprobs) (e7266a92f). ``fields``: only those keys (earlier releases). ``content`` is the flattened message log's
    text per message (llm_message_utils.message_log_to_flat_messages, NeMo-RL 7ea279abf). ``dynamic_sampling``
    (grpo.use_dynamic_sampling): ``filtered_rewards`` holds each sample's reward and ``rewards`` the first B rewards of
    the unfiltered batch (grpo.py dynamic_sampling sets the kept rows' total_reward to the pre-filter tensor and
    slices it to the train size, 7ea279abf)."""
    prompts = [rng.integers(0, 999, int(rng.integers(2, 6))) for _ in range(B // G)]
    prompts[-1] = prompts[0].copy()  # the same prompt drawn twice: NeMo-RL's baseline pools them
    lens, rows = [], []
    for i in range(B):
        p, r = prompts[i // G], rng.integers(0, 999, int(rng.integers(2, 9)))
        rows.append((p, r))
        lens.append(len(p) + len(r))
    S = max(lens) + 1  # make_sequence_length_divisible_by rounds up
    tok_mask, ids = np.zeros((B, S), int), np.zeros((B, S), int)
    for i, (p, r) in enumerate(rows):
        ids[i, :lens[i]] = np.r_[p, r]
        tok_mask[i, len(p):lens[i]] = 1
        if i == 1:
            tok_mask[i, len(p) + 1] = 0  # a tool output inside the response
    gen = np.where(tok_mask > 0, -rng.exponential(1.0, (B, S)), 0.0).astype(np.float32)
    prev = np.where(tok_mask > 0, gen + rng.normal(0, 0.05, (B, S)), 0.0).astype(np.float32)
    sample_mask = np.ones(B, np.float32)
    sample_mask[2] = 0.0  # loss_multiplier: truncated
    content = [[f"prompt {i // G}", "[" * 100 * (i == 0)] for i in range(B)]  # brackets in a string are not nesting
    data = {"content": content, "rewards": rng.random(B).tolist(),
            "input_lengths": lens, "token_ids": ids.tolist(), "token_loss_mask": tok_mask.tolist(),
            "sample_loss_mask": sample_mask.tolist(), "advantages": np.repeat(rng.normal(size=(B, 1)), S, 1).tolist(),
            "generation_logprobs": gen.tolist(), "prev_logprobs": (0 * prev if force_on_policy else prev).tolist()}
    if dynamic_sampling:  # the kept samples' own rewards; `rewards` the unfiltered batch's first B
        data = {"content": content, "rewards": rng.random(B).tolist(), "filtered_rewards": data["rewards"],
                **{k: v for k, v in data.items() if k not in ("content", "rewards")}}
    if not token_ids:
        del data["token_ids"]
    if fields:
        data = {k: data[k] for k in fields}
    with open(folder / f"train_data_step{step}.jsonl", "w") as f:
        for i in range(B):
            f.write(json.dumps({**{k: v[i:i + 1] for k, v in data.items()}, "idx": i}, default=str) + "\n")
    return data, [i // G if i // G < B // G - 1 else 0 for i in range(B)], [len(p) for p, _ in rows]


def _nemo_rl_check(tok, seq, made, run=""):
    deltas = []
    for s, (data, groups, plen) in made.items():
        sel = seq[(seq["step"] == s) & (seq["run"] == run)].sort_values("sample_id")
        assert sel["group_id"].tolist() == groups if "token_ids" in data else sel["group_id"].isna().all()
        assert sel["reward"].tolist() == data.get("filtered_rewards", data["rewards"])
        for i, n in enumerate(data["input_lengths"]):
            rows = tok[(tok["step"] == s) & (tok["sample_id"] == i) & (tok["run"] == run)]
            a = plen[i]
            np.testing.assert_array_equal(rows["position"], np.arange(n - a))
            if "token_ids" in data:
                np.testing.assert_array_equal(rows["token_id"], data["token_ids"][i][a:n])
            else:
                assert rows["token_id"].isna().all()
            m = (np.array(data["token_loss_mask"][i][a:n]) > 0) & bool(data["sample_loss_mask"][i])
            np.testing.assert_array_equal(rows["loss_mask"], m)
            g, p = (np.array(data[k][i][a:n], np.float32) for k in ("generation_logprobs", "prev_logprobs"))
            np.testing.assert_array_equal(rows["sampler_logp"].to_numpy(np.float32), g)
            np.testing.assert_array_equal(rows["old_logp"].to_numpy(np.float32), p)
            deltas.append((p - g)[m])
    return deltas


@pytest.mark.parametrize("token_ids", [True, False])
def test_nemo_rl_training_data_log(tmp_path, token_ids):
    rng = np.random.default_rng(5)
    folder = tmp_path / "logs" / "exp_001"
    folder.mkdir(parents=True)
    made = {s: nemo_rl_log(folder, s, rng, token_ids=token_ids) for s in (1, 2)}
    assert main(["--from", "nemo-rl", str(tmp_path / "logs"), "--save-log", str(tmp_path / "log")]) == 0
    tok, seq = _tables(tmp_path / "log")
    deltas = _nemo_rl_check(tok, seq, made)
    d = diagnose(RolloutLog(tmp_path / "log"), progress=False)
    assert d.tables["overall"].set_index("pair").loc["mismatch", "mean_abs"] == pytest.approx(
        np.abs(np.concatenate(deltas).astype(np.float64)).mean(), rel=1e-9)


def test_nemo_rl_dynamic_sampling_rewards(tmp_path):
    """grpo.use_dynamic_sampling: the reward of each logged sample is filtered_rewards (the one its advantage used);
    the rewards field then holds the unfiltered batch's first rewards, rows of other samples."""
    rng = np.random.default_rng(12)
    (tmp_path / "logs").mkdir()
    data, _, _ = nemo_rl_log(tmp_path / "logs", 1, rng, dynamic_sampling=True)
    assert data["rewards"] != data["filtered_rewards"]
    _, seq = _tables(RolloutLog(convert("nemo-rl", tmp_path / "logs", tmp_path / "log")).path)
    assert seq.sort_values("sample_id")["reward"].tolist() == data["filtered_rewards"]


def test_nemo_rl_resumed_run_writes_a_second_experiment_folder(tmp_path):
    """get_next_experiment_dir: each launch logs to a new exp_<NNN>; a run resumed from its step-2 checkpoint
    writes train_data_step3.jsonl again. Each folder reads as its own run."""
    rng = np.random.default_rng(6)
    made = {}
    for run, steps in (("exp_001", (1, 2, 3)), ("exp_002", (3, 4))):
        (tmp_path / "logs" / run).mkdir(parents=True)
        made[run] = {s: nemo_rl_log(tmp_path / "logs" / run, s, rng) for s in steps}
    assert "nemo-rl" in detect(tmp_path / "logs")
    log = RolloutLog(convert("nemo-rl", tmp_path / "logs", tmp_path / "log"))
    tok, seq = _tables(log.path)
    assert sorted(set(zip(seq["run"], seq["step"]))) == [(r, s) for r in made for s in made[r]]
    deltas = sum((_nemo_rl_check(tok, seq, made[r], r) for r in made), [])
    d = diagnose(log, progress=False)
    assert d.tables["overall"].set_index("pair").loc["mismatch", "mean_abs"] == pytest.approx(
        np.abs(np.concatenate(deltas).astype(np.float64)).mean(), rel=1e-9)


@pytest.mark.parametrize("case", ["force_on_policy_ratio", "before_2026_02", "distillation"])
def test_nemo_rl_logs_without_what_the_lab_needs(tmp_path, capsys, case):
    """force_on_policy_ratio logs zeros for prev_logprobs (e7266a92f); grpo.py before f11f99c79 logged content,
    rewards, generation_logprobs, prev_logprobs and input_lengths only; distillation.py content and input_lengths."""
    rng = np.random.default_rng(7)
    fields = {"before_2026_02": ("content", "rewards", "generation_logprobs", "prev_logprobs", "input_lengths"),
              "distillation": ("content", "input_lengths")}.get(case)
    (tmp_path / "logs").mkdir()
    nemo_rl_log(tmp_path / "logs", 1, rng)
    nemo_rl_log(tmp_path / "logs", 2, rng, force_on_policy=case == "force_on_policy_ratio", fields=fields)
    assert main(["--from", "nemo-rl", str(tmp_path / "logs"), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train_data_step2.jsonl" in err
    assert ("'prev_logprobs' is 0 on every one" in err if case == "force_on_policy_ratio"
            else "train_data_step2.jsonl:1: field 'token_loss_mask' is missing" in err)
    assert not (tmp_path / "run").exists()
