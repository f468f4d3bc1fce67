"""Assembling frames from the views that arrive, within a latency budget.

A frame opens when its first message arrives. It is ready for the local exit as soon as every
device expected to report has sent its scores (or said "absent"), or when its wait runs out: a
missing or dead device never blocks a frame, the frame is fused over the views present (the
paper's fault-tolerance result). The wait adapts to the devices: at least ``deadline`` after the
first view, longer when a device still awaited usually lags
(:class:`~ddnn.edge.arrivals.ArrivalLag`), never longer than ``max_wait``. Devices are expected
unless their status says offline (the last will), or they missed ``suspect_after`` waits in a
row; any message revives them. Feature pulls get their own deadline.

A device that runs ahead of the others opens no frame alone (:mod:`ddnn.edge.runahead`): its
view of a frame not yet open is held until another device opens the frame, and joins it if it
was held within the budget; a device whose views keep running ahead is flagged
(:mod:`ddnn.edge.conduct`), not waited for, and its views are no longer fused. A late view of
a frame a flagged device opened says nothing about the late device's lag.

Bounded whatever the devices send: frame ids more than ``window`` ahead of the newest frame any
device is at are refused (one message moves the window by at most ``window``), at most
``max_open`` frames wait at once, and answered frames are forgotten smallest id first, so no
single frame id, however large, makes later frames look old (:class:`AnsweredFrames`).
Thread-safe: messages arrive on
the MQTT thread, waits are checked on the worker.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ddnn.edge.events import NO_EVENTS, EdgeEvents
from ddnn.edge.frame import DONE, FEATURES, SCORES, Drop, Frame, Scores
from ddnn.edge.roster import DeviceRoster, DeviceRules
from ddnn.edge.runahead import Held

WINDOW = 1_000_000  # frame ids this far ahead of every device's newest are refused ("ahead")
MAX_OPEN = 4096  # frames waiting at once; a message opening one more is refused ("overload")
HISTORY = 65536  # answered frames remembered (anything for them is late)


@dataclass(frozen=True)
class FrameBounds:
    """What bounds the assembler's memory whatever the devices send: frame ids ``window``
    ahead of the newest refused, ``max_open`` frames waiting at once, ``history`` answered
    frames remembered."""

    window: int = WINDOW
    max_open: int = MAX_OPEN
    history: int = HISTORY


@dataclass(frozen=True)
class Answered:
    """What is remembered of an answered frame: enough to tell how late a view of it is."""

    requested: tuple[int, ...]  # the views whose features it pulled
    opened: float  # monotonic time its scores' wait started
    opener: int  # the view that opened it


class AnsweredFrames:
    """The frames answered, remembered so that anything for them is late: the last ``history``
    of them, forgotten smallest id first (so no single frame id, however large, makes later
    frames look old); every id at or below the forgotten ones is answered too."""

    def __init__(self, history: int = HISTORY):
        self.history = history
        self._done: dict[int, Answered] = {}
        self._ids: list[int] = []  # heap of the ids in _done
        self.low_water = -1  # frames at or below this id are forgotten: anything for them is late

    def get(self, frame: int) -> Answered | None:
        """What is remembered of ``frame`` (None: not answered, or forgotten)."""
        return self._done.get(frame)

    def answered(self, frame: int) -> bool:
        """Answered, remembered or forgotten since."""
        return frame in self._done or frame <= self.low_water

    def add(self, f: Frame) -> None:
        if f.id not in self._done:
            heapq.heappush(self._ids, f.id)
        self._done[f.id] = Answered(f.requested, f.opened, f.opener)
        while len(self._done) > self.history:
            old = heapq.heappop(self._ids)
            del self._done[old]
            self.low_water = max(self.low_water, old)


class FrameAssembler:
    """Per-frame bookkeeping of which views arrived, with deadlines. The devices' side (who is
    expected, lags, runs ahead, is flagged) is its :attr:`roster`'s
    (:class:`~ddnn.edge.roster.DeviceRoster`), which reports through ``events``."""

    def __init__(self, views: int, deadline: float = 0.2, feature_deadline: float = 0.5, *,
                 max_wait: float | None = None, single_view: bool = False,
                 rules: DeviceRules = DeviceRules(), bounds: FrameBounds = FrameBounds(),
                 events: EdgeEvents = NO_EVENTS, devices: Sequence[str] = ()):
        # The latency budget: None (or less than deadline) is the fixed deadline of old.
        self.max_wait = deadline if max_wait is None else max(max_wait, deadline)
        self.views, self.single_view = views, single_view
        self.roster = DeviceRoster(views, self.max_wait, rules, single_view=single_view,
                                   events=events, devices=devices)
        self._lock = self.roster.lock  # (one lock: the roster is judged as frames assemble)
        self.deadline, self.feature_deadline = deadline, feature_deadline
        self.window, self.max_open = bounds.window, bounds.max_open
        self._frames: dict[int, Frame] = {}
        self.answered = AnsweredFrames(bounds.history)
        self._newest: int | None = None  # newest frame id any device has opened or joined

    # --- messages ---------------------------------------------------------------------------

    def _check_new(self, frame: int, now: float, view: int) -> None:
        """Raises the Drop of a view of ``frame`` (not open) that is late, or beyond the window."""
        if self.answered.answered(frame):
            lag = None
            done = self.answered.get(frame)
            if done is not None:
                lag = now - done.opened
                self.roster.observe_late(view, lag, done.opener, frame, now)
            raise Drop("late", f"frame {frame} is already answered", view=view, lag=lag)
        if self._newest is not None and frame > self._newest + self.window:
            raise Drop("ahead", f"frame {frame} is more than {self.window} frames ahead of "
                                f"the newest ({self._newest})", view=view)

    def _open(self, frame: int, now: float, captured: float, view: int) -> Frame:
        if len(self._frames) >= self.max_open:
            raise Drop("overload", f"{len(self._frames)} frames already wait", view=view)
        f = self._frames[frame] = Frame(frame, captured, now, first_at=now, opener=view)
        if self._newest is None or frame > self._newest:
            self._newest = frame
        for u, held in self.roster.runahead.claim(frame):
            self._join(f, u, held, now)
        return f

    def _join(self, f: Frame, view: int, held: Held, now: float) -> None:
        """A held view of a frame another device just opened: fused if it was held within the
        budget (a flagged device that keeps in step again is cleared so); else it ran ahead."""
        if now - held.arrived > self.max_wait:
            f.refused.add(view)
            self.roster.ran_ahead(view)
            return
        if held.scores is None:
            f.absent.add(view)
            if held.skipped:
                f.skipped.add(view)
        else:
            f.scores[view] = held.scores
        if held.features is not None:
            f.features[view] = held.features
        f.captures[view] = held.captured
        self.roster.on_time(view, f.id, 0.0, now)  # it came before the frame opened

    def add_scores(self, view: int, frame: int, scores: Scores | None, captured: float,
                   now: float, skipped: bool = False) -> Frame | None:
        """Scores (or ``None`` for an absent view, or one whose device ``skipped`` the frame:
        nobody waits for either) of one view; returns the frame if now ready."""
        with self._lock:
            self.roster.heard(view)
            f = self._frames.get(frame)
            if f is None:
                self._check_new(frame, now, view)
                if self.roster.holds(view, frame, captured, now):
                    self.roster.hold(view, frame, scores, captured, now, skipped)
                    return None
                f = self._open(frame, now, captured, view)
            if view in f.scores or view in f.absent or view in f.refused:
                raise Drop("duplicate", f"view {view} of frame {frame} arrived twice")
            if f.stage != SCORES or f.taken:
                self.roster.observe_late(view, now - f.opened, f.opener, frame, now)
                raise Drop("late", f"view {view} of frame {frame} came after its deadline",
                           view=view, lag=now - f.opened)
            self.roster.on_time(view, frame, now - f.opened, now)
            f.captures[view] = captured
            if scores is None:
                f.absent.add(view)
                if skipped:
                    f.skipped.add(view)
            else:
                f.scores[view] = scores
            return self._ready_or_wait(f, now)

    def refuse(self, view: int, frame: int, reason: str, now: float) -> Frame | None:
        """A message of ``view`` for ``frame`` came and was refused (``reason``: scores out of
        bounds): its device is judged for it, and an open frame stops waiting for the view.
        Returns the frame if that made it ready. A refused message opens no frame."""
        with self._lock:
            self.roster.heard(view)
            self.roster.conduct.bad(view, reason)
            f = self._frames.get(frame)
            if (f is None or f.stage != SCORES or f.taken or view in f.scores
                    or view in f.absent):
                return None
            f.refused.add(view)
            return self._ready_or_wait(f, now)

    def _ready_or_wait(self, f: Frame, now: float) -> Frame | None:
        awaited = self._awaited(f)
        if not awaited:
            self.roster.settle(f)
            return f.take(now)
        f.deadline = self._scores_deadline(f, awaited)
        return None

    def add_features(self, view: int, frame: int, features: np.ndarray, captured: float,
                     now: float) -> Frame | None:
        """Features of one view (pulled, pushed, or a one-view device's uplink)."""
        with self._lock:
            self.roster.heard(view)
            done = self.answered.get(frame)
            if done is not None and not self.single_view:
                if view in done.requested:
                    raise Drop("late", f"features of view {view} of answered frame {frame}")
                # Pushed features of a frame that exited locally are the price of push mode.
                reason = "unneeded" if self.roster.pushing[view] else "unrequested"
                raise Drop(reason, f"features of view {view} for answered frame {frame}")
            if (not self.single_view and frame not in self._frames
                    and not self.answered.answered(frame)):
                if self.roster.runahead.hold_features(view, frame, features):
                    self.roster.pushing[view] = True  # pushed with its held scores: together
                    return None
                # Never open a frame on features (pulled by an edge that restarted since).
                raise Drop("unrequested", f"features of view {view} for unknown frame {frame}")
            f = self._frames.get(frame)
            if f is None:
                self._check_new(frame, now, view)
                f = self._open(frame, now, captured, view)
            else:
                f.captures.setdefault(view, captured)
            if view in f.features:
                raise Drop("duplicate", f"features of view {view} of frame {frame} arrived twice")
            if self.single_view:
                # A one-view device sends features only for frames it did not exit itself.
                f.scores.setdefault(view, np.zeros(0, np.float32))
                f.features[view] = features
                f.move(FEATURES)
                f.requested = (view,)
                return f.take(now)
            if f.stage == SCORES and view not in f.scores:
                raise Drop("unrequested", f"features of view {view} before its scores")
            if f.stage == SCORES and not f.taken:
                # Features before the local exit decided anything: the device pushes them.
                # (A frame the worker holds may be pulled already: that answer can come first.)
                self.roster.pushing[view] = True
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
        hopeless, budget = self.roster.lag.hopeless, self.max_wait
        scores, absent = f.scores, f.absent
        return [v for v in self.roster.expecting if v not in scores and v not in absent
                and v not in f.refused and not hopeless(v, budget)]

    # --- the worker's side ------------------------------------------------------------------

    def await_features(self, f: Frame, views: list[int], now: float) -> Frame | None:
        """Move a frame to the feature stage; returns it at once if nothing needs pulling."""
        with self._lock:
            f.move(FEATURES)
            f.requested = tuple(views)
            f.pulled_at = now
            if all(v in f.features for v in views):
                return f.take(now)
            f.deadline = now + self.feature_deadline
            f.taken = False
            return None

    def finish(self, f: Frame) -> None:
        with self._lock:
            f.move(DONE)
            self._frames.pop(f.id, None)
            self.answered.add(f)

    def _scores_deadline(self, f: Frame, awaited: list[int] | None = None) -> float:
        """When ``f`` stops waiting for scores: the awaited devices' usual lag, within budget."""
        if awaited is None:
            awaited = self._awaited(f)
        if not awaited:  # only hopeless devices are missing: nothing worth waiting for
            return f.opened
        wait = min(max(self.roster.lag.wait_for(awaited), self.deadline), self.max_wait)
        return f.opened + wait

    def expire(self, now: float) -> list[Frame]:
        """Frames whose deadline passed: ready with the views they have."""
        out = []
        with self._lock:
            self.roster.expire_held(now)
            for f in self._frames.values():
                if f.taken or f.deadline > now:
                    continue
                if f.stage == SCORES:
                    # The stored deadline is cheap to scan; lags learnt since may extend it.
                    f.deadline = self._scores_deadline(f)
                    if f.deadline > now:
                        continue
                    f.missing = {v for v in self.roster.expecting if v not in f.scores
                                 and v not in f.absent and v not in f.refused}
                    self.roster.missed(f.missing)
                    self.roster.settle(f)
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

    def knows(self, frame: int) -> bool:
        """The frame is being assembled or was answered (anything for it is handled here)."""
        with self._lock:
            return frame in self._frames or self.answered.answered(frame)

    def __len__(self) -> int:
        return len(self._frames)
