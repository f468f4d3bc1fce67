"""How a device reaches its edge: MQTT (the normal case) or HTTP(S) POSTs (no broker configured;
with one, :mod:`~ddnn.device.failover` switches between the two).

Both take :class:`~ddnn.device.buffer.OutMessage` from :class:`~ddnn.device.service.DeviceService`,
one at a time, oldest first. ``send`` returns False when the message could not be handed over
now; it then stays in the outbox and is sent after reconnection, in order.
"""

from __future__ import annotations

import http.client
import logging
import queue
import threading
import time
from collections.abc import Callable

from ddnn.device.message import OutMessage, Receipt
from ddnn.plumbing.mqtt import BrokerRefusedError, MqttClient, MqttOptions
from ddnn.plumbing.retry import RETRY_STATUSES, RetryPolicy
from ddnn.plumbing.throttle import LogThrottle
from ddnn.status import status_fields, status_time
from ddnn.topics import DELIVERY, Topics, subscription

log = logging.getLogger(__name__)


class PubackReceipt:
    """The receipt of one MQTT publish: true once the broker acknowledged it (PUBACK)."""

    __slots__ = ("_transport", "acked")

    def __init__(self, transport: MqttTransport):
        self._transport, self.acked = transport, False

    def is_published(self) -> bool:
        if not self.acked:
            self._transport.collect_acks()
        return self.acked

STOP_CHECK = 0.1  # seconds between two looks at the stop flag while waiting for peers

# Seconds between the last peer coming online and the agreed replay start: time for its status
# to reach every device through the broker, with room for a busy machine.
START_MARGIN = 1.0


