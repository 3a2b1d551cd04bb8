"""The numbers of the rollout diagnostics: the streaming pass against a whole-table pandas computation, the lab's
per-batch metrics recomputed from a log equal to the trainer's, and statistical claims checked statistically."""
from __future__ import annotations


import numpy as np
import pandas as pd
import pytest
import torch

from lab import diagnostics
from lab.diagnose import RolloutLogWriter, diagnose, lab_weight_metrics, make_meta, weight_metrics_tensors
from lab.diagnose import histogram as H
from lab.diagnose.fits import ols, ratio_intervals
from lab.diagnose.neutral import NeutralLogWriter
from lab.diagnose.reference import reference
from lab.diagnose.synthetic import random_log, simulate
from lab.diagnose.tables import dominant_share

META2 = make_meta("test", {"sampler_logp": "sampler", "old_logp": "trainer", "current_logp": None})


def log_from_deltas(path, deltas_per_step, probs_per_step=None, seed=0):
    """A log whose trainer/sampler log-ratio of sequence i in step s is deltas_per_step[s][i] (one array per
    sequence), with sampler probabilities probs_per_step[s][i] (uniform draws when not given)."""
    rng = np.random.default_rng(seed)
    with NeutralLogWriter(path, META2) as w:
        for k, deltas in enumerate(deltas_per_step):
            lens = np.array([len(d) for d in deltas])
            d = np.concatenate(deltas)
            p = rng.random(d.size) if probs_per_step is None else np.concatenate(probs_per_step[k])
            s = np.log(np.clip(p, 1e-12, 1)).astype(np.float32)
            w.write_tokens({"run": "", "step": k + 1, "sample_id": np.repeat(np.arange(len(deltas)), lens),
                            "position": np.concatenate([np.arange(n) for n in lens]),
                            "loss_mask": np.ones(d.size, bool),
                            "sampler_logp": s, "old_logp": (s.astype(np.float64) + d).astype(np.float32)})
            w.write_sequences({"run": "", "step": k + 1, "sample_id": np.arange(len(deltas)), "response_length": lens})
    return path


@pytest.fixture(scope="module")
def random_small(tmp_path_factory):
    return random_log(tmp_path_factory.mktemp("rl") / "log", 25_000, mean_len=40, batch=80, seed=1,
                      row_group_rows=5000)


