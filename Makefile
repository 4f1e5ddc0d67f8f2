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

clean:
	rm -rf var/ staticfiles/ .pytest_cache