class MqttTransport:
    """Publishes a device's messages and receives the edge's feature pulls over MQTT.

    ``on_request`` gets the edge's pulls, ``on_bundle`` the bundle announcements (over-the-air
    updates), both on paho's thread; ``on_refused`` is called once when the broker refuses this
    client for good (credentials, certificate).
    """

    def __init__(self, url: str, topics: Topics, device_id: str, edge_id: str,
                 options: MqttOptions, status_info: dict, on_request: Callable[[bytes], None],
                 *, on_bundle: Callable[[bytes], None] | None = None,
                 on_refused: Callable[[BrokerRefusedError], None] | None = None,
                 max_pending: int = 1000):
        self.topics, self.device_id, self.edge_id = topics, device_id, edge_id
        self.max_pending = max_pending  # bounds what paho holds beyond our outbox
        self.peers: dict[str, str] = {}  # device or edge id -> "online"/"offline"
        self.since: dict[str, float] = {}  # device id -> when it came online (its status says)
        self._peers_changed = threading.Condition()
        self._on_request = on_request
        # message kind -> (topic, QoS); an absent or skipped view goes on the scores topic
        self._routes = {kind: (topic, DELIVERY[wire].qos) for kind, topic, wire in (
            ("scores", topics.device(device_id, "scores"), "scores"),
            ("absent", topics.device(device_id, "scores"), "scores"),
            ("skipped", topics.device(device_id, "scores"), "scores"),
            ("features", topics.device(device_id, "features"), "features"),
            # A one-view device's own result: to the edge, which publishes it (broker ACL).
            ("results", topics.device(device_id, "results"), "results"))}
        self._requests = topics.requests(edge_id)
        self._edge_status = topics.edge_status(edge_id)
        options.subscriptions = [subscription(self._requests, "requests"),
                                 subscription(topics.all_devices("status"), "status"),
                                 subscription(self._edge_status, "status"),
                                 subscription(topics.bundle, "bundle")]
        self._on_bundle = on_bundle
        # PUBACKs: paho reports the mid (its thread, its lock held); receipts are settled by
        # whoever asks, from this queue.
        self._acks: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._awaiting: dict[int, PubackReceipt] = {}  # mid -> receipt
        self._awaiting_lock = threading.Lock()
        self.client = MqttClient(url, f"ddnn-{topics.deployment}-{device_id}", options,
                                 status_topic=topics.device(device_id, "status"),
                                 status_info=status_info, on_message=self._message,
                                 on_refused=on_refused, on_published=self._acks.put)

    def _message(self, topic: str, payload: bytes) -> None:
        if topic == self._requests:
            self._on_request(payload)
            return
        if topic == self.topics.bundle:
            if self._on_bundle is not None:
                self._on_bundle(payload)
            return
        if topic == self._edge_status:
            peer = f"edge:{self.edge_id}"
        else:
            parsed = self.topics.parse_device(topic)
            if parsed is None:
                return
            peer = parsed[0]
        info = status_fields(payload)
        state = info.get("state")
        if state in ("online", "offline"):
            with self._peers_changed:
                self.peers[peer] = state
                since = status_time(info, "since")  # (one far ahead would stall the start)
                if since is not None:
                    self.since[peer] = since
                self._peers_changed.notify_all()

    def start(self) -> None:
        self.client.start()

    def alive(self) -> bool:
        """paho's thread runs, or ended because the broker refused this device for good (then
        the service stops, and its health says why)."""
        return self.client.refused is not None or self.client.alive()

    def update_status(self, **info) -> None:
        """Change fields of the retained status (the bundle version after an update)."""
        self.client.presence.update(**info)

    @property
    def connected(self) -> bool:
        return self.client.connected.is_set()

    def down_for(self) -> float | None:
        """Seconds since the broker was lost (or this device started); None while connected."""
        since = self.client.disconnected_since
        return None if since is None else time.monotonic() - since

    def last_error(self) -> str | None:
        """Why the last attempt to connect failed; None once connected."""
        return self.client.attempts.last_error

    def describe(self) -> dict:
        """For /healthz: where the uplink goes and how it fares."""
        return {"via": "mqtt", "broker": str(self.client.url), "connected": self.connected,
                "failed_attempts": self.client.attempts.failures,
                "last_error": self.last_error()}

    def can_send(self) -> bool:
        return self.connected and self.client.pending() < self.max_pending

    def send(self, msg: OutMessage) -> Receipt | None:
        """Hand ``msg`` to paho; the receipt turns true when the broker acknowledged it. None
        when paho could not take it (it stays in the outbox)."""
        topic, qos = self._routes[msg.kind]
        self.collect_acks()  # keeps the receipts' table as small as what is in flight
        with self._awaiting_lock:  # the mid is registered before its PUBACK can be collected
            info = self.client.publish(topic, msg.payload, qos)
            if not self.client.queued(info):
                return None
            receipt = self._awaiting[info.mid] = PubackReceipt(self)
        return receipt

    def collect_acks(self) -> None:
        """Mark the receipts of the messages the broker acknowledged since the last call."""
        with self._awaiting_lock:
            while True:
                try:
                    mid = self._acks.get_nowait()
                except queue.Empty:
                    return
                receipt = self._awaiting.pop(mid, None)  # None: a status message
                if receipt is not None:
                    receipt.acked = True

    def idle(self) -> bool:
        """Everything handed over has been acknowledged by the broker."""
        return self.client.pending() == 0

    def wait_peers(self, devices: list[str], timeout: float, stop: threading.Event) -> bool:
        """Block until the edge and every listed device announce themselves online; False after
        ``timeout`` seconds, or soon after ``stop`` is set (a SIGTERM must not wait them out)."""
        wanted = [*devices, f"edge:{self.edge_id}"]
        deadline = time.monotonic() + timeout
        with self._peers_changed:
            while not all(self.peers.get(p) == "online" for p in wanted):
                left = deadline - time.monotonic()
                if left <= 0 or stop.is_set():
                    return False
                self._peers_changed.wait(min(left, STOP_CHECK))
        return True

    def agreed_start(self, devices: list[str]) -> float | None:
        """The replay start every device of ``devices`` computes alike: the moment the last of
        them came online (from their retained statuses), plus :data:`START_MARGIN`. None when
        one of them did not say."""
        with self._peers_changed:
            times = [self.since.get(d) for d in devices]
        if not times or any(t is None for t in times):
            return None
        return max(times) + START_MARGIN

    def stop(self) -> None:
        self.client.stop()


