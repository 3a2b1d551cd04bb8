"""Seeds: every random stream in the lab is derived from the user's seed and a fixed path of integers.

``derive_seed(seed, 2, i)`` hashes the tuple with numpy's SeedSequence, so streams for different purposes
(initial parameters, reference sample, the batches of setting i) are independent, and adding a setting does not
shift the numbers of the others.
"""
from __future__ import annotations

import numpy as np
import torch


def derive_seed(*parts: int) -> int:
    """A 32-bit seed from a path of integers (SeedSequence entropy)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1)[0])


def generator(*parts: int) -> torch.Generator:
    """A torch CPU generator seeded with ``derive_seed(*parts)``."""
    return torch.Generator().manual_seed(derive_seed(*parts))
