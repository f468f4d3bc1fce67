"""When a repeated event gets a log line: one helper for every "warn once, count the rest".

A flood (a misconfigured device, a refusing broker, a port scan) must stay a few lines in the
log while the metrics count every event. :class:`LogThrottle` counts the events of each key and
says when one deserves a line: the first of each key always; after that one in ``every`` (the
``every``-th, ``2 × every``-th, ...), one per ``period`` seconds, one at each doubling (1, 2, 4,
8, ...: an outage of days stays a few lines), or none at all (the default: once per key)::

    refused = LogThrottle(every=1000)
    if n := refused():
        log.warning("refused a message (%d so far)", total)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable


class LogThrottle:
    """Counts events by key and says which deserve a log line; thread-safe, bounded."""

    def __init__(self, *, every: int = 0, period: float = 0.0, doubling: bool = False,
                 max_keys: int = 1000, clock: Callable[[], float] = time.monotonic):
        self.every, self.period, self.doubling = every, period, doubling
        self._clock = clock
        self.max_keys = max_keys  # keys remembered at most: past it new keys stay silent
        self._seen: dict[Hashable, list] = {}  # key -> [events, events since the line, when]
        self._lock = threading.Lock()

    def __call__(self, key: Hashable = None) -> int:
        """Count one event of ``key``. When it deserves a line: how many events that line
        speaks for (this one and those since the last line); else 0."""
        now = self._clock()
        with self._lock:
            seen = self._seen.get(key)
            if seen is None:
                if len(self._seen) >= self.max_keys:
                    return 0
                self._seen[key] = [1, 0, now]
                return 1
            seen[0] += 1
            seen[1] += 1
            n = seen[0]
            due = ((self.every and n % self.every == 0)
                   or (self.period and now - seen[2] >= self.period)
                   or (self.doubling and n & (n - 1) == 0))
            if not due:
                return 0
            since, seen[1], seen[2] = seen[1], 0, now
            return since

    def seen(self, key: Hashable = None) -> bool:
        """Whether an event of ``key`` was counted."""
        with self._lock:
            return key in self._seen

    def forget(self, key: Hashable = None) -> None:
        """Start ``key`` over: its next event is a first again."""
        with self._lock:
            self._seen.pop(key, None)
