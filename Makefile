# Two commands on a fresh machine:  `make sample`  (set up + run the sample investigation)
#                                    `make test`    (set up + run the tests)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

$(BIN)/kvforensics: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e '.[test,spark]'
	touch $@

setup: $(BIN)/kvforensics

sample: setup
	$(BIN)/kvforensics run data/sample/incident.toml --out reports/sample

test: setup
	$(BIN)/python -m pytest -q -n 2

lab: setup
	$(BIN)/jupyter lab notebooks/

.PHONY: setup sample test lab
