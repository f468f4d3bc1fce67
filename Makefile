# One entry point for a fresh machine: `make demo` runs the whole hierarchy, `make test` the suite.
# Each target sets up what it needs: the virtual environment, the packages, the MQTT broker.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch, pinned: an unpinned torch pulls several GB of CUDA packages.
TORCH  ?= torch==2.13.0
EXTRAS ?= device,edge,cloud,train,demo,federate,dev

.PHONY: setup venv broker demo test lint bench clean

setup: venv broker

venv: $(BIN)/.installed

$(BIN)/.installed: pyproject.toml
	# Debian's python3 lacks ensurepip until python3-venv is installed: add it when we can.
	$(PYTHON) -m venv $(VENV) || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv \
		>/dev/null && rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	# Editable: the tier folders map into the one `ddnn` package (pyproject's package-dir).
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

# Mosquitto for the integration tests and the demo; the demo falls back to the embedded
# pure-Python broker (amqtt) when Mosquitto cannot be installed.
broker:
	@if command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing mosquitto"; \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mosquitto >/dev/null) \
		|| echo "warning: could not install mosquitto; broker tests will be skipped"; \
	else echo "warning: mosquitto is not installed and I am not root; broker tests will be skipped"; fi

demo: setup
	$(BIN)/ddnn demo

# import-linter reads packages from disk, so it checks the package as pip installs it: the
# tier folders inside `ddnn`, as on a board.
lint: venv
	$(BIN)/ruff check .
	rm -rf build/lint && $(BIN)/python -m pip install -q --no-deps --target build/lint .
	cd build/lint && ../../$(BIN)/lint-imports --config ../../pyproject.toml

test: setup lint
	$(BIN)/python -m pytest

bench: setup
	$(BIN)/ddnn bench

clean:
	rm -rf $(VENV) runs build .pytest_cache .ruff_cache
