"""The edge aggregator: fuses the devices' views of each frame and walks it up the exits.

It builds the parts of the edge, each given the ones it calls (docs/architecture.md has the
picture): :class:`~ddnn.edge.ingest.Ingest` takes the devices' messages into the
:class:`~ddnn.edge.assembler.FrameAssembler` and hands each ready frame to the
:class:`~ddnn.edge.scheduler.FrameScheduler`, which runs it (at once, or batched) along the
:class:`~ddnn.edge.path.FramePath`: local exit, feature pulls
(:class:`~ddnn.edge.pulls.FeaturePulls`), edge exit, and up (:class:`~ddnn.edge.escalation.
DetailPulls`) to the :class:`~ddnn.edge.cloud_stage.CloudStage`, which answers from the edge's
own exit, flagged ``degraded``, when the cloud cannot. Every exit answers through one
:class:`~ddnn.edge.answers.Answers`: one :class:`~ddnn.result.Result` per frame, fanned out to
the result sinks by :class:`~ddnn.edge.fanout.ResultFanout`. Every part reports what it
observes through one :class:`~ddnn.edge.events.EventRunner` (the metrics, the log, and any
observer given). What the HTTP side and the health checks may read is one
:class:`EdgeSnapshot`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddnn.bundle import Manifest
from ddnn.edge.answers import Answers
from ddnn.edge.assembler import FrameAssembler, FrameBounds
from ddnn.edge.audit import ExitAudit
from ddnn.edge.cloud_client import CloudClient
from ddnn.edge.cloud_stage import CloudStage
from ddnn.edge.counts import MessageCounts
from ddnn.edge.escalation import DetailPulls
from ddnn.edge.event_log import EdgeLog
from ddnn.edge.events import EdgeEvents, EventRunner
from ddnn.edge.fanout import ResultFanout
from ddnn.edge.feedback import AnsweredMemory, FeedbackDesk, FeedbackRoute
from ddnn.edge.ingest import Ingest
from ddnn.edge.latency import PathCosts
from ddnn.edge.metrics import EdgeMetrics
from ddnn.edge.path import FramePath
from ddnn.edge.pipeline import ExitPipeline
from ddnn.edge.planner import LatencyPlanner
from ddnn.edge.pulls import FeaturePulls
from ddnn.edge.recorder import ExperienceRecorder
from ddnn.edge.roster import DeviceRules
from ddnn.edge.scheduler import FrameScheduler
from ddnn.edge.settings import EdgeSettings, view_devices
from ddnn.edge.sinks import ResultSink
from ddnn.plumbing.lifecycle import Lifecycle
from ddnn.result import Result
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
    # the exits checked against the cloud (None: not monitored)
    drift: Mapping[str, Any] | None = None
    drift_reason: str | None = None  # why the drift alarm is up (None: it is not)
    # the latency planner (None: no --latency-slo), and why its objective is not held
    latency: Mapping[str, Any] | None = None
    latency_reasons: tuple[str, ...] = ()

    @property
    def single_view(self) -> bool:
        return self.manifest.views == 1


class EdgeAggregator:
    """The edge tier's entry class: device messages in, one result per frame out.

    ``publish(topic, payload, qos)`` sends feature pulls to the devices (None: they push their
    features, as over HTTP); ``connected()`` says whether deadlines run (not while the broker
    is away: the views are not late, the link is down). ``observers``: more observers of the
    edge's events (:class:`~ddnn.edge.events.EdgeEvents`), after its metrics and its log.
    """

    def __init__(self, runtime: BundleRuntime, settings: EdgeSettings, topics: Topics, *,
                 devices: Sequence[str], metrics: EdgeMetrics | None = None,
                 cloud: CloudClient | None = None, sinks: Sequence[ResultSink] = (),
                 publish: Callable[[str, bytes, int], object] | None = None,
                 connected: Callable[[], bool] = lambda: True,
                 observers: Sequence[EdgeEvents] = ()):
        m, s = runtime.manifest, settings
        self.settings, self.topics, self.cloud = s, topics, cloud
        self.devices = view_devices(devices, m.views)
        self.metrics = metrics = metrics or EdgeMetrics()
        budget = max(s.max_wait, s.deadline)
        # What the paths cost, for the latency planner (--latency-slo), observes the events.
        self.costs = PathCosts() if s.latency.slo is not None else None
        self.events = events = EventRunner([*metrics.observers(), EdgeLog(budget),
                                            *([self.costs] if self.costs else []), *observers])
        events.on_devices(self.devices)
        self.assembler = FrameAssembler(
            m.views, s.deadline, s.feature_deadline, max_wait=s.max_wait,
            single_view=m.views == 1, rules=DeviceRules(s.waits.suspect_after, s.waits.max_fps),
            bounds=FrameBounds(), events=events, devices=self.devices)
        pipeline = self._pipeline(runtime)
        self.fanout = ResultFanout(sinks, events, s.expect_frames, state_dir=s.state_dir)
        self.recent, self.done = self.fanout.recent, self.fanout.done
        self.audit = (ExitAudit(s.drift, lambda: self.path.pipeline, events=events)
                      if s.drift.monitoring else ExitAudit.off())
        recorder = (ExperienceRecorder(s.recording, events=events)
                    if s.recording.directory is not None else None)
        operator = s.operator.token()
        memory = AnsweredMemory() if operator is not None and recorder is not None else None
        self.answers = Answers(self.assembler, self.devices, self.fanout, events,
                               audit=self.audit, recorder=recorder, memory=memory)
        self.cloud_stage = CloudStage(cloud, self.answers, events, batch=s.cloud_link.batch)
        requests = topics.requests(s.edge_id)
        self.pulls = (FeaturePulls(publish, requests, events, lambda: self.manifest)
                      if publish is not None else None)
        self.details = DetailPulls(publish, requests, events, s.feature_deadline,
                                   self.cloud_stage, devices=self.devices)
        self.path = FramePath(self.assembler, pipeline, self.answers, self.details, events,
                              audit=self.audit, pulls=self.pulls)
        self.path.planner = self.planner = self._planner()
        counts = MessageCounts(events)
        self.scheduler = FrameScheduler(self.assembler, self.path, events, counts=counts,
                                        connected=connected)
        self.ingest = Ingest(self.assembler, topics, self.devices, m, scheduler=self.scheduler,
                             events=events, counts=counts, pulls=self.pulls,
                             details=self.details)
        self.feedback = self._feedback(memory, recorder, operator)
        events.on_bundle(m.name, m.version, running=True)
        metrics.before_render.append(counts.flush)
        self.lifecycle = self._lifecycle(recorder, counts)

    def _planner(self) -> LatencyPlanner | None:
        """The latency planner of ``--latency-slo`` (None: no objective, thresholds stay)."""
        s = self.settings
        if self.costs is None:
            return None
        return LatencyPlanner(s.latency, self.costs, lambda: self.path.pipeline,
                              deadlines=self._pull_deadlines, pull_deadline=s.feature_deadline,
                              drift=self.audit.status, events=self.events)

    def _feedback(self, memory: AnsweredMemory | None, recorder: ExperienceRecorder | None,
                  operator: str | None) -> FeedbackRoute | None:
        """POST /v1/feedback: operators' labels, recorded with the frames' features (None: no
        operator token, or nowhere to record)."""
        if memory is None or recorder is None or operator is None:
            return None
        desk = FeedbackDesk(memory, recorder, self.pulls, devices=self.devices,
                            events=self.events, wait=self.settings.feature_deadline)
        self.ingest.feedback = desk
        return FeedbackRoute(desk, operator, self.events)

    def _pipeline(self, runtime: BundleRuntime) -> ExitPipeline:
        s = self.settings
        policy = runtime.manifest.policy.with_overrides(local=s.thresholds.local_threshold,
                                                        edge=s.thresholds.edge_threshold)
        self.events.on_thresholds(policy.thresholds)
        # Compute times are observed once the frame's result is out (EdgeMetrics.on_computed).
        return ExitPipeline(runtime, policy, events=self.events)

    @property
    def pipeline(self) -> ExitPipeline:
        """The exit pipeline new frames run on."""
        return self.path.pipeline

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
        roster = self.assembler.roster
        return EdgeSnapshot(
            answered=self.fanout.answered, pending=len(self.assembler),
            cloud_up=self.cloud_stage.up, devices=tuple(self.devices),
            late_devices=tuple(self.devices[v] for v in roster.late_views()),
            manifest=self.manifest, thresholds=dict(self.pipeline.policy.thresholds),
            flagged_devices=self._flagged(roster.flagged()),
            drift=self.audit.status(), drift_reason=self.audit.reason(),
            latency=self.planner.status() if self.planner else None,
            latency_reasons=tuple(r for r in (self.planner.reason(), self.planner.drift_reason())
                                  if r is not None) if self.planner else ())

    def _pull_deadlines(self, seconds: float) -> None:
        """How long frames wait for pulled features and details (the latency planner's)."""
        self.assembler.feature_deadline = self.details.deadline = seconds

    def _flagged(self, by_conduct: dict[int, list[str]]) -> dict[str, list[str]]:
        """Each flagged device and why: its conduct, and detail pulls it keeps missing."""
        out = {v: list(why) for v, why in by_conduct.items()}
        for v, why in self.details.flagged().items():
            out.setdefault(v, []).extend(why)
        return {self.devices[v]: sorted(why) for v, why in out.items()}

    def accept(self, payload: bytes, device: str | None = None) -> str | None:
        """One device message from outside MQTT (HTTP ingest): the drop reason, or None."""
        return self.ingest.accept(payload, device)

    def publish_result(self, result: Result) -> None:
        """Send one result to every sink (a one-view device's, posted over HTTP or MQTT)."""
        self.answers.publish(result)

    # --- control --------------------------------------------------------------------------------

    def swap(self, runtime: BundleRuntime) -> None:
        """Run new frames on ``runtime`` (an over-the-air update); frames under way keep theirs.

        Messages of the previous version are still taken: devices update one after another.
        """
        runtime.load_all()
        old, m = self.manifest, runtime.manifest
        self.path.pipeline = self._pipeline(runtime)
        self.ingest.serve(m)
        self.audit.reset()  # another bundle: its exits are checked afresh
        self.events.on_bundle(old.name, old.version, running=False)
        self.events.on_bundle(m.name, m.version, running=True)

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

    # --- lifecycle ------------------------------------------------------------------------------

    def _lifecycle(self, recorder: ExperienceRecorder | None, counts: MessageCounts) -> Lifecycle:
        """The sinks, then the segments loaded, then the worker and the cloud threads; stopped
        in reverse, the cloud client closed and the counts flushed after the threads."""
        def load() -> None:  # now, so the first frame does not pay for it
            self.runtime.runner("edge")
            if self.manifest.local is not None:
                self.runtime.runner("local")

        parts = Lifecycle()
        parts.add("sinks", start=self.fanout.start, stop=self.fanout.close)
        parts.add("cloud client", stop=self.cloud_stage.close)
        parts.add("counts", stop=counts.flush)
        parts.add("segments", start=load)
        parts.add("drift audit", start=self.audit.reset)
        if recorder is not None:
            parts.add("edge-experience", recorder)
        parts.add("edge-worker", self.scheduler.worker)
        parts.add("edge-cloud", self.cloud_stage.worker)
        if self.planner is not None:
            parts.add("edge-latency-planner", self.planner.worker)
        return parts

    def start(self) -> EdgeAggregator:
        """Start the sinks, then the worker and the cloud threads."""
        self.lifecycle.start()
        return self

    def stop(self) -> None:
        """Stop the threads, then close the cloud client and the sinks."""
        self.lifecycle.stop()
