"""One registry, one decorator, one signature (modelled on verl's policy-loss registry, with the lab's own order).

Argument order. Sampled-token estimators are ``fn(log_prob, old_log_prob, advantages, response_mask,
loss_agg_mode="token-mean", **hyper) -> (loss, metrics)``: the CURRENT policy's log-probs first, then the behaviour
(old) policy's. verl's policy losses take ``(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode,
config, rollout_is_weights)``, old first; ``lab.estimators.to_verl(name)`` returns a function with verl's exact
signature. All tensors are [B, T]; ``log_prob`` carries the gradient, the others are data. Metrics are 0-dim
tensors so that every estimator runs under ``torch.func.vmap``.

Estimators that need more than that (group rewards for GVPO, full-vocabulary logits or a teacher for the
distillation family, a reference policy for KL penalties, the sampler's log-probs in a decoupled three-policy
batch) name those extra inputs as keyword-only arguments and list them in ``inputs=``; callers pass them by
name. Known extra inputs (all [B, T] unless said): ``rewards`` [B], ``group_size`` (int), ``logits`` [B, T, V]
(the current policy's, carrying the gradient), ``teacher_log_prob``, ``teacher_logits`` [B, T, V],
``ref_log_prob``, ``rollout_log_probs``, ``selection_keys`` (uniform random numbers that order a random choice of
tokens), ``lag`` (the policy versions between the sampler and the current policy, per token).

Three-policy batches. An estimator that lists ``rollout_log_probs`` in ``inputs`` (required) computes a decoupled
loss (verl's decoupled mode, AReaL's decoupled PPO): ``old_log_prob`` is then the proximal policy pi_old that the
trainer recomputes at the start of the update and ``rollout_log_probs`` the sampler mu. The engines supply it so
(lab.engine.estimator.Estimator.three_policy). Estimators that list it in ``optional_inputs`` run the two-policy form
(``old_log_prob`` = mu) unless the caller passes it.

Mask replay. A sampler with top-p, top-k or min-p draws from pi restricted to its kept set S_t and renormalised;
every estimator with ``mask_replay`` in its entry (`lab estimators` shows it) takes an optional ``kept_log_mass``
[B, T] = log pi(S_t) and then scores log pi(y_t) - log pi(S_t), the trainer's log-probs renormalised over the
recorded kept set (lab.estimators.contract).

Named presets. ``info("verl:NAME")`` resolves one of verl's rollout-correction presets
(lab.estimators.presets) to the registered estimator and hyper-parameters it maps to, with the preset's name.

The contract (every registered function is wrapped by lab.estimators.contract.guard, so each estimator, and any
later one, is held to it; ``check_inputs`` runs the same checks on their own):

- Shapes: the [B, T] inputs above share log_prob's shape; ``advantages`` is [B, T] or [B, 1] (1-D is refused);
  [B, T, V] inputs match; otherwise LabError.
- Degenerate inputs: a batch with no token positions (B = 0 or T = 0) raises LabError; rows without a real token
  contribute zero loss and zero gradient (and count as rows in the seq-mean-* modes); an all-masked batch gives
  gradient 0 and loss 0 (GVPO's regression keeps its constant reward term).
- Padding: values at masked positions (NaN, +-inf, 1e30, ...) are replaced by torch.where before use and change
  neither the loss nor the gradient.
- NaN and infinities at real positions, a positive log_prob (or teacher_log_prob) and mask values other than 0/1
  raise LabError outside torch.func transforms; inside vmap/grad (values unreadable) a NaN or infinity at a real
  position makes the loss and the gradient at every real position NaN. No estimator drops them silently.
- Precision: float16/bfloat16 inputs are computed in float32 (ratios included); the loss is float32, and the
  gradient with respect to a half-precision input is the float32 gradient rounded to its precision.
- Hyper-parameters: each has a declared domain (``domains=``, e.g. ``{"cap": "positive"}``) and optionally a
  cross-field ``check``; calls and ``check_hyper`` refuse values outside them with one LabError sentence.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable

from lab.errors import LabError
from lab.estimators.contract import Domain, check_values, guard


UNBIASED = ("always", "on-policy", "never", "other")  # the machine-checked form of ``unbiased_for``


@dataclass(frozen=True)
class EstimatorInfo:
    name: str
    fn: Callable  # the guarded function (see the module docstring)
    family: str  # on-policy | importance-sampling | clipping | ...
    source: str  # the paper or system the formula and defaults come from, with file and commit where code ships
    unbiased_for: str  # what its expectation equals, or "biased" with the reason
    description: str  # one line
    label: str = ""  # display name in tables and figures ("Seq IS", "PPO clip", "VESPO")
    paper: str = ""  # the paper or system it comes from, with its arXiv id where there is one
    unbiased: str = "other"  # checked by enumeration: "always" (E = c grad J at any staleness), "on-policy" (only at
    # mu = pi), "never" (biased even on-policy), "other" (another target: KL penalties, distillation, GVPO)
    coefficient: Callable | None = None  # effective coefficient on grad log pi, as a plain function
    defaults: dict = field(default_factory=dict)  # hyper-parameters and their defaults
    inputs: tuple = ()  # extra named inputs, required (see the module docstring)
    optional_inputs: tuple = ()  # extra named inputs it uses when given (e.g. rollout_log_probs)
    grad_scale: Callable | None = None  # hyper -> c: on-policy, E[-grad loss] = c * grad J (None: c = 1)
    ratio: str = "token"  # its coefficient's ratio: token rho_t, sequence W = pi(y)/mu(y), geometric W^(1/|y|)
    loss_agg_mode: str = "token-mean"  # its own default aggregation (the one its source runs)
    fixed_agg: bool = False  # True: its loss defines its own aggregation and ignores loss_agg_mode (GVPO)
    domains: dict = field(default_factory=dict)  # hyper-parameter -> Domain (allowed values)
    check: Callable | None = None  # hyper -> None, or a sentence naming a conflict between hyper-parameters
    differences: str = ""  # deliberate differences from the code it cites (verl, TRL, the authors'); "" if none
    homogeneous: bool = True  # per-token loss(w A) = w loss(A) for w >= 0: verl's rollout_is_weights can scale A
    mask_replay: bool = False  # takes ``kept_log_mass`` (the sampler's kept set replayed; lab.estimators.contract)

    @property
    def three_policy(self) -> bool:
        """Whether it needs a decoupled batch: old_log_prob = the recomputed pi_old, rollout_log_probs = mu."""
        return "rollout_log_probs" in self.inputs


_REGISTRY: dict[str, EstimatorInfo] = {}


def register(name: str, *, family: str, source: str, unbiased_for: str, label: str = "", paper: str = "",
             unbiased: str = "other", coefficient: Callable | None = None, inputs: tuple = (),
             optional_inputs: tuple = (),
             grad_scale: Callable | None = None, ratio: str = "token", fixed_agg: bool = False,
             domains: dict | None = None, check: Callable | None = None, differences: str = "",
             homogeneous: bool = True):
    """Decorator: add ``fn`` to the registry, held to the contract (see the module docstring). Its keyword defaults
    (other than the named inputs) become the registry's hyper-parameter defaults; each needs a domain in
    ``domains`` ("positive", "nonnegative", "finite", "> X", ">= X", "positive integer", "bool", optionally
    followed by " or None", or "one of a|b|c"). ``label`` (default: the name) and ``paper`` are what tables and
    figures show; ``unbiased`` is one of UNBIASED (tests/test_estimator_unbiasedness.py checks it by enumeration;
    "other", the default, is not checked)."""
    if unbiased not in UNBIASED:
        raise ValueError(f"register({name!r}): unbiased must be one of {UNBIASED}, got {unbiased!r}")

    def wrap(fn):
        signature = inspect.signature(fn).parameters
        params = signature.values()
        agg = signature["loss_agg_mode"].default if "loss_agg_mode" in signature else "token-mean"
        skip = {"loss_agg_mode", *inputs, *optional_inputs}
        defaults = {p.name: p.default for p in params if p.default is not inspect._empty and p.name not in skip}
        parsed = {k: Domain(v) if isinstance(v, str) else v for k, v in (domains or {}).items()}
        missing = sorted(set(defaults) - set(parsed))
        if missing or set(parsed) - set(defaults):
            raise ValueError(f"register({name!r}): declare a domain for each hyper-parameter and nothing else "
                             f"(missing: {missing}, unknown: {sorted(set(parsed) - set(defaults))})")
        check_values(name, parsed, defaults, check)  # the defaults themselves must be admissible
        doc = (fn.__doc__ or "").strip().splitlines()
        guarded = guard(name, fn, tuple(inputs), tuple(optional_inputs), info)
        _REGISTRY[name] = EstimatorInfo(
            name=name, fn=guarded, family=family, source=source, unbiased_for=unbiased_for,
            description=doc[0] if doc else "", label=label or name, paper=paper, unbiased=unbiased,
            coefficient=coefficient,
            defaults=defaults, inputs=tuple(inputs), optional_inputs=tuple(optional_inputs), grad_scale=grad_scale,
            ratio=ratio, loss_agg_mode=agg, fixed_agg=fixed_agg, domains=parsed, check=check, differences=differences,
            homogeneous=homogeneous, mask_replay=replayable(family, inputs))
        return guarded

    return wrap


def replayable(family: str, inputs) -> bool:
    """Whether mask replay applies: the loss is a function of the sampled tokens' log-probs (not a KL penalty, not a
    distillation loss, no logits read), so renormalising them over the sampler's kept set is the whole fix."""
    return family not in ("kl-penalty", "distillation") and "logits" not in inputs


