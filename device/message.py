"""What the device sends, and what a transport gives back for it.

An :class:`OutMessage` goes into the outbox (:mod:`~ddnn.device.buffer`), onto the disk
(:mod:`~ddnn.device.spool`) and out through a transport (:mod:`~ddnn.device.transport`); the
transport answers with a :class:`Receipt` that says when the peer acknowledged it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class OutMessage:
    """A message to send: its kind (``scores``, ``absent``, ``skipped``, ``features`` or
    ``results``: which topic or route), body, and the frame it belongs to."""

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
