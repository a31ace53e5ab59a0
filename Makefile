# Set-up and the two everyday commands. Everything lives in a local virtualenv (.venv).
# torch is installed first as exactly 2.13.0: that is the CPU wheel; an unpinned torch pulls a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# Extra pip flags: .ci/run passes --no-compile (it has Python write each module's bytecode at its first import).
PIP_FLAGS ?=

.PHONY: install train test durations lint clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet $(PIP_FLAGS) "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet $(PIP_FLAGS) -e ".[dev]"
	touch $@

install: $(VENV)/.installed

## The main job on the embedded default: a tiny CPU run that prints the resource ledger.
train: install
	$(VENV)/bin/moe-train $(ARGS)

## The whole test suite (what CI runs). Two workers, each taking whole files (--dist loadfile keeps a module's
## fixtures in one process): many tests wait on process start-up, barriers and timeouts rather than compute. Files
## start longest first, by tests/file_durations.json (tests/conftest.py); `make durations` re-records it.
test: install
	$(PY) -m ruff check .
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

durations: install
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder --record-file-durations $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
