"""What the broker delivers to a client, on to its handler (paho's network thread).

A retained message on a kind of topic ddnn never retains is stale by nature (a retained score
would be taken again by every new subscriber, long after its frame): it is dropped, counted and
logged (throttled); only status and bundle announcements are retained in ddnn
(:data:`ddnn.topics.DELIVERY`). A handler that raises is logged and does not end paho's
thread. A persistent session acknowledges by hand: a message its handler declined (returned
False) stays unacknowledged, so the broker delivers it again to the next session of the same
client id, until the handler's owner acknowledges it (:meth:`Inbox.ack`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ddnn.plumbing.throttle import LogThrottle
from ddnn.topics import may_retain

log = logging.getLogger("ddnn.plumbing.mqtt")

Handler = Callable[[str, bytes], "bool | None"]  # (topic, payload) -> False: acknowledged later


class Inbox:
    """Hands ``paho_client``'s messages to ``handler``; ``persistent``: acknowledges by hand."""

    def __init__(self, paho_client, handler: Handler | None, persistent: bool):
        self._client, self._handler, self.persistent = paho_client, handler, persistent
        self.delivering: tuple[int, int] = (0, 0)  # (mid, qos) of the message being handled
        self.retained_dropped = 0  # retained messages on kinds never retained
        self._retained_log = LogThrottle(every=1000)  # the first, then one in a thousand

    def deliver(self, client, userdata, msg) -> None:
        """paho's ``on_message``."""
        handled = None
        self.delivering = (msg.mid, msg.qos)  # for a handler that acknowledges later
        try:
            if msg.retain and not may_retain(msg.topic):
                self.retained_dropped += 1
                if self._retained_log():
                    log.warning("dropped a retained message on %s, a kind never retained (%d "
                                "so far)", msg.topic[:200], self.retained_dropped)
            elif self._handler is not None:
                handled = self._handler(msg.topic, msg.payload)
        except Exception:  # a handler bug must not kill paho's network thread
            log.exception("message handler failed on %s", msg.topic)
        if self.persistent and msg.qos > 0 and handled is not False:
            client.ack(msg.mid, msg.qos)

    def ack(self, delivery: tuple[int, int]) -> None:
        """Acknowledge a message a persistent session's handler declined (returned False) and
        kept ``delivering`` of: until then the broker holds it for this client id."""
        mid, qos = delivery
        if qos > 0:
            self._client.ack(mid, qos)
