"""The device's outbox: messages wait here while the broker (or edge) cannot be reached.

Bounded: when full, the oldest message is dropped and counted, so a long outage costs the
oldest frames rather than the device's memory. With a spool directory
(:class:`~ddnn.device.spool.Spool`) every message is written to disk first and stays there
until the broker acknowledged it (PUBACK), not merely until the MQTT client took it: a crash,
SIGKILL or power cut of the agent loses nothing that was put, and what was in flight is sent
again after a restart (at least once; the edge drops duplicates).
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ddnn.errors import ConfigError
from ddnn.plumbing.throttle import LogThrottle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutMessage:
    """A message to send: its kind (``scores``, ``absent``, ``features`` or ``results``: which
    topic or route), body, and the frame it belongs to."""

    kind: str
    payload: bytes
    frame: int = -1


class Receipt(Protocol):
    """What a transport returns for a message it took: whether the peer acknowledged it."""

    def is_published(self) -> bool: ...


class Acknowledged:
    """The receipt of a message the peer acknowledged at once (an HTTP answer)."""

    def is_published(self) -> bool:
        return True


DELIVERED = Acknowledged()


class Outbox:
    """A bounded FIFO of :class:`OutMessage`, optionally kept on disk until acknowledged.

    The sender peeks the oldest waiting message, hands it to the transport and reports the
    transport's receipt with :meth:`taken`; :meth:`settle` then forgets every message whose
    receipt says the broker acknowledged it. Without a spool a taken message is forgotten at
    once (the MQTT client holds it in memory, as the process does). ``len()`` counts the
    messages waiting plus those taken but not acknowledged (spool only).
    """

    def __init__(self, capacity: int = 10_000, spool: str | Path | None = None, *,
                 sync_every: int = 64, sync_interval: float = 0.2):
        if capacity < 1:
            raise ConfigError("the outbox needs room for at least one message")
        self.capacity = capacity
        self.dropped = 0
        self._drops_log = LogThrottle(every=1000)  # the first drop, then one in a thousand
        self._items: collections.deque[tuple[int, OutMessage]] = collections.deque()
        self._inflight: collections.deque[tuple[int, Receipt]] = collections.deque()
        self._cond = threading.Condition()
        self._seq = 0
        self._spool = None
        if spool:
            from ddnn.device.spool import Spool  # (the spool module uses OutMessage)

            self._spool = Spool(spool, sync_every=sync_every, sync_interval=sync_interval)
            self._items.extend(self._spool.recovered)
            self._spool.recovered = []
            self._seq = self._spool.next_seq
            while len(self._items) > self.capacity:
                self._drop_oldest()

    @property
    def spooled(self) -> bool:
        return self._spool is not None

    def _drop_oldest(self) -> None:
        seq, _ = self._items.popleft()
        self.dropped += 1
        if self._spool:
            self._spool.done(seq)
        if self._drops_log():
            log.warning("outbox full (%d): dropped the oldest message (%d so far)",
                        self.capacity, self.dropped)

    def put(self, msg: OutMessage) -> None:
        with self._cond:
            if len(self._items) >= self.capacity:
                self._drop_oldest()
            seq = self._seq
            self._seq += 1
            if self._spool:
                self._spool.append(seq, msg)
            self._items.append((seq, msg))
            self._cond.notify()

    def peek(self, timeout: float) -> OutMessage | None:
        """The oldest waiting message without removing it, waiting up to ``timeout`` for one."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            return self._items[0][1] if self._items else None

    def taken(self, receipt: Receipt = DELIVERED, msg: OutMessage | None = None) -> None:
        """The transport took the oldest waiting message (``msg``, when given: what the sender
        peeked); ``receipt`` says when it is acknowledged (with a spool it stays on disk until
        then)."""
        with self._cond:
            if not self._items or (msg is not None and self._items[0][1] is not msg):
                return  # the full outbox dropped it meanwhile (counted): nothing to take
            seq, _ = self._items.popleft()
            if self._spool is not None:
                if receipt.is_published():
                    self._spool.done(seq)
                else:
                    self._inflight.append((seq, receipt))
            self._cond.notify_all()

    def pop(self) -> None:
        """Remove the oldest waiting message: it was delivered."""
        self.taken(DELIVERED)

    def settle(self) -> int:
        """Forget the messages acknowledged since the last call (oldest first: a broker
        acknowledges in order); fsync the spool if a batch is due. Returns how many."""
        n = 0
        with self._cond:
            while self._inflight and self._inflight[0][1].is_published():
                seq, _ = self._inflight.popleft()
                self._spool.done(seq)  # type: ignore[union-attr]
                n += 1
            if self._spool is not None:
                self._spool.sync_if_due()
            if n:
                self._cond.notify_all()
        return n

    def waiting(self) -> int:
        """Messages not yet handed to the transport."""
        return len(self._items)

    def in_flight(self) -> int:
        """Messages handed over and not yet acknowledged (kept on disk)."""
        return len(self._inflight)

    def close(self) -> None:
        """fsync and close the spool; what is not acknowledged is sent by the next process."""
        with self._cond:
            if self._spool is not None:
                self._spool.close()

    def __len__(self) -> int:
        return len(self._items) + len(self._inflight)
