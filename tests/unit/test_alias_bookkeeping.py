"""The MQTT 5 topic-alias bookkeeping, against paho's own message objects (no broker)."""

from __future__ import annotations

import threading

import paho.mqtt.client as paho

from ddnn.plumbing.mqtt import TopicAliases


class StoredMessages:
    """What TopicAliases reads of a paho client: its stored messages and their lock."""

    def __init__(self):
        self._out_message_mutex = threading.Lock()
        self._out_messages: dict[int, paho.MQTTMessage] = {}

    def store(self, mid: int, topic: str, props) -> paho.MQTTMessage:
        m = paho.MQTTMessage(mid, topic.encode())
        m.properties = props
        self._out_messages[mid] = m
        return m


def test_a_topic_goes_once_per_connection_then_its_alias():
    a = TopicAliases()
    assert a.use("t/a") == ("t/a", None)  # not connected yet: no alias
    a.connected(10, StoredMessages())
    topic, props = a.use("t/a")
    assert topic == "t/a" and props.TopicAlias == 1
    assert a.use("t/a")[0] == "" and a.use("t/b")[1].TopicAlias == 2
    a.disconnected()  # until the next CONNACK: topics in full, no alias
    assert a.use("t/a") == ("t/a", None)
    a.connected(10, StoredMessages())
    assert a.use("t/a")[0] == "t/a" and a.use("t/a")[0] == ""


def test_stored_messages_get_their_topic_back_and_lose_aliases_the_broker_refuses():
    a, client = TopicAliases(), StoredMessages()
    a.connected(10, client)
    first = client.store(1, *a.use("t/a"))  # full topic, alias 1
    later = client.store(2, *a.use("t/a"))  # empty topic, alias 1
    other = client.store(3, *a.use("t/b"))  # full topic, alias 2
    a.disconnected()
    a.connected(1, client)  # the new broker allows one alias only
    assert [m.topic for m in (first, later, other)] == ["t/a", "t/a", "t/b"]
    assert first.properties.TopicAlias == 1 and later.properties.TopicAlias == 1
    assert other.properties is None  # alias 2 > 1 would make the broker disconnect us
    assert a.use("t/b") == ("t/b", None) and a.use("t/c") == ("t/c", None)  # none left
