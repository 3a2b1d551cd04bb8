"""SkyRL ``trainer.dump_data_batch=true`` -> neutral log.

SkyRL writes each step's training input with ``pickle`` to ``{export_path}/dumped_data/
global_step_{N}_training_input.pkl`` (``RayPPOTrainer.dump_data``). The pickled object is a ``TrainingInputBatch``
(``skyrl_train.training_batch``; ``skyrl.backends.skyrl_train.training_batch`` in later releases), a dict subclass
whose state is ``{"batch_dict": {key: tensor encoding}, "batch_size", "device", "metadata"}``: each tensor is
``torch.save`` bytes (earlier releases, whose pickle also carries the dict items through torch's tensor
reducers) or ``{"format": "numpy", "data", "shape", "dtype"}`` / ``{"format": "torch", "data"}`` (later releases,
rebuilt through ``_rebuild_tensor_batch``). Keys ([B, R] over the response unless said): ``sequences`` [B, P + R]
(left-padded prompt, then the response), ``attention_mask``, ``response_mask``, ``loss_mask``,
``action_log_probs`` (the trainer's, before the update; None when that forward pass is skipped),
``rollout_logprobs`` (the inference engine's; None unless the generator returns them), ``advantages``,
``returns``, ``base_action_log_probs``, ``values``; metadata ``response_length``, ``policy_prompt_boundaries``
(one (start, end) per prompt group; earlier releases kept ``uids``), ``pad_size``.

Mapping: sampler_logp = rollout_logprobs, old_logp = action_log_probs; a row's response is its first R tokens up
to the last one with response_mask (else loss_mask) set; rows without any loss-masked token (SkyRL pads a batch to
a multiple of the data-parallel size) are skipped and counted in the notes; step = N from the file name;
sample_id = the row; group_id from the prompt boundaries. The pickle is read by a restricted unpickler
(lab.diagnose.safe_load) that never imports SkyRL.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from lab.diagnose.adapters.common import SequenceBuffer
from lab.diagnose.neutral import NeutralLogWriter
from lab.diagnose.safe_load import decode_skyrl_field, load_skyrl_pickle
from lab.diagnose.schema import make_meta
from lab.errors import LabError

LOGP = {"sampler_logp": "SkyRL rollout_logprobs: the inference engine's (vLLM/SGLang) log-probs of the sampled tokens",
        "old_logp": "SkyRL action_log_probs: the trainer's log-probs before the update", "current_logp": None}
_NAME = re.compile(r"global_step_(\d+)_training_input\.pkl$")


def find_files(path: Path) -> list[tuple[int | None, Path]]:
    path = Path(path)
    if not path.exists():
        raise LabError(f"{path}: no such file or folder")
    if path.is_file():
        m = _NAME.search(path.name)
        return [(int(m.group(1)) if m else None, path)]
    files = [(int(m.group(1)), f) for f in path.rglob("global_step_*_training_input.pkl")
             if (m := _NAME.search(f.name))]
    if not files:
        raise LabError(f"{path}: no SkyRL dumps (dumped_data/global_step_N_training_input.pkl) found; enable them with "
                       f"trainer.dump_data_batch=true")
    return sorted(files)


def _fields(batch, source: Path) -> tuple[dict, dict]:
    state = getattr(batch, "state", None) or {}
    if not isinstance(state, dict):
        raise LabError(f"{source}: unexpected TrainingInputBatch state of type {type(state).__name__}")
    fields = {k: v for k, v in dict(batch).items()}  # earlier releases also pickle the items themselves
    bd = state.get("batch_dict") or {}
    if not isinstance(bd, dict):
        raise LabError(f"{source}: 'batch_dict' is not a dict")
    for k, v in bd.items():
        fields[k] = decode_skyrl_field(v, source=source, key=k)
    meta = state.get("metadata") or {}
    return fields, meta if isinstance(meta, dict) else {}


def _groups(meta: dict, B: int, source: Path):
    bounds = meta.get("policy_prompt_boundaries")
    if isinstance(bounds, (list, tuple)) and bounds:
        g = np.full(B, np.nan)
        for k, be in enumerate(bounds):
            try:
                s, e = int(be[0]), int(be[1])
            except (TypeError, ValueError, IndexError, KeyError):
                raise LabError(f"{source}: metadata 'policy_prompt_boundaries' entry {k} is {be!r:.40}; expected "
                               f"(start, end)") from None
            if not 0 <= s <= e:
                raise LabError(f"{source}: metadata 'policy_prompt_boundaries' entry {k} is ({s}, {e}); expected "
                               f"0 <= start <= end")
            g[s:min(e, B)] = k
        return g
    uids = meta.get("uids")
    if isinstance(uids, (list, tuple)) and len(uids) >= 1:
        if not all(isinstance(u, (str, int)) for u in uids):
            raise LabError(f"{source}: metadata 'uids' must be a list of strings")
        codes = {u: i for i, u in enumerate(dict.fromkeys(uids))}
        g = np.full(B, np.nan)
        g[:len(uids)] = [codes[u] for u in uids[:B]]
        return g
    return None


def convert(path, out, *, trust: bool = False, sampling: dict | None = None, progress=None) -> Path:
    files = find_files(Path(path))
    writer = NeutralLogWriter(out, make_meta("skyrl", LOGP, **(sampling or {})))
    skipped = 0
    try:
        buf = SequenceBuffer(writer)
        for step, f in files:
            fields, meta = _fields(load_skyrl_pickle(f, trust), f)
            if step is None:
                step = meta.get("global_step")
                if not isinstance(step, int):
                    raise LabError(f"{f}: no step in the file name (global_step_N_training_input.pkl) or metadata")
            for k, what in (("rollout_logprobs", "the inference engine's log-probs (SkyRL stores them when the "
                                                 "generator returns them, e.g. with an off-policy correction)"),
                            ("action_log_probs", "the trainer's log-probs (None when SkyRL skips that forward pass)"),
                            ("loss_mask", "the loss mask")):
                if fields.get(k) is None:
                    raise LabError(f"{f}: {k!r} is missing or None: it holds {what}; nothing to compare against")
            for k in ("loss_mask", "rollout_logprobs", "action_log_probs", "advantages", "response_mask", "rewards",
                      "sequences"):
                if fields.get(k) is not None and not torch.is_tensor(fields[k]):
                    raise LabError(f"{f}: {k!r} is a {type(fields[k]).__name__}, expected a tensor")
            lm = fields["loss_mask"]
            if lm.dim() != 2:
                raise LabError(f"{f}: 'loss_mask' has shape {tuple(lm.shape)}, expected [batch, response_length]")
            B, R = lm.shape
            for k in ("rollout_logprobs", "action_log_probs", "advantages", "response_mask", "rewards"):
                v = fields.get(k)
                if v is not None and tuple(v.shape) != (B, R):
                    raise LabError(f"{f}: {k!r} has shape {tuple(v.shape)} but 'loss_mask' has {(B, R)}; masks and "
                                   f"lengths must match")
            seqs = fields.get("sequences")
            if seqs is not None and (seqs.dim() != 2 or seqs.shape[0] != B or seqs.shape[1] < R):
                raise LabError(f"{f}: 'sequences' has shape {tuple(seqs.shape)}, expected [{B}, prompt + {R}]")
            mask = (lm != 0).numpy()
            extent = (fields["response_mask"] != 0).numpy() if fields.get("response_mask") is not None else mask
            samp = fields["rollout_logprobs"].float().numpy().astype(np.float64)
            old = fields["action_log_probs"].float().numpy().astype(np.float64)
            adv = fields["advantages"].float().numpy().astype(np.float64) if fields.get("advantages") is not None else None
            rew = fields["rewards"].float().numpy().astype(np.float64) if fields.get("rewards") is not None else None
            resp = seqs[:, -R:].long().numpy() if seqs is not None else None
            groups = _groups(meta, B, f)
            for b in range(B):
                if not mask[b].any():
                    skipped += 1
                    continue
                ext = np.flatnonzero(extent[b] | mask[b])
                n = int(ext[-1]) + 1
                a = None if adv is None else adv[b, :n]
                buf.add("", int(step), b,
                        {"token_id": None if resp is None else resp[b, :n], "loss_mask": mask[b, :n],
                         "sampler_logp": samp[b, :n], "old_logp": old[b, :n], "advantage": a},
                        {"group_id": None if groups is None or not np.isfinite(groups[b]) else int(groups[b]),
                         "reward": None if rew is None else float(rew[b, :n].sum()),
                         "advantage": None if a is None else float(a[np.argmax(mask[b, :n])]),
                         "origin": f"{f} row {b}"})
        buf.flush()
        if skipped:
            writer.meta["notes"].append(f"{skipped} rows without loss-masked tokens (batch padding) skipped")
        return writer.close()
    except BaseException:
        writer.abort()
        raise
