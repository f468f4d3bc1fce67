"""A running edge: the aggregator wired to the broker, the cloud and its HTTP server."""

from __future__ import annotations

import logging
import time

from ddnn.edge.aggregator import EdgeAggregator
from ddnn.edge.http import EdgeHttpServer
from ddnn.plumbing.mqtt import QOS_FEATURES, QOS_SCORES, QOS_STATUS, MqttClient, MqttOptions

log = logging.getLogger(__name__)


class EdgeService:
    """Owns the MQTT client (optional), the aggregator's threads and the HTTP server (optional)."""

    def __init__(self, aggregator: EdgeAggregator, broker: str | None,
                 options: MqttOptions | None = None, http_host: str = "127.0.0.1",
                 http_port: int | None = None, http_token: str | None = None):
        self.aggregator = agg = aggregator
        t = agg.topics
        self.mqtt: MqttClient | None = None
        self.on_bundle = None  # bundle announcements (over-the-air updates, ddnn.plumbing.ota)
        if broker:
            options = options or MqttOptions()
            options.persistent = True  # the broker keeps device messages while the edge restarts
            options.subscriptions = [(t.all_devices("scores"), QOS_SCORES),
                                     (t.all_devices("features"), QOS_FEATURES),
                                     (t.all_devices("status"), QOS_STATUS),
                                     (t.bundle, 1)]
            self.mqtt = MqttClient(
                broker, f"ddnn-{t.deployment}-{agg.config.edge_id}", options,
                status_topic=t.edge_status(agg.config.edge_id),
                status_info={"edge": agg.config.edge_id, "model": agg.runtime.bundle.ref},
                on_message=self._on_message, on_connect=self._connected,
                on_disconnect=lambda: agg.metrics.broker_up.set(0))
            agg._publish = self.mqtt.publish
            agg._connected = self.mqtt.connected.is_set
        self.http = (EdgeHttpServer(agg, http_host, http_port, http_token)
                     if http_port is not None else None)

    def _on_message(self, topic: str, payload: bytes) -> bool | None:
        if topic == self.aggregator.topics.bundle:
            if self.on_bundle is not None:
                self.on_bundle(payload)
            return None
        return self.aggregator.on_message(topic, payload)

    def _connected(self) -> None:
        self.aggregator.metrics.broker_up.set(1)
        self.aggregator.on_reconnect()

    def start(self) -> EdgeService:
        self.aggregator.start()
        if self.http:
            self.http.start()
        if self.mqtt:
            self.mqtt.start()
        return self

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

    def stop(self) -> None:
        if self.mqtt:
            agg, cfg = self.aggregator, self.aggregator.config
            cloud = agg.cloud.timeout if agg.cloud is not None else 0.0
            agg.drain(cfg.deadline + cfg.feature_deadline + cloud + 1.0)
        self.flush(5.0)
        if self.mqtt:
            self.mqtt.stop()
        self.aggregator.stop()
        if self.http:
            self.http.stop()
        m = self.aggregator.metrics
        log.info("edge %s done: %d results (local %d, edge %d, cloud %d, degraded %d)",
                 self.aggregator.config.edge_id, self.aggregator.answered,
                 m.frames.value(exit="local", degraded="false"),
                 m.frames.value(exit="edge", degraded="false"),
                 m.frames.value(exit="cloud", degraded="false"),
                 m.frames.value(exit="edge", degraded="true"))
