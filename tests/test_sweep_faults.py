"""A sweep driver killed with SIGKILL leaves no process of its own behind, and its folder resumes."""
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

LAB = Path(sys.executable).parent / "lab"
SPEC = """name: slow
base: {env: small_dense, policy: markov, steps: 60, rollout_batch: 32, group_size: 4, minibatches: 4}
grid:
  seed: [0, 1, 2, 3]
"""


def _marked(marker: str) -> list[int]:
    """Live processes whose environment carries ``marker``."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                status = (proc / "status").read_text()
                if "State:\tZ" not in status:
                    out.append(int(proc.name))
        except OSError:
            continue
    return out


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc to find the processes")
def test_sigkilled_sweep_leaves_no_workers_and_resumes(tmp_path):
    spec = tmp_path / "slow.yaml"
    spec.write_text(SPEC)
    marker = f"LAB_SWEEP_MARK={uuid.uuid4().hex}"
    key, value = marker.split("=")
    env = {**os.environ, key: value, "LAB_QUIET": "1"}
    out = tmp_path / "run"
    driver = subprocess.Popen([str(LAB), "sweep", str(spec), "--workers", "2", "--out", str(out)], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while len(_marked(marker)) < 3 and time.time() < deadline:  # the driver, the fork server and workers
        time.sleep(0.2)
    assert len(_marked(marker)) >= 3, "the sweep did not start its workers"
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    deadline = time.time() + 20
    while _marked(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert _marked(marker) == []
    done = subprocess.run([str(LAB), "sweep", str(spec), "--workers", "2", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "4 in all" in done.stdout
    names = [p.name for p in (out / "cells").iterdir()]
    assert len(names) == 4 and not [n for n in names if n.startswith(".")]  # the killed run's staging is gone
