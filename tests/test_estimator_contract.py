"""Every registered estimator (lab.estimators.names(): a new one is covered without new test code) against the input
contract in lab.estimators.registry: junk on padding changes nothing, NaN/inf at real positions raise outside
torch.func transforms and reach the loss and the gradient inside them, empty batches raise, rows without tokens get
no gradient, mismatched shapes and bad masks raise, half precision is computed in float32, and hyper-parameters
outside their declared domains raise LabError."""
import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.func import grad, vmap

from lab import estimators
from lab.errors import LabError
from lab.estimators.aggregation import AGG_MODES

NAMES = estimators.names()
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
JUNK = [float("nan"), float("inf"), -float("inf"), 1e30, -1e30]


def batch(name, B=4, T=3, V=5, seed=0, dtype=torch.float64, lengths=None, optional=True):
    """(log_prob leaf, old_log_prob, advantages, mask, named inputs, logits leaf or None) for one estimator."""
    info = estimators.info(name)
    g = torch.Generator().manual_seed(seed)
    lengths = lengths if lengths is not None else [T, max(T - 1, 0), 1, T][:B] + [T] * max(B - 4, 0)
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).to(dtype)
    logits = torch.randn(B, T, V, generator=g, dtype=torch.float64).to(dtype)
    tokens = torch.randint(V, (B, T), generator=g)
    lp0 = torch.log_softmax(logits.double(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    teacher_logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)

    def near(scale):
        return (lp0 + scale * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)

    extras = {"rewards": torch.randn(B, generator=g, dtype=torch.float64), "group_size": 2,
              "teacher_logits": teacher_logits, "ref_log_prob": near(0.3), "rollout_log_probs": near(0.3),
              "teacher_log_prob": torch.log_softmax(teacher_logits, -1).gather(-1, tokens[..., None]).squeeze(-1),
              "selection_keys": torch.rand(B, T, generator=g, dtype=torch.float64),
              "lag": torch.randint(0, 4, (B, T), generator=g).to(torch.float64)}
    wanted = list(info.inputs) + (list(info.optional_inputs) if optional else [])
    named = {k: (v.to(dtype) if torch.is_tensor(v) else v) for k, v in extras.items() if k in wanted}
    adv = torch.randn(B, 1, generator=g, dtype=torch.float64).expand(B, T).to(dtype)
    old = near(0.5).to(dtype)
    lp = lp0.to(dtype).clone().requires_grad_(True)
    logit_leaf = None
    if "logits" in wanted:
        logit_leaf = logits.clone().requires_grad_(True)
        named["logits"] = logit_leaf
    return lp, old, adv, mask, named, logit_leaf


def loss_and_grads(name, lp, old, adv, mask, named, logit_leaf, mode="token-mean"):
    loss, metrics = estimators.get(name)(lp, old, adv, mask, loss_agg_mode=mode, **named)
    leaves = [lp] + ([logit_leaf] if logit_leaf is not None else [])
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads)]
    return loss.detach(), grads, metrics


def with_junk(x, pad, value):
    """x with ``value`` on the padding positions (pad [B, T]; [B, T, V] tensors get it on whole padded rows)."""
    at = pad.bool()[..., None].expand_as(x) if x.dim() == 3 else pad.bool()
    return torch.where(at, torch.full_like(x, value), x)


# ---------------------------------------------------------------------------------------------------- padding
@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=4, **SETTINGS)
@given(seed=st.integers(0, 10**6), junk=st.sampled_from(JUNK), mode=st.sampled_from(AGG_MODES),
       lengths=st.lists(st.integers(0, 3), min_size=4, max_size=4))
