# culmen developer entry points. Both targets work on a fresh machine with python3 (3.10+) and PyPI:
# they create .venv, install what is missing once (stamp files in .venv), then run.
#   make demo   train a tiny model with culmen's kernels (CPU: < 1 min)
#   make test   ruff + the CPU test suite (2 xdist workers); matplotlib for the bench --plot tests,
#               transformers + safetensors for the flash_attn model remaps and the Hugging Face integration,
#               expecttest for PyTorch's multi-process test helpers (culmen.distributed_testing)
#
# torch: when $(PYTHON) already imports torch (a GPU user's CUDA/ROCm build, conda, an outer venv),
# .venv reuses that torch and the triton/numpy beside it (scripts/reuse_torch.py puts their site
# directories behind .venv's own); only when none is there is the CPU build $(TORCH) installed.
# `make clean-venv` starts over (e.g. after installing a torch into $(PYTHON)).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of torch that lies on local disk in CI (pip's find-links); no other install may
# resolve torch again, hence --no-deps for culmen itself. triton 3.9's interpreter runs the Triton
# kernels on CPU (3.6's breaks on range loops with numpy 2).
TORCH  := torch==2.13.0
TRITON := triton==3.9.0
STAMP_BASE := $(VENV)/.culmen-base.stamp
STAMP_TEST := $(VENV)/.culmen-test.stamp

.PHONY: demo test venv clean-venv

venv: $(STAMP_BASE)

# A venv whose reuse step failed is removed, so the next run cannot silently install the CPU build
# over a torch it was meant to reuse.
$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PYTHON) scripts/reuse_torch.py $(PY) || { rm -rf $(VENV); exit 1; }

# Each of torch, triton, numpy is installed only when .venv cannot import it already.
$(STAMP_BASE): pyproject.toml Makefile | $(PY)
	@if $(PY) -c "import torch" >/dev/null 2>&1; then echo "torch: using the installed one"; \
	else $(PIP) install "$(TORCH)"; fi
	@if $(PY) -c "import triton" >/dev/null 2>&1; then echo "triton: using the installed one"; \
	else $(PIP) install "$(TRITON)"; fi
	@if $(PY) -c "import numpy" >/dev/null 2>&1; then echo "numpy: using the installed one"; \
	else $(PIP) install numpy; fi
	$(PIP) install --no-deps -e .
	$(PY) -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__)"
	touch $@

$(STAMP_TEST): $(STAMP_BASE) Makefile
	$(PIP) install pytest pytest-xdist ruff matplotlib transformers safetensors expecttest
	touch $@

demo: $(STAMP_BASE)
	$(PY) -m culmen demo

# pytest exits 5 when it collects no test; that is not a failure of the build itself.
test: $(STAMP_TEST)
	$(PY) -m ruff check culmen tests scripts examples
	$(PY) -m pytest -q -n 2 tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; exit 0; fi; exit $$rc

clean-venv:
	rm -rf $(VENV)
