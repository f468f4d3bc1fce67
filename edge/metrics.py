"""The edge aggregator's Prometheus metrics (served at ``/metrics`` by :mod:`ddnn.edge.http`)."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from ddnn.edge.conduct import REASONS
from ddnn.edge.events import EdgeEvents
from ddnn.plumbing.metrics import Registry
from ddnn.result import EXITS, NO_EXIT, Result

if TYPE_CHECKING:  # (types only: drift never imports the metrics)
    from ddnn.edge.drift import AgreementMonitor, Decision

_SEGMENT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)
# Fine below a millisecond: what the edge adds after a frame's last view is a fraction of one.
_STAGE_BUCKETS = (0.00005, 0.0001, 0.00015, 0.0002, 0.00025, 0.0003, 0.00035, 0.0004, 0.0005,
                  0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1,
                  0.2, 0.5, 1.0, 2.0, 5.0)


class EdgeMetrics(EdgeEvents):
    """Every series the edge exports (names start with ``ddnn_edge_``), kept current by the
    edge's events: this class observes the frames, the cloud and the bundle;
    :class:`DeviceMetrics` the devices, :class:`LearningMetrics` learning in the field and
    :class:`LatencyMetrics` the latency planner (:meth:`observers` gives all four)."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.before_render: list[Callable[[], None]] = []
        self.frames = r.counter("ddnn_edge_frames_total",
                                "Frames answered, by exit tier (\"none\": no view was fused, "
                                "nothing classified) and whether the answer is degraded",
                                ("exit", "degraded"))
        for tier in (*EXITS, NO_EXIT):
            for degraded in ("false", "true"):
                self.frames.zero(exit=tier, degraded=degraded)
        self.latency = r.histogram("ddnn_edge_latency_seconds",
                                   "Capture to result, by exit tier (needs synchronized clocks)",
                                   ("exit",))
        self.segment = r.histogram("ddnn_edge_segment_seconds",
                                   "Compute time of each step at the edge", ("step",),
                                   _SEGMENT_BUCKETS)
        self.stage = r.histogram("ddnn_edge_stage_seconds",
                                 "Where a frame's time goes (docs/latency.md): capture to its "
                                 "first view here (arrival), to its last view (wait), to the "
                                 "local exit's result handed on (local); the pull, the edge "
                                 "exit and the cloud (pull, edge, cloud)", ("stage",),
                                 _STAGE_BUCKETS)
        self.devices = DeviceMetrics(r)
        d = self.devices  # (its series, as the edge's: what the HTTP side and tests read)
        self.messages, self.bytes, self.dropped, self.late = d.messages, d.bytes, d.dropped, d.late
        self.refused, self.flagged, self.clock_skewed = d.refused, d.flagged, d.clock_skewed
        self.skipped = d.skipped
        self.devices_online = d.devices_online
        self.missing = r.counter("ddnn_edge_missing_views_total",
                                 "Views a frame expected but fused without, by stage", ("stage",))
        self.requests = r.counter("ddnn_edge_feature_requests_total", "Feature pulls published")
        self.detail_requests = r.counter("ddnn_edge_detail_requests_total",
                                         "Detail pulls published (frames escalated to the cloud "
                                         "with their cameras' detail)")
        self.cloud = r.counter("ddnn_edge_cloud_requests_total",
                               "Calls to the cloud, by outcome", ("outcome",))
        self.cloud_up = r.gauge("ddnn_edge_cloud_up", "1 while the cloud answers, else 0")
        self.pending = r.gauge("ddnn_edge_pending_frames", "Frames being assembled")
        self.broker_up = r.gauge("ddnn_edge_broker_connected", "1 while connected to the broker")
        self.bundle = r.gauge("ddnn_edge_bundle_info", "1 for the bundle version the edge runs",
                              ("model", "version"))
        self.thresholds = r.gauge("ddnn_edge_exit_threshold",
                                  "Normalized-entropy threshold of each early exit in force "
                                  "(a frame exits where its entropy is under it)", ("exit",))
        self.callback = r.counter("ddnn_edge_results_callback_total",
                                  "Results for the HTTP callback, by outcome", ("outcome",))
        self.bundle_updates = r.counter("ddnn_edge_bundle_updates_total",
                                        "Over-the-air bundle updates, by result", ("result",))
        self.learning = LearningMetrics(r)
        self.planning = LatencyMetrics(r)

        # Compute times of segments, observed once the frame's result is out (not on its path).
        self._computed: collections.deque[tuple[str, float]] = collections.deque()

    def observers(self) -> tuple[EdgeEvents, ...]:
        """The observers that keep every series current (for an
        :class:`~ddnn.edge.events.EventRunner`)."""
        return self, self.devices, self.learning, self.planning

    def on_computed(self, step: str, seconds: float) -> None:
        """Noted, not observed: the frame's path only appends (:meth:`observe_computed`)."""
        self._computed.append((step, seconds))

    def observe_computed(self) -> None:
        """Observe the compute times noted since the last call."""
        while self._computed:  # (a deque: threads append while this one takes)
            step, seconds = self._computed.popleft()
            self.segment.observe(seconds, step=step)

    def on_stage(self, stage: str, seconds: float) -> None:
        self.stage.observe(seconds, stage=stage)

    def on_missing(self, stage: str, views: int) -> None:
        self.missing.inc(views, stage=stage)

    def on_pulled(self, kind: str) -> None:
        (self.detail_requests if kind == "detail" else self.requests).inc()

    def on_answered(self, result: Result, step: str, latency: float) -> None:
        self.frames.inc(exit=result.exit, degraded="true" if result.degraded else "false")
        self.latency.observe(latency, exit=result.exit)
        self.observe_computed()

    def on_settled(self, pending: int) -> None:
        self.observe_computed()
        self.pending.set(pending)

    def on_cloud_call(self, outcome: str, seconds: float | None = None,
                      model: str = "cloud") -> None:
        self.cloud.inc(outcome=outcome)
        if outcome in ("ok", "error"):  # (a version it does not serve says nothing of its link)
            self.cloud_up.set(1 if outcome == "ok" else 0)
        if seconds is not None:
            self.segment.observe(seconds, step="cloud_call")

    def on_bundle(self, model: str, version: str, running: bool) -> None:
        self.bundle.set(1 if running else 0, model=model, version=version)

    def on_bundle_update(self, result: str) -> None:
        self.bundle_updates.inc(result=result)

    def on_broker(self, connected: bool) -> None:
        self.broker_up.set(1 if connected else 0)

    def on_thresholds(self, thresholds: Mapping[str, float]) -> None:
        for exit_name, threshold in thresholds.items():
            self.thresholds.set(threshold, exit=exit_name)

    def render(self) -> str:
        for hook in self.before_render:  # counts kept in plain integers on the hot path
            hook()
        return self.registry.render()


