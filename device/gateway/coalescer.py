"""What a gateway holds back to send together: the devices' messages of one frame.

The edge cannot answer a frame before its last view arrives, so a gateway that waits for the
last of its devices' messages of a frame before forwarding them adds next to nothing to the
answer's latency, and saves one MQTT and one TCP/IP header per device on the uplink. A group
(scores and absent messages of a frame, or the features of a frame) goes as soon as every
device expected in it sent its message, else ``window`` seconds after its first message.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

Key = tuple[str, int]  # ("scores" | "features", frame)


@dataclass
class Group:
    """The messages of one kind and frame received so far."""

    key: Key
    due: float  # monotonic time it goes even if incomplete
    entries: list[tuple[str, bytes, Any]] = field(default_factory=list)  # (device, data, tag)
    devices: set[str] = field(default_factory=set)
    complete: bool = False  # every expected device sent (else: its window ended)


class Coalescer:
    """Groups messages by (kind, frame); ``expected(key)`` names the devices a group waits for
    (an empty set: wait for the window). Thread-safe; ``flush`` is called with ready groups,
    from the adding thread when a group completes, from :meth:`run` when a window ends."""

    def __init__(self, window: float, expected: Callable[[Key], set[str]],
                 flush: Callable[[list[Group]], None], max_groups: int = 10_000):
        self.window, self._expected, self._flush = window, expected, flush
        self.max_groups = max_groups  # a flood of frames must not grow memory without bound
        self._groups: dict[Key, Group] = {}
        self._cond = threading.Condition()
        self._stopped = False

    def add(self, key: Key, device: str, data: bytes, tag: Any = None) -> None:
        """One device message; ``tag`` comes back with it in the flushed group."""
        with self._cond:
            group = self._groups.get(key)
            if group is None:
                group = self._groups[key] = Group(key, time.monotonic() + self.window)
                self._cond.notify()
            group.entries.append((device, data, tag))
            group.devices.add(device)
            want = self._expected(key)
            group.complete = bool(want) and want <= group.devices
            ready = [self._groups.pop(key)] if group.complete else []
            if len(self._groups) > self.max_groups:  # the oldest goes now
                ready.append(self._groups.pop(min(self._groups, key=lambda k: self._groups[k].due)))
        if ready:
            self._flush(ready)

    def due(self, now: float) -> list[Group]:
        """Take the groups whose window ended by ``now``."""
        with self._cond:
            keys = [k for k, g in self._groups.items() if g.due <= now]
            return [self._groups.pop(k) for k in keys]

    def run(self) -> None:
        """Flush groups as their windows end, until :meth:`stop` (then everything held)."""
        while True:
            with self._cond:
                if self._stopped:
                    break
                nearest = min((g.due for g in self._groups.values()), default=None)
                delay = None if nearest is None else max(nearest - time.monotonic(), 0)
                if delay is None or delay > 0:
                    self._cond.wait(delay)
            self._flush_safely(self.due(time.monotonic()))
        self._flush_safely(self.due(float("inf")))

    def _flush_safely(self, groups: list[Group]) -> None:
        if not groups:
            return
        try:
            self._flush(groups)
        except Exception:  # a bug in one flush must not stop every later one
            log.exception("flushing %d groups failed", len(groups))

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def __len__(self) -> int:
        with self._cond:
            return len(self._groups)
