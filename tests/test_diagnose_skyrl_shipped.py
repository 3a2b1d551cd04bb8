"""``lab diagnose --from skyrl`` on dumps written by SkyRL 0.4.0's own code, run from the installed wheel
(tests/shipped_code.py; ``.ci/run`` installs it with --no-deps --ignore-requires-python).

The batch is SkyRL's: ``TrainingInputBatch`` and ``pad_training_input_batch`` (``skyrl/backends/skyrl_train/
training_batch.py``, defined under its real module name so the pickle names what a real dump names), built by the
trainer's own ``RayPPOTrainer.convert_to_training_input`` (``skyrl/train/trainer.py``, with ``dataset/preprocess.py``:
``convert_prompts_responses_to_batch_tensors``, ``compute_prompt_boundaries``, ``compute_prompt_mini_batch_boundaries``)
from a generator output, filled by ``fwd_logprobs_values_reward`` and ``compute_advantages_and_returns`` (GRPO,
``ppo_utils.compute_grpo_outcome_advantage``), trimmed as ``RayPPOTrainer.train`` trims it (rewards, uids and
is_last_step popped) and written by ``RayPPOTrainer.dump_data`` (``TensorBatch.save``). Only the model and the Ray
runtime are stood in for: the forward pass returns log-probs that are a fixed function of the tokens, the
advantage-estimator registry (a Ray actor) is a lookup of GRPO's function, and ``self`` carries the config fields
the methods read. The converted log is checked value by value against the generator output and the batch, and the
headline numbers against an independent computation.
"""
from __future__ import annotations

import contextlib
import logging
import math
import pickle
import sys
import types

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

from lab.diagnose import RolloutLog, diagnose
from lab.diagnose.adapters import convert
from lab.diagnose.safe_load import load_skyrl_pickle
from lab.errors import LabError
from shipped_code import load, methods

MODULE = "skyrl.backends.skyrl_train.training_batch"
DP_SIZE = 4  # data-parallel ranks: a batch of 6 sequences gets 2 padding rows, one of 8 none
N_SAMPLES = 2


class _Shape:
    """jaxtyping's Bool / Float / Integer[Tensor, "dims"]: type annotations only (TrainingInput, preprocess
    signatures); jaxtyping is not installed with --no-deps and no pickling or tensor code reads them."""

    def __class_getitem__(cls, item):
        return torch.Tensor


SHAPES = {"Bool": _Shape, "Float": _Shape, "Integer": _Shape}


