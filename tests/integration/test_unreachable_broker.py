"""A broker that cannot be reached is said so, and a device still stops when told.

Against a port where nothing listens (each attempt refused) and a listener that accepts TCP and
never answers CONNECT (a hung broker), with real ``ddnn device`` processes and a real edge
service: every failed attempt is counted and its reason is in the log (throttled) and in
``/healthz``; the wait for the CONNACK is bounded, then tried again with backoff; SIGTERM ends a
device whatever it waits on (its peers, the CONNACK, the drain of its outbox).
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

from ddnn.edge.service import EdgeService
from ddnn.edge.settings import EdgeSettings
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.tools.broker import free_port
from tests.support.polling import wait_for
from tests.support.processes import ddnn_process, stop_process

HUNG = "did not answer CONNECT within 0.5 s"


class SilentBroker:
    """Accepts TCP connections, takes what they send and never answers (a hung broker)."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"mqtt://127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return  # closed
            self._conns.append(conn)
            self.accepted += 1

    def close(self) -> None:
        self.sock.close()
        for c in self._conns:
            c.close()


def health(url: str) -> dict:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=5) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def reason_with(url: str, text: str):
    return lambda: any(text in r for r in health(url)["reasons"])


def device(tmp_path: Path, bundle: Path, data: Path, broker: str, *extra: str):
    port = free_port()
    log = tmp_path / "device.log"
    proc = ddnn_process(["device", "--bundle", str(bundle), "--broker", broker, "--view", "0",
                         "--data", str(data), "--http-port", str(port), "--health-grace", "0",
                         "--reconnect-max", "1", "--spool", str(tmp_path / "spool"), *extra],
                        log)
    return proc, f"http://127.0.0.1:{port}", log


def test_a_refused_connection_is_said_and_sigterm_ends_the_wait_for_peers(tiny_bundle,
                                                                       tiny_data, tmp_path):
    closed = f"mqtt://127.0.0.1:{free_port()}"  # nothing listens there
    proc, url, log = device(tmp_path, tiny_bundle, tiny_data.test, closed, "--wait-peers",
                            "3600")
    try:
        wait_for(lambda: "waiting up to 3600 s for the edge" in log.read_text(), 60,
                 "the wait for peers", [proc])
        wait_for(lambda: "cannot connect to broker" in log.read_text(), 30, "a logged failure",
                 [proc])
        wait_for(reason_with(url, "Connection refused"), 30, "the reason in /healthz", [proc])
        uplink = health(url)["uplink"]
        assert uplink["connected"] is False and uplink["failed_attempts"] >= 1
        assert "Connection refused" in uplink["last_error"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0  # an hour of --wait-peers is not waited out
    finally:
        stop_process(proc)
    text = log.read_text()
    assert "not every peer came online" not in text
    assert "device cam0 done: 0 frames" in text


def test_a_broker_that_never_answers_connect_is_given_up_on_and_retried(tiny_bundle,
                                                                        tiny_data, tmp_path):
    silent = SilentBroker()
    proc, url, log = device(tmp_path, tiny_bundle, tiny_data.test, silent.url,
                            "--connect-timeout", "0.5", "--wait-peers", "0", "--fps", "0",
                            "--drain-timeout", "3600")
    try:
        wait_for(lambda: HUNG in log.read_text(), 60, "the CONNECT wait given up", [proc])
        wait_for(lambda: silent.accepted >= 2, 30, "a second attempt (backoff)", [proc])
        wait_for(reason_with(url, HUNG), 30, "the reason in /healthz", [proc])
        # Every frame replayed, none delivered: the device drains its outbox for up to an hour.
        wait_for(lambda: "replayed 120 frames" in log.read_text(), 60, "the replay", [proc])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        stop_process(proc)
        silent.close()
    # Throttled: the first failure and then one line at each doubling of the count.
    lines = [ln for ln in log.read_text().splitlines() if HUNG in ln]
    assert "(1 failed attempt so far)" in lines[0]
    assert len(lines) <= 1 + max(silent.accepted, 1).bit_length()


def test_every_mqtt_client_bounds_the_connect_wait_the_edge_says_why(tiny_bundle):
    """The edge (and the gateway: the same client) gives a hung broker up too, and says why."""
    silent = SilentBroker()
    settings = EdgeSettings(bundle=tiny_bundle, broker=silent.url, http_port=0,
                            health_grace=0, connect_timeout=0.5, reconnect_max=1)
    try:
        with EdgeService.from_settings(settings) as edge:
            wait_for(lambda: edge.mqtt.attempts.failures >= 2, 30, "two attempts given up")
            wait_for(reason_with(edge.http.url, HUNG), 30, "the reason in the edge's /healthz")
        client = MqttClient(silent.url, "bare", MqttOptions(connect_timeout=0.5,
                                                            reconnect_max=1))
        client.start()
        try:
            wait_for(lambda: client.attempts.failures >= 1, 30, "a bare client gives up too")
            assert HUNG in client.attempts.last_attempt()
        finally:
            client.stop()
        wait_for(lambda: not client.alive(), 10, "paho's thread ended after stop()")
    finally:
        silent.close()
