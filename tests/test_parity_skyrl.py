"""Parity with SkyRL 0.4.0's own code (``skyrl/backends/skyrl_train/utils/ppo_utils.py``: ``dppo_policy_loss``,
``ppo_policy_loss`` with ``off_policy_correction_utils.apply_off_policy_correction``, ``compute_policy_loss_kl_cov``,
``compute_policy_loss_clip_cov``; configs from ``skyrl/train/config/config.py``), run from the installed wheel
(tests/shipped_code.py) on the same tensors as the lab's estimators.

SkyRL normalises by scaling the advantages (``apply_loss_reduction_to_advantages_minibatch``, here "token_mean") and
then sums the per-token loss (``reduce_loss``); the lab's token-mean loss of the unscaled advantages is the same
number wherever the loss is linear in A. Every case has ragged rows, an empty row, both advantage signs, and compares
d loss / d log pi (and the loss where the lab follows SkyRL's form) to 1e-6. Needs skyrl installed without
dependencies and with --ignore-requires-python (its loss modules run on 3.11; .ci/run).
"""
import pytest
import torch

from lab import estimators
from shipped_code import load, permutation_keys

TOL = 1e-6
B, T = 8, 6
LENGTHS = [6, 3, 0, 4, 1, 6, 2, 5]
CONFIGS = ["BaseConfig", "KLCtrlConfig", "SAPOConfig", "DynamicSamplingConfig", "ClipCovConfig", "KLCovConfig",
           "CISPOConfig", "DPPOConfig", "OffPolicyCorrectionConfig", "AlgorithmConfig"]


@pytest.fixture(scope="module")
def skyrl():
    cfg = load("skyrl", "train/config/config.py", CONFIGS)
    torch_utils = load("skyrl", "backends/skyrl_train/utils/torch_utils.py", ["masked_mean", "safe_exp_delta"])
    helpers = {k: torch_utils[k] for k in ("masked_mean", "safe_exp_delta")}
    correction = load("skyrl", "backends/skyrl_train/utils/off_policy_correction_utils.py", None, helpers)
    ppo = load("skyrl", "backends/skyrl_train/utils/ppo_utils.py",
               ["ppo_policy_loss", "dppo_policy_loss", "compute_policy_loss_kl_cov", "compute_policy_loss_clip_cov",
                "reduce_loss", "apply_loss_reduction_to_advantages_minibatch"],
               {**helpers, "apply_off_policy_correction": correction["apply_off_policy_correction"],
                "AlgorithmConfig": cfg["AlgorithmConfig"]})
    return {**cfg, **ppo}


