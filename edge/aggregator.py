"""The edge aggregator: fuses the devices' views of each frame and walks it up the exits.

It composes the three parts of the edge: :class:`~edge.ingest.Ingest` takes the devices'
messages into the :class:`~edge.assembler.FrameAssembler`; each assembled frame runs through the
:class:`~edge.pipeline.ExitPipeline` (local exit, feature pulls, edge exit); a cloud thread sends
the rest to the cloud in batches (:class:`edge.cloud_client.CloudClient`), answering from the
edge's own exit, flagged ``degraded``, when the cloud cannot. Every answer becomes one
:class:`~ddnn.result.Result`, fanned out to the result sinks (:mod:`edge.sinks`). Metrics are
counted here, from the parts' hooks.

Where a frame runs (docs/latency.md): a frame readied by its last message runs at once on the
thread that took that message (no queue, no thread to wake: the result is out a fraction of a
millisecond after the last view). Where the local exit needs numpy or ONNX Runtime (an
aggregation other than max, a local segment), frames readied less than :data:`INLINE_GAP`
apart (a busy edge) go to the worker thread instead, which runs all that wait in one batch,
their local exits in one vectorised call. The worker also expires deadlines.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from ddnn import envelope as env
from ddnn.bundle import Manifest
from ddnn.edge.assembler import DONE, SCORES, Frame, FrameAssembler
from ddnn.edge.cloud_client import CloudClient, CloudError, UnknownVersion
from ddnn.edge.ingest import Ingest
from ddnn.edge.metrics import EdgeMetrics
from ddnn.edge.pipeline import Exit, ExitPipeline, Pull, ToCloud
from ddnn.edge.settings import EdgeSettings, view_devices
from ddnn.edge.sinks import RecentResults, ResultSink
from ddnn.envelope import MessageType
from ddnn.plumbing.lifecycle import Lifecycle, Worker
from ddnn.plumbing.throttle import LogThrottle
from ddnn.result import Result, result_for
from ddnn.runtime import BundleRuntime
from ddnn.topics import DELIVERY, Topics

log = logging.getLogger(__name__)

RECENT_RESULTS = 1000  # results kept for GET /v1/results
# Frames readied closer together than this (seconds) are batched on the worker when their local
# exit is a numpy call (tens of µs whatever the batch); further apart, each runs at once where
# it was readied. 2 ms: well above the edge's per-frame cost, so an edge that keeps up answers
# every frame at once, and one that is saturated batches. (In plain floats a frame's local exit
# costs microseconds: batching would cost more in thread hand-overs than it saves.)
INLINE_GAP = 0.002


class EdgeAggregator:
    """The edge tier's entry class: device messages in, one result per frame out.

    ``publish(topic, payload, qos)`` sends feature pulls to the devices (None: they push their
    features, as over HTTP); ``connected()`` says whether deadlines run (not while the broker
    is away: the views are not late, the link is down).
    """

    def __init__(self, runtime: BundleRuntime, settings: EdgeSettings, topics: Topics, *,
                 devices: Sequence[str], metrics: EdgeMetrics | None = None,
                 cloud: CloudClient | None = None, sinks: Sequence[ResultSink] = (),
                 publish: Callable[[str, bytes, int], object] | None = None,
                 connected: Callable[[], bool] = lambda: True):
        m = runtime.manifest
        self.settings, self.topics = settings, topics
        self.devices = view_devices(devices, m.views)
        self.metrics = metrics or EdgeMetrics()
        self.cloud = cloud
        self._publish = publish
        self._connected = connected
        self.single_view = m.views == 1
        self.assembler = FrameAssembler(m.views, settings.deadline, settings.feature_deadline,
                                        settings.suspect_after, single_view=self.single_view,
                                        max_wait=settings.max_wait)
        self.pipeline = self._pipeline(runtime)
        self._batch: list[Frame] = []  # ready frames the worker runs in its next batch
        self._wake = threading.Condition()  # guards _batch and _last_ready
        self._last_ready = float("-inf")  # when the last frame was readied (monotonic)
        self._to_cloud: queue.SimpleQueue[tuple[Frame, ToCloud]] = queue.SimpleQueue()
        self._segments: collections.deque[tuple[str, float]] = collections.deque()
        self.ingest = Ingest(
            self.assembler, topics, self.devices, m, on_ready=self._ready,
            on_received=self._received, on_drop=self._dropped, on_status=self._status,
            on_clock=lambda device: self.metrics.clock_skewed.inc(device=device))
        self.recent = RecentResults(RECENT_RESULTS)
        # The recent results last: the sinks that carry results away come first.
        self.sinks: list[ResultSink] = [*sinks, self.recent]
        self._results_lock = threading.Lock()  # every sink sees the results in one order
        self.answered = 0
        self.done = threading.Event()  # set after settings.expect_frames results
        # One line each: a version the cloud does not serve, a late device, a failing sink.
        self._once = LogThrottle()
        self._stop = threading.Event()
        self.metrics.bundle.set(1, model=m.name, version=m.version)
        self.metrics.before_render.append(self.ingest.flush)
        self.lifecycle = self._lifecycle()

    def _pipeline(self, runtime: BundleRuntime) -> ExitPipeline:
        s = self.settings
        policy = runtime.manifest.policy.with_overrides(local=s.local_threshold,
                                                        edge=s.edge_threshold)
        # Compute times are observed once the frame's result is out (_observe_segments).
        return ExitPipeline(runtime, policy, on_segment=lambda step, seconds:
                            self._segments.append((step, seconds)))

    @property
    def runtime(self) -> BundleRuntime:
        """The runtime new frames run on."""
        return self.pipeline.runtime

    @property
    def manifest(self) -> Manifest:
        """The manifest of the bundle new frames run on."""
        return self.pipeline.manifest

    @property
    def results(self) -> list[dict]:
        """The recent results (as published), oldest first."""
        return self.recent.all()

    # --- hooks of the ingest --------------------------------------------------------------------

    def _received(self, kind: str, messages: int, payload_bytes: int, header_bytes: int) -> None:
        self.metrics.messages.inc(messages, kind=kind)
        self.metrics.bytes.inc(payload_bytes, kind=kind, part="payload")
        self.metrics.bytes.inc(header_bytes, kind=kind, part="header")

    def _dropped(self, reason: str, device: str | None = None, lag: float | None = None) -> None:
        self.metrics.dropped.inc(reason=reason)
        if reason == "late" and device is not None:
            self.metrics.late.inc(device=device)
            if self._once(("late", device)):  # once per device; the counter says the rest
                log.warning("device %s: a view came %s after its frame's first view, too late to "
                            "be fused (the frame waits at most %.0f ms); later ones are counted in "
                            "ddnn_edge_late_views_total", device,
                            "?" if lag is None else f"{lag * 1000:.0f} ms",
                            self.assembler.max_wait * 1000)

    def _status(self, device: str, online: bool) -> None:
        self.metrics.devices_online.set(1 if online else 0, device=device)
        if online:
            self._request_again()

    def late_devices(self) -> list[str]:
        """Devices late for most of their recent views (systematically): for health checks."""
        return [self.devices[v] for v in self.assembler.late_views()]

    # --- control --------------------------------------------------------------------------------

    def swap(self, runtime: BundleRuntime) -> None:
        """Run new frames on ``runtime`` (an over-the-air update); frames under way keep theirs.

        Messages of the previous version are still taken: devices update one after another.
        """
        runtime.load_all()
        old, m = self.manifest, runtime.manifest
        self.pipeline = self._pipeline(runtime)
        self.ingest.serve(m)
        self.metrics.bundle.set(0, model=old.name, version=old.version)
        self.metrics.bundle.set(1, model=m.name, version=m.version)

    def drain(self, timeout: float) -> int:
        """Stop opening frames and finish those under way; returns how many were left.

        Messages of new frames are declined (with a persistent session the broker keeps them
        for the next edge), so a restart neither loses nor splits a frame.
        """
        self.ingest.decline_new_frames()
        deadline = time.monotonic() + timeout
        while len(self.assembler) and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the assembler: frames finish on the worker threads
        left = len(self.assembler)
        if left:
            log.warning("stopping with %d frames unanswered after %.1f s of draining", left,
                        timeout)
        log.info("drained: %d frames left unanswered, %d messages of new frames left to the "
                 "broker for the next edge", left, self.ingest.declined)
        return left

    def on_reconnect(self) -> None:
        """The broker is back: waiting frames get a fresh deadline, missed pulls are redone."""
        self.assembler.extend_deadlines(time.monotonic())
        self._request_again()

    # --- feature pulls --------------------------------------------------------------------------

    def _request(self, frame: int, views: Sequence[int]) -> None:
        m = self.manifest
        mask = np.full(m.views, -1.0, np.float32)
        mask[list(views)] = 1.0
        edge_id = self.settings.edge_id
        # The topic names deployment and edge: the request carries only version and frame.
        req = env.pack(MessageType.REQUEST, version=m.version, frame=frame, tensor=mask,
                       codec="binary")
        self._publish(self.topics.requests(edge_id), env.encode(req),
                      DELIVERY["requests"].qos)
        self.metrics.requests.inc()

    def _request_again(self) -> None:
        # After an outage a device may have missed pulls: ask again for what is still awaited.
        if self._publish is None:
            return
        for f in self.assembler.pending():
            missing = [v for v in f.requested if v not in f.features]
            if missing:
                self._request(f.id, missing)

    # --- running frames: local and edge exits -------------------------------------------------

    def _ready(self, f: Frame) -> None:
        """A frame is ready (on the thread of its last message): run it now, or batch it."""
        with self._wake:
            gap, self._last_ready = f.ready_at - self._last_ready, f.ready_at
            if self._batch or (gap < INLINE_GAP and f.stage == SCORES
                               and not (f.pipeline or self.pipeline).plain_local):
                self._batch.append(f)
                self._wake.notify()
                return
        self._run([f])

    def _work_loop(self) -> None:
        while not self._stop.is_set():
            with self._wake:
                if not self._batch:
                    wait = self.assembler.next_deadline() - time.monotonic()
                    self._wake.wait(min(max(wait, 0.001), 0.05))
                batch, self._batch = self._batch, []
            if batch:
                self._run(batch)
            # No expiry while the broker is away: the views are not late, the link is down.
            if self._connected():
                expired = self.assembler.expire(time.monotonic())
                if expired:
                    self._run(expired)
            self.ingest.flush()
            self._observe_segments()
            self.metrics.pending.set(len(self.assembler))

    def _run(self, frames: list[Frame]) -> None:
        """Take ready frames as far up the exits as they can go now; the local exits of those
        at that stage in one call per bundle version."""
        local: dict[int, Exit | Pull] = {}
        at_scores = [f for f in frames if f.stage == SCORES]
        if len(at_scores) > 1:
            try:
                local = self._local_exits(at_scores)
            except Exception:  # each frame is tried alone below, so a bad one fails alone
                log.exception("local exit of %d frames failed; running them one by one",
                              len(at_scores))
        for f in frames:
            self._process_safely(f, local.get(f.id))

    def _local_exits(self, frames: list[Frame]) -> dict[int, Exit | Pull]:
        by_pipeline: dict[int, list[Frame]] = {}
        for f in frames:
            if f.pipeline is None:  # a frame runs on one bundle version, even across an update
                f.pipeline = self.pipeline
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

    def _process_safely(self, f: Frame, local: Exit | Pull | None = None) -> None:
        """Process one frame; a failure (a bug, a broken segment) ends that frame, counted."""
        try:
            self._process(f, local)
        except Exception:  # one bad frame must not stop the edge
            log.exception("processing frame %d failed", f.id)
            if f.stage != DONE:  # (a failure after its result went out loses nothing)
                self.assembler.finish(f)
                self.metrics.dropped.inc(reason="processing_failed")

    def _process(self, f: Frame, local: Exit | Pull | None = None) -> None:
        """Take a ready frame as far up the exits as it can go now (``local``: its local exit,
        when computed in a batch)."""
        if f.missing:
            self.metrics.missing.inc(len(f.missing), stage=f.stage)
        if f.pipeline is None:  # a frame runs on one bundle version, even across an update
            f.pipeline = self.pipeline
        p: ExitPipeline = f.pipeline
        if f.stage == SCORES:
            if local is None:
                local = p.local(f.scores, arrived=f.features, pushing=self._pushing())
            if isinstance(local, Exit):
                self._answer(f, local, step="local")
                self._observe_arrival(f)  # (after the result: it is not on the frame's path)
                return
            f.local = local.answer
            # The frame waits for features before the pull goes out, so an answer that comes
            # back at once finds it waiting.
            ready = self.assembler.await_features(f, list(local.views), time.monotonic())
            if local.ask and self._publish is not None:
                self._request(f.id, local.ask)
            self._observe_arrival(f)
            if ready is None:
                return  # the features come to the ingest, which hands the frame back
        if f.pulled_at:  # (a one-view device's frame comes with its features)
            self.metrics.stage.observe(f.ready_at - f.pulled_at, stage="pull")
        arrived = {v: f.features[v] for v in f.requested if v in f.features}
        if not arrived:
            # Never classify zeros: no view's features came, so the local exit's answer stands,
            # flagged degraded (the devices could not deliver what the frame needed).
            self._answer(f, f.local, degraded=True, step="edge")
            return
        edge = p.edge(arrived)
        if isinstance(edge, ToCloud):
            self.metrics.stage.observe(time.monotonic() - f.ready_at, stage="edge")
            f.ready_at = time.monotonic()  # the cloud stage runs from here
            self._to_cloud.put((f, edge))
        else:
            self._answer(f, edge, step="edge")

    def _observe_arrival(self, f: Frame) -> None:
        """Capture to the frame's first view here (wall clocks), and on to its last view."""
        now = time.monotonic()
        first_wall = time.time() - (now - f.first_at)
        self.metrics.stage.observe(max(first_wall - f.captured, 0.0), stage="arrival")
        self.metrics.stage.observe(f.ready_at - f.first_at, stage="wait")

    # --- the cloud ------------------------------------------------------------------------------

    def _cloud_loop(self) -> None:
        while not self._stop.is_set():
            try:
                batch = [self._to_cloud.get(timeout=0.05)]
            except queue.Empty:
                continue
            while len(batch) < self.settings.cloud_link.batch:
                try:
                    batch.append(self._to_cloud.get_nowait())
                except queue.Empty:
                    break
            # One call per bundle version: during an update, frames finish on their own.
            by_version: dict[str, list[tuple[Frame, ToCloud]]] = {}
            for f, sent in batch:
                by_version.setdefault(sent.version, []).append((f, sent))
            for version, items in by_version.items():
                try:
                    self._cloud_batch(items, version)
                except Exception:  # a bug must not lose the frames: the edge's answer stands
                    log.exception("cloud stage failed; answering from the edge exit")
                    for f, sent in items:
                        if f.stage != DONE:
                            self._answer(f, sent.fallback, degraded=True, step="cloud")

    def _cloud_batch(self, items: list[tuple[Frame, ToCloud]], version: str) -> None:
        sent = [s for _, s in items]
        scores = self._call_cloud(sent, version)
        if scores is None:  # no cloud: the best answer this edge has is its own, degraded
            for f, s in items:
                self._answer(f, s.fallback, degraded=True, step="cloud")
            return
        for (f, _), answer in zip(items, ExitPipeline.cloud(scores, sent), strict=True):
            self._answer(f, answer, step="cloud")

    def _call_cloud(self, sent: list[ToCloud], version: str) -> np.ndarray | None:
        """The cloud's scores for ``sent``, or None when it cannot give them (counted)."""
        if self.cloud is None or not self.cloud.available():
            return None
        t0 = time.perf_counter()
        try:
            scores, _ = self.cloud.infer(np.concatenate([s.features for s in sent]), version,
                                         entropy=False)  # computed here from the scores
            classes = len(sent[0].fallback.scores)
            if scores.shape != (len(sent), classes) or not np.isfinite(scores).all():
                raise CloudError(f"cloud answered scores of shape {scores.shape} (expected "
                                 f"{(len(sent), classes)}) or not finite")
        except UnknownVersion as e:
            self.metrics.cloud.inc(outcome="unknown_version")
            if self._once(("unknown version", version)):  # once per version, not per batch
                log.error("%s; its frames are answered from the edge exit, degraded", e)
            return None
        except CloudError:
            self.metrics.cloud.inc(outcome="error")
            self.metrics.cloud_up.set(0)
            return None
        self.metrics.cloud.inc(outcome="ok")
        self.metrics.cloud_up.set(1)
        self.metrics.segment.observe(time.perf_counter() - t0, step="cloud_call")
        return scores

    # --- results --------------------------------------------------------------------------------

    def _answer(self, f: Frame, answer: Exit, degraded: bool = False, *, step: str) -> None:
        """Publish ``answer`` as ``f``'s result; ``step``: the stage of the latency breakdown
        that ends here (local, edge or cloud: from the frame's last view, its features, or its
        hand-over to the cloud thread to its result handed to the sinks)."""
        classes = (f.pipeline or self.pipeline).classes
        latency = max(time.time() - f.captured, 0.0)
        missing = self.assembler.why_missing(f, answer.views)
        result = result_for(frame=f.id, scores=answer.scores.tolist(), classes=classes,
                            exit=answer.tier, entropy=answer.entropy,
                            views=[self.devices[v] for v in answer.views],
                            missing={self.devices[v]: why for v, why in missing.items()},
                            degraded=degraded, latency_ms=latency * 1000)
        self.publish_result(result)
        handed = time.monotonic()
        # The bookkeeping after the result is out (a bad result leaves the frame unanswered).
        self.assembler.finish(f)
        self.metrics.stage.observe(handed - f.ready_at, stage=step)
        self.metrics.frames.inc(exit=answer.tier, degraded=str(degraded).lower())
        self.metrics.latency.observe(latency, exit=answer.tier)
        self._observe_segments()

    def _observe_segments(self) -> None:
        while self._segments:  # (a deque: threads append while this one takes)
            step, seconds = self._segments.popleft()
            self.metrics.segment.observe(seconds, step=step)

    def publish_result(self, result: Result) -> None:
        """Send one result to every sink (the edge's own, or a one-view device's posted over
        HTTP)."""
        with self._results_lock:
            for sink in self.sinks:
                try:
                    sink.publish(result)
                except Exception:  # a full disk or a broken sink must not silence the others
                    self.metrics.dropped.inc(reason="sink")
                    if self._once(("sink", type(sink).__name__)):
                        log.exception("result sink %s failed; counted in "
                                      'ddnn_edge_dropped_total{reason="sink"}',
                                      type(sink).__name__)
            self.answered += 1
            expect = self.settings.expect_frames
            if expect and self.answered >= expect:
                self.done.set()

    # --- lifecycle ------------------------------------------------------------------------------

    def _lifecycle(self) -> Lifecycle:
        """The sinks, then the segments loaded, then the worker and the cloud threads; stopped
        in reverse, the cloud client closed and the counts flushed after the threads."""
        def load() -> None:  # now, so the first frame does not pay for it
            self.runtime.runner("edge")
            if self.manifest.local is not None:
                self.runtime.runner("local")

        def wake_worker() -> None:
            self._stop.set()
            with self._wake:
                self._wake.notify()

        parts = Lifecycle()
        parts.add("sinks", start=self._start_sinks, stop=self._close_sinks)
        parts.add("cloud client", stop=lambda: self.cloud.close() if self.cloud else None)
        parts.add("counts", stop=self.ingest.flush)
        parts.add("segments", start=load)
        parts.add("edge-worker", Worker("edge-worker", self._work_loop, stop=wake_worker))
        parts.add("edge-cloud", Worker("edge-cloud", self._cloud_loop, stop=self._stop.set))
        return parts

    def _start_sinks(self) -> None:
        for sink in self.sinks:
            sink.start()

    def _close_sinks(self) -> None:
        for sink in reversed(self.sinks):
            sink.close()

    def start(self) -> EdgeAggregator:
        """Start the sinks, then the worker and the cloud threads."""
        self.lifecycle.start()
        return self

    def stop(self) -> None:
        """Stop the threads, then close the cloud client and the sinks."""
        self.lifecycle.stop()
