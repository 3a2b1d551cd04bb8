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
@pytest.mark.parametrize("how", ["kill", "kill, never reaped", "term, never reaped"])
@pytest.mark.slow
def test_a_killed_sweep_leaves_no_process_and_resumes(tmp_path, how):
    """SIGKILL or SIGTERM of the driver: its fork server and workers exit within seconds, also while the driver stays
    a zombie because its parent still holds its output pipe (a pid probe takes a zombie for alive)."""
    spec = tmp_path / "slow.yaml"
    spec.write_text(SPEC)
    marker = f"LAB_SWEEP_MARK={uuid.uuid4().hex}"
    key, value = marker.split("=")
    env = {**os.environ, key: value, "LAB_QUIET": "1"}
    out = tmp_path / "run"
    driver = subprocess.Popen([str(LAB), "sweep", str(spec), "--workers", "2", "--out", str(out)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.time() + 60
    while len(_marked(marker)) < 4 and time.time() < deadline:  # the driver, the fork server and two workers
        time.sleep(0.2)
    assert len(_marked(marker)) >= 4, "the sweep did not start its workers"
    driver.send_signal(signal.SIGTERM if how.startswith("term") else signal.SIGKILL)
    if "never reaped" not in how:
        driver.wait()
    deadline = time.time() + 20
    while _marked(marker) and time.time() < deadline:
        time.sleep(0.2)
    assert _marked(marker) == []
    driver.wait()  # reaped only now
    if how.startswith("term"):
        err = driver.stderr.read().decode().strip().splitlines()
        assert driver.returncode == 130 and len(err) == 1 and err[0].startswith("error: interrupted"), err
    done = subprocess.run([str(LAB), "sweep", str(spec), "--workers", "2", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "4 in all" in done.stdout
    names = [p.name for p in (out / "cells").iterdir()]
    assert len(names) == 4 and not [n for n in names if n.startswith(".")]  # the killed run's staging is gone
