"""The input contract every registered estimator is held to, and hyper-parameter domains.

``guard`` wraps each function at registration (lab.estimators.registry.register), so a new estimator is held to
the same contract without code of its own. The contract (also in the registry's module docstring):

- Order and shapes. ``fn(log_prob, old_log_prob, advantages, response_mask, loss_agg_mode, **hyper)``: the current
  policy's log-probs first. ``log_prob``, ``old_log_prob``, ``response_mask`` and the per-token extra inputs
  (``ref_log_prob``, ``rollout_log_probs``, ``teacher_log_prob``, ``selection_keys``, ``lag``) are [B, T];
  ``advantages`` is [B, T] or [B, 1]
  (a 1-D [B] is refused: it would broadcast along T when B == T); ``logits`` and ``teacher_logits`` are
  [B, T, V]. Log-probs are floating point; the mask is bool, integer or float. Anything else: LabError.
- Empty. A batch with no token positions (B = 0 or T = 0) raises LabError. A row without a real token (a response
  truncated to nothing, a sequence masked out) contributes zero loss and zero gradient and still counts as a row
  in the seq-mean-* denominators (see lab.estimators.aggregation). An all-masked batch: gradient 0 and loss 0
  (GVPO's regression keeps its constant reward term, 1/2 Var(R) per group).
- Padding. Whatever sits at a masked position of any per-token or [B, T, V] input (NaN, +-inf, 1e30) is replaced
  with 0 by ``torch.where`` before the estimator sees it: it changes neither the loss nor any gradient.
- Invalid values at real (mask 1) positions: a NaN or infinite log-prob, advantage, reward or logit, a positive
  ``log_prob`` or ``teacher_log_prob`` (beyond 16 machine epsilons of its dtype), or a mask value other than 0 and 1
  raises LabError naming the input. Inside torch.func transforms (vmap, grad), where values cannot be inspected,
  these checks are skipped and a NaN or infinity at a real position makes the loss and the gradient at every real
  position NaN: it is never dropped. (The behaviour-side log-probs, ``old_log_prob``, ``rollout_log_probs`` and
  ``ref_log_prob``, are not held to <= 0: tests build extreme ratios with them.)
- Precision. float16 and bfloat16 inputs are promoted to float32 before any ratio is formed and the loss is float32;
  the gradient with respect to a half-precision input is the float32 gradient rounded to that precision (entries
  beyond its range, 65504 for float16, become inf).
- Mask replay. Every estimator whose entry has ``mask_replay`` (each one scored on the sampled tokens' log-probs:
  all but the KL penalties, the distillation family and those that read the logits) takes an optional
  ``kept_log_mass`` [B, T]: log pi(S_t), the trainer's log-probability of the sampler's kept set at each position
  (top-p / top-k / min-p; ``lab.policies.truncation.kept_log_mass``), carrying the gradient like ``log_prob``. The
  estimator then sees log_prob - kept_log_mass, the trainer's log-probs renormalised over the kept set (slime's
  and DeepSeek-V3.2's "keep sampling mask"); it is held to log_prob's checks (finite, <= 0 at real positions).
  Where ``old_log_prob`` is the trainer's own recomputation (three-policy batches) the caller renormalises it too.
- Hyper-parameters. Each has a declared domain (``EstimatorInfo.domains``); a call, and ``check_hyper``, refuse a
  value outside it (NaN, a wrong sign, a non-number) with LabError.
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import re
from dataclasses import dataclass
from typing import Callable

from lab.lazy import torch

from lab.errors import LabError
from lab.estimators.aggregation import check_mode

REPLAY = "kept_log_mass"  # mask replay's input (see the module docstring)
PER_TOKEN = ("old_log_prob", "ref_log_prob", "rollout_log_probs", "teacher_log_prob", "selection_keys",
             "lag", REPLAY)  # [B, T] besides log_prob
LOG_PROBS = ("log_prob", "teacher_log_prob", REPLAY)  # held to <= 0 (see the module docstring for the others)
VOCAB = ("logits", "teacher_logits")  # [B, T, V]


# ----------------------------------------------------------------------------------------------- domains
@dataclass(frozen=True)
class Domain:
    """A hyper-parameter's allowed values, written as text: "positive", "nonnegative", "finite", "> X", ">= X",
    "positive integer", "bool", "one of a|b|c" (names), each optionally followed by " or None"."""
    spec: str

    def __post_init__(self):
        base = self._base()
        if base not in ("positive", "nonnegative", "finite", "positive integer", "bool") \
                and not re.fullmatch(r">=? *-?\d+(\.\d+)?", base) and not re.fullmatch(r"one of \w+(\|\w+)*", base):
            raise ValueError(f"unknown hyper-parameter domain {self.spec!r}")

    def choices(self) -> tuple:
        """The allowed names of a "one of a|b|c" domain (empty for numeric domains)."""
        base = self._base()
        return tuple(base[len("one of "):].split("|")) if base.startswith("one of ") else ()

    def _base(self) -> str:
        return self.spec[:-len(" or None")] if self.spec.endswith(" or None") else self.spec

    def describe(self) -> str:
        base = self._base()
        if self.choices():
            return "one of " + ", ".join(repr(c) for c in self.choices()) + (
                " or None (off)" if self.spec.endswith(" or None") else "")
        text = {"positive": "a finite number > 0", "nonnegative": "a finite number >= 0", "finite": "a finite number",
                "positive integer": "a positive whole number", "bool": "true or false"}.get(base) \
            or f"a finite number {base}"
        return text + (" or None (off)" if self.spec.endswith(" or None") else "")

    def admits(self, value) -> bool:
        if value is None:
            return self.spec.endswith(" or None")
        base = self._base()
        if self.choices():
            return isinstance(value, str) and value in self.choices()
        if base == "bool":
            return isinstance(value, bool)
        if base == "positive integer":
            return isinstance(value, numbers.Integral) and not isinstance(value, bool) and value >= 1
        if not isinstance(value, numbers.Real) or isinstance(value, bool) or not math.isfinite(value):
            return False
        if base == "positive":
            return value > 0
        if base == "nonnegative":
            return value >= 0
        if base == "finite":
            return True
        op, bound = re.fullmatch(r"(>=?) *(-?\d+(?:\.\d+)?)", base).groups()
        return value >= float(bound) if op == ">=" else value > float(bound)


def check_values(name: str, domains: dict, hyper: dict, check: Callable | None = None) -> None:
    """LabError unless every value in ``hyper`` lies in its domain (and ``check(hyper)`` finds no conflict)."""
    for key, value in hyper.items():
        domain = domains.get(key)
        if domain is not None and not domain.admits(value):
            shown = repr(value)
            raise LabError(f"estimator {name!r}: {key} must be {domain.describe()}, got "
                           f"{shown if len(shown) <= 60 else shown[:57] + '...'}")
    if check is not None:
        problem = check(hyper)
        if problem:
            raise LabError(f"estimator {name!r}: {problem}")


def ordered(low: str, high: str) -> Callable:
    """A cross-field ``check``: refuse hyper-parameters where ``low`` exceeds ``high`` (an empty band)."""
    def check(hyper: dict) -> str | None:
        if hyper[low] > hyper[high]:
            return f"the band is empty: {low} ({hyper[low]}) exceeds {high} ({hyper[high]})"
        return None

    return check


# ----------------------------------------------------------------------------------------------- inputs
def in_transform() -> bool:
    """Whether the caller runs inside a torch.func transform (vmap, grad), where tensor values cannot be read."""
    return torch._C._functorch.peek_interpreter_stack() is not None


def _shape(x) -> str:
    return "[" + ", ".join(str(s) for s in x.shape) + "]"


def check_shapes(name: str, log_prob, old_log_prob, advantages, response_mask, named: dict) -> None:
    """Static checks (shapes and dtypes): safe under vmap, where each replicate's shapes are seen."""
    def refuse(text):
        raise LabError(f"estimator {name!r}: {text}")

    if not torch.is_tensor(log_prob) or log_prob.dim() != 2 or not log_prob.is_floating_point():
        got = f"{_shape(log_prob)} {log_prob.dtype}" if torch.is_tensor(log_prob) else type(log_prob).__name__
        refuse(f"log_prob must be a [B, T] floating-point tensor of per-token log-probs, got {got}")
    B, T = log_prob.shape
    if B == 0 or T == 0:
        refuse(f"the batch is empty (log_prob has shape {_shape(log_prob)}); pass at least one response and one "
               f"token position (rows without a real token are fine: mask them out)")
    tensors = {"old_log_prob": old_log_prob, "response_mask": response_mask,
               **{k: named[k] for k in PER_TOKEN[1:] if named.get(k) is not None}}
    for key, x in tensors.items():
        if not torch.is_tensor(x) or tuple(x.shape) != (B, T):
            refuse(f"{key} must have log_prob's shape [{B}, {T}], got "
                   f"{_shape(x) if torch.is_tensor(x) else type(x).__name__}")
        if key != "response_mask" and not x.is_floating_point():
            refuse(f"{key} must be floating point, got {x.dtype}")
    if response_mask.is_complex():
        refuse("response_mask must be bool, integer or float")
    if not torch.is_tensor(advantages) or tuple(advantages.shape) not in ((B, T), (B, 1)) \
            or not advantages.is_floating_point():
        got = f"{_shape(advantages)} {advantages.dtype}" if torch.is_tensor(advantages) else type(advantages).__name__
        refuse(f"advantages must be a floating-point [B, T] (per token) or [B, 1] (per sequence) tensor with "
               f"B = {B}, T = {T}, got {got}; pass a per-sequence vector as advantages[:, None]")
    vocab = [k for k in VOCAB if named.get(k) is not None]
    for key in vocab:
        x = named[key]
        if not torch.is_tensor(x) or x.dim() != 3 or tuple(x.shape[:2]) != (B, T) or not x.is_floating_point():
            refuse(f"{key} must be a floating-point [B, T, V] tensor with B = {B}, T = {T}, got "
                   f"{_shape(x) if torch.is_tensor(x) else type(x).__name__}")
    if len(vocab) == 2 and named["logits"].shape != named["teacher_logits"].shape:
        refuse(f"logits {_shape(named['logits'])} and teacher_logits {_shape(named['teacher_logits'])} must have "
               f"the same shape (one vocabulary)")
    rewards = named.get("rewards")
    if rewards is not None and (not torch.is_tensor(rewards) or rewards.is_complex()):
        refuse("rewards must be a tensor of real numbers")


