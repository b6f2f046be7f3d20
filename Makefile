# The two commands: `make up` and `make test`. Everything else is `tokenmill ...` (see README).
UV_HOME := .local/uv
UV := $(UV_HOME)/bin/uv
PY := .venv/bin/python
TOKENMILL := .venv/bin/tokenmill

.PHONY: up down test install status clean

$(UV):
	python3 -m venv $(UV_HOME)
	$(UV_HOME)/bin/pip install --quiet uv==0.13.8

.venv/.installed: $(UV) pyproject.toml uv.lock
	$(UV) sync --locked
	touch $@

install: .venv/.installed

up: install
	$(TOKENMILL) up

down:
	@if [ -x $(TOKENMILL) ]; then $(TOKENMILL) down; fi

status: install
	$(TOKENMILL) status

# pytest starts its own broker on free ports (tests/conftest.py), so `make up` may keep running meanwhile.
test: install
	.venv/bin/lint-imports --no-cache
	$(PY) -m infra.fetch_jars
	$(PY) -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)

clean: down
	rm -rf .local .venv
