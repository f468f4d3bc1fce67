"""Assembling frames from the views that arrive, within a latency budget.

A frame opens when its first message arrives. It is ready for the local exit as soon as every
device expected to report has sent its scores (or said "absent"), or when its wait runs out: a
missing or dead device never blocks a frame, the frame is fused over the views present (the
paper's fault-tolerance result). The wait adapts to the devices: at least ``deadline`` after the
first view, longer when a device still awaited usually lags
(:class:`~ddnn.edge.arrivals.ArrivalLag`), never longer than ``max_wait``. Devices are expected
unless their status says offline (the last will), or they missed ``suspect_after`` waits in a
row; any message revives them. Feature pulls get their own deadline.

Bounded whatever the devices send: frame ids more than ``window`` ahead of the newest frame any
device is at are refused (one message moves the window by at most ``window``), at most
``max_open`` frames wait at once, and answered frames are forgotten smallest id first, so no
single frame id, however large, makes later frames look old. Thread-safe: messages arrive on
the MQTT thread, waits are checked on the worker.
"""

from __future__ import annotations

import heapq
import threading
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np

from ddnn.edge.arrivals import ArrivalLag

SCORES, FEATURES, DONE = "scores", "features", "done"
WINDOW = 1_000_000  # frame ids this far ahead of every device's newest are refused ("ahead")
MAX_OPEN = 4096  # frames waiting at once; a message opening one more is refused ("overload")


class Drop(Exception):
    """A message that is valid but not wanted; ``reason`` is the metric label.

    ``view`` and ``lag`` (seconds after its frame's first view) say who was late, and by how
    much, for the warning and the per-device counter.
    """

    def __init__(self, reason: str, detail: str = "", *, view: int | None = None,
                 lag: float | None = None):
        super().__init__(detail or reason)
        self.reason, self.view, self.lag = reason, view, lag


@dataclass
class Frame:
    """One frame being assembled from per-view messages."""

    id: int
    captured: float  # earliest wall-clock capture time among the views (for latency)
    opened: float  # monotonic time of its first message (the scores wait runs from here)
    deadline: float = float("inf")  # when it stops waiting (scores: rechecked when it comes)
    stage: str = SCORES
    scores: dict[int, np.ndarray] = field(default_factory=dict)
    absent: set[int] = field(default_factory=set)
    features: dict[int, np.ndarray] = field(default_factory=dict)
    requested: tuple[int, ...] = ()
    missing: set[int] = field(default_factory=set)  # views expected but not heard by the deadline
    taken: bool = False  # handed to the worker: its views are frozen until it is given back
    pipeline: object = None  # the ExitPipeline (bundle version) it runs on, pinned at its start
    local: object = None  # the local exit's answer, kept for when no features arrive
    # Monotonic times for the latency breakdown: its first message (``opened`` moves when the
    # broker comes back), when it became ready for its current stage (its last view, or its
    # deadline), and when its features were pulled.
    first_at: float = 0.0
    ready_at: float = 0.0
    pulled_at: float = 0.0

    @property
    def present(self) -> list[int]:
        """Views that sent scores: the views the local and edge exits fuse over."""
        return sorted(self.scores)

    def take(self, now: float) -> Frame:
        """Ready for its stage: handed to the worker, out of the deadline watch until it is
        given back."""
        self.deadline = float("inf")
        self.taken = True
        self.ready_at = now
        return self


