"""slime ``--dump-details DIR`` -> neutral log.

slime's ``--dump-details DIR`` sets ``--save-debug-rollout-data DIR/rollout_data/{rollout_id}.pt`` and
``--save-debug-train-data DIR/train_data/{rollout_id}.pt`` (older releases: ``train_data/{rollout_id}_{rank}.pt``),
both written with ``torch.save`` (slime ``utils/arguments.py``, ``ray/rollout.py``,
``backends/megatron_utils/train_dump_utils.py``):

- rollout_data: ``{"rollout_id", "samples": [Sample.to_dict()]}`` with ``group_index``, ``index``, ``tokens``
  (prompt + response), ``response_length``, ``reward``, ``loss_mask``, ``weight_versions`` (one SGLang weight
  version per generation call; "default" for the launch weights), ``rollout_log_probs``, ``status``, ...
- train_data, format_version 2: ``{"format_version": 2, "rollout_id", "rank", "samples": [...], "dp_shards": [...],
  "raw_reward": ...}``; each sample holds ``data_parallel_rank``, ``sample_index``, ``rollout_position`` (its
  index in the rollout dump's samples), ``tokens``, ``response_lengths``, ``total_lengths``, ``loss_masks``,
  ``rewards`` (post-processed), ``rollout_log_probs``, ``log_probs`` (the trainer's, before the update),
  ``ref_log_probs``, ``advantages``, ``returns`` (tensors over the response). Older releases:
  ``{"rollout_id", "rank", "rollout_data": {column: [one entry per sample]}}``, one file per rank.

Mapping: sampler_logp = rollout_log_probs, old_logp = log_probs, response tokens = the last response_lengths of
``tokens``; group_id, reward and versions from the rollout dump's sample at ``rollout_position`` (else the one with
the same ``index``); step = trainer_version = rollout_id (one weight sync per rollout: slime's default
``--update-weights-interval 1``, the launch weights counting as version 0). Loading uses torch's restricted
unpickler (lab.diagnose.safe_load) unless ``trust``.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from lab.diagnose.adapters.common import SequenceBuffer, float_array, int_array, int_version, mask_array
from lab.diagnose.neutral import NeutralLogWriter
from lab.diagnose.safe_load import torch_load
from lab.diagnose.schema import make_meta
from lab.errors import LabError

LOGP = {"sampler_logp": "slime rollout_log_probs: the rollout engine's (SGLang) log-probs of the sampled tokens",
        "old_logp": "slime log_probs: the trainer's (Megatron) log-probs before the update", "current_logp": None}
_V2, _LEGACY = re.compile(r"^(\d+)\.pt$"), re.compile(r"^(\d+)_(\d+)\.pt$")


def _root(path: Path) -> Path:
    path = Path(path)
    if not path.exists():
        raise LabError(f"{path}: no such file or folder")
    if path.is_file() or path.name in ("train_data", "rollout_data"):
        path = path.parent if path.is_dir() else path.parent.parent
    if not (path / "train_data").is_dir():
        raise LabError(f"{path}: no train_data/ folder; slime writes train_data/ and rollout_data/ with --dump-details "
                       f"DIR (the trainer's log-probs are only in train_data)")
    return path


def _files(root: Path) -> dict[int, list[Path]]:
    out: dict[int, list[Path]] = {}
    for f in sorted((root / "train_data").iterdir()):
        m = _V2.match(f.name) or _LEGACY.match(f.name)
        if m:
            out.setdefault(int(m.group(1)), []).append(f)
    if not out:
        raise LabError(f"{root / 'train_data'}: no {{rollout_id}}.pt files")
    return out


def _train_samples(files: list[Path], trust: bool) -> list[tuple[Path, int, dict]]:
    """(file, index in file, sample dict) for every training sample of one rollout."""
    out = []
    for f in files:
        payload = torch_load(f, trust)
        if not isinstance(payload, dict):
            raise LabError(f"{f}: expected a dict, got {type(payload).__name__}")
        if "format_version" in payload:
            if payload["format_version"] != 2:
                raise LabError(f"{f}: format_version {payload['format_version']!r} is not supported (2 is)")
            samples = payload.get("samples")
            if not isinstance(samples, list):
                raise LabError(f"{f}: 'samples' is missing or not a list")
        elif isinstance(payload.get("rollout_data"), dict):  # one DP rank's columns
            cols = payload["rollout_data"]
            if not isinstance(cols.get("response_lengths"), (list, tuple)):
                raise LabError(f"{f}: 'rollout_data' has no 'response_lengths' list")
            n = len(cols["response_lengths"])
            samples = [{k: (v[i] if isinstance(v, (list, tuple)) and len(v) == n else v) for k, v in cols.items()}
                       for i in range(n)]
            for s in samples:
                s.setdefault("sample_index", s.pop("sample_indices", None))
        else:
            raise LabError(f"{f}: neither a format_version 2 train dump nor a legacy one with 'rollout_data'")
        out.extend((f, i, s) for i, s in enumerate(samples))
    return out


def _vec(sample: dict, key: str, where: str, n: int, required: bool = True):
    v = sample.get(key)
    if v is None:
        if required:
            raise LabError(f"{where}: no {key!r}")
        return None
    arr = float_array(v, where, key)
    if arr.shape != (n,):
        raise LabError(f"{where}: {key!r} has {arr.size} entries but response_lengths is {n}")
    return arr


def convert(path, out, *, trust: bool = False, sampling: dict | None = None, progress=None) -> Path:
    root = _root(Path(path))
    writer = NeutralLogWriter(out, make_meta("slime", LOGP, **(sampling or {})))
    try:
        buf = SequenceBuffer(writer)
        for rid, files in sorted(_files(root).items()):
            rollout_file = root / "rollout_data" / f"{rid}.pt"
            rollout = []
            if rollout_file.exists():
                payload = torch_load(rollout_file, trust)
                rollout = payload.get("samples") if isinstance(payload, dict) else None
                if not isinstance(rollout, list):
                    raise LabError(f"{rollout_file}: expected a dict with a 'samples' list")
            by_index = {s["index"]: s for s in rollout if isinstance(s, dict) and isinstance(s.get("index"), int)}
            for f, i, s in _train_samples(files, trust):
                where = f"{f} sample {i}"
                if not isinstance(s, dict):
                    raise LabError(f"{where}: expected a dict, got {type(s).__name__}")
                try:
                    n, total = int(s["response_lengths"]), int(s["total_lengths"])
                    pos, idx = (None if s.get(k) is None else int(s[k]) for k in ("rollout_position", "sample_index"))
                except (KeyError, TypeError, ValueError):
                    raise LabError(f"{where}: needs integer 'response_lengths' and 'total_lengths' (and "
                                   f"'rollout_position', 'sample_index' when present)") from None
                toks = int_array(s["tokens"] if s.get("tokens") is not None else [], where, "tokens")
                if toks.size != total or not 0 <= n <= total:
                    raise LabError(f"{where}: 'tokens' has {toks.size} entries but total_lengths is {total} "
                                   f"(response_lengths {n})")
                mask = mask_array(s["loss_masks"], where, "loss_masks") if s.get("loss_masks") is not None \
                    else np.ones(n, bool)
                if mask.shape != (n,):
                    raise LabError(f"{where}: 'loss_masks' has {mask.size} entries but response_lengths is {n}")
                rs = rollout[pos] if pos is not None and 0 <= pos < len(rollout) else by_index.get(idx)
                rs = rs if isinstance(rs, dict) else {}
                wv = rs.get("weight_versions") or []
                versions = [int_version(v) for v in (wv if isinstance(wv, (list, tuple)) else [wv])]
                versions = [v for v in versions if np.isfinite(v)]
                reward = rs.get("reward")
                reward = float(reward) if isinstance(reward, (int, float)) and not isinstance(reward, bool) else None
                group = rs.get("group_index")
                if group is not None and not isinstance(group, int):
                    raise LabError(f"{where}: the rollout sample's 'group_index' is {group!r:.40}; expected an integer")
                adv = _vec(s, "advantages", where, n, required=False)
                seq_adv = None
                if adv is not None and mask.any():
                    seq_adv = float(adv[np.argmax(mask)])
                sid = pos if pos is not None else (idx if idx is not None else i)
                buf.add("", rid, sid,
                        {"token_id": toks[total - n:], "loss_mask": mask,
                         "sampler_logp": _vec(s, "rollout_log_probs", where, n),
                         "old_logp": _vec(s, "log_probs", where, n),
                         "advantage": adv, "entropy": _vec(s, "entropy", where, n, required=False),
                         "version": np.full(n, versions[0] if len(set(versions)) == 1 else np.nan)},
                        {"group_id": group, "reward": reward, "advantage": seq_adv,
                         "version_min": min(versions) if versions else None,
                         "version_max": max(versions) if versions else None, "trainer_version": rid,
                         "origin": where})
        buf.flush()
        return writer.close()
    except BaseException:
        writer.abort()
        raise
