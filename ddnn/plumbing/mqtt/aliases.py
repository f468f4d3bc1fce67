"""MQTT 5 topic aliases: each topic a client publishes on is sent once per connection, then a
two-byte alias (a device's topic is 32 bytes; its score message 16)."""

from __future__ import annotations

import threading

from ddnn.plumbing.mqtt import _paho


class TopicAliases:
    """MQTT 5 topic aliases of one client: a topic goes on the wire once per connection, then
    its alias (the broker forgets them at each disconnection)."""

    def __init__(self):
        self.lock = threading.Lock()  # held across choosing and queueing a publish
        self.maximum = 0  # the broker's Topic Alias Maximum on this connection (0: none)
        self._ids: dict[str, int] = {}  # topic -> alias (kept across connections)
        self._topics: dict[int, bytes] = {}  # alias -> topic
        self._props: dict[int, object] = {}  # alias -> its PUBLISH properties (paho reads them)
        self._live: set[str] = set()  # topics the broker has learnt on this connection

    def use(self, topic: str):
        """``(topic to send, PUBLISH properties or None)`` for a message on ``topic``."""
        alias = self._ids.get(topic)
        if alias is None or alias > self.maximum:
            if len(self._ids) >= self.maximum:
                return topic, None  # no alias left: the topic in full
            alias = self._ids[topic] = len(self._ids) + 1
            self._topics[alias] = topic.encode()
        props = self._props.get(alias)
        if props is None:  # made and packed once: paho's Properties cost tens of µs each
            from paho.mqtt.packettypes import PacketTypes
            from paho.mqtt.properties import Properties

            props = self._props[alias] = Properties(PacketTypes.PUBLISH)
            props.TopicAlias = alias
            _paho.freeze_pack(props)
        if topic in self._live:
            return "", props
        self._live.add(topic)
        return topic, props

    def disconnected(self) -> None:
        """The connection is gone: nothing goes out with an alias until the next CONNACK."""
        with self.lock:
            self.maximum = 0
            self._live.clear()

    def connected(self, maximum: int, client) -> None:
        """A (re)connection: aliases start over; stored messages that paho is about to send
        again get their topic back (paho resends after ``on_connect``) and lose an alias the
        broker no longer allows."""
        with self.lock:
            self.maximum = int(maximum or 0)
            self._live.clear()
            if not self._topics:
                return
            with _paho.stored_messages(client) as messages:
                for m in messages:
                    alias = getattr(m.properties, "TopicAlias", None)
                    if alias not in self._topics:
                        continue
                    if not m.topic:
                        m.topic = self._topics[alias]
                    if alias > self.maximum:  # the broker allows fewer now (or none)
                        m.properties = None
