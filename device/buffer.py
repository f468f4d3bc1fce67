"""The device's outbox: messages wait here while the broker (or edge) cannot be reached.

Bounded in messages and in bytes: when full, the oldest waiting message is dropped and
counted, so a long outage costs the oldest frames rather than the device's memory or disk.
With a spool directory
(:class:`~ddnn.device.spool.Spool`) every message is written to disk first and stays there
until the broker acknowledged it (PUBACK), not merely until the MQTT client took it: a crash,
SIGKILL or power cut of the agent loses nothing that was put, and what was in flight is sent
again after a restart (at least once; the edge drops duplicates).
"""

from __future__ import annotations

import collections
import logging
import threading
from pathlib import Path

from ddnn.device.message import DELIVERED, OutMessage, Receipt
from ddnn.device.spool import Spool
from ddnn.device.spool_run import SpoolRun
from ddnn.errors import ConfigError
from ddnn.plumbing.throttle import LogThrottle

log = logging.getLogger(__name__)


class Outbox:
    """A bounded FIFO of :class:`OutMessage`, optionally kept on disk until acknowledged.

    The sender peeks the oldest waiting message, hands it to the transport and reports the
    transport's receipt with :meth:`taken`; :meth:`settle` then forgets every message whose
    receipt says the broker acknowledged it. Without a spool a taken message is forgotten at
    once (the MQTT client holds it in memory, as the process does). ``len()`` counts the
    messages waiting plus those taken but not acknowledged (spool only). ``max_bytes`` bounds
    the payloads held (waiting, and with a spool awaiting their acknowledgement too); ``run``
    is the spool's owner (:mod:`~ddnn.device.spool_run`).
    """

    def __init__(self, capacity: int = 10_000, spool: str | Path | None = None, *,
                 sync_every: int = 64, sync_interval: float = 0.2,
                 max_bytes: int | None = None, run: SpoolRun | None = None):
        if capacity < 1:
            raise ConfigError("the outbox needs room for at least one message")
        if max_bytes is not None and max_bytes < 1:
            raise ConfigError("the outbox needs room for at least one byte")
        self.capacity, self.max_bytes = capacity, max_bytes
        self._bytes = 0  # payloads held: waiting, and in flight (spool)
        self.dropped = 0
        # Messages handed to the transport whose acknowledgement never came while the spool
        # was at its bound: released from the disk (the MQTT client still holds them).
        self.unspooled = 0
        self._drops_log = LogThrottle(every=1000)  # the first drop, then one in a thousand
        self._unspooled_log = LogThrottle(every=1000)
        self._items: collections.deque[tuple[int, OutMessage]] = collections.deque()
        self._inflight: collections.deque[tuple[int, Receipt, int]] = collections.deque()
        self._cond = threading.Condition()
        self._seq = 0
        self._spool = None
        if spool:
            # A segment stays until its last message is done: smaller ones keep the disk near
            # the bound.
            segment = min(4 << 20, max(64 << 10, (max_bytes or 4 << 23) // 8))
            self._spool = Spool(spool, sync_every=sync_every, sync_interval=sync_interval,
                                segment_bytes=segment, run=run)
            self._items.extend(self._spool.recovered)
            self._bytes = sum(len(m.payload) for _, m in self._items)
            self._spool.recovered = []
            self._seq = self._spool.next_seq
            while self._items and self._full(0):
                self._drop_oldest()

    @property
    def spooled(self) -> bool:
        return self._spool is not None

    def _full(self, adding: int) -> bool:
        """Whether ``adding`` more bytes (and a message) would go past a bound."""
        return (len(self._items) + (adding > 0) > self.capacity
                or (self.max_bytes is not None and self._bytes + adding > self.max_bytes))

    def _drop_oldest(self) -> None:
        seq, dropped = self._items.popleft()
        self._bytes -= len(dropped.payload)
        self.dropped += 1
        if self._spool:
            self._spool.done(seq)
        if self._drops_log():
            log.warning("outbox full (%d messages, %d bytes at most): dropped the oldest "
                        "message (%d so far)", self.capacity, self.max_bytes or 0, self.dropped)

    def put(self, msg: OutMessage) -> None:
        with self._cond:
            while self._items and self._full(len(msg.payload) or 1):
                self._drop_oldest()
            self._unpin()
            seq = self._seq
            self._seq += 1
            if self._spool:
                self._spool.append(seq, msg)
            self._items.append((seq, msg))
            self._bytes += len(msg.payload)
            self._cond.notify()

    def _unpin(self) -> None:
        """Keep the spool's disk near the byte bound: a segment stays while one message of it
        is not done, so old messages handed over and never acknowledged (a broker that takes
        and never answers) could pin segment after segment. Past the bound plus two segments,
        the oldest of them are released from the disk (oldest first, counted)."""
        spool = self._spool
        if spool is None or self.max_bytes is None:
            return
        while self._inflight and spool.bytes > self.max_bytes + 2 * spool.segment_bytes:
            seq, _, size = self._inflight.popleft()
            self._bytes -= size
            spool.done(seq)
            self.unspooled += 1
            if self._unspooled_log():
                log.warning("spool at its bound: released %d unacknowledged messages from the "
                            "disk (the MQTT client still holds them; a crash would lose them)",
                            self.unspooled)

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
            seq, taken = self._items.popleft()
            size = len(taken.payload)
            if self._spool is not None and not receipt.is_published():
                self._inflight.append((seq, receipt, size))  # still held: on disk
            else:
                self._bytes -= size
                if self._spool is not None:
                    self._spool.done(seq)
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
                seq, _, size = self._inflight.popleft()
                self._bytes -= size
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
