"""Starting an MQTT broker for a demo or a test: Mosquitto when installed, else amqtt.

Production deployments run their own broker (see ``deploy/mosquitto``); this module exists so
that ``ddnn demo`` and the test suite work on a machine with no services. The broker always
runs as a child process on a loopback port and is stopped with :meth:`BrokerProcess.stop`;
amqtt runs in an environment of its own (:mod:`ddnn.tools.embedded_broker`: it cannot be
installed beside Flower).

amqtt runs with :class:`ddnn.tools.amqtt_plugins.OpenSessions`: its stock anonymous access
keeps no queue for a persistent session, so the edge's restart would lose the messages
published meanwhile (Mosquitto keeps them); ``tests/integration/test_broker_sessions.py``
checks both. Both brokers bound what they queue for an absent persistent client
(:mod:`ddnn.tools.broker_limits`; amqtt through
:class:`ddnn.tools.amqtt_plugins.BoundedBroker`), so one client flooding while the edge is away
cannot grow the broker without bound
(``tests/integration/test_hostile_broker.py::test_an_absent_clients_queue_is_bounded``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ddnn.errors import ConfigError
from ddnn.tools import embedded_broker
from ddnn.tools.broker_limits import MAX_PACKET, MAX_QUEUED_BYTES, MAX_QUEUED_MESSAGES

log = logging.getLogger(__name__)


def mosquitto_config(host: str, port: int, persist: Path | None = None) -> str:
    """The Mosquitto configuration of a test or demo broker on ``host:port``; with ``persist``
    (a directory), sessions, subscriptions and queued messages survive its restarts there, as
    in deploy/mosquitto/*.conf."""
    persistence = (f"persistence true\npersistence_location {persist}/\n" if persist
                   else "persistence false\n")
    return (
        f"listener {port} {host}\nallow_anonymous true\n{persistence}"
        f"max_inflight_messages 1000\nmax_queued_messages {MAX_QUEUED_MESSAGES}\n"
        f"max_queued_bytes {MAX_QUEUED_BYTES}\n"
        # Small messages must not wait for a delayed ACK (Nagle): ~40 ms per feature pull.
        "set_tcp_nodelay true\n"
        f"max_packet_size {MAX_PACKET}\n"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for_port(
    host: str, port: int, timeout: float = 10.0, proc: subprocess.Popen | None = None
) -> None:
    """Block until something accepts TCP connections on (host, port)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ConfigError(
                f"process exited with code {proc.returncode} before listening on {port}"
            )
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)  # polling readiness, not waiting for a guessed duration
    raise ConfigError(f"nothing listens on {host}:{port} after {timeout:.0f} s")


@dataclass
class BrokerProcess:
    """A broker child process listening on ``host:port``."""

    kind: str  # "mosquitto" or "amqtt"
    host: str
    port: int
    proc: subprocess.Popen
    workdir: Path

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def stop(self, timeout: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> BrokerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def mosquitto_path() -> str | None:
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)),
        None,
    )


def start_broker(
    host: str = "127.0.0.1", port: int = 0, prefer: str = "auto", timeout: float = 10.0,
    persist: Path | None = None,
) -> BrokerProcess:
    """Start Mosquitto (or amqtt when Mosquitto is absent or ``prefer="amqtt"``) and wait for it.
    ``persist``: Mosquitto's persistence directory (state kept across restarts). Without the
    broker asked for, a :class:`ConfigError` says how to get one."""
    port = port or free_port(host)
    exe = mosquitto_path()
    if prefer not in ("auto", "mosquitto", "amqtt"):
        raise ConfigError(f"unknown broker kind {prefer!r}")
    if prefer == "mosquitto" and exe is None:
        raise ConfigError("mosquitto is not installed (apt-get install mosquitto)")
    workdir = Path(tempfile.mkdtemp(prefix="ddnn-broker-"))
    if exe is not None and prefer != "amqtt":
        conf = workdir / "mosquitto.conf"
        if persist is not None:
            Path(persist).mkdir(parents=True, exist_ok=True)
        conf.write_text(mosquitto_config(host, port, persist))
        cmd, kind = [exe, "-c", str(conf)], "mosquitto"
    else:  # amqtt, in an environment of its own
        try:
            cmd, kind = embedded_broker.command(host, port), "amqtt"
        except ConfigError:
            shutil.rmtree(workdir, ignore_errors=True)
            raise
    with open(workdir / "broker.log", "wb") as logf:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_port(host, port, timeout, proc)
    except ConfigError as e:
        proc.kill()
        log_text = (workdir / "broker.log").read_text(errors="replace")[-2000:]
        raise ConfigError(f"{kind} broker did not start: {e}\n{log_text}") from None
    log.info("started %s broker on %s:%d", kind, host, port)
    return BrokerProcess(kind, host, port, proc, workdir)


async def _serve_amqtt(host: str, port: int) -> None:
    from ddnn.tools.amqtt_plugins import bounded_broker

    config = {
        "listeners": {"default": {"type": "tcp", "bind": f"{host}:{port}"}},
        "sys_interval": 0,
        # Open access that keeps persistent sessions (amqtt's anonymous plugin would not).
        "plugins": {"ddnn.tools.amqtt_plugins.OpenSessions": {}},
    }
    broker = bounded_broker()(config)
    await broker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await broker.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Run the embedded amqtt broker in the foreground (``python -m ddnn.tools.broker``)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m ddnn.tools.broker", description=main.__doc__)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=1883)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve_amqtt(args.host, args.port))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
