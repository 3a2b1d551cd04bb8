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
import pickle
import sys
import types

import numpy as np
import pytest
import torch

from lab.diagnose import RolloutLog
from lab.diagnose.adapters import convert
from lab.diagnose.safe_load import load_skyrl_pickle
from lab.errors import LabError
from shipped_code import load, methods
from skyrl_checks import check_converted, check_headline, model_logprobs
from skyrl_checks import generator_output as text_output

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
def generator_output(rng, n_prompts: int, routed: bool) -> tuple[dict, list[str]]:
    """skyrl_checks.generator_output; ``routed`` adds what router replay (the MoE routes vLLM captured, uint8),
    sampler-support replay (top-k token ids per response token, -1 padded) and a vision-language model (bfloat16
    patches) add."""
    out, uids = text_output(rng, n_prompts, N_SAMPLES)
    responses = out["response_ids"]
    if routed:
        totals = [len(p) + len(r) for p, r in zip(out["prompt_token_ids"], responses)]  # the last has no route
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
    assert log.meta["notes"] == ["2 padding rows (SkyRL's pad_size, added to fill the data-parallel ranks) skipped"]
    check_converted(steps, batches, log, export, right_aligned=True, grouped=True)
    assert sum(len(o["response_ids"]) for o, _ in steps.values()) == 14


@pytest.mark.slow
def test_headline_numbers(run):
    check_headline(run[0], run[2])


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
