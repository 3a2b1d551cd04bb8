import os

import pytest
import torch

os.environ.setdefault("LAB_QUIET", "1")

import toy_envs  # noqa: E402
from lab.policies import init_params, make_policy  # noqa: E402


@pytest.fixture
def tiny():
    env = toy_envs.make("tiny_target")
    policy = make_policy("prefix", env)
    theta = init_params(policy, 1.0, torch.Generator().manual_seed(0))
    return env, policy, theta
