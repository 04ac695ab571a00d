# Set-up and the two everyday commands. Everything installs into .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: sweep test test-slow test-soak test-full test-compat test-top install
sweep: $(VENV)/.installed   ## the main job: a small sweep on the embedded default (local Ray, synthetic data)
	$(PY) sweep.py

# The tiers' marker expressions live in tests/conftest.py (TIERS); docs/development.md says what each runs.
test: $(VENV)/.installed    ## the fast tier: unit, dist, every shipped file's shrink check, a small Ray core
	$(PY) -m pytest -q --tier fast $(PYTEST_ARGS)

test-slow: $(VENV)/.installed    ## what CI runs after the fast tier: rehearsals, multinode, launcher
	$(PY) -m pytest -q --tier slow $(PYTEST_ARGS)

test-soak: $(VENV)/.installed    ## what CI cannot fit (by hand, before a release): the chaos soak, elastic groups, long rehearsals, benchmark smokes
	$(PY) -m pytest -q --tier soak $(PYTEST_ARGS)

test-full: $(VENV)/.installed    ## every test (test + test-slow + test-soak)
	$(PY) -m pytest -q --tier full $(PYTEST_ARGS)

install: $(VENV)/.installed

# torch: the newest release pyproject.toml admits, the one `make test` runs on. TORCH_INDEX: where it
# comes from; auto decides by nvidia-smi (tools/install_torch.py): the CPU build without a GPU, pip's
# default index for a driver that runs CUDA 13, PyTorch's CUDA 12 index for one that runs CUDA 12 only.
TORCH ?= torch==2.13.0
TORCH_INDEX ?= auto
PYTHON ?= python3

# PYTHON is checked against pyproject.toml's range before anything is downloaded (tools/find_python):
# outside it, a python3.X in the range on the PATH is used instead (said), else make stops saying how
# to get one.
$(VENV)/.installed: pyproject.toml
	py=$$(tools/find_python "$(PYTHON)") && $$py -m venv $(VENV)
	# The pip a venv brings can be years old: with a torch installed first, Python 3.10's pip 23.0
	# was seen backtracking through raymcn's dependencies for over 27 minutes (a current pip: 2).
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m tools.install_torch "$(TORCH)" --index "$(TORCH_INDEX)"
	$(PY) -m pip install -q -e ".[test]"
	$(PY) -m tools.install_torch --check
	touch $@

# The compat and top tiers: the fast tier again on the oldest and on the newest Python and torch
# pyproject.toml admits, each in a venv of its own (docs/development.md). COMPAT_PYTHON, TOP_PYTHON:
# the Pythons (default: tools/find_python finds the range's oldest and newest, on the PATH or pyenv's).
TORCH_FLOOR := torch==2.3.1
TORCH_TOP := torch==2.15.0
COMPAT_VENV ?= .venv-compat
COMPAT_PYTHON ?=
TOP_VENV ?= .venv-top
TOP_PYTHON ?=
test-compat:
	py="$(COMPAT_PYTHON)"; [ -n "$$py" ] || py=$$(tools/find_python floor) || exit 1; \
	  $(MAKE) test VENV=$(COMPAT_VENV) TORCH=$(TORCH_FLOOR) TORCH_INDEX=$(TORCH_INDEX) PYTHON="$$py"

test-top:
	py="$(TOP_PYTHON)"; [ -n "$$py" ] || py=$$(tools/find_python newest) || exit 1; \
	  $(MAKE) test VENV=$(TOP_VENV) TORCH=$(TORCH_TOP) TORCH_INDEX=$(TORCH_INDEX) PYTHON="$$py"
