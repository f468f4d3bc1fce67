"""A client's retained status (ddnn.plumbing.mqtt.presence), without a broker."""

from __future__ import annotations

import json
import threading

from ddnn.plumbing.mqtt import Presence


class _Paho:
    """What Presence asks of paho's client, recorded."""

    def __init__(self):
        self.calls = []

    def will_set(self, topic, payload, qos, retain):
        self.calls.append(("will", topic, json.loads(payload), qos, retain))

    def publish(self, topic, payload, qos, retain):
        self.calls.append(("publish", topic, json.loads(payload), qos, retain))
        return self

    def wait_for_publish(self, timeout):
        raise RuntimeError("the connection was lost meanwhile")  # the last will says it


def test_online_and_offline_carry_the_fields_and_changes_go_out_only_while_connected():
    published, connected = [], threading.Event()
    presence = Presence("ddnn/d/devices/cam0/status", {"device": "cam0"},
                        lambda *a: published.append((a[0], json.loads(a[1]), a[2], a[3])),
                        connected)
    paho = _Paho()
    presence.will(paho)
    presence.update(model="tiny:1")  # not connected: kept for the next connection
    assert published == []
    presence.online(paho)
    connected.set()
    presence.update(model="tiny:2")
    presence.offline(paho, timeout=0.1)
    states = [(c[0], c[2]["state"], c[2].get("model")) for c in paho.calls]
    assert states == [("will", "offline", None), ("publish", "online", "tiny:1"),
                      ("publish", "offline", "tiny:2")]
    assert all(c[1] == "ddnn/d/devices/cam0/status" and c[4] is True for c in paho.calls)
    assert [(p[1]["state"], p[1]["model"], p[3]) for p in published] == [
        ("online", "tiny:2", True)]


def test_without_a_topic_nothing_is_said():
    paho, connected = _Paho(), threading.Event()
    connected.set()
    presence = Presence(None, None, lambda *a: paho.calls.append(a), connected)
    presence.will(paho)
    presence.online(paho)
    presence.update(model="x")
    presence.offline(paho, timeout=0.1)
    assert paho.calls == []
