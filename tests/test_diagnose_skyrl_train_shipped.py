"""``lab diagnose --from skyrl`` on dumps written by the ``skyrl-train`` releases' own code (top-level package
``skyrl_train``, SkyRL before 0.4.0), run from the installed wheel (tests/shipped_code.py; ``.ci/run`` installs
skyrl-train 0.3.1 with --no-deps --ignore-requires-python).

The pickle mechanism of ``skyrl_train/training_batch.py`` is the same in 0.1.0 to 0.3.1 (byte-identical from 0.2.0;
0.1.0 differs only in the ``TrainingInput`` annotations): ``TensorBatch`` is a dict subclass, so the pickle carries
the dict items through torch's tensor reducers, and its ``__getstate__`` stores every field again as ``torch.save``
bytes in ``batch_dict``. What the releases dump differs: 0.1.0 to 0.3.0 the same fields and metadata keys (0.1.0 pops
``custom_rewards`` and ``rm_rewards``, later ones ``rewards``); 0.3.1 adds ``RayPPOTrainer.pad_batch`` (padding rows
copied from the first rows with a zero loss mask, metadata ``pad_size``) and an ``is_last_step`` field (None unless
step-wise). The installed release's code builds the dump: ``TrainingInputBatch`` (defined under its real module
name, so the pickle names what a real dump names), ``convert_prompts_responses_to_batch_tensors``
(``dataset/preprocess.py``), the trainer's ``convert_to_training_input`` (with ``pad_batch`` where the release has
it), ``fwd_logprobs_values_reward`` (the forward passes dispatched by ``PPORayActorGroup.async_run_ray_method``
through ``distributed/dispatch.py``'s ``MeshDispatch`` and gathered by ``concatenate_outputs_after_mesh_dispatch``)
and ``compute_advantages_and_returns`` (GRPO, ``ppo_utils.compute_grpo_outcome_advantage``), trimmed as the
release's ``RayPPOTrainer.train`` trims it (the popped keys read from its source) and written by ``dump_data``
(``TensorBatch.save``). The config is the release's ``config/ppo_base_config.yaml``. Stood in: the model (a worker
handle whose ``forward.remote`` returns log-probs that are a fixed function of the tokens), the Ray runtime
(``ray.get`` returns what the stand-in handles returned, placement moves are no-ops), the advantage-estimator
registry (a Ray actor; a lookup of GRPO's function), loguru's logger and jaxtyping's annotation types (neither is
installed). The converted log is
checked value by value against the generator output and the batch, the headline numbers against an independent
computation.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
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
from shipped_code import load, methods, source_file
from skyrl_checks import check_converted, check_headline, generator_output, model_logprobs

pytestmark = pytest.mark.slow  # loading the trainer's source runs its imports (Ray, transformers): seconds

PACKAGE = "skyrl_train"
MODULE = "skyrl_train.training_batch"
N_SAMPLES = 2


class _Shape:
    """jaxtyping's Float / Integer[Tensor, "dims"]: type annotations only (TrainingInput, preprocess signatures);
    jaxtyping is not installed with --no-deps and no pickling or tensor code reads them."""

    def __class_getitem__(cls, item):
        return torch.Tensor


SHAPES = {"Float": _Shape, "Integer": _Shape}


def _class_body(relative: str, cls: str) -> list:
    tree = ast.parse(source_file(PACKAGE, relative).read_text())
    (body,) = [n.body for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return body


def popped_before_dump() -> list[str]:
    """The keys ``RayPPOTrainer.train`` pops from the training input after computing advantages (``for key in
    [...]: training_input.pop(key)``), read from the installed release's source."""
    (train,) = [n for n in _class_body("trainer.py", "RayPPOTrainer")
                if isinstance(n, ast.FunctionDef) and n.name == "train"]
    loops = [n for n in ast.walk(train) if isinstance(n, ast.For) and isinstance(n.iter, ast.List)
             and [ast.unparse(s) for s in n.body] == ["training_input.pop(key)"]]
    assert len(loops) == 1, "the release's train loop pops no keys the way 0.1.0-0.3.1 do"
    return ast.literal_eval(loops[0].iter)