@contextlib.contextmanager
def shipped_skyrl():
    """SkyRL 0.4.0's functions and classes, ``training_batch`` registered in ``sys.modules`` under its real name only
    inside the block (importing it fails: ``skyrl/backends/__init__.py`` needs cloudpathlib and more). The import
    statements the sources run leave parts of SkyRL's packages in ``sys.modules``; they are removed after it, as the
    other SkyRL tests check that the lab reads a dump with no SkyRL module loaded."""
    before, loaded = sys.modules.get(MODULE), set(sys.modules)
    try:
        packed = load("skyrl", "backends/skyrl_train/utils/packed_tensor.py")
        # the sample-support and routed-expert modules import Megatron's token metadata (not installed) for
        # functions the batch here does not use; their constants and type aliases are taken as written
        support = load("skyrl", "backends/skyrl_train/utils/sample_support.py",
                       ["SampleSupport", "SAMPLE_SUPPORT_DTYPE", "SAMPLE_SUPPORT_TORCH_DTYPE", "SAMPLE_SUPPORT_DTYPES",
                        "SAMPLE_SUPPORT_PADDING", "SAMPLE_SUPPORT_FIELD"])
        routed = load("skyrl", "backends/skyrl_train/utils/routed_experts.py",
                      ["RoutedExpertIndices", "ROUTED_EXPERT_DTYPES"])
        replay = load("skyrl", "backends/skyrl_train/utils/replay_utils.py", ["replay_padding_row"])
        common = {**SHAPES, **{k: v for ns in (packed, support, routed, replay) for k, v in ns.items()
                               if not k.startswith("__")}}
        batch = load("skyrl", "backends/skyrl_train/training_batch.py", None, common, module_name=MODULE)
        assert batch["TrainingInputBatch"].__module__ == MODULE
        prep = load("skyrl", "train/dataset/preprocess.py",
                    ["logger", "ROUTED_EXPERT_TORCH_DTYPES", "make_router_padding_mask", "_verify_inputs",
                     "_reward_to_numpy", "_fill_routed_expert_segment", "_collate_rollout_expert_indices",
                     "_fill_sample_support_segment", "build_sample_support",
                     "convert_prompts_responses_to_batch_tensors", "compute_prompt_boundaries",
                     "compute_prompt_mini_batch_boundaries"], common)
        config = load("skyrl", "train/config/config.py",
                      ["BaseConfig", "KLCtrlConfig", "SAPOConfig", "DynamicSamplingConfig", "ClipCovConfig",
                       "KLCovConfig", "CISPOConfig", "DPPOConfig", "OffPolicyCorrectionConfig", "AlgorithmConfig"])
        ppo = load("skyrl", "backends/skyrl_train/utils/ppo_utils.py",
                   ["AdvantageEstimator", "compute_grpo_outcome_advantage", "compute_advantages_and_returns"],
                   {"AlgorithmConfig": config["AlgorithmConfig"]})
        ppo["AdvantageEstimatorRegistry"] = types.SimpleNamespace(  # the registry's lookup, without its Ray actor
            get=lambda name: {"grpo": ppo["compute_grpo_outcome_advantage"]}[str(name)])
        trainer_globals = {**{k: batch[k] for k in ("TensorList", "TrainingInputBatch", "pad_training_input_batch")},
                           **{k: v for k, v in prep.items() if not k.startswith("_") and k != "logger"},
                           **{k: support[k] for k in ("SAMPLE_SUPPORT_FIELD", "SAMPLE_SUPPORT_PADDING")},
                           "ppo_utils": types.SimpleNamespace(**ppo), "Float": _Shape,
                           "GeneratorOutput": dict,  # a TypedDict, annotation only
                           "logger": logging.getLogger("skyrl.train.trainer")}  # loguru's, for logger.info
        trainer = methods("skyrl", "train/trainer.py", "RayPPOTrainer",
                          ["convert_to_training_input", "fwd_logprobs_values_reward",
                           "compute_advantages_and_returns", "dump_data"], trainer_globals)
        yield {**batch, **trainer, "AlgorithmConfig": config["AlgorithmConfig"]}
    finally:
        for name in set(sys.modules) - loaded:
            if name.split(".")[0] in ("skyrl", "skyrl_gym"):
                del sys.modules[name]
        if before is not None:
            sys.modules[MODULE] = before


# ------------------------------------------------------------------------------------------------ the run
def model_logprobs(tokens: torch.Tensor, model: str) -> torch.Tensor:
    """The stand-in model's log-prob of each token: a fixed function of the token id (the same for the padding
    rows, which copy row 0, as a real forward pass gives)."""
    salt = {"policy": 31, "ref": 57}[model]
    return -(((tokens * salt + 7) % 97).to(torch.float32) / 40.0 + 0.01)


