"""Every damaged dump is one line, never a traceback: each framework's dump (built the way the framework writes it, by
the builders of the adapter tests) is mutated at random, a field deleted, resized, retyped or given a hostile value
(None, strings, containers, 2^70, 1e308, NaN, inf, non-real tensors, ...), and `lab diagnose` must either diagnose it
(exit 0, no warning, a summary that is strict JSON) or refuse it with one line and exit 2, leaving nothing in --out.
Fixed seeds: the same cases every run."""
from __future__ import annotations

import contextlib
import copy
import io
import json
import pickle
import random
import shutil
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from lab.diagnose.cli import main
from test_diagnose_adapters import prime_record, skyrl_batch, skyrl_module, write_prime_export, write_slime_dump
from test_diagnose_frameworks import nemo_rl_log

pytestmark = pytest.mark.slow
CASES = 40  # per format and seed block

HOSTILE = [None, "abc", "", True, 0, -1, 7, 2**31, 2**63, 2**70, -2**70, 1.5, -0.0, float("nan"), float("inf"),
           float("-inf"), 5.0, -1e30, [], {}, [None], [[0.0]], ["a"], {"a": 1}, [1e308] * 3, "1", [0.1] * 300, [True]]


def _tensors():
    return [torch.zeros(0), torch.zeros(3, 2), torch.tensor(1.0), torch.ones(5, dtype=torch.bool),
            torch.ones(5, dtype=torch.int64) * 2**40, torch.ones(7, dtype=torch.bfloat16),
            torch.full((5,), float("nan")), torch.ones(5, dtype=torch.complex64), np.ones(4), "x", None, [1, 2]]


def _paths(obj, rnd, pre=()):
    out = [pre] if pre else []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, rnd, pre + (k,))
    elif isinstance(obj, list) and obj and len(obj) < 64:
        for i in rnd.sample(range(len(obj)), min(3, len(obj))):
            out += _paths(obj[i], rnd, pre + (i,))
    return out


def mutate(obj, rnd, tensors: bool) -> str:
    """Change one field of a nested dict/list in place: delete it, resize it, retype it or give it a hostile value."""
    paths = _paths(obj, rnd)
    if not paths:
        return "nothing to change"
    p = rnd.choice(paths)
    parent = obj
    for k in p[:-1]:
        parent = parent[k]
    k, cur, op = p[-1], parent[p[-1]], rnd.random()
    if op < 0.15 and isinstance(parent, dict):
        del parent[k]
        return f"del {p}"
    if op < 0.3 and isinstance(cur, list) and cur:
        n = rnd.choice([0, 1, len(cur) - 1, len(cur) + 1, 2 * len(cur)])
        parent[k] = (cur * 3)[:n]
        return f"{p} resized to {n}"
    if op < 0.4 and torch.is_tensor(cur) and cur.numel() and cur.dim():
        n = rnd.choice([0, 1, cur.shape[0] - 1, cur.shape[0] + 1])
        parent[k] = torch.cat([cur, cur])[:n]
        return f"{p} resized to {n}"
    if op < 0.5 and torch.is_tensor(cur) and cur.numel() and not cur.is_complex():
        v = cur.clone().double()
        v.view(-1)[rnd.randrange(v.numel())] = rnd.choice([float("nan"), float("inf"), 5.0, -1e30, -3.4e38, 0.0])
        parent[k] = v.to(cur.dtype) if cur.is_floating_point() else v
        return f"{p} value"
    if op < 0.55 and torch.is_tensor(cur):
        dtype = rnd.choice([torch.bool, torch.uint8, torch.complex64, torch.float64, torch.int32, torch.bfloat16])
        parent[k] = cur.to(dtype)
        return f"{p} as {dtype}"
    parent[k] = copy.deepcopy(rnd.choice(HOSTILE + (_tensors() if tensors else [])))
    return f"{p} = {parent[k]!r:.40}"


# ------------------------------------------------------------------------------------------------ the formats
def _jsonl(folder_glob):
    def edit(dump, rnd):
        f = rnd.choice(sorted(dump.rglob(folder_glob)))
        lines = f.read_bytes().splitlines()
        i, op = rnd.randrange(len(lines)), rnd.random()
        if op < 0.08:
            lines[i] = lines[i][:rnd.randrange(len(lines[i]))]
        elif op < 0.12:
            lines[i] += b"\xff\xfe"
        elif op < 0.16:
            lines.insert(i, lines[i])
        elif op < 0.2:
            lines.insert(i, rnd.choice([b"null", b"[]", b"1", b'"x"', b"{}"]))
        else:
            try:
                rec = json.loads(lines[i])
            except ValueError:  # a line an earlier edit broke: left broken
                rec = None
            if rec is not None:
                mutate(rec, rnd, tensors=False)
                lines[i] = json.dumps(rec).encode()
        f.write_bytes(b"\n".join(lines) + b"\n")
    return edit


def _build_prime(root):
    rng, records = np.random.default_rng(0), {}
    for step in (1, 2):
        for rank in (0, 1):
            records[(step, rank)] = [prime_record(rng, step, rank, 0, i, i, int(rng.integers(3, 7)),
                                                  int(rng.integers(4, 12)), hole=2 if i == 1 else None)
                                     for i in range(3)]
    write_prime_export(root / "outputs", records)
    return root / "outputs"


def _build_nemo(root):
    rng = np.random.default_rng(5)
    (root / "logs" / "exp_001").mkdir(parents=True)
    for step in (1, 2):
        nemo_rl_log(root / "logs" / "exp_001", step, rng)
    return root / "logs"


