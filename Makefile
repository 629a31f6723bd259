# Two commands on a fresh machine:  `make sample`  (set up + run the sample investigation)
#                                    `make test`    (set up + run the tests)
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

# The main job needs the runtime dependencies only; the tests add their own, Spark (the parity tests) and the
# linters (the extras test, spark and dev).
$(VENV)/.runtime-installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test-installed: pyproject.toml $(VENV)/.runtime-installed
	$(BIN)/pip install -q -e '.[test,spark,dev]'
	touch $@

setup: $(VENV)/.runtime-installed

sample: setup
	$(BIN)/kvforensics run data/sample/incident.toml --out reports/sample

test: $(VENV)/.test-installed
	$(BIN)/python -m pytest -q -n 2

# The habits CI keeps before the tests: ruff's lint and format check, and the layers of docs/architecture.md as
# import contracts (pyproject.toml's [tool.importlinter]).
LINTED := kvforensics tests benchmarks
lint: $(VENV)/.test-installed
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/lint-imports --no-cache

# JupyterLab on the notebooks, at http://$(LAB_IP):$(LAB_PORT). In a container: `make lab LAB_IP=0.0.0.0` to reach
# it from outside; as root (the usual case there) --allow-root is added, which Jupyter needs to start.
# LAB_ARGS: any other jupyter lab options, e.g. LAB_ARGS=--no-browser.
LAB_IP ?= 127.0.0.1
LAB_PORT ?= 8888
LAB_ARGS ?=
lab: setup
	$(BIN)/jupyter lab --ip=$(LAB_IP) --port=$(LAB_PORT) $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS) notebooks/

.PHONY: setup sample test lint lab