@pytest.mark.slow
def test_junk_on_padding_changes_neither_loss_nor_gradient(name, seed, junk, mode, lengths):
    lp, old, adv, mask, named, logit_leaf = batch(name, seed=seed, lengths=lengths)
    base = loss_and_grads(name, lp, old, adv, mask, named, logit_leaf, mode)
    pad = 1 - mask
    lp2 = with_junk(lp.detach(), pad, junk).requires_grad_(True)
    logit2 = None if logit_leaf is None else with_junk(logit_leaf.detach(), pad, junk).requires_grad_(True)
    named2 = {k: (logit2 if k == "logits" else with_junk(v, pad, junk) if torch.is_tensor(v) and v.dim() >= 2 else v)
              for k, v in named.items()}
    other = loss_and_grads(name, lp2, with_junk(old, pad, junk), with_junk(adv, pad, junk), mask, named2, logit2, mode)
    assert torch.equal(base[0], other[0]), f"{name}: {junk} on padding changed the loss"
    for a, b in zip(base[1], other[1]):
        assert torch.equal(a, b), f"{name}: {junk} on padding changed the gradient"
    for key, v in base[2].items():
        assert torch.equal(v, other[2][key]) or (torch.isnan(v) and torch.isnan(other[2][key])), key


# ---------------------------------------------------------------------------------------------------- invalid values
PER_TOKEN_INPUTS = ["log_prob", "old_log_prob", "advantages", "ref_log_prob", "rollout_log_probs", "teacher_log_prob",
                    "selection_keys", "lag"]


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_value_at_a_real_position_raises(name):
    info = estimators.info(name)
    keys = [k for k in PER_TOKEN_INPUTS
            if k in ("log_prob", "old_log_prob", "advantages") or k in (*info.inputs, *info.optional_inputs)]
    for key in keys:
        for bad in (float("nan"), float("inf")):
            lp, old, adv, mask, named, _ = batch(name)
            args = {"log_prob": lp.detach().clone(), "old_log_prob": old.clone(), "advantages": adv.clone(), **named}
            args[key] = args[key].clone()
            args[key][0, 0] = bad  # row 0 is full length: a real token
            with pytest.raises(LabError, match=key):
                estimators.get(name)(args.pop("log_prob"), args.pop("old_log_prob"), args.pop("advantages"), mask,
                                     **args)


@pytest.mark.parametrize("name", NAMES)
def test_non_finite_value_at_a_real_position_poisons_loss_and_gradient_under_vmap(name):
    """Inside torch.func transforms values cannot be inspected: a NaN must reach the loss and the whole gradient."""
    M = 2
    parts = [batch(name, seed=s) for s in range(M)]
    lp = torch.stack([p[0].detach() for p in parts])
    old = torch.stack([p[1] for p in parts])
    old[1, 0, 0] = float("nan")  # replicate 1 only
    adv, mask = torch.stack([p[2] for p in parts]), torch.stack([p[3] for p in parts])
    named = {k: torch.stack([p[4][k].detach() for p in parts]) for k, v in parts[0][4].items() if torch.is_tensor(v)}
    static = {k: v for k, v in parts[0][4].items() if not torch.is_tensor(v)}

    def f(a, b, c, m, extra):
        return estimators.get(name)(a, b, c, m, loss_agg_mode="token-mean", **extra, **static)[0]

    values = vmap(f)(lp, old, adv, mask, named)
    grads = vmap(grad(f))(lp, old, adv, mask, named)
    assert torch.isfinite(values[0]) and torch.isfinite(grads[0]).all()
    real = mask[1] > 0  # padding keeps a zero gradient (torch.where blocks it)
    assert torch.isnan(values[1]) and torch.isnan(grads[1][real]).all(), f"{name}: a NaN input was dropped under vmap"
    assert torch.equal(grads[1][~real], torch.zeros_like(grads[1][~real]))


@pytest.mark.parametrize("name", NAMES)
def test_bad_masks_and_positive_log_probs_raise(name):
    lp, old, adv, mask, named, _ = batch(name)
    half = mask.clone()
    half[0, 0] = 0.5
    with pytest.raises(LabError, match="response_mask must hold only 0 and 1"):
        estimators.get(name)(lp, old, adv, half, **named)
    positive = lp.detach().clone()
    positive[0, 0] = 0.5
    with pytest.raises(LabError, match="log_prob holds log-probs above 0"):
        estimators.get(name)(positive, old, adv, mask, **named)
    # bool and integer masks are the float mask
    ref = estimators.get(name)(lp, old, adv, mask, **named)[0]
    assert torch.equal(estimators.get(name)(lp, old, adv, mask.bool(), **named)[0], ref)
    assert torch.equal(estimators.get(name)(lp, old, adv, mask.long(), **named)[0], ref)


