"""prime-rl token exports -> neutral log.

prime-rl's trainer writes, with ``trainer.enable_token_export = true``, one JSONL record per exported sequence to
``<output_dir>/token_exports/step_<step>/rank_<rank>.jsonl`` (multi-run trainers: ``<output_dir>/<run_id>/
token_exports/...``), ``schema_version`` 1 (2 in later releases, same fields for this purpose). A record holds
``step``, ``export_step``, ``rank``, ``micro_step``, ``micro_sequence_idx``, ``export_sequence_idx``, ``run_id``,
``env_name`` and aligned per-token lists over the packed sequence (prompt and completion): ``token_ids``,
``position_ids``, ``loss_mask``, ``advantages``, ``rewards``, ``inference_logprobs``, ``trainer_logprobs``,
``entropy``, ``mismatch_kl``, ``log_importance_ratio``, ``importance_ratio``, ``prob_delta``, ``is_masked*``;
non-finite floats are written as null (prime-rl ``rl/token_export.py``). No group id, no policy version.

Mapping: sampler_logp = inference_logprobs (the inference server's), old_logp = trainer_logprobs (the trainer's
forward pass at that step; prime-rl takes one optimiser step per batch). The response is the span from the first
to the last loss-masked token (prompt tokens are dropped; masked-out gaps such as tool outputs stay, loss_mask 0).
run = run_id (or ""), step = export_step, sample_id = the record's order within (run, step) over ranks and lines,
reward = the first non-null per-token reward on a loss-masked token, origin = "file:line".
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from lab.diagnose.adapters.common import SequenceBuffer, float_array, int_array, mask_array
from lab.diagnose.neutral import NeutralLogWriter
from lab.diagnose.schema import make_meta
from lab.errors import LabError

LOGP = {"sampler_logp": "prime-rl inference_logprobs: the inference server's (vLLM) log-probs of the sampled tokens",
        "old_logp": "prime-rl trainer_logprobs: the trainer's log-probs from its forward pass at the step",
        "current_logp": None}
SCHEMA_VERSIONS = (1, 2)
REQUIRED = ("token_ids", "loss_mask", "inference_logprobs", "trainer_logprobs")
_STEP, _RANK = re.compile(r"step_(\d+)$"), re.compile(r"rank_(\d+)\.jsonl$")


def find_files(path: Path) -> list[Path]:
    path = Path(path)
    if not path.exists():
        raise LabError(f"{path}: no such file or folder")
    if path.is_file():
        return [path]
    files = [f for f in path.rglob("rank_*.jsonl") if _STEP.search(f.parent.name) and _RANK.search(f.name)]
    if not files:
        raise LabError(f"{path}: no prime-rl token exports (token_exports/step_N/rank_R.jsonl) found; enable them "
                       f"with trainer.enable_token_export = true")

    def key(f: Path):
        return (str(f.parent.parent), int(_STEP.search(f.parent.name).group(1)), int(_RANK.search(f.name).group(1)))

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
    skipped = 0
    writer = NeutralLogWriter(out, make_meta("prime-rl", LOGP, **(sampling or {})))
    try:
        buf = SequenceBuffer(writer)
        for f in files:
            dir_step = _STEP.search(f.parent.name)
            with open(f, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    where = f"{f}:{lineno}"
                    if not line.strip():
                        continue
                    if not _add_record(buf, _parse_record(line, where), where, dir_step, counters, temps):
                        skipped += 1
        buf.flush()
        _finish_meta(writer.meta, temps, sampling, skipped)
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _parse_record(line: str, where: str) -> dict:
    """One JSONL line as a record: a JSON object of a known schema_version whose REQUIRED fields are lists, and
    whose per-token lists all have len(token_ids) entries."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as e:
        raise LabError(f"{where}: not valid JSON ({e.msg} at column {e.colno}; a truncated line?)") from None
    if not isinstance(rec, dict):
        raise LabError(f"{where}: expected a JSON object per line, got {type(rec).__name__}")
    version = rec.get("schema_version")
    if version not in SCHEMA_VERSIONS:
        raise LabError(f"{where}: schema_version {version!r} is not a prime-rl token export this adapter "
                       f"reads ({', '.join(map(str, SCHEMA_VERSIONS))})")
    for k in REQUIRED:
        if not isinstance(rec.get(k), list):
            raise LabError(f"{where}: field {k!r} is missing or not a list")
    n = len(rec["token_ids"])
    for k in (*REQUIRED[1:], "advantages", "rewards", "entropy", "temperatures"):
        v = rec.get(k)
        if isinstance(v, list) and len(v) != n:
            raise LabError(f"{where}: {k!r} has {len(v)} entries but 'token_ids' has {n}")
    return rec