@pytest.mark.slow
def test_streaming_equals_whole_table_pandas(random_small):
    ref = reference(random_small)
    d = diagnose(random_small, chunk_rows=4099, progress=False)  # sequences straddle chunk boundaries
    ps = d.tables["per_step"].merge(ref["per_step"], on=["run", "step", "pair"], suffixes=("", "_ref"))
    assert len(ps) == len(d.tables["per_step"]) == len(ref["per_step"]) > 0
    for col in ("n_tok", "mean", "mean_abs", "std", "k3_token", "max_abs", "ess_frac", "chi2_seq_sampled",
                "max_weight_share", "khat", "dominant_share", "logw_mean", "logw_sd"):
        np.testing.assert_allclose(ps[col], ps[f"{col}_ref"], rtol=1e-9, atol=1e-12, err_msg=col)
    corr = d.tables["corrections"].merge(ref["corrections"], on=["name", "pair"], suffixes=("", "_ref"))
    assert len(corr) == 9
    np.testing.assert_allclose(corr["tokens_changed"], corr["tokens_changed_ref"], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(corr["removed"], corr["removed_ref"], rtol=1e-9, atol=1e-12)
    assert (corr["removed_lo"] <= corr["removed"] + 1e-12).all()
    assert (corr["removed"] <= corr["removed_hi"] + 1e-12).all()
    bp = d.tables["by_probability"].merge(ref["by_probability"], on=["pair", "p_lo"], suffixes=("", "_ref"))
    for col in ("n_tok", "mean_abs", "abs_mass_share"):
        np.testing.assert_allclose(bp[col], bp[f"{col}_ref"], rtol=1e-9, err_msg=col)
    st = d.tables["staleness"].merge(ref["staleness"], on="lag", suffixes=("", "_ref"))
    np.testing.assert_array_equal(st["n_seq"], st["n_seq_ref"])
    ov = d.tables["overall"].merge(ref["overall"], on="pair", suffixes=("", "_ref"))
    for q in ("p01", "p05", "p50", "p95", "p99"):  # histogram quantiles: within one bin (5.9 %) of the exact ones
        np.testing.assert_allclose(ov[q], ov[f"{q}_ref"], rtol=0.06, atol=2e-6, err_msg=q)
    np.testing.assert_allclose(ov["mean_abs"], ov["mean_abs_ref"], rtol=1e-9)
    whole = diagnose(random_small, progress=False)  # one chunk: the same numbers
    np.testing.assert_allclose(whole.tables["per_step"]["ess_frac"], d.tables["per_step"]["ess_frac"], rtol=1e-12)


def _training_weight_metrics():
    from lab.engine.training import weight_metrics

    return weight_metrics


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_lab_metrics_from_a_log_equal_the_trainers(tmp_path, dtype):
    weight_metrics = _training_weight_metrics()
    g = torch.Generator().manual_seed(0)
    B, T, steps = 32, 9, 4
    logged, path = [], tmp_path / "log"
    with RolloutLogWriter(path, None) as log:  # meta=None: a lab run (mu, pi_old, pi)
        for step in range(1, steps + 1):
            lengths = torch.randint(1, T + 1, (B,), generator=g)
            mask = (torch.arange(T)[None] < lengths[:, None]).to(dtype)
            logits = torch.randn(B, T, 6, generator=g, dtype=dtype)
            tokens = torch.randint(0, 6, (B, T), generator=g)
            lp_mu = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0] * mask
            lp_old = torch.log_softmax(logits + 0.3 * torch.randn(B, T, 6, generator=g, dtype=dtype), -1
                                       ).gather(-1, tokens[..., None])[..., 0] * mask
            lp_pi = torch.log_softmax(logits + step * 0.4 * torch.randn(B, T, 6, generator=g, dtype=dtype), -1
                                      ).gather(-1, tokens[..., None])[..., 0] * mask
            logged.append(weight_metrics(lp_pi, lp_mu, lp_old, mask))
            log.add(step, torch.arange(B) + 100 * step, tokens, mask, sampler_logp=lp_mu, old_logp=lp_old,
                    current_logp=lp_pi, version=torch.full((B,), step - 1), advantages=torch.randn(B, generator=g),
                    rewards=torch.zeros(B), group_ids=torch.arange(B) // 8, trainer_version=step)
    got = lab_weight_metrics(path)
    for step, want in enumerate(logged, 1):
        row = got[got["step"] == step].iloc[0]
        assert len(want) == 5
        for k, v in want.items():  # equal, not close: same formulas, dtypes and [B, T] sums
            mine = row[k]
            assert (mine == v) or (np.isnan(mine) and np.isnan(v)), (step, k, mine, v)
        direct = weight_metrics_tensors(*(torch.zeros(1, 1, dtype=dtype),) * 3, torch.ones(1, 1, dtype=dtype))
        assert set(direct) == set(row.index) - {"run", "step"}
    streamed = diagnose(path, progress=False).tables["per_step"].query("pair == 'total'").set_index("step")
    ref = got.set_index("step")
    np.testing.assert_allclose(streamed["ess_frac"], ref["ess_frac"], rtol=1e-9)
    np.testing.assert_allclose(streamed["chi2_seq_sampled"], ref["chi2_seq_sampled"], rtol=1e-9)
    np.testing.assert_allclose(streamed["khat"], ref["khat"], rtol=1e-9)
    np.testing.assert_allclose(streamed["k3_token"], ref["k3_token"], rtol=1e-9)
    mism = diagnose(path, progress=False).tables["per_step"].query("pair == 'mismatch'").set_index("step")
    np.testing.assert_allclose(mism["mean_abs"], ref["mismatch_abs_logprob"], rtol=1e-6)


def test_histogram_quantiles_are_within_one_bin():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_t(2, 20000) * 0.01, np.zeros(500), -rng.exponential(0.3, 3000)])
    counts = np.bincount(H.bin_index(x), minlength=H.NBINS)
    qs = np.array([0.001, 0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 0.999])
    np.testing.assert_allclose(H.quantiles(counts, qs), np.quantile(x, qs), rtol=0.06, atol=1e-6)
    np.testing.assert_allclose(H.abs_quantiles(counts, [0.5, 0.99]), np.quantile(np.abs(x), [0.5, 0.99]), rtol=0.06)
    lo, hi = H.bin_edges()
    b = H.bin_index(x)
    assert (lo[b] <= x).all() and (x <= hi[b]).all()


def test_dominant_share_by_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(50):
        L = rng.normal(0, rng.uniform(0.1, 4), rng.integers(1, 60))
        w = np.sort(np.exp(L))[::-1]
        k = next(k for k in range(1, len(w) + 1) if w[:k].sum() >= 0.5 * w.sum() * (1 - 1e-12))
        assert dominant_share(L) == pytest.approx(k / len(L))


def test_ols_interval_covers_the_slope_at_its_level():
    """HC1 intervals under heteroskedastic noise (variance growing with x, as log-weights do): 95 % coverage."""
    rng = np.random.default_rng(2)
    hits = 0
    for _ in range(400):
        x = rng.integers(5, 500, 300).astype(float)
        y = 0.3 + 0.01 * x + rng.normal(0, np.sqrt(0.02 * x))
        f = ols(x, y)
        hits += f["lo"] <= 0.01 <= f["hi"]
    assert 0.92 <= hits / 400 <= 0.98  # binomial sd at 0.95 and n = 400: 0.011


