# `make serve` and `make test` work on a fresh machine: both set up .venv first.
VENV    := .venv
PY      := $(VENV)/bin/python
OMNI    := $(VENV)/bin/omni
STAMP   := $(VENV)/.installed
MODELS  := models
PORT    ?= 8000

.PHONY: setup serve test lint format demo-models clean

setup: $(STAMP)

# Idempotent: re-runs only when pyproject.toml changes. torch 2.13.0 (CPU) first, so the
# project's `torch>=` range is already met and pip never reaches for a CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(MODELS)/tiny-thinker/config.json: | $(STAMP)
	$(OMNI) models init-demo $(MODELS)

demo-models: $(MODELS)/tiny-thinker/config.json

serve: setup demo-models
	$(OMNI) serve examples/tiny-omni.yaml --port $(PORT)

test: setup
	$(PY) -m pytest

lint: setup
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

format: setup
	$(VENV)/bin/ruff check --fix . && $(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) $(MODELS) .pytest_cache