# ---------------------------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("name", NAMES)
def test_empty_batches_raise_one_clear_error(name):
    for B, T in [(0, 3), (4, 0)]:
        lp, old, adv, mask, named, _ = batch(name, B=4, T=3)
        lp, old, adv, mask = (x[:B, :T] for x in (lp.detach(), old, adv, mask))
        named = {k: (v[:B, :T] if torch.is_tensor(v) and v.dim() >= 2 else v[:B] if torch.is_tensor(v) else v)
                 for k, v in named.items()}
        with pytest.raises(LabError, match="the batch is empty"):
            estimators.get(name)(lp, old, adv, mask, **named)


@pytest.mark.parametrize("name", NAMES)
def test_rows_without_tokens_get_no_gradient_and_an_all_masked_batch_none_at_all(name):
    for mode in AGG_MODES:
        lp, old, adv, mask, named, logit_leaf = batch(name, lengths=[3, 0, 2, 0])
        loss, grads, metrics = loss_and_grads(name, lp, old, adv, mask, named, logit_leaf, mode)
        assert torch.isfinite(loss) and all(torch.isfinite(v) for v in metrics.values())
        for g in grads:
            assert torch.isfinite(g).all() and float(g[1].abs().sum()) == 0.0 and float(g[3].abs().sum()) == 0.0
        lp, old, adv, mask, named, logit_leaf = batch(name, lengths=[0, 0, 0, 0])
        loss, grads, metrics = loss_and_grads(name, lp, old, adv, mask, named, logit_leaf, mode)
        assert all(float(g.abs().sum()) == 0.0 for g in grads) and all(torch.isfinite(v) for v in metrics.values())
        if name != "gvpo":  # GVPO's regression keeps its reward term: 1/2 Var(R) per group, a constant
            assert float(loss) == 0.0, mode


@pytest.mark.parametrize("name", NAMES)
def test_mismatched_shapes_raise_one_clear_error(name):
    lp, old, adv, mask, named, _ = batch(name)
    fn = estimators.get(name)
    bad = {
        "old_log_prob": (lp, old[:, :2], adv, mask, named),
        "response_mask": (lp, old, adv, mask[:3], named),
        "advantages": (lp, old, adv[:, 0], mask, named),  # 1-D [B]
        "log_prob": (lp[0], old, adv, mask, named),
    }
    for key, args in bad.items():
        with pytest.raises(LabError, match=key):
            fn(*args[:4], **args[4])
    for key in [k for k in ("ref_log_prob", "rollout_log_probs", "teacher_log_prob", "logits", "selection_keys", "lag")
                if k in named]:
        with pytest.raises(LabError, match=key):
            fn(lp, old, adv, mask, **{**named, key: named[key][:, :2]})
    # a per-sequence advantage [B, 1] is accepted and equals the broadcast one
    assert torch.equal(fn(lp, old, adv[:, :1], mask, **named)[0], fn(lp, old, adv, mask, **named)[0])


@pytest.mark.parametrize("name", NAMES)
def test_shapes_are_checked_under_vmap_too_and_values_are_not_read_there(name):
    lp, old, adv, mask, named, _ = batch(name)
    static = {k: v for k, v in named.items() if not torch.is_tensor(v)}
    tensors = {k: v.detach()[None] for k, v in named.items() if torch.is_tensor(v)}
    f = estimators.get(name)
    with pytest.raises(LabError, match="old_log_prob"):
        vmap(lambda a, b: f(a, b, adv, mask, **named)[0])(lp.detach()[None], old[None, :, :2])
    # positive log-probs cannot be seen under vmap: no error (outside, test_bad_masks_... raises)
    positive = lp.detach().clone()
    positive[0, 0] = 0.5
    out = vmap(lambda a, b, c, m, e: f(a, b, c, m, **e, **static)[0])(
        positive[None], old[None], adv[None], mask[None], tensors)
    assert out.shape == (1,)


