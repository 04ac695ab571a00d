# Set-up and the two everyday commands. Everything installs into .venv on first use.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: sweep test install
sweep: $(VENV)/.installed   ## the main job: a small sweep on the embedded default (local Ray, synthetic data)
	$(PY) sweep.py

test: $(VENV)/.installed    ## the test suite
	$(PY) -m pytest -q

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# Without a GPU, install the CPU build of torch first: the torch range in pyproject.toml would
	# otherwise pull a multi-GB CUDA build. With nvidia-smi present the range picks the CUDA build.
	command -v nvidia-smi >/dev/null 2>&1 || $(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test]"
	touch $@
