"""Where and when a ready frame runs up the exits (docs/latency.md).

A frame readied by its last message runs at once on the thread that took that message (no
queue, no thread to wake: the result is out a fraction of a millisecond after the last view).
Where the local exit needs numpy or ONNX Runtime (concat aggregation, a local segment; max
and avg run in plain floats), frames readied less than :data:`INLINE_GAP` apart (a busy edge)
go to the worker thread instead, which runs all that wait in one batch, their local exits in
one vectorised call. The worker also expires deadlines (the frames' and the detail pulls'),
and after each round hands the counts to the events. Each frame then walks the exits in
:meth:`~ddnn.edge.path.FramePath.advance`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from ddnn.edge.assembler import DONE, SCORES, Frame, FrameAssembler
from ddnn.edge.counts import MessageCounts
from ddnn.edge.events import EdgeEvents
from ddnn.edge.path import FramePath
from ddnn.edge.pipeline import Exit, Pull
from ddnn.plumbing.lifecycle import Worker

log = logging.getLogger(__name__)

# Frames readied closer together than this (seconds) are batched on the worker when their local
# exit is a numpy call (tens of µs whatever the batch); further apart, each runs at once where
# it was readied. 2 ms: well above the edge's per-frame cost, so an edge that keeps up answers
# every frame at once, and one that is saturated batches. (In plain floats a frame's local exit
# costs microseconds: batching would cost more in thread hand-overs than it saves.)
INLINE_GAP = 0.002


class FrameScheduler:
    """Runs ready frames of ``assembler`` along ``path``; ``connected()`` says whether
    deadlines run (not while the broker is away: the views are not late, the link is down);
    ``counts``: the ingest's, flushed after each round of the worker."""

    def __init__(self, assembler: FrameAssembler, path: FramePath, events: EdgeEvents, *,
                 counts: MessageCounts, connected: Callable[[], bool] = lambda: True):
        self.assembler, self.path, self.events = assembler, path, events
        self.counts, self._connected = counts, connected
        self._batch: list[Frame] = []  # ready frames the worker runs in its next batch
        self._wake = threading.Condition()  # guards _batch and _last_ready
        self._last_ready = float("-inf")  # when the last frame was readied (monotonic)
        self._stop = threading.Event()
        self.worker = Worker("edge-worker", self._work_loop, stop=self._stop_worker)

    def ready(self, f: Frame) -> None:
        """A frame is ready (on the thread of its last message): run it now, or batch it."""
        with self._wake:
            gap, self._last_ready = f.ready_at - self._last_ready, f.ready_at
            if self._batch or (gap < INLINE_GAP and f.stage is SCORES
                               and not (f.pipeline or self.path.pipeline).plain_local):
                self._batch.append(f)
                self._wake.notify()
                return
        self.run([f])

    def _stop_worker(self) -> None:
        self._stop.set()
        with self._wake:
            self._wake.notify()

    def _work_loop(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                if not self._batch:
                    wait = self.assembler.next_deadline() - time.monotonic()
                    self._wake.wait(min(max(wait, 0.001), 0.05))
                batch, self._batch = self._batch, []
            if batch:
                self.run(batch)
            # No expiry while the broker is away: the views are not late, the link is down.
            if self._connected():
                expired = self.assembler.expire(time.monotonic())
                if expired:
                    self.run(expired)
            self._settle()

    def _settle(self) -> None:
        """After each round: detail pulls past their deadline go up, counts are handed on."""
        self.counts.flush()
        self.path.details.expire(time.monotonic())
        self.events.on_settled(len(self.assembler))

    def run(self, frames: list[Frame]) -> None:
        """Take ready frames as far up the exits as they can go now; the local exits of those
        at that stage in one call per bundle version. A failure (a bug, a broken segment)
        ends that frame alone, counted."""
        local: dict[int, Exit | Pull] = {}
        at_scores = [f for f in frames if f.stage is SCORES and f.scores]
        if len(at_scores) > 1:
            try:
                local = self.path.local_many(at_scores)
            except Exception:  # each frame is tried alone below, so a bad one fails alone
                log.exception("local exit of %d frames failed; running them one by one",
                              len(at_scores))
        for f in frames:
            try:
                self.path.advance(f, local.get(f.id))
            except Exception:  # one bad frame must not stop the edge
                log.exception("processing frame %d failed", f.id)
                if f.stage is not DONE:  # (a failure after its result went out loses nothing)
                    self.assembler.finish(f)
                    self.events.on_dropped("processing_failed")