def _log_prob_tolerance(dtype) -> float:
    return 16 * torch.finfo(dtype).eps


def check_values_of_inputs(name: str, log_prob, old_log_prob, advantages, response_mask, named: dict) -> None:
    """Value checks (NaN, infinities, positive log-probs, mask values). They read tensor values, so they run only
    outside torch.func transforms."""
    def refuse(text):
        raise LabError(f"estimator {name!r}: {text}")

    with torch.no_grad():
        mask = response_mask
        if mask.dtype != torch.bool:
            binary = (mask == 0) | (mask == 1)
            if not bool(binary.all()):
                bad = mask[~binary].reshape(-1)[0].item()
                refuse(f"response_mask must hold only 0 and 1 (1 on real tokens), found {bad!r}")
        real = mask.bool() if mask.dtype == torch.bool else mask > 0
        data = {"log_prob": log_prob, "old_log_prob": old_log_prob, "advantages": advantages,
                **{k: named[k] for k in (*PER_TOKEN[1:], *VOCAB) if named.get(k) is not None}}
        for key, x in data.items():
            x = x.detach()
            at = real[..., None] if key in VOCAB else real
            bad = ~torch.isfinite(x) & at
            if bool(bad.any()):
                what = "NaN" if bool((torch.isnan(x) & at).any()) else "an infinite value"
                refuse(f"{key} holds {what} at {int(bad.sum())} real (unmasked) position(s); every real token needs "
                       f"finite values (padding may hold anything)")
            if key in LOG_PROBS:
                above = (x > _log_prob_tolerance(x.dtype)) & at
                if bool(above.any()):
                    refuse(f"{key} holds log-probs above 0 (largest {float(x[above].max()):.4g}) at "
                           f"{int(above.sum())} real position(s); pass log-probabilities (<= 0), not logits or ratios")
        rewards = named.get("rewards")
        if rewards is not None and not bool(torch.isfinite(rewards.detach()).all()):
            refuse("rewards hold NaN or an infinite value; every response needs a finite reward")