def generator_output(rng, n_prompts: int, routed: bool) -> tuple[dict, list[str]]:
    """What ``postprocess_generator_output`` hands ``convert_to_training_input``: N_SAMPLES responses per prompt,
    per-token rewards (the outcome on the last token), loss masks (a tool output inside one response, one response
    left out of the loss entirely, as the overlong filter does) and the inference engine's log-probs; ``routed``
    adds what router replay (the MoE routes vLLM captured, uint8), sampler-support replay (top-k token ids per
    response token, -1 padded) and a vision-language model (bfloat16 patches) add."""
    uids = [f"prompt-{k}" for k in range(n_prompts) for _ in range(N_SAMPLES)]
    prompts = {u: rng.integers(3, 900, int(rng.integers(2, 7))).tolist() for u in dict.fromkeys(uids)}
    responses = [rng.integers(3, 900, int(n)).tolist() for n in rng.integers(1, 10, len(uids))]
    responses[1] = rng.integers(3, 900, 12).tolist()  # the longest: the other rows are padded in the response window
    masks = [[1] * len(r) for r in responses]
    masks[1][3:5] = [0, 0]  # a tool output
    masks[2] = [0] * len(responses[2])  # left out of the loss, but not padding
    rewards = [[0.0] * (len(r) - 1) + [float(rng.integers(0, 2))] for r in responses]
    rewards[0][-1], rewards[1][-1] = 1.0, 0.0  # the first group has a nonzero spread
    logprobs = [(-rng.exponential(1.0, len(r))).tolist() for r in responses]
    out = {"prompt_token_ids": [prompts[u] for u in uids], "response_ids": responses, "rewards": rewards,
           "loss_masks": masks, "rollout_logprobs": logprobs}
    if routed:
        totals = [len(prompts[u]) + len(r) for u, r in zip(uids, responses)]  # the last token has no captured route
        out["rollout_expert_indices"] = [rng.integers(0, 8, (t - 1, 3, 2)).astype(np.uint8) for t in totals]
        out["rollout_sample_support"] = [np.concatenate([rng.integers(3, 900, (len(r), 2)), np.full((len(r), 1), -1)],
                                                        1).astype(np.int32) for r in responses]
        out["pixel_values"] = [torch.tensor(rng.normal(size=(int(rng.integers(1, 4)), 8))).to(torch.bfloat16)
                               for _ in uids]
        out["image_grid_thw"] = [torch.tensor([[1, 1, len(p)]]) for p in out["pixel_values"]]
    return out, uids


def trainer_self(skyrl, export_path):
    """The attributes of ``RayPPOTrainer`` that the four methods read (config defaults are SkyRL's own)."""
    algorithm = skyrl["AlgorithmConfig"]()
    algorithm.off_policy_correction.tis_ratio_type = "token"  # a run that keeps the inference engine's log-probs
    cfg = types.SimpleNamespace(
        trainer=types.SimpleNamespace(algorithm=algorithm, train_batch_size=None, policy_mini_batch_size=None,
                                      critic=types.SimpleNamespace(model=types.SimpleNamespace(path=None)),
                                      export_path=str(export_path)),
        generator=types.SimpleNamespace(n_samples_per_prompt=N_SAMPLES, step_wise_trajectories=False))

    def forward(model, data, key, mini_batch_boundaries):  # _execute_forward_pass: the policy / ref model
        R = data.metadata["response_length"]
        return model_logprobs(data["sequences"][:, -R:], model)

    return types.SimpleNamespace(
        cfg=cfg, tokenizer=types.SimpleNamespace(pad_token_id=0), all_metrics={}, has_critic=False, ref_model="ref",
        dispatch=types.SimpleNamespace(get_lcm_dp_size=lambda: DP_SIZE, empty_cache=lambda *a: None),
        _execute_forward_pass=forward, _skip_policy_forward=lambda training_input: False)


def run_steps(skyrl, export_path, steps: dict) -> dict:
    """One training step each, as ``RayPPOTrainer.train`` runs it up to ``dump_data``; returns the dumped batches."""
    me = trainer_self(skyrl, export_path)
    dumped = {}
    for step, (out, uids) in steps.items():
        n_prompts = len(dict.fromkeys(uids))
        me.cfg.trainer.train_batch_size = me.cfg.trainer.policy_mini_batch_size = n_prompts
        batch = skyrl["convert_to_training_input"](me, out, uids)
        batch = skyrl["fwd_logprobs_values_reward"](me, batch)
        batch = skyrl["compute_advantages_and_returns"](me, batch)
        for key in ["rewards"]:  # trainer.py, RayPPOTrainer.train, step 6
            batch.pop(key)
        batch.metadata.pop("uids")
        batch.metadata.pop("is_last_step", None)
        skyrl["dump_data"](me, batch, file_name=f"global_step_{step}_training_input")
        dumped[step] = batch
    return dumped


