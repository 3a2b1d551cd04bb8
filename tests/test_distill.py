"""On-policy distillation from a real teacher (lab/engine/distill.py): bad input, determinism, exact unbiasedness of
the baselines on the transformer, a student equal to its teacher, distractor vocabularies, the distill sweep kind
(runs, resumes, equals in-process runs). The real_distillation study that aggregates these runs is tested in
lab/studies/real_distillation/tests/."""
import dataclasses
import pandas as pd
import pytest
import torch

import toy_envs
from lab.cli import main as lab_main
from lab.engine.distill import (FAMILY, TIME_COLUMNS, DistillConfig, distil, make_setup, random_setup,
                                sequence_kl)
from lab.engine.exact import Problem
from lab.engine.sweep import SweepSpec, load_results, run_sweep
from lab.errors import LabError
from lab.policies import log_probs_of
from lab.policies.transformer import TransformerPolicy, size_config
from lab.studies.distillation.exact import expected_estimate, per_token_target

# a "small" teacher warm-started to 0.5 on 32 prompts of 2-step chain sums (a few seconds, once), a random "test"
# student, a handful of steps: every run below takes about a second
TINY = dict(n_prompts=32, teacher_size="small", teacher_accuracy=0.5, student_size="test", student_accuracy=0.0,
            batch_size=16, steps=3, grad_every=2, probe_size=8, eval_every=2, eval_prompts=4, eval_samples=4)


pytestmark = pytest.mark.usefixtures("one_thread_module")  # before the module's warm starts


def stable(table: pd.DataFrame) -> pd.DataFrame:
    """The table without its wall-clock columns (the only ones a seed does not fix)."""
    return table.drop(columns=list(TIME_COLUMNS))


# ---- bad input ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change, message", [
    ({"estimator": "vespo"}, "not a distillation estimator"),
    ({"probe_estimators": ["opd", "opd"]}, "more than once"),
    ({"env": "tiny_target"}, "not a task env"),
    ({"teacher_size": "huge"}, "unknown teacher size"),
    ({"teacher_accuracy": 1.0}, "strictly between 0 and 1"),
    ({"student_accuracy": -0.1}, r"\[0, 1\)"),
    ({"distractors": -1}, "distractors must be a whole number from 0"),
    ({"top_k": 0}, "top_k must be a positive"),
    ({"hyper": {"return_to_go": 2}}, "return_to_go"),
    ({"lr": float("nan")}, "lr must be a number"),
    ({"steps": 0}, "steps must be a positive"),
    ({"batch_size": 2.5}, "whole number"),
    ({"eval_prompts": 1000}, "held-out"),
    ({"loss_agg_mode": "sum"}, "loss_agg_mode"),
    ({"device": "tpu"}, "device"),
])
def test_bad_config_is_one_clear_error(change, message):
    with pytest.raises(LabError, match=message) as err:
        DistillConfig(**{**TINY, **change}).validate()
    assert "\n" not in str(err.value)