@pytest.mark.slow
def test_ratio_interval_covers_at_its_level():
    """Poisson bootstrap over sequences for a ratio of sums with within-sequence correlation."""
    rng = np.random.default_rng(3)
    hits = 0
    for r in range(150):
        n = rng.integers(5, 60, 150)
        u = rng.gamma(2.0, 0.5, 150)  # a sequence-level effect shared by its tokens
        num = u * rng.gamma(n, 1.0)  # the sum of n Exp(1) draws, scaled by the shared effect
        out = ratio_intervals({"x": (num, n.astype(float))}, n_boot=150, seed=r)["x"]
        hits += out[1] <= 1.0 <= out[2]  # E[u e] = 1
    assert 0.87 <= hits / 150 <= 0.99  # binomial sd at 0.95 and n = 150: 0.018


def test_variance_growth_is_recovered(tmp_path):
    """iid token log-ratios N(0, s^2): Var(log W | n) = n s^2, so the fitted slope's interval covers s^2."""
    rng = np.random.default_rng(4)
    s2 = 0.02**2
    steps = [[rng.normal(0, np.sqrt(s2), int(k)) for k in rng.integers(10, 800, 120)] for _ in range(6)]
    d = diagnose(log_from_deltas(tmp_path / "log", steps), progress=False)
    g = d.summary["growth"]["mismatch"]
    assert g["var_lo"] <= s2 <= g["var_hi"] and abs(g["var_per_token"] / s2 - 1) < 0.25
    assert g["drift_lo"] <= 0 <= g["drift_hi"]


def test_low_probability_concentration_is_detected_both_ways(tmp_path):
    rng = np.random.default_rng(5)
    for case, scale in (("concentrated", lambda p: np.where(p < 0.1, 0.2, 0.002)), ("flat", lambda p: 0.01 + 0 * p)):
        probs = [[rng.random(int(k)) ** 3 for k in rng.integers(50, 150, 64)] for _ in range(3)]
        deltas = [[scale(p) * rng.standard_normal(p.size) for p in step] for step in probs]
        d = diagnose(log_from_deltas(tmp_path / case, deltas, probs), progress=False)
        line = d.verdict[1]
        if case == "concentrated":
            assert line.startswith("The trainer/sampler mismatch is concentrated on tokens with p < 0.1"), line
        else:
            assert line.startswith("The trainer/sampler mismatch is not concentrated"), line
        low = d.summary["low_prob"]["mismatch"]
        p_all = np.concatenate([np.concatenate(x) for x in probs])
        d_all = np.concatenate([np.concatenate(x) for x in deltas])
        s = np.log(np.clip(p_all, 1e-12, 1)).astype(np.float32)
        delta = ((s.astype(np.float64) + d_all).astype(np.float32) - s).astype(np.float64)
        lo = np.exp(s.astype(np.float64)) < 0.1
        assert low["abs_mass_share"] == pytest.approx(np.abs(delta[lo]).sum() / np.abs(delta).sum(), rel=1e-9)
        assert low["token_share"] == pytest.approx(lo.mean(), rel=1e-12)


def test_heavy_tailed_steps_raise_the_khat_warning(tmp_path):
    rng = np.random.default_rng(6)
    calm = [np.full(20, x) for x in rng.normal(0, 0.01, 200)]
    wild = [np.full(20, x) for x in rng.standard_t(1.5, 200) * 0.4]  # sequence log-weights with a heavy tail
    probs = [[rng.random(20) for _ in calm], *[[np.full(20, 1e-12) for _ in wild]] * 2]  # room for log-ratios > 0
    d = diagnose(log_from_deltas(tmp_path / "log", [calm, wild, wild], probs), progress=False)
    ps = d.tables["per_step"].set_index("step")
    assert not ps.loc[1, "khat_warning"] and ps.loc[2, "khat_warning"] and ps.loc[3, "khat_warning"]
    np.testing.assert_allclose(ps.loc[2, "khat"], diagnostics.psis_khat(np.array([w.sum() for w in wild])), rtol=1e-5)
    assert "Pareto k-hat > 0.7 in 2 of 3 steps: sequence-level IS estimates are unreliable here" in d.verdict[0]


def test_simulated_run_has_real_staleness_and_mismatch(tmp_path):
    """The synthetic async run: lag-0 sequences show only the bf16 rounding mismatch, older ones add staleness."""
    d = diagnose(simulate(tmp_path / "sim", steps=6, batch=48, vocab=64, mean_len=40, lag_max=2, drift=0.05),
                 progress=False)
    st = d.tables["staleness"].set_index("lag")
    assert list(st.index) == [0, 1, 2]
    assert st.loc[0, "mean_abs_mismatch"] < st.loc[1, "mean_abs_mismatch"] < st.loc[2, "mean_abs_mismatch"]
    assert 0 < st.loc[0, "mean_abs_mismatch"] < 0.02  # rounding only
    assert d.summary["staleness"]["max_lag"] == 2


