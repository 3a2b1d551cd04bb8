"""`lab estimators` (every entry with its label, paper and inputs; `--preset verl` and `--preset verl:NAME`), and the
new estimators and verl's presets by name through `lab variance` and `lab train`, with one clear line for bad
input."""
import json

import pandas as pd
import pytest

from lab.cli import main
from lab.estimators import presets


def test_estimators_lists_every_entry_with_label_paper_and_inputs(capsys):
    assert main(["estimators"]) == 0
    out = capsys.readouterr().out
    for name, label, text in [("dppo_prime", "prime-rl DPPO+KL", "e48a538"),
                              ("m2po_clip", "M2PO (global clip)", "af54a3e"), ("vespo", "VESPO", "arXiv 2602.10693")]:
        assert f"{name}  [" in out and label in out and text in out
    assert "inputs: rollout_log_probs, lag (optional)" in out  # decoupled_ppo's
    assert "verl:NAME" in out


def test_preset_listing_names_every_verl_preset_and_its_composition(capsys):
    assert main(["estimators", "--preset", "verl"]) == 0
    out = capsys.readouterr().out
    for name in presets.names():
        assert out.count(f"{name}: ") == 1
    assert "verl:bypass_pg_geo_rs_token_tis: bypass_mode, loss_type='reinforce', rollout_is='token' 2.0, " \
           "rollout_rs='seq_mean_k1' '0.999_1.001' -> geo_rs(bypass_loss='reinforce', tis='token'), two-policy" in out
    assert main(["estimators", "--preset", "verl:decoupled_k3_rs"]) == 0
    one = capsys.readouterr().out.strip().splitlines()
    assert one == ["verl:decoupled_k3_rs: rollout_is=None, rollout_rs='seq_mean_k3' 0.01 -> k3_rs(), three-policy "
                   "(decoupled)"]


@pytest.mark.parametrize("args,needle", [
    (["estimators", "--preset", "openrlhf"], "unknown preset system 'openrlhf'"),
    (["estimators", "--preset", "verl:geo"], "unknown estimator or preset 'verl:geo'"),
    (["variance", "--estimators", "verl:geo", "--replicates", "4"], "unknown estimator or preset 'verl:geo'"),
    (["variance", "--estimators", "geo_rs", "--hyper", "geo_rs.tis=tokens"], "tis must be one of 'none', 'token', "
                                                                             "'sequence', got 'tokens'"),
    (["train", "--estimator", "decoupled_ppo", "--hyper", "decoupled_ppo.proximal=approx"], "proximal must be one of"),
])
def test_bad_names_and_values_are_one_clear_line(tmp_path, capsys, args, needle):
    out = [] if args[0] == "estimators" else ["--out", str(tmp_path / "run")]
    assert main([*args, *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_variance_runs_new_estimators_and_presets_by_name(tmp_path, capsys):
    names = "dppo_tv,m2po,clip_cov,vcpo,verl:decoupled_geo_rs_token_tis,verl:bypass_pg_is"
    assert main(["variance", "--estimators", names, "--values", "0,4", "--replicates", "20", "--n-boot", "20",
                 "--trajectory-steps", "4", "--hyper", "verl:bypass_pg_is.cap=3", "--out", str(tmp_path / "v")]) == 0
    results = pd.read_parquet(tmp_path / "v" / "results.parquet")
    assert set(names.split(",")) <= set(results["estimator"])
    assert results.loc[results.metric == "rel_mse", "value"].notna().all()
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    assert config["hyper"] == {"verl:bypass_pg_is": {"cap": 3}}


@pytest.mark.parametrize("regime", ["sync", "async", "mismatch"])
@pytest.mark.slow
def test_train_runs_presets_and_three_policy_estimators(tmp_path, capsys, regime):
    for name in ("verl:decoupled_k3_rs_seq_tis", "m2po"):
        extra = ["--logprob-noise", "0.3"] if regime == "mismatch" else []
        out = tmp_path / f"{regime}-{name.replace(':', '_')}"
        assert main(["train", "--estimator", name, "--steps", "2", "--minibatches", "4", "--regime", regime, *extra,
                     "--out", str(out)]) == 0
        table = pd.read_parquet(out / "results.parquet")
        assert len(table) == 8 and table["finite"].all()


@pytest.mark.slow
def test_a3po_needs_a_version_lag_which_only_the_lag_knob_defines(tmp_path, capsys):
    args = ["variance", "--estimators", "decoupled_ppo", "--hyper", "decoupled_ppo.proximal=loglinear",
            "--replicates", "4", "--n-boot", "10", "--trajectory-steps", "2"]
    assert main([*args, "--staleness", "kl", "--values", "0.01", "--out", str(tmp_path / "kl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "interpolates by the version lag" in err[0] and not (tmp_path / "kl").exists()
    assert main([*args, "--values", "0,2", "--out", str(tmp_path / "lag")]) == 0
