"""The gateway at work: two MQTT clients (the site's broker, the edge's over the uplink) and
the coalescer between them.

Nothing is lost on the way: a device message is acknowledged on the local broker (a persistent
session) only once the batch that carries it was acknowledged upstream.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from ddnn import envelope as env
from ddnn.batch import MAX_ENTRY, batches, pack_batch
from ddnn.device.gateway.coalescer import Coalescer, Group
from ddnn.device.gateway.health import GatewayMetrics, monitor
from ddnn.device.gateway.roster import SiteRoster
from ddnn.device.gateway.settings import GatewaySettings
from ddnn.envelope import DecodeError
from ddnn.plumbing.health import MonitorServer
from ddnn.plumbing.lifecycle import Lifecycle, Worker
from ddnn.plumbing.mqtt import MqttClient, MqttOptions
from ddnn.plumbing.throttle import LogThrottle
from ddnn.result import Result, ResultError
from ddnn.topics import DELIVERY, DEVICE_KINDS, Topics, subscription

log = logging.getLogger(__name__)

STOP_WAIT = 5.0  # seconds a stopping gateway waits for its last batches' acknowledgements


class GatewayService:
    """The two MQTT clients and the coalescer between them, for the devices of its
    :class:`~ddnn.device.gateway.roster.SiteRoster`; a context manager over its
    :attr:`lifecycle` (the HTTP server with ``--http-port``, the edge's broker, the site's
    broker, the acknowledging and the flushing threads: stopped in reverse)."""

    def __init__(self, settings: GatewaySettings):
        s = self.settings = settings
        t = self.topics = Topics(s.deployment, s.topic_prefix)
        self._lock = threading.Lock()
        self._batches: dict[int, list] = {}  # upstream mid -> local deliveries to acknowledge
        # PUBACKs from upstream as (mid, taken): paho reports them with its own lock held, so
        # the local acknowledgements happen on a thread of ours.
        self._acks: queue.SimpleQueue[tuple[int, bool] | None] = queue.SimpleQueue()
        self._stopping = False
        # batches and messages sent up; groups sent complete or at their window's end;
        # messages dropped (bad, or too large to go up) and refused by the edge's broker
        self.forwarded = dict.fromkeys(("batches", "messages", "complete", "timed_out",
                                        "dropped", "refused"), 0)
        self._drops_log = LogThrottle(every=1000)  # the first, then one in a thousand
        self.roster = SiteRoster(s.devices)
        self.coalescer = Coalescer(s.coalesce_ms / 1000, self.roster.expected, self._send,
                                   max_groups=self.roster.max_pulls)
        self.up = MqttClient(
            s.broker, f"ddnn-{s.deployment}-{s.gateway_id}",
            MqttOptions(keepalive=s.keepalive, reconnect_max=s.reconnect_max,
                        connect_timeout=s.connect_timeout, security=s.security,
                        subscriptions=[subscription(t.requests(s.edge_id), "requests"),
                                       subscription(t.edge_status(s.edge_id), "status"),
                                       subscription(t.bundle, "bundle")]),
            status_topic=t.gateway(s.gateway_id, "status"),
            status_info={"gateway": s.gateway_id, "devices": {}},
            on_message=self._from_edge, on_published=lambda mid: self._acks.put((mid, True)),
            on_publish_refused=lambda mid: self._acks.put((mid, False)))
        self.local = MqttClient(
            s.local, f"ddnn-{s.deployment}-{s.gateway_id}-local",
            MqttOptions(keepalive=s.keepalive, reconnect_max=s.reconnect_max, persistent=True,
                        security=s.local_security, connect_timeout=s.connect_timeout,
                        subscriptions=[subscription(t.all_devices(k), k) for k in DEVICE_KINDS
                                       if k != "results" or s.forward_results]),
            on_message=self._from_device)
        self.metrics = GatewayMetrics()
        self.http: MonitorServer | None = None  # /metrics, /healthz, /livez (--http-port)
        self.lifecycle = self._lifecycle()

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> GatewayService:
        return cls(settings)

    # --- up: devices -> edge ------------------------------------------------------------------

    def _from_device(self, topic: str, payload: bytes) -> bool | None:
        """A local device message (local paho thread); False: acknowledged later (or, while
        stopping, by the next run of the gateway)."""
        if self._stopping:
            return False
        delivery = self.local.inbox.delivering
        parsed = self.topics.parse_device(topic)
        if parsed is None or not self.roster.forwards(parsed[0]):
            return None
        device, kind = parsed
        if kind == "results":  # a one-view device's own answer: up as it is, the edge checks it
            return self._device_result(device, payload, delivery)
        if kind == "status":
            if self.roster.status(device, payload):
                self.up.presence.update(devices=dict(self.roster.statuses))
            return None
        try:
            if len(payload) > MAX_ENTRY:  # before decoding: the cheap check first
                raise DecodeError(f"message of {len(payload)} bytes cannot go in a batch")
            frame = env.decode(payload).frame
        except DecodeError as e:
            self._count("dropped")  # the edge would drop it too: the uplink is dear
            if self._drops_log():
                log.warning("dropping a message of %s (%d so far): %s", device,
                            self.forwarded["dropped"], e)
            return None
        self.coalescer.add((kind, frame), device, payload, delivery)
        return False

    def _device_result(self, device: str, payload: bytes, delivery) -> bool | None:
        """Up on the gateway's results topic, if it is ``device``'s own: the edge trusts this
        gateway for all its devices, so which one sent it is checked here, from its topic."""
        try:
            views = Result.from_json(payload).views
        except ResultError:
            views = ()
        if views != (device,):
            self._count("dropped")
            if self._drops_log():
                log.warning("dropping a result on %s's topic that is not its own (%d dropped so "
                            "far)", device, self.forwarded["dropped"])
            return None
        self._publish(self.topics.gateway(self.settings.gateway_id, "results"), payload,
                      DELIVERY["results"].qos, [delivery])
        return False

    def _send(self, groups: list[Group]) -> None:
        """The ready groups' messages, in as few batches as the format allows."""
        entries = [e for g in groups for e in g.entries]
        complete = sum(g.complete for g in groups)
        with self._lock:
            self.forwarded["complete"] += complete
            self.forwarded["timed_out"] += len(groups) - complete
        for g in groups:
            self.roster.sent(g.key)
        for chunk in batches(entries):
            data = pack_batch((device, payload) for device, payload, _ in chunk)
            self._publish(self.topics.gateway(self.settings.gateway_id, "messages"), data,
                          DELIVERY["messages"].qos, [tag for _, _, tag in chunk])
            with self._lock:
                self.forwarded["batches"] += 1
                self.forwarded["messages"] += len(chunk)

    def _publish(self, topic: str, payload: bytes, qos: int, deliveries: list) -> None:
        with self._lock:  # the mid is registered before its PUBACK can arrive
            info = self.up.publish(topic, payload, qos)
            if self.up.queued(info):
                self._batches[info.mid] = deliveries
                return
        log.warning("the uplink refused a batch (%d messages): the devices' broker keeps them",
                    len(deliveries))

    def _acknowledge(self) -> None:
        """As the edge's broker takes batches, their messages leave the devices' broker; a
        batch it refused stays there (it comes again when the gateway reconnects)."""
        while (ack := self._acks.get()) is not None:
            mid, taken = ack
            with self._lock:
                deliveries = self._batches.pop(mid, ())
                if not taken:
                    self.forwarded["refused"] += len(deliveries)
            if taken:
                for d in deliveries:
                    self.local.inbox.ack(d)
            # A refused batch is counted above; MqttClient already warns about refused
            # publishes with the ACL hint, first and then one in a thousand.

    def _count(self, what: str) -> None:
        with self._lock:
            self.forwarded[what] += 1

    # --- down: edge -> devices ----------------------------------------------------------------

    def _from_edge(self, topic: str, payload: bytes) -> None:
        t, s = self.topics, self.settings
        if topic == t.requests(s.edge_id):
            self.roster.remember_pull(payload)
            self.local.publish(topic, payload, DELIVERY["requests"].qos)
        elif topic in (t.edge_status(s.edge_id), t.bundle):
            wire = DELIVERY["status" if topic != t.bundle else "bundle"]
            self.local.publish(topic, payload, wire.qos, retain=wire.retain)

    # --- lifecycle ----------------------------------------------------------------------------

    def _lifecycle(self) -> Lifecycle:
        """Started in this order, stopped in reverse: no more device messages are taken, what
        is held is sent, what the edge's broker took is acknowledged, then both disconnect
        (the site's broker first: the acknowledgements go out before its DISCONNECT)."""
        parts = Lifecycle()
        if self.settings.http.port is not None:  # first: a port in use fails before the rest
            parts.add("http", start=self._start_http, stop=lambda: self.http.stop(),
                      alive=lambda: self.http.alive())
        for name, client in (("mqtt-up", self.up), ("mqtt-local", self.local)):
            parts.add(name, client,
                      alive=lambda c=client: c.refused is not None or c.alive())
        parts.add("gateway-acks", Worker("gateway-acks", self._acknowledge,
                                         stop=self._last_acknowledgements, join=STOP_WAIT))
        parts.add("gateway-flush", Worker("gateway-flush", self.coalescer.run,
                                          stop=self._stop_taking, join=STOP_WAIT))
        return parts

    def _start_http(self) -> None:
        s = self.settings
        self.http = monitor(self, s.http.host, s.http.port).start()

    def _stop_taking(self) -> None:
        """Take no more device messages; the coalescer sends what it holds and ends."""
        self._stopping = True
        self.coalescer.stop()

    def _last_acknowledgements(self) -> None:
        """Wait (a while) for the edge's broker to take the last batches, then end the
        acknowledging thread: what is left comes again to the next run."""
        deadline = time.monotonic() + STOP_WAIT
        while self.up.connected.is_set() and time.monotonic() < deadline:
            with self._lock:
                if not self._batches:
                    break
            time.sleep(0.02)  # the last PUBACKs, over the uplink
        self._acks.put(None)

    def __enter__(self) -> GatewayService:
        self.lifecycle.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stop every part, in reverse order (see :meth:`_lifecycle`)."""
        self.lifecycle.stop()