def prepare(log_prob, old_log_prob, advantages, response_mask, named: dict):
    """Promote half precision to float32, zero every masked position (torch.where, so NaN cannot leak), and
    return (log_prob, old_log_prob, advantages, mask, named, poison): ``poison`` is a 0-dim tensor, 0 when every
    real entry is finite and NaN otherwise, carried into the loss with ``log_prob`` so that non-finite inputs
    reach the loss and the gradient under torch.func transforms."""
    def lift(x):
        return x.float() if torch.is_tensor(x) and _half(x.dtype) else x

    log_prob, old_log_prob, advantages = lift(log_prob), lift(old_log_prob), lift(advantages)
    named = {k: lift(v) for k, v in named.items()}
    mask = response_mask
    if mask.dtype == torch.bool or not mask.is_floating_point() or _half(mask.dtype):
        mask = mask.to(log_prob.dtype)
    real = mask > 0
    zero = torch.zeros((), dtype=log_prob.dtype)

    def clean(x, at):
        return torch.where(at, x, torch.zeros((), dtype=x.dtype))

    log_prob = clean(log_prob, real)
    old_log_prob = clean(old_log_prob, real)
    advantages = clean(advantages, real)
    total = log_prob.detach() + old_log_prob.detach() + advantages.detach()  # NaN or inf iff one of them is
    for key in PER_TOKEN[1:]:
        if named.get(key) is not None:
            named[key] = clean(named[key], real)
            total = total + named[key].detach()
    poison = (total * 0).sum()
    for key in VOCAB:
        if named.get(key) is not None:
            named[key] = clean(named[key], real[..., None])
    if named.get("rewards") is not None and torch.is_tensor(named["rewards"]):
        poison = poison + (named["rewards"].detach() * 0).sum().to(zero.dtype)
    return log_prob, old_log_prob, advantages, mask, named, poison.to(zero.dtype)


