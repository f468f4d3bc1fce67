"""Devices with both a broker and the edge's HTTP(S) ingest: they fail over to HTTP while their
path to the broker is cut, come back to MQTT when it returns, and every frame is answered once.
A real Mosquitto broker behind a relay the test cuts, an edge in this process serving HTTPS
with a certificate from deploy/make-certs.sh, devices in this process trusting its CA."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from ddnn.device.message import OutMessage
from ddnn.device.service import DeviceService
from ddnn.device.settings import DeviceSettings
from ddnn.device.transport import HttpTransport
from ddnn.tools.broker import free_port
from tests.support.hierarchy import REPLAY_WAIT, Edge
from tests.support.polling import wait_for
from tests.support.proxy import TcpRelay

ROOT = Path(__file__).resolve().parents[2]
VIEWS = range(3)  # the tiny bundle's
CUT_AT, RESTORE_AT = 20, 40  # frames the replays wait at for the outage, then for its end

pytestmark = [pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl"),
              pytest.mark.filterwarnings(
                  "ignore:Exception ignored in.*broker.log:"
                  "pytest.PytestUnraisableExceptionWarning")]


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Path:
    """The deployment's CA and a server certificate for 127.0.0.1 (make-certs.sh's cloud one,
    which the edge's HTTP server presents here)."""
    out = tmp_path_factory.mktemp("pki")
    subprocess.run(["bash", str(ROOT / "deploy" / "make-certs.sh"), str(out),
                    "--broker-host", "127.0.0.1", "--devices", "cam0", "--edges", "edge0",
                    "--cloud-host", "127.0.0.1", "--install-dir", str(out)],
                   check=True, capture_output=True, text=True)
    return out


def _devices(bundle, data, broker, edge_url, pki, stack) -> list[DeviceService]:
    return [stack.enter_context(DeviceService.from_settings(DeviceSettings(
        bundle=bundle, view=v, broker=broker, edge_url=edge_url, edge_ca_file=pki / "ca.crt",
        failover_after=0.3, deployment="fo", data=data, limit=60, fps=0, grace=0.5,
        drain_timeout=30, keepalive=5, reconnect_max=1, wait_peers=20)))
        for v in VIEWS]


def _gated(service: DeviceService, gates: dict[int, threading.Event]):
    """The device's replay, waiting at each gate's frame until the test opens it."""
    for frame, image in service.source:
        if frame in gates:
            assert gates[frame].wait(REPLAY_WAIT), f"gate at frame {frame} never opened"
        yield frame, image


def test_a_device_fails_over_to_https_and_back_each_frame_answered_once(
        mosquitto, tiny_bundle, tiny_data, pki):
    relay = TcpRelay((mosquitto.host, mosquitto.port))  # the devices' path to the broker
    port = free_port()
    edge = Edge(tiny_bundle, mosquitto.url, None, deployment="fo", http_port=port,
                http_cert_file=pki / "cloud.crt", http_key_file=pki / "cloud.key")
    assert edge.service.http.url.startswith("https://")
    cut, restored = threading.Event(), threading.Event()
    try:
        with contextlib.ExitStack() as stack:
            devices = _devices(tiny_bundle, tiny_data.test, relay.url,
                               f"https://127.0.0.1:{port}", pki, stack)
            assert all(d.settings.mode == "push" for d in devices)  # HTTP cannot be pulled
            threads = [threading.Thread(target=d.run, args=(_gated(d, {
                CUT_AT: cut, RESTORE_AT: restored}),)) for d in devices]
            for t in threads:
                t.start()
            # The frames before the outage answered, and every message of them acknowledged.
            wait_for(lambda: edge.agg.answered >= CUT_AT
                     and all(len(d.outbox) == 0 and d.transport.idle() for d in devices),
                     timeout=REPLAY_WAIT, what="the frames before the outage")
            relay.cut()
            # The frames of the outage come once every device has seen its broker go: a message
            # handed to paho before it noticed stays with paho until the broker is back (never
            # sent twice), and would keep its outbox from draining over HTTPS.
            wait_for(lambda: not any(d.transport.mqtt.connected for d in devices),
                     timeout=REPLAY_WAIT, what="the devices to see the broker gone")
            cut.set()
            # Frames CUT_AT.. wait in the outboxes, then go over HTTPS once the broker has
            # been gone for --failover-after.
            wait_for(lambda: all(d.transport.via == "http" and len(d.outbox) == 0
                                 for d in devices), timeout=REPLAY_WAIT,
                     what="every device to fail over and send its waiting frames")
            assert all(d.transport.failovers == 1 for d in devices)
            over_http = {d.settings.device_id: d.transport.sent["http"] for d in devices}
            relay.restore()
            wait_for(lambda: all(d.transport.mqtt.connected for d in devices),
                     timeout=REPLAY_WAIT, what="the devices back on the broker")
            mqtt_before = [d.transport.sent["mqtt"] for d in devices]
            restored.set()
            for t in threads:
                t.join(timeout=120)
        wait_for(lambda: edge.agg.answered >= 60, timeout=REPLAY_WAIT, what="60 results")
    finally:
        relay.cut()
        edge.stop()
    frames = sorted(r["frame"] for r in edge.agg.results)
    assert frames == list(range(60)), "every frame answered exactly once"
    # Frames CUT_AT..RESTORE_AT-1 went over HTTPS (a message or two each: absent, or scores
    # and features), the rest over MQTT, after the broker came back too.
    assert all(n >= RESTORE_AT - CUT_AT for n in over_http.values()), over_http
    assert all(d.transport.sent["http"] == over_http[d.settings.device_id] for d in devices)
    assert all(d.transport.sent["mqtt"] > m for d, m in zip(devices, mqtt_before, strict=True))
    assert all(d.transport.via == "mqtt" for d in devices)


def test_the_http_path_is_tls_when_the_edge_has_a_certificate(tiny_bundle, pki):
    port = free_port()
    edge = Edge(tiny_bundle, None, None, deployment="fo", http_port=port,
                http_cert_file=pki / "cloud.crt", http_key_file=pki / "cloud.key")
    probe = OutMessage("results", b"{}")  # the edge answers 403: a 3-view bundle's devices
    try:                                    # never post results (it is heard, over TLS)
        trusting = HttpTransport(f"https://127.0.0.1:{port}", ca_file=str(pki / "ca.crt"))
        assert not trusting.send(probe) and "answered 403" in trusting.last_failure
        untrusting = HttpTransport(f"https://127.0.0.1:{port}")  # the system's CAs only
        assert not untrusting.send(probe)
        assert "CERTIFICATE_VERIFY_FAILED" in untrusting.last_failure
        plain = HttpTransport(f"http://127.0.0.1:{port}")  # no TLS: no answer
        assert not plain.send(probe) and "unreachable" in plain.last_failure
        for t in (trusting, untrusting, plain):
            t.stop()
    finally:
        edge.stop()
