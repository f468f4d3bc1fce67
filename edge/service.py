"""A running edge: the aggregator wired to the broker, the cloud, its HTTP server and updates.

:meth:`EdgeService.from_settings` builds everything ``ddnn edge`` runs from
:class:`~ddnn.edge.settings.EdgeSettings`; nothing runs until the service is entered (or started)::

    with EdgeService.from_settings(settings) as service:
        service.run_until(stop)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from ddnn.bundle import load_bundle
from ddnn.edge.aggregator import EdgeAggregator
from ddnn.edge.callback import ResultsCallback
from ddnn.edge.cloud_client import CLOUD_RETRY, CloudClient
from ddnn.edge.credentials import load_http_tokens
from ddnn.edge.device_results import DeviceResults
from ddnn.edge.events import EdgeEvents
from ddnn.edge.gateways import GatewayIngest
from ddnn.edge.health import EdgeHealth, EdgeVersionProbe
from ddnn.edge.http import EdgeHttpServer, server_tls
from ddnn.edge.metrics import EdgeMetrics
from ddnn.edge.settings import EdgeSettings, view_devices
from ddnn.edge.sinks import CallbackSink, FileSink, MqttSink, ResultSink
from ddnn.errors import ConfigError
from ddnn.plumbing.good_version import resume
from ddnn.plumbing.lifecycle import Lifecycle
from ddnn.plumbing.mqtt import BrokerRefusedError, MqttClient, MqttOptions
from ddnn.plumbing.ota import BundleUpdater
from ddnn.plumbing.ota_settings import UpdateHooks
from ddnn.plumbing.retry import RetryPolicy
from ddnn.runtime import BundleRuntime
from ddnn.topics import DEVICE_KINDS, GATEWAY_KINDS, Topics, subscription

log = logging.getLogger(__name__)


class EdgeService:
    """Owns the aggregator, the bundle updater and the MQTT client (with a broker) and the HTTP
    server (with an HTTP port). Entering starts the parts of :attr:`lifecycle` in order — the
    aggregator, the health sampler, the updater, the HTTP server and the MQTT client; leaving
    stops them in reverse, once the frames under way are answered. ``/livez`` lists them."""

    def __init__(self, settings: EdgeSettings, runtime: BundleRuntime, *,
                 cloud: CloudClient | None = None, sinks: Sequence[ResultSink] = (),
                 observers: Sequence[EdgeEvents] = (), max_inflight: int | None = None):
        self.settings = s = settings
        m = runtime.manifest
        devices = view_devices(s.devices, m.views)
        strangers = [d for _, ds in s.gateways for d in ds if d not in devices]
        if strangers:
            raise ConfigError(f"--gateways names devices that are not this edge's: {strangers}")
        topics = Topics(s.deployment, s.topic_prefix)
        self.metrics = EdgeMetrics()
        self.mqtt = (self._mqtt_client(s.broker, topics, runtime, max_inflight) if s.broker
                     else None)
        self.aggregator = EdgeAggregator(
            runtime, s, topics, devices=devices, metrics=self.metrics, cloud=cloud,
            sinks=[*self._sinks(topics), *sinks],
            publish=self.mqtt.publish if self.mqtt else None,
            connected=self.mqtt.connected.is_set if self.mqtt else lambda: True,
            observers=observers)
        # One-view devices' own results (their own topic, or through a gateway), checked.
        self.device_results = DeviceResults(self.aggregator)
        self.gateways = GatewayIngest(self.aggregator.ingest, topics, dict(s.gateways),
                                      self.aggregator.events, results=self.device_results)
        self.lifecycle = Lifecycle()  # its parts are added below, once made
        # /healthz, /readyz, /livez (edge.health), served by the HTTP server.
        self.health = EdgeHealth(self.aggregator, s, self.mqtt, lambda: self.updater,
                                 liveness=self.lifecycle.liveness)
        self.http: EdgeHttpServer | None = None
        if s.http.port is not None:
            access = s.http_access
            tokens = (load_http_tokens(access.http_tokens, devices) if access.http_tokens
                      else None)
            route = self.aggregator.feedback
            if route is not None and route.shares([access.http_token, *(tokens or {}).values()]):
                raise ConfigError("the operator token is a device's token (--http-token or "
                                  "--http-tokens): give the operator a token of its own")
            tls = server_tls(*access.tls) if access.tls is not None else None
            self.http = EdgeHttpServer(self.aggregator, s.http.host, s.http.port,
                                       access.http_token, tokens=tokens,
                                       max_connections=access.http_max_connections,
                                       health=self.health, tls=tls)
        # Updates are announced over MQTT.
        self.updater = self._updater() if self.mqtt is not None else None
        self._refused = threading.Event()
        self._started = False
        self._add_parts()

    @classmethod
    def from_settings(cls, settings: EdgeSettings, *, runtime: BundleRuntime | None = None,
                      sinks: Sequence[ResultSink] = (), observers: Sequence[EdgeEvents] = (),
                      cloud_retry: RetryPolicy = CLOUD_RETRY,
                      max_inflight: int | None = None) -> EdgeService:
        """Everything ``ddnn edge`` runs, built (not started) from ``settings``.

        ``sinks``: more places for every result (:class:`~ddnn.edge.sinks.ResultSink`), after those
        the settings configure; ``observers``: more observers of the edge's events
        (:class:`~ddnn.edge.events.EdgeEvents`), after its metrics and its log. ``runtime``: run
        this bundle runtime instead of loading ``settings.bundle``; with ``cloud_retry`` (the
        cloud client's backoff) and ``max_inflight`` (unacknowledged MQTT messages) for tests
        and benchmarks.
        """
        if runtime is None:
            bundle = load_bundle(settings.bundle, public_key=settings.bundle_key)
            # The version it had over the air, unless --bundle is newer.
            bundle = resume(bundle, tag=settings.edge_id, public_key=settings.bundle_key)
            runtime = BundleRuntime(bundle, threads=settings.threads)
        cloud = None
        link = settings.cloud_link
        if link.url:
            cloud = CloudClient(link.url, f"{runtime.manifest.name}-cloud", token=link.token,
                                timeout=link.timeout, retry=cloud_retry, ca_file=link.ca_file,
                                cert_file=link.cert_file, key_file=link.key_file,
                                codec=runtime.manifest.codec["edge_features"],
                                escalated=f"{runtime.manifest.name}-escalated")
        return cls(settings, runtime, cloud=cloud, sinks=sinks, observers=observers,
                   max_inflight=max_inflight)

    def _sinks(self, topics: Topics) -> list[ResultSink]:
        """The result sinks the settings configure: MQTT, a file, an application's URL."""
        results, out = self.settings.results, list[ResultSink]()
        if self.mqtt is not None:
            out.append(MqttSink(self.mqtt.publish, topics.results))
        if results.results_out is not None:
            out.append(FileSink(results.results_out))
        if results.results_url is not None:
            out.append(CallbackSink(ResultsCallback(results.results_url, self.metrics.callback,
                                                    token=results.results_token)))
        return out

    def _add_parts(self) -> None:
        parts = self.lifecycle
        parts.add("aggregator", self.aggregator.lifecycle)
        parts.add("edge-health", self.health)
        if self.updater is not None:
            parts.add("bundle-updater", self.updater)
        if self.http is not None:
            parts.add("edge-http", self.http)
        if self.mqtt is not None:
            mqtt = self.mqtt
            # (a refusal for good ends paho's thread by design: health says so, not /livez)
            parts.add("mqtt", mqtt, stop=self._stop_mqtt,
                      alive=lambda: mqtt.refused is not None or mqtt.alive())

    def _mqtt_client(self, broker: str, topics: Topics, runtime: BundleRuntime,
                     max_inflight: int | None) -> MqttClient:
        s = self.settings
        options = MqttOptions(
            keepalive=s.broker_link.keepalive, reconnect_max=s.broker_link.reconnect_max,
            security=s.security, connect_timeout=s.broker_link.connect_timeout,
            persistent=True,  # the broker keeps device messages while the edge restarts
            subscriptions=[subscription(topics.all_devices(k), k) for k in DEVICE_KINDS]
            + [subscription(topics.bundle, "bundle")]
            + [subscription(topics.gateway(g, k), k) for g, _ in s.gateways
               for k in GATEWAY_KINDS])
        if max_inflight is not None:
            options.max_inflight = max_inflight
        return MqttClient(
            broker, f"ddnn-{topics.deployment}-{s.edge_id}", options,
            status_topic=topics.edge_status(s.edge_id),
            status_info={"edge": s.edge_id, "model": runtime.bundle.ref},
            on_message=self._on_message, on_connect=self._connected,
            on_disconnect=lambda: self.aggregator.events.on_broker(False),
            on_refused=lambda error: self._refused.set())

    # --- MQTT callbacks (paho's thread) ---------------------------------------------------------

    def _on_message(self, topic: str, payload: bytes) -> bool | None:
        if topic == self.aggregator.topics.bundle:
            if self.updater is not None:
                self.updater.on_message(payload)
            return None
        if self.gateways.handles(topic):
            return self.gateways.on_message(topic, payload)
        if topic.endswith("/results"):  # a device's own result (cheap test first)
            parsed = self.aggregator.topics.parse_device(topic)
            if parsed is not None:
                self.device_results.take(payload, (parsed[0],), parsed[0])
                return None
        return self.aggregator.ingest.on_message(topic, payload)

    def _connected(self) -> None:
        self.aggregator.events.on_broker(True)
        self.aggregator.on_reconnect()

    # --- over-the-air bundle updates ------------------------------------------------------------

    def _updater(self) -> BundleUpdater:
        s, agg, events = self.settings, self.aggregator, self.aggregator.events

        def apply(bundle) -> None:
            agg.swap(BundleRuntime(bundle, threads=s.threads))

        hooks = UpdateHooks(
            apply=apply,
            on_result=lambda ok: events.on_bundle_update("applied" if ok else "refused"),
            on_retry=lambda ann, why: events.on_bundle_update("retry"),
            # The target of an update survives restarts (BundleUpdater): one announced before
            # this process started is announced to the ingest again here, before MQTT connects.
            on_announce=lambda ann: agg.ingest.versions.announce((ann.name, ann.version)),
            # messages of a refused version are another model's again
            on_refused=lambda ann: agg.ingest.versions.withdraw((ann.name, ann.version)),
            # failing its health check on probation rolls a version back
            on_rollback=lambda ref, why: events.on_bundle_update("rolled_back"))
        return BundleUpdater(agg.runtime.bundle, hooks, policy=s.updates,
                             source=s.cloud_link.update_source(), public_key=s.bundle_key,
                             tag=s.edge_id, probe=EdgeVersionProbe(self.health))

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> EdgeService:
        """Start the aggregator, the health sampler, the updater, the HTTP server and the MQTT
        client, in order (a part that fails to start stops those before it)."""
        agg, s = self.aggregator, self.settings
        log.info("edge config: bundle %s, devices %s, thresholds %s; settings %s",
                 agg.runtime.bundle.ref, ",".join(agg.devices),
                 dict(agg.pipeline.policy.thresholds), s.describe())
        self.lifecycle.start()
        self._started = True
        if agg.cloud is not None and not agg.cloud.ready():
            log.warning("cloud %s is not ready yet; frames past the edge exit are degraded "
                        "until it is", s.cloud_link.url)
        return self

    def _stop_mqtt(self) -> None:
        # Frames under way finish; messages of new ones stay with the broker for the next edge.
        s = self.settings
        cloud = self.aggregator.cloud.timeout if self.aggregator.cloud is not None else 0.0
        self.aggregator.drain(s.max_wait + s.feature_deadline + cloud + 1.0)
        self.flush(5.0)
        if self.mqtt is not None:
            self.mqtt.stop()

    def stop(self) -> None:
        """Stop what :meth:`start` started, in reverse order."""
        if not self._started:
            return
        self._started = False
        self.lifecycle.stop()
        m = self.metrics
        log.info("edge %s done: %d results (local %d, edge %d, cloud %d, degraded %d, no view "
                 "%d)",
                 self.settings.edge_id, self.aggregator.answered,
                 m.frames.value(exit="local", degraded="false"),
                 m.frames.value(exit="edge", degraded="false"),
                 m.frames.value(exit="cloud", degraded="false"),
                 m.frames.value(exit="edge", degraded="true"),
                 m.frames.value(exit="none", degraded="false"))

    def __enter__(self) -> EdgeService:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def run_until(self, stop: threading.Event) -> None:
        """Serve until ``stop`` is set, ``expect_frames`` results are out, or the broker refused
        this edge's credentials for good (:attr:`refused`)."""
        while not (stop.is_set() or self.aggregator.done.is_set() or self._refused.is_set()):
            stop.wait(0.1)

    @property
    def refused(self) -> BrokerRefusedError | None:
        """The broker's refusal of this edge's credentials or certificate, if it refused."""
        return self.mqtt.refused if self.mqtt is not None else None

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every published result and request has been acknowledged."""
        if self.mqtt is None:
            return True
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.mqtt.pending() == 0:
                return True
            time.sleep(0.01)  # polling paho's queue: it has no completion event
        return False
