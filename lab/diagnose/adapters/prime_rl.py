"""prime-rl token exports -> neutral log.

prime-rl's trainer writes, with ``trainer.enable_token_export = true``, one JSONL record per exported sequence
(``rl/token_export.py``, schema_version 1): first (2026-05-21, e971d905a) to ``<output_dir>/token_exports/
rank_<rank>.jsonl``, since badd2b0fe to ``token_exports/step_<step>/rank_<rank>.jsonl``; from 941019f2e (2026-06)
until multi-tenant runs were removed (289562d2e, 2026-08) with ``export_step`` and ``run_id`` and, per run,
``<output_dir>/<run_id>/token_exports/...``. A record holds ``step``, ``rank``, ``micro_step``,
``micro_sequence_idx``, ``export_sequence_idx``, ``env_name`` and aligned per-token lists over the packed sequence
(prompt and completion, trailing padding trimmed): ``token_ids``, ``position_ids``, ``loss_mask``, ``advantages``,
``inference_logprobs``, ``trainer_logprobs``, ``entropy``, ``mismatch_kl``, ..., until 0be5ac452 (2026-06-27)
``rewards`` and ``training_mode``, since then ``rl_weights``, ``ce_weights``, ``ref_kl_weights`` (lists of null
when the micro-batch has no such stream: the defaults, rl on the loss mask). Non-finite floats are written as null.
No group id, no policy version.

Which tokens carry the sampler's log-probs: prime-rl computes its mismatch metric (``mismatch_kl``) on
``loss_mask & (rl_weights != 0 | ref_kl_weights != 0)`` when either stream is present, on ``loss_mask`` otherwise,
and on no token of a ``training_mode == "sft"`` micro-batch (``rl/train.py``): the other tokens are routed to the
cross-entropy (distillation) loss, keep ``loss_mask`` true, but carry another model's tokens and log-probs. The
neutral log's ``loss_mask`` is that same set (the excluded tokens are counted in the log's notes).

Mapping: sampler_logp = inference_logprobs (the inference server's), old_logp = trainer_logprobs (the trainer's
forward pass at that step; prime-rl takes one optimiser step per batch). The response is the span from the first
to the last token of prime-rl's loss mask (prompt tokens are dropped; masked-out gaps such as tool outputs stay).
run = run_id (or ""), step = export_step, else step, sample_id = the record's order within (run, step) over ranks
and lines, reward = the first non-null per-token reward on a loss-masked token, origin = "file:line".
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from lab.diagnose.adapters.common import SequenceBuffer, float_array, int_array, int_field, json_line, mask_array
from lab.diagnose.neutral import NeutralLogWriter
from lab.diagnose.schema import make_meta
from lab.errors import LabError

LOGP = {"sampler_logp": "prime-rl inference_logprobs: the inference server's (vLLM) log-probs of the sampled tokens",
        "old_logp": "prime-rl trainer_logprobs: the trainer's log-probs from its forward pass at the step",
        "current_logp": None}
SCHEMA_VERSIONS = (1, 2)
REQUIRED = ("token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs")
WEIGHT_STREAMS = ("rl_weights", "ce_weights", "ref_kl_weights")
_STEP, _RANK = re.compile(r"step_(\d+)$"), re.compile(r"rank_(\d+)\.jsonl$")


def find_files(path: Path) -> list[Path]:
    """The export files under ``path`` (or ``path`` itself), ordered by run folder, step folder and rank."""
    path = Path(path)
    if not path.exists():
        raise LabError(f"{path}: no such file or folder")
    if path.is_file():
        return [path]
    files = [f for f in path.rglob("rank_*.jsonl")
             if _RANK.search(f.name) and (_STEP.search(f.parent.name) or f.parent.name == "token_exports")]
    if not files:
        raise LabError(f"{path}: no prime-rl token exports (token_exports/step_N/rank_R.jsonl) found; enable them "
                       f"with trainer.enable_token_export = true")

    def key(f: Path):
        step = _STEP.search(f.parent.name)
        root = f.parent.parent if step else f.parent
        return (str(root), int(step.group(1)) if step else -1, int(_RANK.search(f.name).group(1)))

    return sorted(files, key=key)


def _advantages(rec: dict, n: int, where: str):
    adv = rec.get("advantages")
    if adv is not None:
        return float_array(adv, where, "advantages")
    losses = rec.get("losses")  # later releases: per-token {"rl": {"advantage": a, "mask": m}, ...}
    if isinstance(losses, list) and len(losses) == n:
        rl = [x.get("rl") if isinstance(x, dict) else None for x in losses]
        return float_array([x.get("advantage") if isinstance(x, dict) else None for x in rl], where,
                           "losses[t].rl.advantage")
    return None


def convert(path, out, *, trust: bool = False, sampling: dict | None = None, progress=None) -> Path:
    """Convert the token exports under ``path`` into a neutral log at ``out``."""
    files = find_files(Path(path))
    temps = set()
    counters: dict = {}
    tally = {"skipped": 0, "not_sampled": 0}
    writer = NeutralLogWriter(out, make_meta("prime-rl", LOGP, **(sampling or {})))
    try:
        buf = SequenceBuffer(writer)
        for f in files:
            dir_step = _STEP.search(f.parent.name)
            with open(f, "rb") as fh:
                for lineno, line in enumerate(fh, 1):
                    where = f"{f}:{lineno}"
                    if not line.strip():
                        continue
                    _add_record(buf, _parse_record(line, where), where, dir_step, counters, temps, tally)
        buf.flush()
        _finish_meta(writer.meta, temps, sampling, tally)
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _parse_record(line: bytes, where: str) -> dict:
    """One JSONL line as a record: a JSON object of a known schema_version whose REQUIRED fields are lists, and
    whose per-token lists all have len(token_ids) entries."""
    rec = json_line(line, where)
    if not isinstance(rec, dict):
        raise LabError(f"{where}: expected a JSON object per line, got {type(rec).__name__}")
    version = rec.get("schema_version")
    if version not in SCHEMA_VERSIONS or isinstance(version, bool):
        raise LabError(f"{where}: schema_version {version!r:.40} is not a prime-rl token export this adapter "
                       f"reads ({', '.join(map(str, SCHEMA_VERSIONS))})")
    for k in REQUIRED:
        if not isinstance(rec.get(k), list):
            raise LabError(f"{where}: field {k!r} is missing or not a list")
    n = len(rec["token_ids"])
    for k in (*REQUIRED[1:], "advantages", "rewards", "entropy", "temperatures", *WEIGHT_STREAMS):
        v = rec.get(k)
        if v is not None and not isinstance(v, list):
            raise LabError(f"{where}: field {k!r} is {v!r:.40}; expected a list with one entry per token")
        if isinstance(v, list) and len(v) != n:
            raise LabError(f"{where}: {k!r} has {len(v)} entries but 'token_ids' has {n}")
    return rec


def sampled_mask(rec: dict, mask: np.ndarray, where: str) -> np.ndarray:
    """The loss-masked tokens that carry the policy's own sampler log-probs (prime-rl's mismatch mask): none in a
    ``training_mode == "sft"`` record; ``loss_mask & (rl_weights != 0 | ref_kl_weights != 0)`` when either stream
    is present (an absent rl stream means rl on the loss mask); else the loss mask."""
    if rec.get("training_mode") == "sft":
        return np.zeros_like(mask)
    streams = {}
    for k in WEIGHT_STREAMS:
        v = rec.get(k)
        if isinstance(v, list) and any(x is not None for x in v):
            streams[k] = float_array(v, where, k)
    if not streams:
        return mask
    sampled = streams["rl_weights"] != 0 if "rl_weights" in streams else mask.copy()
    if "ref_kl_weights" in streams:
        sampled |= streams["ref_kl_weights"] != 0
    return mask & sampled


def _add_record(buf: SequenceBuffer, rec: dict, where: str, dir_step, counters: dict, temps: set,
                tally: dict) -> None:
    """Add the record's response (first to last loss-masked token) to ``buf`` as the next sample_id of its (run,
    step), with loss_mask limited to the sampled tokens; collects its temperatures. Records without a loss-masked
    token are skipped, and counted."""
    n = len(rec["token_ids"])
    loss = mask_array(rec["loss_mask"], where, "loss_mask")
    if not loss.any():
        tally["skipped"] += 1
        return
    mask = sampled_mask(rec, loss, where)
    tally["not_sampled"] += int(loss.sum() - mask.sum())
    first = int(np.argmax(loss))
    last = n - 1 - int(np.argmax(loss[::-1]))
    sl = slice(first, last + 1)
    tokens = int_array(rec["token_ids"], where, "token_ids")
    adv = _advantages(rec, n, where)
    ent = rec.get("entropy")
    rewards = rec.get("rewards")
    reward = _first_finite(float_array(rewards, where, "rewards"), sl, loss) if isinstance(rewards, list) else None
    if isinstance(rec.get("temperatures"), list):
        t = float_array(rec["temperatures"], where, "temperatures")
        temps.update(t[np.isfinite(t)].tolist())
    run, step = _run_step(rec, where, dir_step)
    sid = counters.get((run, step), 0)
    counters[(run, step)] = sid + 1
    seq_adv = None if adv is None else _first_finite(adv, sl, loss)
    buf.add(run, step, sid,
            {"token_id": tokens[sl], "loss_mask": mask[sl],
             "sampler_logp": float_array(rec["inference_logprobs"], where, "inference_logprobs")[sl],
             "old_logp": float_array(rec["trainer_logprobs"], where, "trainer_logprobs")[sl],
             "advantage": None if adv is None else adv[sl],
             "entropy": None if not isinstance(ent, list) else float_array(ent, where, "entropy")[sl]},
            {"reward": reward, "advantage": seq_adv, "origin": where})


def _first_finite(x: np.ndarray, sl: slice, mask: np.ndarray) -> float | None:
    """The first finite value of ``x`` on a loss-masked token of the span ``sl``, else None."""
    v = x[sl][mask[sl]]
    v = v[np.isfinite(v)]
    return float(v[0]) if v.size else None


def _run_step(rec: dict, where: str, dir_step) -> tuple[str, int]:
    """(run, step): run_id (or ""), and export_step, else step, else the step_N folder's N."""
    run = rec.get("run_id") or ""
    if not isinstance(run, (str, int)) or isinstance(run, bool):
        raise LabError(f"{where}: 'run_id' is {run!r:.40}; expected a string or null")
    run = str(run)
    step, export_step = int_field(rec, "step", where), int_field(rec, "export_step", where)
    step = export_step if export_step is not None else step
    if step is None and dir_step:
        step = int(dir_step.group(1))
    if step is None:
        raise LabError(f"{where}: record has no integer 'export_step' or 'step'")
    return run, step


def _finish_meta(meta: dict, temps: set, sampling: dict | None, tally: dict) -> None:
    """The one temperature the records carry, unless given; notes counting the records skipped and the tokens
    routed to another loss."""
    if len(temps) == 1 and (sampling or {}).get("temperature") is None:
        meta["sampling"]["temperature"] = temps.pop()
    if tally["skipped"]:
        meta["notes"].append(f"{tally['skipped']} records without loss-masked tokens skipped")
    if tally["not_sampled"]:
        meta["notes"].append(f"{tally['not_sampled']} loss-masked tokens routed to the cross-entropy (distillation) "
                             f"loss carry another model's log-probs; left out of the loss mask, as prime-rl leaves "
                             f"them out of its mismatch metrics")
