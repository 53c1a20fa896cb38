# Two entry points: `make demo` runs the embedded tiny pipeline, `make test` runs lint + tests.
# Both create .venv on first use and are idempotent afterwards.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU machines take this torch from a local wheel; GPU users install their CUDA torch first
# (see README) and run `make TORCH_SPEC= test` so it is left alone.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test lint setup clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	if [ -n "$(TORCH_SPEC)" ]; then $(PY) -m pip install -q "$(TORCH_SPEC)"; fi
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/lmforge demo

lint: $(STAMP)
	$(VENV)/bin/ruff check lmforge tests benchmarks
	$(VENV)/bin/ruff format --check lmforge tests benchmarks

test: lint
	$(VENV)/bin/pytest -q

clean:
	rm -rf $(VENV) runs
