"""Devices that misbehave, flagged from what they recently sent (docs/security.md).

The edge judges some of a device's messages, each for one reason: ``ahead`` (a view that ran
ahead of the other devices' views of its frame by more than the latency budget, see
:mod:`ddnn.edge.runahead`), ``scores`` (class scores out of the bounds the bundle allows). A
device is *flagged* for a reason while most of its recent judged messages were bad, and at least
:data:`EVIDENCE` of them: a device flagged ``ahead`` or ``scores`` is not waited for and cannot
open or close a frame; one flagged ``clock`` (capture times far from its frames' other views',
:meth:`ddnn.edge.frame.Frame.settle_capture`) is still fused, but its capture times are not
trusted for latency. The edge says so in its metrics and health. Good messages clear the flag
again, so a device that was wrong for a while (a clock that jumped, a replay started too early)
comes back by itself. The edge's log and metrics say so through its events
(``on_flag``, :mod:`ddnn.edge.events`). Not thread-safe: the assembler calls it under its lock.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

RECENT = 50  # judged messages per device and reason the verdict looks at
EVIDENCE = 10  # bad ones at least before a device is flagged (a few can be bad luck)
REASONS = ("ahead", "scores", "clock")
EXCLUDING = ("ahead", "scores")  # a device flagged for these is not waited for, nor fused


class Conduct:
    """Per device and reason, the verdicts on its recent messages, and the flags they give;
    ``on_change(view, reason, flagged)`` is told of every flag raised or cleared."""

    def __init__(self, views: int, on_change: Callable[[int, str, bool], None]):
        self._recent: dict[tuple[int, str], collections.deque[bool]] = {}
        self._bad: dict[tuple[int, str], int] = {}
        self.flags: list[set[str]] = [set() for _ in range(views)]
        self.on_change = on_change

    def good(self, view: int, reason: str) -> None:
        """A message of ``view`` judged good. Counted only while the device has bad ones on
        record (the hot path of a well-behaved device costs one dictionary lookup)."""
        if (view, reason) in self._recent:
            self._note(view, reason, False)

    def bad(self, view: int, reason: str) -> None:
        self._note(view, reason, True)

    def flagged(self, view: int, reason: str | None = None) -> bool:
        """Whether ``view`` is flagged for ``reason`` (None: for one that excludes it)."""
        flags = self.flags[view]
        if reason is None:
            return bool(flags) and any(r in flags for r in EXCLUDING)
        return reason in flags

    def _note(self, view: int, reason: str, bad: bool) -> None:
        key = (view, reason)
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = collections.deque(maxlen=RECENT)
            self._bad[key] = 0
        if len(recent) == recent.maxlen:
            self._bad[key] -= recent[0]
        recent.append(bad)
        self._bad[key] += bad
        n = self._bad[key]
        flagged = n >= EVIDENCE and 2 * n > len(recent)
        if not n:  # nothing bad on record any more: back to the cheap path
            del self._recent[key], self._bad[key]
        if flagged != (reason in self.flags[view]):
            (self.flags[view].add if flagged else self.flags[view].discard)(reason)
            self.on_change(view, reason, flagged)
