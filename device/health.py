"""A device's own metrics and health, served on ``--http-port``.

``GET /metrics`` (Prometheus: frames, messages sent by kind, outbox depth and drops, broker
connection, pulls answered and missed, bundle version), ``GET /healthz`` = ``/readyz`` (503
with reasons when the broker has been unreachable for longer than ``--health-grace``, the
broker refused this device for good, or the source has produced no frame for
``--stall-after`` seconds while it should, e.g. a camera being reopened) and ``GET /livez``
(the threads of the service's lifecycle run: sender, MQTT, updater).

The agent counts in plain integers (:class:`~ddnn.device.agent.DeviceStats`); the metrics are
brought up to date from them at each scrape. :class:`DeviceVersionProbe` is what the probation
of an over-the-air update looks at (:mod:`ddnn.plumbing.probation`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator

from ddnn.plumbing.health import Check, MonitorServer, check_route
from ddnn.plumbing.metrics import CONTENT_TYPE, Registry
from ddnn.plumbing.probation import Look


class SourceWatch:
    """Wraps a frame source: when it last produced a frame, and whether it has ended."""

    def __init__(self, source: Iterable):
        self.source = source
        self.started: float | None = None  # monotonic: iteration began
        self.last: float | None = None  # monotonic: the last frame came
        self.busy_since: float | None = None  # monotonic: the consumer took a frame, not back yet
        self.finished = False

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        self.started = self.last = time.monotonic()
        self.finished = False
        try:
            for item in self.source:
                self.last = self.busy_since = time.monotonic()
                yield item  # the agent runs the frame until it asks for the next one
                self.busy_since = None
        finally:
            self.finished = True
            self.busy_since = None

    def silent_for(self) -> float | None:
        """Seconds since the last frame while the source runs; None when it does not run."""
        if self.last is None or self.finished:
            return None
        return time.monotonic() - self.last

    def busy_for(self) -> float | None:
        """Seconds the consumer has been on the current frame; None while it waits for one."""
        since = self.busy_since
        return None if since is None or self.finished else time.monotonic() - since

    @property
    def problem(self) -> str | None:
        return getattr(self.source, "problem", None)


class DeviceMetrics:
    """Every series a device exports; names start with ``ddnn_device_``."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.frames = r.counter("ddnn_device_frames_total", "Frames processed")
        self.absent = r.counter("ddnn_device_absent_frames_total",
                                "Frames in which this view saw nothing")
        self.skipped = r.counter("ddnn_device_skipped_frames_total",
                                 "Frames dropped unprocessed because the device fell behind its "
                                 "source (the edge is told: missing 'skipped')")
        self.local_exits = r.counter("ddnn_device_local_exits_total",
                                     "Frames this one-view device answered itself")
        self.sent = r.counter("ddnn_device_messages_total", "Messages queued to send, by kind",
                              ("kind",))
        self.bytes = r.counter("ddnn_device_sent_bytes_total",
                               "Bytes queued to send: tensor payload or envelope header",
                               ("part",))
        self.pulls = r.counter("ddnn_device_pulls_total", "Feature pulls of the edge, by outcome",
                               ("outcome",))
        self.bad_requests = r.counter("ddnn_device_bad_requests_total",
                                      "Malformed or foreign feature pulls dropped")
        self.dropped = r.counter("ddnn_device_outbox_dropped_total",
                                 "Messages dropped by the full outbox (the oldest first)")
        self.depth = r.gauge("ddnn_device_outbox_messages",
                             "Messages in the outbox, by state", ("state",))
        self.broker_up = r.gauge("ddnn_device_broker_connected",
                                 "1 while the uplink (broker or edge) is reachable")
        self.source_age = r.gauge("ddnn_device_source_silence_seconds",
                                  "Seconds since the source's last frame (0: not running)")
        self.bundle = r.gauge("ddnn_device_bundle_info", "1 for the bundle version the device runs",
                              ("model", "version"))
        self.bundle_updates = r.counter("ddnn_device_bundle_updates_total",
                                        "Over-the-air bundle updates, by result", ("result",))
        self._lock = threading.Lock()

    def sync(self, service) -> None:
        """Bring every series up to date from ``service`` (a DeviceService)."""
        s, box = service.agent.stats, service.outbox
        with self._lock:
            self.frames.catch_up(s.frames)
            self.absent.catch_up(s.absent)
            self.skipped.catch_up(s.skipped)
            self.local_exits.catch_up(s.local_exits)
            for kind, n in list(s.sent.items()):
                self.sent.catch_up(n, kind=kind)
            self.bytes.catch_up(s.payload_bytes, part="payload")
            self.bytes.catch_up(s.header_bytes, part="header")
            self.pulls.catch_up(s.pulls_answered, outcome="answered")
            self.pulls.catch_up(s.pulls_missed, outcome="missed")
            self.bad_requests.catch_up(s.bad_requests)
            self.dropped.catch_up(box.dropped)
            self.depth.set(box.waiting(), state="waiting")
            self.depth.set(box.in_flight(), state="unacknowledged")
            self.broker_up.set(1 if uplink_down_for(service.transport) is None else 0)
            silent = service.source.silent_for() if isinstance(service.source, SourceWatch) \
                else None
            self.source_age.set(silent or 0.0)

    def render(self, service) -> str:
        self.sync(service)
        return self.registry.render()


