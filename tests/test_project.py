"""The project's own promises: environment.yml in step with pyproject.toml, CI runs the README's test command."""
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = set(project["dependencies"]).union(*(v for k, v in extras.items() if k != "all"))
    assert extras["all"] == [f"offpolicy-variance-lab[{','.join(k for k in extras if k not in ('all', 'test'))}]"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert "python=3.11" in env["dependencies"]
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert set(pip) - {"-e ."} == wanted
    assert "torch==2.13.0" in wanted


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", readme, flags=re.S)
    commands = {line.strip() for b in blocks for line in b.splitlines() if line.strip()}
    assert "make test" in commands and "make reports" in commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "make test" in [line.strip() for line in ci]
