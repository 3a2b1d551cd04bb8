"""What the mismatch report decides, on hand-made summaries (the decisions, then that the templates render and
name them), and its figures on a real smoke run's results."""
from __future__ import annotations

import copy

import pytest
from matplotlib.figure import Figure

from lab.studies.mismatch import figures, measure, report, study


def metrics(**given) -> dict:
    """A setting's summary: every metric [value, lo, hi], the given ones as (value, lo, hi) or a value."""
    base = {"tokens": 1000.0, "mean_length": 50.0, "abs_mean": 0.02, "abs_q50": 0.01, "abs_q90": 0.05,
            "abs_q99": 0.15, "abs_max": 0.9, "low_high_ratio": (20.0, 15.0, 25.0), "kl_k3": 5e-4, "prob_corr": 0.999,
            "token_share[p<0.1]": 0.2, "abs_share[p<0.1]": 0.4, "token_share[p>0.9]": 0.5, "abs_L_ref": 0.2,
            "ref_length": 96.0, "linear_prediction_ref": 1.92, "growth_rate": 0.002,
            "growth_exponent": (0.5, 0.45, 0.55), "seq_var_ratio": (1.0, 0.9, 1.1), "tis_truncated": 0.001,
            "icepop_masked": 0.0005, "seq_mis_masked": 0.05}
    out = {}
    for k, v in {**base, **given}.items():
        out[k] = list(v) if isinstance(v, tuple) else [float(v)] * 3
    return out


def lm_info(**settings) -> dict:
    return {"kind": "pretrained", "source": "/m/SmolLM2-135M-Instruct.Q4_1.gguf", "model_type": "llama",
            "model_parameters": 134_515_008, "vocab_size": 49152, "length": 96, "n_prompts": 8, "moe": False,
            "load_seconds": 3.0, "sequences": 16, "nocache_sequences": 4, "nocache_length": 24, "chat": True,
            "examples": [{"prompt": "Why?", "response": "Because\nof light."}], "seconds": 60.0,
            "settings": settings}


def moe_info(**settings) -> dict:
    return {"kind": "in-lab", "env": "sort6", "env_description": "sort six digits", "size": "moe",
            "parameters": 100_000, "moe": True, "init": "random", "length": 6, "prompt_length": 7, "sequences": 64,
            "device": "cpu", "seconds": 5.0, "settings": settings}


def summary(**models) -> dict:
    return {"study": "mismatch", "models": models, "practitioners": measure.PRACTITIONERS,
            "trainer": "float32, full sequence, own routing", "seconds": 70.0, "config": {"seed": 0}}


SUMMARY = summary(**{
    "SmolLM2-135M": lm_info(**{"bf16+kv": metrics(abs_mean=(0.036, 0.034, 0.038)), "fp32+kv": metrics(abs_mean=1e-7),
                               "bf16+kv+head32": metrics(abs_mean=0.030, prob_corr=0.9995),
                               "bf16": metrics(abs_mean=0.035)}),
    "in-lab moe": moe_info(**{"bf16+kv": metrics(abs_mean=0.002, route_disagreement=(0.0015, 0.001, 0.002),
                                                  replay_kl_reduction=(0.37, 0.2, 0.5), abs_mean_replay=0.0015,
                                                  kl_k3_replay=3e-4)}),
})


def test_decisions_place_each_model_beside_the_practitioners_figures():
    d = report.decide(SUMMARY)
    assert [(p.model, p.setting, p.where) for p in d.per_token] == [("SmolLM2-135M", "bf16+kv", "inside"),
                                                                     ("in-lab moe", "bf16+kv", "below")]
    assert d.growth.model == "SmolLM2-135M" and d.growth.verdict == "independent"  # exponent 0.5, ratio about 1
    assert d.growth.overstated == pytest.approx(1.92 / 0.2)
    assert d.low_prob.holds and d.low_prob.abs_share == 0.4  # ratio interval [15, 25] above 1; not most of |Δ|
    assert d.head32.corr == (0.999, 0.9995) and d.head32.abs_mean == (0.036, 0.030)
    assert d.routing.model == "in-lab moe" and d.routing.few_flips and not d.routing.little_removed  # 0.37 >= 0.25
    assert [(k.model, k.fp32_kv, k.bf16_kv, k.bf16) for k in d.kv_cache] == [
        ("SmolLM2-135M", 1e-7, 0.036, 0.035)]
    assert (d.acting.model, d.acting.tis_truncated, d.acting.seq_mis_masked) == ("SmolLM2-135M", 0.001, 0.05)


@pytest.mark.parametrize("given,verdict", [
    ({"abs_L_ref": 0.0}, "flat"), ({"growth_exponent": (0.95, 0.9, 1.0)}, "linear"),
    ({"seq_var_ratio": (0.5, 0.4, 0.6)}, "cancel"), ({"seq_var_ratio": (3.0, 2.0, 4.0)}, "drift"),
    ({"seq_var_ratio": (1.0, 0.8, 1.3)}, "independent"),
])
def test_the_growth_verdict_follows_the_exponent_and_the_variance_ratio(given, verdict):
    assert report.growth_verdict(metrics(**given)) == verdict


def test_without_a_pretrained_lm_the_first_model_is_the_target_and_fp32_alone_has_no_bf16_findings():
    s = summary(**{"in-lab moe": SUMMARY["models"]["in-lab moe"]})
    d = report.decide(s)
    assert d.growth.model == d.acting.model == "in-lab moe" and d.head32 is None and d.kv_cache == []
    only_fp32 = summary(**{"in-lab moe": moe_info(**{"fp32+kv": metrics()})})
    d = report.decide(only_fp32)
    assert d.per_token == [] and d.growth is None and d.routing is None and d.acting is None
    assert "in-lab moe fp32+kv" in report.headline("mismatch", only_fp32)
    report.answer(only_fp32)  # renders with nothing to say beside the practitioners' figures


