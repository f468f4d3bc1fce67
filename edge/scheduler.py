"""Where and when a ready frame runs up the exits (docs/latency.md).

A frame readied by its last message runs at once on the thread that took that message (no
queue, no thread to wake: the result is out a fraction of a millisecond after the last view).
Where the local exit needs numpy or ONNX Runtime (concat aggregation, a local segment; max
and avg run in plain floats), frames readied less than :data:`INLINE_GAP` apart (a busy edge)
go to the worker thread instead, which runs all that wait in one batch, their local exits in
one vectorised call. The worker also expires deadlines. A frame goes as far as it can now:
answered at the local exit, parked for the features it pulls, answered at the edge exit, or
handed to the cloud stage.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from ddnn.edge.assembler import DONE, SCORES, Frame, FrameAssembler
from ddnn.edge.audit import ExitAudit
from ddnn.edge.metrics import EdgeMetrics
from ddnn.edge.pipeline import Exit, ExitPipeline, Pull, ToCloud
from ddnn.plumbing.lifecycle import Worker

log = logging.getLogger(__name__)

# Frames readied closer together than this (seconds) are batched on the worker when their local
# exit is a numpy call (tens of µs whatever the batch); further apart, each runs at once where
# it was readied. 2 ms: well above the edge's per-frame cost, so an edge that keeps up answers
# every frame at once, and one that is saturated batches. (In plain floats a frame's local exit
# costs microseconds: batching would cost more in thread hand-overs than it saves.)
INLINE_GAP = 0.002

# (frame, exit or None: no view fused, degraded=False, *, step, finish=True)
Answer = Callable[..., None]


class FrameScheduler:
    """Runs ready frames on ``pipeline()`` (the bundle version new frames take).

    ``answer(frame, exit, degraded=False, step=...)`` publishes a result; ``request(frame,
    views)`` pulls features (None: the devices push them); ``to_cloud(frame, sent)`` hands a
    frame to the cloud stage; ``connected()`` says whether deadlines run (not while the broker
    is away: the views are not late, the link is down); ``tick()`` runs on the worker after
    each round (counts and gauges); ``audit`` picks the early exits that go up anyway, for the
    cloud's answer to check (:mod:`ddnn.edge.audit`).
    """

    def __init__(self, assembler: FrameAssembler, metrics: EdgeMetrics, *,
                 pipeline: Callable[[], ExitPipeline], answer: Answer,
                 request: Callable[[int, Sequence[int]], None] | None,
                 to_cloud: Callable[[Frame, ToCloud], None],
                 connected: Callable[[], bool], tick: Callable[[], None],
                 audit: ExitAudit | None = None):
        self.assembler, self.metrics = assembler, metrics
        self._audit = audit or ExitAudit.off()  # which early exits go up anyway (drift)
        self._pipeline, self._answer, self._request = pipeline, answer, request
        self._to_cloud, self._connected, self._tick = to_cloud, connected, tick
        self._batch: list[Frame] = []  # ready frames the worker runs in its next batch
        self._wake = threading.Condition()  # guards _batch and _last_ready
        self._last_ready = float("-inf")  # when the last frame was readied (monotonic)
        self._stop = threading.Event()
        self.worker = Worker("edge-worker", self._work_loop, stop=self._stop_worker)

    def ready(self, f: Frame) -> None:
        """A frame is ready (on the thread of its last message): run it now, or batch it."""
        with self._wake:
            gap, self._last_ready = f.ready_at - self._last_ready, f.ready_at
            if self._batch or (gap < INLINE_GAP and f.stage == SCORES
                               and not (f.pipeline or self._pipeline()).plain_local):
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
            self._tick()

    def run(self, frames: list[Frame]) -> None:
        """Take ready frames as far up the exits as they can go now; the local exits of those
        at that stage in one call per bundle version. A failure (a bug, a broken segment)
        ends that frame alone, counted."""
        local: dict[int, Exit | Pull] = {}
        at_scores = [f for f in frames if f.stage == SCORES and f.scores]
        if len(at_scores) > 1:
            try:
                local = self._local_exits(at_scores)
            except Exception:  # each frame is tried alone below, so a bad one fails alone
                log.exception("local exit of %d frames failed; running them one by one",
                              len(at_scores))
        for f in frames:
            try:
                self._process(f, local.get(f.id))
            except Exception:  # one bad frame must not stop the edge
                log.exception("processing frame %d failed", f.id)
                if f.stage != DONE:  # (a failure after its result went out loses nothing)
                    self.assembler.finish(f)
                    self.metrics.dropped.inc(reason="processing_failed")

    def _local_exits(self, frames: list[Frame]) -> dict[int, Exit | Pull]:
        by_pipeline: dict[int, list[Frame]] = {}
        for f in frames:
            if f.pipeline is None:  # a frame runs on one bundle version, even across an update
                f.pipeline = self._pipeline()
            by_pipeline.setdefault(id(f.pipeline), []).append(f)
        pushing = self._pushing()
        out = {}
        for group in by_pipeline.values():
            p: ExitPipeline = group[0].pipeline
            # (a frame's views are frozen while it is taken: its own dicts are passed)
            decisions = p.local_many([f.scores for f in group],
                                     arrived=[f.features for f in group], pushing=pushing)
            out.update((f.id, d) for f, d in zip(group, decisions, strict=True))
        return out

    def _pushing(self) -> set[int]:
        return {v for v, push in enumerate(self.assembler.pushing) if push}

    def _process(self, f: Frame, local: Exit | Pull | None = None) -> None:
        """Take a ready frame as far up the exits as it can go now (``local``: its local exit,
        when computed in a batch)."""
        if f.missing:
            self.metrics.missing.inc(len(f.missing), stage=f.stage)
        if f.pipeline is None:  # a frame runs on one bundle version, even across an update
            f.pipeline = self._pipeline()
        p: ExitPipeline = f.pipeline
        if f.stage == SCORES and not f.scores:
            # No view sent scores (every camera saw nothing, or none came in time): a class
            # made from nothing would be a wrong answer, so the result says nobody saw it.
            self._answer(f, None, step="local")
            self._observe_arrival(f)
            return
        if f.stage == SCORES:
            if local is None:
                local = p.local(f.scores, arrived=f.features, pushing=self._pushing())
            audited = self._audit.local(f, local)
            if isinstance(local, Exit) and not audited:
                self._answer(f, local, step="local")
                self._observe_arrival(f)  # (after the result: it is not on the frame's path)
                return
            if isinstance(local, Exit):  # an audit: answered once, from here, and sent on up
                self._answer(f, local, step="local", finish=False)
                pushing = self._pushing()
                local = Pull(local.views, tuple(v for v in local.views if v not in f.features
                                                and v not in pushing), local)
            f.local = local.answer
            # The frame waits for features before the pull goes out, so an answer that comes
            # back at once finds it waiting.
            ready = self.assembler.await_features(f, list(local.views), time.monotonic())
            if local.ask and self._request is not None:
                self._request(f.id, local.ask)
            self._observe_arrival(f)
            if ready is None:
                return  # the features come to the ingest, which hands the frame back
        if f.pulled_at:  # (a one-view device's frame comes with its features)
            self.metrics.stage.observe(f.ready_at - f.pulled_at, stage="pull")
        arrived = {v: f.features[v] for v in f.requested if v in f.features}
        early = self._audit.answered(f)  # the local exit answered it: the audit's chance
        if not arrived and early:
            self.assembler.finish(f)  # answered already, and nothing came to check it with
        elif not arrived:
            # Never classify zeros: no view's features came, so the local exit's answer stands,
            # flagged degraded (the devices could not deliver what the frame needed).
            self._answer(f, f.local, degraded=True, step="edge")
        else:
            self._edge(f, p, arrived, early)

    def _edge(self, f: Frame, p: ExitPipeline, arrived: dict, early: float) -> None:
        """The edge exit; the cloud for what it leaves, and for audits (``early``: the chance
        of the audit of a frame the local exit answered)."""
        edge = p.edge(arrived, audit=early or self._audit.edge(f),
                      below=f.local.scores if f.local is not None else None)
        if isinstance(edge, Exit):
            self._answer(f, edge, step="edge")
        elif early:  # answered at the local exit: the cloud's answer only checks it
            self.assembler.finish(f)
            self._to_cloud(f, replace(edge, audit=early))
        elif edge.audit:  # answered here, and sent up to be checked
            self._answer(f, edge.fallback, step="edge")
            self._audit.sent(edge)
            self._to_cloud(f, edge)
        else:
            self.metrics.stage.observe(time.monotonic() - f.ready_at, stage="edge")
            f.ready_at = time.monotonic()  # the cloud stage runs from here
            self._to_cloud(f, edge)

    def _observe_arrival(self, f: Frame) -> None:
        """Capture to the frame's first view here (wall clocks), and on to its last view."""
        now = time.monotonic()
        first_wall = time.time() - (now - f.first_at)
        self.metrics.stage.observe(max(first_wall - f.captured, 0.0), stage="arrival")
        self.metrics.stage.observe(f.ready_at - f.first_at, stage="wait")
