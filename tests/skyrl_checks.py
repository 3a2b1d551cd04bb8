"""The checks shared by the tests that build SkyRL dumps with SkyRL's own code (tests/test_diagnose_skyrl_shipped.py:
skyrl 0.4.0; tests/test_diagnose_skyrl_train_shipped.py: skyrl-train 0.3.1): the stand-in model, GRPO's advantage
restated, the converted log value by value and the headline numbers against an independent computation."""
from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from lab.diagnose import diagnose


def generator_output(rng, n_prompts: int, n_samples: int) -> tuple[dict, list[str]]:
    """What ``postprocess_generator_output`` hands ``convert_to_training_input``: ``n_samples`` responses per prompt,
    per-token rewards (the outcome on the last token), loss masks (a tool output inside one response, one response
    left out of the loss entirely, as the overlong filter does) and the inference engine's log-probs; (output, uids)."""
    uids = [f"prompt-{k}" for k in range(n_prompts) for _ in range(n_samples)]
    prompts = {u: rng.integers(3, 900, int(rng.integers(2, 7))).tolist() for u in dict.fromkeys(uids)}
    responses = [rng.integers(3, 900, int(n)).tolist() for n in rng.integers(1, 10, len(uids))]
    responses[1] = rng.integers(3, 900, 12).tolist()  # the longest: the other rows are padded in the response window
    masks = [[1] * len(r) for r in responses]
    masks[1][3:5] = [0, 0]  # a tool output
    masks[2] = [0] * len(responses[2])  # left out of the loss, but not padding
    rewards = [[0.0] * (len(r) - 1) + [float(rng.integers(0, 2))] for r in responses]
    rewards[0][-1], rewards[1][-1] = 1.0, 0.0  # the first group has a nonzero spread
    logprobs = [(-rng.exponential(1.0, len(r))).tolist() for r in responses]
    return {"prompt_token_ids": [prompts[u] for u in uids], "response_ids": responses, "rewards": rewards,
            "loss_masks": masks, "rollout_logprobs": logprobs}, uids


def model_logprobs(tokens: torch.Tensor, model: str) -> torch.Tensor:
    """The stand-in model's log-prob of each token: a fixed function of the token id (the same for the padding
    rows, which copy row 0, as a real forward pass gives)."""
    salt = {"policy": 31, "ref": 57}[model]
    return -(((tokens * salt + 7) % 97).to(torch.float32) / 40.0 + 0.01)


def grpo(rewards, groups, eps=1e-6) -> np.ndarray:
    """GRPO's outcome advantage (Shao et al. 2024, DeepSeekMath), restated: (r - mean_group) / (std_group + eps),
    the standard deviation with n - 1 in the denominator as SkyRL's torch.std takes it."""
    r = np.array([sum(x) for x in rewards], dtype=np.float64)
    g = np.array(groups)
    out = np.empty_like(r)
    for k in set(groups):
        m = g == k
        out[m] = (r[m] - r[m].mean()) / (r[m].std(ddof=1) + eps) if m.sum() > 1 else r[m]
    return out


def check_converted(steps: dict, batches: dict, log, export, *, right_aligned: bool, grouped: bool) -> None:
    """Every sequence of the converted log against the generator output, the stand-in model and the dumped batch
    (the response in its last columns when ``right_aligned``, else its first); group ids from the prompt boundaries
    when ``grouped``, else none; no reward (SkyRL pops the rewards before dumping)."""
    tok, seq = [pq.read_table(log.path / f"{t}.parquet").to_pandas() for t in ("tokens", "sequences")]
    assert log.meta["source"] == "skyrl"
    assert tok["current_logp"].isna().all() and tok["version"].isna().all()
    k = 0
    for step, (out, uids) in steps.items():
        batch, f = batches[step], export / "dumped_data" / f"global_step_{step}_training_input.pkl"
        groups = [list(dict.fromkeys(uids)).index(u) for u in uids]
        adv = grpo(out["rewards"], groups)
        for b, resp in enumerate(out["response_ids"]):
            n = len(resp)
            cols = slice(-n, None) if right_aligned else slice(0, n)
            rows = tok[(tok["step"] == step) & (tok["sample_id"] == b)]
            np.testing.assert_array_equal(rows["position"], np.arange(n))
            np.testing.assert_array_equal(rows["token_id"], resp)
            np.testing.assert_array_equal(rows["loss_mask"], np.array(out["loss_masks"][b]) > 0)
            np.testing.assert_array_equal(rows["sampler_logp"].to_numpy(np.float32),
                                          np.array(out["rollout_logprobs"][b], np.float32))
            np.testing.assert_array_equal(rows["old_logp"].to_numpy(np.float32),
                                          model_logprobs(torch.tensor(resp), "policy").numpy())
            np.testing.assert_allclose(rows["advantage"], np.full(n, adv[b]), rtol=1e-6, atol=1e-6)
            for col, key in (("sampler_logp", "rollout_logprobs"), ("old_logp", "action_log_probs"),
                             ("advantage", "advantages"), ("loss_mask", "loss_mask")):
                np.testing.assert_array_equal(rows[col].to_numpy(np.float32), batch[key][b, cols].numpy())
            r = seq.iloc[k]
            assert (r["step"], r["sample_id"], r["response_length"]) == (step, b, n)
            assert r["group_id"] == groups[b] if grouped else pd.isna(r["group_id"])
            assert r["origin"] == f"{f} row {b}" and math.isnan(r["reward"])
            if any(out["loss_masks"][b]):
                assert r["advantage"] == pytest.approx(adv[b], abs=1e-6)
            else:
                assert pd.isna(r["advantage"])
            k += 1
    assert len(seq) == k and len(tok) == sum(len(r) for o, _ in steps.values() for r in o["response_ids"])


def check_headline(steps: dict, log) -> None:
    """The mismatch pair's overall numbers against the same computed from the generator output and the model."""
    d = diagnose(log, progress=False)
    delta, L = [], []
    for out, _ in steps.values():
        for resp, mask, lp in zip(out["response_ids"], out["loss_masks"], out["rollout_logprobs"]):
            m = np.array(mask) > 0
            # the log keeps SkyRL's float32 log-probs, and the lab takes their difference in float32
            x = (model_logprobs(torch.tensor(resp), "policy").numpy() - np.array(lp, np.float32))[m].astype(np.float64)
            delta.append(x)
            if m.any():
                L.append(x.sum())
    delta = np.concatenate(delta)
    row = d.tables["overall"].set_index("pair").loc["mismatch"]
    assert row["n_tok"] == delta.size and row["n_seq"] == len(L) and row["n_steps"] == len(steps)
    assert row["mean"] == pytest.approx(delta.mean(), rel=1e-9)
    assert row["mean_abs"] == pytest.approx(np.abs(delta).mean(), rel=1e-9)
    assert row["max_abs"] == pytest.approx(np.abs(delta).max(), rel=1e-9)
    assert row["logw_mean"] == pytest.approx(np.mean(L), rel=1e-9)
