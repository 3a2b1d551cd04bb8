"""verl's rollout-correction presets by name: ``verl:NAME`` is the lab estimator and hyper-parameters that compute
exactly the loss verl 0.9.1 runs for ``RolloutCorrectionConfig.NAME()`` (``verl/trainer/config/algorithm.py``) with
its vanilla actor (eps 0.2 / 0.2, dual clip 3.0: ActorConfig's defaults).

Decoupled presets run the three-policy batch (old_log_prob = the recomputed pi_old, rollout_log_probs = the
sampler): their entry lists rollout_log_probs as required, and the engines supply that batch (in ``lab variance``
pi_old is pi itself, the first mini-batch of an update). Bypass presets run the two-policy batch (verl sets
old_log_prob = rollout_log_prob): given rollout_log_probs, they use it as old_log_prob. ``lab estimators --preset
verl`` lists them; ``--estimators verl:NAME`` runs one.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from lab.errors import LabError

VANILLA = {"clip_ratio_c": 3.0}  # verl's vanilla PPO keeps the dual clip on; the lab's ppo_clip default is off


@dataclass(frozen=True)
class Preset:
    estimator: str  # the registered estimator
    hyper: dict  # its hyper-parameters under the preset
    decoupled: bool  # three-policy (verl's decoupled mode) or two-policy (bypass mode)
    verl: str  # the RolloutCorrectionConfig fields the preset sets, as verl writes them


VERL_PRESETS = {
    "decoupled_token_is": Preset("tis_token", {"cap": 2.0}, True, "rollout_is='token', threshold 2.0"),
    "decoupled_seq_is": Preset("tis_seq", {"cap": 2.0}, True, "rollout_is='sequence', threshold 2.0"),
    "decoupled_token_icepop": Preset("mis_token", {"lower": 0.5, "upper": 5.0}, True,
                                     "rollout_is='token', threshold '0.5_5.0'"),
    "decoupled_seq_is_rs": Preset("seq_rs", {"tis": "sequence", "cap": 2.0, "lower": 0.5, "upper": 2.0}, True,
                                  "rollout_is='sequence' 2.0, rollout_rs='seq_sum_k1' '0.5_2.0'"),
    "decoupled_geo_rs": Preset("geo_rs", {}, True, "rollout_is=None, rollout_rs='seq_mean_k1' '0.999_1.001'"),
    "decoupled_geo_rs_seq_tis": Preset("geo_rs", {"tis": "sequence"}, True,
                                       "rollout_is='sequence' 2.0, rollout_rs='seq_mean_k1' '0.999_1.001'"),
    "decoupled_geo_rs_token_tis": Preset("geo_rs", {"tis": "token"}, True,
                                         "rollout_is='token' 2.0, rollout_rs='seq_mean_k1' '0.999_1.001'"),
    "decoupled_k3_rs": Preset("k3_rs", {}, True, "rollout_is=None, rollout_rs='seq_mean_k3' 0.01"),
    "decoupled_k3_rs_seq_tis": Preset("k3_rs", {"tis": "sequence"}, True,
                                      "rollout_is='sequence' 2.0, rollout_rs='seq_mean_k3' 0.01"),
    "decoupled_k3_rs_token_tis": Preset("k3_rs", {"tis": "token"}, True,
                                        "rollout_is='token' 2.0, rollout_rs='seq_mean_k3' 0.01"),
    "bypass_ppo_clip": Preset("ppo_clip", VANILLA, False, "bypass_mode, loss_type='ppo_clip', no IS, no RS"),
    "bypass_ppo_clip_geo_rs": Preset("geo_rs", {"bypass_loss": "ppo_clip"}, False,
                                     "bypass_mode, loss_type='ppo_clip', rollout_rs='seq_mean_k1' '0.999_1.001'"),
    "bypass_ppo_clip_k3_rs": Preset("k3_rs", {"bypass_loss": "ppo_clip"}, False,
                                    "bypass_mode, loss_type='ppo_clip', rollout_rs='seq_mean_k3' 0.01"),
    "bypass_pg_is": Preset("tis_seq", {"cap": 2.0}, False,
                           "bypass_mode, loss_type='reinforce', rollout_is='sequence' 2.0"),
    "bypass_pg_token_icepop": Preset("mis_token", {"lower": 0.5, "upper": 5.0}, False,
                                     "bypass_mode, loss_type='reinforce', rollout_is='token' '0.5_5.0'"),
    "bypass_pg_geo_rs": Preset("geo_rs", {"bypass_loss": "reinforce"}, False,
                               "bypass_mode, loss_type='reinforce', rollout_rs='seq_mean_k1' '0.999_1.001'"),
    "bypass_pg_geo_rs_seq_tis": Preset("geo_rs", {"bypass_loss": "reinforce", "tis": "sequence"}, False,
                                       "bypass_mode, loss_type='reinforce', rollout_is='sequence' 2.0, "
                                       "rollout_rs='seq_mean_k1' '0.999_1.001'"),
    "bypass_pg_geo_rs_token_tis": Preset("geo_rs", {"bypass_loss": "reinforce", "tis": "token"}, False,
                                         "bypass_mode, loss_type='reinforce', rollout_is='token' 2.0, "
                                         "rollout_rs='seq_mean_k1' '0.999_1.001'"),
    "disabled": Preset("ppo_clip", VANILLA, True, "rollout_is=None, rollout_rs=None (decoupled PPO, no correction)"),
}
SYSTEMS = {"verl": VERL_PRESETS}


def split(name: str) -> tuple[str, str]:
    system, _, preset = name.partition(":")
    if system not in SYSTEMS or preset not in SYSTEMS[system]:
        known = ", ".join(f"{s}:{p}" for s, table in SYSTEMS.items() for p in table)
        raise LabError(f"unknown estimator or preset {name!r}; presets: {known} (see `lab estimators --preset verl`)")
    return system, preset


def composition(name: str) -> str:
    """One line: the preset, verl's fields and the lab estimator with hyper-parameters it runs."""
    system, preset = split(name)
    p = SYSTEMS[system][preset]
    hyper = ", ".join(f"{k}={v!r}" for k, v in p.hyper.items())
    form = "three-policy (decoupled)" if p.decoupled else "two-policy (bypass)"
    return f"{name}: {p.verl} -> {p.estimator}({hyper}), {form}"


