# The two entry points of the README. Each sets up .venv first (scripts/setup.sh, idempotent).
VENV ?= .venv
# pytest-xdist workers of `make test` (one per CI core; 0 runs the suite in this process)
TEST_WORKERS ?= 2
PY := $(VENV)/bin/python
# The second environment, at the lowest versions pyproject.toml allows (scripts/setup_lowest.sh), and
# what runs in it: the tests of what depends most on the library versions (activation checkpointing and
# offloading, model patching, loading, quantized loading) and kernel tests under triton 3.6's interpreter
LOWEST_VENV ?= .venv-lowest
LOWEST_TESTS ?= tests/train/test_memory.py tests/train/test_offload_keep.py tests/plan tests/kernels/test_head_workspace.py tests/reliability/test_safe_checkpoints.py tests/train/test_host_memory.py tests/train/test_generation.py tests/train/test_decode_steps.py tests/integrations/test_generate.py tests/patching \
	tests/test_model_options.py tests/real/test_loading.py tests/train/test_hub_ids.py tests/quant/test_qlora.py \
	tests/kernels/test_interpreter_versions.py tests/kernels/test_rms_norm.py tests/kernels/test_rope.py \
	tests/kernels/test_swiglu.py tests/kernels/test_linear_cross_entropy.py \
	--deselect tests/test_model_options.py::test_defaults_are_trls \
	--deselect tests/test_model_options.py::test_lora_config_is_trls \
	--deselect tests/integrations/test_generate.py::test_trls_sampling_trainers_score_trls_completions_with_greedy_sampling
# (the deselected compare with TRL, the oracle, not a dependency: trl 1.16 needs accelerate >= 1.10)

.PHONY: setup setup-lowest demo test test-lowest lint bench-cpu

setup:
	bash scripts/setup.sh

demo: setup
	$(VENV)/bin/fastalign train sft --config examples/sft_tiny.yaml --overwrite_output_dir true

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist worksteal

setup-lowest:
	bash scripts/setup_lowest.sh

# The supported versions are the tested ones: the subset above on the floor of every dependency
test-lowest: setup-lowest
	$(LOWEST_VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(LOWEST_TESTS)

bench-cpu: setup
	$(VENV)/bin/fastalign bench all --preset cpu
