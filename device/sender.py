"""The device's sender: one thread between the outbox and the transport, oldest message first.

Order matters (the edge sees scores before the features they announce), so one sender sends,
oldest first, and a message leaves the outbox only once the transport took it; with a spool it
stays on disk until the broker acknowledged it (:meth:`~ddnn.device.buffer.Outbox.settle`).
A message the agent emits while nothing older waits is sent at once, saving a thread hop.
"""

from __future__ import annotations

import logging
import threading
import time

from ddnn.device.buffer import Outbox
from ddnn.device.failover import FailoverTransport
from ddnn.device.message import DELIVERED, OutMessage
from ddnn.device.transport import HttpTransport, MqttTransport
from ddnn.plumbing.lifecycle import Worker

log = logging.getLogger(__name__)

# Seconds to wait at exit for a send under way: the HTTP fallback's timeout, plus a margin.
SENDER_JOIN = 6.0


class Sender:
    """Sends what the ``outbox`` holds through ``transport`` on the thread of :attr:`worker`
    (a part of the service's lifecycle); :meth:`close_outbox` after the worker stopped."""

    def __init__(self, outbox: Outbox,
                 transport: MqttTransport | HttpTransport | FailoverTransport):
        self.outbox, self.transport = outbox, transport
        self._done = threading.Event()
        self._lock = threading.Lock()  # one send at a time: the sender's or deliver()'s
        self.worker = Worker("device-sender", self._loop, stop=self._done.set, join=SENDER_JOIN)

    def _loop(self) -> None:
        while not self._done.is_set():
            self.outbox.settle()
            msg = self.outbox.peek(timeout=0.05)
            if msg is None:
                continue
            if not self.transport.can_send():
                self._done.wait(0.005)  # broker down or paho's window full: wait a tick
                continue
            with self._lock:
                receipt = self.transport.send(msg)
                if receipt:
                    self.outbox.taken(DELIVERED if receipt is True else receipt, msg)

    def deliver(self, msg: OutMessage) -> None:
        """Send at once when nothing older waits, else queue in order. With a spool every
        message goes to disk first, for the sender to send."""
        # Never wait for the sender: it may be inside a slow HTTP send, and the camera must not
        # stall behind it. When it is busy, the message queues behind what it is sending.
        if not self.outbox.spooled and self._lock.acquire(blocking=False):
            try:
                if (len(self.outbox) == 0 and self.transport.can_send()
                        and self.transport.send(msg)):
                    return
            finally:
                self._lock.release()
        self.outbox.put(msg)

    def drain(self, timeout: float, stop: threading.Event) -> bool:
        """Wait until the outbox is empty and the broker acknowledged everything (or ``stop``)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not stop.is_set():
            if len(self.outbox) == 0 and self.transport.idle():
                return True
            stop.wait(0.01)
        left = len(self.outbox)
        if left:
            log.warning("%d messages still undelivered at exit", left)
        return left == 0

    def close_outbox(self) -> None:
        """Settle and close the outbox, unless a send is still under way."""
        self.outbox.settle()  # acknowledged while stopping: not sent again by the next process
        if self.worker.alive():  # closing the spool under a send would lose its done mark
            log.warning("the sender is still inside a send after %.0f s; the outbox is left "
                        "for the next start to recover", SENDER_JOIN)
        else:
            self.outbox.close()
