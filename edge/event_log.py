"""The edge's log as an observer of its events: the lines an operator needs, one per cause.

A device that keeps sending views too late, or that is flagged for its conduct
(:mod:`ddnn.edge.conduct`), gets a line the first time; the metrics count the rest.
"""

from __future__ import annotations

import logging

from ddnn.edge.events import EdgeEvents
from ddnn.plumbing.throttle import LogThrottle

log = logging.getLogger(__name__)


class EdgeLog(EdgeEvents):
    """Logs what the edge's events say of its devices; ``budget``: the latency budget (s)."""

    def __init__(self, budget: float):
        self.budget = budget
        self._late = LogThrottle()  # a late device: one line each, the counter says the rest

    def on_dropped(self, reason: str, device: str | None = None,
                   lag: float | None = None) -> None:
        if reason == "late" and device is not None and self._late(device):
            log.warning("device %s: a view came %s after its frame's first view, too late to be "
                        "fused (the frame waits at most %.0f ms); later ones are counted in "
                        "ddnn_edge_late_views_total", device,
                        "?" if lag is None else f"{lag * 1000:.0f} ms", self.budget * 1000)

    def on_flag(self, device: str, reason: str, flagged: bool) -> None:
        if not flagged:
            log.info("device %s is no longer flagged (%s)", device, reason)
        elif reason == "ahead":
            log.warning("device %s runs ahead of the other devices (its views come more than "
                        "%.0f ms before theirs, or faster than --max-fps alone): flagged, not "
                        "waited for, its views not fused", device, self.budget * 1000)
        elif reason == "details":
            log.warning("device %s has not answered the last detail pulls: passed over for "
                        "details (its slot left empty, no frame waits for it) but for a probe "
                        "now and then", device)
        elif reason == "scores":
            log.warning("device %s sends class scores out of the bundle's bounds: flagged, "
                        "not waited for, its views not fused", device)
        else:
            log.warning("device %s stamps its views far from the other views of their frames "
                        "(its clock is off): flagged; its capture times are not used for "
                        "latency", device)