def _add_record(buf: SequenceBuffer, rec: dict, where: str, dir_step, counters: dict, temps: set) -> bool:
    """Add the record's response (first to last loss-masked token) to ``buf`` as the next sample_id of its (run,
    step); collects its temperatures. False, adding nothing, when it has no loss-masked token."""
    n = len(rec["token_ids"])
    mask = mask_array(rec["loss_mask"], where, "loss_mask")
    if not mask.any():
        return False
    first = int(np.argmax(mask))
    last = n - 1 - int(np.argmax(mask[::-1]))
    sl = slice(first, last + 1)
    tokens = int_array(rec["token_ids"], where, "token_ids")
    adv = _advantages(rec, n, where)
    ent = rec.get("entropy")
    rewards = rec.get("rewards")
    reward = _first_finite(float_array(rewards, where, "rewards"), sl, mask) if isinstance(rewards, list) else None
    if isinstance(rec.get("temperatures"), list):
        t = float_array(rec["temperatures"], where, "temperatures")
        temps.update(t[np.isfinite(t)].tolist())
    run, step = _run_step(rec, where, dir_step)
    sid = counters.get((run, step), 0)
    counters[(run, step)] = sid + 1
    seq_adv = None if adv is None else _first_finite(adv, sl, mask)
    buf.add(run, int(step), sid,
            {"token_id": tokens[sl], "loss_mask": mask[sl],
             "sampler_logp": float_array(rec["inference_logprobs"], where, "inference_logprobs")[sl],
             "old_logp": float_array(rec["trainer_logprobs"], where, "trainer_logprobs")[sl],
             "advantage": None if adv is None else adv[sl],
             "entropy": None if not isinstance(ent, list) else float_array(ent, where, "entropy")[sl]},
            {"reward": reward, "advantage": seq_adv, "origin": where})
    return True


def _first_finite(x: np.ndarray, sl: slice, mask: np.ndarray) -> float | None:
    """The first finite value of ``x`` on a loss-masked token of the span ``sl``, else None."""
    v = x[sl][mask[sl]]
    v = v[np.isfinite(v)]
    return float(v[0]) if v.size else None


def _run_step(rec: dict, where: str, dir_step) -> tuple[str, int]:
    """(run, step): run_id (or ""), and export_step, else step, else the step_N folder's N."""
    run = rec.get("run_id") or ""
    if not isinstance(run, (str, int)):
        raise LabError(f"{where}: 'run_id' is {run!r:.40}; expected a string or null")
    run = str(run)
    step = rec.get("export_step", rec.get("step"))
    if step is None and dir_step:
        step = int(dir_step.group(1))
    if not isinstance(step, int) or isinstance(step, bool):
        raise LabError(f"{where}: record has no integer 'export_step' or 'step'")
    return run, step


def _finish_meta(meta: dict, temps: set, sampling: dict | None, skipped: int) -> None:
    """The one temperature the records carry, unless given; a note counting the records skipped."""
    if len(temps) == 1 and (sampling or {}).get("temperature") is None:
        meta["sampling"]["temperature"] = temps.pop()
    if skipped:
        meta["notes"].append(f"{skipped} records without loss-masked tokens skipped")
