"""Connection attempts: each failure said once in the log (throttled) and kept for health, and
the wait for the broker's answer to CONNECT bounded.

paho reconnects by itself, with backoff, but says nothing of why an attempt failed, and it
waits for the CONNACK as long as its keepalive lets it (forever with keepalive 0): a broker
that accepts TCP and never answers CONNECT would leave a client silent, reconnecting now and
then. Here every failed attempt is counted and its reason kept (``last_error``, for
``/healthz``); the log gets the first failure and then one line at each doubling of the count,
so an outage of days stays a few lines. A connection that gets no CONNACK within ``timeout``
seconds is ended, which paho treats as a lost connection: it tries again after its backoff.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading

from ddnn.plumbing.throttle import LogThrottle

log = logging.getLogger("ddnn.plumbing.mqtt")

CONNECT_TIMEOUT = 10.0  # seconds for TCP, for TLS's handshake and for the CONNACK, each


class ConnectAttempts:
    """The attempts of one client to connect since it was last connected.

    paho's thread reports each step: :meth:`opened` (the CONNECT goes out on ``sock``),
    :meth:`answered` (a CONNACK came, whatever it said), :meth:`failed` (an attempt failed, and
    why), :meth:`ended` (the connection closed; a failure if no CONNACK had come) and
    :meth:`succeeded`. ``retrying`` describes the backoff for the log line.
    """

    def __init__(self, url: object, timeout: float = CONNECT_TIMEOUT, retrying: str = ""):
        self.url, self.timeout, self.retrying = url, timeout, retrying
        self.failures = 0  # failed attempts since the last connection
        self.last_error: str | None = None  # why the last one failed; None once connected
        self._log = LogThrottle(doubling=True)
        self._lock = threading.Lock()
        self._waiting: socket.socket | None = None  # the connection awaiting its CONNACK
        self._timer: threading.Timer | None = None

    def opened(self, sock: socket.socket) -> None:
        """The connection is up (TCP, and TLS's handshake) and CONNECT goes out: the CONNACK
        must come within ``timeout`` seconds."""
        timer = threading.Timer(self.timeout, self._expire, (sock,))
        timer.name, timer.daemon = "mqtt-connack-wait", True
        with self._lock:
            self._cancel()
            self._waiting, self._timer = sock, timer
        timer.start()

    def answered(self) -> None:
        """A CONNACK came (a refusal too): the wait is over."""
        with self._lock:
            self._cancel()

    def ended(self, why: str) -> None:
        """The connection closed; a failed attempt if it was still waiting for its CONNACK."""
        with self._lock:
            waiting = self._waiting is not None
            self._cancel()
        if waiting:
            self.failed(why)

    def failed(self, why: str) -> None:
        """An attempt failed (``why``: one sentence): counted, kept, logged (throttled)."""
        with self._lock:
            self.failures += 1
            self.last_error = why
            n = self.failures
        if self._log():
            log.warning("%s; %s (%d failed attempt%s so far)", why, self.retrying, n,
                        "" if n == 1 else "s")

    def succeeded(self) -> int:
        """Connected: the count starts over. Returns how many attempts had failed."""
        with self._lock:
            self._cancel()
            failures, self.failures, self.last_error = self.failures, 0, None
        self._log.forget()
        return failures

    def last_attempt(self) -> str:
        """For a health reason: ``"; last attempt: ..."`` (why the last attempt failed), or
        nothing since the last connection."""
        why = self.last_error
        return f"; last attempt: {why}" if why else ""

    def stop(self) -> None:
        with self._lock:
            self._cancel()

    def _cancel(self) -> None:  # (lock held)
        if self._timer is not None:
            self._timer.cancel()
        self._waiting = self._timer = None

    def _expire(self, sock: socket.socket) -> None:
        with self._lock:
            if self._waiting is not sock:
                return  # answered, ended or replaced meanwhile
            self._waiting = self._timer = None
        self.failed(f"broker {self.url} accepted the connection but did not answer CONNECT "
                    f"within {self.timeout:g} s")
        # The base class's shutdown, also for a TLS socket: it wakes paho's read with an end
        # of file (the TLS layer stays paho's to close); paho then reconnects after its backoff.
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
