# Two commands on a fresh machine:  make demo  (build the env, run the demo)  ·  make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SHARED ?= ../shared
# The venv is rebuilt only when the dependency declaration changes.
STAMP := $(VENV)/.deps-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-12)
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: env demo test bench clean

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,ocr]'
	@rm -f $(VENV)/.deps-* && touch $@

env: $(STAMP)

demo: env
	$(VENV)/bin/vlcurate demo --out runs/demo

test: env
	$(PY) -m pytest tests -q

bench: env
	$(PY) tests/benchmarks/bench_ingest_export.py

clean:
	rm -rf runs .pytest_cache
