"""Where the embedded MQTT broker (amqtt, when Mosquitto is absent) runs: an environment of its
own.

amqtt 0.11 pins typer 0.15.4, on which Flower's ``flwr`` command cannot start (its options need
typer >= 0.19), and no amqtt release installs beside Flower 1.42. So amqtt is never installed in
ddnn's environment: ``make setup`` makes ``.venv-broker`` beside ``.venv`` (``pip install -e
'.[broker]'``), and :func:`ddnn.tools.broker.start_broker` runs ``python -m ddnn.tools.broker``
with that environment's interpreter. Elsewhere, install ``ddnn[broker]`` in an environment of
its own and name its interpreter in ``DDNN_BROKER_PYTHON``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from ddnn.errors import ConfigError

ENV_VAR = "DDNN_BROKER_PYTHON"
SUFFIX = "-broker"  # the environment beside this one: .venv -> .venv-broker (the Makefile's)
HOW = ("install Mosquitto (apt-get install mosquitto; `make setup` does as root) or the "
       "embedded broker's environment (`make setup` makes .venv-broker; elsewhere `pip install "
       f"'ddnn[broker]'` in a virtual environment of its own and set {ENV_VAR} to its python)")


def beside() -> Path:
    """The interpreter of the broker's environment beside this one (``.venv-broker/bin/python``
    for ``.venv``)."""
    prefix = Path(sys.prefix)
    return prefix.with_name(prefix.name + SUFFIX) / "bin" / "python"


def embedded_broker_python() -> str | None:
    """The interpreter that runs the embedded broker: ``$DDNN_BROKER_PYTHON``, else the
    environment beside this one, else this one where amqtt is installed; None without any."""
    named = os.environ.get(ENV_VAR)
    if named:
        if not os.access(named, os.X_OK):
            raise ConfigError(f"{ENV_VAR}={named}: not an executable interpreter")
        return named
    python = beside()
    if os.access(python, os.X_OK):
        return str(python)
    if importlib.util.find_spec("amqtt") is not None:
        return sys.executable
    return None


def command(host: str, port: int) -> list[str]:
    """The embedded broker's command line, listening on ``host:port``."""
    python = embedded_broker_python()
    if python is None:
        raise ConfigError(f"no MQTT broker to start: {HOW}")
    return [python, "-m", "ddnn.tools.broker", "--host", host, "--port", str(port)]