class LatencyMetrics(EdgeEvents):
    """The latency planner's series (``--latency-slo``, :mod:`ddnn.edge.planner`)."""

    def __init__(self, r: Registry) -> None:
        self.latency_objective = r.gauge(
            "ddnn_edge_latency_objective_seconds",
            "The latency objective (--latency-slo) at its percentile, and the latency planner's "
            "percentile of capture to result: predicted for the operating point in force, and "
            "measured over the last seconds", ("kind",))
        self.latency_met = r.gauge("ddnn_edge_latency_objective_met",
                                   "1 while the operating point in force is predicted to meet "
                                   "the latency objective, else 0")
        self.operating_point = r.gauge(
            "ddnn_edge_operating_point",
            "The latency planner's operating point: its escalation level and its held-out "
            "accuracy (its thresholds are ddnn_edge_exit_threshold)", ("field",))

    def on_latency_plan(self, point: Mapping[str, float], objective: float,
                        predicted: float | None, measured: float | None, met: bool) -> None:
        for kind, seconds in (("objective", objective), ("predicted", predicted),
                              ("measured", measured)):
            self.latency_objective.set(math.nan if seconds is None else seconds, kind=kind)
        self.latency_met.set(1 if met else 0)
        for name in ("level", "accuracy"):
            self.operating_point.set(point[name], field=name)


class DeviceMetrics(EdgeEvents):
    """The devices' series: their messages, drops, statuses and conduct."""

    def __init__(self, r: Registry) -> None:
        self.messages = r.counter("ddnn_edge_messages_total",
                                  "Device messages received, by kind", ("kind",))
        self.bytes = r.counter("ddnn_edge_received_bytes_total",
                               "Bytes received from devices: tensor payload or envelope header",
                               ("kind", "part"))
        self.dropped = r.counter("ddnn_edge_dropped_total",
                                 "Messages counted and dropped, by reason", ("reason",))
        self.late = r.counter("ddnn_edge_late_views_total",
                              "Views that arrived after their frame was answered, by device",
                              ("device",))
        # Devices that misbehave (docs/security.md).
        self.refused = r.counter("ddnn_edge_refused_views_total",
                                 "Views refused for their device's conduct, by device and reason: "
                                 "ran ahead of the other devices' views (ahead), scores out of "
                                 "the bundle's bounds (scores)", ("device", "reason"))
        self.flagged = r.gauge("ddnn_edge_device_flagged",
                               "1 while a device is flagged for most of its recent views: ran "
                               "ahead (ahead), scores out of bounds (scores), both not waited "
                               "for nor fused; capture times off (clock), not used for latency",
                               ("device", "reason"))
        self.clock_skewed = r.counter("ddnn_edge_clock_skewed_total",
                                      "Messages stamped far from the edge's clock, by device",
                                      ("device",))
        self.skipped = r.counter("ddnn_edge_skipped_views_total",
                                 "Views a device skipped because it fell behind its source (it "
                                 "said so: nobody waited; missing 'skipped'), by device",
                                 ("device",))
        self.devices_online = r.gauge("ddnn_edge_device_online",
                                      "1 while a device's status is online", ("device",))

    def on_devices(self, devices: Sequence[str]) -> None:
        for device in devices:  # every device's flags exported at 0 from the start
            for reason in REASONS:
                self.flagged.set(0, device=device, reason=reason)

    def on_received(self, kind: str, messages: int, payload_bytes: int,
                    header_bytes: int) -> None:
        self.messages.inc(messages, kind=kind)
        self.bytes.inc(payload_bytes, kind=kind, part="payload")
        self.bytes.inc(header_bytes, kind=kind, part="header")

    def on_dropped(self, reason: str, device: str | None = None,
                   lag: float | None = None) -> None:
        self.dropped.inc(reason=reason)
        if device is None:
            return
        if reason == "scores":  # out of the bundle's bounds: refused for its device's conduct
            self.refused.inc(device=device, reason=reason)
        elif reason == "late":
            self.late.inc(device=device)

    def on_refused(self, device: str, reason: str) -> None:
        self.dropped.inc(reason=reason)
        self.refused.inc(device=device, reason=reason)

    def on_device_status(self, device: str, online: bool) -> None:
        self.devices_online.set(1 if online else 0, device=device)

    def on_clock_skewed(self, device: str) -> None:
        self.clock_skewed.inc(device=device)

    def on_skipped(self, device: str) -> None:
        self.skipped.inc(device=device)

    def on_flag(self, device: str, reason: str, flagged: bool) -> None:
        self.flagged.set(1 if flagged else 0, device=device, reason=reason)


