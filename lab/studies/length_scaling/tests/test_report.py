"""What the length_scaling report decides is what the summary says: the decisions and flags are checked on
hand-made summaries, and the template renders them."""
import copy

from lab.studies.length_scaling import report


def _point(regime, T, mse, khat=0.3, exact=(0.1, 0.1), sampled=(0.1, 0.05, 0.2), log_m2=None):
    """One point; mse: name -> rel_mse; ||grad J|| = 1."""
    ests = {n: {"rel_mse": m, "rel_bias": sampled[0], "rel_noise": 1.0, "variance": m, "bias_norm": sampled[0],
                "mse": m} for n, m in mse.items()}
    ivs = {n: {"rel_mse": [0.9 * m, 1.1 * m], "rel_bias": list(sampled[1:]), "variance": [0.9 * m, 1.1 * m]}
           for n, m in mse.items()}
    return {"regime": regime, "length": T, "scale": 0.1, "kl_token": 0.01, "kl_seq": 0.01 * T,
            "chi2_token": 0.02, "chi2_seq": 1.0, "log_m2": 0.0198 * T if log_m2 is None else log_m2,
            "logw_var": 0.02 * T, "mean_len": float(T), "objective": 0.1, "grad_norm": 1.0,
            "ess_frac": [0.5, 0.4, 0.6], "khat": [khat, khat - 0.1, khat + 0.1], "estimators": ests,
            "intervals": ivs, "exact": {"token_is": {"rel_bias": exact[0], "first_order": exact[1]}}}


def _summary(points, fits):
    return {"study": "length_scaling", "env": "long_dense", "policy": "markov", "lengths": [8, 64, 512],
            "regimes": ["token"], "kl_token": 0.01, "kl_seq": 0.5, "loss_agg_modes": {}, "points": points,
            "fits": fits, "config": {"batch_size": 32, "group_size": 8, "advantage": "rloo",
                                     "loss_agg_mode": "seq-mean-token-sum", "replicates": 100,
                                     "trajectory_steps": 8}}


FIT = {"regime": "token", "theory_rate": 0.0198, "dp_rate": 0.0199, "measured_rate": [0.019, 0.015, 0.023],
       "bias_exponent": {"token_is": 0.5}, "first_order_exponent": {"token_is": 0.5}}
AGREE = _summary([_point("token", 8, {"reinforce": 1.0, "seq_is": 1.2, "token_is": 0.9}),
                  _point("token", 64, {"reinforce": 2.0, "seq_is": 3.0, "token_is": 1.5}),
                  _point("token", 512, {"reinforce": 4.0, "seq_is": 90.0, "token_is": 3.0})], [FIT])


def test_when_theory_and_measurement_agree_nothing_is_flagged():
    d = report.decide(report.summary_of(AGREE))
    assert d.flags == [] and d.best["token"] == {8: "token_is", 64: "token_is", 512: "token_is"}
    assert d.flips["token"] == []
    line = report.headline("length_scaling", AGREE)
    assert "lowest MSE token_is" in line and "0.019/token measured vs 0.0198 theory" in line
    assert line.endswith("theory and measurement agree")


def test_each_disagreement_is_flagged_where_it_happens():
    s = copy.deepcopy(AGREE)
    s["fits"][0].update(dp_rate=0.03, measured_rate=[0.005, 0.001, 0.009])  # Markov gap; sampled growth stalls
    s["points"][2] = _point("token", 512, {"reinforce": 4.0, "seq_is": 2.0, "token_is": 3.0}, khat=0.9,
                            exact=(0.5, 0.2), sampled=(0.1, 0.0, 0.3))
    d = report.decide(report.summary_of(s))
    kinds = {(f.kind, f.length) for f in d.flags}
    assert kinds == {("markov", None), ("variance", None), ("first_order", 512), ("engine", 512), ("khat", 512)}
    assert d.flips["token"] == [(64, "token_is", 512, "seq_is")]
    assert report.headline("length_scaling", s).endswith("5 disagreements flagged")
    md = report.answer(s)
    for fact in ("0.03/token exactly", "0.0198", "k-hat 0.90", "token_is → seq_is between T = 64 and 512",
                 "T^0.5", "long_dense"):
        assert fact in md, fact
    assert "{" not in md.replace("{8, 64, 512}", "")


def test_the_length_table_marks_the_lowest_mse():
    html = report.length_table(AGREE, "token").to_html()
    assert "0.9 [0.81, 0.99]" in html and "0.1 / 0.1" in html
