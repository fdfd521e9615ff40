# Quick start: `make demo` and `make test`. Both create or reuse ./.venv and install what they need.
# torch is pinned to a known-good CPU-friendly version (an unpinned torch pulls GBs of CUDA
# wheels); override with e.g. `make demo TORCH_SPEC='torch==2.6.0'` or TORCH_SPEC=torch.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.zdiag-installed
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: demo test lint typecheck unit integration venv clean sample-traces

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "zdiag: installing into $(VENV) ($(TORCH_SPEC) and the dev extras)..."
	@$(PIP) install "$(TORCH_SPEC)" 2>&1 | grep -v "is ignored: it is neither" || true
	@$(PIP) install -e ".[dev]" 2>&1 | grep -v "is ignored: it is neither" || true
	@$(BIN)/python -c "import torch, zdiag.analyzers, zdiag.collectors, zdiag.tui" \
		|| { echo "zdiag: the install into $(VENV) failed (see pip's messages above)"; exit 1; }
	@touch $@

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/zdiag demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# mypy follows zdiag.analyzers (a symlink to analyzers/) on the checkout itself.
typecheck: $(STAMP)
	$(BIN)/mypy -p zdiag
	$(BIN)/mypy bench/*.py examples/*.py examples/mesh/*.py

# Fast unit tests (no real processes, training runs or browser), on every core: under a minute.
UNIT_MARKERS := not dist and not browser and not slow and not tui
unit: $(STAMP)
	$(BIN)/pytest -m "$(UNIT_MARKERS)" -n auto

# Real multi-process torch.distributed runs, the browser, Textual pilots and the slow tests.
integration: $(STAMP)
	$(BIN)/pytest -m "not ($(UNIT_MARKERS))"

test: lint typecheck unit integration

sample-traces: $(STAMP)
	$(BIN)/python bench/make_sample_traces.py

clean:
	rm -rf $(VENV) build dist *.egg-info zdiag_runs .mypy_cache .ruff_cache .pytest_cache