def _build_slime(root):
    rng = np.random.default_rng(1)
    for rid in (0, 1):
        write_slime_dump(root / "dump", rid, rng, legacy=rid == 1)
    return root / "dump"


def _edit_slime(dump, rnd):
    f = rnd.choice(sorted(dump.rglob("*.pt")))
    try:
        obj = torch.load(f, weights_only=False)
    except RuntimeError:  # an earlier edit wrote it as a plain pickle
        obj = pickle.loads(f.read_bytes())
    mutate(obj, rnd, tensors=True)
    if rnd.random() < 0.1:  # the payload as a plain pickle, not a torch.save archive
        f.write_bytes(pickle.dumps(obj))
    else:
        torch.save(obj, f)


def _build_skyrl(root, monkeypatch):
    cls = skyrl_module(monkeypatch, True)
    rng = np.random.default_rng(3)
    (root / "dumped_data").mkdir()
    batches = {}
    for step in (1, 2):
        b = skyrl_batch(cls, rng)
        batches[step] = b
        (root / "dumped_data" / f"global_step_{step}_training_input.pkl").write_bytes(pickle.dumps(b))
    return root / "dumped_data", batches


def _edit_skyrl(dump, rnd, batches):
    step = rnd.choice(sorted(batches))
    b = batches[step]
    box = {"batch": {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in b.items()},
           "metadata": copy.deepcopy(b.metadata)}
    mutate(box, rnd, tensors=True)
    out = type(b)(box["batch"] if isinstance(box.get("batch"), dict) else {})
    out.metadata = box.get("metadata")
    try:
        data = pickle.dumps(out)
    except (TypeError, AttributeError, StopIteration):  # a batch the stand-in cannot write: SkyRL could not either
        return
    (dump / f"global_step_{step}_training_input.pkl").write_bytes(data)


def _build_lab(root):
    from lab.cli import main as lab_main

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert lab_main(["train", "--steps", "2", "--rollout-log", "--out", str(root / "run")]) == 0
    return root / "run" / "rollout_log"


def _edit_lab(dump, rnd):
    f = rnd.choice([dump / "tokens.parquet", dump / "sequences.parquet", dump / "meta.json"])
    if f.suffix == ".json":
        meta = json.loads(f.read_text())
        mutate(meta, rnd, tensors=False)
        f.write_text(json.dumps(meta))
        return
    t = pq.read_table(f)
    c = rnd.choice(t.column_names)
    arr, i, op = t[c].to_numpy(zero_copy_only=False), t.column_names.index(c), rnd.random()
    if op < 0.15:
        t = t.drop([c])
    elif op < 0.35:
        t = t.set_column(i, c, pa.array([str(x) for x in arr]) if rnd.random() < 0.5 else
                         pa.array(np.zeros(len(arr), bool)))
    elif op < 0.55:
        t = t.set_column(i, c, pa.array(arr.tolist(), mask=np.arange(len(arr)) % 7 == 3))
    elif arr.dtype.kind in "fiu" and len(arr):
        v = rnd.choice([np.nan, np.inf, -np.inf, 2**62, -1, 1e30, 5.0, 0, -1e300, -3.4e38])
        a = arr.astype(np.float64 if isinstance(v, float) or arr.dtype.kind == "f" else np.int64)
        with np.errstate(over="ignore", invalid="ignore"):
            a[rnd.randrange(len(a))] = v
        t = t.set_column(i, c, pa.array(a))
    pq.write_table(t, f)


# ------------------------------------------------------------------------------------------------ the check
def _outcome(argv, out):
    err = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("always")
        rc = main(argv)
    lines = err.getvalue().splitlines()
    caught = [str(w.message) for w in caught]  # a warning is printed beside the line or the report: never one
    if rc == 2:
        assert len(lines) == 1 and lines[0].startswith("error: ") and not out.exists() and not caught, (
            caught, err.getvalue())
        return "refused"
    assert rc == 0 and not caught and not lines, (rc, caught, err.getvalue())

    def strict(c):
        raise ValueError(f"non-JSON constant {c}")
    json.loads((out / "summary.json").read_text(), parse_constant=strict)
    return "diagnosed"


@pytest.mark.parametrize("fmt", ["prime-rl", "nemo-rl", "slime", "skyrl", "lab"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_damaged_dump_is_diagnosed_or_refused_in_one_line(fmt, seed, tmp_path, monkeypatch):
    pristine = tmp_path / "pristine"
    pristine.mkdir()
    batches = None
    if fmt == "skyrl":
        dump, batches = _build_skyrl(pristine, monkeypatch)
        edit = lambda d, rnd: _edit_skyrl(d, rnd, batches)  # noqa: E731
    else:
        build, edit = {"prime-rl": (_build_prime, _jsonl("*.jsonl")), "nemo-rl": (_build_nemo, _jsonl("*.jsonl")),
                       "slime": (_build_slime, _edit_slime), "lab": (_build_lab, _edit_lab)}[fmt]
        dump = build(pristine)
    rnd = random.Random(f"{fmt}-{seed}")
    seen = {"refused": 0, "diagnosed": 0}
    for case in range(CASES):
        work = tmp_path / f"case{case}"
        shutil.copytree(pristine, work)
        d = work / dump.relative_to(pristine)
        for _ in range(rnd.choice([1, 1, 2])):
            edit(d, rnd)
        seen[_outcome(["--from", fmt, str(d), "--out", str(work / "out")], work / "out")] += 1
        shutil.rmtree(work)
    assert seen["refused"] and seen["diagnosed"]  # the mutations reach both outcomes
