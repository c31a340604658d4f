# The two entry points of the README. Each sets up .venv first (scripts/setup.sh, idempotent).
VENV ?= .venv
# pytest-xdist workers of `make test` (one per CI core; 0 runs the suite in this process)
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python

.PHONY: setup demo test lint bench-cpu

setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/fastalign train sft --config examples/sft_tiny.yaml --overwrite_output_dir true

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

bench-cpu: setup
	$(VENV)/bin/fastalign bench all --preset cpu