# A message is kept and sent again while the edge cannot take it *now*. 401/403 are retried
# too: a wrong token is fixed by an operator, and nothing is lost meanwhile beyond what the
# bounded outbox drops (counted).
HTTP_RETRY = RetryPolicy(initial=0.5, maximum=10.0,
                         retry_statuses=RETRY_STATUSES | {401, 403})


class HttpTransport:
    """POSTs envelopes to the edge's HTTP ingest (``/v1/ingest``): the fallback without a broker.

    There is no channel for the edge to pull features, so a device on HTTP runs in push mode.
    """

    def __init__(self, edge_url: str, token: str | None = None, timeout: float = 5.0,
                 ca_file: str | None = None):
        # Imported here: urllib3 costs an MQTT device 2.5 MiB it never uses.
        from ddnn.plumbing.http import KeepAliveConnection

        self._edge = KeepAliveConnection(edge_url, "edge", timeout, ca_file)
        self._headers = {"Content-Type": "application/octet-stream"}
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        self._backoff = HTTP_RETRY.backoff()
        self.connected = False
        self.disconnected_since: float | None = None  # monotonic: the edge became unreachable
        self.refused = 0  # messages the edge refused (4xx other than "later"): dropped
        self.last_failure: str | None = None  # why the last send failed; None after a success
        self._refusals_log = LogThrottle(every=1000)

    def start(self) -> None:
        pass

    def can_send(self) -> bool:
        return self._backoff.ready()

    def send(self, msg: OutMessage) -> bool:
        path = "/v1/results" if msg.kind == "results" else "/v1/ingest"
        headers = dict(self._headers)
        if msg.kind == "results":
            headers["Content-Type"] = "application/json"
        edge = self._edge
        try:
            status, body, _ = edge.request("POST", edge.path.rstrip("/") + path, msg.payload,
                                           headers)
        except (OSError, http.client.HTTPException) as e:
            return self._retry_later(f"edge {edge.netloc} unreachable ({e})")
        if HTTP_RETRY.retryable(status):
            # The edge is up but cannot take it now (overloaded, restarting, token not yet
            # rolled out): the message stays in the outbox and is sent again after a backoff,
            # on a fresh connection (a refusing server may close this one unannounced).
            edge.close()
            return self._retry_later(f"edge {edge.netloc} answered {status} {body[:200]!r}")
        if not self.connected:
            log.info("edge %s reachable over HTTP", edge.netloc)
        self.connected = True
        self.disconnected_since = None
        self.last_failure = None
        self._backoff.succeeded()
        if status >= 400:  # the edge refused this message itself: resending cannot help
            self.refused += 1
            if self._refusals_log():
                log.warning("edge refused a %s message (%d so far): %d %s", msg.kind,
                            self.refused, status, body[:200])
        return True

    def _retry_later(self, why: str) -> bool:
        if self.connected or self._backoff.failures == 0:
            log.warning("%s; keeping the message and retrying with backoff", why)
        self.connected = False
        self.last_failure = why
        if self.disconnected_since is None:
            self.disconnected_since = time.monotonic()
        self._backoff.failed()
        return False

    def idle(self) -> bool:
        return True

    def wait_peers(self, devices: list[str], timeout: float, stop: threading.Event) -> bool:
        return True

    def down_for(self) -> float | None:
        since = self.disconnected_since
        return None if since is None else time.monotonic() - since

    def last_error(self) -> str | None:
        return self.last_failure

    def describe(self) -> dict:
        return {"via": "http", "edge": self._edge.url, "connected": self.connected,
                "failed_attempts": self._backoff.failures, "last_error": self.last_failure}

    def stop(self) -> None:
        self._edge.close()