def _batch(seed=23):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    lp = -2.0 * torch.rand(B, T, generator=g, dtype=torch.float64)
    old = (lp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    # a sampler close to pi_old on rows 0, 3, 5 (geometric-mean ratio within 1 +/- 0.005) and far on the others
    near = torch.tensor([1, 0, 0, 1, 0, 1, 0, 0], dtype=torch.float64)[:, None]
    noise = torch.randn(B, T, generator=g, dtype=torch.float64)
    rollout = old + torch.where(near > 0, 0.004 * noise.clamp(-1, 1), 0.5 * noise)
    signs = torch.tensor([1.0, -1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0], dtype=torch.float64)
    adv = (signs * (0.2 + torch.rand(B, generator=g, dtype=torch.float64)))[:, None].expand(B, T).clone()
    return mask, lp, old, rollout, adv


MASK, LP, OLD, ROLLOUT, ADV = _batch()


def both(f):
    x = LP.clone().requires_grad_(True)
    loss = f(x)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad


def skyrl_loss(s, fn_name, config, x, rollout=None, adv=ADV):
    scaled = s["apply_loss_reduction_to_advantages_minibatch"](adv, MASK, "token_mean", B, T)
    loss, _ = s[fn_name](x, OLD, scaled, config, loss_mask=MASK, rollout_logprobs=rollout)
    return loss


def lab(name, old=OLD, mode="token-mean", adv=ADV, **kw):
    return both(lambda x: estimators.get(name)(x, old, adv, MASK, loss_agg_mode=mode, **kw)[0])


def algorithm(s, **fields):
    config = s["AlgorithmConfig"]()
    for key, value in fields.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("three_policy", [False, True])
@pytest.mark.parametrize("kind,name,delta", [("binary_tv", "dppo_tv", 0.2), ("binary_kl", "dppo_kl", 0.05)])
def test_dppo_has_skyrl_gradient(skyrl, kind, name, delta, three_policy):
    config = algorithm(skyrl, policy_loss_type="dppo", dppo=skyrl["DPPOConfig"](kind, delta, delta))
    rollout = ROLLOUT if three_policy else None
    theirs = both(lambda x: skyrl_loss(skyrl, "dppo_policy_loss", config, x, rollout))
    extra = {"rollout_log_probs": ROLLOUT} if three_policy else {}
    ours = lab(name, clip_ratio_low=delta, clip_ratio_high=delta, clip_ratio_c=1e30, **extra)
    assert float((ours[1] - theirs[1]).abs().max()) <= TOL, name
    # the loss values differ on purpose: SkyRL keeps rho in the graph (-A rho), the lab follows verl (-A sg[rho] log pi)
    assert float((ours[0] - theirs[0]).abs()) > 1e-3
    assert 0 < float(estimators.get(name)(LP, OLD, ADV, MASK, **extra)[1]["clipfrac"]) < 1


def test_geometric_mask_equals_skyrl_sequence_mask(skyrl):
    correction = skyrl["OffPolicyCorrectionConfig"](sequence_mask_metric="geometric")
    config = algorithm(skyrl, off_policy_correction=correction)
    theirs = both(lambda x: skyrl_loss(skyrl, "ppo_policy_loss", config, x, ROLLOUT))
    ours = lab("geo_rs_skyrl", rollout_log_probs=ROLLOUT)
    assert float((ours[0] - theirs[0]).abs()) <= TOL and float((ours[1] - theirs[1]).abs().max()) <= TOL
    masked = float(estimators.get("geo_rs_skyrl")(LP, OLD, ADV, MASK, rollout_log_probs=ROLLOUT)[1]["rs_masked_frac"])
    assert 0 < masked < 1  # the band keeps some sequences and drops others
    assert (correction.geo_mask_low, correction.geo_mask_high) == (0.99, 1.01)


def test_kl_cov_skyrl_equals_skyrl(skyrl):
    config = algorithm(skyrl, policy_loss_type="kl_cov")
    theirs = both(lambda x: skyrl_loss(skyrl, "compute_policy_loss_kl_cov", config, x))
    ours = lab("kl_cov_skyrl")
    assert float((ours[0] - theirs[0]).abs()) <= TOL and float((ours[1] - theirs[1]).abs().max()) <= TOL
    assert (config.kl_cov.kl_cov_frac, config.kl_cov.ppo_kl_coef) == (0.2, 1.0)


def test_clip_cov_equals_skyrl_given_its_advantage_scaling_and_random_choice(skyrl):
    """SkyRL ranks the covariance of its scaled advantages A / N; given those advantages (and the same random
    permutation of the candidates) the lab's clip_cov is SkyRL's function, summed (seq-mean-token-sum times B)."""
    scaled = skyrl["apply_loss_reduction_to_advantages_minibatch"](ADV * 160.0, MASK, "token_mean", B, T)
    config = algorithm(skyrl, policy_loss_type="clip_cov")
    config.clip_cov.clip_ratio = 0.1  # two of the 27 tokens, among five candidates: the random choice matters
    keys, n_candidates = permutation_keys(candidates(scaled, config.clip_cov), seed=5)
    assert n_candidates > 2
    torch.manual_seed(5)
    theirs = both(lambda x: skyrl["compute_policy_loss_clip_cov"](x, OLD, scaled, config, loss_mask=MASK)[0])
    ours = both(lambda x: B * estimators.get("clip_cov")(x, OLD, scaled, MASK, loss_agg_mode="seq-mean-token-sum",
                                                         clip_cov_ratio=0.1, selection_keys=keys)[0])
    assert float((ours[0] - theirs[0]).abs()) <= TOL and float((ours[1] - theirs[1]).abs().max()) <= TOL


def candidates(advantages, clip_cov):
    """SkyRL's Clip-Cov candidates: real tokens PPO did not clip whose covariance lies in (lb, ub)."""
    from lab.estimators.covariance import covariance

    ratio = torch.exp(LP - OLD)
    by_origin = (-advantages * torch.clamp(ratio, 0.8, 1.2) > -advantages * ratio) & (MASK > 0)
    cov = covariance(advantages, LP, MASK, eps=0.0)
    return (MASK > 0) & ~by_origin & (cov > clip_cov.clip_cov_lb) & (cov < clip_cov.clip_cov_ub)