def test_the_answer_renders_every_decision_with_its_numbers():
    md = " ".join(report.answer(SUMMARY).split())  # the template's line breaks aside
    for needle in ("**SmolLM2-135M** (`llama`, 135M parameters", "0.036 [0.034, 0.038]", "inside the 0.01-0.04",
                   "below the 0.01-0.04", "100,000", "add up", "20 [15, 25] times", "holds per token",
                   "0.9990 with the bf16 head and 0.9995", "0.15% [0.10%, 0.20%] of (token", "reduces the KL by 37%",
                   "Far fewer routes flip", "fp32 with the cache 1e-07", "truncates 0.10% of tokens",
                   "| SmolLM2-135M | `bf16+kv+head32` |"):
        assert needle in md, needle
    raised = copy.deepcopy(SUMMARY)
    raised["models"]["in-lab moe"]["settings"]["bf16+kv"]["replay_kl_reduction"] = [-0.1, -0.2, 0.0]
    assert report.decide(raised).routing.little_removed and "raises the KL by 10%" in " ".join(
        report.answer(raised).split())
    line = report.headline("mismatch", SUMMARY)
    assert line.startswith("SmolLM2-135M bf16+kv: mean |Δlog p| 0.036/token (p99 0.15), 20x larger")
    assert line.endswith("in-lab moe: 0.15% of routes differ, replay cuts KL by 37%")
    assert "> Because\n> of light." in report.examples(SUMMARY)
    assert "No pretrained LM" in report.examples(summary(**{"in-lab moe": SUMMARY["models"]["in-lab moe"]}))
    assert "routes differ" in report.settings_table(SUMMARY).to_html()


@pytest.mark.usefixtures("no_network", "one_thread")
@pytest.mark.slow
def test_figures_draw_a_real_smoke_run():
    results, _ = study.run(study.Config(**{**study.SMOKE, "n_boot": 50}), progress=False)
    for draw in (figures.abs_delta_vs_probability, figures.log_weight_vs_length, figures.setting_bars,
                 figures.routing_replay):
        assert isinstance(draw(results), Figure)
    assert figures.routing_replay(results[results["model"] == "in-lab test"]) is None  # no MoE, no figure


def trunc(**given) -> dict:
    base = {"ratio_mean": 0.85, "ratio_outside": 0.74, "kept_mass": 0.853, "ratio_minus_mass": -0.003,
            "renorm_mean": 0.996, "renorm_outside": 0.054, "kept_size": 20.0, "entropy": 1.7, "tokens": 900.0}
    return metrics(**{**base, **given})


def with_truncation(**by_setting) -> dict:
    out = copy.deepcopy(SUMMARY)
    out["models"]["SmolLM2-135M"]["truncation"] = {"length": 64, "sequences": 16, "settings": by_setting,
                                                   "seconds": 100.0}
    return out


@pytest.mark.parametrize("given,verdict", [
    ({}, "explained"),  # lower kept mass than Qwen2.5-1.5B's, ratio = kept mass, renormalising fixes it
    ({"ratio_mean": 0.896, "ratio_outside": 0.50, "kept_mass": 0.9, "renorm_mean": 1.0, "renorm_outside": 0.06},
     "reproduced"),
    ({"ratio_minus_mass": -0.05}, "unexplained"),  # the ratio is not the kept mass
    ({"renorm_mean": 0.95}, "unexplained"),  # renormalising does not fix it
])
def test_truncation_is_set_beside_the_published_figures(given, verdict):
    d = report.decide(with_truncation(**{"bf16+kv": {"top_p=0.8": trunc(**given), "top_p=0.95": trunc()}}))
    top08, top095 = d.truncation
    assert (top08.truncation, top08.verdict, top095.verdict) == ("top_p=0.8", verdict, "unpublished")
    assert top08.published["ratio_mean"][:2] == (0.896, top08.ratio_mean) and set(top08.published) == {
        "ratio_mean", "ratio_outside", "renorm_mean", "renorm_outside"}


def test_the_truncation_section_and_table_render_the_measured_and_published_figures():
    s = with_truncation(**{"bf16+kv": {"top_p=0.8": trunc(), "top_k=20": trunc(ratio_mean=0.9, kept_mass=0.9)},
                           "fp32+kv": {"top_p=1": trunc(ratio_mean=1.0, kept_mass=1.0, ratio_outside=0.0,
                                                        renorm_mean=1.0, renorm_outside=0.0)}})
    md = " ".join(report.answer(s).split())
    for needle in ("`top_p=0.8`: mean ratio 0.896 with 51.8% of tokens outside [0.9, 1.1], after renormalising 1.001 "
                   "and 4.3%", "`top_k=20`: mean ratio 0.965, after renormalising 1.000.",
                   "`bf16+kv`, `top_p=0.8`: mean ratio 0.850, kept mass 0.853 (equal, as predicted), 74.0% outside",
                   "renormalised 0.996 and 5.4% (fixed)", "explained: the ratio is this model's kept mass",
                   "a lower kept mass", "here 1.70 nats per token", "`fp32+kv`, `top_p=1`", "0.0% (nothing cut",
                   "Nothing published for this setting"):
        assert needle in md, needle
    html = report.truncation_table(s).to_html()
    assert "0.896, 51.8% → 1.001, 4.3%" in html and "0.965 → 1.000" in html and "kept mass π(S)" in html
    assert report.truncation_table(SUMMARY) is None and report.decide(SUMMARY).truncation == []
    assert "truncating sampler" not in report.answer(SUMMARY)
