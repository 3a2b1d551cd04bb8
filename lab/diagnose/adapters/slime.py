"""slime debug dumps -> neutral log.

Where slime writes them (``utils/arguments.py``): ``--dump-details DIR`` sets ``--save-debug-rollout-data
DIR/rollout_data/{rollout_id}.pt`` and ``--save-debug-train-data DIR/train_data/{rollout_id}.pt`` (before the
2026-08 refactor, 681b3adca: ``train_data/{rollout_id}_{rank}.pt``); either flag can also be given alone with any
path template (the docs use ``/your/saved/debug/train_{rollout_id}.pt``). All are ``torch.save`` files. PATH may
be the DIR, its train_data/ folder, a folder of such files, or one train file; files are recognised by content.
Evaluation rollouts (``RolloutManager.eval``, since 48c16f123, 2025-10) go through the rollout template with
rollout_id ``eval_{rollout_id}`` (``rollout_data/eval_0.pt`` beside ``rollout_data/0.pt``) and the same payload;
they are not training data and are left out by that name.

- rollout dump: ``{"rollout_id", "samples": [Sample.to_dict()]}`` with ``group_index``, ``index``, ``tokens``
  (prompt + response), ``response_length``, ``reward``, ``loss_mask``, ``weight_versions`` (the SGLang weight
  version of each generation call), ``rollout_log_probs``, ...
- train dump, format_version 2 (``observability/train_data_utils.py``): written once per rollout by the last
  pipeline stage's TP-0 / CP-0 / DP-source rank: ``{"format_version": 2, "rollout_id", "rank", "samples": [...],
  "dp_shards": [...], "raw_reward"}``; each sample holds ``data_parallel_rank``, ``sample_index``,
  ``rollout_position`` (its index in the rollout dump's samples), ``tokens``, ``response_lengths``,
  ``total_lengths``, ``loss_masks``, ``rollout_log_probs``, ``log_probs`` (the trainer's, before the update),
  ``advantages``, ... (tensors over the whole response, context-parallel pieces gathered).
- train dump before 681b3adca (``utils/train_dump_utils.py``): EVERY rank writes ``{"rollout_id", "rank",
  "rollout_data": {column: [one entry per sample of its data-parallel shard]}}``. Tensor-parallel and
  context-parallel ranks of one shard hold the same samples (identical files under TP); only last-stage pipeline
  ranks hold ``log_probs``; with context parallelism each rank's log-prob tensors are its CP slice. The adapter
  groups the files by the samples they hold (one group per data-parallel shard), takes the lowest rank that has
  whole-response ``log_probs`` in each group, and refuses a group where no file has them. slime's FSDP backend
  (fsdp_utils/actor.py, fd6ebde2a 2025-11-01 until its removal in e4faf6330, 2026-03-04) wrote the same per-rank
  files with its log-probs kept in the packed batches, so without ``log_probs``: refused.

Mapping: sampler_logp = rollout_log_probs, old_logp = log_probs, response tokens = the last response_lengths of
``tokens``; group_id, reward and versions from the rollout dump's sample at ``rollout_position`` (else the one
with the same ``index``); a reward that is a dict (a reward model returning several, picked by ``--reward-key``)
is taken from the train sample's ``local_raw_reward`` (slime's pick, dumped since c1dd9ab24, 2026-08-12) when it is
there; step = rollout_id; sample_id = rollout_position (else sample_index).

Kept sets (top-p "sampling mask" replay, slime PR 2102, ``utils/types.py`` ``Sample``): with ``--rollout-top-p`` < 1
slime records each response token's kept set as ``rollout_top_p_token_ids`` (int32, flat) and
``rollout_top_p_token_offsets`` (int32, response_length + 1 entries from 0; token i's set is
ids[offsets[i]:offsets[i + 1]], an empty span where no set was recorded, e.g. appended tool tokens), puts both in
the train data (``ray/rollout.py``) and so in both dumps, and renormalises the trainer's ``log_probs`` over them
(``backends/megatron_utils/loss.py``: the keep mask on the logits). They become ``kept_token_ids`` (empty spans:
null), from the train sample, else from the rollout sample.

Policy versions (``train.py``, ``train_async.py``, ``update_weight/*``): slime pushes the weights to SGLang once
before its loop and again after each rollout's training (train_async.py: after every ``--update-weights-interval``
N-th rollout, default 1), counting pushes from 0 in each process, so a fresh train.py run's rollout k is generated
with version k + 1 and a run resumed at rollout s (``--start-rollout-id`` or a checkpoint) restarts at version 1.
Versions are counted in the trainer's unit, rollouts trained (``_Versions``): the trainer consuming rollout k of a
segment that began at rollout s with weight version v_s is at ``k - s + v_s``, and weight version v at ``v_s`` plus
the rollouts trained when it was pushed (v itself with a push per rollout; N per version with an interval of N):
lag 0 for train.py, 1 for train_async.py after its first rollout, 1..N with an interval of N. A segment begins at
the first rollout of the dump and wherever the versions drop. When a dump begins mid-run, the first rollout's lag
is taken as 0 (noted in the log).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lab.diagnose.adapters.common import SequenceBuffer, float_array, int_array, int_version, mask_array
from lab.diagnose.neutral import NeutralLogWriter, kept_sets_from_offsets
from lab.diagnose.safe_load import torch_load
from lab.diagnose.schema import make_meta
from lab.errors import LabError

LOGP = {"sampler_logp": "slime rollout_log_probs: the rollout engine's (SGLang) log-probs of the sampled tokens",
        "old_logp": "slime log_probs: the trainer's (Megatron) log-probs before the update (renormalised over the "
                    "sampler's top-p kept set when slime replays it)", "current_logp": None}
_NUM = re.compile(r"(\d+)(?:_(\d+))?\.pt$")


# ------------------------------------------------------------------------------------------------ finding files
@dataclass
class _Files:
    train: dict = field(default_factory=dict)    # rollout_id -> [path]
    rollout: dict = field(default_factory=dict)  # rollout_id -> path


def _discover(path: Path, trust: bool) -> _Files:
    path = Path(path)
    if not path.exists():
        raise LabError(f"{path}: no such file or folder")
    out = _Files()
    root = path.parent if path.is_file() else path
    if root.name in ("train_data", "rollout_data"):
        root = root.parent
    if (root / "train_data").is_dir():  # --dump-details layout: the folder says what each file is
        for kind, folder in (("train", root / "train_data"), ("rollout", root / "rollout_data")):
            for f in sorted(folder.glob("*.pt")) if folder.is_dir() else []:
                m = _NUM.fullmatch(f.name)  # not rollout_data/eval_{rollout_id}.pt (evaluation rollouts)
                if m and (kind == "train" or m.group(2) is None):
                    _put(out, kind, int(m.group(1)), f)
        if path.is_file():
            out.train = {rid: [f for f in fs if f == path] for rid, fs in out.train.items() if path in fs}
    else:  # a folder of --save-debug-*-data files named by any template: classify by content
        files = [path] if path.is_file() else sorted(path.glob("*.pt"))
        if path.is_file():
            files += [f for f in sorted(path.parent.glob("*.pt")) if f != path]
        found = []
        for f in files:
            payload = torch_load(f, trust)
            kind, rid = _classify(payload, f)
            del payload
            if kind == "train" and path.is_file() and f != path:
                continue
            found.append((kind, rid, f))
        rollouts = [(rid, f) for kind, rid, f in found if kind == "rollout"]
        evals = {f for rid, f in rollouts if re.search(rf"(?:^|[^A-Za-z0-9])eval_{rid}(?!\d)", f.stem)}
        if len(evals) == len(rollouts):  # the template itself says eval_: none is an evaluation dump
            evals = set()
        for kind, rid, f in found:
            if f not in evals:
                _put(out, kind, rid, f)
    if not out.train:
        raise LabError(f"{path}: no slime train dumps found (--dump-details DIR writes DIR/train_data/"
                       f"{{rollout_id}}.pt; --save-debug-train-data writes the path it is given); the trainer's "
                       f"log-probs are only in the train dumps")
    return out


def _put(out: _Files, kind: str, rid: int, f: Path) -> None:
    if kind == "train":
        out.train.setdefault(rid, []).append(f)
    elif rid in out.rollout:
        raise LabError(f"{f}: a second rollout dump for rollout {rid} (also {out.rollout[rid]}); keep one")
    else:
        out.rollout[rid] = f


def _classify(payload, f: Path) -> tuple[str, int]:
    """("train" | "rollout", rollout_id) of a loaded dump."""
    if not isinstance(payload, dict):
        raise LabError(f"{f}: expected a dict (a slime debug dump), got {type(payload).__name__}")
    rid = payload.get("rollout_id")
    if isinstance(rid, bool) or not isinstance(rid, int) or rid < 0:
        raise LabError(f"{f}: 'rollout_id' is {rid!r:.40}; expected a non-negative integer (a slime debug dump)")
    if "format_version" in payload or isinstance(payload.get("rollout_data"), dict):
        return "train", rid
    if isinstance(payload.get("samples"), list):
        return "rollout", rid
    raise LabError(f"{f}: neither a slime train dump (format_version 2, or 'rollout_data') nor a rollout dump "
                   f"('samples')")


# ------------------------------------------------------------------------------------------------ train samples
def _v2_samples(payload: dict, f: Path, info: dict) -> list:
    version = payload["format_version"]
    if isinstance(version, bool) or not isinstance(version, int) or version != 2:
        raise LabError(f"{f}: format_version {version!r:.40} is not supported (2 is)")
    samples = payload.get("samples")
    if not isinstance(samples, list):
        raise LabError(f"{f}: 'samples' is missing or not a list")
    shards = payload.get("dp_shards")
    steps = [len(d["num_microbatches"]) for d in (shards if isinstance(shards, list) else [])
             if isinstance(d, dict) and isinstance(d.get("num_microbatches"), (list, tuple))]
    info["rollouts"] += 1
    info["multi_step"] += bool(steps) and max(steps) > 1  # num_microbatches: one entry per optimizer step
    return [(f, i, s) for i, s in enumerate(samples)]


def _legacy_columns(payload: dict, f: Path) -> list[dict]:
    cols = payload["rollout_data"]
    n_col = cols.get("response_lengths")
    if not isinstance(n_col, (list, tuple)):
        raise LabError(f"{f}: 'rollout_data' has no 'response_lengths' list")
    n = len(n_col)
    per_sample = {k: v for k, v in cols.items() if isinstance(v, (list, tuple)) and len(v) == n and k != "raw_reward"}
    samples = [{k: v[i] for k, v in per_sample.items()} for i in range(n)]
    for s in samples:
        s["sample_index"] = s.pop("sample_indices", None)
    return samples


def _fingerprint(samples: list[dict], f: Path) -> tuple:
    """What identifies a data-parallel shard's samples: their sample indices and token counts and sums."""
    out = []
    for i, s in enumerate(samples):
        toks = s.get("tokens")
        arr = int_array(toks if toks is not None else [], f"{f} sample {i}", "tokens")
        out.append((_sample_index(s.get("sample_index"), f"{f} sample {i}"), arr.size, int(arr.sum()),
                    int(arr[-1]) if arr.size else -1))
    return tuple(out)


