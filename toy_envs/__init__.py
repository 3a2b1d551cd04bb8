"""Toy environments with a registry of named presets: autoregressive bandits (``toy_envs.bandits``) and synthetic
tasks with verifiable rewards in a character vocabulary (``toy_envs.tasks``)."""
from toy_envs import bandits, tasks
from toy_envs.bandits import DEFAULT_ENUM_LIMIT, REWARDS, SequenceBandit
from toy_envs.tasks import Task

__all__ = ["DEFAULT_ENUM_LIMIT", "REWARDS", "SequenceBandit", "Task", "make", "names"]


def names() -> list[str]:
    """Every preset: the bandits, then the tasks."""
    return bandits.names() + tasks.names()


def make(name: str, **overrides):
    """A named preset, with fields overridden by keyword (``make('tiny_target', length=6)``)."""
    if name in tasks.PRESETS:
        return tasks.make(name, **overrides)
    if name in bandits.names():
        return bandits.make(name, **overrides)
    from lab.errors import LabError

    raise LabError(f"unknown env {name!r}; known envs: {', '.join(names())} (see `lab envs`)")
