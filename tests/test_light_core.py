"""The core installs and runs without the extras: with every package of the reports, teach, hf and ray extras
made unimportable, the listing commands, a variance study, a training run with its rollout log, a local sweep and
`lab diagnose` work, and the commands that need an extra say in one line what to install. The listing commands
load neither torch nor scipy (they answer in a fraction of a second: benchmarks/bench_cli.py)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from lab.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = sorted({m for _, mods in EXTRAS.values() for m in mods} | {"ipywidgets", "jupyterlab", "accelerate"})
PRELUDE = f"""
import sys
BLOCKED = {BLOCKED!r}
LOADED = []
class Blocker:
    def find_spec(self, name, path=None, target=None):
        top = name.split(".")[0]
        if top in BLOCKED:
            raise ImportError(f"{{name}} is not installed (blocked by the test)")
        if top in ("torch", "scipy", "pandas") and top not in LOADED:
            LOADED.append(top)
sys.meta_path.insert(0, Blocker())
from lab.cli import main
try:
    code = main(sys.argv[1:])
finally:
    print("LOADED", ",".join(LOADED), file=sys.stderr)
sys.exit(code)
"""


def lab(tmp_path, *args):
    return subprocess.run([sys.executable, "-c", PRELUDE, *args], capture_output=True, text=True, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LAB_QUIET": "1",
                               "LAB_CACHE_DIR": str(tmp_path / "cache")}, timeout=600)


def loaded(proc) -> set:
    line = [ln for ln in proc.stderr.splitlines() if ln.startswith("LOADED")][-1]
    return set(filter(None, line.removeprefix("LOADED").strip().split(",")))


@pytest.mark.parametrize("args", [["--help"], ["envs"], ["estimators"], ["estimators", "--preset", "verl"]])
def test_listing_commands_load_neither_torch_nor_scipy(tmp_path, args):
    proc = lab(tmp_path, *args)
    assert proc.returncode == 0, proc.stderr
    assert loaded(proc) == set(), proc.stderr


@pytest.mark.slow
def test_the_core_runs_without_the_extras(tmp_path):
    ran = lab(tmp_path, "variance", "--replicates", "8", "--values", "0,2", "--n-boot", "20", "--out", "v")
    assert ran.returncode == 0, ran.stderr
    assert json.loads((tmp_path / "v" / "summary.json").read_text())["study"] == "variance"
    ran = lab(tmp_path, "train", "--steps", "2", "--rollout-log", "--out", "t")
    assert ran.returncode == 0, ran.stderr
    ran = lab(tmp_path, "diagnose", "t/rollout_log", "--out", "d")
    assert ran.returncode == 0 and (tmp_path / "d" / "summary.json").exists(), ran.stderr
    (tmp_path / "s.yaml").write_text("name: s\nbase: {env: tiny_target, steps: 2}\ngrid: {seed: [0, 1]}\n")
    ran = lab(tmp_path, "sweep", "s.yaml", "--workers", "1", "--out", "s")
    assert ran.returncode == 0 and "2 in all" in ran.stdout, ran.stderr


@pytest.mark.parametrize("args, extra", [(["report", "variance"], "reports"),
                                         (["variance", "--policy", "hf", "--model", "model"], "hf")])
@pytest.mark.slow
def test_a_command_that_needs_an_extra_says_what_to_install(tmp_path, args, extra):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama"}')
    proc = lab(tmp_path, *args)
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert f"pip install 'offpolicy-variance-lab[{extra}" in errors[0], errors
