# Every target creates (once) and uses the virtual environment in $(VENV).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP_LIB := $(VENV)/.installed-lib
STAMP_TEST := $(VENV)/.installed-test
PYTEST_ARGS ?=

.PHONY: install install-test test demo bench clean tpu-check tunix-env

$(PY):
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip

# The project itself is installed editable and without dependencies: requirements.txt pins them.
$(STAMP_LIB): requirements.txt pyproject.toml | $(PY)
	$(PIP) install -q -r requirements.txt
	$(PIP) install -q --no-deps -e .
	touch $@

$(STAMP_TEST): requirements-test.txt requirements-tpu.txt $(STAMP_LIB)
	$(PIP) install -q -r requirements-test.txt -r requirements-tpu.txt
	touch $@

install: $(STAMP_LIB)
install-test: $(STAMP_TEST)

test: $(STAMP_TEST)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder -q -rs --durations=30 $(PYTEST_ARGS) tests

# Compile every preset/slice pair of docs/tpu.md's matrix for TPU on this machine (libtpu).
tpu-check: $(STAMP_TEST)
	$(PY) launch/compile_matrix.py

# The CPU quickstart: JAX_PLATFORMS=cpu keeps libtpu (installed by `make test`) from probing
# for TPU metadata this machine does not have.
demo: $(STAMP_LIB)
	JAX_PLATFORMS=cpu $(PY) experiments/quickstart.py

# Tunix (the JAX peer in the benchmarks) lives in its own venv, .venv-tunix; `make bench`
# runs it when that venv exists and reports it as skipped otherwise.
tunix-env:
	bash benchmarks/tunix_env.sh

bench: $(STAMP_TEST)
	$(PY) benchmarks/run_all.py

clean:
	rm -rf runs/ .pytest_cache
