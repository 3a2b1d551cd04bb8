"""Property tests over EVERY registered estimator (lab.estimators.names(), so later additions are covered).

For random batches with log-ratios up to +-1e4, empty rows, all-equal rewards and advantages, every aggregation
mode, float32 and float64, and every extra input an estimator declares (info.inputs; info.optional_inputs both
given and left out), each estimator either returns a finite 0-dim loss with finite gradients with respect to
log_prob (and the logits, when it reads them) and finite 0-dim detached metrics, or raises LabError with a
message. It is a pure function (same inputs, same outputs), ignores whatever sits on padding positions, and runs
under torch.func.vmap as the variance engine runs it. Hypothesis runs derandomized: the examples are fixed.
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.func import grad, vmap

from lab import estimators
from lab.errors import LabError
from lab.estimators.aggregation import AGG_MODES

NAMES = estimators.names()
KNOWN_INPUTS = {"rewards", "group_size", "logits", "teacher_log_prob", "teacher_logits", "ref_log_prob",
                "rollout_log_probs", "selection_keys", "lag"}
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw):
    G = draw(st.sampled_from([1, 2, 3, 4]))
    B = G * draw(st.integers(1, 3))
    return {
        "G": G, "B": B, "T": draw(st.integers(1, 5)), "V": draw(st.integers(2, 6)),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
        "seed": draw(st.integers(0, 2**31 - 1)),
        "logit_scale": draw(st.sampled_from([0.0, 1.0, 30.0, 1e4])),  # log pi down to about -2e4
        "ratio_scale": draw(st.sampled_from([0.0, 1e-3, 1.0, 30.0, 1e4])),  # |log pi - log mu| up to 1e4
        "lengths": draw(st.lists(st.integers(0, 5), min_size=B, max_size=B)),  # 0: an empty row
        "adv": draw(st.sampled_from(["normal", "zero", "equal", "huge"])),
        "rewards": draw(st.sampled_from(["normal", "equal", "binary"])),
        "padding_zeroed": draw(st.booleans()),  # the engine's convention (log-probs 0 on padding) or junk there
        "mode": draw(st.sampled_from(AGG_MODES)),
        "optional": draw(st.booleans()),
    }


def make_inputs(p):
    """Tensors for one example: logits [B, T, V] (a leaf), log_prob from the logits, and every known extra input."""
    g = torch.Generator().manual_seed(p["seed"])
    B, T, V, dt = p["B"], p["T"], p["V"], p["dtype"]

    def normal(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dt)

    def uniform(*shape):
        return torch.rand(*shape, generator=g, dtype=torch.float64).to(dt)

    mask = (torch.arange(T)[None, :] < torch.tensor(p["lengths"])[:, None].clamp(max=T)).to(dt)
    logits = (normal(B, T, V) * p["logit_scale"]).requires_grad_(True)
    tokens = torch.randint(V, (B, T), generator=g)
    log_prob = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)

    def other_log_prob():  # another policy's log-probs of the same tokens: log-ratios up to +-ratio_scale, <= 0
        return torch.clamp(log_prob.detach() + p["ratio_scale"] * (2 * uniform(B, T) - 1), max=0.0)

    teacher_logits = normal(B, T, V) * p["logit_scale"]
    teacher_log_prob = torch.log_softmax(teacher_logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    adv_seq = {"normal": normal(B), "zero": torch.zeros(B, dtype=dt), "equal": torch.full((B,), 0.7, dtype=dt),
               "huge": 1e4 * normal(B)}[p["adv"]]
    rewards = {"normal": normal(B), "equal": torch.ones(B, dtype=dt),
               "binary": (uniform(B) > 0.5).to(dt)}[p["rewards"]]
    old_log_prob, ref_log_prob, rollout_log_probs = other_log_prob(), other_log_prob(), other_log_prob()
    if p["padding_zeroed"]:
        log_prob = log_prob * mask
        old_log_prob, ref_log_prob, rollout_log_probs, teacher_log_prob = (
            x * mask for x in (old_log_prob, ref_log_prob, rollout_log_probs, teacher_log_prob))
    extras = {"rewards": rewards, "group_size": p["G"], "logits": logits, "teacher_log_prob": teacher_log_prob,
              "teacher_logits": teacher_logits, "ref_log_prob": ref_log_prob, "rollout_log_probs": rollout_log_probs,
              "selection_keys": uniform(B, T), "lag": torch.randint(0, 5, (B, T), generator=g).to(dt)}
    return log_prob, old_log_prob, adv_seq[:, None] * torch.ones(B, T, dtype=dt), mask, extras, logits


def named_inputs(info, extras, optional):
    unknown = (set(info.inputs) | set(info.optional_inputs)) - KNOWN_INPUTS
    assert not unknown, f"{info.name} declares inputs {unknown} this test cannot generate; add them to make_inputs"
    wanted = list(info.inputs) + (list(info.optional_inputs) if optional else [])
    return {k: extras[k] for k in wanted}


def run(name, p):
    """(loss, [grad log_prob, grad logits], metrics), or None after checking a LabError."""
    info = estimators.info(name)
    log_prob, old, adv, mask, extras, logits = make_inputs(p)
    kwargs = named_inputs(info, extras, p["optional"])
    try:
        loss, metrics = info.fn(log_prob, old, adv, mask, loss_agg_mode=p["mode"], **kwargs)
    except LabError as err:
        assert len(str(err)) > 15, f"{name}: LabError without a clear message: {err!r}"
        return None
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0, f"{name}: the loss must be a 0-dim tensor"
    if loss.requires_grad:
        grads = torch.autograd.grad(loss, [log_prob, logits], allow_unused=True)
    else:
        grads = [None, None]
    return loss.detach(), grads, metrics


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=25, **SETTINGS)
@given(p=batches())
@pytest.mark.slow
def test_finite_loss_gradient_and_metrics_or_a_clear_error(name, p):
    out = run(name, p)
    if out is None:
        return
    loss, grads, metrics = out
    assert torch.isfinite(loss), f"{name}: loss {loss} for {p}"
    for what, g in zip(["log_prob", "logits"], grads):
        assert g is None or torch.isfinite(g).all(), f"{name}: non-finite gradient w.r.t. {what} for {p}"
    assert isinstance(metrics, dict)
    for key, v in metrics.items():
        assert isinstance(v, torch.Tensor) and v.dim() == 0, f"{name}: metric {key} must be a 0-dim tensor"
        assert not v.requires_grad, f"{name}: metric {key} must be detached"
        assert torch.isfinite(v), f"{name}: metric {key} = {v} for {p}"
    again = run(name, p)  # a pure function: the same inputs give the same numbers
    assert torch.equal(again[0], loss) and all(
        (a is None and b is None) or torch.equal(a, b) for a, b in zip(again[1], grads))


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=10, **SETTINGS)
@given(p=batches(), shift=st.floats(-30.0, -0.1))
@pytest.mark.slow
def test_padding_positions_do_not_matter(name, p, shift):
    """Moving every tensor's values on padding positions (log-probs stay <= 0) changes neither the loss nor the
    gradient on real tokens."""
    p = {**p, "ratio_scale": min(p["ratio_scale"], 30.0), "logit_scale": min(p["logit_scale"], 30.0),
         "adv": "normal" if p["adv"] == "huge" else p["adv"], "dtype": torch.float64}
    info = estimators.info(name)
    log_prob, old, adv, mask, extras, logits = make_inputs(p)
    kwargs = named_inputs(info, extras, p["optional"])
    pad = 1 - mask
    lp_leaf = log_prob.detach().requires_grad_(True)

    def moved(x, by):  # different amounts for different tensors, so padding log-ratios change too
        if x.dim() == 3:  # logits / teacher logits: move the padding positions' whole rows
            return x + pad[..., None] * by * torch.linspace(0, 1, x.shape[-1], dtype=x.dtype)
        return x + pad * by

    def loss_and_grad(lp, o, a, kw):
        try:
            loss, _ = info.fn(lp, o, a, mask, loss_agg_mode=p["mode"], **kw)
        except LabError:
            return None
        (g,) = torch.autograd.grad(loss, lp, allow_unused=True) if loss.requires_grad else (None,)
        return loss.detach(), (torch.zeros_like(lp) if g is None else g) * mask

    # the logits carry the gradient in estimators that read them; here they are fixed data (log_prob is the leaf)
    kw = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
    base = loss_and_grad(lp_leaf, old, adv, kw)
    if base is None:
        return
    kw_moved = {k: (moved(v, shift * (0.2 + 0.15 * i)) if isinstance(v, torch.Tensor) and v.dim() >= 2 else v)
                for i, (k, v) in enumerate(kw.items())}
    lp_moved = moved(log_prob.detach(), shift).requires_grad_(True)
    other = loss_and_grad(lp_moved, moved(old, 0.5 * shift), adv + pad * 123.0, kw_moved)
    assert other is not None
    assert torch.allclose(base[0], other[0], rtol=1e-9, atol=1e-9), f"{name}: padding changed the loss for {p}"
    assert torch.allclose(base[1], other[1], rtol=1e-9, atol=1e-9), f"{name}: padding changed the gradient for {p}"


@pytest.mark.parametrize("name,optional", [(n, False) for n in NAMES]
                         + [(n, True) for n in NAMES if estimators.info(n).optional_inputs])
def test_every_estimator_runs_under_vmap_with_its_inputs(name, optional):
    """vmap(grad) over 3 replicate batches equals a loop, with the gradient taken through the logits."""
    info = estimators.info(name)
    M, B, T, V, G = 3, 4, 3, 5, 2
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(M, B, T, V, generator=g)
    tokens = torch.randint(V, (M, B, T), generator=g)
    mask = torch.ones(M, B, T)
    mask[:, 1, 2:] = 0.0
    mask[:, 3, :] = 0.0  # an empty row in every replicate
    lp0 = torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    teacher_logits = torch.randn(M, B, T, V, generator=g)
    data = {"old": (lp0 + 0.3 * torch.randn(M, B, T, generator=g)).clamp(max=0) * mask,
            "adv": torch.randn(M, B, 1, generator=g).expand(M, B, T) * mask,
            "rewards": torch.randint(2, (M, B), generator=g).float(),
            "teacher_logits": teacher_logits,
            "teacher_log_prob": torch.log_softmax(teacher_logits, -1).gather(-1, tokens[..., None]).squeeze(-1) * mask,
            "ref_log_prob": (lp0 - 0.2 * torch.rand(M, B, T, generator=g)).clamp(max=0) * mask,
            "rollout_log_probs": (lp0 + 0.2 * torch.randn(M, B, T, generator=g)).clamp(max=0) * mask,
            "selection_keys": torch.rand(M, B, T, generator=g),
            "lag": torch.randint(0, 4, (M, B, T), generator=g).float()}
    wanted = [k for k in list(info.inputs) + (list(info.optional_inputs) if optional else []) if k in data]

    def loss(lg, tok, m, old, adv, extra):
        lp = torch.log_softmax(lg, -1).gather(-1, tok[..., None]).squeeze(-1) * m
        named = {**extra, **({"logits": lg} if "logits" in info.inputs else {}),
                 **({"group_size": G} if "group_size" in info.inputs else {})}
        return info.fn(lp, old, adv, m, loss_agg_mode="token-mean", **named)[0]

    extra = {k: data[k] for k in wanted}
    try:
        vmapped = vmap(grad(loss))(logits, tokens, mask, data["old"], data["adv"], extra)
    except LabError:
        pytest.fail(f"{name} raised LabError on a valid batch")
    looped = torch.stack([grad(loss)(logits[i], tokens[i], mask[i], data["old"][i], data["adv"][i],
                                     {k: v[i] for k, v in extra.items()}) for i in range(M)])
    assert torch.isfinite(vmapped).all()
    assert torch.allclose(vmapped, looped, atol=1e-6, rtol=1e-5)
