"""The device's outbox: messages wait here while the broker (or edge) cannot be reached.

Bounded: when full, the oldest message is dropped and counted, so a long outage costs the
oldest frames rather than the device's memory. With a spool directory every message is also a
file until it is handed to the transport, so a restart of the agent loses nothing either.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

from ddnn.errors import ConfigError

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class OutMessage:
    """A message to send: its kind (``scores``, ``absent``, ``features`` or ``results``: which
    topic or route), body, and the frame it belongs to."""

    kind: str
    payload: bytes
    frame: int = -1


class Outbox:
    """A bounded FIFO of :class:`OutMessage`, optionally mirrored on disk."""

    def __init__(self, capacity: int = 10_000, spool: str | Path | None = None):
        if capacity < 1:
            raise ConfigError("the outbox needs room for at least one message")
        self.capacity = capacity
        self.dropped = 0
        self._items: collections.deque[tuple[int, OutMessage]] = collections.deque()
        self._cond = threading.Condition()
        self._seq = 0
        self._spool = Path(spool) if spool else None
        if self._spool:
            self._spool.mkdir(parents=True, exist_ok=True)
            self._recover()

    def _recover(self) -> None:
        assert self._spool is not None
        for f in sorted(self._spool.glob("*.msg")):
            try:
                seq = int(f.stem)
                data = f.read_bytes()
                kind_len = data[0]
                kind = data[1 : 1 + kind_len].decode()
                frame = int.from_bytes(data[1 + kind_len : 9 + kind_len], "little", signed=True)
                msg = OutMessage(kind, data[9 + kind_len :], frame)
            except (ValueError, IndexError, UnicodeDecodeError, OSError):
                log.warning("spool: dropping unreadable %s", f.name)
                f.unlink(missing_ok=True)
                continue
            self._items.append((seq, msg))
            self._seq = max(self._seq, seq + 1)
        if self._items:
            log.info("spool: %d messages recovered from %s", len(self._items), self._spool)
        while len(self._items) > self.capacity:
            self._drop_oldest()

    def _path(self, seq: int) -> Path:
        assert self._spool is not None
        return self._spool / f"{seq:016d}.msg"

    def _drop_oldest(self) -> None:
        seq, _ = self._items.popleft()
        self.dropped += 1
        if self._spool:
            self._path(seq).unlink(missing_ok=True)
        if self.dropped == 1 or self.dropped % 1000 == 0:
            log.warning("outbox full (%d): dropped the oldest message (%d so far)",
                        self.capacity, self.dropped)

    def put(self, msg: OutMessage) -> None:
        with self._cond:
            if len(self._items) >= self.capacity:
                self._drop_oldest()
            seq = self._seq
            self._seq += 1
            if self._spool:
                kind = msg.kind.encode()
                tmp = self._path(seq).with_suffix(".tmp")
                tmp.write_bytes(bytes([len(kind)]) + kind
                                + msg.frame.to_bytes(8, "little", signed=True) + msg.payload)
                os.replace(tmp, self._path(seq))  # a crash never leaves half a message
            self._items.append((seq, msg))
            self._cond.notify()

    def peek(self, timeout: float) -> OutMessage | None:
        """The oldest message without removing it, waiting up to ``timeout`` for one."""
        with self._cond:
            if not self._items:
                self._cond.wait(timeout)
            return self._items[0][1] if self._items else None

    def pop(self) -> None:
        """Remove the oldest message: the transport has taken it."""
        with self._cond:
            if self._items:
                seq, _ = self._items.popleft()
                if self._spool:
                    self._path(seq).unlink(missing_ok=True)
                self._cond.notify_all()

    def __len__(self) -> int:
        return len(self._items)
