# Set-up and the two everyday commands. Everything installs into .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: sweep test test-slow test-soak test-full install
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

TORCH := torch==2.13.0
# PyTorch's own index of CPU-only wheels; on Linux the default index serves torch's CUDA build.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# Without a GPU, torch comes first, from the CPU wheel index: the torch range in pyproject.toml
	# would otherwise pull the multi-GB CUDA build. Where that index does not answer within 5 s
	# (offline, a proxy, a local mirror), torch comes from pip's configured indexes instead, and the
	# last line says which build arrived. With nvidia-smi present the range picks the CUDA build.
	@if command -v nvidia-smi >/dev/null 2>&1; then \
	  echo "torch: nvidia-smi found, so the CUDA build comes with raymcn's dependencies"; \
	elif $(PY) -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=5)" \
	       "$(TORCH_CPU_INDEX)" 2>/dev/null \
	     && $(PY) -m pip install -q --timeout 15 --index-url "$(TORCH_CPU_INDEX)" "$(TORCH)"; then \
	  echo "torch: $(TORCH) installed from the CPU wheel index $(TORCH_CPU_INDEX)"; \
	else \
	  echo "torch: no $(TORCH) from the CPU wheel index $(TORCH_CPU_INDEX) (not reachable within 5 s, or the install failed);" \
	       "installing it from pip's configured indexes (on a stock Linux machine: the CUDA build)"; \
	  $(PY) -m pip install -q "$(TORCH)"; \
	fi
	$(PY) -m pip install -q -e ".[test]"
	@$(PY) -c "import torch; print('torch', torch.__version__, 'installed:', 'a CUDA build' if torch.version.cuda else 'the CPU build')"
	touch $@
