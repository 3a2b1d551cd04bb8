# Two entry points: `make reports` (default report gallery) and `make test`.
# Both create or reuse the virtual environment in .venv.
PYTHON ?= python3.11
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup reports test bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e '.[test]'
	$(BIN)/python -m ipykernel install --prefix $(VENV) --name python3 > /dev/null
	touch $(STAMP)

reports: $(STAMP)
	$(BIN)/lab report --all

test: $(STAMP)
	$(BIN)/python -m pytest -q

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do echo "== $$b"; $(BIN)/python $$b || exit 1; done

clean:
	rm -rf $(VENV) reports/*/ .pytest_cache
