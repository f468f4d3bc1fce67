"""Devices behind a gateway: one batch per frame up the uplink, answers unchanged."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from ddnn import envelope as env
from ddnn.batch import pack_batch
from ddnn.device.gateway.service import GatewayService
from ddnn.device.gateway.settings import GatewaySettings
from ddnn.envelope import MessageType
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.tools.broker import start_broker
from ddnn.topics import Topics
from tests.support.cloud import real_cloud
from tests.support.data import mixed_thresholds
from tests.support.hierarchy import (
    REPLAY_WAIT,
    Edge,
    check_against_evaluate,
    replay,
)
from tests.support.polling import wait_for

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")

wait_for = functools.partial(wait_for, timeout=REPLAY_WAIT)  # whole replays through brokers


@pytest.fixture(scope="module")
def thresholds(tiny_bundle, tiny_data) -> dict[str, float]:
    return mixed_thresholds(tiny_bundle, tiny_data.test)


@pytest.fixture
def cloud(tiny_bundle):
    with real_cloud(tiny_bundle) as server:
        yield server


@pytest.fixture
def site_broker(mosquitto):  # (mosquitto: skips the test where it is not installed)
    with start_broker(prefer="mosquitto") as broker:
        yield broker


def test_devices_behind_a_gateway_answer_like_offline_evaluation(
        mosquitto, site_broker, tiny_bundle, tiny_data, cloud, thresholds):
    edge, gateway = replay(tiny_bundle, tiny_data.test, mosquitto.url, cloud.url,
                           deployment="gw", thresholds=thresholds, site=site_broker.url)
    check_against_evaluate(list(edge.agg.results), tiny_bundle, tiny_data.test, thresholds)
    sent = gateway.forwarded
    # A frame's three score messages went as one batch (pulled features likewise).
    assert sent["messages"] >= 3 * 120 and sent["batches"] <= sent["messages"] / 2.5, sent
    assert edge.agg.metrics.dropped.value(reason="late") == 0


def _entry(frame: int) -> bytes:
    return env.encode(env.pack(MessageType.SCORES, version="1", frame=frame,
                               tensor=np.zeros((1, 3), np.float32), codec="float16"))


def test_a_gateway_speaks_only_for_its_devices(mosquitto, tiny_bundle, cloud):
    edge = Edge(tiny_bundle, mosquitto.url, cloud.url, deployment="gwx",
                gateways=(("gw0", ("cam0", "cam1")),))
    t = Topics("gwx")
    pub = MqttClient(mosquitto.url, "vandal", MqttOptions()).start()
    dropped = edge.agg.metrics.dropped
    try:
        assert pub.wait_connected(10)
        # cam2 is this edge's, but not gw0's to speak for (gw1, no gateway of this edge, is not
        # even listened to).
        pub.publish(t.gateway("gw0", "messages"),
                    pack_batch([("cam0", _entry(5)), ("cam2", _entry(5))]), 1)
        pub.publish(t.gateway("gw1", "messages"), pack_batch([("cam1", _entry(6))]), 1)
        pub.publish(t.gateway("gw0", "messages"), b"\xe2\x04cam0\x7f", 1)  # truncated entry
        wait_for(lambda: dropped.value(reason="unknown_device") >= 1
                 and dropped.value(reason="malformed") >= 1, what="refusals counted")
        wait_for(lambda: edge.agg.assembler.knows(5), what="cam0's scores taken")
        assert not edge.agg.assembler.knows(6)
    finally:
        pub.stop()
        edge.stop()


def test_the_gateway_serves_metrics_and_health_like_the_other_processes(site_broker):
    import json
    import urllib.error
    import urllib.request

    def get(url: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    # The edge's broker is unreachable (nothing listens on port 1), the site's is up.
    settings = GatewaySettings(local=site_broker.url, broker="mqtt://127.0.0.1:1", http_port=0,
                               health_grace=0.2, reconnect_max=1)
    with GatewayService.from_settings(settings) as gateway:
        url = gateway.http.url
        wait_for(gateway.local.connected.is_set, what="the site's broker")
        assert get(f"{url}/livez")[0] == 200
        status, body = wait_for(lambda: (r := get(f"{url}/healthz"))[0] == 503 and r,
                                what="/healthz to report the unreachable uplink")
        assert "the edge's broker mqtt://127.0.0.1:1 unreachable" in json.loads(body)["reasons"][0]
        status, text = get(f"{url}/metrics")
        assert status == 200
        assert b'ddnn_gateway_broker_connected{broker="local"} 1.0' in text
        assert b'ddnn_gateway_broker_connected{broker="up"} 0.0' in text
