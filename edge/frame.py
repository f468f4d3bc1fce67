"""A frame being assembled from its views' messages, and a message the assembler does not
want (:mod:`ddnn.edge.assembler`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from ddnn.edge.pipeline import Exit, ExitPipeline, Scores


class Stage(Enum):
    """Where a frame is: waiting for its views' scores, then (not answered at the local exit)
    for the features it pulled, then done (answered, or handed to the cloud stage)."""

    SCORES = "scores"
    FEATURES = "features"
    DONE = "done"


SCORES, FEATURES, DONE = Stage.SCORES, Stage.FEATURES, Stage.DONE
# The only moves a frame makes (a one-view device's frame comes with its features).
_MOVES = {SCORES: (FEATURES, DONE), FEATURES: (DONE,), DONE: ()}
CAPTURE_SPREAD = 1.0  # seconds a view's capture time may be from its frame's others' median


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
    captured: float  # earliest trusted wall-clock capture time among the views (for latency)
    opened: float  # monotonic time of its first message (the scores wait runs from here)
    deadline: float = float("inf")  # when it stops waiting (scores: rechecked when it comes)
    stage: Stage = SCORES
    scores: dict[int, Scores] = field(default_factory=dict)
    absent: set[int] = field(default_factory=set)
    skipped: set[int] = field(default_factory=set)  # of the absent: their devices fell behind
    features: dict[int, np.ndarray] = field(default_factory=dict)
    requested: tuple[int, ...] = ()
    missing: set[int] = field(default_factory=set)  # views expected but not heard by the deadline
    refused: set[int] = field(default_factory=set)  # views that came but were refused (flagged)
    opener: int = -1  # the view that opened it
    captures: dict[int, float] = field(default_factory=dict)  # capture time of each view
    taken: bool = False  # handed to the worker: its views are frozen until it is given back
    pipeline: ExitPipeline | None = None  # the bundle version it runs on, pinned at its start
    local: Exit | None = None  # the local exit's answer, kept for when no features arrive
    # Monotonic times for the latency breakdown: its first message (``opened`` moves when the
    # broker comes back), when it became ready for its current stage (its last view, or its
    # deadline), and when its features were pulled.
    first_at: float = 0.0
    ready_at: float = 0.0
    pulled_at: float = 0.0

    @property
    def runs_on(self) -> ExitPipeline:
        """The pipeline (bundle version) it runs on, pinned when it first ran."""
        if self.pipeline is None:
            raise RuntimeError(f"frame {self.id} has not run yet: no bundle version pinned")
        return self.pipeline

    @property
    def present(self) -> list[int]:
        """Views that sent scores: the views the local and edge exits fuse over."""
        return sorted(self.scores)

    def settle_capture(self) -> list[tuple[int, bool]]:
        """Set :attr:`captured` from the views' capture times, each judged against their
        median: one more than :data:`CAPTURE_SPREAD` from it (a clock that is off, or lies) is
        not trusted. Returns ``(view, trusted)`` of each view when there are three or more (two
        cannot tell which is off: the earliest stands)."""
        times = self.captures
        if len(times) < 3:
            if times:
                self.captured = min(times.values())
            return []
        median = sorted(times.values())[(len(times) - 1) // 2]
        verdicts = [(v, abs(t - median) <= CAPTURE_SPREAD) for v, t in times.items()]
        self.captured = min(times[v] for v, ok in verdicts if ok)
        return verdicts

    def move(self, stage: Stage) -> None:
        """On to ``stage``: a frame only goes forward (scores, features, done); done again is
        nothing (a frame the cloud stage answers may have been finished already)."""
        if stage is not self.stage and stage not in _MOVES[self.stage]:
            raise ValueError(f"frame {self.id} cannot go from {self.stage.value} to "
                             f"{stage.value}")
        self.stage = stage

    def take(self, now: float) -> Frame:
        """Ready for its stage: handed to the worker, out of the deadline watch until it is
        given back."""
        self.deadline = float("inf")
        self.taken = True
        self.ready_at = now
        return self
