"""How fast the lessons' live controls redraw: each control of each lesson's ipywidgets panel changed once, the
time from the change to the new picture and numbers (``ui.elapsed``), median over the controls and --repeats.
Target: under one second per redraw, so that a slider feels live (the lessons' static pages redraw in the browser,
in milliseconds: tests/test_teach_pages.py).

    python benchmarks/bench_lessons.py [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from common import finish, load

TARGET_S = 1.0
CHANGES = {"weight_explosion_ui": [("kl", 0.1, 0.2), ("length", 64, 32), ("vocab", 8, 16), ("batch", 64, 128)],
           "clip_mask_ui": [("kl", 0.5, 0.2), ("vocab", 16, 32), ("seed", 3, 4), ("eps", 0.1, 0.2)],
           "vespo_kernel_ui": [("k", 3.0, 2.0), ("lam", 2.0, 3.0), ("kl", 0.3, 0.1), ("length", 3, 4)],
           "gvpo_ui": [("beta", 0.2, 0.5), ("lr", 0.5, 1.0), ("steps", 100, 200)],
           "vopd_ui": [("vocab", 64, 32), ("sharpness", 2.5, 1.0), ("closeness", 0.5, 0.0), ("seed", 7, 8)],
           "sampler_truncation_ui": [("level", 0.6, 0.8), ("temperature", 1.5, 1.0), ("kl", 0.2, 0.0), ("seed", 3, 0)]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    from lab.teach import live

    t0 = time.perf_counter()
    meta = {"load_start": load(), "repeats": args.repeats}
    print(f"load average at start: {meta['load_start']}")
    rows, checks, ok = [], [], True
    for builder, changes in CHANGES.items():
        ui = getattr(live, builder)()
        times = []
        for _ in range(args.repeats):
            for name, a, b in changes:
                for value in (a, b):
                    ui.controls[name].value = value
                    times.append(ui.elapsed)
        med = statistics.median(times)
        passed = med < TARGET_S
        ok &= passed
        rows.append({"lesson": builder, "median_redraw_s": med, "max_redraw_s": max(times)})
        checks.append({"check": f"{builder} redraws in under {TARGET_S} s", "ok": passed, "value": med})
        print(f"{builder:<22} median {med:6.3f} s  max {max(times):6.3f} s{'' if passed else '  FAIL'}")
    return finish(meta, t0, checks, rows, args.json, ok)


if __name__ == "__main__":
    sys.exit(main())
