# The two commands of README.md, `make demo` and `make test`; `make lint` (ruff, mypy) runs in CI too.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# torch first: on the project's machines its CPU wheel is local and a bare `torch`
# would pull gigabytes of CUDA packages. Override with TORCH_SPEC=torch elsewhere.
TORCH_SPEC ?= torch==2.13.0
# One pytest worker per core (pytest-xdist; every test runs torch on one thread), a test file per
# worker so module fixtures are built once. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 1)

.PHONY: demo test lint venv clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

venv: $(VENV)/.installed

demo: venv
	HF_HUB_OFFLINE=1 $(VENV)/bin/headlab demo

test: venv
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -rs -n $(TEST_WORKERS) --dist loadfile

lint: venv
	$(VENV)/bin/ruff check src tests benchmarks examples reproduction experiments
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) build src/*.egg-info
