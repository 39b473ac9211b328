# zfctl developer entry points. `make test` and `make demo` work on a fresh clone: they create
# .venv, install torch==2.13.0 first (an unpinned torch pulls a multi-GB CUDA build), then the
# package in editable mode, then build the native CPU-Adam. A second run reinstalls nothing.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.zfctl-installed
NATIVE_SRC := $(wildcard native/*.c native/*.h native/build.py)
NATIVE_STAMP := $(VENV)/.zfctl-native

.PHONY: setup native test test-fast demo bench lint clean gpu-check

# Native build and sanitizer targets (check-native) live next to the C sources.
include native/native.mk

setup: $(STAMP) $(NATIVE_STAMP)

# TORCH_INDEX=https://download.pytorch.org/whl/cpu picks the small CPU build where reachable.
TORCH_INDEX ?=

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

$(NATIVE_STAMP): $(STAMP) $(NATIVE_SRC)
	$(PY) native/build.py
	touch $@

native: $(NATIVE_STAMP)

# The full suite (what CI runs), then ruff and mypy (lint), the kernel tests again against an
# ASan/UBSan build (check-native) and the Python-free kernel driver on every ISA and on aarch64
# under qemu (check-arch; both in native/native.mk).
test: setup
	$(PY) -m pytest -q
	$(MAKE) lint
	$(MAKE) check-native
	$(MAKE) check-arch

# The edit loop: the suite without the tests marked slow (whole CLI runs, multi-process runs).
test-fast: setup
	$(PY) -m pytest -q -m "not slow"

demo: setup
	$(VENV)/bin/zfctl finetune tiny-llama --data alpaca-sample --output runs/demo --force

bench: setup
	$(VENV)/bin/zfctl bench --topk 0.1,0.2 --interval 2,4

# The GPU check (scripts/gpu_check.py; README, section "GPU check"): tests, benchmarks and a 2-GPU
# NCCL run into one JSON file. PART=tests|bench-b1|bench-b4|nccl|all (each part fits a 10-minute
# slot; several parts add up in the same file), OUT=file.json. It runs with $(PYTHON), the
# system's python3 that holds torch, and does not depend on `setup`: that installs torch from
# PyPI, which an offline GPU machine cannot do (the other packages come from .whl/, see
# scripts/fetch_gpu_wheels.sh). Without CUDA it prints one SKIPPED line and exits 0.
PART ?= all
gpu-check:
	$(PYTHON) scripts/gpu_check.py $(PART) $(if $(OUT),--out $(OUT))

# ruff on everything; mypy on the library (zfctl/, settings in pyproject.toml [tool.mypy]).
lint: setup
	$(VENV)/bin/ruff check zfctl tests scripts
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build dist *.egg-info zfctl/_zfnative* runs native/build-*
