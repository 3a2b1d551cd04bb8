"""Toy autoregressive bandit environments with a registry of named presets."""
from toy_envs.bandits import DEFAULT_ENUM_LIMIT, REWARDS, SequenceBandit, make, names

__all__ = ["DEFAULT_ENUM_LIMIT", "REWARDS", "SequenceBandit", "make", "names"]
