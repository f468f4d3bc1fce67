"""The embedded broker runs in its own environment (amqtt cannot sit beside Flower); without it
and without Mosquitto, starting a broker says how to get one."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from ddnn.errors import ConfigError
from ddnn.tools import broker, embedded_broker


@pytest.fixture
def bare(monkeypatch, tmp_path):
    """No Mosquitto, no amqtt here, no environment beside this one, nothing named."""
    monkeypatch.delenv(embedded_broker.ENV_VAR, raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / ".venv"))
    monkeypatch.setattr(broker, "mosquitto_path", lambda: None)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "amqtt" else real(name, *a))
    return tmp_path


def test_without_any_broker_the_error_says_how_to_get_one(bare):
    assert embedded_broker.embedded_broker_python() is None
    for prefer in ("auto", "amqtt"):
        with pytest.raises(ConfigError, match=r"apt-get install mosquitto.*\.venv-broker"):
            broker.start_broker(prefer=prefer)


def test_the_environment_beside_this_one_runs_the_broker(bare):
    python = bare / ".venv-broker" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text("#!/bin/sh\n")
    python.chmod(0o755)
    assert embedded_broker.command("127.0.0.1", 1884) == [
        str(python), "-m", "ddnn.tools.broker", "--host", "127.0.0.1", "--port", "1884"]


def test_a_named_interpreter_comes_first_and_must_exist(bare, monkeypatch):
    monkeypatch.setenv(embedded_broker.ENV_VAR, sys.executable)
    assert embedded_broker.embedded_broker_python() == sys.executable
    monkeypatch.setenv(embedded_broker.ENV_VAR, str(bare / "no-python"))
    with pytest.raises(ConfigError, match="not an executable"):
        embedded_broker.embedded_broker_python()