@functools.lru_cache(maxsize=None)
def preset_info(name: str):
    """The EstimatorInfo of a preset: the registered estimator's, with the preset's name, defaults and batch form."""
    from lab.estimators.registry import _REGISTRY

    system, preset = split(name)
    p = SYSTEMS[system][preset]
    base = _REGISTRY[p.estimator]
    accepts_rollout = "rollout_log_probs" in base.inputs + base.optional_inputs
    base_fn = base.fn

    @functools.wraps(base_fn)
    def fn(log_prob, old_log_prob, *args, rollout_log_probs=None, **kwargs):
        if rollout_log_probs is not None and not p.decoupled:  # bypass mode: the sampler IS old_log_prob
            old_log_prob = rollout_log_probs
        elif rollout_log_probs is not None and accepts_rollout:
            kwargs["rollout_log_probs"] = rollout_log_probs
        return base_fn(log_prob, old_log_prob, *args, **{**p.hyper, **kwargs})

    others = tuple(k for k in base.optional_inputs if k != "rollout_log_probs")
    return dataclasses.replace(
        base, name=name, fn=fn, defaults={**base.defaults, **p.hyper}, label=f"verl {preset}",
        inputs=(*base.inputs, "rollout_log_probs") if p.decoupled and not base.three_policy else base.inputs,
        optional_inputs=others if p.decoupled else (*others, "rollout_log_probs"),
        source=f"verl 0.9.1 RolloutCorrectionConfig.{preset}() ({p.verl}); " + base.source,
        description=f"verl preset {preset}: {p.estimator} with {p.hyper or 'its defaults'}, "
                    f"{'decoupled (three-policy)' if p.decoupled else 'bypass (two-policy)'}")


def names(system: str = "verl") -> list[str]:
    return [f"{system}:{p}" for p in SYSTEMS[system]]
