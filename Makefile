# The two commands a new user runs: `make up` and `make test`.
# Both bootstrap .venv first (idempotent; see scripts/bootstrap.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: up test bootstrap lint proto clean

bootstrap:
	@VENV=$(VENV) bash scripts/bootstrap.sh

up: bootstrap
	$(VENV)/bin/hybridpd up

test: bootstrap
	$(PY) -m pytest $(PYTEST_ARGS)

lint: bootstrap
	$(VENV)/bin/ruff check hybridpd services tests bench
	$(VENV)/bin/mypy

proto: bootstrap
	$(PY) -m hybridpd.protogen

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
