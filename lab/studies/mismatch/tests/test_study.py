"""The mismatch study end to end on the small in-lab models and a tiny Hugging Face MoE, its Config's declarations
and checks, and its parameters as the report reads them; every network connection refused."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from lab.errors import LabError
from lab.policies.transformer import TransformerPolicy
from lab.studies.mismatch import study

pytestmark = pytest.mark.usefixtures("no_network", "one_thread")


@pytest.mark.parametrize("kwargs,match", [
    ({"settings": ["bf16+x"]}, "settings\\[0\\] must be one of"), ({"inlab_sizes": ["huge"]}, "inlab_sizes"),
    ({"inlab_env": "tiny_target"}, "inlab_env must be one of add2"), ({"lm_length": 0}, "lm_length must be >= 1"),
    ({"inlab_sizes": [], "lm": "none"}, "nothing"), ({"settings": ["bf16+kv+head32"]}, "head32"),
    ({"lm_prompts": []}, "lm_prompts"), ({"lm_prompts": ["a", [1, 2]]}, "lm_prompts"),
    ({"lm_prompts": ["  "]}, "lm_prompts"), ({"lm_prompts": [[]]}, "lm_prompts"),
    ({"lm_prompts": [1.5]}, "lm_prompts\\[0\\]"), ({"n_boot": 3}, "n_boot must be >= 10"),
    ({"settings": ["bf16", "bf16"]}, "more than once"), ({"inlab_init": "random", "inlab_accuracy": 0.3}, "only"),
    ({"inlab_accuracy": 1.0}, "inlab_accuracy must be > 0 and < 1"), ({"threads": -1}, "threads"),
    ({"inlab_samples": True}, "whole number"), ({"lm": "/nonexistent/model"}, "no model at"),
    ({"lm_truncations": ["top_p=0"]}, "top_p must be a number in"), ({"lm_truncations": ["top_q=1"]}, "unknown"),
    ({"lm_truncations": ["top_k=20", "top_k=20"]}, "more than once"),
    ({"lm_truncation_settings": []}, "truncating samplers"), ({"lm_truncation_settings": ["bf16+kv+head32"]}, "head32"),
    ({"lm_truncation_length": 0}, "lm_truncation_length must be >= 1"),
    ({"lm_truncations": ["top_k=60000"]}, "top_k 60000 exceeds the vocabulary size 49152"),
])
@pytest.mark.slow
def test_bad_configs_are_one_line_before_any_work(kwargs, match):
    with pytest.raises(LabError, match=match):
        study.Config(**kwargs).validate()


def test_a_corrupt_checkpoint_is_refused_before_any_work(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(LabError, match="not a readable model"):
        study.Config(inlab_sizes=[], lm=str(tmp_path)).validate()
    bad = tmp_path / "m.gguf"
    bad.write_bytes(b"NOPE")
    with pytest.raises(LabError, match="not a GGUF file"):
        study.Config(inlab_sizes=[], lm=str(bad)).validate()


def test_a_top_k_above_the_lms_vocabulary_is_refused_before_any_work(tiny_mixtral):
    with pytest.raises(LabError, match="top_k 50 exceeds the vocabulary size 48"):
        study.Config(inlab_sizes=[], lm=str(tiny_mixtral), lm_truncations=["top_k=50"]).validate()


def test_every_setting_the_measurement_reads_is_a_choice_and_only_the_lm_has_head32():
    from lab.studies.mismatch import measure

    for name in study.LM_SETTINGS:
        s = measure.parse_setting(name)
        assert (name in study.SETTINGS) == (not s.head32)
    assert len(study.SETTINGS) == 2 * len(measure.DTYPES) and len(study.LM_SETTINGS) == 2 * len(study.SETTINGS)


def test_the_reports_parameters_are_the_configs_fields():
    from lab.reports import get, params

    report = get("mismatch")
    assert list(params.specs(report)) == [f.name for f in dataclasses.fields(study.Config)]
    cfg, _ = params.resolve(report, {}, {"lm_prompts": "[[1, 2, 3], [4, 5]]", "settings": "bf16+kv,fp16"},
                            smoke=True)
    assert cfg.lm_prompts == [[1, 2, 3], [4, 5]] and cfg.settings == ["bf16+kv", "fp16"]
    for cli, match in (({"settings": "bf16+x"}, "settings"), ({"lm_prompts": '["a", [1]]'}, "lm_prompts")):
        with pytest.raises(LabError, match=match):
            params.resolve(report, {}, cli, smoke=True)
    with pytest.raises(LabError, match="now called 'mismatch'"):
        get("mismatch_anatomy")


def test_inlab_models_run_on_the_studys_device(monkeypatch):
    """The in-lab transformer (its warm start included) runs on cfg.device, as the pretrained LM does."""
    from lab import pretrain

    device = "cuda" if torch.cuda.is_available() else "cpu"
    seen = []
    generate = TransformerPolicy.generate

    def spy(self, theta, *args, **kwargs):
        seen.append(theta.device.type)
        return generate(self, theta, *args, **kwargs)

    monkeypatch.setattr(TransformerPolicy, "generate", spy)
    cfg = study.Config(settings=["bf16+kv"], inlab_sizes=["test"], inlab_init="random", inlab_samples=1, lm="none",
                       n_boot=20, device=device)
    _, summary = study.run(cfg, progress=False)
    assert seen == [device] and summary["models"]["in-lab test"]["device"].startswith(device)

    def warm(env, size, accuracy, **kwargs):
        seen.append(kwargs["device"])
        raise LabError("stop")

    monkeypatch.setattr(pretrain, "pretrain", warm)
    with pytest.raises(LabError, match="stop"):
        study.run(dataclasses.replace(cfg, inlab_init="warm"), progress=False)
    assert seen[-1] == device
    with pytest.raises(LabError, match="device"):
        study.Config(device=f"cuda:{torch.cuda.device_count() + 4}").validate()


@pytest.mark.slow
def test_smoke_study_measures_every_model_and_setting_deterministically(tiny_mixtral):
    cfg = study.Config(inlab_sizes=["test", "test_moe"], inlab_init="random", inlab_samples=1, lm=str(tiny_mixtral),
                       lm_prompts=[[1, 2, 3], [4, 5, 6, 7]], lm_length=12, lm_nocache_length=6, n_boot=100)
    results, summary = study.run(cfg, progress=False)
    assert set(results["model"]) == {"in-lab test", "in-lab test_moe", f"LM {tiny_mixtral}"}
    assert {"abs_mean", "abs_delta_by_prob", "abs_L_by_length", "seq_log_weight", "route_disagreement"} <= \
        set(results["metric"])
    lm = summary["models"][f"LM {tiny_mixtral}"]
    assert set(lm["settings"]) == set(cfg.lm_settings) and lm["nocache_length"] == 6
    assert lm["settings"]["bf16+kv"]["abs_mean"][0] > lm["settings"]["fp32+kv"]["abs_mean"][0]
    assert list(summary) == [f.name for f in dataclasses.fields(study.Summary)] and math.isfinite(summary["seconds"])
    assert summary["practitioners"]["abs_delta_range"]["value"] == [0.01, 0.04]
    trunc = lm["truncation"]
    assert trunc["length"] == 12 and set(trunc["settings"]["bf16+kv"]) == {"top_p=0.8", "top_k=20"}
    for e in trunc["settings"]["bf16+kv"].values():  # the ratio is the kept mass; renormalising brings it to 1
        assert e["kept_mass"][0] < 1 and abs(e["ratio_minus_mass"][0]) < 0.01 and abs(e["renorm_mean"][0] - 1) < 0.01
    assert {"trunc:top_p=0.8:ratio_mean", "trunc:top_k=20:renorm_outside"} <= set(results["metric"])
    again, _ = study.run(cfg, progress=False)
    assert again.equals(results)  # deterministic given the seed
