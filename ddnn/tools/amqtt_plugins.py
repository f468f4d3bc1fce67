"""The embedded amqtt broker of ``ddnn.tools.broker``, made to behave like the shipped Mosquitto
where ddnn relies on it: persistent sessions kept, their queues bounded, retained messages only
where the protocol retains.

* :class:`OpenSessions` (a plugin): amqtt's stock anonymous-access plugin marks every client
  anonymous, and amqtt keeps no queue for an anonymous client's persistent session
  (``clean_session`` off): QoS 1 messages published while the edge is away were dropped, where
  Mosquitto queues them for its next connection. This plugin lets every client in without
  marking it anonymous, so amqtt queues for persistent sessions as the MQTT specification says
  (3.1.2.4). It authenticates nobody: demo and test brokers only.
* :class:`BoundedBroker`: amqtt's queue for an absent persistent client has no bound (Mosquitto's
  ``max_queued_messages``/``max_queued_bytes``): it drops a message past
  :data:`~ddnn.tools.broker_limits.MAX_QUEUED_MESSAGES` or
  :data:`~ddnn.tools.broker_limits.MAX_QUEUED_BYTES`
  for that client, as Mosquitto does; delivers the queue with the retain flag off (amqtt set
  it, MQTT 3.3.1-9 says off: the edge ignores retained scores); keeps retained messages only on
  topic kinds ddnn retains (:data:`ddnn.topics.DELIVERY`) and at most
  :data:`MAX_RETAINED_TOPICS` of them. It overrides private methods of amqtt 0.11: with an
  amqtt that lacks them, :func:`bounded_broker` says so and runs amqtt unbounded (a demo broker).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from amqtt.broker import Broker
from amqtt.plugins.base import BaseAuthPlugin

from ddnn.plumbing.throttle import LogThrottle
from ddnn.tools.broker_limits import MAX_QUEUED_BYTES, MAX_QUEUED_MESSAGES
from ddnn.topics import may_retain

log = logging.getLogger(__name__)

MAX_RETAINED_TOPICS = 10_000  # retained messages the embedded broker keeps at most
_OVERRIDDEN = ("_retain_broadcast_message", "_publish_session_retained_messages",
               "retain_message", "_get_handler")


class OpenSessions(BaseAuthPlugin):
    """Accept every client, and leave it non-anonymous so its persistent session is kept."""

    @dataclass
    class Config:
        """No options."""

    async def authenticate(self, *, session) -> bool:
        return True


class BoundedBroker(Broker):
    """amqtt's broker with bounded per-client queues and retained messages (module docstring)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.queued_bytes: dict[str, int] = {}  # client id -> bytes queued while it is away
        self.dropped = 0  # messages not queued (a full queue) or not retained (kind, count)
        self._warn = LogThrottle(period=10.0)

    def _drop(self, what: str) -> None:
        self.dropped += 1
        if self._warn():
            log.warning("%s (%d dropped so far)", what, self.dropped)

    async def _retain_broadcast_message(self, broadcast, qos, target_session) -> None:
        client, size = target_session.client_id, len(broadcast["data"])
        queue = target_session.retained_messages
        held = self.queued_bytes.get(client, 0) if queue.qsize() else 0  # delivered: empty
        if queue.qsize() >= MAX_QUEUED_MESSAGES or held + size > MAX_QUEUED_BYTES:
            self._drop(f"queue of absent client {client} full ({queue.qsize()} messages, "
                       f"{held} bytes): a message on {broadcast['topic']} dropped")
            return
        self.queued_bytes[client] = held + size
        await super()._retain_broadcast_message(broadcast, qos, target_session)

    async def _publish_session_retained_messages(self, session) -> None:
        handler = self._get_handler(session)
        if handler is None:
            return
        sends = []
        while not session.retained_messages.empty():
            queued = session.retained_messages.get_nowait()
            # Queued for a subscription, not retained: MQTT 3.3.1-9 sends it with retain off.
            sends.append(asyncio.ensure_future(
                handler.mqtt_publish(queued.topic, queued.data, queued.qos, retain=False)))
        self.queued_bytes.pop(session.client_id, None)
        if sends:
            await asyncio.wait(sends)

    async def retain_message(self, source_session, topic_name, data, qos=None) -> None:
        if data and topic_name is not None:
            if not may_retain(topic_name):
                self._drop(f"a retained message on {topic_name!r}, a kind never retained: "
                           "delivered, not kept")
                return
            if (topic_name not in self.retained_messages
                    and len(self.retained_messages) >= MAX_RETAINED_TOPICS):
                self._drop(f"{MAX_RETAINED_TOPICS} retained topics kept: {topic_name!r} is not")
                return
        await super().retain_message(source_session, topic_name, data, qos)


def bounded_broker() -> type[Broker]:
    """:class:`BoundedBroker`, or amqtt's own broker (with a warning) when its internals are not
    the ones overridden."""
    if all(callable(getattr(Broker, name, None)) for name in _OVERRIDDEN):
        return BoundedBroker
    log.warning("this amqtt has not the internals ddnn bounds its queues by (amqtt 0.11's): the "
                "embedded broker runs without the queue and retained-message bounds (demo only)")
    return Broker
