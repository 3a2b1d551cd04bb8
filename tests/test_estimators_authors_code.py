"""The estimators that no trainer ships, against their authors' code restated line by line (Python loops and all,
as written there; file and commit cited), and hand-computed values:

- BAPO: WooooDyy/BAPO recipe/bapo/policy_loss.py compute_policy_loss_bapo (7287044), run_bapo_example.sh's bounds;
- ASPO: wizard-III/Archer2.0 verl/trainer/ppo/core_algos.py compute_policy_loss_archer and the entropy split of
  verl/workers/actor/dp_actor.py (b08d963);
- CTPO: horizon-llm/CTPO verl/trainer/ppo/core_algos.py _compute_policy_loss_cum_token_la_impl (acc4021);
- GEPO: yelurebajrang/HeteroRL_GEPO src/open-r1/online_rl.py loss_type "gepo" (97000a8), one group per batch;
- M2PO's global clip: Infini-AI-Lab/M2PO verl/trainer/ppo/core_algos.py kpo_clip_harmful_tokens,
  _solve_tau_from_sorted_delta2, compute_m2po_policy_loss (af54a3e);
- VCPO: by hand (no code released).
Batches have ragged rows and both advantage signs; loss and gradient agree to 1e-9 (the authors' float32 steps
aside).
"""
import math

import pytest
import torch

from lab import estimators

B, T, V = 4, 5, 6
LENGTHS = [5, 3, 4, 2]


def _batch(seed=31, noise=0.3):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).double()
    logits = 1.5 * torch.randn(B, T, V, generator=g, dtype=torch.float64)
    tokens = torch.randint(V, (B, T), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    old = (lp + noise * torch.randn(B, T, generator=g, dtype=torch.float64)).clamp(max=0.0)
    adv = torch.tensor([0.9, -0.6, 0.4, -1.1], dtype=torch.float64)[:, None].expand(B, T).clone()
    return mask, logits, lp, old, adv


MASK, LOGITS, LP, OLD, ADV = _batch()


def both(f, x0=LP):
    x = x0.clone().requires_grad_(True)
    loss = f(x)
    return loss.detach(), torch.autograd.grad(loss, x)[0]


def assert_same(ours, theirs, tol=1e-9):
    assert float((ours[0] - theirs[0]).abs()) <= tol, (float(ours[0]), float(theirs[0]))
    assert float((ours[1] - theirs[1]).abs().max()) <= tol


def token_mean(loss_mat, mask=MASK):
    return (loss_mat * mask).sum() / mask.sum()


def lab(name, *args, mode="token-mean", **kw):
    return lambda x: estimators.get(name)(x, OLD, ADV, MASK, *args, loss_agg_mode=mode, **kw)[0]


# ------------------------------------------------------------------------------------------ BAPO
def bapo_restated(x, target=0.5, low=0.8, low_max=0.95, low_step=0.05, high=1.2, high_max=2.0, high_step=0.1, c=3.0,
                  eps=1e-8, adv=ADV):
    ratio = torch.exp(torch.clamp(x - OLD, min=-20.0, max=20.0))

    def pos_neg(lo, hi):
        r = ratio.detach()
        eff = torch.where(adv >= 0, torch.minimum(r, r.new_tensor(hi)), torch.maximum(r, r.new_tensor(lo))) * adv * MASK
        pos, neg = eff.clamp(min=0).sum(), (-eff.clamp(max=0)).sum()
        return float("inf") if neg <= 0 else float(pos / (neg + eps))

    value = pos_neg(low, high)
    while value < target and low < low_max:
        low = min(low + low_step, low_max)
        value = pos_neg(low, high)
        if value >= target:
            break
    while value < target and high < high_max:
        high = min(high + high_step, high_max)
        value = pos_neg(low, high)
        if value >= target:
            break
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, low, high)
    clip1 = torch.maximum(l1, l2)
    losses = torch.where(adv < 0, torch.min(-adv * c, clip1), clip1)
    return token_mean(losses), (low, high)


@pytest.mark.parametrize("target", [0.5, 0.9, 1.5, 3.0])
def test_bapo_equals_its_authors_loop(target):
    theirs = both(lambda x: bapo_restated(x, target=target)[0])
    assert_same(both(lab("bapo", adv_ratio_target=target)), theirs)
    _, m = estimators.get("bapo")(LP, OLD, ADV, MASK, adv_ratio_target=target)
    assert (float(m["clip_low"]), float(m["clip_high"])) == pytest.approx(bapo_restated(LP, target=target)[1])


def test_bapo_search_moves_the_bounds_by_hand():
    # every bound reached: the search visits 0.8 -> 0.95 (4 steps of 0.05, the last capped) then 1.2 -> 2.0 by 0.1
    c = estimators.adaptive_clip.bapo_candidates(0.8, 0.95, 0.05, 1.2, 2.0, 0.1)
    assert [round(lo, 10) for lo, _ in c[:4]] == [0.8, 0.85, 0.9, 0.95]
    assert [round(hi, 10) for _, hi in c[3:]] == [1.2, 1.3, 1.4, 1.5, 1.6, 1.7, 1.8, 1.9, 2.0]
    _, (lo, hi) = bapo_restated(LP, target=100.0)  # unreachable: the last bounds
    assert (lo, round(hi, 10)) == (0.95, 2.0)


