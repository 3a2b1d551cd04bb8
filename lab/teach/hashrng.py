"""A counter-based random generator with an identical JavaScript twin (lab.teach.jscore).

The browser pages redraw random teachers, rewards and logits without Python, and their numbers must match the
notebooks'. numpy's generators cannot be reproduced in a few lines of JavaScript, so the lessons draw from this
one instead: draw i of stream ``seed`` is a pure function of (seed, i), built from 32-bit integer operations that
JavaScript performs exactly (``Math.imul``, ``>>>``).

    x_i = mix(mix(seed) + i mod 2^32),   u_i = (x_i + 0.5) / 2^32 in (0, 1)
    mix = "lowbias32" (C. Wellons, hash-prospector: x ^= x >> 16; x *= 0x7feb352d; x ^= x >> 15; x *= 0x846ca68b;
          x ^= x >> 16, all mod 2^32)
    normals: Box-Muller on consecutive pairs, z_j = sqrt(-2 log u_2j) cos(2 pi u_2j+1)

It is a teaching generator (well mixed, not cryptographic); the statistics in the notebooks use numpy's.
"""
from __future__ import annotations

import numpy as np

_MASK = np.uint64(0xFFFFFFFF)


def mix32(x) -> np.ndarray:
    """lowbias32 on uint32 values (any shape), returned as uint64 holding 32-bit values."""
    x = np.asarray(x, dtype=np.uint64) & _MASK
    x ^= x >> np.uint64(16)
    x = (x * np.uint64(0x7FEB352D)) & _MASK
    x ^= x >> np.uint64(15)
    x = (x * np.uint64(0x846CA68B)) & _MASK
    x ^= x >> np.uint64(16)
    return x


def uniforms(seed: int, n: int, offset: int = 0) -> np.ndarray:
    """n uniforms in (0, 1): draws offset .. offset + n - 1 of stream ``seed``."""
    key = mix32(np.uint64(int(seed) & 0xFFFFFFFF))
    i = np.arange(offset, offset + n, dtype=np.uint64)
    return (mix32((key + i) & _MASK).astype(np.float64) + 0.5) / 4294967296.0


def normals(seed: int, n: int) -> np.ndarray:
    """n standard normal draws of stream ``seed`` (Box-Muller on pairs of uniforms)."""
    u = uniforms(seed, 2 * n)
    return np.sqrt(-2.0 * np.log(u[0::2])) * np.cos(2.0 * np.pi * u[1::2])