def guard(name: str, fn: Callable, inputs: tuple, optional_inputs: tuple, get_info: Callable) -> Callable:
    """``fn`` held to the contract above: argument and hyper-parameter checks, shapes, values (outside torch.func
    transforms), padding replaced, half precision promoted, non-finite inputs carried into the loss."""
    signature = inspect.signature(fn)
    params = signature.parameters
    named_keys = (*inputs, *optional_inputs)

    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        info = get_info(name)
        kept = kwargs.pop(REPLAY, None)
        if kept is not None and not info.mask_replay:
            raise LabError(f"estimator {name!r} does not take {REPLAY} (mask replay): it is not scored on the sampled "
                           f"tokens' log-probs alone")
        unknown = [k for k in kwargs if k not in params]
        if unknown:
            raise LabError(f"estimator {name!r} has no hyper-parameter(s) {', '.join(sorted(unknown))}; it takes "
                           f"{', '.join(info.defaults) or 'none'}"
                           + (f" and the inputs {', '.join(named_keys)}" if named_keys else ""))
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as err:
            raise LabError(f"estimator {name!r}: {err}") from None
        bound.apply_defaults()
        a = bound.arguments
        if "loss_agg_mode" in a:
            check_mode(a["loss_agg_mode"])
        check_values(name, info.domains, {k: a[k] for k in info.defaults if k in a}, info.check)
        named = {k: a[k] for k in named_keys if k in a and a[k] is not None}
        if kept is not None:
            named[REPLAY] = kept
        check_shapes(name, a["log_prob"], a["old_log_prob"], a["advantages"], a["response_mask"], named)
        if not in_transform():
            check_values_of_inputs(name, a["log_prob"], a["old_log_prob"], a["advantages"], a["response_mask"], named)
        lp, old, adv, mask, named, poison = prepare(a["log_prob"], a["old_log_prob"], a["advantages"],
                                                    a["response_mask"], named)
        if kept is not None:
            lp = lp - named.pop(REPLAY)  # log pi(y_t) - log pi(S_t): renormalised over the kept set
        a.update(log_prob=lp, old_log_prob=old, advantages=adv, response_mask=mask, **named)
        loss, metrics = fn(*bound.args, **bound.kwargs)
        return loss + poison * lp.sum(), metrics

    guarded.unguarded = fn
    return guarded


def _half(dtype) -> bool:
    """float16 or bfloat16: computed in float32."""
    return dtype in (torch.float16, torch.bfloat16)
