# hutch — two commands on a fresh Debian 12 machine, as root: `make up`, `make test`.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STATE_DIR ?= $(CURDIR)/var
LISTEN ?= 127.0.0.1:7070
PYTEST_ARGS ?=

# System packages hutch needs on the host (installed with apt, nothing by hand).
APT_PACKAGES := qemu-system-x86 qemu-utils mmdebstrap nftables busybox-static lz4 \
	e2fsprogs bubblewrap iproute2 cpio kmod xz-utils zstd python3-venv python3-pip \
	ca-certificates procps libpq5
# libpq5: the PostgreSQL client library psycopg uses (HUTCH_DATABASE_URL); Debian's, so it
# gets the distribution's security updates (no wheel with a libpq copy of its own).

.PHONY: cluster-up cluster-down
.PHONY: help deps system-deps test-system-deps apt-install js-deps ui-vendor venv qemu-user image images up down restart check lint typecheck test test-postgres \
	test-lane-a test-lane-b test-serial test-fast openapi unasync bench clean

help:
	@echo "make up      install deps, build the base image, start hutchd on $(LISTEN)"
	@echo "make down    stop hutchd (sandboxes keep running; a restart adopts them)"
	@echo "make cluster-up [WORKERS=3] [IMAGES_DIR=DIR]  N hutchd workers on this machine, one database"
	@echo "make cluster-down            stop them"
	@echo "make test    install deps and run lint, types and the whole test suite (two lanes)"
	@echo "make test-serial  the same in one lane (or make test LANES=1)"
	@echo "make check   lint, types and the fast test tiers"
	@echo "make test-postgres  the component and e2e tiers with the state in PostgreSQL"
	@echo "make bench   run the benchmark harness (results in bench/results/)"

# Installed by `make test` only: what the test tiers use on the host.
#   python3-matplotlib: the component tier runs the code-interpreter kernel with the host's
#   system Python (tests/component/test_contexts.py::test_matplotlib_png).
#   chromium: the console tests (tests/e2e/test_console.py) drive Debian's Chromium
#   with Playwright (the suite installs it too when missing: tests/browser.py).
#   postgresql: the suite's own PostgreSQL server (tests/pgserver.py: the store tests on
#   both databases, and the component and e2e tiers run a second time on it).
#   docker-registry: the OCI registry the image import tests push to
#   (tests/registry_server.py). The suite installs each of these when missing, but
#   installed here, before the lanes start, two lanes never run apt-get at once.
TEST_APT_PACKAGES := python3-matplotlib chromium postgresql docker-registry

# The E2B JS SDK smoke test (tests/e2e/test_e2b.py::test_e2b_js_sdk_smoke) runs Node's
# test runner in tests/e2b_js. Node.js >= 20.18.1 (the SDK's engines) comes with the
# machine; where there is no node, Debian's nodejs and npm are installed. The packages
# come from the committed lock with `npm ci` (npm registry; its cache when offline).
JS_DIR := tests/e2b_js

system-deps:
	@$(MAKE) --no-print-directory apt-install PACKAGES="$(APT_PACKAGES)"

test-system-deps:
	@$(MAKE) --no-print-directory apt-install PACKAGES="$(TEST_APT_PACKAGES)"

apt-install:
	@missing=$$(for p in $(PACKAGES); do \
		dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q 'install ok installed' || echo $$p; \
	done); \
	if [ -n "$$missing" ]; then \
		echo "installing system packages:" $$missing; \
		apt-get update -q; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi

js-deps: $(JS_DIR)/node_modules/.hutch-installed

$(JS_DIR)/node_modules/.hutch-installed: $(JS_DIR)/package.json $(JS_DIR)/package-lock.json
	@if ! command -v node >/dev/null || ! command -v npm >/dev/null; then \
		$(MAKE) --no-print-directory apt-install PACKAGES="nodejs npm"; fi
	cd $(JS_DIR) && npm ci --no-audit --no-fund --prefer-offline
	@touch $@

# The web console's npm packages (xterm.js, its fit addon) from the committed lock,
# copied into src/hutch/ui/static/vendor with a manifest of their hashes. The copies are
# committed: the daemon serves them and never needs npm. Run after changing ui/package.json.
UI_DIR := ui
ui-vendor: venv
	@if ! command -v node >/dev/null || ! command -v npm >/dev/null; then \
		$(MAKE) --no-print-directory apt-install PACKAGES="nodejs npm"; fi
	cd $(UI_DIR) && npm ci --no-audit --no-fund --prefer-offline
	$(BIN)/python scripts/ui_vendor.py

$(BIN)/.installed: pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements.lock
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e .
	@touch $@

venv: $(BIN)/.installed

# QEMU drops to this user once set up (hutchd runs as root for networking).
QEMU_USER ?= hutch-qemu
qemu-user:
	@id -u $(QEMU_USER) >/dev/null 2>&1 || { \
		echo "creating the unprivileged QEMU user $(QEMU_USER)"; \
		useradd --system --no-create-home --home-dir /nonexistent \
			--shell /usr/sbin/nologin $(QEMU_USER); }