class FrameAssembler:
    """Per-frame bookkeeping of which views arrived, with deadlines and dead-device tracking."""

    def __init__(self, views: int, deadline: float = 0.2, feature_deadline: float = 0.5,
                 suspect_after: int = 3, history: int = 65536, single_view: bool = False,
                 max_wait: float | None = None, window: int = WINDOW, max_open: int = MAX_OPEN):
        self.views = views
        self.deadline, self.feature_deadline = deadline, feature_deadline
        # The latency budget: None (or less than deadline) is the fixed deadline of old.
        self.max_wait = deadline if max_wait is None else max(max_wait, deadline)
        self.suspect_after = suspect_after
        self.single_view = single_view
        self.window, self.max_open = window, max_open
        self.lag = ArrivalLag(views)
        self._frames: dict[int, Frame] = {}
        self._done: dict[int, tuple[tuple[int, ...], float]] = {}  # id -> (requested, opened)
        self._done_ids: list[int] = []  # heap of the ids in _done: forgotten smallest first
        self._history = history
        self._low_water = -1  # frames at or below this id are forgotten: anything for them is late
        self._newest: int | None = None  # newest frame id any device has opened or joined
        self._offline = [False] * views
        self._misses = [0] * views
        self._expected = tuple(range(views))  # what expected() says, kept up to date
        # Devices in push mode send features unasked; the edge learns it from the first ones.
        self.pushing = [False] * views
        self._lock = threading.Lock()

    # --- devices ----------------------------------------------------------------------------

    def set_online(self, view: int, online: bool, pushing: bool | None = None) -> None:
        """The device of ``view`` says it is online or offline (its status, or its last will);
        ``pushing``: whether it sends its features with every frame (push mode), when it
        says."""
        with self._lock:
            self._offline[view] = not online
            self._misses[view] = 0
            self._update_expected()
        if pushing is not None:
            self.pushing[view] = pushing

    def expected(self) -> list[int]:
        """Views a frame waits for right now: their devices are believed alive."""
        return list(self._expected)

    def _update_expected(self) -> None:
        """The one rule of who is expected: not offline, and not silent ``suspect_after``
        waits in a row (called under the lock whenever either changes)."""
        self._expected = tuple(v for v in range(self.views)
                               if not self._offline[v] and self._misses[v] < self.suspect_after)

    # --- messages ---------------------------------------------------------------------------

    def _frame(self, frame: int, now: float, captured: float, view: int) -> Frame:
        f = self._frames.get(frame)
        if f is None:
            if frame in self._done or frame <= self._low_water:
                lag = now - self._done[frame][1] if frame in self._done else None
                if lag is not None:
                    self.lag.observe(view, lag, late=True)
                raise Drop("late", f"frame {frame} is already answered", view=view, lag=lag)
            if self._newest is not None and frame > self._newest + self.window:
                raise Drop("ahead", f"frame {frame} is more than {self.window} frames ahead of "
                                    f"the newest ({self._newest})", view=view)
            if len(self._frames) >= self.max_open:
                raise Drop("overload", f"{len(self._frames)} frames already wait", view=view)
            f = self._frames[frame] = Frame(frame, captured, now, first_at=now)
        elif captured < f.captured:
            f.captured = captured
        if self._newest is None or frame > self._newest:
            self._newest = frame
        return f

    def _heard(self, view: int) -> None:
        if self._offline[view] or self._misses[view]:  # (the hot path: most views are alive)
            self._offline[view] = False
            self._misses[view] = 0
            self._update_expected()

    def add_scores(self, view: int, frame: int, scores: np.ndarray | None, captured: float,
                   now: float) -> Frame | None:
        """Scores (or ``None`` for an absent view) of one view; returns the frame if now ready."""
        with self._lock:
            self._heard(view)
            f = self._frame(frame, now, captured, view)
            if view in f.scores or view in f.absent:
                raise Drop("duplicate", f"view {view} of frame {frame} arrived twice")
            if f.stage != SCORES or f.taken:
                self.lag.observe(view, now - f.opened, late=True)
                raise Drop("late", f"view {view} of frame {frame} came after its deadline",
                           view=view, lag=now - f.opened)
            self.lag.observe(view, now - f.opened)
            if scores is None:
                f.absent.add(view)
            else:
                f.scores[view] = scores
            awaited = self._awaited(f)
            if not awaited:
                return f.take(now)
            f.deadline = self._scores_deadline(f, awaited)
            return None

    def add_features(self, view: int, frame: int, features: np.ndarray, captured: float,
                     now: float) -> Frame | None:
        """Features of one view (pulled, pushed, or a one-view device's uplink)."""
        with self._lock:
            self._heard(view)
            if frame in self._done and view not in self._done[frame] and not self.single_view:
                # Pushed features of a frame that exited locally are the price of push mode.
                reason = "unneeded" if self.pushing[view] else "unrequested"
                raise Drop(reason, f"features of view {view} for answered frame {frame}")
            if (not self.single_view and frame not in self._frames and frame not in self._done
                    and frame > self._low_water):
                # Never open a frame on features (pulled by an edge that restarted since).
                raise Drop("unrequested", f"features of view {view} for unknown frame {frame}")
            f = self._frame(frame, now, captured, view)
            if view in f.features:
                raise Drop("duplicate", f"features of view {view} of frame {frame} arrived twice")
            if self.single_view:
                # A one-view device sends features only for frames it did not exit itself.
                f.scores.setdefault(view, np.zeros(0, np.float32))
                f.features[view] = features
                f.stage, f.requested = FEATURES, (view,)
                return f.take(now)
            if f.stage == SCORES and view not in f.scores:
                raise Drop("unrequested", f"features of view {view} before its scores")
            if f.stage == SCORES and not f.taken:
                # Features before the local exit decided anything: the device pushes them.
                # (A frame the worker holds may be pulled already: that answer can come first.)
                self.pushing[view] = True
            if f.stage == FEATURES and f.taken:
                raise Drop("late", f"features of view {view} of frame {frame} after the deadline")
            if f.stage == FEATURES and view not in f.requested:
                raise Drop("unrequested", f"features of view {view} were not pulled")
            f.features[view] = features
            if f.stage == FEATURES and all(v in f.features for v in f.requested):
                return f.take(now)
            return None

    def _awaited(self, f: Frame) -> list[int]:
        """Views ``f`` still waits for: expected, not arrived, and not hopelessly late."""
        hopeless, budget, scores, absent = self.lag.hopeless, self.max_wait, f.scores, f.absent
        return [v for v in self._expected if v not in scores and v not in absent
                and not hopeless(v, budget)]

    # --- the worker's side ------------------------------------------------------------------

    def await_features(self, f: Frame, views: list[int], now: float) -> Frame | None:
        """Move a frame to the feature stage; returns it at once if nothing needs pulling."""
        with self._lock:
            f.stage, f.requested = FEATURES, tuple(views)
            f.pulled_at = now
            if all(v in f.features for v in views):
                return f.take(now)
            f.deadline = now + self.feature_deadline
            f.taken = False
            return None

    def finish(self, f: Frame) -> None:
        with self._lock:
            f.stage = DONE
            self._frames.pop(f.id, None)
            if f.id not in self._done:
                heapq.heappush(self._done_ids, f.id)
            self._done[f.id] = (f.requested, f.opened)
            while len(self._done) > self._history:
                old = heapq.heappop(self._done_ids)
                del self._done[old]
                self._low_water = max(self._low_water, old)

    def _scores_deadline(self, f: Frame, awaited: list[int] | None = None) -> float:
        """When ``f`` stops waiting for scores: the awaited devices' usual lag, within budget."""
        if awaited is None:
            awaited = self._awaited(f)
        if not awaited:  # only hopeless devices are missing: nothing worth waiting for
            return f.opened
        wait = min(max(self.lag.wait_for(awaited), self.deadline), self.max_wait)
        return f.opened + wait

    def expire(self, now: float) -> list[Frame]:
        """Frames whose deadline passed: ready with the views they have."""
        out = []
        with self._lock:
            for f in self._frames.values():
                if f.taken or f.deadline > now:
                    continue
                if f.stage == SCORES:
                    # The stored deadline is cheap to scan; lags learnt since may extend it.
                    f.deadline = self._scores_deadline(f)
                    if f.deadline > now:
                        continue
                    expected = self.expected()
                    f.missing = {v for v in expected if v not in f.scores and v not in f.absent}
                    for v in f.missing:
                        self._misses[v] += 1
                    self._update_expected()
                else:
                    f.missing = {v for v in f.requested if v not in f.features}
                out.append(f.take(now))
        return out

    def pending(self) -> list[Frame]:
        """Frames waiting for features (to pull again after a reconnection)."""
        with self._lock:
            return [f for f in self._frames.values() if f.stage == FEATURES and not f.taken]

    def extend_deadlines(self, now: float) -> None:
        """Restart every waiting frame's clock (after the broker was unreachable)."""
        with self._lock:
            for f in self._frames.values():
                if f.taken:
                    continue
                if f.stage == SCORES:
                    f.opened = now
                    f.deadline = self._scores_deadline(f)
                else:
                    f.deadline = now + self.feature_deadline

    def next_deadline(self) -> float:
        with self._lock:
            return min((f.deadline for f in self._frames.values() if not f.taken),
                       default=float("inf"))

    def late_views(self) -> list[int]:
        """Views whose devices are late for most of their recent views (for health checks)."""
        with self._lock:
            return self.lag.systematically_late()

    def why_missing(self, f: Frame, fused: Collection[int]) -> dict[int, str]:
        """Why each view not in ``fused`` is missing from ``f``'s answer (the Result's reasons)."""
        out = {}
        for v in range(self.views):
            if v in fused:
                continue
            if v in f.absent:
                out[v] = "absent"
            elif v in f.scores:
                out[v] = "no_features"
            else:
                out[v] = "late" if v in self._expected else "offline"
        return out

    def knows(self, frame: int) -> bool:
        """The frame is being assembled or was answered (anything for it is handled here)."""
        with self._lock:
            return frame in self._frames or frame in self._done or frame <= self._low_water

    def __len__(self) -> int:
        return len(self._frames)