def test_a_bad_distill_sweep_exits_2_with_one_line(tmp_path, capsys):
    spec = tmp_path / "bad.yaml"
    spec.write_text("name: bad\nkind: distill\nbase: {steps: 2}\ngrid:\n  estimator: [opd, vespo]\n")
    assert lab_main(["sweep", str(spec), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "vespo" in err and "\n" not in err and not (tmp_path / "out").exists()


# ---- the run --------------------------------------------------------------------------------------------------------
def test_same_seed_same_table_and_what_a_row_holds(distill_cache):
    cfg = DistillConfig(**TINY, estimator="vopd", distractors=10)  # V = 20: the embedding grows past 16 token ids
    a, b = distil(cfg), distil(cfg)
    pd.testing.assert_frame_equal(stable(a.table), stable(b.table))
    assert not stable(a.table).equals(stable(distil(dataclasses.replace(cfg, seed=1)).table))
    t = a.table
    assert list(t["update"]) == [1, 2, 3] and (t["vocab_size"] == 20).all()
    assert t["gvar"].notna().tolist() == [False, True, False]  # probes at updates 2, 4, ...
    assert t["kl_seq"].notna().tolist() == [False, True, True]  # every 2 steps and after the last
    assert (t[[f"gvar_{e}" for e in FAMILY]].dropna() > 0).all().all() and (t[list(TIME_COLUMNS)] > 0).all().all()
    assert ((t["value_share"] > 0) & (t["value_share"] < 1)).all()
    assert abs(t["reward_m2"] - t["reward_var_within"] - t["value_share"] * t["reward_m2"]).max() < 1e-9
    assert a.summary["headline"] and all(not isinstance(v, (dict, list)) for v in a.summary.values())
    # eval prompts x V^(T-1) = 80 prefixes > enum_limit 50: sampled, with an interval around it
    sampled = distil(dataclasses.replace(cfg, enum_limit=50)).table.dropna(subset=["kl_seq"])
    assert not sampled["kl_seq_exact"].any() and (sampled["kl_seq_lo"] < sampled["kl_seq"]).all()


@pytest.mark.parametrize("difficulty, distractors", [(3, 0), (2, 3)])
@pytest.mark.slow
def test_sequence_kl_by_prefixes_is_the_kl_of_every_response(difficulty, distractors):
    cfg = DistillConfig(**{**TINY, "difficulty": difficulty, "distractors": distractors, "eval_samples": 400})
    setup = random_setup(cfg)  # no warm start needed: any two networks
    table = setup.env.heldout_prompt_tokens[:4]
    value, lo, hi, exact = sequence_kl(cfg, setup, setup.theta0, table, torch.Generator().manual_seed(0))
    V, T = setup.env.vocab_size, setup.env.length
    grid = torch.cartesian_prod(*[torch.arange(V)] * T)
    prompts, tokens = torch.arange(4).repeat_interleave(grid.shape[0]), grid.repeat(4, 1)
    ls = log_probs_of(setup.student.with_prompts(table).logits(setup.theta0.double(), prompts, tokens), tokens)
    lt = log_probs_of(setup.teacher.with_prompts(table).logits(setup.theta_teacher.double(), prompts, tokens), tokens)
    brute = float((ls.sum(-1).exp() * (ls - lt).sum(-1)).sum()) / 4  # every one of the V^T responses
    assert exact and lo == value == hi and value == pytest.approx(brute, rel=1e-5)
    sampled = dataclasses.replace(cfg, enum_limit=0)
    mc = sequence_kl(sampled, setup, setup.theta0, table, torch.Generator().manual_seed(1))
    assert not mc[3] and mc[1] < brute < mc[2]  # sampled: the exact value inside its 95% interval (fixed seed)


def test_a_student_equal_to_its_teacher_gets_zero_gradient(distill_cache):
    same = dict(TINY, student_size=TINY["teacher_size"], student_accuracy=TINY["teacher_accuracy"], steps=1,
                grad_every=1, estimator="kl_full")
    res = distil(DistillConfig(**same))
    row = res.table.iloc[0]  # one step: Adam would turn the gradient's float32 rounding into a step of size lr
    assert res.summary["initial_kl_seq"] == 0 and row["kl_token"] == 0 and abs(row["loss"]) < 1e-7
    assert row["grad_norm"] < 1e-6  # float32 rounding of softmax sums; a real gradient here is ~1e-1 or larger
    assert all(row[f"gvar_{e}"] < 1e-10 for e in FAMILY)  # r_t = 0 at every token: every estimator's noise is 0
    other = distil(DistillConfig(**dict(same, student_size="test", student_accuracy=0.0))).table.iloc[0]
    assert other["grad_norm"] > 1e-2 and other["gvar_kl_full"] > 1e-6


def test_baselines_are_exactly_unbiased_on_the_transformer(distill_cache):
    """E[gradient] by enumerating every response of the real student, against the teacher: OPD, vOPD and vOPD top-k
    (any k) all equal the per-token target exactly; the top-k KL loss does not."""
    # T = 1: 4 prompts x 10 responses; the exact helpers of lab.studies.distillation.exact take one network for both, so
    # the (random) student has the teacher's size here
    cfg = DistillConfig(**{**TINY, "difficulty": 1, "n_prompts": 4, "student_size": TINY["teacher_size"]})
    setup = make_setup(cfg)
    problem = Problem(setup.env, setup.student)
    support = problem.support(setup.theta0.double())
    target = -per_token_target(setup.student, setup.theta0, setup.theta_teacher, support)  # ascent, T = 1
    expect = {}
    for name, hyper in [("opd", {}), ("vopd", {}), ("vopd_topk", {"k": 2}), ("kl_full", {}), ("kl_topk", {"k": 2})]:
        est = dataclasses.replace(cfg, estimator=name, top_k=hyper.get("k", 4)).resolved()
        expect[name] = expected_estimate(setup.student, setup.theta0, setup.theta_teacher, support, est)
    scale = float(target.norm())
    for name in ("opd", "vopd", "vopd_topk", "kl_full"):
        assert float((expect[name] - target).norm()) < 1e-10 * scale, name
    assert float((expect["kl_topk"] - target).norm()) > 0.01 * scale


def test_distractors_widen_the_vocabulary_and_nothing_else():
    base, wide = toy_envs.make("chain3"), toy_envs.make("chain3", distractors=30)
    assert base.vocab_size == 10 and wide.vocab_size == 40 and wide.sequences_per_prompt == 40**3
    assert torch.equal(base.prompt_tokens, wide.prompt_tokens) and torch.equal(base.answers, wide.answers)
    assert TransformerPolicy.for_env(base, "test").config == size_config("test")  # unchanged without distractors
    assert TransformerPolicy.for_env(wide, "test").config.n_tokens == 40
    assert wide.decode(torch.tensor([1, 10, 13])) == "1+#" and "40" in wide.description
    prompts, tokens, mask = toy_envs.make("chain3", difficulty=1, n_prompts=2, distractors=5).enumerate()
    assert tokens.shape == (2 * 15, 1)
    with pytest.raises(LabError, match="distractors"):
        toy_envs.make("chain3", distractors=-2)


# ---- the sweep kind and the study ---------------------------------------------------------------------------------
SPEC = SweepSpec("d", dict(TINY), {"estimator": ["opd", "vopd"], "seed": [0]}, kind="distill")


def test_distill_sweep_runs_resumes_and_equals_in_process_runs(distill_cache, tmp_path):
    out = tmp_path / "sweep"
    assert run_sweep(SPEC, out, "local", workers=1) == {"done": 2, "skipped": 0, "total": 2}
    assert run_sweep(SPEC, out, "local", workers=1) == {"done": 0, "skipped": 2, "total": 2}  # resumed: nothing to do
    grown = dataclasses.replace(SPEC, grid={"estimator": ["opd", "vopd"], "seed": [0, 1]})
    assert run_sweep(grown, out, "local", workers=1) == {"done": 2, "skipped": 2, "total": 4}
    steps, runs = load_results(out)
    assert len(runs) == 4 and len(steps) == 4 * TINY["steps"]
    mine = distil(DistillConfig(**TINY, estimator="vopd", seed=1)).table
    theirs = steps[(steps["estimator"] == "vopd") & (steps["seed"] == 1)].reset_index(drop=True)
    pd.testing.assert_frame_equal(stable(theirs[mine.columns]), stable(mine), check_dtype=False)