def names() -> list[str]:
    return list(_REGISTRY)


def info(name: str) -> EstimatorInfo:
    """The registry entry of ``name``, or of a named preset such as "verl:decoupled_geo_rs" (lab.estimators.presets)."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if isinstance(name, str) and ":" in name:
        from lab.estimators.presets import preset_info

        return preset_info(name)
    raise LabError(f"unknown estimator {name!r}; known estimators: {', '.join(_REGISTRY)}, and verl's presets as "
                   f"verl:NAME (see `lab estimators` and `lab estimators --preset verl`)")


def get(name: str) -> Callable:
    return info(name).fn


def check_hyper(name: str, hyper: dict) -> None:
    """LabError unless ``hyper`` names only the estimator's hyper-parameters and every value (merged with the
    defaults) lies in its declared domain, e.g. a NaN, a negative cap, beta = 0 for GVPO or "abc"."""
    i = info(name)
    unknown = set(hyper) - set(i.defaults)
    if unknown:
        raise LabError(f"estimator {name!r} has no hyper-parameter(s) {', '.join(sorted(unknown))}; "
                       f"it takes {', '.join(i.defaults) or 'none'}")
    check_values(name, i.domains, {**i.defaults, **hyper}, i.check)


def check_inputs(name: str, log_prob, old_log_prob, advantages, response_mask, **named) -> None:
    """The contract's input checks on their own (shapes, then values: NaN, infinities, positive log-probs, mask
    values), for callers that validate a batch once before running an estimator under torch.func transforms,
    where the guarded call cannot read values. Call it outside transforms."""
    from lab.estimators.contract import check_shapes, check_values_of_inputs

    i = info(name)
    keys = (*i.inputs, *i.optional_inputs)
    named = {k: v for k, v in named.items() if k in keys and v is not None}
    check_shapes(name, log_prob, old_log_prob, advantages, response_mask, named)
    check_values_of_inputs(name, log_prob, old_log_prob, advantages, response_mask, named)
