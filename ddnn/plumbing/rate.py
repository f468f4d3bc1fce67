"""A rate per client: a token bucket for each of a bounded number of clients."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

MAX_CLIENTS = 4096  # buckets kept; the least recently seen client's is forgotten past that


class RateLimiter:
    """``allow(client)``: True while ``client`` keeps under ``rate`` calls a second on average,
    with bursts of up to ``burst``. Thread-safe; memory bounded by ``max_clients`` (a client
    forgotten starts again with a full bucket, so an attacker with many addresses gains nothing
    it could not get from as many clients)."""

    def __init__(self, rate: float, burst: float, max_clients: int = MAX_CLIENTS,
                 clock=time.monotonic):
        self.rate, self.burst, self.max_clients = rate, burst, max_clients
        self._clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, when
        self._lock = threading.Lock()

    def allow(self, client: str) -> bool:
        now = self._clock()
        with self._lock:
            tokens, then = self._buckets.pop(client, (self.burst, now))
            tokens = min(self.burst, tokens + (now - then) * self.rate)
            allowed = tokens >= 1.0
            self._buckets[client] = (tokens - 1.0 if allowed else tokens, now)
            if len(self._buckets) > self.max_clients:
                self._buckets.popitem(last=False)
            return allowed
