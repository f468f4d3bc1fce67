"""The results HTTP callback: every result also POSTed as JSON to an application's URL.

For consumers without MQTT (a web hook, a serverless function). Results go out in order from
one background thread over a keep-alive connection, so a slow or absent receiver never holds up
the edge: they wait in a bounded queue (the oldest dropped and counted when it is full). A
result is sent again after a backoff when the receiver is unreachable or answers 408, 429 or
5xx; any other 4xx means the receiver refuses that result, which is counted and dropped.
"""

from __future__ import annotations

import collections
import http.client
import logging
import threading

from ddnn.errors import ConfigError
from ddnn.plumbing.http import KeepAliveConnection
from ddnn.plumbing.metrics import Counter
from ddnn.plumbing.retry import RetryPolicy

log = logging.getLogger(__name__)


RESULTS_RETRY = RetryPolicy(initial=0.25, maximum=10.0)


class ResultsCallback:
    """POSTs each result body to ``url``; :meth:`post` never blocks."""

    def __init__(self, url: str, outcomes: Counter, *, token: str | None = None,
                 timeout: float = 5.0, capacity: int = 10_000,
                 retry: RetryPolicy = RESULTS_RETRY, ca_file: str | None = None):
        self._receiver = KeepAliveConnection(url, "results", timeout, ca_file)
        if capacity < 1:
            raise ConfigError("the results callback queue needs room for at least one result")
        self.retry = retry
        r = self._receiver
        self._path = (r.path or "/") + (f"?{r.query}" if r.query else "")
        self._headers = {"Content-Type": "application/json"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._outcomes = outcomes  # counter labelled by outcome: sent, refused, overflow, retry
        self._queue: collections.deque[bytes] = collections.deque()
        self._capacity = capacity
        self._cv = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="edge-callback", daemon=True)

    def start(self) -> ResultsCallback:
        self._thread.start()
        r = self._receiver
        log.info("results also POSTed to %s://%s%s", r.scheme, r.netloc, self._path)
        return self

    def post(self, body: bytes) -> None:
        """Queue one result for the receiver (oldest dropped, counted, when the queue is full)."""
        with self._cv:
            if len(self._queue) >= self._capacity:
                self._queue.popleft()
                self._outcomes.inc(outcome="overflow")
            self._queue.append(body)
            self._cv.notify()

    def pending(self) -> int:
        with self._cv:
            return len(self._queue)

    def _loop(self) -> None:
        backoff = self.retry.backoff()
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:  # stopping, nothing left
                    return
                body = self._queue[0]
            done = self._send(body)
            with self._cv:
                if done:
                    if self._queue and self._queue[0] is body:  # (an overflow may have taken it)
                        self._queue.popleft()
                    backoff.succeeded()
                    continue
                if self._stop:  # the receiver is down and we are stopping: give up, counted
                    self._outcomes.inc(len(self._queue), outcome="unsent_at_stop")
                    return
                self._outcomes.inc(outcome="retry")
                self._cv.wait(backoff.failed())

    def _send(self, body: bytes) -> bool:
        """True when the receiver took or refused the result; False to send it again later."""
        try:
            status, _, _ = self._receiver.request("POST", self._path, body, self._headers)
        except (OSError, http.client.HTTPException) as e:
            log.warning("results callback %s unreachable (%s); retrying", self._receiver.netloc,
                        e)
            return False
        if self.retry.retryable(status):
            self._receiver.close()
            log.warning("results callback answered %d; retrying", status)
            return False
        if status >= 300:  # refused, or redirected (never followed: the token would go along)
            self._outcomes.inc(outcome="refused")
            log.warning("results callback refused a result: %d", status)
            return True
        self._outcomes.inc(outcome="sent")
        return True

    def stop(self, timeout: float = 5.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), then stop."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)
        self._receiver.close()
