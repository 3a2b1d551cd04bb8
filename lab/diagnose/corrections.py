"""What each off-policy correction would do to the tokens of a log: the share of tokens and sequences it clips,
masks or reweights, and the share of importance-sampling gradient weight it removes (or adds).

Every correction is an effective coefficient c on A grad log pi(y_t) (the registry's ``coefficient`` functions,
lab.estimators, at the defaults their sources run; evaluated by their numpy versions, lab.diagnose.coefficients),
applied to the raw importance weight w it replaces: w = rho_t = exp(delta_t) for token-level corrections,
W = exp(L) (L = sum_t delta_t, clamped to +-20 as verl does) for sequence-level ones, s = exp(L / n) for GSPO's
geometric mean. With advantage weights a = |A| (1 when the log has no advantages):

    removed = sum a (w - c)+ / sum a w        added = sum a (c - w)+ / sum a w

summed over loss-masked tokens (a sequence-level weight counts once per token of its sequence). A token is
*zeroed* when c = 0 (masked, or clipped out of the gradient) and *changed* when |c - w| > 1e-6 (1 + w).

Which ratio each correction sees (``natural`` pairing, the three-policy setup of verl and slime): TIS and the
masks (IcePop) weight the trainer's old policy against the sampler (old/sampler, the ``mismatch`` pair); PPO clip,
GSPO, CISPO and SAPO clip the update ratio current/old (``update``); VESPO folds the sampler correction into its
sequence weight, current/sampler (``total``). A pair that the log lacks falls back to the widest one it has
(with no current log-probs, the clip family is evaluated on old/sampler: verl's bypass mode, in which the
trainer's policy is compared directly with the sampler's).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lab import estimators
from lab.diagnose.coefficients import NUMPY


CORRECTIONS = ("tis_token", "tis_seq", "mis_token", "mis_seq", "ppo_clip", "gspo", "cispo", "sapo", "vespo")
LABELS = {n: estimators.info(n).label for n in CORRECTIONS}  # the registry's display names
NATURAL = {"tis_token": "mismatch", "tis_seq": "mismatch", "mis_token": "mismatch", "mis_seq": "mismatch",
           "ppo_clip": "update", "gspo": "update", "cispo": "update", "sapo": "update", "vespo": "total"}
PAIR_ORDER = ("total", "mismatch", "update")
LOG_W_BOUND = 20.0


@dataclass(frozen=True)
class Correction:
    name: str
    level: str  # token | sequence | geometric
    pair: str  # which log-ratio it sees
    hyper: dict

    @property
    def label(self) -> str:
        return LABELS.get(self.name, self.name)

    def coefficient(self, ratio: np.ndarray, advantage: np.ndarray) -> np.ndarray:
        """c(w, A), float64, vectorised: the numpy version of the registry's function (lab.diagnose.coefficients)
        for the report's corrections, the registry's own (torch) for any other name."""
        fn = NUMPY.get(self.name)
        if fn is not None:
            ratio, advantage = (np.asarray(x, dtype=np.float64) for x in (ratio, advantage))
            return np.asarray(fn(ratio, advantage, **self.hyper), dtype=np.float64)
        import torch

        out = estimators.info(self.name).coefficient(_tensor(ratio), _tensor(advantage), **self.hyper)
        return out.numpy() if torch.is_tensor(out) else np.asarray(out, dtype=np.float64)

    def describe(self) -> str:
        shown = {k: v for k, v in self.hyper.items() if not (self.name in ("tis_token", "tis_seq", "mis_token",
                                                                             "mis_seq") and k.startswith("clip_ratio"))}
        return ", ".join(f"{k}={v}" for k, v in shown.items())


def _tensor(x):
    """A float64 tensor sharing the array's memory (copied only when the array is read-only)."""
    import torch

    a = np.ascontiguousarray(x, dtype=np.float64)
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def resolve(pairs_available, names=CORRECTIONS, pair: str = "natural", hyper: dict | None = None) -> list[Correction]:
    """The corrections to evaluate, each with the pair it sees among ``pairs_available`` and its hyper-parameters
    (registry defaults, overridden per name by ``hyper = {name: {key: value}}``)."""
    from lab import estimators

    hyper = hyper or {}
    stray = sorted(set(hyper) - set(names))
    if stray:
        from lab.errors import LabError

        raise LabError(f"hyper-parameters given for {', '.join(stray)}, which the report does not evaluate; it "
                       f"evaluates {', '.join(names)}")
    if pair != "natural" and pair not in pairs_available:
        from lab.errors import LabError
        from lab.diagnose.streaming import PAIRS

        raise LabError(f"--pair {pair} compares {' and '.join(PAIRS[pair])}, which this log does not both have "
                       f"(it has the pairs: {', '.join(pairs_available) or 'none'}); choose one of those or natural")
    out = []
    for name in names:
        info = estimators.info(name)  # LabError for an unknown name
        params = dict(info.defaults)
        estimators.check_hyper(name, hyper.get(name, {}))  # unknown keys or values outside their domain
        params.update(hyper.get(name, {}))
        want = NATURAL.get(name, "total") if pair == "natural" else pair
        if want not in pairs_available:
            want = next(p for p in PAIR_ORDER if p in pairs_available)
        out.append(Correction(name, info.ratio, want, params))
    return out


def token_effect(c: np.ndarray, w: np.ndarray, weight: np.ndarray):
    """Per-token (changed, zeroed, removed, added) of a token-level correction with coefficients ``c`` =
    coefficient(w, A) on the raw token weights ``w`` = exp(clamp(delta, +-LOG_W_BOUND)), advantage weights
    ``weight`` = |A|: changed |c - w| > 1e-6 (1 + w), zeroed c = 0, removed weight (w - c)+, added weight (c - w)+."""
    diff = c - w
    changed = np.abs(diff) > 1e-6 * (1.0 + w)
    zeroed = c == 0
    r = weight * diff
    return changed, zeroed, np.maximum(-r, 0.0), np.maximum(r, 0.0)


def sequence_weight(corr: Correction, L: np.ndarray, n: np.ndarray) -> np.ndarray:
    """The raw weight a sequence-level correction replaces: W = exp(clamp(L)) or s = exp(L / n) (GSPO)."""
    if corr.level == "geometric":
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.exp(np.clip(np.where(n > 0, L / np.maximum(n, 1), 0.0), -LOG_W_BOUND, LOG_W_BOUND))
    return np.exp(np.clip(L, -LOG_W_BOUND, LOG_W_BOUND))
