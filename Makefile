# `make test` sets up a fresh CPU machine (its own virtualenv) and runs the test suite.
# `make gpu-test` runs the GPU tests in the current environment (see docs/gpu-tests.md).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
SGLANG_VERSION ?= 0.5.10.post1
TMS_VERSION ?= 0.0.10
# other SGLang releases whose source the version checks read (tests/test_sglang_versions.py)
SGLANG_CHECKED ?= 0.5.12 0.5.23

.PHONY: test gpu-test setup clean

test: $(VENV)/.ready
	$(PY) -m pytest -q

setup: $(VENV)/.ready

$(VENV)/.ready: pyproject.toml requirements/cpu-test.txt Makefile tests/sglang_sources.py
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0 || $(PIP) torch
	$(PIP) --no-deps sglang==$(SGLANG_VERSION) torch-memory-saver==$(TMS_VERSION)
	$(PIP) -r requirements/cpu-test.txt
	$(PIP) --no-deps -e .
	$(PY) tests/sglang_sources.py $(VENV)/sglang-src $(SGLANG_CHECKED)
	touch $@

gpu-test:
	python3 -m pytest -q -m gpu -s

clean:
	rm -rf $(VENV) build *.egg-info