def _sample_index(v, where: str):
    """A sample's ``sample_index`` as an int (None when absent); one LabError for anything but an integer."""
    if v is None:
        return None
    if hasattr(v, "item") and getattr(v, "ndim", None) == 0:
        v = v.item()
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise LabError(f"{where}: 'sample_index' is {v!r:.40}; expected an integer")
    return int(v)


def _log_probs_state(samples: list[dict]) -> str:
    """"whole" when every sample's log_probs cover its response, "slice" when some are shorter (a context-parallel
    slice), "none" when the file has no log_probs (not a last pipeline stage)."""
    lps = [s.get("log_probs") for s in samples]
    if not samples or all(x is None for x in lps):
        return "none"
    try:
        ok = all(x is not None and _length(x) == int(s["response_lengths"]) for x, s in zip(lps, samples))
    except (KeyError, TypeError, ValueError, OverflowError):
        return "whole"  # malformed: the sample checks name the field
    return "whole" if ok else "slice"


def _length(x) -> int:
    return int(x.numel()) if hasattr(x, "numel") else len(x) if isinstance(x, (list, tuple)) else -1


def _train_samples(files: list[Path], trust: bool, info: dict) -> list:
    """(file, index in file, sample dict) for every training sample of one rollout: a format_version 2 file's
    samples (counting in ``info`` the rollouts trained in more than one optimizer step), or per-rank files grouped
    by the samples they hold, one file per group (the lowest rank with whole-response log_probs)."""
    groups: dict = {}  # fingerprint -> {"files": [...], "best": (rank, f, samples) | None, "slice": bool}
    for f in sorted(files, key=lambda f: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", f.name)]):
        payload = torch_load(f, trust)
        if not isinstance(payload, dict):
            raise LabError(f"{f}: expected a dict, got {type(payload).__name__}")
        if "format_version" in payload:
            if len(files) > 1:
                raise LabError(f"{f}: one of several train dumps for rollout {payload.get('rollout_id')} "
                               f"({', '.join(x.name for x in files)}); keep one")
            return _v2_samples(payload, f, info)
        if not isinstance(payload.get("rollout_data"), dict):
            raise LabError(f"{f}: neither a format_version 2 train dump nor a per-rank one with 'rollout_data'")
        rank = payload.get("rank") if isinstance(payload.get("rank"), int) else 0
        samples = _legacy_columns(payload, f)
        del payload
        g = groups.setdefault(_fingerprint(samples, f), {"files": [], "best": None, "slice": False})
        g["files"].append(f.name)
        state = _log_probs_state(samples)
        g["slice"] |= state == "slice"
        if state == "whole" and (g["best"] is None or rank < g["best"][0]):
            g["best"] = (rank, f, samples)
    out, seen = [], {}
    for g in groups.values():
        if g["best"] is None:
            first = Path(files[0]).parent / g["files"][0]
            if g["slice"]:
                raise LabError(f"{first}: 'log_probs' are shorter than the responses in {', '.join(g['files'])}: "
                               f"context-parallel slices, which per-rank dumps do not gather; dump with slime from "
                               f"2026-08 on (format_version 2 gathers them)")
            if all(h["best"] is None and not h["slice"] for h in groups.values()):
                raise LabError(f"{first}: no 'log_probs' (the trainer's log-probs) in any train dump of this rollout "
                               f"({', '.join(h for x in groups.values() for h in x['files'])}): slime's FSDP "
                               f"backend (2025-11 to 2026-03) keeps them out of its dumps, and Megatron writes them "
                               f"on the last pipeline stage only; nothing to compare the sampler's log-probs against")
            raise LabError(f"{first}: no 'log_probs' (the trainer's log-probs) in {', '.join(g['files'])}: slime "
                           f"writes them only on the last pipeline stage, and no last-stage file of these samples "
                           f"is here; keep the last stage's train_data files")
        _, f, samples = g["best"]
        for i, smp in enumerate(samples):
            key = smp.get("sample_index")
            if key is not None and key in seen:
                raise LabError(f"{f} sample {i}: sample_index {key} is also in {seen[key]}, which holds other "
                               f"samples; the per-rank files overlap")
            seen[key] = f
        out.extend((f, i, smp) for i, smp in enumerate(samples))
    return out


# ------------------------------------------------------------------------------------------------ versions
class _Versions:
    """Trainer version per rollout: ``k - s + v_s`` within a segment that began at rollout s with weight version v_s
    (the newest version among its samples: older ones are partial rollouts carried over); a segment begins at the
    first rollout and wherever the smallest version drops.

    Weight versions are counted in the trainer's unit, rollouts trained: version v is ``v_s + u(v)`` with u(v) the
    rollouts the trainer had trained when it pushed v, read off the rollout j_v where v first appears (the newest
    version among its samples): ``j_v - s`` for train.py, ``j_v - s - 1`` for train_async.py (which generates rollout
    s + 1 with the segment's first weights, while train.py pushes before it). With a push after every rollout that is
    v itself; train_async.py with ``--update-weights-interval N`` pushes every N rollouts, so v counts N rollouts."""

    def __init__(self):
        self.start = self.v_start = self.prev = None
        self.mid_run = None
        self.pushed: dict = {}  # weight version -> rollouts trained when it was pushed (this segment)
        self.lagged = None  # train_async.py: rollout s + 1 carries the segment's first version
        self.spaced = False  # a version came more than one rollout after the previous one

    def trainer_version(self, rid: int, vmin, vmax=None) -> int | None:
        if vmin is None:
            self.prev = None
            return None
        vmax = vmin if vmax is None else vmax
        if self.start is None or self.prev is None or vmin < self.prev:
            self.start, self.v_start, self.pushed, self.lagged = rid, vmax, {vmax: 0}, None
            if vmax > 1 and self.mid_run is None:
                self.mid_run = (rid, vmax)
        k = rid - self.start
        if k == 1:
            self.lagged = vmax <= self.v_start
        newest = max(self.pushed)
        if vmax > newest:
            self.pushed[vmax] = k - 1 if self.lagged else k
            self.spaced |= self.pushed[vmax] - self.pushed[newest] > vmax - newest
        self.prev = vmin
        return k + self.v_start

    def scale(self, v: int) -> int:
        """A weight version of this segment in the trainer's unit (a version it has not seen pushed: as it is)."""
        u = self.pushed.get(v)
        return v if u is None else self.v_start + u


# ------------------------------------------------------------------------------------------------ conversion
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


def _kept_sets(sample: dict, where: str, n: int):
    """The sample's kept sets (``rollout_top_p_token_ids`` / ``rollout_top_p_token_offsets``) as a list column, None
    when it has none; LabError when only one is there or they do not fit together and the response."""
    ids, offsets = sample.get("rollout_top_p_token_ids"), sample.get("rollout_top_p_token_offsets")
    if ids is None and offsets is None:
        return None
    if ids is None or offsets is None:
        raise LabError(f"{where}: has {'rollout_top_p_token_ids' if offsets is None else 'rollout_top_p_token_offsets'}"
                       f" without {'rollout_top_p_token_offsets' if offsets is None else 'rollout_top_p_token_ids'}; "
                       f"slime writes both")
    ids = int_array(ids, where, "rollout_top_p_token_ids")
    offsets = int_array(offsets, where, "rollout_top_p_token_offsets")
    if offsets.shape != (n + 1,) or offsets[0] != 0 or (np.diff(offsets) < 0).any() or offsets[-1] != ids.size:
        raise LabError(f"{where}: 'rollout_top_p_token_offsets' must be response_lengths + 1 = {n + 1} non-decreasing "
                       f"offsets from 0 to the {ids.size} kept token ids, got {offsets.size} entries from "
                       f"{offsets[0] if offsets.size else None} to {offsets[-1] if offsets.size else None}")
    return kept_sets_from_offsets(ids, offsets)


def _rollout(f: Path | None, trust: bool) -> list:
    if f is None:
        return []
    payload = torch_load(f, trust)
    rollout = payload.get("samples") if isinstance(payload, dict) else None
    if not isinstance(rollout, list):
        raise LabError(f"{f}: expected a dict with a 'samples' list")
    return rollout


def _sample_versions(rs: dict) -> list[int]:
    wv = rs.get("weight_versions")
    wv = [] if wv is None else wv
    versions = [int_version(v) for v in (wv if isinstance(wv, (list, tuple)) else [wv])]
    return [int(v) for v in versions if np.isfinite(v)]


def convert(path, out, *, trust: bool = False, sampling: dict | None = None, progress=None) -> Path:
    files = _discover(Path(path), trust)
    writer = NeutralLogWriter(out, make_meta("slime", LOGP, **(sampling or {})))
    versions = _Versions()
    info = {"rollouts": 0, "multi_step": 0}
    try:
        buf = SequenceBuffer(writer)
        for rid, train_files in sorted(files.train.items()):
            rollout_file = files.rollout.get(rid)
            rollout = _rollout(rollout_file, trust)
            by_index = {s["index"]: s for s in rollout if isinstance(s, dict) and isinstance(s.get("index"), int)}
            all_v = [v for s in rollout if isinstance(s, dict) for v in _sample_versions(s)]
            tv = versions.trainer_version(rid, min(all_v) if all_v else None, max(all_v) if all_v else None)
            seen: dict = {}
            for f, i, s in _train_samples(train_files, trust, info):
                _add_sample(buf, rid, f, i, s, rollout, by_index, tv, versions.scale, seen)
        buf.flush()
        if info["multi_step"]:
            writer.meta["notes"].append(
                f"{info['multi_step']} of {info['rollouts']} rollouts were trained in more than one optimizer step: "
                f"if the run used --use-rollout-logprobs without --get-mismatch-metrics, slime (since 2026-08-12, "
                f"681b3adca) dumps log_probs taken in the training forward, so for samples trained after the first "
                f"step they follow the earlier updates and trainer old / sampler also holds that drift")
        if versions.spaced:
            writer.meta["notes"].append("slime pushed its weights less often than once per rollout (train_async.py "
                                        "--update-weights-interval): weight versions are counted in rollouts "
                                        "trained, the trainer's unit, so a version spans several")
        if versions.mid_run is not None:
            rid, v = versions.mid_run
            writer.meta["notes"].append(f"the dump begins mid-run (rollout {rid} was generated with weight version "
                                        f"{v}, not 1): staleness takes the trainer to be at that version then")
        return writer.close()
    except BaseException:
        writer.abort()
        raise


def _add_sample(buf, rid: int, f: Path, i: int, s, rollout: list, by_index: dict, tv, scale, seen: dict) -> None:
    where = f"{f} sample {i}"
    if not isinstance(s, dict):
        raise LabError(f"{where}: expected a dict, got {type(s).__name__}")
    try:
        n, total = int(s["response_lengths"]), int(s["total_lengths"])
        pos, idx = (None if s.get(k) is None else int(s[k]) for k in ("rollout_position", "sample_index"))
    except (KeyError, TypeError, ValueError, OverflowError):
        raise LabError(f"{where}: needs integer 'response_lengths' and 'total_lengths' (and "
                       f"'rollout_position', 'sample_index' when present)") from None
    toks = int_array(s["tokens"] if s.get("tokens") is not None else [], where, "tokens")
    if toks.size != total or not 0 <= n <= total:
        raise LabError(f"{where}: 'tokens' has {toks.size} entries but total_lengths is {total} "
                       f"(response_lengths {n})")
    mask = mask_array(s["loss_masks"], where, "loss_masks") if s.get("loss_masks") is not None else np.ones(n, bool)
    if mask.shape != (n,):
        raise LabError(f"{where}: 'loss_masks' has {mask.size} entries but response_lengths is {n}")
    rs = rollout[pos] if pos is not None and 0 <= pos < len(rollout) else by_index.get(idx)
    rs = rs if isinstance(rs, dict) else {}
    versions = [scale(v) for v in _sample_versions(rs)]
    reward = next((r for r in (rs.get("reward"), s.get("local_raw_reward"))  # a dict of rewards: slime's pick
                   if isinstance(r, (int, float)) and not isinstance(r, bool)), None)
    reward = None if reward is None else float(reward)
    group = rs.get("group_index")
    if group is not None and (isinstance(group, bool) or not isinstance(group, int)):
        raise LabError(f"{where}: the rollout sample's 'group_index' is {group!r:.40}; expected an integer")
    adv = _vec(s, "advantages", where, n, required=False)
    kept = _kept_sets(s, where, n)
    if kept is None and rs.get("rollout_top_p_token_ids") is not None:
        kept = _kept_sets(rs, f"{where} (its rollout sample)", n)
    seq_adv = float(adv[np.argmax(mask)]) if adv is not None and mask.any() else None
    sid = pos if pos is not None else (idx if idx is not None else i)
    if sid in seen:
        raise LabError(f"{where}: sample {sid} of rollout {rid} appears twice (also {seen[sid]})")
    seen[sid] = where
    buf.add("", rid, sid,
            {"token_id": toks[total - n:], "loss_mask": mask,
             "sampler_logp": _vec(s, "rollout_log_probs", where, n), "old_logp": _vec(s, "log_probs", where, n),
             "advantage": adv, "entropy": _vec(s, "entropy", where, n, required=False),
             "version": np.full(n, versions[0] if len(set(versions)) == 1 else np.nan), "kept_token_ids": kept},
            {"group_id": group, "reward": reward, "advantage": seq_adv,
             "version_min": min(versions) if versions else None,
             "version_max": max(versions) if versions else None, "trainer_version": tv, "origin": where})