deps: system-deps venv qemu-user

image: deps
	HUTCH_STATE_DIR=$(STATE_DIR) $(BIN)/hutch image build base

# Every image the test suite boots; cached by content hash, so a no-op when built.
images: deps
	@ls /var/lib/apt/lists/*_Packages >/dev/null 2>&1 || apt-get update -q
	HUTCH_STATE_DIR=$(STATE_DIR) $(BIN)/hutch image build base
	HUTCH_STATE_DIR=$(STATE_DIR) $(BIN)/hutch image build devbox

up: image
	@mkdir -p $(STATE_DIR)/logs
	@if [ -f $(STATE_DIR)/hutchd.pid ] && kill -0 $$(cat $(STATE_DIR)/hutchd.pid) 2>/dev/null; then \
		echo "hutchd already running (pid $$(cat $(STATE_DIR)/hutchd.pid))"; \
	else \
		HUTCH_STATE_DIR=$(STATE_DIR) HUTCH_LISTEN=$(LISTEN) setsid nohup $(BIN)/hutch daemon \
			>>$(STATE_DIR)/logs/hutchd.out 2>&1 </dev/null & echo $$! > $(STATE_DIR)/hutchd.pid; \
	fi
	@for i in $$(seq 1 100); do \
		if curl -fsS http://$(LISTEN)/healthz >/dev/null 2>&1; then \
			echo "hutchd is up on http://$(LISTEN) (state: $(STATE_DIR), logs: $(STATE_DIR)/logs)"; \
			exit 0; \
		fi; \
		kill -0 $$(cat $(STATE_DIR)/hutchd.pid) 2>/dev/null || { tail -20 $(STATE_DIR)/logs/hutchd.out; exit 1; }; \
		sleep 0.2; \
	done; echo "hutchd did not answer on $(LISTEN)"; tail -20 $(STATE_DIR)/logs/hutchd.out; exit 1

down:
	@if [ -f $(STATE_DIR)/hutchd.pid ] && kill -0 $$(cat $(STATE_DIR)/hutchd.pid) 2>/dev/null; then \
		pid=$$(cat $(STATE_DIR)/hutchd.pid); kill $$pid; \
		for i in $$(seq 1 50); do kill -0 $$pid 2>/dev/null || break; sleep 0.2; done; \
		echo "hutchd stopped"; \
	else echo "hutchd is not running"; fi
	@rm -f $(STATE_DIR)/hutchd.pid

restart: down up

# N workers on this machine sharing one database (scripts/cluster.py; README "A cluster
# on one machine"): each its own state dir under var/cluster, port 7071.., address pool.
WORKERS ?= 3
CLUSTER_DB ?= postgres
# Private networks across the workers: worker i's VXLAN end on UDP TUNNEL_PORT+i-1 (0: off).
TUNNEL_PORT ?= 14789
# The workers' images: the state dir's, built first (`make image`); IMAGES_DIR=DIR: ones
# built elsewhere (e.g. another checkout's var/images), used as they are, nothing built.
IMAGES_DIR ?=
cluster-up: $(if $(IMAGES_DIR),deps,image)
	@if [ "$(CLUSTER_DB)" = postgres ]; then $(MAKE) --no-print-directory apt-install PACKAGES=postgresql; fi
	$(BIN)/python scripts/cluster.py up --workers $(WORKERS) --root $(STATE_DIR)/cluster \
		--images $(or $(IMAGES_DIR),$(STATE_DIR)/images) --db $(CLUSTER_DB) \
		--tunnel-port $(TUNNEL_PORT)

cluster-down:
	$(BIN)/python scripts/cluster.py down --root $(STATE_DIR)/cluster

lint: venv
	$(BIN)/ruff check src tests bench guest_agent scripts
	$(BIN)/ruff format --check src tests bench guest_agent scripts
	$(BIN)/python scripts/unasync.py --check

typecheck: venv
	$(BIN)/mypy
	MYPYPATH=guest_agent $(BIN)/mypy --strict -p hutch_agent
	# The tests, the benchmarks and the scripts are code too (a test calling a service
	# with the wrong argument passed review and failed only in CI).
	MYPYPATH=src:guest_agent $(BIN)/mypy tests bench scripts

check: deps lint typecheck
	$(BIN)/pytest tests/unit tests/component $(PYTEST_ARGS)

# `make test` runs the suite in two lanes side by side (scripts/lanes.sh): CI's clean-clone
# run has 50 minutes on 2 cores, the serial run took 49-52 of them, yet on average less
# than one core was busy (TCG guests wait on their agent, daemons sleep, tests poll). Each
# lane is its own pytest process; the suite's shared resources (ports, address pools,
# netns, nft tables, /run/hutch dirs) are per process or leased (tests/leases.py), so the
# two never collide. Lane a (streamed): the image builds, then the VM and privileged tiers
# and the e2e files of LANE_A_E2E. Lane b (var/lanes/b.log, printed at the end): lint and
# types beside the image builds, the tiers that need no guest image (unit, component),
# then the rest of the e2e tier and the PostgreSQL pass. `make test LANES=1` (or `make
# test-serial`) runs it all in one pytest process, one tier after the other.
LANES ?= 2
LANE_PYTEST := HUTCH_TEST_IMAGES_DIR=$(STATE_DIR)/images $(BIN)/pytest -p no:cacheprovider
# The e2e files lane a runs after its VM tier, to even the lanes out (seconds each in the
# serial run of /tmp/ci2.log, 2026-12-02: vm 1156 + privileged 82 + image builds ~120 in
# lane a against lint/types ~90 + unit 24 + component 301 + e2e 780 + PostgreSQL pass 347
# in lane b). The clean-clone run of 2026-12-06 (88103a3) ended lane a at 37m01s and lane
# b at 46m05s (unit+component 693 s, e2e 1493 s, PostgreSQL pass 515 s): template_sharing
# (80 s), builtin_images_cluster (69 s) and roles (106 s) moved to lane a. The clean-clone
# run of 2026-12-07 (8c06f38) ended lane a at 37m41s and lane b at 43m34s, before the
# PostgreSQL pass left out the db_target tests (11m47s -> 8m01s): cli (41 s) and mcp
# (41 s) moved to lane a.
# Every other e2e file, a new one too, runs in lane b.
LANE_A_E2E := crash_lifecycle metering two_daemons template_sharing builtin_images_cluster \
	roles cli mcp
LANE_A_E2E_FILES := $(addprefix tests/e2e/test_,$(addsuffix .py,$(LANE_A_E2E)))

ifeq ($(LANES),1)
test: test-serial
else
test: deps test-system-deps js-deps
	scripts/lanes.sh $(STATE_DIR)/lanes \
		a="$(MAKE) --no-print-directory test-lane-a" b="$(MAKE) --no-print-directory test-lane-b"
endif

test-lane-a: images
	$(LANE_PYTEST) tests/vm tests/privileged $(LANE_A_E2E_FILES) --durations=40 $(PYTEST_ARGS)

# Lane b's three pytest runs all run (a failure is remembered, the lane fails at the end).
LANE_B_FAILED := $(STATE_DIR)/lanes/b.failed
test-lane-b: lint typecheck
	@mkdir -p $(dir $(LANE_B_FAILED)) && rm -f $(LANE_B_FAILED)
	$(LANE_PYTEST) tests/unit tests/component --durations=20 $(PYTEST_ARGS) || touch $(LANE_B_FAILED)
	@# Waits for lane a's image builds (they serialize on var/images/<name>.lock), then a no-op.
	$(MAKE) --no-print-directory images
	$(LANE_PYTEST) tests/e2e $(addprefix --ignore=,$(LANE_A_E2E_FILES)) --durations=20 \
		$(PYTEST_ARGS) || touch $(LANE_B_FAILED)
	HUTCH_TEST_DATABASE=postgres $(LANE_PYTEST) tests/component $(PG_E2E) --durations=10 \
		$(PYTEST_ARGS) || touch $(LANE_B_FAILED)
	@if [ -e $(LANE_B_FAILED) ]; then echo "lane b: a pytest run failed (see above)"; exit 1; fi

test-serial: deps test-system-deps js-deps lint typecheck images
	HUTCH_TEST_IMAGES_DIR=$(STATE_DIR)/images $(BIN)/pytest tests --durations=40 $(PYTEST_ARGS)
	# The API suite again with the state in PostgreSQL (tests/pgserver.py): the component
	# tier and the e2e files of PG_E2E.
	HUTCH_TEST_DATABASE=postgres HUTCH_TEST_IMAGES_DIR=$(STATE_DIR)/images \
		$(BIN)/pytest tests/component $(PG_E2E) --durations=10 $(PYTEST_ARGS)

# The e2e files `make test` runs a second time on PostgreSQL: the API through the SDK and
# a SIGKILLed daemon restarted on its database (~1.5 min here). The rest of the tier
# (crash_lifecycle, metering, two_daemons, timeout: ~3 min; crash_points ~6 min; e2b,
# inflight_auth, mcp, cli, ...: ~12 min on this 2-core machine) runs on SQLite only there:
# the whole CI run measured 50m22s with four more files, past its 50-minute budget.
# `make test-postgres` runs the whole component and e2e tiers on PostgreSQL.
PG_E2E := $(addprefix tests/e2e/test_,$(addsuffix .py,sdk crash))

test-postgres: deps test-system-deps js-deps images
	HUTCH_TEST_DATABASE=postgres HUTCH_TEST_IMAGES_DIR=$(STATE_DIR)/images \
		$(BIN)/pytest tests/component tests/e2e --durations=10 $(PYTEST_ARGS)

openapi: venv
	$(BIN)/python -m hutch.api.openapi > openapi.json

# The SDK's blocking shells (src/hutch/sdk/_sync/) are generated from its asyncio ones.
unasync: venv
	$(BIN)/python scripts/unasync.py

bench: deps
	HUTCH_STATE_DIR=$(STATE_DIR) $(BIN)/python -m bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
