"""What the gvpo_optimum report decides is what the summary says: the decisions are checked on hand-made summaries,
the template renders them (the wording is free; the numbers and names are not), and the figures draw the tables."""
import numpy as np
import pandas as pd
import pytest

from lab.reports import style
from lab.studies.gvpo_optimum import figures, report


def _entry(mean, half=0.01):
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "per_seed": [mean - half, mean + half]}


def report_summary(gvpo_uniform=0.02, start=0.87):
    """A gvpo_optimum summary with known numbers: three methods, on-policy and uniform samplers, two seeds."""
    return {"study": "gvpo_optimum", "env": "small_dense", "beta": 0.1, "steps": 60, "group_size": 4, "seeds": [0, 1],
            "tv_at_start": start, "policy": "prefix",
            "final_tv": {"gvpo": {"on_policy": _entry(0.01), "uniform": _entry(gvpo_uniform)},
                         "seq_is": {"on_policy": _entry(0.012), "uniform": _entry(0.15)},
                         "ppo_clip": {"on_policy": _entry(0.3, 0.005), "uniform": _entry(0.85)}},
            "config": {"env": "small_dense", "env_overrides": {"n_prompts": 2}, "beta": 0.1, "steps": 60, "lr": 0.1,
                       "schedule": "constant", "groups_per_step": 8, "group_size": 4}}


def report_summary3(reference_tv=(0.02, 0.6, 0.3)):
    """Three samplers: on-policy, reference and uniform; reference_tv = (gvpo, seq_is, ppo_clip) from pi_ref."""
    s = report_summary()
    for m, v in zip(("gvpo", "seq_is", "ppo_clip"), reference_tv):
        s["final_tv"][m] = {"on_policy": s["final_tv"][m]["on_policy"], "reference": _entry(v),
                            "uniform": s["final_tv"][m]["uniform"]}
    return s


def test_the_decisions_follow_the_summary():
    d = report.decide(report_summary())
    assert d.methods == ["gvpo", "seq_is", "ppo_clip"] and d.samplers == ["on_policy", "uniform"]
    assert d.best == {"on_policy": "gvpo", "uniform": "gvpo"}
    assert d.gvpo == "reached" and d.gvpo_worst == 0.02 and d.gvpo_worst_hi == pytest.approx(0.03)
    alts = {a.method: a for a in d.alternatives["uniform"]}
    assert list(d.alternatives) == ["uniform"] and alts["seq_is"].ratio == pytest.approx(7.5)
    assert alts["ppo_clip"].ratio == pytest.approx(42.5) and d.contrast == "uniform"
    assert (d.on_policy.low, d.on_policy.high) == (0.01, 0.3)
    assert not d.on_policy.overlap  # ppo_clip's on-policy interval [0.295, 0.305] clears the others'


def test_the_decisions_flip_with_the_numbers():
    short = report.decide(report_summary(gvpo_uniform=0.5))
    assert short.gvpo == "approaching" and short.best["uniform"] == "seq_is" and short.gvpo_worst_hi == 0.51
    assert report.decide(report_summary(gvpo_uniform=0.9)).gvpo == "not approaching"  # above the start, 0.87
    # the contrast is the fixed sampler where even the best alternative ends farthest from GVPO
    assert report.decide(report_summary3((0.02, 0.6, 0.3))).contrast == "reference"  # 15x against uniform's 7.5x
    assert report.decide(report_summary3((0.2, 0.6, 0.3))).contrast == "uniform"  # 1.5x
    alone = report_summary()
    alone["final_tv"] = {"gvpo": alone["final_tv"]["gvpo"]}
    d = report.decide(alone)
    assert d.alternatives == {} and d.contrast is None and d.on_policy.overlap is False


def test_the_headline_states_gvpo_and_the_contrast():
    line = report.headline("gvpo_optimum", report_summary())
    assert line.startswith("GVPO ends within TV 0.02 of π*") and "from uniform samples" in line
    assert "gvpo 0.02, seq_is 0.15, ppo_clip 0.85" in line and "60 steps" in line
    assert "from π_ref samples" in report.headline("gvpo_optimum", report_summary3())