@pytest.fixture(scope="module", params=["text", "routed"])
def run(tmp_path_factory, request):
    rng = np.random.default_rng(11)
    routed = request.param == "routed"  # 6 sequences (2 padding rows), then 8 (none)
    steps = {3: generator_output(rng, 3, routed), 4: generator_output(rng, 4, routed)}
    export = tmp_path_factory.mktemp("skyrl") / "export"
    globals_named = {}
    with shipped_skyrl() as skyrl:
        batches = run_steps(skyrl, export, steps)
        for step, batch in batches.items():  # SkyRL reads its own dump back as the batch it wrote
            f = export / "dumped_data" / f"global_step_{step}_training_input.pkl"
            names = globals_named.setdefault(step, set())

            class Recording(pickle.Unpickler):
                def find_class(self, module, name, names=names):
                    names.add((module, name))
                    return super().find_class(module, name)

            with open(f, "rb") as fh:
                assert Recording(fh).load() == batch
    assert MODULE not in sys.modules  # the lab reads the dump without SkyRL's batch module (importing it fails)
    log = RolloutLog(convert("skyrl", export, export.parent / "neutral"))
    assert MODULE not in sys.modules
    return steps, batches, log, globals_named, export


def _tables(path):
    return [pq.read_table(path / f"{t}.parquet").to_pandas() for t in ("tokens", "sequences")]


# ------------------------------------------------------------------------------------------------ the checks
@pytest.mark.slow  # loading SkyRL's sources runs their imports (Ray, transformers): seconds
def test_the_dump_is_skyrls(run):
    """The batch really went through SkyRL's padding and right-aligned layout, and the pickle names SkyRL's module
    (the batch class, its rebuild function and its TensorFormat enum) besides torch.device."""
    steps, batches, _, names, _ = run
    b3 = batches[3]
    assert b3.metadata["pad_size"] == 2 and len(b3) == 8 and batches[4].metadata["pad_size"] == 0
    assert set(b3.metadata) == {"policy_mini_batch_boundaries", "policy_prompt_boundaries", "response_length",
                                "avg_response_length", "pad_size", "metrics"}
    assert b3.metadata["policy_prompt_boundaries"] == [(0, 2), (2, 4), (4, 6)]
    assert "rewards" not in b3 and b3["values"] is None
    routed = b3["rollout_expert_indices"] is not None
    assert routed == (b3["rollout_sample_support"] is not None) == (b3["pixel_values"] is not None)
    assert (b3["loss_mask"][6:] == 0).all() and torch.equal(b3["sequences"][6:], b3["sequences"][:1].expand(2, -1))
    short = b3["response_mask"][0]
    assert short[0] == 0 and short[-1] == 1  # right-aligned: the response fills the last columns
    for step in steps:  # router and support replay keep their packed values as numpy arrays in the pickle
        numpy = {(m, n) for m, n in names[step] if m.split(".")[0] == "numpy"}
        assert bool(numpy) == routed and names[step] - numpy == {
            (MODULE, "_rebuild_tensor_batch"), (MODULE, "TrainingInputBatch"), (MODULE, "TensorFormat"),
            ("torch", "device")}


@pytest.mark.slow
def test_converted_value_by_value(run):
    steps, batches, log, _, export = run
    tok, seq = _tables(log.path)
    assert log.meta["source"] == "skyrl"
    assert log.meta["notes"] == ["2 padding rows (SkyRL's pad_size, added to fill the data-parallel ranks) skipped"]
    assert tok["current_logp"].isna().all() and tok["version"].isna().all()
    k = 0
    for step, (out, uids) in steps.items():
        batch, f = batches[step], export / "dumped_data" / f"global_step_{step}_training_input.pkl"
        groups = [list(dict.fromkeys(uids)).index(u) for u in uids]
        adv = grpo(out["rewards"], groups)
        for b, resp in enumerate(out["response_ids"]):
            n = len(resp)
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
                             ("advantage", "advantages"), ("loss_mask", "loss_mask")):  # the batch's last n columns
                np.testing.assert_array_equal(rows[col].to_numpy(np.float32), batch[key][b, -n:].numpy())
            r = seq.iloc[k]
            assert (r["step"], r["sample_id"], r["group_id"], r["response_length"]) == (step, b, groups[b], n)
            assert r["origin"] == f"{f} row {b}" and math.isnan(r["reward"])  # SkyRL pops the rewards before dumping
            if any(out["loss_masks"][b]):
                assert r["advantage"] == pytest.approx(adv[b], abs=1e-6)
            else:
                assert pd.isna(r["advantage"])
            k += 1
    assert len(seq) == k == 14 and len(tok) == sum(len(r) for o, _ in steps.values() for r in o["response_ids"])


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