@contextlib.contextmanager
def shipped_skyrl_train():
    """The installed skyrl-train release's classes and trainer methods, ``training_batch`` registered under its real
    name only inside the block (importing it fails: it imports jaxtyping). The trainer's own import statements bring
    in ``skyrl_train.distributed.dispatch`` (which imports the registered batch module); all ``skyrl_train``
    modules are removed after it, as the lab must read a dump with none loaded."""
    before, loaded = sys.modules.get(MODULE), set(sys.modules)
    try:
        batch = load(PACKAGE, "training_batch.py", None, SHAPES, module_name=MODULE)
        assert batch["TrainingInputBatch"].__module__ == MODULE
        prep = load(PACKAGE, "dataset/preprocess.py", ["_verify_inputs", "convert_prompts_responses_to_batch_tensors"],
                    SHAPES)
        ppo = load(PACKAGE, "utils/ppo_utils.py",
                   ["AdvantageEstimator", "compute_grpo_outcome_advantage", "compute_advantages_and_returns"],
                   {"Float": _Shape})
        ppo["AdvantageEstimatorRegistry"] = types.SimpleNamespace(  # the registry's lookup, without its Ray actor
            get=lambda name: {"grpo": ppo["compute_grpo_outcome_advantage"]}[str(name)])
        names = ["convert_to_training_input", "fwd_logprobs_values_reward", "compute_advantages_and_returns",
                 "dump_data"]
        has_pad = any(isinstance(n, ast.FunctionDef) and n.name == "pad_batch"
                      for n in _class_body("trainer.py", "RayPPOTrainer"))
        trainer = methods(PACKAGE, "trainer.py", "RayPPOTrainer", names + ["pad_batch"] * has_pad,
                          {"TrainingInputBatch": batch["TrainingInputBatch"],
                           "TrainingOutputBatch": batch["TrainingOutputBatch"],
                           "convert_prompts_responses_to_batch_tensors": prep[
                               "convert_prompts_responses_to_batch_tensors"],
                           "ppo_utils": types.SimpleNamespace(**ppo), "Float": _Shape})
        group = methods(PACKAGE, "workers/worker.py", "PPORayActorGroup", ["async_run_ray_method"])
        g = trainer["dump_data"].__globals__
        assert g["TrainingInputBatch"] is batch["TrainingInputBatch"]  # the trainer's import found the same class
        g["ray"] = types.SimpleNamespace(get=lambda refs: refs)  # a stand-in handle returns values, not refs
        g["logger"] = logging.getLogger("skyrl_train.trainer")  # loguru's, for logger.info
        yield {**batch, **trainer, **group, "MeshRank": g["MeshRank"], "ActorInfo": g["ActorInfo"],
               "popped": popped_before_dump(), "has_pad": has_pad}
    finally:
        for name in set(sys.modules) - loaded:
            if name.split(".")[0] == PACKAGE or name.startswith("shipped_skyrl_train"):
                del sys.modules[name]
        if before is not None:
            sys.modules[MODULE] = before


# ------------------------------------------------------------------------------------------------ the run
def actor_group(sk, model: str, dp_size: int):
    """A ``PPORayActorGroup`` with one worker per data-parallel rank: SkyRL's ``async_run_ray_method`` dispatches
    through its ``MeshDispatch`` / ``PassThroughDispatch``; each worker handle's ``forward.remote`` returns the
    stand-in model's log-probs of its chunk's response window (``sequences[:, -response_length:]``)."""
    def forward(data):
        R = data.metadata["response_length"]
        return sk["TrainingOutputBatch"]({"output": model_logprobs(data["sequences"][:, -R:], model)})

    handle = types.SimpleNamespace(forward=types.SimpleNamespace(remote=forward),
                                   empty_cache=types.SimpleNamespace(remote=lambda *a, **k: None))
    fields = {f.name for f in dataclasses.fields(sk["MeshRank"])}  # 0.1.0's MeshRank has no pp_size
    ranks = [sk["MeshRank"](**{k: v for k, v in dict(dp=i, sp=0, tp=0, pp=0, world_size=dp_size, dp_size=dp_size,
                                                        pp_size=1).items() if k in fields}) for i in range(dp_size)]
    group = types.SimpleNamespace(actor_infos=[sk["ActorInfo"](handle=handle, rank=r) for r in ranks],
                                  backload_to_gpu=lambda *a, **k: None, offload_to_cpu=lambda *a, **k: None)
    group.async_run_ray_method = functools.partial(sk["async_run_ray_method"], group)
    return group


