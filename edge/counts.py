"""Device messages counted in plain integers on the hot path, handed to the events in bulk.

The ingest counts each message it takes here (a lock and three additions); the worker, the
metrics page and the ingest's own callers over HTTP :meth:`~MessageCounts.flush` them to
``on_received`` (:mod:`ddnn.edge.events`), so the metrics never cost the frame's path.
"""

from __future__ import annotations

import threading

from ddnn.edge.events import EdgeEvents


class MessageCounts:
    """Messages and bytes taken per kind since the last :meth:`flush`."""

    def __init__(self, events: EdgeEvents):
        self.events = events
        self._counts: dict[str, list[int]] = {}  # kind -> [messages, payload, header bytes]
        self._lock = threading.Lock()

    def count(self, kind: str, payload_bytes: int, header_bytes: int) -> None:
        with self._lock:
            c = self._counts.get(kind)
            if c is None:
                c = self._counts[kind] = [0, 0, 0]
            c[0] += 1
            c[1] += payload_bytes
            c[2] += header_bytes

    def flush(self) -> None:
        """Hand the messages counted since the last flush to the events."""
        with self._lock:
            counts, self._counts = self._counts, {}
        for kind, (n, payload_bytes, header_bytes) in counts.items():
            self.events.on_received(kind, n, payload_bytes, header_bytes)
