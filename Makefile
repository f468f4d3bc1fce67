# One entry point for a fresh machine: `make demo` runs the whole hierarchy, `make test` the suite
# but its slow tests (`make test-slow`).
# Each target sets up what it needs: the virtual environment, the packages, the MQTT broker.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# torch, pinned. On PyPI an ordinary Linux machine gets the CUDA build (several GB), so by
# default torch comes from PyTorch's CPU index when that answers within a few seconds, and from
# the configured index (PyPI) otherwise: a machine that cannot reach download.pytorch.org, such
# as one with a local CPU wheel, is not stalled. TORCH_INDEX overrides: a URL (GPUs:
# https://download.pytorch.org/whl/cu128), `pypi` for the configured index only (what CI sets:
# its mirror serves the CPU build), or `auto` (the default).
TORCH       ?= torch==2.13.0
TORCH_INDEX ?= auto
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# federate: flwr (Python >= 3.11), so that one install runs every command.
EXTRAS ?= device,edge,cloud,train,federate,dev
# The embedded MQTT broker (amqtt) in an environment of its own: amqtt pins a typer on which
# Flower's `flwr` cannot start. ddnn.tools.embedded_broker finds it beside $(VENV) by this name.
BROKER_VENV := $(VENV)-broker

.PHONY: setup venv system broker demo test test-slow test-arm64 lint bench clean

setup: venv system

venv: $(BIN)/.installed $(BROKER_VENV)/bin/.installed

$(BIN)/.installed: pyproject.toml
	# Debian's python3 lacks ensurepip until python3-venv is installed: add it when we can.
	$(PYTHON) -m venv $(VENV) || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv \
		>/dev/null && rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install -q --upgrade pip
	@index="$(TORCH_INDEX)"; \
	if [ "$$index" = auto ]; then \
		if $(BIN)/python -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/torch/', timeout=5)" \
			2>/dev/null; then index="$(TORCH_CPU_INDEX)"; else index=pypi; fi; fi; \
	if [ "$$index" = pypi ]; then echo "torch: $(TORCH) from the configured index"; \
		$(BIN)/python -m pip install -q "$(TORCH)"; \
	else echo "torch: $(TORCH) from $$index"; \
		$(BIN)/python -m pip install -q "$(TORCH)" --index-url "$$index" \
			--extra-index-url https://pypi.org/simple; fi
	# Editable: the tier folders map into the one `ddnn` package (pyproject's package-dir).
	# amqtt (and its typer pin) lived here before it moved to $(BROKER_VENV).
	$(BIN)/python -m pip uninstall -q -y amqtt 2>/dev/null || true
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

# After $(VENV): python3-venv is there, and the two editable installs never run at once.
$(BROKER_VENV)/bin/.installed: pyproject.toml $(BIN)/.installed
	$(PYTHON) -m venv $(BROKER_VENV)
	$(BROKER_VENV)/bin/python -m pip install -q --upgrade pip
	$(BROKER_VENV)/bin/python -m pip install -q -e ".[broker]"
	touch $@

# Debian packages the tests and the demo use, installed when root and missing:
#   mosquitto   the broker of the integration tests and the demo (the demo falls back to the
#               embedded pure-Python broker, amqtt in $(BROKER_VENV), without it)
#   prometheus  promtool and a real Prometheus for the monitoring tests (deploy/prometheus)
#   chromium, chromium-driver   a real headless browser for the edge's status page test
# Without root the tests that need them are skipped (CI, which is root, fails instead).
SYSTEM_PACKAGES ?= mosquitto:/usr/sbin/mosquitto prometheus:/usr/bin/promtool \
	chromium:/usr/bin/chromium chromium-driver:/usr/bin/chromedriver

system:
	@missing=""; for entry in $(SYSTEM_PACKAGES); do \
		pkg=$${entry%%:*}; exe=$${entry#*:}; [ -x "$$exe" ] || missing="$$missing $$pkg"; done; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing$$missing"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends $$missing >/dev/null) \
		|| echo "warning: could not install$$missing; the tests that need them will be skipped"; \
	else echo "warning:$$missing not installed and I am not root; the tests that need them will be skipped"; fi

# (the old name of `system`)
broker: system

# The whole hierarchy on this machine, proving itself: exit status 1 when an answer is wrong.
demo: setup
	$(BIN)/ddnn demo

# import-linter and mypy read packages from disk, so they check the package as pip installs it:
# the tier folders inside `ddnn`, as on a board. mypy checks the edge's types ([tool.mypy]).
lint: venv
	$(BIN)/ruff check .
	rm -rf build/lint && $(BIN)/python -m pip install -q --no-deps --target build/lint .
	cd build/lint && ../../$(BIN)/lint-imports --config ../../pyproject.toml
	cd build/lint && ../../$(BIN)/mypy --config-file ../../pyproject.toml -p ddnn.edge

# The suite: every test but those marked `slow` (pyproject.toml: each over about 15 s here,
# real Flower federations, the closed loop, the demo, fresh virtual environments, the end-to-end
# fault and OTA runs). `make test-slow` runs those; CI (.ci/run) runs both.
test: setup lint
	$(BIN)/python -m pytest -m "not slow"

test-slow: setup
	$(BIN)/python -m pytest -m slow

# The device agent on the boards' architecture (aarch64), in an arm64 Debian userland run
# through qemu-user: the device's tests and a live replay against this machine's broker and edge.
# Needs root; made once and cached in $(DDNN_ARM64_CACHE) (default /var/cache/ddnn-arm64);
# skips with the reason where it cannot run. See tests/support/arm64.py and docs/raspberry-pi.md.
test-arm64: setup
	$(BIN)/python -m tests.support.arm64

bench: setup
	$(BIN)/ddnn bench

clean:
	rm -rf $(VENV) $(BROKER_VENV) runs build .pytest_cache .ruff_cache
