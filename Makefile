# culmen developer entry points. Both targets work on a fresh machine with python3 (3.10+) and PyPI:
# they create .venv, install pinned deps once (stamp files in .venv), then run.
#   make demo   train a tiny model with culmen's kernels (CPU: < 1 min)
#   make test   ruff + the CPU test suite (2 xdist workers); matplotlib for the bench --plot test

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch is pinned to the CPU build that lies on local disk (pip's find-links); no other install may
# resolve torch again, hence --no-deps for culmen itself. triton 3.9's interpreter runs the Triton
# kernels on CPU (3.6's breaks on range loops with numpy 2).
TORCH  := torch==2.13.0
TRITON := triton==3.9.0
STAMP_BASE := $(VENV)/.culmen-base.stamp
STAMP_TEST := $(VENV)/.culmen-test.stamp

.PHONY: demo test venv clean-venv

venv: $(STAMP_BASE)

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP_BASE): pyproject.toml Makefile | $(PY)
	$(PIP) install "$(TORCH)" "$(TRITON)" numpy
	$(PIP) install --no-deps -e .
	$(PY) -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, '| triton', triton.__version__)"
	touch $@

$(STAMP_TEST): $(STAMP_BASE) Makefile
	$(PIP) install pytest pytest-xdist ruff matplotlib
	touch $@

demo: $(STAMP_BASE)
	$(PY) -m culmen demo

# pytest exits 5 when it collects no test; that is not a failure of the build itself.
test: $(STAMP_TEST)
	$(PY) -m ruff check culmen tests
	$(PY) -m pytest -q -n 2 tests; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest: no tests collected"; exit 0; fi; exit $$rc

clean-venv:
	rm -rf $(VENV)
