# Quick start: `make demo` and `make test`. Both create or reuse ./.venv and install what they need.
# torch is pinned to a known-good CPU-friendly version (an unpinned torch pulls GBs of CUDA
# wheels); override with e.g. `make demo TORCH_SPEC='torch==2.6.0'` or TORCH_SPEC=torch.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.zdiag-installed
PIP := $(BIN)/python -m pip --disable-pip-version-check -q

.PHONY: demo test lint typecheck unit venv clean sample-traces

$(STAMP): pyproject.toml setup.py
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

# mypy sees the installed layout (collectors/ as zdiag/collectors, ...) through a symlink tree.
TYPECHECK_TREE := build/typecheck
typecheck: $(STAMP)
	@rm -rf $(TYPECHECK_TREE) && mkdir -p $(TYPECHECK_TREE)/zdiag
	@for f in zdiag/*; do ln -s "$(CURDIR)/$$f" $(TYPECHECK_TREE)/zdiag/; done
	@for d in collectors analyzers tui; do ln -s "$(CURDIR)/$$d" $(TYPECHECK_TREE)/zdiag/$$d; done
	cd $(TYPECHECK_TREE) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml -p zdiag
	cd $(TYPECHECK_TREE) && $(CURDIR)/$(BIN)/mypy --config-file $(CURDIR)/pyproject.toml \
		$(CURDIR)/bench/*.py $(CURDIR)/examples/*.py

unit: $(STAMP)
	$(BIN)/pytest

test: lint typecheck unit

sample-traces: $(STAMP)
	$(BIN)/python bench/make_sample_traces.py

clean:
	rm -rf $(VENV) build dist *.egg-info zdiag_runs .mypy_cache .ruff_cache .pytest_cache