class LearningMetrics(EdgeEvents):
    """The series of learning in the field: the exits checked against the cloud (drift,
    ``--audit-rate``) and the experience recorded for federated learning (``--experience``)."""

    def __init__(self, r: Registry) -> None:
        self.agreement = r.gauge(
            "ddnn_edge_cloud_agreement",
            "Estimated share of the answers that agree with the cloud's over the drift window, "
            "at the exit thresholds in force or at the configured ones (NaN until estimated)",
            ("thresholds",))
        self.drift_alarm = r.gauge(
            "ddnn_edge_drift_alarm", "1 while the early exits disagree with the cloud more than "
            "--agreement-budget allows at the configured thresholds")
        self.agreement_floor = r.gauge(
            "ddnn_edge_agreement_floor", "The least agreement with the cloud the budget allows "
            "(1 - --agreement-budget; 0 when not monitored)")
        self.audits = r.counter(
            "ddnn_edge_audits_total", "Frames answered by an early exit and sent up anyway for "
            "the cloud to check, by exit", ("exit",))
        self.investigations = r.counter(
            "ddnn_edge_drift_investigations_total", "Shifts in the local exit's share that made "
            "the edge audit every early exit for a while")
        self.threshold_changes = r.counter(
            "ddnn_edge_threshold_changes_total", "Exit thresholds adapted at run time, by "
            "direction", ("direction",))
        self.experience = r.counter(
            "ddnn_edge_experience_frames_total", "Forwarded frames for the experience recording, "
            "by outcome: recorded, dropped (the queue was full), failed (not written)",
            ("outcome",))
        self.experience_bytes = r.gauge("ddnn_edge_experience_bytes",
                                        "Bytes of recorded experience on disk")
        self.feedback = r.counter(
            "ddnn_edge_feedback_total", "Operators' POST /v1/feedback, by outcome: recorded, or "
            "why it was refused", ("outcome",))
        for thresholds in ("in_force", "configured"):
            self.agreement.set(math.nan, thresholds=thresholds)
        self.drift_alarm.set(0)
        self.agreement_floor.set(0)
        for tier in ("local", "edge"):
            self.audits.zero(exit=tier)
        self.investigations.zero()
        for direction in ("tighten", "relax"):
            self.threshold_changes.zero(direction=direction)
        for outcome in ("recorded", "dropped", "failed"):
            self.experience.zero(outcome=outcome)
        self.experience_bytes.set(0)
        self.feedback.zero(outcome="recorded")

    def on_audit(self, exit: str) -> None:
        self.audits.inc(exit=exit)

    def on_investigation(self) -> None:
        self.investigations.inc()

    def on_threshold_change(self, direction: str) -> None:
        self.threshold_changes.inc(direction=direction)

    def on_drift(self, decision: Decision | None, monitor: AgreementMonitor) -> None:
        self.agreement_floor.set(1 - monitor.policy.agreement_budget)
        self.drift_alarm.set(1 if monitor.alarm else 0)
        d = decision
        for name, e in (("in_force", d and d.in_force), ("configured", d and d.configured)):
            self.agreement.set(e.agreement if e else math.nan, thresholds=name)

    def on_experience(self, outcome: str, frames: int) -> None:
        self.experience.inc(frames, outcome=outcome)

    def on_experience_size(self, size: int) -> None:
        self.experience_bytes.set(size)

    def on_feedback(self, outcome: str) -> None:
        self.feedback.inc(outcome=outcome)
