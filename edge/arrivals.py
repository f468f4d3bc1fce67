"""How late each device's views arrive: the edge's running estimate of per-device lag.

A view's *lag* is how long after the first view of the same frame it arrived at the edge. It
has many causes: devices that started a replay apart, a busy board or gateway, a slow link.
The :class:`FrameAssembler` holds a frame open long enough for the devices that are alive
(:meth:`ArrivalLag.wait_for`), within the latency budget ``max_wait``, instead of a fixed deadline
from the first arrival; a device that usually lags more than the whole budget is not waited
for at all (:meth:`ArrivalLag.hopeless`). The estimate is a decaying maximum: one slow view
raises it at once (the next frames wait for that device), and it decays by ``decay`` per later
view, so a device that catches up stops costing latency. Views that still came after their
frame was answered are counted per device; a device late for most of its recent views is
*systematically late*.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable

MARGIN = 1.25  # wait this much longer than the estimate...
SLACK = 0.02  # ...plus this many seconds (scheduling jitter of the edge itself)
RECENT = 50  # views per device over which lateness is judged
SYSTEMATIC = 0.5  # late for more than this share of its recent views (and at least 10 of them)


class ArrivalLag:
    """Per-view lag estimates (seconds) and lateness statistics. Not thread-safe: the assembler
    calls it under its lock."""

    def __init__(self, views: int, decay: float = 0.95):
        self.decay = decay
        self.estimate = [0.0] * views
        self._recent: list[collections.deque[bool]] = [collections.deque(maxlen=RECENT)
                                                       for _ in range(views)]
        self.late = [0] * views  # views that came after their frame was answered, in total

    def observe(self, view: int, lag: float | None, *, late: bool = False) -> None:
        """A view of ``view`` arrived ``lag`` seconds after its frame's first view (None: a
        lag that says nothing of the device, counted late or not but not learnt)."""
        if lag is not None:
            self.estimate[view] = max(max(lag, 0.0), self.estimate[view] * self.decay)
        self._recent[view].append(late)
        if late:
            self.late[view] += 1

    def hopeless(self, view: int, budget: float) -> bool:
        """The device of ``view`` usually lags more than ``budget``: waiting for it buys nothing
        but latency (its views come after their frames are answered, counted late)."""
        return self.estimate[view] > budget

    def wait_for(self, views: Iterable[int]) -> float:
        """How long after a frame's first view to wait for ``views``: their estimates, with
        a margin. 0 when there is nothing to wait for."""
        worst = max((self.estimate[v] for v in views), default=None)
        return 0.0 if worst is None else worst * MARGIN + SLACK

    def systematically_late(self) -> list[int]:
        """Views late for most of their recent views."""
        return [v for v, recent in enumerate(self._recent)
                if len(recent) >= 10 and sum(recent) > SYSTEMATIC * len(recent)]