@pytest.mark.slow
def test_headline_numbers(run):
    steps, _, log, _, _ = run
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
    assert row["n_tok"] == delta.size and row["n_seq"] == len(L) and row["n_steps"] == 2
    assert row["mean"] == pytest.approx(delta.mean(), rel=1e-9)
    assert row["mean_abs"] == pytest.approx(np.abs(delta).mean(), rel=1e-9)
    assert row["max_abs"] == pytest.approx(np.abs(delta).max(), rel=1e-9)
    assert row["logw_mean"] == pytest.approx(np.mean(L), rel=1e-9)


@pytest.mark.slow
def test_the_adapter_tests_stand_in_reads_as_skyrls_batch(run, monkeypatch, tmp_path):
    """The stand-in class of tests/test_diagnose_adapters.py, pickling the same batch, decodes to the same state
    (batch size, device, metadata, every dense and list field's encoding). Its bytes differ: SkyRL tags each field
    with a ``TensorFormat`` member, the stand-in with a plain string; SkyRL's packed replay fields it cannot write."""
    from test_diagnose_adapters import skyrl_module

    steps, batches, _, _, export = run
    real = load_skyrl_pickle(export / "dumped_data" / "global_step_3_training_input.pkl").state
    batch = batches[3]
    packed = {k for k, v in batch.items() if hasattr(v, "cu_seqlens")}  # PackedTensor
    cls = skyrl_module(monkeypatch, True)
    fake = cls({k: (list(v.tensors) if hasattr(v, "tensors") else v) for k, v in batch.items() if k not in packed})
    fake.metadata = batch.metadata
    (tmp_path / "stand_in.pkl").write_bytes(pickle.dumps(fake))
    monkeypatch.undo()
    stand_in = load_skyrl_pickle(tmp_path / "stand_in.pkl").state
    assert {k: v for k, v in stand_in.items() if k != "batch_dict"} == {k: v for k, v in real.items()
                                                                         if k != "batch_dict"}
    assert stand_in["batch_dict"] == {k: v for k, v in real["batch_dict"].items() if k not in packed}
    assert {real["batch_dict"][k]["format"] for k in packed} <= {"packed_tensor"}


def test_a_format_tag_that_is_not_a_string_is_one_error(tmp_path, monkeypatch):
    """``TensorFormat`` is read as its string; any other argument is a corrupt dump, one LabError."""
    mod = types.ModuleType(MODULE)

    def TensorFormat(value):  # noqa: N802 - pickled under SkyRL's name
        raise AssertionError("never called when the lab reads a dump")

    TensorFormat.__module__, TensorFormat.__qualname__, mod.TensorFormat = MODULE, "TensorFormat", TensorFormat

    class Tag:
        def __reduce__(self):
            return (TensorFormat, (b"numpy",))

    for name in ("skyrl", "skyrl.backends", "skyrl.backends.skyrl_train"):  # pickle imports the parents
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, MODULE, mod)
    f = tmp_path / "global_step_1_training_input.pkl"
    f.write_bytes(pickle.dumps(Tag()))
    monkeypatch.undo()
    with pytest.raises(LabError, match=r"not a readable SkyRL pickle.*ValueError: TensorFormat of a bytes"):
        load_skyrl_pickle(f)
