# offaug: every target installs what it needs first, so each works on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PYTHONUNBUFFERED := 1

.PHONY: install quickstart test test-fast lint typecheck bench bench-quick clean

install: $(STAMP)

# Re-installs only when pyproject.toml changes. torch is pinned in pyproject (a CPU wheel on
# these machines); d4rl goes in without its dependencies (mujoco-py cannot build) so that its
# reference code and scores are importable.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev]"
	$(PY) -m pip install --quiet --no-deps "d4rl==1.1"
	touch $(STAMP)

# The main job on the embedded default: workflows/quickstart.yaml end to end on a local Dask
# cluster (it makes its own small Minari dataset first). Results in runs/quickstart/.
QUICKSTART_DIR := .quickstart
quickstart: install
	MINARI_DATASETS_PATH=$(abspath $(QUICKSTART_DIR))/datasets \
	OFFAUG_CACHE_DIR=$(abspath $(QUICKSTART_DIR))/cache \
	$(PY) -m offaug run workflows/quickstart.yaml --out runs/quickstart

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy sees the installed layout (offaug.datasets -> datasets/) through a folder of symlinks.
typecheck: install
	mkdir -p .typecheck/offaug
	for f in offaug/*.py offaug/py.typed; do ln -sfn ../../$$f .typecheck/offaug/$$(basename $$f); done
	for d in datasets algorithms pipeline; do ln -sfn ../../$$d .typecheck/offaug/$$d; done
	cd .typecheck && ../$(VENV)/bin/mypy --config-file ../pyproject.toml -p offaug

test: lint typecheck
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

BENCH_STAMP := $(VENV)/.installed-bench
$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev,bench]"
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(PY) benchmarks/run_all.py

bench-quick: $(BENCH_STAMP)
	$(PY) benchmarks/run_all.py --quick

clean:
	rm -rf .quickstart .typecheck .pytest_cache .mypy_cache .ruff_cache