# ------------------------------------------------------------------------------------------ ASPO
def aspo_restated(x, q=0.8, low_clip=0.2, high_clip=0.4, c=3.0):
    entropy = torch.logsumexp(LOGITS, -1) - (torch.softmax(LOGITS, -1) * LOGITS).sum(-1)
    masked = torch.where(MASK.bool(), entropy, torch.nan)
    q80 = torch.nanquantile(masked, q=q, dim=-1, keepdim=True)
    hm = (masked <= q80) & MASK.bool()  # Archer's "high_entropy_mask": the tokens at or below the quantile
    ratio = torch.exp(torch.clamp(x - OLD, min=-20.0, max=20.0))
    neg = torch.where(hm, torch.clamp(ratio, min=1 - low_clip), torch.clamp(ratio, min=1 - high_clip))
    pos = torch.where(hm, torch.clamp(ratio, max=1 + low_clip), torch.clamp(ratio, max=1 + high_clip))
    neg_loss = -ADV * neg
    pos_loss = -ADV * (pos / pos.detach()) / pos.detach()
    neg_dual = torch.clamp(neg, max=c)
    neg_loss = torch.where(torch.gt(neg, neg_dual), -ADV * neg_dual.detach() * x, neg_loss)
    pos_dual = torch.clamp(1 / pos, max=c)
    pos_loss = torch.where(torch.gt(1 / pos, pos_dual), -ADV * pos_dual.detach() * x, pos_loss)
    return token_mean(torch.where(ADV < 0, neg_loss, pos_loss))


@pytest.mark.parametrize("noise", [0.3, 1.5])  # 1.5: ratios beyond the soft dual clip
def test_aspo_equals_archer2(noise):
    global OLD
    saved = OLD
    try:
        OLD = _batch(noise=noise)[3]
        assert_same(both(lab("aspo", logits=LOGITS)), both(aspo_restated))
    finally:
        OLD = saved


def test_aspo_flips_the_ratio_of_positive_advantages_by_hand():
    # A = 1, rho = 1/2 (inside the clip): the coefficient on grad log pi is A / rho = 2; A = -1, rho = 1/2 with
    # eps 0.2: max(rho, 0.8) = 0.8 is clipped -> no gradient
    lp = torch.tensor([[math.log(0.25)], [math.log(0.25)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(0.5)], [math.log(0.5)]], dtype=torch.float64)
    adv = torch.tensor([[1.0], [-1.0]], dtype=torch.float64)
    logits = torch.zeros(2, 1, 3, dtype=torch.float64)
    loss, _ = estimators.get("aspo")(lp, old, adv, torch.ones(2, 1, dtype=torch.float64), logits=logits)
    (g,) = torch.autograd.grad(loss, lp)
    assert float(g[0, 0]) == pytest.approx(-2.0 / 2) and float(g[1, 0]) == 0.0


# ------------------------------------------------------------------------------------------ CTPO
def ctpo_restated(x, low=0.025, high=0.05, c=0.05, power=0.5):
    nak = torch.clamp(x - OLD, min=-20.0, max=20.0)
    mask = MASK
    cum = torch.cumsum(nak * mask, dim=-1)
    kl = torch.where(mask > 0, cum, torch.zeros_like(cum))
    log_r = torch.clamp(kl.detach() + x - x.detach(), max=10.0)
    ratio = torch.where(mask > 0, torch.exp(log_r), torch.zeros_like(log_r))
    scale = torch.cumsum(mask, dim=-1).clamp(min=1.0).pow(power)
    clipped = torch.where(mask > 0, torch.exp(torch.clamp(log_r, -low * scale, high * scale)), torch.zeros_like(log_r))
    threshold = torch.where(mask > 0, torch.exp(c * scale), torch.ones_like(scale))
    l1, l2 = -ADV * ratio, -ADV * clipped
    clip1 = torch.maximum(l1, l2)
    return token_mean(torch.where(ADV < 0, torch.min(-ADV * threshold, clip1), clip1))


@pytest.mark.parametrize("noise", [0.01, 0.3])
def test_ctpo_equals_its_authors_code(noise):
    global OLD
    saved = OLD
    try:
        OLD = _batch(noise=noise)[3]
        theirs = both(ctpo_restated)
        assert_same(both(lab("ctpo")), theirs)
        assert float(theirs[1].abs().sum()) > 0  # some tokens pass the position-scaled window
    finally:
        OLD = saved


