"""A running device: agent, outbox, transport and the sender thread between them.

``DeviceService.from_settings(settings)`` builds everything ``ddnn device`` runs; the service is
a context manager that starts the transport and the sender on entry and stops them on exit.
``run()`` replays the source, delivers everything queued, keeps answering pulls for a grace
period, then returns. The CLI and the tests build and run devices the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from ddnn.bundle import Bundle, load_bundle
from ddnn.device.agent import DeviceAgent
from ddnn.device.buffer import Outbox
from ddnn.device.failover import FailoverTransport
from ddnn.device.health import DeviceMetrics, DeviceVersionProbe, SourceWatch, monitor
from ddnn.device.message import OutMessage
from ddnn.device.sender import Sender
from ddnn.device.settings import DeviceSettings, after_send_mode
from ddnn.device.sources import Camera, ImageFolder, NpzReplay
from ddnn.device.spool_run import SpoolRun, default_spool_dir
from ddnn.device.transport import HttpTransport, MqttTransport
from ddnn.device.updates import DeviceUpdates
from ddnn.errors import ConfigError
from ddnn.plumbing.good_version import resume
from ddnn.plumbing.health import MonitorServer
from ddnn.plumbing.lifecycle import Lifecycle
from ddnn.plumbing.mqtt import BrokerRefusedError, MqttOptions
from ddnn.plumbing.retry import RetryPolicy
from ddnn.runtime import BundleRuntime
from ddnn.topics import Topics, default_device_ids

log = logging.getLogger(__name__)

Source = Iterable[tuple[int, np.ndarray]]  # (frame id, float32 (3, H, W) image in [0, 1])


class DeviceService:
    """Wires a :class:`DeviceAgent` to a transport through a bounded :class:`Outbox` and its
    :class:`~ddnn.device.sender.Sender`, with over-the-air updates (MQTT only,
    :class:`~ddnn.device.updates.DeviceUpdates`), and replays the source (:meth:`run`).

    ``settings`` must be resolved for ``bundle`` (:meth:`from_settings` does that). Nothing
    runs until the ``with`` block: entering starts the parts of :attr:`lifecycle` in order —
    the HTTP server (with ``--http-port``: a port in use fails before anything runs), the
    over-the-air updater (MQTT only), the transport and the sender thread; leaving stops them
    in reverse, settling the outbox and closing the source on the way.
    """

    def __init__(self, settings: DeviceSettings, bundle: Bundle, source: Source | None = None):
        self.settings, self.bundle = settings, bundle
        # Watched for the health check (a source that stops producing); stopped with us.
        self.source = SourceWatch(source) if source is not None else None
        self.stop_event = threading.Event()
        if hasattr(source, "stop_event"):  # a camera or a followed folder stops waiting too
            source.stop_event = self.stop_event
        self.refused: BrokerRefusedError | None = None  # the broker refused us for good
        self.outbox = Outbox(settings.buffer, None if settings.no_spool else settings.spool,
                             sync_every=settings.spool_sync_every,
                             sync_interval=settings.spool_sync_ms / 1000,
                             max_bytes=int(settings.buffer_mb * (1 << 20)),
                             run=spool_run(settings, bundle, source))
        self.metrics = DeviceMetrics()
        self.metrics.bundle.set(1, model=bundle.manifest.name, version=bundle.manifest.version)
        self.http: MonitorServer | None = None  # /metrics, /healthz, /livez (--http-port)
        self.agent = DeviceAgent(BundleRuntime(bundle, threads=settings.threads), settings,
                                 emit=self.deliver)
        self.transport = self._transport()
        self.sender = Sender(self.outbox, self.transport)
        # Updates are announced over MQTT.
        self.updates = (DeviceUpdates(settings, bundle, self.agent, self.metrics, self.mqtt,
                                      DeviceVersionProbe(self))
                        if self.mqtt is not None else None)
        self.updater = self.updates.updater if self.updates is not None else None
        self._clean = True  # False when leaving on an error: a version on probation is condemned
        self.lifecycle = self._lifecycle()

    @classmethod
    def from_settings(cls, settings: DeviceSettings) -> DeviceService:
        """Load and verify the bundle, check the settings against it, open the frame source."""
        bundle = load_bundle(settings.bundle, public_key=settings.bundle_key)
        # The version it had over the air, unless --bundle is newer.
        bundle = resume(bundle, tag=settings.device_id, public_key=settings.bundle_key)
        settings = for_bundle(settings, bundle)
        log.info("device config: bundle %s, %s", bundle.ref, settings.describe())
        return cls(settings, bundle, open_source(settings, bundle))

    @property
    def mqtt(self) -> MqttTransport | None:
        """The MQTT side of the uplink (statuses, peers, updates); None on HTTP alone."""
        t = self.transport
        return t.mqtt if isinstance(t, FailoverTransport) else (
            t if isinstance(t, MqttTransport) else None)

    def _transport(self) -> MqttTransport | HttpTransport | FailoverTransport:
        s = self.settings
        http = None
        if s.edge_url:
            http = HttpTransport(s.edge_url, s.token,
                                 ca_file=str(s.edge_ca_file) if s.edge_ca_file else None)
        if not s.broker:
            return http  # type: ignore[return-value]
        options = MqttOptions(keepalive=s.keepalive, reconnect_max=s.reconnect_max,
                              connect_timeout=s.connect_timeout, security=s.security)
        # "since": when this device came online; replaying peers agree on a start from it.
        status = {"device": s.device_id, "view": s.view, "model": self.bundle.ref,
                  "mode": s.mode, "since": round(time.time(), 3)}
        transport = MqttTransport(s.broker, Topics(s.deployment, s.topic_prefix), s.device_id,
                                  s.edge_id, options, status, self.agent.handle_request,
                                  on_bundle=self._on_bundle, on_refused=self._on_refused)
        # A pull repeated after a reconnection is answered again (the agent's de-duplication).
        self.agent.connections = lambda: transport.client.connects
        if http is not None:  # both: HTTP(S) while the broker is away
            return FailoverTransport(transport, http, s.failover_after, lambda: dict(
                model=self.agent.manifest.name, deployment=s.deployment, device=s.device_id))
        return transport

    # --- lifetime ----------------------------------------------------------------------------

    def _lifecycle(self) -> Lifecycle:
        parts = Lifecycle()
        if self.settings.http.port is not None:
            parts.add("http", start=self._start_http, stop=lambda: self.http.stop(),
                      alive=lambda: self.http.alive())
        close = getattr(self.source.source if self.source is not None else None, "close", None)
        if close is not None:
            parts.add("source", stop=close)
        if self.updater is not None:
            parts.add("bundle updater", self.updater,
                      stop=lambda: self.updater.stop(clean=self._clean))
        parts.add("outbox", stop=self.sender.close_outbox)
        parts.add({MqttTransport: "mqtt", HttpTransport: "http fallback",
                   FailoverTransport: "mqtt+http failover"}[type(self.transport)],
                  self.transport)
        parts.add("sender", self.sender.worker)
        return parts

    def _start_http(self) -> None:
        s = self.settings
        self.http = monitor(self, s.http.host, s.http.port).start()

    def __enter__(self) -> DeviceService:
        self.lifecycle.start()
        return self

    def __exit__(self, *exc) -> None:
        self._clean = exc[0] is None
        self.stop_event.set()
        self.lifecycle.stop()
        s = self.agent.stats
        log.info(
            "device %s done: %d frames (%d absent, %d skipped, %d local exits), sent %s, %d "
            "payload + %d header bytes, pulls answered %d missed %d repeated %d, bad requests "
            "%d, outbox dropped %d",
            self.settings.device_id, s.frames, s.absent, s.skipped, s.local_exits, dict(s.sent),
            s.payload_bytes, s.header_bytes, s.pulls_answered, s.pulls_missed,
            s.pulls_repeated, s.bad_requests,
            self.outbox.dropped,
        )

    # --- hooks of the transport ---------------------------------------------------------------

    def _on_bundle(self, payload: bytes) -> None:
        if self.updater is not None:
            self.updater.on_message(payload)

    def _on_refused(self, error: BrokerRefusedError) -> None:
        # Credentials or certificates refused: stop instead of buffering forever.
        self.refused = error
        self.stop_event.set()

    def deliver(self, msg: OutMessage) -> None:
        """What the agent emits: to the sender (sent at once, or queued in order)."""
        self.sender.deliver(msg)

    # --- a whole replay ----------------------------------------------------------------------

    def _agree_on_start(self) -> float | None:
        """When this replay's frame 0 is captured, agreed with the peers through the broker.

        Devices started one after another (a shell loop, a busy machine) would otherwise replay
        frame n seconds apart, and the edge would answer most frames without the late views.
        Each device waits for the edge and its peers to be online, then starts at the moment
        the last of them came online (their retained statuses say when), plus a margin: the
        same time on every device. ``--start-at`` fixes it instead; ``--wait-peers 0`` starts
        at once.
        """
        s = self.settings
        if s.start_at is not None or s.wait_peers <= 0:
            return s.start_at
        log.info("waiting up to %g s for the edge %s and the devices %s to be online",
                 s.wait_peers, s.edge_id, ",".join(s.peers))
        if not self.transport.wait_peers(list(s.peers), s.wait_peers, self.stop_event):
            if not self.stop_event.is_set():
                log.warning("not every peer came online within %.0f s; starting now",
                            s.wait_peers)
            return None
        start = getattr(self.transport, "agreed_start", lambda peers: None)(list(s.peers))
        if start is not None:
            log.info("replay starts at %.3f, agreed with %s", start, ", ".join(s.peers))
        return start

    def run(self, source: Source | None = None) -> None:
        """Replay ``source`` (default: the settings' source), then drain and linger for pulls;
        returns when done or stopped."""
        s = self.settings
        source = self.source if source is None else source
        if source is None:
            raise ConfigError("no frame source to replay")
        start_at = self._agree_on_start() if s.camera is None else None
        t0 = time.monotonic()
        self.agent.replay(source, self.stop_event, start_at)
        log.info("replayed %d frames in %.2f s", self.agent.stats.frames, time.monotonic() - t0)
        self.drain(s.drain_timeout)
        # The edge pulls features of the last frames after it has their scores: keep serving
        # until it has been quiet for the grace period.
        deadline = time.monotonic() + s.drain_timeout
        while not self.stop_event.is_set() and time.monotonic() < deadline:
            quiet = self.agent.seconds_since_request()
            if quiet >= s.grace and len(self.outbox) == 0:
                break
            self.stop_event.wait(min(0.05, max(s.grace - quiet, 0.01)))
        self.drain(s.drain_timeout)

    def drain(self, timeout: float) -> bool:
        """Wait until the outbox is empty and the broker acknowledged everything."""
        return self.sender.drain(timeout, self.stop_event)


def for_bundle(settings: DeviceSettings, bundle: Bundle) -> DeviceSettings:
    """``settings`` checked against the bundle, with what depends on it filled in."""
    m = bundle.manifest
    if not settings.view < m.views:
        raise ConfigError(f"--view {settings.view} is outside the bundle's views "
                          f"0..{m.views - 1}")
    mode = settings.mode
    if settings.edge_url and mode == "pull" and m.views > 1:
        log.info("the HTTP path%s has no pull channel: using push mode",
                 " (failover)" if settings.broker else "")
        mode = "push"
    peers = settings.peers or tuple(default_device_ids(m.views))
    spool = settings.spool
    if spool is None and not settings.no_spool:
        spool = default_spool_dir(settings.deployment, settings.device_id)
    return dataclasses.replace(settings, mode=mode, peers=peers, spool=spool)


def spool_run(settings: DeviceSettings, bundle: Bundle, source: Source | None) -> SpoolRun:
    """Who writes the spool: what a restart of this run sends again, and nothing else."""
    s = settings
    where = (f"data:{Path(s.data).resolve()}" if s.data is not None else
             f"images:{Path(s.images).resolve()}" if s.images is not None else
             f"camera:{s.camera}")
    return SpoolRun(s.deployment, s.device_id, bundle.ref, where,  # type: ignore[arg-type]
                    replayed=getattr(source, "replayed", None))


def open_source(settings: DeviceSettings, bundle: Bundle) -> Source:
    """The frame source the settings name (exactly one of data, images, camera)."""
    m, s = bundle.manifest, settings
    if s.data is not None:
        return NpzReplay(s.data, s.view, m.num_classes, s.limit, s.start)
    if s.images is not None:
        mode, archive = after_send_mode(s.after_send)
        return ImageFolder(s.images, m.input_shape, s.limit, follow=s.follow, after_send=mode,
                           archive=archive, fps=s.fps)
    retry = RetryPolicy(initial=min(0.5, s.camera_retry_max), maximum=s.camera_retry_max)
    return Camera(s.camera, m.input_shape, s.limit, s.fps, retries=s.camera_retries,
                  retry=retry)
