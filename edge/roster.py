"""The devices a frame waits for, and how each is doing: the device side of the
:class:`~ddnn.edge.assembler.FrameAssembler`.

Devices are expected unless their status says offline (the last will), they missed
``suspect_after`` waits in a row, or they are flagged (:mod:`ddnn.edge.conduct`); any message
revives a silent one. Each device's lag behind its frames' first views is learnt
(:class:`~ddnn.edge.arrivals.ArrivalLag`), and a device that runs ahead of the others opens no
frame alone (:mod:`ddnn.edge.runahead`): its views of frames not yet open are held here until
another device opens the frame, or refused once held past the budget.

The roster reports what it judges through the edge's events (:mod:`ddnn.edge.events`): a held
view refused (``on_refused``), a device flagged or cleared (``on_flag``).
The frame assembler shares the roster's lock and holds it whenever it calls the methods
documented as called under it.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass

from ddnn.edge.arrivals import ArrivalLag
from ddnn.edge.conduct import Conduct
from ddnn.edge.events import NO_EVENTS, EdgeEvents
from ddnn.edge.frame import Drop, Frame, Scores
from ddnn.edge.runahead import MAX_FPS, RunAhead


@dataclass(frozen=True)
class DeviceRules:
    """How the roster judges devices: ``suspect_after`` waits missed in a row and a device is
    no longer expected; ``max_fps``: the pace of a device alone (:mod:`ddnn.edge.runahead`)."""

    suspect_after: int = 3
    max_fps: float = MAX_FPS


class DeviceRoster:
    """Who is expected, who lags, who runs ahead and who is flagged, per view (``devices``:
    the device of each view, for the events; view numbers without them)."""

    def __init__(self, views: int, max_wait: float, rules: DeviceRules = DeviceRules(), *,
                 single_view: bool = False, events: EdgeEvents = NO_EVENTS,
                 devices: Sequence[str] = ()):
        self.views, self.max_wait = views, max_wait
        self.suspect_after, self.single_view = rules.suspect_after, single_view
        self.devices = list(devices) or [str(v) for v in range(views)]
        self.events = events
        self.lag = ArrivalLag(views)
        self.runahead = RunAhead(views, max_wait, rules.max_fps)
        self.conduct = Conduct(views, on_change=self._flag_changed)
        self._offline = [False] * views
        self._misses = [0] * views
        self.expecting = tuple(range(views))  # what expected() says, kept up to date
        # Devices in push mode send features unasked; the edge learns it from the first ones.
        self.pushing = [False] * views
        self.lock = threading.Lock()  # (the frame assembler's too)

    def set_online(self, view: int, online: bool, pushing: bool | None = None) -> None:
        """The device of ``view`` says it is online or offline (its status, or its last will);
        ``pushing``: whether it sends its features with every frame (push mode), when it
        says."""
        with self.lock:
            self._offline[view] = not online
            self._misses[view] = 0
            self._update_expected()
        if pushing is not None:
            self.pushing[view] = pushing

    def expected(self) -> list[int]:
        """Views a frame waits for right now: their devices are believed alive."""
        return list(self.expecting)

    def flagged(self) -> dict[int, list[str]]:
        """The flagged devices' views, and why (for the health checks)."""
        with self.lock:
            return {v: sorted(r) for v, r in enumerate(self.conduct.flags) if r}

    def late_views(self) -> list[int]:
        """Views whose devices are late for most of their recent views (for health checks)."""
        with self.lock:
            return self.lag.systematically_late()

    def why_missing(self, f: Frame, fused: Collection[int]) -> dict[int, str]:
        """Why each view not in ``fused`` is missing from ``f``'s answer (the Result's reasons)."""
        out = {}
        for v in range(self.views):
            if v in fused:
                continue
            if v in f.absent:
                out[v] = "skipped" if v in f.skipped else "absent"
            elif v in f.scores:
                out[v] = "no_features"
            elif v in f.refused or self.conduct.flagged(v):
                out[v] = "refused"
            else:
                out[v] = "late" if v in self.expecting else "offline"
        return out

    def _update_expected(self) -> None:
        """The one rule of who is expected: not offline, not silent ``suspect_after`` waits
        in a row, not flagged (called under the lock whenever one changes)."""
        flagged = self.conduct.flagged
        self.expecting = tuple(v for v in range(self.views)
                               if not self._offline[v] and self._misses[v] < self.suspect_after
                               and not flagged(v))

    def _flag_changed(self, view: int, reason: str, flagged: bool) -> None:
        self._update_expected()
        self.events.on_flag(self.devices[view], reason, flagged)

    # --- called under the lock, by the frame assembler ----------------------------------------

    def heard(self, view: int) -> None:
        if self._offline[view] or self._misses[view]:  # (the hot path: most views are alive)
            self._offline[view] = False
            self._misses[view] = 0
            self._update_expected()

    def missed(self, views: set[int]) -> None:
        """``views`` were waited for in vain."""
        for v in views:
            self._misses[v] += 1
        self._update_expected()

    def on_time(self, view: int, frame: int, lag: float, now: float) -> None:
        """A view of ``view`` opened or joined ``frame``, ``lag`` seconds after its first view."""
        self.lag.observe(view, lag)
        self.runahead.taken(view, frame, now)
        self.conduct.good(view, "ahead")

    def settle(self, f: Frame) -> None:
        """``f``'s views are all in: its capture time from those that agree, and each device
        judged for its clock (one far from the others' is not trusted for latency)."""
        for view, trusted in f.settle_capture():
            (self.conduct.good if trusted else self.conduct.bad)(view, "clock")

    def observe_late(self, view: int, lag: float, opener: int, frame: int, now: float) -> None:
        """A view came after its frame was answered or taken: counted late (and it did not run
        ahead). Its lag is learnt unless a flagged device opened the frame (then the lag is that
        device's lead). Its device is no reference for who runs ahead: it is behind."""
        self.lag.observe(view, None if self.conduct.flagged(opener) else lag, late=True)
        self.conduct.good(view, "ahead")

    # --- devices that run ahead ---------------------------------------------------------------

    def holds(self, view: int, frame: int, captured: float, now: float) -> bool:
        """Whether a view of ``frame`` (not open) is held: its device is flagged, or runs
        ahead of the others."""
        if self.single_view:
            return False
        return self.conduct.flagged(view) or self.runahead.ahead(view, frame, captured, now,
                                                                 self.expecting)

    def hold(self, view: int, frame: int, scores: Scores | None, captured: float,
             now: float, skipped: bool = False) -> None:
        if self.runahead.is_held(view, frame):
            raise Drop("duplicate", f"view {view} of frame {frame} arrived twice")
        for _ in self.runahead.hold(view, frame, scores, captured, now, skipped):
            self.ran_ahead(view)

    def ran_ahead(self, view: int) -> None:
        """A held view dropped after the fact: it ran ahead."""
        self.conduct.bad(view, "ahead")
        self.events.on_refused(self.devices[view], "ahead")

    def expire_held(self, now: float) -> None:
        """Views held past the budget ran ahead. Where no other device reports at all, the
        devices expected are silent: each such view counts as a wait they missed."""
        aged = self.runahead.aged(now)
        for view, _ in aged:
            self.ran_ahead(view)
            others = [v for v in self.expecting if v != view]
            if others and not self.runahead.peers(others, now):
                for v in others:
                    self._misses[v] += 1
        if aged:
            self._update_expected()
