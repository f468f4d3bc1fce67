"""The edge aggregator's Prometheus metrics (served at ``/metrics`` by :mod:`ddnn.edge.http`)."""

from __future__ import annotations

import collections
import math
from collections.abc import Callable

from ddnn.plumbing.metrics import Registry
from ddnn.result import EXITS, NO_EXIT

_SEGMENT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0)
# Fine below a millisecond: what the edge adds after a frame's last view is a fraction of one.
_STAGE_BUCKETS = (0.00005, 0.0001, 0.00015, 0.0002, 0.00025, 0.0003, 0.00035, 0.0004, 0.0005,
                  0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1,
                  0.2, 0.5, 1.0, 2.0, 5.0)


class EdgeMetrics:
    """Every series the edge exports; names start with ``ddnn_edge_``."""

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
        self._conduct(r)
        self.clock_skewed = r.counter("ddnn_edge_clock_skewed_total",
                                      "Messages stamped far from the edge's clock, by device",
                                      ("device",))
        self.missing = r.counter("ddnn_edge_missing_views_total",
                                 "Views a frame expected but fused without, by stage", ("stage",))
        self._pulls(r)
        self.cloud = r.counter("ddnn_edge_cloud_requests_total",
                               "Calls to the cloud, by outcome", ("outcome",))
        self.cloud_up = r.gauge("ddnn_edge_cloud_up", "1 while the cloud answers, else 0")
        self.devices_online = r.gauge("ddnn_edge_device_online",
                                      "1 while a device's status is online", ("device",))
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

        # Compute times of segments, observed once the frame's result is out (not on its path).
        self._computed: collections.deque[tuple[str, float]] = collections.deque()

    def _pulls(self, r: Registry) -> None:
        """What the edge asks of the devices."""
        self.requests = r.counter("ddnn_edge_feature_requests_total", "Feature pulls published")
        self.detail_requests = r.counter("ddnn_edge_detail_requests_total",
                                         "Detail pulls published (frames escalated to the cloud "
                                         "with their cameras' detail)")

    def _conduct(self, r: Registry) -> None:
        """Devices that misbehave (docs/security.md)."""
        self.refused = r.counter("ddnn_edge_refused_views_total",
                                 "Views refused for their device's conduct, by device and reason: "
                                 "ran ahead of the other devices' views (ahead), scores out of "
                                 "the bundle's bounds (scores)", ("device", "reason"))
        self.flagged = r.gauge("ddnn_edge_device_flagged",
                               "1 while a device is flagged for most of its recent views: ran "
                               "ahead (ahead), scores out of bounds (scores), both not waited "
                               "for nor fused; capture times off (clock), not used for latency",
                               ("device", "reason"))

    def received(self, kind: str, messages: int, payload_bytes: int, header_bytes: int) -> None:
        """Device messages taken by the ingest (its counts, handed over in bulk)."""
        self.messages.inc(messages, kind=kind)
        self.bytes.inc(payload_bytes, kind=kind, part="payload")
        self.bytes.inc(header_bytes, kind=kind, part="header")

    def computed(self, step: str, seconds: float) -> None:
        """A segment's compute time, for :meth:`observe_computed` (any thread)."""
        self._computed.append((step, seconds))

    def observe_computed(self) -> None:
        """Observe the compute times noted since the last call."""
        while self._computed:  # (a deque: threads append while this one takes)
            step, seconds = self._computed.popleft()
            self.segment.observe(seconds, step=step)

    def render(self) -> str:
        for hook in self.before_render:  # counts kept in plain integers on the hot path
            hook()
        return self.registry.render()


class LearningMetrics:
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
