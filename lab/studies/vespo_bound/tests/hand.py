"""A hand-made bound table of the vespo_bound study (the shape lab.studies.vespo_bound.bound computes), ratios known."""
import math

import pandas as pd

from lab.estimators import vespo as V
from lab.studies.vespo_bound.bound import kernel_label


def wide_bound() -> pd.DataFrame:
    """A bound table by hand: two kinds, three kernels (one without K), two seeds; ratios known."""
    rows = []
    for seed in (0, 1):
        for kind, values in (("lag", [0.0, 4.0]), ("temperature", [0.5, 2.0])):
            for i, v in enumerate(values):
                for k, lam in ((2.0, 3.0), (1.0, 1.0), (0.5, 1.0)):
                    K = V.bound_constant(k, lam)
                    ratio = 0.2 + 0.1 * i + 0.05 * seed + 0.3 * (k == 2.0) if math.isfinite(K) else math.nan
                    rows.append({"env": "tiny_target", "policy": "prefix", "seed": seed, "staleness_kind": kind,
                                 "staleness": v, "k": k, "lam": lam, "kernel": kernel_label(k, lam), "Z": 1.0,
                                 "C": 1.0, "K": K, "phi2": 0.5 + i, "bound": 1.0 + 2 * i, "ratio": ratio,
                                 "w2": 1.0 + 10 * i, "floor_mass": 0.0, "kl_token": 0.1 * i, "chi2_seq": 10.0 * i})
    return pd.DataFrame(rows)
