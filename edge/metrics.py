"""The edge aggregator's Prometheus metrics (served at ``/metrics`` by :mod:`ddnn.edge.http`)."""

from __future__ import annotations

import collections
from collections.abc import Callable

from ddnn.plumbing.metrics import Registry

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
                                "Frames answered, by exit tier and whether the answer is degraded",
                                ("exit", "degraded"))
        for tier in ("local", "edge", "cloud"):
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
        self.clock_skewed = r.counter("ddnn_edge_clock_skewed_total",
                                      "Messages stamped far from the edge's clock, by device",
                                      ("device",))
        self.missing = r.counter("ddnn_edge_missing_views_total",
                                 "Views a frame expected but fused without, by stage", ("stage",))
        self.requests = r.counter("ddnn_edge_feature_requests_total", "Feature pulls published")
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

        # Compute times of segments, observed once the frame's result is out (not on its path).
        self._computed: collections.deque[tuple[str, float]] = collections.deque()

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
