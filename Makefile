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

$(VENV)/.installed-dev: requirements.txt requirements-dev.txt $(VENV)/.installed
	$(BIN)/pip install -q -r requirements-dev.txt
	touch $@

# The demo: SQLite + Celery's file broker under var/ unless DATABASE_URL / REDIS_URL are set.
demo: $(VENV)/.installed
	@mkdir -p var
	DEBUG=1 $(BIN)/python manage.py migrate --noinput -v 0
	DEBUG=1 $(BIN)/python manage.py demo_setup
	DEBUG=1 LOG_LEVEL=$${LOG_LEVEL:-WARNING} DOVECOTE_REPLY_DEBOUNCE_SECONDS=$${DOVECOTE_REPLY_DEBOUNCE_SECONDS:-2} \
	  TELEGRAM_API_BASE_URL=$${TELEGRAM_API_BASE_URL:-http://127.0.0.1:8081} \
	  DOVECOTE_CRM_WEBHOOK_URL=$${DOVECOTE_CRM_WEBHOOK_URL:-http://127.0.0.1:9/crm-is-down} \
	  PATH=$(CURDIR)/$(BIN):$$PATH $(BIN)/honcho start -f Procfile.demo

services:
	bash scripts/services.sh

# The whole suite against the real PostgreSQL and Redis on 127.0.0.1.
test: $(VENV)/.installed-dev services
	$(BIN)/python -m pytest $(PYTEST_ARGS)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/mypy

# The lock files: every transitive dependency pinned with its hashes (pip-tools, in a venv of
# its own so that it never changes .venv). Run after editing requirements*.txt.
lock:
	$(PYTHON) -m venv var/pip-tools && var/pip-tools/bin/pip install -q pip-tools==7.7.0
	var/pip-tools/bin/pip-compile -q --generate-hashes --allow-unsafe --strip-extras --no-header \
	  --no-emit-index-url --no-emit-find-links \
	  -o requirements.lock requirements.txt
	var/pip-tools/bin/pip-compile -q --generate-hashes --allow-unsafe --strip-extras --no-header \
	  --no-emit-index-url --no-emit-find-links \
	  -o requirements-dev.lock requirements.txt requirements-dev.txt

clean:
	rm -rf var/ staticfiles/ .pytest_cache
