"""A client's presence: its retained status, ``online`` while connected and ``offline`` after.

The status topic holds one retained message per client (:func:`ddnn.status.status_payload`):
``online`` with the client's fields, published on every connection before anything else;
``offline`` published when it stops, and left with the broker as the last will, which the
broker publishes when the connection is lost without a DISCONNECT. Peers read it to know who is
there (the edge its devices, devices their peers, a gateway's devices through it).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

from ddnn.status import status_payload
from ddnn.topics import DELIVERY

STATUS = DELIVERY["status"]


class Presence:
    """The retained status of one client on ``topic`` (None: it has none) with ``info``.

    ``publish(topic, payload, qos, retain)`` is the client's own publish (topic aliases and
    all), used for changes while ``connected``; the connection's own moments (:meth:`will`,
    :meth:`online`, :meth:`offline`) go through paho's client as they happen.
    """

    def __init__(self, topic: str | None, info: dict[str, Any] | None,
                 publish: Callable[[str, bytes, int, bool], object],
                 connected: threading.Event):
        self.topic = topic
        self.info: dict[str, Any] = info or {}
        self._publish, self._connected = publish, connected

    def payload(self, state: str) -> bytes:
        return status_payload(state, **self.info)

    def will(self, paho_client) -> None:
        """Leave ``offline`` with the broker, for a connection lost without a goodbye."""
        if self.topic:
            paho_client.will_set(self.topic, self.payload("offline"), STATUS.qos,
                                 retain=STATUS.retain)

    def online(self, paho_client) -> None:
        """Say ``online`` on a new connection (paho's thread, at the CONNACK)."""
        if self.topic:
            paho_client.publish(self.topic, self.payload("online"), STATUS.qos,
                                retain=STATUS.retain)

    def update(self, **info: Any) -> None:
        """Change fields of the ``online`` status, and publish it now when connected."""
        # A new dict, never an update in place: paho's thread reads it on every reconnection.
        self.info = {**self.info, **info}
        if self.topic and self._connected.is_set():
            self._publish(self.topic, self.payload("online"), STATUS.qos, STATUS.retain)

    def offline(self, paho_client, timeout: float) -> None:
        """Say ``offline`` before a disconnection, waiting up to ``timeout`` for the broker."""
        if not self.topic:
            return
        info = paho_client.publish(self.topic, self.payload("offline"), STATUS.qos,
                                   retain=STATUS.retain)
        # Lost the connection meanwhile (RuntimeError/ValueError): the last will says it.
        with contextlib.suppress(RuntimeError, ValueError):
            info.wait_for_publish(timeout)