def uplink_down_for(transport) -> float | None:
    """Seconds the transport has been unable to reach its peer; None while it can."""
    return transport.down_for()


def readiness(service) -> Check:
    """Whether the device does its work: uplink, source, outbox."""
    s = service.settings
    stats = service.agent.stats
    check = Check(details={"frames": stats.frames, "skipped": stats.skipped,
                           "outbox": len(service.outbox), "dropped": service.outbox.dropped})
    if stats.skipped:  # still serving: the frames it keeps up with are on time
        check.details["warnings"] = [
            f"this device cannot keep up with its source: {stats.skipped} of {stats.frames} "
            "frames skipped (ddnn_device_skipped_frames_total); a faster board, a lower --fps "
            "or a smaller device segment"]
    if service.refused is not None:
        check.reasons.append(f"the broker refused this device for good: {service.refused}")
    transport = service.transport
    down = transport.down_for()
    check.details["uplink"] = transport.describe()
    if down is not None and down > s.health_grace:
        why = transport.last_error()
        check.reasons.append(f"uplink unreachable for {down:.0f} s (more than "
                             f"--health-grace {s.health_grace:g} s); messages wait in the "
                             f"outbox ({len(service.outbox)})"
                             + (f"; last attempt: {why}" if why else ""))
    if service.updater is not None:
        check.details["bundle"] = service.updater.status()
    source = service.source
    if isinstance(source, SourceWatch):
        if source.problem:
            check.reasons.append(source.problem)
        silent, limit = source.silent_for(), stall_limit(s)
        if silent is not None and silent > limit:
            check.reasons.append(f"source stalled: no frame for {silent:.0f} s (more than "
                                 f"{limit:g} s)")
    return check


def stall_limit(settings) -> float:
    """Seconds without a new frame that count as a stall: ``--stall-after``, at least three
    frame periods."""
    return max(settings.stall_after, 3 / settings.fps if settings.fps > 0 else 0.0)


class DeviceVersionProbe:
    """What a device sees of the bundle version it runs, for its probation: it worked if it
    processed frames; it fails while one frame takes longer than a stall (the segment hangs or
    crawls; a source that produces nothing is not the version's fault). A segment that raises
    ends the process, and the next start rolls the version back."""

    def __init__(self, service):
        self.service = service
        self._frames = service.agent.stats.frames

    def begin(self) -> None:
        self._frames = self.service.agent.stats.frames

    def look(self) -> Look:
        frames = self.service.agent.stats.frames
        worked, self._frames = frames > self._frames, frames
        source, limit = self.service.source, stall_limit(self.service.settings)
        busy = source.busy_for() if isinstance(source, SourceWatch) else None
        if busy is not None and busy > limit:
            return Look(worked, (f"one frame has been running for {busy:.0f} s (more than "
                                 f"{limit:g} s)",))
        return Look(worked)


def monitor(service, host: str, port: int) -> MonitorServer:
    """The device's HTTP server: /metrics, /healthz, /readyz, /livez."""
    metrics: DeviceMetrics = service.metrics

    def scrape() -> tuple[int, str, bytes]:
        return 200, CONTENT_TYPE, metrics.render(service).encode()

    ready = check_route(lambda: readiness(service))
    return MonitorServer({"/metrics": scrape, "/healthz": ready, "/readyz": ready,
                          "/livez": check_route(service.lifecycle.liveness)}, host, port,
                         name="device")