def _ragged_log(path, row_group_rows: int, seed: int = 3):
    """A log with every case the pass treats apart: two runs, masked tokens, NaN log-probs on masked and on
    loss-masked tokens, token advantages missing on some rows (and sequence advantages on some sequences),
    versions that change inside a response (partial rollouts) or are missing, weights far outside every
    correction's band, and sequences of 1 to 90 tokens."""
    rng = np.random.default_rng(seed)
    meta = make_meta("test", {"sampler_logp": "sampler", "old_logp": "trainer", "current_logp": "current"})
    with NeutralLogWriter(path, meta, row_group_rows=row_group_rows) as w:
        for run in ("a", "b"):
            for step in range(1, 4):
                n_seq = 12
                lens = rng.integers(1, 91, n_seq)
                n = int(lens.sum())
                s = np.log(rng.random(n) ** 3 + 1e-9).astype(np.float32)
                old = np.minimum(s + rng.standard_normal(n).astype(np.float32) * 0.4, 0).astype(np.float32)
                cur = np.minimum(old + rng.standard_t(2, n).astype(np.float32) * 0.3, 0).astype(np.float32)
                mask = rng.random(n) < 0.9
                s[~mask & (rng.random(n) < 0.3)] = np.nan  # ignored: not loss-masked
                old[mask & (rng.random(n) < 0.01)] = np.nan  # dropped by nan="drop"
                adv = np.repeat(rng.standard_normal(n_seq), lens)
                adv[rng.random(n) < 0.2] = np.nan
                version = np.repeat(step - 1 - rng.integers(0, 3, n_seq), lens).astype(float)
                version[rng.random(n) < 0.05] += 1  # a version change inside a response
                version[np.repeat(rng.random(n_seq) < 0.2, lens)] = np.nan
                seq_adv = rng.standard_normal(n_seq)
                seq_adv[rng.random(n_seq) < 0.3] = np.nan
                sid = np.repeat(np.arange(n_seq), lens)
                w.write_tokens({"run": run, "step": step, "sample_id": sid,
                                "position": np.arange(n) - np.repeat(np.cumsum(lens) - lens, lens),
                                "loss_mask": mask, "sampler_logp": s, "old_logp": old, "current_logp": cur,
                                "version": version, "advantage": adv})
                v = version.copy()
                w.write_sequences({"run": run, "step": step, "sample_id": np.arange(n_seq), "response_length": lens,
                                   "advantage": seq_adv, "version_min": np.fmin.reduceat(v, np.cumsum(lens) - lens),
                                   "version_max": np.fmax.reduceat(v, np.cumsum(lens) - lens),
                                   "trainer_version": np.full(n_seq, step - 1)})
    return path


def _assert_close(got, want, where: str) -> None:
    """Nested summaries equal: numbers to rounding (rtol 1e-10), everything else exactly."""
    if isinstance(want, dict):
        assert set(got) == set(want), where
        for key in want:
            _assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_close(g, w, f"{where}[{i}]")
    elif isinstance(want, (float, np.floating)) and not isinstance(want, bool):
        assert got == pytest.approx(want, rel=1e-10, abs=1e-13, nan_ok=True), where
    else:
        assert got == want, where


@pytest.mark.slow
def test_chunk_and_row_group_sizes_change_no_output(tmp_path):
    """Every table and the summary are the same (to rounding) whatever the reader's chunk size and the writer's
    row-group size: sequences and steps straddle chunks and row groups, and the pass sums them piece by piece."""
    whole = _ragged_log(tmp_path / "whole", 1 << 20)
    small = _ragged_log(tmp_path / "small", 37)
    want = diagnose(whole, nan="drop", chunk_rows=1 << 20, progress=False)
    assert want.summary["nan"]["tokens"]["old_logp"] > 0 and want.summary["advantages"] == ["none", "sequence",
                                                                                             "token"]
    assert (want.tables["corrections"]["tokens_changed"] > 0).all()
    for path, chunk in ((whole, 5), (whole, 211), (small, 1 << 20), (small, 64)):
        got = diagnose(path, nan="drop", chunk_rows=chunk, progress=False)
        _assert_close(got.summary, want.summary, f"summary ({path.name}, chunk {chunk})")
        assert set(got.tables) == set(want.tables)
        for name, table in want.tables.items():
            pd.testing.assert_frame_equal(got.tables[name], table, check_exact=False, rtol=1e-10, atol=1e-13,
                                          obj=f"{name} ({path.name}, chunk {chunk})")
