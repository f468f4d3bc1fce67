"""MQTT 5 topic aliases survive what a real link does: reconnections with messages in flight,
and brokers that speak only MQTT 3.1.1."""

from __future__ import annotations

import threading

import pytest

from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.tools.broker import start_broker
from tests.support.brokers import needs_embedded_broker
from tests.support.polling import wait_for

pytestmark = pytest.mark.filterwarnings(
    "ignore:Exception ignored in.*broker.log:pytest.PytestUnraisableExceptionWarning")


def _listen(url: str, got: list, name: str) -> MqttClient:
    lock = threading.Lock()

    live = threading.Event()

    def on(topic: str, payload: bytes) -> None:
        if topic == "alias/probe":
            live.set()
            return
        with lock:
            got.append((topic, payload))
    client = MqttClient(url, name, MqttOptions(subscriptions=[("alias/#", 1)]),
                        on_message=on).start()
    assert client.wait_connected(10)
    # The subscription is live once a message of its own comes back through the broker.
    wait_for(lambda: client.publish("alias/probe", b"", 1) and live.wait(0.05),
             what="the subscription live")
    return client


def test_messages_sent_again_after_a_reconnection_get_their_topic_back(mosquitto):
    port = mosquitto.port
    pub = MqttClient(mosquitto.url, "alias-pub", MqttOptions(reconnect_max=1)).start()
    got: list = []
    sub = _listen(mosquitto.url, got, "alias-sub")
    try:
        assert pub.wait_connected(10) and pub._aliases.maximum > 0  # Mosquitto: MQTT 5
        for i in range(3):
            pub.publish("alias/a", b"before%d" % i, 1)
        wait_for(lambda: len(got) == 3, what="three messages through the alias")
        mosquitto.stop()
        wait_for(lambda: not pub.connected.is_set(), what="the broker gone")
        for i in range(3):  # stored by paho with an empty topic and the alias
            pub.publish("alias/a", b"after%d" % i, 1)
        with start_broker(prefer="mosquitto", port=port) as again:
            sub.stop()
            sub = _listen(again.url, got, "alias-sub2")
            wait_for(lambda: pub.connects >= 2 and pub.pending() == 0, timeout=30,
                     what="the stored messages acknowledged by the new broker")

            assert sub.wait_subscribed(10)  # the broker acknowledged the new subscription
            pub.publish("alias/a", b"later", 1)
            wait_for(lambda: ("alias/a", b"later") in got, what="a message after it")
            assert pub.connects == 2, "the broker never closed the connection for a bad alias"
    finally:
        pub.stop()
        sub.stop()
    assert all(topic == "alias/a" for topic, _ in got)


def test_a_broker_without_mqtt5_gets_full_topics():
    needs_embedded_broker()
    with start_broker(prefer="amqtt") as broker:
        got: list = []
        sub = _listen(broker.url, got, "v3-sub")
        pub = MqttClient(broker.url, "v3-pub", MqttOptions()).start()
        try:
            assert pub.wait_connected(20)
            assert pub._client.protocol == 4 and pub._aliases.maximum == 0  # MQTT 3.1.1
            for i in range(3):
                pub.publish("alias/b", b"%d" % i, 1)
            wait_for(lambda: len(got) == 3, what="three messages")
        finally:
            pub.stop()
            sub.stop()
        assert got == [("alias/b", b"0"), ("alias/b", b"1"), ("alias/b", b"2")]