def trainer_self(sk, export_path, dp_size: int):
    """The attributes of ``RayPPOTrainer`` that the methods read; the config is the release's own defaults with a
    run that keeps the inference engine's log-probs (``generator.sampling_params.logprobs``, ``use_tis``)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(source_file(PACKAGE, "config/ppo_base_config.yaml"))
    cfg.trainer.export_path = str(export_path)
    cfg.trainer.algorithm.use_tis = True
    cfg.generator.sampling_params.logprobs = 0
    cfg.generator.n_samples_per_prompt = N_SAMPLES
    me = types.SimpleNamespace(cfg=cfg, tokenizer=types.SimpleNamespace(pad_token_id=0), all_metrics={},
                               colocate_all=cfg.trainer.placement.colocate_all, critic_model=None, reward_model=None,
                               policy_model=actor_group(sk, "policy", dp_size),
                               ref_model=actor_group(sk, "ref", dp_size))
    if sk["has_pad"]:
        me.pad_batch = functools.partial(sk["pad_batch"], me)
    return me


def run_steps(sk, export_path, steps: dict, dp_size: int) -> dict:
    """One training step each, as ``RayPPOTrainer.train`` runs it up to ``dump_data``; returns the dumped batches."""
    me = trainer_self(sk, export_path, dp_size)
    dumped = {}
    for step, (out, uids) in steps.items():
        batch = sk["convert_to_training_input"](me, out, uids)
        batch = sk["fwd_logprobs_values_reward"](me, batch)
        batch = sk["compute_advantages_and_returns"](me, batch)
        for key in sk["popped"]:
            batch.pop(key)
        batch.metadata.pop("uids")
        sk["dump_data"](me, batch, file_name=f"global_step_{step}_training_input")
        dumped[step] = batch
    return dumped


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    rng = np.random.default_rng(11)
    steps = {3: generator_output(rng, 3, N_SAMPLES), 4: generator_output(rng, 4, N_SAMPLES)}  # 6, then 8 sequences
    export = tmp_path_factory.mktemp("skyrl_train") / "export"
    names = {}
    with shipped_skyrl_train() as sk:
        # with pad_batch, 4 ranks: 2 padding rows, then none; before it the batch must divide the ranks (2)
        dp_size = 4 if sk["has_pad"] else 2
        batches = run_steps(sk, export, steps, dp_size)
        for step, batch in batches.items():  # SkyRL reads its own dump back as the batch it wrote (field by
            # field: the release's TensorBatch.__eq__ calls torch.equal on the None fields and raises)
            seen = names.setdefault(step, set())

            class Recording(pickle.Unpickler):
                def find_class(self, module, name, seen=seen):
                    seen.add((module, name))
                    return super().find_class(module, name)

            with open(export / "dumped_data" / f"global_step_{step}_training_input.pkl", "rb") as fh:
                back = Recording(fh).load()
            assert type(back) is type(batch) and back.metadata == batch.metadata and set(back) == set(batch)
            assert all(torch.equal(v, back[k]) if v is not None else back[k] is None for k, v in batch.items())
        info = {"popped": sk["popped"], "has_pad": sk["has_pad"], "dp_size": dp_size}
    assert not any(m.split(".")[0] == PACKAGE for m in sys.modules)  # the lab reads the dump without SkyRL
    log = RolloutLog(convert("skyrl", export, export.parent / "neutral"))
    assert not any(m.split(".")[0] == PACKAGE for m in sys.modules)
    return steps, batches, log, names, export, info


def test_the_dump_is_skyrl_trains(run):
    """The batch went through the release's layout (left-aligned response tensors) and padding, and the pickle names
    the release's batch class, torch's tensor rebuild and storage loader, and nothing else of SkyRL's."""
    steps, batches, _, names, export, info = run
    b3, b4 = batches[3], batches[4]
    pad = 2 if info["has_pad"] else 0
    assert len(b3) == 6 + pad and len(b4) == 8
    expected = {"response_length", "avg_response_length", "metrics"} | ({"pad_size"} if info["has_pad"] else set())
    assert set(b3.metadata) == set(b4.metadata) == expected
    if info["has_pad"]:  # pad_batch copies the first rows and zeroes their loss mask
        assert b3.metadata["pad_size"] == 2 and b4.metadata["pad_size"] == 0
        assert (b3["loss_mask"][6:] == 0).all() and torch.equal(b3["sequences"][6:], b3["sequences"][:2])
        # is_last_step (None unless step-wise) stays a None field, except where pad_batch rebuilt the batch from
        # its non-None fields
        assert "is_last_step" not in b3 and b4["is_last_step"] is None
    assert not set(info["popped"]) & set(b3) and b3["values"] is None
    short = b3["response_mask"][0]
    assert short[0] == 1 and short[-1] == 0  # left-aligned: the response starts at column 0
    for step in steps:
        assert names[step] == {(MODULE, "TrainingInputBatch"), ("torch._utils", "_rebuild_tensor_v2"),
                               ("torch.storage", "_load_from_bytes"), ("collections", "OrderedDict"),
                               ("torch", "device")}
    state = load_skyrl_pickle(export / "dumped_data" / "global_step_3_training_input.pkl").state
    assert set(state) == {"batch_dict", "batch_size", "device", "metadata"}
    assert set(state["batch_dict"]) == set(b3) and all(isinstance(v, bytes) for v in state["batch_dict"].values())


def test_converted_value_by_value(run):
    steps, batches, log, _, export, info = run
    padding = [] if not info["has_pad"] else [
        "2 padding rows (SkyRL's pad_size, added to fill the data-parallel ranks) skipped"]
    assert log.meta["notes"] == padding
    # these releases left-align the response and pop the uids without recording prompt boundaries: no groups
    check_converted(steps, batches, log, export, right_aligned=False, grouped=False)
    assert sum(len(o["response_ids"]) for o, _ in steps.values()) == 14


def test_headline_numbers(run):
    check_headline(run[0], run[2])
