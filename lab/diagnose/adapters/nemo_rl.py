"""NeMo-RL training-data logs -> neutral log.

NeMo-RL's GRPO and PPO loops (``algorithms/grpo.py``: the synchronous and the asynchronous one; ``grpo_sync.py``,
``ppo.py``) write, unless NeMo Gym responses are logged instead, each step's training batch with
``Logger.log_batched_dict_as_jsonl`` to ``<log_dir>/train_data_step<N>.jsonl`` (N = the step, from 1), where
``log_dir`` is a fresh ``exp_<NNN>`` folder per launch (``get_next_experiment_dir``; a resumed run writes its steps
again into the next one). The logger writes one line per sample from ``make_microbatch_iterator(1)``:
``json.dumps({**batch.slice(i, i + 1), "idx": i}, default=str)``, so every field is the batch's value sliced to one
row: a one-element list (``"rewards": [r]``, ``"token_ids": [[t0, t1, ...]]``). Fields since f11f99c79
(2026-02-21): ``content``, ``rewards``, ``input_lengths`` (the sample's real length), ``token_ids`` [S] (prompt +
response, right-padded to the batch's longest; ``grpo_sync.py`` may omit it), ``token_loss_mask`` [S] (1 on
generated assistant tokens), ``sample_loss_mask`` (0 drops the whole sample from the loss: truncated, filtered, or
over ``seq_logprob_error_threshold``), ``advantages`` [S], ``generation_logprobs`` [S] (the generation engine's, 0
off generated tokens), ``prev_logprobs`` [S] (the training engine's before the update); optional
``filtered_rewards`` (``grpo.use_dynamic_sampling``: the sample's own reward, the one its advantage
used, while ``rewards`` then holds the first rows of the unfiltered batch's rewards, whatever samples the filter
kept: ``dynamic_sampling`` gives the kept rows the pre-filter ``total_reward`` tensor, sliced to the train size),
``agent_ref``. Log-probs at index t are those of token t (NeMo-RL's loss drops column 0).
Earlier logs (and ``distillation.py``'s) hold no token mask and are refused. With
``loss_fn.force_on_policy_ratio`` (and no ``seq_logprob_error_threshold``) NeMo-RL skips the trainer's pass and
logs ``prev_logprobs`` as zeros (since e7266a92f, 2026-05-12): such a file is refused. No policy version.

Mapping: sampler_logp = generation_logprobs, old_logp = prev_logprobs; loss_mask = token_loss_mask *
sample_loss_mask (NeMo-RL's loss and its token_mult_prob_error use that product); the response spans the first
token_loss_mask token to input_lengths (padding dropped); run = the log file's folder relative to the path given
when the files lie in more than one folder (one per launch), else ""; step = N; sample_id = idx; group_id = the
sample's prompt (its tokens before the first token_loss_mask token), numbered in order of appearance within the
step, as NeMo-RL's baseline groups samples by identical prompt (``calculate_baseline_and_std_per_prompt``);
reward = filtered_rewards when logged, else rewards; origin = "file:line".
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
TOKEN_FIELDS = ("token_loss_mask", "generation_logprobs", "prev_logprobs")
_PER_TOKEN = (*TOKEN_FIELDS, "token_ids", "advantages")
_NAME = re.compile(r"^train_data_step(\d+)\.jsonl$")


def find_files(path: Path) -> list[tuple[str, int, Path]]:
    """(run, step, file) for each training-data log under ``path``; run names the file's folder relative to
    ``path`` when the files lie in more than one folder (NeMo-RL's exp_<NNN> per launch), else ""."""
    path = Path(path)
    if not path.exists():
        raise LabError(f"{path}: no such file or folder")
    candidates = [path] if path.is_file() else list(path.rglob("train_data_step*.jsonl"))
    files = [(int(m.group(1)), f) for f in candidates if (m := _NAME.match(f.name))]
    if not files:
        raise LabError(f"{path}: no NeMo-RL training-data logs (train_data_step<N>.jsonl) found")
    folders = {f.parent for _, f in files}
    run = (lambda f: "") if len(folders) == 1 else (lambda f: f.parent.relative_to(path).as_posix())
    return sorted((run(f), step, f) for step, f in files)


def convert(path, out, *, trust: bool = False, sampling: dict | None = None, progress=None) -> Path:
    files = find_files(Path(path))
    writer = NeutralLogWriter(out, make_meta("nemo-rl", LOGP, **(sampling or {})))
    try:
        buf = SequenceBuffer(writer)
        for run, step, f in files:
            seen, groups, tally = {}, {}, {"loss": 0, "prev": 0, "gen": 0}
            with open(f, "rb") as fh:
                for lineno, line in enumerate(fh, 1):
                    if line.strip():
                        _add_record(buf, run, step, f"{f}:{lineno}", line, seen, groups, tally)
            if tally["loss"] and not tally["prev"] and tally["gen"]:
                raise LabError(f"{f}: 'prev_logprobs' is 0 on every one of its {tally['loss']} loss-masked tokens: "
                               f"NeMo-RL logs zeros there when loss_fn.force_on_policy_ratio skips the trainer's "
                               f"log-prob pass; this step holds no trainer log-probs to compare")
        buf.flush()
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _row(rec: dict, key: str):
    """A field sliced to the sample's row: NeMo-RL's logger writes every value as a one-element list ([r],
    [[t0, t1, ...]]); a value written without that list is taken as it is."""
    v = rec.get(key)
    return v[0] if isinstance(v, list) and len(v) == 1 and (isinstance(v[0], list) or key not in _PER_TOKEN) else v


def _scalar(rec: dict, key: str, where: str):
    v = _row(rec, key)
    if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
        raise LabError(f"{where}: {key!r} is {rec.get(key)!r:.40}; expected a number")
    return v


def _add_record(buf: SequenceBuffer, run: str, step: int, where: str, line: bytes, seen: dict, groups: dict,
                tally: dict) -> None:
    rec = json_line(line, where)
    if not isinstance(rec, dict):
        raise LabError(f"{where}: expected a JSON object per line, got {type(rec).__name__}")
    if "token_loss_mask" not in rec and "input_lengths" in rec:
        raise LabError(f"{where}: field 'token_loss_mask' is missing: NeMo-RL logs it since 2026-02 (f11f99c79); "
                       f"this training-data log (an earlier release's, or distillation's) does not say which tokens "
                       f"were generated")
    cols = {k: _row(rec, k) for k in _PER_TOKEN}
    for k in TOKEN_FIELDS:
        if not isinstance(cols[k], list):
            raise LabError(f"{where}: field {k!r} is missing or not a list")
    S = len(cols["token_loss_mask"])
    for k in ("token_ids", *TOKEN_FIELDS[1:], "advantages"):
        if cols[k] is not None and (not isinstance(cols[k], list) or len(cols[k]) != S):
            n = f"{len(cols[k])} entries" if isinstance(cols[k], list) else f"a {type(cols[k]).__name__}"
            raise LabError(f"{where}: {k!r} has {n} but 'token_loss_mask' has {S}")
    length = _scalar(rec, "input_lengths", where)
    length = int_field({"input_lengths": length}, "input_lengths", where)
    length = S if length is None else length
    if length > S:
        raise LabError(f"{where}: 'input_lengths' is {length} but 'token_loss_mask' has {S} entries")
    sample_ok = _scalar(rec, "sample_loss_mask", where)
    sample_ok = 1 if sample_ok is None else sample_ok
    if sample_ok not in (0, 1):
        raise LabError(f"{where}: 'sample_loss_mask' is {sample_ok!r:.40}; expected 0 or 1")
    token_mask = mask_array(cols["token_loss_mask"], where, "token_loss_mask")[:length]
    idx = int_field(rec, "idx", where, required=True)
    if (step, idx) in seen:
        raise LabError(f"{where}: idx {idx} appears twice in step {step} (also {seen[step, idx]})")
    seen[step, idx] = where
    nz = np.flatnonzero(token_mask)
    first = int(nz[0]) if nz.size else length
    sl = slice(first, length)
    tokens = None if cols["token_ids"] is None else int_array(cols["token_ids"], where, "token_ids")
    group = None if tokens is None else groups.setdefault(tokens[:first].tobytes(), len(groups))
    adv = None if cols["advantages"] is None else float_array(cols["advantages"], where, "advantages")[sl]
    reward = _scalar(rec, "filtered_rewards" if "filtered_rewards" in rec else "rewards", where)
    gen = float_array(cols["generation_logprobs"], where, "generation_logprobs")[sl]
    prev = float_array(cols["prev_logprobs"], where, "prev_logprobs")[sl]
    m = token_mask[sl]
    tally["loss"] += int(m.sum())
    tally["prev"] += int(np.count_nonzero(prev[m]))
    tally["gen"] += int(np.count_nonzero(gen[m]))
    buf.add(run, step, idx,
            {"token_id": None if tokens is None else tokens[sl], "loss_mask": m & bool(sample_ok),
             "sampler_logp": gen, "old_logp": prev, "advantage": adv},
            {"group_id": group, "reward": None if reward is None else float(reward),
             "advantage": None if adv is None or not m.any() else float(adv[np.argmax(m)]), "origin": where})
