"""NeMo-RL training-data logs -> neutral log.

NeMo-RL's GRPO loops (``algorithms/grpo.py``: the synchronous and the asynchronous one; also ``grpo_sync.py``,
``ppo.py``, ``distillation.py``) write, unless NeMo Gym responses are logged instead, each step's training batch
with ``Logger.log_batched_dict_as_jsonl`` to ``<log_dir>/train_data_step<N>.jsonl`` (N = the step, from 1): one
JSON line per sample, ``json.dumps({**sample, "idx": i}, default=str)``, tensors as lists. Fields: ``content``,
``rewards`` (the sample's reward), ``input_lengths`` (its real length), ``token_ids`` [S] (prompt + response,
right-padded to the batch's longest), ``token_loss_mask`` [S] (1 on generated assistant tokens),
``sample_loss_mask`` (0 drops the whole sample from the loss), ``advantages`` [S], ``generation_logprobs`` [S]
(the generation engine's, 0 off generated tokens), ``prev_logprobs`` [S] (the training engine's before the update);
optional ``filtered_rewards``, ``agent_ref``. Log-probs at index t are those of token t (NeMo-RL's loss drops
column 0). No group id, no policy version.

Mapping: sampler_logp = generation_logprobs, old_logp = prev_logprobs; loss_mask = token_loss_mask *
sample_loss_mask (NeMo-RL's loss and its token_mult_prob_error use that product); the response spans the first
token_loss_mask token to input_lengths (padding dropped); step = N; sample_id = idx; reward = rewards; origin =
"file:line".
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from lab.diagnose.adapters.common import SequenceBuffer, float_array, int_array, int_field, json_line, mask_array
from lab.diagnose.neutral import NeutralLogWriter
from lab.diagnose.schema import make_meta
from lab.errors import LabError

LOGP = {"sampler_logp": "NeMo-RL generation_logprobs: the generation engine's (vLLM/SGLang) log-probs",
        "old_logp": "NeMo-RL prev_logprobs: the training engine's log-probs before the update", "current_logp": None}
TOKEN_FIELDS = ("token_ids", "token_loss_mask", "generation_logprobs", "prev_logprobs")
_NAME = re.compile(r"^train_data_step(\d+)\.jsonl$")


def find_files(path: Path) -> list[tuple[int, Path]]:
    path = Path(path)
    if not path.exists():
        raise LabError(f"{path}: no such file or folder")
    candidates = [path] if path.is_file() else list(path.rglob("train_data_step*.jsonl"))
    files = sorted((int(m.group(1)), f) for f in candidates if (m := _NAME.match(f.name)))
    if not files:
        raise LabError(f"{path}: no NeMo-RL training-data logs (train_data_step<N>.jsonl) found")
    return files


def convert(path, out, *, trust: bool = False, sampling: dict | None = None, progress=None) -> Path:
    files = find_files(Path(path))
    writer = NeutralLogWriter(out, make_meta("nemo-rl", LOGP, **(sampling or {})))
    try:
        buf = SequenceBuffer(writer)
        seen = {}
        for step, f in files:
            with open(f, "rb") as fh:
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        _add_record(buf, step, f"{f}:{lineno}", line, seen)
        buf.flush()
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _add_record(buf: SequenceBuffer, step: int, where: str, line: bytes, seen: dict) -> None:
    rec = json_line(line, where)
    if not isinstance(rec, dict):
        raise LabError(f"{where}: expected a JSON object per line, got {type(rec).__name__}")
    for k in TOKEN_FIELDS:
        if not isinstance(rec.get(k), list):
            raise LabError(f"{where}: field {k!r} is missing or not a list")
    S = len(rec["token_ids"])
    for k in (*TOKEN_FIELDS[1:], "advantages"):
        if isinstance(rec.get(k), list) and len(rec[k]) != S:
            raise LabError(f"{where}: {k!r} has {len(rec[k])} entries but 'token_ids' has {S}")
    length = int_field(rec, "input_lengths", where)
    length = S if length is None else length
    if length > S:
        raise LabError(f"{where}: 'input_lengths' is {length} but 'token_ids' has {S} entries")
    sample_ok = rec.get("sample_loss_mask", 1)
    if isinstance(sample_ok, list) and len(sample_ok) == 1:
        sample_ok = sample_ok[0]
    if isinstance(sample_ok, bool) or not isinstance(sample_ok, (int, float)) or sample_ok not in (0, 1):
        raise LabError(f"{where}: 'sample_loss_mask' is {sample_ok!r:.40}; expected 0 or 1")
    token_mask = mask_array(rec["token_loss_mask"], where, "token_loss_mask")[:length]
    idx = int_field(rec, "idx", where, required=True)
    if (step, idx) in seen:
        raise LabError(f"{where}: idx {idx} appears twice in step {step} (also {seen[step, idx]})")
    seen[step, idx] = where
    nz = np.flatnonzero(token_mask)
    first = int(nz[0]) if nz.size else length
    sl = slice(first, length)
    adv = float_array(rec["advantages"], where, "advantages")[sl] if isinstance(rec.get("advantages"), list) else None
    reward = rec.get("rewards")
    if isinstance(reward, list) and len(reward) == 1:
        reward = reward[0]
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))):
        raise LabError(f"{where}: 'rewards' is {reward!r:.40}; expected a number")
    mask = token_mask[sl] & bool(sample_ok)
    buf.add("", step, idx,
            {"token_id": int_array(rec["token_ids"], where, "token_ids")[sl], "loss_mask": mask,
             "sampler_logp": float_array(rec["generation_logprobs"], where, "generation_logprobs")[sl],
             "old_logp": float_array(rec["prev_logprobs"], where, "prev_logprobs")[sl], "advantage": adv},
            {"reward": None if reward is None else float(reward),
             "advantage": None if adv is None or not token_mask[sl].any() else float(adv[np.argmax(token_mask[sl])]),
             "origin": where})