def test_the_answer_renders_every_decision():
    text = report.answer(report_summary())
    for fact in ("`small_dense (n_prompts=2)`", "prefix-tree", "β = 0.1", "60 Adam steps", "lr 0.1", "constant",
                 "8 groups", "k = 4", "2 seeds", "0.87", "0.030", "7.5×", "42×", "0.010 to 0.300",
                 "| gvpo | **0.010 [0.000, 0.020]** | **0.020 [0.010, 0.030]** |",  # the lowest per sampler in bold
                 "| ppo_clip | 0.300 [0.295, 0.305] | 0.850 [0.840, 0.860] |"):
        assert fact in text, fact
    assert "{" not in text and "}" not in text and "π*" not in text  # π\* is escaped for Markdown
    texts = {report.answer(report_summary(gvpo_uniform=v)) for v in (0.02, 0.5, 0.9)}
    assert len(texts) == 3  # reached, approaching, not approaching: three different answers
    assert "0.510" in report.answer(report_summary(gvpo_uniform=0.5))


def _curves():
    """Tidy results by hand: TV curves (3 steps) for two methods x two samplers x two seeds, and final distributions."""
    rows = []
    for m_i, m in enumerate(["gvpo", "seq_is"]):
        for s_i, s in enumerate(["on_policy", "uniform"]):
            for seed in (0, 1):
                for step in range(3):
                    rows.append({"method": m, "sampler": s, "seed": seed, "step": step, "metric": "tv",
                                 "value": 0.8 / (1 + step) / (1 + m_i + s_i) + 0.01 * seed, "prompt": -1,
                                 "response": ""})
    opt = {"00": 0.5, "01": 0.3, "10": 0.15, "11": 0.05}
    for method, sampler, probs in [("pi*", "-", opt), ("pi_ref", "-", dict.fromkeys(opt, 0.25)),
                                   ("gvpo", "uniform", opt), ("seq_is", "uniform", dict.fromkeys(opt, 0.25)),
                                   ("gvpo", "on_policy", opt), ("seq_is", "on_policy", opt)]:
        rows += [{"method": method, "sampler": sampler, "seed": 0, "step": 2, "metric": "prob", "value": p,
                  "prompt": 0, "response": r} for r, p in probs.items()]
    return pd.DataFrame(rows)


def test_figures_draw_what_the_results_hold():
    fig = figures.final_tv_figure(report_summary())
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["on-policy (π_θ)", "uniform (fixed)"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["gvpo", "seq_is", "ppo_clip"]
    markers = [ln for ln in ax.get_lines() if ln.get_marker() == "o"]
    assert [ln.get_color() for ln in markers] == [style.color(m) for m in ("gvpo", "seq_is", "ppo_clip")
                                                  for _ in range(2)]
    assert np.allclose([ln.get_ydata()[0] for ln in markers], [0.01, 0.02, 0.012, 0.15, 0.3, 0.85])
    results = _curves()
    fig = figures.tv_curves_figure(results)
    assert [ax.get_title() for ax in fig.axes] == ["on-policy (π_θ)", "uniform (fixed)"]
    lines = fig.axes[1].get_lines()
    assert [ln.get_label() for ln in lines] == ["gvpo", "seq_is"] and lines[1].get_color() == style.color("seq_is")
    assert np.allclose(lines[0].get_ydata(), [0.8 / 2 / (1 + s) + 0.005 for s in range(3)])  # median of 2 seeds
    fig = figures.distribution_figure(results, prompt=0, top=3)
    ax = fig.axes[0]
    assert ax.get_title() == "Learned vs closed form, groups from uniform (fixed)"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["00", "01", "10"]  # pi*'s most likely first
    bars = [p.get_height() for p in ax.patches]
    assert np.allclose(bars, [0.5, 0.3, 0.15, 0.25, 0.25, 0.25])  # pi* then pi_ref
    learned = [c for c in ax.collections if c.get_label() == "seq_is (learned)"][0]
    assert np.allclose(learned.get_offsets()[:, 1], [0.25, 0.25, 0.25])
