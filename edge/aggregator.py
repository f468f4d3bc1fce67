"""The edge aggregator: fuses the devices' views of each frame and walks it up the exits.

It composes the parts of the edge: :class:`~ddnn.edge.ingest.Ingest` takes the devices'
messages into the :class:`~ddnn.edge.assembler.FrameAssembler`; the
:class:`~ddnn.edge.scheduler.FrameScheduler` runs each ready frame through the
:class:`~ddnn.edge.pipeline.ExitPipeline` (local exit, feature pulls through
:class:`~ddnn.edge.pulls.FeaturePulls`, edge exit); the :class:`~ddnn.edge.cloud_stage.CloudStage`
sends the rest to the cloud, answering from the edge's own exit, flagged ``degraded``, when
the cloud cannot. Every answer becomes one :class:`~ddnn.result.Result`, fanned out to the
result sinks by :class:`~ddnn.edge.fanout.ResultFanout`. Metrics are counted from the parts'
hooks. What the HTTP side and the health checks may read is one :class:`EdgeSnapshot`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ddnn.bundle import Manifest
from ddnn.edge.assembler import Frame, FrameAssembler
from ddnn.edge.audit import ExitAudit, report_to
from ddnn.edge.cloud_client import CloudClient
from ddnn.edge.cloud_stage import CloudStage
from ddnn.edge.conduct import ConductReport
from ddnn.edge.escalation import DetailPulls
from ddnn.edge.fanout import ResultFanout
from ddnn.edge.ingest import Ingest
from ddnn.edge.metrics import EdgeMetrics
from ddnn.edge.pipeline import Exit, ExitPipeline, ToCloud
from ddnn.edge.pulls import FeaturePulls
from ddnn.edge.recorder import ExperienceRecorder
from ddnn.edge.scheduler import FrameScheduler
from ddnn.edge.settings import EdgeSettings, view_devices
from ddnn.edge.sinks import ResultSink
from ddnn.plumbing.lifecycle import Lifecycle
from ddnn.plumbing.throttle import LogThrottle
from ddnn.result import Result, result_for, unanswered
from ddnn.runtime import BundleRuntime
from ddnn.topics import Topics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EdgeSnapshot:
    """What the edge's HTTP side and health checks read of the aggregator, at one moment."""

    answered: int  # results published
    pending: int  # frames being assembled
    cloud_up: bool  # the cloud answered its last call
    devices: tuple[str, ...]  # the device of each view
    late_devices: tuple[str, ...]  # devices late for most of their recent views
    manifest: Manifest  # of the bundle new frames run on
    thresholds: Mapping[str, float] = field(default_factory=dict)  # the exit thresholds in force
    flagged_devices: dict[str, list[str]] = field(default_factory=dict)  # device -> why
    drift: Mapping | None = None  # the exits checked against the cloud (None: not monitored)
    drift_reason: str | None = None  # why the drift alarm is up (None: it is not)

    @property
    def single_view(self) -> bool:
        return self.manifest.views == 1


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
        m, s = runtime.manifest, settings
        self.settings, self.topics = s, topics
        self.devices = view_devices(devices, m.views)
        self.metrics = metrics = metrics or EdgeMetrics()
        self.single_view = m.views == 1
        conduct = ConductReport(self.devices, metrics, max(s.max_wait, s.deadline))
        self.assembler = FrameAssembler(m.views, s.deadline, s.feature_deadline,
                                        s.suspect_after, single_view=self.single_view,
                                        max_wait=s.max_wait, max_fps=s.max_fps,
                                        on_refused=conduct.refused, on_flag=conduct.flagged)
        self.pipeline = self._pipeline(runtime)
        self.fanout = ResultFanout(sinks, metrics, s.expect_frames, state_dir=s.state_dir)
        self.recent, self.done = self.fanout.recent, self.fanout.done
        self.audit = (ExitAudit(s.drift, lambda: self.pipeline, **report_to(metrics, s.drift))
                      if s.drift.monitoring else ExitAudit.off())
        self.recorder = (ExperienceRecorder.counted(s.recording, metrics.learning)
                         if s.recording.directory is not None else None)
        self.cloud_stage = CloudStage(cloud, metrics, batch=s.cloud_link.batch,
                                      answer=self._answer, taught=self._taught)
        self.cloud = cloud
        self.pulls = (FeaturePulls(publish, topics.requests(s.edge_id), metrics,
                                   lambda: self.manifest) if publish is not None else None)
        self.details = DetailPulls(publish, topics.requests(s.edge_id), metrics,
                                   s.feature_deadline, self.cloud_stage.put)
        self.scheduler = FrameScheduler(
            self.assembler, metrics, pipeline=lambda: self.pipeline, answer=self._answer,
            request=self.pulls.request if self.pulls else None, to_cloud=self.details.send_up,
            connected=connected, tick=self._tick, audit=self.audit)
        self.ingest = Ingest(
            self.assembler, topics, self.devices, m, on_ready=self.scheduler.ready,
            on_received=metrics.received, on_drop=self._dropped, on_status=self._status,
            on_clock=lambda device: metrics.clock_skewed.inc(device=device),
            on_detail=self.details.add)
        self._late = LogThrottle()  # a late device: one line each, the counter says the rest
        metrics.bundle.set(1, model=m.name, version=m.version)
        metrics.before_render.append(self.ingest.flush)
        self.lifecycle = self._lifecycle()

    def _pipeline(self, runtime: BundleRuntime) -> ExitPipeline:
        s = self.settings
        policy = runtime.manifest.policy.with_overrides(local=s.local_threshold,
                                                        edge=s.edge_threshold)
        for exit_name, threshold in policy.thresholds.items():
            self.metrics.thresholds.set(threshold, exit=exit_name)
        # Compute times are observed once the frame's result is out (observe_computed).
        return ExitPipeline(runtime, policy, on_segment=self.metrics.computed)

    @property
    def runtime(self) -> BundleRuntime:
        """The runtime new frames run on."""
        return self.pipeline.runtime

    @property
    def manifest(self) -> Manifest:
        """The manifest of the bundle new frames run on."""
        return self.pipeline.manifest

    @property
    def answered(self) -> int:
        """Results published."""
        return self.fanout.answered

    @property
    def results(self) -> list[dict]:
        """The recent results (as published), oldest first."""
        return self.recent.all()

    def snapshot(self) -> EdgeSnapshot:
        """What the HTTP side and the health checks may read, now."""
        return EdgeSnapshot(
            answered=self.fanout.answered, pending=len(self.assembler),
            cloud_up=self.cloud_stage.up, devices=tuple(self.devices),
            late_devices=tuple(self.devices[v] for v in self.assembler.late_views()),
            manifest=self.manifest, thresholds=dict(self.pipeline.policy.thresholds),
            flagged_devices={self.devices[v]: why
                             for v, why in self.assembler.flagged().items()},
            drift=self.audit.status(), drift_reason=self.audit.reason())

    def accept(self, payload: bytes, device: str | None = None) -> str | None:
        """One device message from outside MQTT (HTTP ingest): the drop reason, or None."""
        return self.ingest.accept(payload, device)

    # --- hooks of the ingest --------------------------------------------------------------------

    def _dropped(self, reason: str, device: str | None = None, lag: float | None = None) -> None:
        self.metrics.dropped.inc(reason=reason)
        if reason == "scores" and device is not None:
            self.metrics.refused.inc(device=device, reason=reason)
        if reason == "late" and device is not None:
            self.metrics.late.inc(device=device)
            if self._late(device):  # once per device; the counter says the rest
                log.warning("device %s: a view came %s after its frame's first view, too late to "
                            "be fused (the frame waits at most %.0f ms); later ones are counted in "
                            "ddnn_edge_late_views_total", device,
                            "?" if lag is None else f"{lag * 1000:.0f} ms",
                            self.assembler.max_wait * 1000)

    def _status(self, device: str, online: bool) -> None:
        self.metrics.devices_online.set(1 if online else 0, device=device)
        if online and self.pulls is not None:
            self.pulls.again(self.assembler)  # it may have missed pulls while away

    # --- control --------------------------------------------------------------------------------

    def swap(self, runtime: BundleRuntime) -> None:
        """Run new frames on ``runtime`` (an over-the-air update); frames under way keep theirs.

        Messages of the previous version are still taken: devices update one after another.
        """
        runtime.load_all()
        old, m = self.manifest, runtime.manifest
        self.pipeline = self._pipeline(runtime)
        self.ingest.serve(m)
        self.audit.reset()  # another bundle: its exits are checked afresh
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
        if self.pulls is not None:
            self.pulls.again(self.assembler)
        self.details.again()

    # --- results --------------------------------------------------------------------------------

    def _answer(self, f: Frame, answer: Exit | None, degraded: bool = False, *, step: str,
                finish: bool = True) -> None:
        """Publish ``answer`` as ``f``'s result (None: no view was fused); ``step``: the stage
        of the latency breakdown that ends here (local, edge or cloud: from the frame's last
        view, its features, or its hand-over to the cloud thread to its result handed to the
        sinks). ``finish`` False: the frame goes on up, answered (an audit,
        :mod:`ddnn.edge.audit`)."""
        latency = max(time.time() - f.captured, 0.0)
        missing = self.assembler.why_missing(f, answer.views if answer else ())
        why = {self.devices[v]: reason for v, reason in missing.items()}
        if answer is None:  # no view was fused: nothing to classify (the result says so)
            result = unanswered(frame=f.id, missing=why, latency_ms=latency * 1000)
        else:
            result = result_for(frame=f.id, scores=answer.scores.tolist(),
                                classes=(f.pipeline or self.pipeline).classes, exit=answer.tier,
                                entropy=answer.entropy,
                                views=[self.devices[v] for v in answer.views], missing=why,
                                degraded=degraded, latency_ms=latency * 1000)
        self.publish_result(result)
        handed = time.monotonic()
        # The bookkeeping after the result is out (a bad result leaves the frame unanswered).
        if finish:
            self.assembler.finish(f)
        self.metrics.stage.observe(handed - f.ready_at, stage=step)
        self.metrics.frames.inc(exit=result.exit, degraded=str(degraded).lower())
        self.metrics.latency.observe(latency, exit=result.exit)
        self.metrics.observe_computed()

    def _taught(self, f: Frame, sent: ToCloud, answer: Exit) -> None:
        """The cloud answered a frame (forwarded or audited): its answer checks the early
        exits, and is the label of the experience recorded."""
        self.audit.observe(f, sent, answer)
        if self.recorder is not None and f.pipeline is not None:
            self.recorder.put(f.pipeline.manifest,  # type: ignore[attr-defined]
                              {v: f.features[v] for v in answer.views if v in f.features},
                              f.scores, answer.scores)

    def publish_result(self, result: Result) -> None:
        """Send one result to every sink (the edge's own, or a one-view device's posted over
        HTTP)."""
        self.fanout.publish(result)

    def _tick(self) -> None:
        """After each round of the worker: counts and gauges brought up to date."""
        self.ingest.flush()
        self.details.expire(time.monotonic())
        self.metrics.observe_computed()
        self.metrics.pending.set(len(self.assembler))

    # --- lifecycle ------------------------------------------------------------------------------

    def _lifecycle(self) -> Lifecycle:
        """The sinks, then the segments loaded, then the worker and the cloud threads; stopped
        in reverse, the cloud client closed and the counts flushed after the threads."""
        def load() -> None:  # now, so the first frame does not pay for it
            self.runtime.runner("edge")
            if self.manifest.local is not None:
                self.runtime.runner("local")

        parts = Lifecycle()
        parts.add("sinks", start=self.fanout.start, stop=self.fanout.close)
        parts.add("cloud client", stop=self.cloud_stage.close)
        parts.add("counts", stop=self.ingest.flush)
        parts.add("segments", start=load)
        parts.add("drift audit", start=self.audit.reset)
        if self.recorder is not None:
            parts.add("edge-experience", self.recorder)
        parts.add("edge-worker", self.scheduler.worker)
        parts.add("edge-cloud", self.cloud_stage.worker)
        return parts

    def start(self) -> EdgeAggregator:
        """Start the sinks, then the worker and the cloud threads."""
        self.lifecycle.start()
        return self

    def stop(self) -> None:
        """Stop the threads, then close the cloud client and the sinks."""
        self.lifecycle.stop()