def test_ctpo_prefix_ratio_by_hand():
    # log rho = (0.01, 0.02): the ratio of token 2 is exp(0.03), inside [exp(-0.025 sqrt 2), exp(0.05 sqrt 2)]
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    old = lp.detach() - torch.tensor([[0.01, 0.02]], dtype=torch.float64)
    ones = torch.ones(1, 2, dtype=torch.float64)
    loss, m = estimators.get("ctpo")(lp, old, ones, ones)
    assert float(loss.detach()) == pytest.approx(-(math.exp(0.01) + math.exp(0.03)) / 2, rel=1e-12)
    (g,) = torch.autograd.grad(loss, lp)
    assert torch.allclose(g, -torch.tensor([[math.exp(0.01), math.exp(0.03)]], dtype=torch.float64) / 2)


# ------------------------------------------------------------------------------------------ GEPO
def gepo_restated(x, eps=0.2):
    n = MASK.sum(dim=1).clamp(min=1.0)
    sampler = (OLD * MASK).sum(dim=1) / n
    learner = (x * MASK).sum(dim=1) / n
    p, q = learner.exp(), sampler.exp()
    normalised = q.detach() / q.sum().detach()
    coef = p / (normalised * q).sum()
    adv = ADV[:, 0]
    return (-torch.min(coef * adv, torch.clamp(coef, 1 - eps, 1 + eps) * adv)).mean()


def test_gepo_equals_its_authors_code_on_one_group():
    assert_same(both(lab("gepo", mode="seq-mean-token-mean", group_size=B)), both(gepo_restated))


def test_gepo_weight_is_not_one_on_policy_by_hand():
    # two responses of one prompt with geometric-mean probabilities q = (0.5, 0.25): E_q[q] = (0.25 + 0.0625) / 0.75
    lp = torch.tensor([[math.log(0.5)], [math.log(0.25)]], dtype=torch.float64)
    w = torch.exp(estimators.group_sequence.gepo_weights(lp, lp, torch.ones(2, 1, dtype=torch.float64), 2))
    e = (0.25 + 0.0625) / 0.75
    assert torch.allclose(w[:, 0], torch.tensor([0.5 / e, 0.25 / e], dtype=torch.float64))


# ------------------------------------------------------------------------------------------ M2PO global clip
def m2po_clip_restated(x, budget=0.04):
    mask = MASK.bool()
    adv_example = ADV[:, 0]
    pos, neg = adv_example > 1e-12, adv_example < -1e-12
    delta = (OLD - x).detach()
    ratio = torch.exp(-delta)
    delta_sq = delta.pow(2)
    harmful = torch.cat([delta_sq[pos][(ratio[pos] > 1.0 + 1e-12) & mask[pos]],
                         delta_sq[neg][(ratio[neg] < 1.0 - 1e-12) & mask[neg]]])
    low, high = 0.0, 100000
    n = harmful.numel()
    if n and float(harmful.sum() / n) > budget + 1e-12:
        v, _ = torch.sort(harmful)
        csum = torch.cumsum(v, dim=0)
        for k in range(n):
            if (v[k].item() - 1e-12) * (n - k - 1) + float(csum[k]) >= budget * n - 1e-12:
                tau = 0.0 if k == 0 else float(v[k - 1].item() - 1e-12) ** 0.5
                break
        low = float(torch.exp(torch.tensor(-tau)).item())
        high = float(torch.exp(torch.tensor(+tau)).item())
    clip_low, clip_high = 1 - low, high - 1
    r = torch.exp(x - OLD)
    return token_mean(torch.maximum(-ADV * r, -ADV * torch.clamp(r, 1 - clip_low, 1 + clip_high)))


@pytest.mark.parametrize("budget", [0.04, 0.01, 0.5])
def test_m2po_clip_equals_its_authors_code(budget):
    theirs = both(lambda x: m2po_clip_restated(x, budget))
    assert_same(both(lab("m2po_clip", m2_budget=budget)), theirs, tol=1e-7)


# ------------------------------------------------------------------------------------------ VCPO
def test_vcpo_by_hand():
    # one group of two: W = (2, 1/2), R = (1, 0). Leave-one-out baselines: b_1 = R_2 = 0, b_2 = R_1 = 1.
    # ESS fraction (W1 + W2)^2 / (2 (W1^2 + W2^2)) = 6.25 / 8.5. Coefficients on grad log pi(y_i), seq-mean-token-sum:
    # -ESS W_i (R_i - b_i) / 2 = -ESS (2, -1/2) / 2.
    lp = torch.tensor([[math.log(0.4)], [math.log(0.1)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[math.log(0.2)], [math.log(0.2)]], dtype=torch.float64)
    rewards = torch.tensor([1.0, 0.0], dtype=torch.float64)
    one = torch.ones(2, 1, dtype=torch.float64)
    loss, m = estimators.get("vcpo")(lp, old, 0 * one, one, rewards=rewards, group_size=2)
    (g,) = torch.autograd.grad(loss, lp)
    ess = 6.25 / 8.5
    assert float(m["ess_frac"]) == pytest.approx(ess, rel=1e-12)
    assert torch.allclose(g[:, 0], -ess * torch.tensor([2.0, -0.5], dtype=torch.float64) / 2, rtol=1e-12)
