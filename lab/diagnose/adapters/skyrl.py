"""SkyRL ``trainer.dump_data_batch=true`` -> neutral log.

SkyRL writes each step's training input with ``pickle`` to ``{export_path}/dumped_data/
global_step_{N}_training_input.pkl`` (``RayPPOTrainer.dump_data``). The pickled object is a ``TrainingInputBatch``
(``skyrl_train.training_batch``; ``skyrl.backends.skyrl_train.training_batch`` in later releases), a dict subclass
whose state is ``{"batch_dict": {key: tensor encoding}, "batch_size", "device", "metadata"}``: each tensor is
``torch.save`` bytes (earlier releases, whose pickle also carries the dict items through torch's tensor
reducers) or ``{"format": "numpy", "data", "shape", "dtype"}`` / ``{"format": "torch", "data"}`` (later releases,
rebuilt through ``_rebuild_tensor_batch``; in 0.4.0 the format tag is a member of the ``TensorFormat`` string enum,
read as its string, and the packed router- and sampler-support-replay fields are ``{"format": "packed_tensor"}``
holding numpy arrays, which the conversion does not read). Keys ([B, R] over the response unless said):
``sequences`` [B, P + R] (left-padded prompt, then the response), ``attention_mask``, ``response_mask``, ``loss_mask``,
``action_log_probs`` (the trainer's, before the update; None when that forward pass is skipped),
``rollout_logprobs`` (the inference engine's; None unless the generator returns them), ``advantages``,
``returns``, ``base_action_log_probs``, ``values``; metadata ``response_length``, ``policy_prompt_boundaries``
(one (start, end) per prompt group; skyrl-train 0.1.0-0.3.1 pop ``uids`` and write no boundaries, so their dumps
carry no group id), ``pad_size`` (skyrl-train 0.3.1 on).

Layouts (``dataset/preprocess.py``, ``convert_prompts_responses_to_batch_tensors``): until b059319cf (2026-03-18)
the response tensors are left-aligned (response at column 0, padding after it); since then every row is one
left-padded block and the response tensors are right-aligned (the response fills the last response_len_i columns).
In both, ``response_mask`` marks the response's columns and ``sequences[:, -R:]`` lines up with them. SkyRL pops
``rewards`` and the ``uids`` before dumping (``trainer.py``), so dumps carry no reward, and group ids only through
``policy_prompt_boundaries`` (from b9afd49fe, 2026-06-01). ``pad_training_input_batch`` appends ``pad_size`` copies
of row 0 with a zero loss mask to reach a multiple of the data-parallel size: only those last rows are padding.

Mapping: sampler_logp = rollout_logprobs, old_logp = action_log_probs; a row's response is the columns where
response_mask is set (position 0 = its first response token), with loss_mask as dumped; the last ``pad_size`` rows
are skipped and counted in the notes, every other row is a sequence (one whose loss mask is all zero too); step =
N from the file name; sample_id = the row; group_id from the prompt boundaries; no policy versions (SkyRL records
none). The pickle is read by a restricted unpickler (lab.diagnose.safe_load) that never imports SkyRL.
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
_USED = ("sequences", "response_mask", "loss_mask", "rollout_logprobs", "action_log_probs", "advantages", "rewards")


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
    state = getattr(batch, "state", None)
    state = {} if state is None else state
    if not isinstance(state, dict):
        raise LabError(f"{source}: unexpected TrainingInputBatch state of type {type(state).__name__}")
    fields = {k: v for k, v in dict(batch).items()}  # earlier releases also pickle the items themselves
    bd = state.get("batch_dict")
    bd = {} if bd is None else bd
    if not isinstance(bd, dict):
        raise LabError(f"{source}: 'batch_dict' is not a dict")
    for k, v in bd.items():  # only what the conversion reads (routed experts and pixel values can be gigabytes)
        if k in _USED:
            fields[k] = decode_skyrl_field(v, source=source, key=k)
    meta = state.get("metadata")
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


def _check_fields(fields: dict, f: Path) -> tuple[int, int]:
    """(B, R) after checking that the needed fields are tensors of matching shapes."""
    for k, what in (("rollout_logprobs", "the inference engine's log-probs (SkyRL stores them when the generator "
                                         "returns them, e.g. with an off-policy correction)"),
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
    return B, R


def _pad_size(meta: dict, B: int, f: Path) -> int:
    pad = meta.get("pad_size", 0)
    if pad is None:
        return 0
    if isinstance(pad, bool) or not isinstance(pad, int) or not 0 <= pad <= B:
        raise LabError(f"{f}: metadata 'pad_size' is {pad!r:.40}; expected an integer in 0..{B}")
    return pad


def _np64(t, f: Path, key: str):
    """A real-valued tensor as float64 (through float32, the neutral log's log-prob dtype); one LabError for a
    complex or boolean one."""
    if t is None:
        return None
    if t.is_complex() or t.dtype == torch.bool:
        raise LabError(f"{f}: {key!r} is a {t.dtype} tensor; expected real numbers")
    return t.float().numpy().astype(np.float64)


def convert(path, out, *, trust: bool = False, sampling: dict | None = None, progress=None) -> Path:
    files = find_files(Path(path))
    writer = NeutralLogWriter(out, make_meta("skyrl", LOGP, **(sampling or {})))
    padded = 0
    try:
        buf = SequenceBuffer(writer)
        for step, f in files:
            fields, meta = _fields(load_skyrl_pickle(f, trust), f)
            if step is None:
                step = meta.get("global_step")
                if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 2**62:
                    raise LabError(f"{f}: no step in the file name (global_step_N_training_input.pkl) or metadata")
            B, R = _check_fields(fields, f)
            pad = _pad_size(meta, B, f)
            mask = (fields["loss_mask"] != 0).numpy()
            resp_mask = (fields["response_mask"] != 0).numpy() if fields.get("response_mask") is not None else None
            samp, old, adv, rew = (_np64(fields.get(k), f, k) for k in ("rollout_logprobs", "action_log_probs",
                                                                        "advantages", "rewards"))
            seqs = fields.get("sequences")
            resp = seqs[:, -R:].long().numpy() if seqs is not None else None
            groups = _groups(meta, B - pad, f)
            for b in range(B - pad):
                cols = _response_columns(resp_mask, mask, b, f)
                m = mask[b, cols]
                a = None if adv is None else adv[b, cols]
                buf.add("", int(step), b,
                        {"token_id": None if resp is None else resp[b, cols], "loss_mask": m,
                         "sampler_logp": samp[b, cols], "old_logp": old[b, cols], "advantage": a},
                        {"group_id": None if groups is None or not np.isfinite(groups[b]) else int(groups[b]),
                         "reward": None if rew is None else float(rew[b, cols].sum()),
                         "advantage": None if a is None or not m.any() else float(a[np.argmax(m)]),
                         "origin": f"{f} row {b}"})
            padded += pad
        buf.flush()
        if padded:
            writer.meta["notes"].append(f"{padded} padding rows (SkyRL's pad_size, added to fill the data-parallel "
                                        f"ranks) skipped")
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _response_columns(resp_mask, mask, b: int, f: Path) -> np.ndarray:
    """The columns of row b's response: where response_mask is set (one contiguous block, at the left or the
    right of the response tensors); without a response_mask, column 0 through the last loss-masked column."""
    if resp_mask is None:
        nz = np.flatnonzero(mask[b])
        return np.arange(nz[-1] + 1 if nz.size else 0)
    cols = np.flatnonzero(resp_mask[b])
    if cols.size and cols[-1] - cols[0] + 1 != cols.size:
        raise LabError(f"{f} row {b}: 'response_mask' is not one contiguous block of columns")
    outside = mask[b] & ~resp_mask[b]
    if outside.any():
        raise LabError(f"{f} row {b}: loss_mask is set at column {int(np.argmax(outside))}, outside the response "
                       f"(response_mask)")
    return cols