# ---------------------------------------------------------------------------------------------------- precision
@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", NAMES)
def test_half_precision_is_computed_in_float32(name, half):
    """Log-ratios of +-30 (W up to e^60 before the clamps) in float16: the loss is the float32 loss of the same
    values, and the gradient is the float32 gradient rounded to the input's precision."""
    lp, old, adv, mask, named, logit_leaf = batch(name, dtype=torch.float32)
    old = old.clone()
    lp = lp.detach().clone()
    lp[0, 0], old[0, 0] = 0.0, -30.0  # log-ratio +30
    lp[3, 1], old[3, 1] = -30.0, 0.0  # log-ratio -30
    if "rollout_log_probs" in named:
        named["rollout_log_probs"] = named["rollout_log_probs"].clone()
        named["rollout_log_probs"][0, 1] = -30.0

    def cast(x, dtype):
        return x.to(dtype) if torch.is_tensor(x) and x.is_floating_point() else x

    low = {k: cast(v.detach(), half) if torch.is_tensor(v) else v for k, v in named.items()}
    lp16 = lp.to(half).requires_grad_(True)
    inputs16 = (cast(old, half), cast(adv, half), cast(mask, half))
    if logit_leaf is not None:
        low["logits"] = logit_leaf.detach().to(half).requires_grad_(True)
    loss16, grads16, _ = loss_and_grads(name, lp16, *inputs16, low, low.get("logits"))
    # the reference: the same (rounded) values, computed in float32
    ref = {k: cast(v.detach(), torch.float32) if torch.is_tensor(v) else v for k, v in low.items()}
    lp32 = lp16.detach().float().requires_grad_(True)
    if logit_leaf is not None:
        ref["logits"] = low["logits"].detach().float().requires_grad_(True)
    loss32, grads32, _ = loss_and_grads(name, lp32, *(cast(x, torch.float32) for x in inputs16), ref,
                                        ref.get("logits"))
    assert loss16.dtype == torch.float32 and torch.isfinite(loss16)
    assert torch.equal(loss16, loss32)
    for g16, g32 in zip(grads16, grads32):
        assert g16.dtype == half and torch.equal(g16, g32.to(half))


# ---------------------------------------------------------------------------------------------------- hyper-parameters
def _bad_values(domain):
    spec = domain.spec
    base = spec[:-len(" or None")] if spec.endswith(" or None") else spec
    bad = ["abc", float("nan"), float("inf")]
    if base == "bool":
        return ["abc", 1, None]
    if base == "positive integer":
        return ["abc", 0, -3, 2.5, True]
    bad.append(True)
    bad += {"positive": [0.0, -1.0], "nonnegative": [-1e-3, -1.0], "finite": []}.get(base, [])
    if base.startswith(">"):
        bound = float(base.lstrip(">= "))
        bad.append(bound - 1.0)
        if not base.startswith(">="):
            bad.append(bound)
    if not spec.endswith(" or None"):
        bad.append(None)
    return bad


@pytest.mark.parametrize("name", NAMES)
def test_hyper_parameters_outside_their_domain_raise(name):
    lp, old, adv, mask, named, _ = batch(name)
    for key, domain in estimators.info(name).domains.items():
        for value in _bad_values(domain):
            with pytest.raises(LabError, match=f"estimator '{name}': {key} must be"):
                estimators.check_hyper(name, {key: value})
            with pytest.raises(LabError, match=f"{key} must be"):
                estimators.get(name)(lp, old, adv, mask, **named, **{key: value})


def test_every_hyper_parameter_has_a_domain_its_default_satisfies():
    for name in NAMES:
        info = estimators.info(name)
        assert set(info.domains) == set(info.defaults), name
        estimators.check_hyper(name, {})  # the defaults are admissible
        assert isinstance(info.differences, str)


def test_hyper_parameter_examples_and_cross_checks():
    for name, hyper, match in [
        ("tis_token", {"cap": -1}, "cap must be a finite number > 0, got -1"),
        ("tis_seq", {"cap": float("nan")}, "cap must be"),
        ("gvpo", {"beta": 0}, "beta must be a finite number > 0, got 0"),
        ("sapo", {"tau_pos": "abc"}, "tau_pos must be a finite number > 0, got 'abc'"),
        ("ppo_clip", {"clip_ratio_c": 1.0}, r"clip_ratio_c must be a finite number > 1 or None \(off\), got 1.0"),
        ("vopd_topk", {"k": 0}, "k must be a positive whole number"),
        ("mis_token", {"lower": 3.0, "upper": 2.0}, r"the band is empty: lower \(3.0\) exceeds upper \(2.0\)"),
        ("cispo", {"clip_ratio_low": 0.0, "clip_ratio_high": -0.5}, "clip range"),
    ]:
        with pytest.raises(LabError, match=match):
            estimators.check_hyper(name, hyper)
    # admissible edge values
    estimators.check_hyper("ppo_clip", {"clip_ratio_c": None})
    estimators.check_hyper("cispo", {"clip_ratio_high": -0.8})  # TRL's 0.2 fallback cap
    estimators.check_hyper("mis_seq", {"lower": 0.0, "upper": 3.0})  # TRL's sequence_mask
    with pytest.raises(LabError, match="no hyper-parameter"):
        estimators.get("ppo_clip")(*batch("ppo_clip")[:4], eps=0.1)


def test_check_inputs_runs_the_value_checks_on_their_own():
    lp, old, adv, mask, named, _ = batch("tis_token")
    estimators.check_inputs("tis_token", lp, old, adv, mask, **named)
    bad = named["rollout_log_probs"].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(LabError, match="rollout_log_probs holds NaN at 1 real"):
        estimators.check_inputs("tis_token", lp, old, adv, mask, rollout_log_probs=bad)
    with pytest.raises(LabError, match="advantages must be"):
        estimators.check_inputs("tis_token", lp, old, adv[:, 0], mask)
    assert math.isfinite(float(estimators.get("tis_token")(lp, old, adv, mask, **named)[0].detach()))


# ---------------------------------------------------------------------------------------------------- empty rows
def test_empty_rows_count_as_rows_in_every_seq_mean_mode_by_hand():
    # 10 rows of 2 positions: rows 0-7 full, row 8 one token, row 9 empty (17 real tokens); loss 1 per token
    mask = torch.ones(10, 2, dtype=torch.float64)
    mask[8, 1] = 0.0
    mask[9] = 0.0
    ones = torch.ones(10, 2, dtype=torch.float64)
    assert float(estimators.agg_loss(ones, mask, "token-mean")) == pytest.approx(17 / 17)
    assert float(estimators.agg_loss(ones, mask, "seq-mean-token-sum")) == pytest.approx(17 / 10)  # not 17 / 9
    assert float(estimators.agg_loss(ones, mask, "seq-mean-token-mean")) == pytest.approx(9 / 10)  # 0.9x, as TRL
    assert float(estimators.agg_loss(ones, mask, "seq-mean-token-sum-norm")) == pytest.approx(17 / 20)
    # REINFORCE with A = 1, log pi = -1: the same numbers, and the empty row gets no gradient
    lp = (-ones).requires_grad_(True)
    loss, _ = estimators.get("reinforce")(lp, -ones, ones, mask, loss_agg_mode="seq-mean-token-sum")
    (g,) = torch.autograd.grad(loss, lp)
    assert float(loss.detach()) == pytest.approx(17 / 10) and torch.equal(g[9], torch.zeros(2, dtype=torch.float64))
    assert torch.allclose(g[:8], torch.full((8, 2), -1 / 10, dtype=torch.float64))
    # verl's agg_loss without global batch information (a loss called on its own) divides by the 9 non-empty rows;
    # to_verl reproduces it (config None), and the trainer's global_batch_size = 10 gives the lab's number back
    fn = estimators.to_verl("reinforce")
    alone, _ = fn(-ones, -ones, ones, mask.bool(), "seq-mean-token-sum", None)
    trainer_info = {"global_batch_info": {"global_batch_size": 10}}
    trainer, _ = fn(-ones, -ones, ones, mask.bool(), "seq-mean-token-sum", trainer_info)
    assert float(alone.detach()) == pytest.approx(17 / 9) and float(trainer.detach()) == pytest.approx(17 / 10)
    token_sum, _ = fn(-ones, -ones, ones, mask.bool(), "token-sum", None)
    assert float(token_sum.detach()) == pytest.approx(17.0)
